#!/usr/bin/env bash
# How cost grows with connections (docs/benchmarks.md, "How cost grows"): HAProxy and the proxy
# holding 1,000 / 10,000 / 20,000 / 30,000 long-lived connections (watches), idle, then all of
# them reconnecting at once after a backend restart (`bench storm`). Each size runs in a private
# network namespace with the whole port range (netns.sh); beyond one process's descriptor limit
# every role is spread over processes, alike for both targets. Prints the table and writes the
# plot. Needs root. About 3 minutes on 2 CPUs. 30,000 is the largest size below half of the
# ephemeral port range, past which connect() slows down (docs/benchmarks.md: 50,000 could not
# be measured here).
#
#   bench/scripts/scale.sh [OUT] [SIZES]     # defaults: target/bench/scale, "1000 10000 20000 30000"
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-target/bench/scale}
sizes=${2:-1000 10000 20000 30000}
cargo build --release -p kube-apiserver-proxy -p kube-apiserver-proxy-bench
for n in $sizes; do
  bench/scripts/netns.sh target/release/bench storm --targets haproxy,proxy --no-build \
    --connections "$n" --rounds 2 --out "$out/storm-$n"
done
python3 bench/scripts/scale_plot.py "$out" "$out/scale.svg"
