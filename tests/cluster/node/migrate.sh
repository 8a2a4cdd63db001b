# shellcheck shell=bash
# shellcheck disable=SC2154 # here, S, NODE_IP and the rest come from smoke and pivot.sh
# The migration from kubeadm's static kube-apiserver to the Deployment (issue 13 point 2),
# sourced by `smoke --migrate` after pivot.sh, whose helpers it uses, once the kubeadm-style
# control plane runs. It follows docs/operations.md, "Migrating from kubeadm":
#
#   1. the node is prepared (manifests/node/tmpfiles.d, the control-plane label and taint), and
#      `kube-apiserver-proxy kubernetes-endpoints` applied (the overlay's apiserver runs with
#      --endpoint-reconciler-type=none);
#   2. `kube-apiserver-proxy migrate --listen NODE_IP:6443 --listen 127.0.0.1:6443` starts, as
#      root: SO_REUSEPORT on kubeadm's 0.0.0.0:6443 socket, the two addresses bound beside it
#      (not listening), then it waits on the handoff directory as uid 65532;
#   3. `kubectl apply` of manifests/single-controller: `launch` starts the apiserver on another
#      port of its 127.a.b.c (6443 is held by the wildcard socket), the proxy asks its peers for
#      sockets and `migrate` hands it both addresses;
#   4. once the Deployment is ready, kubeadm's static manifest is removed;
#   5. two rollouts of the Deployment (the first one brings the apiserver back to 6443).
#
# Throughout, a prober connects to NODE_IP:6443 and 127.0.0.1:6443 in turn (each every 20 ms)
# and counts refused connections; two client-go loads run, one per address (the one on
# 127.0.0.1 with `tls-server-name: kubernetes`: the serving certificate has no 127.0.0.1); a
# watcher polls the `kubernetes` Endpoints and the Service's EndpointSlices every 250 ms:
# neither may ever be without a ready address (the overlay's none reconciler, and
# `kubernetes-endpoints` applied before step 2, whose admission policy keeps kubeadm's stopping
# lease apiserver from emptying them).

MIGRATE_LOCAL_CONF="$S/local-super-admin.conf"
MIGRATE_RESTARTS="${MIGRATE_RESTARTS:-2}"
# Then pivot.sh's rollouts: MIGRATE_MORE_RESTARTS more restarts (5 in all by default) and the
# image change (IMAGE_CHANGE=0 leaves it out).
HANDOFF_DIR=/run/kube-apiserver-proxy/handoff

# probe2_start NAME / probe2_stop NAME: TCP connects to each address in turn; per address the
# summary (connects, refused, timeouts, refusal windows) lands in $S/probe-NAME.json.
probe2_start() {
  python3 - "$S/probe-$1.json" "$NODE_IP:6443" "127.0.0.1:6443" <<'EOF' &
import json, signal, socket, sys, time
out, addrs = sys.argv[1], sys.argv[2:]
st = {a: {"attempts": 0, "ok": 0, "refused": 0, "timeouts": 0, "other": 0, "refused_windows": []} for a in addrs}
win = {a: None for a in addrs}
stop = False
def done(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, done)
while not stop:
    t0 = time.time()
    for a in addrs:
        host, port = a.rsplit(":", 1)
        s = socket.socket()
        s.settimeout(1)
        t = time.time()
        st[a]["attempts"] += 1
        try:
            s.connect((host, int(port)))
            st[a]["ok"] += 1
            if win[a]:
                st[a]["refused_windows"].append([win[a][0], win[a][1], round(win[a][1] - win[a][0], 3)])
                win[a] = None
        except ConnectionRefusedError:
            st[a]["refused"] += 1
            win[a] = [win[a][0], t] if win[a] else [t, t]
        except socket.timeout:
            st[a]["timeouts"] += 1
        except OSError as e:
            st[a]["other"] += 1
            st[a].setdefault("other_errors", []).append(str(e))
        finally:
            s.close()
    time.sleep(max(0.0, 0.02 - (time.time() - t0)))
for a in addrs:
    if win[a]:
        st[a]["refused_windows"].append([win[a][0], win[a][1], round(win[a][1] - win[a][0], 3)])
json.dump(st, open(out, "w"))
EOF
  eval "PROBE2_${1//-/_}=$!"
}

probe2_stop() { bg_stop "PROBE2_${1//-/_}"; }

# probe2_summary NAME: one clause per address; probe2_refused NAME: the refusals, all addresses.
probe2_summary() {
  python3 - "$S/probe-$1.json" <<'EOF'
import json, sys
st = json.load(open(sys.argv[1]))
parts = []
for a, s in st.items():
    w = ", ".join("%.3f s" % x[2] for x in s["refused_windows"])
    parts.append("%s: %d refused, %d timeouts, %d other errors of %d connects%s" % (
        a, s["refused"], s["timeouts"], s["other"], s["attempts"], " (refused for " + w + ")" if w else ""))
print("; ".join(parts))
EOF
}
probe2_refused() {
  python3 -c 'import json,sys; print(sum(s["refused"] + s["other"] for s in json.load(open(sys.argv[1])).values()))' "$S/probe-$1.json"
}

# epwatch_start NAME / epwatch_stop NAME: the `kubernetes` Endpoints and EndpointSlice every
# 250 ms through the API (the admin client certificate); each change of what they hold, with
# its time, lands in $S/endpoints-NAME.json.
epwatch_start() {
  python3 - "$S/endpoints-$1.json" "$NODE_IP" "$S/admin-client-certificate-data" "$S/admin-client-key-data" <<'EOF' &
import json, signal, ssl, sys, time, urllib.request
out, ip, cert, key = sys.argv[1:]
ctx = ssl.create_default_context(cafile="/etc/kubernetes/pki/ca.crt")
ctx.load_cert_chain(cert, key)
stop = False
def done(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, done)
def get(path):
    try:
        with urllib.request.urlopen("https://%s:6443%s" % (ip, path), context=ctx, timeout=2) as r:
            return json.load(r)
    except Exception as e:
        return {"error": str(e)[:120]}
def state():
    ep = get("/api/v1/namespaces/default/endpoints/kubernetes")
    sls = get("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices?labelSelector=kubernetes.io%2Fservice-name%3Dkubernetes")
    if "error" in sls:
        return "error: " + sls["error"]
    e = ep["error"] if "error" in ep else " ".join(sorted(
        "%s:%s" % (a["ip"], p["port"]) for s in ep.get("subsets") or [] for a in s.get("addresses") or [] for p in s.get("ports") or []))
    parts = []
    for sl in sorted(sls.get("items") or [], key=lambda x: x["metadata"]["name"]):
        s = sorted("%s:%s%s" % (a, p["port"], "" if (x.get("conditions") or {}).get("ready", True) else "(not ready)")
                   for x in sl.get("endpoints") or [] for a in x.get("addresses") or [] for p in sl.get("ports") or [])
        parts.append("%s [%s]" % (sl["metadata"]["name"], " ".join(s)))
    return "endpoints [%s] slices %s" % (e, "; ".join(parts) or "none")
changes, last = [], None
while not stop:
    t = time.time()
    s = state()
    if s != last:
        changes.append([t, s])
        last = s
    time.sleep(max(0.0, 0.25 - (time.time() - t)))
changes.append([time.time(), "end"])
json.dump(changes, open(out, "w"))
EOF
  eval "EPWATCH_${1//-/_}=$!"
}

epwatch_stop() { bg_stop "EPWATCH_${1//-/_}"; }

# epwatch_summary NAME T0_MS: each state with its start, in seconds after T0_MS, and how long
# it lasted.
epwatch_summary() {
  python3 - "$S/endpoints-$1.json" "$2" <<'EOF'
import json, sys
ch, t0 = json.load(open(sys.argv[1])), int(sys.argv[2]) / 1000.0
out = []
for (t, s), (t2, _) in zip(ch, ch[1:]):
    out.append("%+.1f s %s for %.1f s" % (t - t0, s, t2 - t))
print(" | ".join(out))
EOF
}

# epwatch_gaps NAME: how many observed states had no ready address in any slice of the
# Service (what kube-proxy and CoreDNS read) and their total time in seconds, then the same for
# the v1 Endpoints.
epwatch_gaps() {
  python3 - "$S/endpoints-$1.json" <<'EOF'
import json, re, sys
ch = json.load(open(sys.argv[1]))
slices_empty = ep_empty = 0.0
n = n_ep = 0
for (t, s), (t2, _) in zip(ch, ch[1:]):
    if s.startswith("error"):
        continue
    ready = [a for a in re.findall(r"\[([^\]]*)\]", s.split(" slices ", 1)[1]) if a.strip() and "(not ready)" not in a]
    if not ready:
        slices_empty += t2 - t
        n += 1
    # No address (empty, or the GET failed, e.g. 404) in the v1 Endpoints.
    if not re.match(r"\d", s.split(" slices ", 1)[0][len("endpoints ["):]):
        ep_empty += t2 - t
        n_ep += 1
print("%d %.1f %d %.1f" % (n, slices_empty, n_ep, ep_empty))
EOF
}

# epwatch_check NAME WHAT: neither the Service's slices nor its v1 Endpoints may ever be
# without a ready address.
epwatch_check() {
  local n slices n_ep ep
  read -r n slices n_ep ep < <(epwatch_gaps "$1")
  if [ "$n" = 0 ] && [ "$n_ep" = 0 ]; then
    pass "default/kubernetes during $2: neither the Service's EndpointSlices nor its v1 Endpoints ever without a ready address"
  else
    fail "default/kubernetes during $2: the Service's EndpointSlices without a ready address $n times ($slices s in all), its v1 Endpoints $n_ep times ($ep s)"
  fi
}

# endpoints_apply: default/kubernetes as docs/operations.md says for the single controller
# (--endpoint-reconciler-type=none): `kubernetes-endpoints` through `kubectl apply`.
endpoints_apply() {
  "$S/bins/kube-apiserver-proxy" kubernetes-endpoints --address "$NODE_IP" | kc apply -f - >>"$S/endpoints-apply.log" 2>&1
}

# loadgen_with NAME KUBECONFIG: pivot.sh's loadgen_start with another kubeconfig.
loadgen_with() {
  rm -f "$S/load-$1.ready"
  "$S/bins/loadgen" -kubeconfig "$2" -out "$S/load-$1.json" -ready "$S/load-$1.ready" \
    >"$S/load-$1.log" 2>&1 &
  eval "LOADGEN_${1//-/_}=$!"
  if wait_for 180 test -f "$S/load-$1.ready"; then
    return 0
  fi
  fail "client-go load ($1) did not start within 180 s: $(tail -n 3 "$S/load-$1.log")"
  return 1
}
loadgen_with_stop() { loadgen_stop "${1//-/_}"; }

# The super-admin kubeconfig pointed at 127.0.0.1:6443 (as kubeadm's kubeconfigs may be), with
# the server name the serving certificate has.
migrate_local_kubeconfig() {
  sed -e "s#^\( *\)server: https://$NODE_IP:6443#\1server: https://127.0.0.1:6443\n\1tls-server-name: kubernetes#" \
    "$PIVOT_ADMIN" >"$MIGRATE_LOCAL_CONF"
  if grep -q 'server: https://127.0.0.1:6443' "$MIGRATE_LOCAL_CONF" \
    && "$S/bins/kubectl" --kubeconfig "$MIGRATE_LOCAL_CONF" --request-timeout=10s get --raw /readyz >/dev/null 2>&1; then
    pass "a kubeconfig on https://127.0.0.1:6443 (tls-server-name: kubernetes) reaches kubeadm's apiserver"
  else
    fail "the kubeconfig on 127.0.0.1:6443 does not work: $(grep -n 'server' "$MIGRATE_LOCAL_CONF")"
    return 1
  fi
}

# listeners_6443: the TCP listeners on port 6443 (address and process).
listeners_6443() {
  ss -Hltnp 'sport = :6443' 2>/dev/null | awk '{ print $4, $6 }' | sed 's/users:((//; s/,fd=[0-9]*))//' | tr '\n' ';'
}

# launch_lines: what `launch` said in each Deployment pod's apiserver container.
launch_lines() {
  local p
  for p in $(kcs get pods -l component=kube-apiserver,pod-template-hash -o name 2>/dev/null); do
    printf '%s: %s; ' "${p#pod/}" "$(kcs logs "$p" -c kube-apiserver 2>/dev/null | grep '^launch:' | tr '\n' ' ')"
  done
}

# wildcard_gone: no listener on *:6443, 0.0.0.0:6443 or [::]:6443.
wildcard_gone() { ! listeners_6443 | tr ';' '\n' | grep -qE '^(\*|0\.0\.0\.0|\[::\]):6443 '; }

migrate_exited() { ! kill -0 "$MIGRATE_PID" 2>/dev/null; }

migrate_static_step() { mv "$MANIFESTS/kube-apiserver.yaml" "$S/kube-apiserver.static.yaml"; }

migrate() {
  local t0 t1 t2 rc
  note "restarts before the migration: $(control_plane_restarts)"
  note "listeners on port 6443 before: $(listeners_6443)"
  log_mark migrate
  probe2_start migrate
  loadgen_with migrate "$PIVOT_ADMIN" || true
  loadgen_with migrate-local "$MIGRATE_LOCAL_CONF" || true
  t0="$(now_ms)"
  epwatch_start migrate

  # The kubernetes Service's endpoints for the overlay's none reconciler (docs/operations.md).
  if endpoints_apply; then
    pass "kubernetes-endpoints --address $NODE_IP | kubectl apply -f -: $(tail -n 3 "$S/endpoints-apply.log" | tr '\n' ' ')"
  else
    fail "applying kubernetes-endpoints failed: $(tail -n 3 "$S/endpoints-apply.log")"
  fi

  # Step 1: as root on the node (docs/operations.md).
  "$S/bins/kube-apiserver-proxy" migrate --listen "$NODE_IP:6443" --listen 127.0.0.1:6443 \
    --handoff-dir "$HANDOFF_DIR" --timeout 600s >"$S/migrate.log" 2>&1 &
  MIGRATE_PID=$!
  if wait_for 30 grep -q 'waiting for a proxy' "$S/migrate.log"; then
    pass "kube-apiserver-proxy migrate waits for the proxy after $(since "$t0") s: $(sed 's/^[^ ]* *INFO [^ ]* //' "$S/migrate.log" | head -n 3 | tr '\n' ' ' | cut -c1-500)"
  else
    fail "kube-apiserver-proxy migrate did not get ready: $(tail -n 5 "$S/migrate.log")"
    probe2_stop migrate
    epwatch_stop migrate
    loadgen_with_stop migrate
    loadgen_with_stop migrate-local
    return 1
  fi
  note "listeners on port 6443 with migrate waiting: $(listeners_6443)"

  # Step 2: the Deployment.
  t1="$(now_ms)"
  if ! kc apply -f "$S/deployment.yaml" >"$S/apply.log" 2>&1; then
    fail "kubectl apply of the rendered Deployment failed: $(cat "$S/apply.log")"
    return 1
  fi
  if wait_for 420 migrate_exited; then
    rc=0
    wait "$MIGRATE_PID" || rc=$?
    if [ "$rc" = 0 ]; then
      pass "migrate handed the sockets over $(since "$t1") s after kubectl apply (exit 0): $(grep 'handed to the proxy' "$S/migrate.log" | cut -c1-300)"
    else
      fail "migrate exited $rc: $(tail -n 3 "$S/migrate.log")"
    fi
  else
    fail "migrate still waiting 420 s after kubectl apply: $(tail -n 3 "$S/migrate.log"); pods: $(deploy_pods | tr '\n' ' ')"
    pod_diagnostics
  fi
  if wait_for 300 deploy_ready; then
    pass "the Deployment is ready beside kubeadm's static apiserver $(since "$t1") s after kubectl apply: $(deploy_pods | tr '\n' ' ')"
  else
    fail "the Deployment is not ready 300 s after kubectl apply: $(deploy_pods | tr '\n' ' ')"
    pod_diagnostics
  fi
  note "launch: $(launch_lines)"
  note "listeners on port 6443 with both apiservers: $(listeners_6443)"

  # Step 3: kubeadm's static apiserver goes (its manifest moved away; kubeadm-upgrade.sh
  # redefines migrate_static_step with the runbook's other form).
  t2="$(now_ms)"
  migrate_static_step
  # kubeadm's apiserver (lease reconciler) tries to empty the Endpoints at its SIGTERM: the
  # admission policy of `kubernetes-endpoints` denies it (docs/operations.md). Nothing to do.
  # The kubelet's pod list is not enough: what counts is that the apiserver closed its
  # wildcard socket (it does at once, with kubeadm's flags; the process may drain on).
  if wait_for 90 wildcard_gone; then
    pass "kubeadm's wildcard socket closed $(since "$t2") s after its manifest was removed ($(since "$t0") s after migrate started)"
  else
    fail "kubeadm's wildcard socket still listens 90 s after its manifest was removed: $(listeners_6443)"
  fi
  note "listeners on port 6443 after: $(listeners_6443)"
  # Let the loads see some seconds of the Deployment alone.
  wait_for 15 false || true
  probe2_stop migrate
  epwatch_stop migrate
  loadgen_with_stop migrate
  loadgen_with_stop migrate-local
  if [ "$(probe2_refused migrate)" = 0 ]; then
    pass "no refused connection during the migration: $(probe2_summary migrate)"
  else
    fail "refused connections during the migration: $(probe2_summary migrate)"
  fi
  local l
  for l in migrate migrate-local; do
    if [ "$(load_failed "$l")" = 0 ]; then
      pass "client-go load ($l) during the migration: $(load_summary "$l")"
    else
      fail "client-go load ($l) during the migration: $(load_summary "$l")"
    fi
  done
  note "the kubernetes Endpoints/EndpointSlices during the migration (seconds after migrate started; the static manifest went at +$(((t2 - t0) / 1000)) s): $(epwatch_summary migrate "$t0")"
  epwatch_check migrate "the migration"
  note "restarts after the migration: $(control_plane_restarts)"
  note "controller-manager, scheduler and kubelet logs during the migration: $(log_error_summary migrate)"
}

migrate_rollouts() {
  local i t0
  log_mark rollouts
  probe2_start rollouts
  loadgen_with rollouts "$PIVOT_ADMIN" || return 1
  loadgen_with rollouts-local "$MIGRATE_LOCAL_CONF" || return 1
  t0="$(now_ms)"
  epwatch_start rollouts
  for i in $(seq 1 "$MIGRATE_RESTARTS"); do
    rollout "rollout restart $i/$MIGRATE_RESTARTS after the migration" kcs rollout restart deployment/kube-apiserver
    note "launch: $(launch_lines)"
  done
  probe2_stop rollouts
  epwatch_stop rollouts
  loadgen_with_stop rollouts
  loadgen_with_stop rollouts-local
  if launch_lines | grep -q ':6443 *;'; then
    pass "the apiserver is back on port 6443 of its 127.a.b.c: $(launch_lines)"
  else
    fail "the apiserver is not on port 6443 after the rollouts: $(launch_lines)"
  fi
  if [ "$(probe2_refused rollouts)" = 0 ]; then
    pass "no refused connection during the rollouts after the migration: $(probe2_summary rollouts)"
  else
    fail "refused connections during the rollouts after the migration: $(probe2_summary rollouts)"
  fi
  local l
  for l in rollouts rollouts-local; do
    if [ "$(load_failed "$l")" = 0 ]; then
      pass "client-go load ($l) during the rollouts: $(load_summary "$l")"
    else
      fail "client-go load ($l) during the rollouts: $(load_summary "$l")"
    fi
  done
  note "the kubernetes Endpoints/EndpointSlices during the rollouts: $(epwatch_summary rollouts "$t0")"
  epwatch_check rollouts "the rollouts"
  note "listeners on port 6443 after the rollouts: $(listeners_6443)"
  note "restarts after the rollouts: $(control_plane_restarts)"
  note "controller-manager, scheduler and kubelet logs during the rollouts: $(log_error_summary rollouts)"
}

run_migrate() {
  pivot_prepare_node || return 0
  pivot_render || return 0
  migrate_local_kubeconfig || return 0
  migrate || return 0
  migrate_rollouts || true
  # Then the rollouts of pivot.sh by the real controllers (issue 12 point 3): more rollout
  # restarts (5 in all with the ones above) and the image change v1.36 -> v1.37 and back.
  # shellcheck disable=SC2034 # read by rollouts() in pivot.sh
  ROLLOUT_RESTARTS="${MIGRATE_MORE_RESTARTS:-$((MIGRATE_RESTARTS < 5 ? 5 - MIGRATE_RESTARTS : 0))}"
  rollouts || true
  note "reports: $S/load-*.json, $S/probe-*.json, $S/endpoints-*.json, $S/migrate.log"
}
