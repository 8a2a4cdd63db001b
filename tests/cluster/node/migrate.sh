# shellcheck shell=bash
# shellcheck disable=SC2154 # here, S, NODE_IP and the rest come from smoke and pivot.sh
# The migration from kubeadm's static kube-apiserver to the Deployment,
# sourced by `smoke --migrate` after pivot.sh, whose helpers it uses, once the kubeadm-style
# control plane runs. It follows docs/runbooks/migrate-from-kubeadm.md:
#
#   1. the node is prepared (manifests/node/tmpfiles.d, the control-plane label and taint), and
#      `kube-apiserver-proxy kubernetes-endpoints` applied (the overlay's apiserver runs with
#      --endpoint-reconciler-type=none);
#   2. `kube-apiserver-proxy migrate --listen NODE_IP:6443 --listen 127.0.0.1:6443` starts, as
#      root: SO_REUSEPORT on kubeadm's 0.0.0.0:6443 socket, the two addresses bound beside it
#      (not listening), then it waits on the handoff directory as uid 59443;
#   3. `kubectl apply` of manifests/single-controller: `launch` starts the apiserver on another
#      port of its 127.a.b.c (6443 is held by the wildcard socket), the proxy asks its peers for
#      sockets and `migrate` hands it both addresses;
#   4. once the Deployment is ready, kubeadm's static manifest is removed;
#   5. two rollouts of the Deployment (the first one brings the apiserver back to 6443).
#
# Throughout, cmd/loadgen (pivot.sh's step_start) judges each step: a prober connects to
# NODE_IP:6443 and 127.0.0.1:6443 in turn (each every 20 ms), and every refused, timed-out or
# failed connect is a failure; two client-go loads run, one per address (the one on 127.0.0.1
# with `tls-server-name: kubernetes`: the serving certificate has no 127.0.0.1), each held to
# the tier's strict criteria; a watcher follows the `kubernetes` Endpoints and the Service's
# EndpointSlices: neither may ever be without a ready address (the overlay's none reconciler,
# and `kubernetes-endpoints` applied before step 2, whose admission policy keeps kubeadm's
# stopping lease apiserver from emptying them); the controller-manager and the scheduler must
# not restart.

MIGRATE_LOCAL_CONF="$S/local-super-admin.conf"
MIGRATE_RESTARTS="${MIGRATE_RESTARTS:-2}"
# Then pivot.sh's rollouts: MIGRATE_MORE_RESTARTS more restarts (5 in all by default) and the
# image change (IMAGE_CHANGE=0 leaves it out).
HANDOFF_DIR=/run/kube-apiserver-proxy/handoff

# endpoints_apply: default/kubernetes as docs/operations.md says for the single controller
# (--endpoint-reconciler-type=none): `kubernetes-endpoints` through `kubectl apply`.
endpoints_apply() {
  "$S/bins/kube-apiserver-proxy" kubernetes-endpoints --address "$NODE_IP" | kc apply -f - >>"$S/endpoints-apply.log" 2>&1
}

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
  step_start migrate -probe 127.0.0.1:6443 -watch-endpoints || true
  step_start migrate-local -kubeconfig "$MIGRATE_LOCAL_CONF" || true
  t0="$(now_ms)"

  # The kubernetes Service's endpoints for the overlay's none reconciler (docs/operations.md).
  if endpoints_apply; then
    pass "kubernetes-endpoints --address $NODE_IP | kubectl apply -f -: $(tail -n 3 "$S/endpoints-apply.log" | tr '\n' ' ')"
  else
    fail "applying kubernetes-endpoints failed: $(tail -n 3 "$S/endpoints-apply.log")"
  fi

  # An address in use that the proxy would not take (127.0.0.1, which the local load uses):
  # migrate refuses before it touches anything.
  local rc=0
  "$S/bins/kube-apiserver-proxy" migrate --listen "$NODE_IP:6443" --handoff-dir "$HANDOFF_DIR" \
    --timeout 10s >"$S/migrate-refused.log" 2>&1 || rc=$?
  if [ "$rc" = 2 ] && tail -n 1 "$S/migrate-refused.log" | grep -q "127.0.0.1:6443 ([0-9]* established connection" \
    && ! tail -n 1 "$S/migrate-refused.log" | grep -q "$NODE_IP:6443 ("; then
    pass "migrate without 127.0.0.1 refuses (exit 2, nothing touched): $(tail -n 1 "$S/migrate-refused.log" | cut -c1-300)"
  else
    fail "migrate --listen $NODE_IP:6443 alone: exit $rc: $(tail -n 2 "$S/migrate-refused.log")"
  fi

  # Step 1: as root on the node (docs/runbooks/migrate-from-kubeadm.md).
  "$S/bins/kube-apiserver-proxy" migrate --listen "$NODE_IP:6443" --listen 127.0.0.1:6443 \
    --handoff-dir "$HANDOFF_DIR" --timeout 600s >"$S/migrate.log" 2>&1 &
  MIGRATE_PID=$!
  if wait_for 30 grep -q 'waiting for a proxy' "$S/migrate.log"; then
    pass "kube-apiserver-proxy migrate waits for the proxy after $(since "$t0") s: $(sed 's/^[^ ]* *INFO [^ ]* //' "$S/migrate.log" | head -n 3 | tr '\n' ' ' | cut -c1-500)"
  else
    fail "kube-apiserver-proxy migrate did not get ready: $(tail -n 5 "$S/migrate.log")"
    step_end migrate "the migration (NODE_IP:6443)"
    step_end migrate-local "the migration (127.0.0.1:6443)"
    return 1
  fi
  note "listeners on port 6443 with migrate waiting: $(listeners_6443)"
  note "clients of port 6443 now, by address and process: $(ss -Htnp state established '( dport = :6443 )' 2>/dev/null | awk '{ split($NF, p, "\""); print $4, p[2] }' | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
  note "addresses in use that migrate found: $(grep -o 'address in use.*' "$S/migrate.log" | cut -c1-200 | tr '\n' ';')$(grep -o 'could not look everywhere.*' "$S/migrate.log" | cut -c1-200 | tr '\n' ';')"

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
  step_end migrate "the migration: client-go load on NODE_IP:6443, connects to both addresses, default/kubernetes, no controller restart (the static manifest went at +$(((t2 - t0) / 1000)) s)"
  step_end migrate-local "the migration: client-go load on 127.0.0.1:6443"
  note "restarts after the migration: $(control_plane_restarts)"
  note "controller-manager, scheduler and kubelet logs during the migration: $(log_error_summary migrate)"
}

migrate_rollouts() {
  local i
  log_mark migrate-rollouts
  step_start migrate-rollouts -probe 127.0.0.1:6443 -watch-endpoints || return 1
  step_start migrate-rollouts-local -kubeconfig "$MIGRATE_LOCAL_CONF" || return 1
  local done=0
  for i in $(seq 1 "$MIGRATE_RESTARTS"); do
    rollout "rollout restart $i/$MIGRATE_RESTARTS after the migration" kcs rollout restart deployment/kube-apiserver && done=$((done + 1))
    note "launch: $(launch_lines)"
  done
  step_end migrate-rollouts "the rollouts after the migration: client-go load on NODE_IP:6443, connects to both addresses, default/kubernetes, no controller restart"
  step_end migrate-rollouts-local "the rollouts after the migration: client-go load on 127.0.0.1:6443"
  if [ "$done" = "$MIGRATE_RESTARTS" ]; then
    pass "$done of $MIGRATE_RESTARTS rollouts after the migration completed"
  else
    fail "only $done of $MIGRATE_RESTARTS rollouts after the migration completed"
  fi
  if launch_lines | grep -q ':6443 *;'; then
    pass "the apiserver is back on port 6443 of its 127.a.b.c: $(launch_lines)"
  else
    fail "the apiserver is not on port 6443 after the rollouts: $(launch_lines)"
  fi
  note "listeners on port 6443 after the rollouts: $(listeners_6443)"
  note "restarts after the rollouts: $(control_plane_restarts)"
  note "controller-manager, scheduler and kubelet logs during the rollouts: $(log_error_summary migrate-rollouts)"
}

run_migrate() {
  pivot_prepare_node || return 0
  pivot_render || return 0
  migrate_local_kubeconfig || return 0
  migrate || return 0
  migrate_rollouts || true
  # Then the rollouts of pivot.sh by the real controllers: more rollout
  # restarts (5 in all with the ones above) and the image change v1.36 -> v1.37 and back.
  # shellcheck disable=SC2034 # read by rollouts() in pivot.sh
  ROLLOUT_RESTARTS="${MIGRATE_MORE_RESTARTS:-$((MIGRATE_RESTARTS < 5 ? 5 - MIGRATE_RESTARTS : 0))}"
  rollouts || true
  note "reports: $S/step-*.json, $S/migrate.log"
}
