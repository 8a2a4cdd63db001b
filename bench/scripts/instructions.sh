#!/usr/bin/env bash
# User-space instructions the proxy executes per forwarded request, counted by callgrind: a
# before/after figure for a busy shared machine, where wall-clock rates are noise. The counts
# still depend on how many events a wake-up finds: compare builds measured back to back.
#
#   bench/scripts/instructions.sh PROXY_BIN LABEL SCENARIO [bench options...]
#   bench/scripts/instructions.sh target/release/kube-apiserver-proxy new rr --connections 50
#   SIZE=16 bench/scripts/instructions.sh target/release/kube-apiserver-proxy new churn
#
# Runs `bench SCENARIO --targets proxy` with the proxy under `valgrind --tool=callgrind`,
# zeroes the counts WARM seconds after the start (default 3), dumps them MEASURE seconds later
# (default 5), and divides the instructions by the requests forwarded meanwhile: the proxy's
# client-to-backend byte counter (from /metrics) over SIZE, the request size (rr: 64, the
# default; churn: 16). Needs valgrind and curl; the release `bench` binary must be built.
set -euo pipefail
BIN=$(realpath "$1"); LABEL=$2; shift 2
SIZE=${SIZE:-64}; WARM=${WARM:-3}; MEASURE=${MEASURE:-5}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
D=$(mktemp -d "/tmp/instructions-$LABEL.XXXX")
cat > "$D/wrap.sh" <<W
#!/bin/sh
exec valgrind --tool=callgrind --callgrind-out-file=$D/cg.%p --dump-instr=no $BIN "\$@"
W
chmod +x "$D/wrap.sh"
"$ROOT/target/release/bench" "$@" --targets proxy --proxy-bin "$D/wrap.sh" --no-build \
  --rounds 1 --duration $((WARM + MEASURE + 4))s --warmup 1s --out "$D/out" > "$D/bench.out" 2>&1 &
bench=$!
for _ in $(seq 300); do [ -s "$D/out/logs/proxy-1.admin" ] && break; sleep 0.2; done
admin=$(cat "$D/out/logs/proxy-1.admin")
bytes() { curl -s "http://$admin/metrics" | awk '/bytes_total\{direction="client_to_backend"\}/ {print $2}'; }
sleep "$WARM"
b0=$(bytes); callgrind_control -z >/dev/null
sleep "$MEASURE"
callgrind_control -d >/dev/null; b1=$(bytes)
wait "$bench" || true
dump=$(ls -S "$D"/cg.*.1 | head -1)
ir=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
requests=$(( (b1 - b0) / SIZE ))
echo "$LABEL: $ir instructions, $requests requests, $(( ir / requests )) per request (profile: $dump)"
