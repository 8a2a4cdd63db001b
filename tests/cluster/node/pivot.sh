# shellcheck shell=bash
# shellcheck disable=SC2154 # here, S, CTR and the rest come from smoke, which sources this
# The pivot from kubeadm's static apiserver to the Deployment, sourced by `smoke --pivot` inside its namespaces once the
# kubeadm-style control plane runs (etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler as static pods, the node registered):
#
#   1. the node is prepared as docs/operations.md says (manifests/node/tmpfiles.d, the
#      control-plane label and taint from `kubeadm init phase mark-control-plane`);
#   2. manifests/single-controller is rendered with `kubectl kustomize`, through an overlay
#      whose only content is a kustomize `images:` entry per image (the local ones);
#   3. the pivot in the order docs/operations.md gives: apply the Deployment, wait until it
#      runs, then remove kubeadm's static kube-apiserver manifest; when the Deployment does
#      not become ready beside the static apiserver, the manifest is removed anyway and the
#      pivot completes the only way left, with the outage measured;
#   4. rollouts by the real controllers under the client-go load (cmd/loadgen);
#   5. a broken rollout, which must stall with the old pod serving, and `kubectl rollout undo`.
#
# A TCP connect loop on NODE_IP:6443 (every 20 ms) runs through every step and counts
# refused connections; every step is timed. Uses from smoke: S, CTR, NODE_IP, NODE_NAME,
# IMAGE_REPO, MANIFESTS, pass, fail, note, wait_for, now_ms, since, api.

PIVOT_ADMIN=/etc/kubernetes/super-admin.conf
PROXY_IMAGE="$IMAGE_REPO/kube-apiserver-proxy:dev"
ROLLOUT_RESTARTS="${ROLLOUT_RESTARTS:-5}"
OLD_APISERVER_VERSION="${OLD_APISERVER_VERSION:-v1.36.3}"

kc() { "$S/bins/kubectl" --kubeconfig "$PIVOT_ADMIN" --request-timeout=10s "$@"; }
kcs() { kc -n kube-system "$@"; }

# STEP_WATCH: what every step watches besides the client-go load: connects to NODE_IP:6443
# every 20 ms, and the controller-manager and the scheduler, which must not restart.
STEP_WATCH=(-probe "$NODE_IP:6443" -watch-restarts "kube-system/component in (kube-controller-manager,kube-scheduler)")

# step_start NAME [LOADGEN FLAGS...]: cmd/loadgen around one step: the client-go load on
# NODE_IP:6443 as the super-admin, and STEP_WATCH, and what the flags add (a flag given again
# replaces, e.g. -kubeconfig). The report lands in $S/step-NAME.json, a fresh file.
step_start() {
  local name="$1" var="STEP_${1//-/_}"
  shift
  rm -f "$S/step-$name.json" "$S/step-$name.ready" "$S/step-$name.log"
  "$S/bins/loadgen" -kubeconfig "$PIVOT_ADMIN" -out "$S/step-$name.json" -ready "$S/step-$name.ready" \
    "${STEP_WATCH[@]}" "$@" >"$S/step-$name.log" 2>&1 &
  eval "$var=$!"
  if wait_for 180 test -f "$S/step-$name.ready"; then
    return 0
  fi
  fail "$name: the load and its observers did not start within 180 s: $(tail -n 3 "$S/step-$name.log" | tr '\n' ' ')"
  return 1
}

# step_summary NAME: what loadgen printed of the step, one clause per observer.
step_summary() {
  grep '^loadgen: ' "$S/step-$1.log" | grep -v '^loadgen: PROBLEM: ' | sed 's/^loadgen: //' | tr '\n' '|' | sed 's/|$//; s/|/ | /g'
}

# step_end NAME WHAT: stop the step's loadgen; pass when it judged the step lossless (its exit
# status; a report must have been written), fail with every problem it found otherwise.
step_end() {
  local name="$1" what="$2" var="STEP_${1//-/_}" rc=0
  kill -TERM "${!var}" 2>/dev/null || true
  # The load gives its last requests 15 s to be answered.
  if ! wait_for 90 eval "! kill -0 ${!var} 2>/dev/null"; then
    kill -KILL "${!var}" 2>/dev/null || true
    fail "$what: loadgen did not stop within 90 s of SIGTERM"
  fi
  wait "${!var}" 2>/dev/null || rc=$?
  if [ "$rc" = 0 ] && [ -s "$S/step-$name.json" ]; then
    pass "$what: $(step_summary "$name")"
  else
    fail "$what: loadgen exit $rc: $(grep '^loadgen: PROBLEM: ' "$S/step-$name.log" | sed 's/^loadgen: PROBLEM: //' | head -n 12 | tr '\n' ';') -- $(step_summary "$name") $(grep -v '^loadgen: ' "$S/step-$name.log" | tail -n 3 | tr '\n' ' ')"
  fi
}

# step_refused NAME: the refused connects of the step's probers, all addresses together.
step_refused() {
  "$NODECHECK" refused "$S/step-$1.json"
}

# log_mark NAME: remember how long each control-plane log is; log_errors NAME: the klog
# error lines (E....) the controller-manager, the scheduler and the kubelet wrote since.
log_files() {
  local f
  for f in "$S"/pod-logs/kube-system_kube-controller-manager-*/*/*.log \
    "$S"/pod-logs/kube-system_kube-scheduler-*/*/*.log "$S/kubelet.log"; do
    [ -f "$f" ] && echo "$f"
  done
}
log_mark() {
  local f
  : >"$S/logmark-$1"
  while read -r f; do echo "$f $(wc -l <"$f")" >>"$S/logmark-$1"; done < <(log_files)
}
log_errors() {
  local f n label
  while read -r f; do
    n="$(awk -v f="$f" '$1 == f { print $2 }' "$S/logmark-$1")"
    case "$f" in
      */kubelet.log) label=kubelet ;;
      *) label="$(basename "$(dirname "$(dirname "$f")")" | sed -E 's/^kube-system_//; s/-'"$NODE_NAME"'_[0-9a-f]+$//')" ;;
    esac
    tail -n +"$((${n:-0} + 1))" "$f" | grep -E '(^| )E[0-9]{4} ' | sed "s|^|$label: |" || true
  done < <(log_files)
}
# log_error_summary NAME: how many error lines, how many of them about reaching the
# apiserver, and the kinds (numbers and pod hashes blanked) with their counts.
log_error_summary() {
  local errs conn
  errs="$(log_errors "$1")"
  if [ -z "$errs" ]; then
    echo "no error lines"
    return 0
  fi
  conn="$(grep -cE 'connection refused|connection reset|EOF|http2|GOAWAY|i/o timeout|deadline exceeded|Too Many Requests|unable to handle the request|broken pipe|dial tcp|TLS handshake|no route' <<<"$errs" || true)"
  echo "$(wc -l <<<"$errs") error lines, $conn of them about reaching the apiserver; by kind:"
  sed -E 's/^([^:]*): (.* )?E[0-9]{4} [0-9:.]+ +[0-9]+ /\1: /; s/kube-apiserver-[0-9a-z]{8,10}(-[0-9a-z]{5})?/kube-apiserver-X/g; s/[0-9]{3,}/N/g; s/(task|containerID=)[^ ]*/\1 X/g' <<<"$errs" \
    | cut -c1-230 | sort | uniq -c | sort -rn | head -n 12 | sed 's/^/#   /'
}

# deploy_ready: what `kubectl rollout status` checks, through the API.
deploy_ready() {
  api /apis/apps/v1/namespaces/kube-system/deployments/kube-apiserver 2>/dev/null | "$NODECHECK" rollout-done
}

# deploy_pods: "name phase ready restarts" of the Deployment's pods (mirror pods excluded).
deploy_pods() {
  kcs get pods -l component=kube-apiserver,pod-template-hash \
    -o custom-columns=NAME:.metadata.name,PHASE:.status.phase,READY:.status.containerStatuses[*].ready,RESTARTS:.status.containerStatuses[*].restartCount,WAITING:.status.containerStatuses[*].state.waiting.reason --no-headers 2>&1
}

# pod_diagnostics: events, container states and the last log lines of the Deployment's pods.
pod_diagnostics() {
  local p c
  for p in $(kcs get pods -l component=kube-apiserver,pod-template-hash -o name 2>/dev/null); do
    note "$p:"
    kcs get "$p" -o jsonpath='{range .status.initContainerStatuses[*]}{.name}{" "}{.state}{"\n"}{end}{range .status.containerStatuses[*]}{.name}{" ready="}{.ready}{" restarts="}{.restartCount}{" "}{.state}{" last="}{.lastState}{"\n"}{end}' 2>&1 | sed 's/^/#     /'
    for c in kube-apiserver proxy; do
      note "  $c log (last 6 lines):"
      kcs logs "$p" -c "$c" --tail=6 2>&1 | cut -c1-400 | sed 's/^/#     /'
      kcs logs "$p" -c "$c" --previous --tail=4 2>/dev/null | cut -c1-400 | sed 's/^/#     previous: /'
    done
  done
  note "events:"
  kcs get events --sort-by=.lastTimestamp 2>&1 | grep -i 'kube-apiserver-[0-9a-f]\{5,\}' | tail -n 12 | cut -c1-300 | sed 's/^/#     /'
}

pivot_prepare_node() {
  # manifests/node/tmpfiles.d, as `systemd-tmpfiles --create` would (no systemd here): the
  # "d" lines, with their mode and owner.
  local conf="$here/../../../manifests/node/tmpfiles.d/kube-apiserver-proxy.conf" typ path mode uid gid
  while read -r typ path mode uid gid _; do
    [ "$typ" = d ] || continue
    mkdir -p "$path" && chmod "$mode" "$path" && chown "$uid:$gid" "$path" || return 1
  done < <(grep -v '^#' "$conf")
  pass "node prepared from manifests/node/tmpfiles.d: $(stat -c '%n %a %u:%g' /run/kube-apiserver-proxy /run/kube-apiserver-proxy/* | tr '\n' ' ')"
  if "$S/bins/kubeadm" init phase mark-control-plane --config "$S/kubeadm.yaml" >>"$S/kubeadm.log" 2>&1; then
    pass "kubeadm init phase mark-control-plane: node labelled node-role.kubernetes.io/control-plane and tainted"
  else
    fail "kubeadm init phase mark-control-plane failed: $(tail -n 3 "$S/kubeadm.log")"
    return 1
  fi
}

# pivot_render: manifests/single-controller through `kubectl kustomize`, the only change an
# `images:` entry per image; checked against the plain rendering (only image lines differ).
pivot_render() {
  local src="$here/../../../manifests" k="$S/kustomize"
  mkdir -p "$k/local"
  cp -r "$src" "$k/manifests"
  cat >"$k/local/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../manifests/single-controller
images:
  - name: ghcr.io/example/kube-apiserver-proxy
    newName: ${PROXY_IMAGE%:*}
    newTag: ${PROXY_IMAGE##*:}
  - name: registry.k8s.io/kube-apiserver
    newName: $IMAGE_REPO/kube-apiserver
    newTag: $APISERVER_VERSION
EOF
  if ! kc kustomize "$k/local" >"$S/deployment.yaml" 2>"$S/kustomize.err" \
    || ! kc kustomize "$k/manifests/single-controller" >"$S/deployment-shipped.yaml" 2>>"$S/kustomize.err"; then
    fail "kubectl kustomize failed: $(head -c 300 "$S/kustomize.err")"
    return 1
  fi
  local changed
  changed="$(diff "$S/deployment-shipped.yaml" "$S/deployment.yaml" | grep '^[<>]' | grep -vc 'image: ' || true)"
  if [ "$changed" = 0 ]; then
    pass "manifests/single-controller rendered with kubectl kustomize; only the image lines differ: $(diff "$S/deployment-shipped.yaml" "$S/deployment.yaml" | grep '^>' | sed 's/^> *//' | sort -u | tr '\n' ' ')"
  else
    fail "the rendering differs in more than the images: $(diff "$S/deployment-shipped.yaml" "$S/deployment.yaml" | head -n 10)"
    return 1
  fi
}

# control_plane_restarts: the restart counts of the controller-manager and the scheduler
# (their static pods' containers, as the mirror pods report them).
control_plane_restarts() {
  local c
  for c in kube-controller-manager kube-scheduler; do
    printf '%s %s; ' "$c" "$(kcs get pod "$c-$NODE_NAME" -o jsonpath='{.status.containerStatuses[0].restartCount}' 2>&1)"
  done
}

# pivot: the documented order, then what it takes to finish.
pivot() {
  local t0 t1 static_stopped
  note "restarts before the pivot: $(control_plane_restarts)"
  log_mark pivot
  # The pivot without migrate removes kubeadm's apiserver before the Deployment's can serve:
  # the client-go load's failures are measured here, not asserted; refusals are.
  step_start pivot -report-only || true
  t0="$(now_ms)"
  if ! kc apply -f "$S/deployment.yaml" >"$S/apply.log" 2>&1; then
    fail "kubectl apply of the rendered Deployment failed: $(cat "$S/apply.log")"
    return 1
  fi
  pass "kubectl apply -f (the rendered single-controller overlay): $(tr '\n' ' ' <"$S/apply.log")"
  # docs/operations.md: "Remove kubeadm's static kube-apiserver manifest once the Deployment
  # runs". Wait for it to run (what `kubectl rollout status` waits for). PIVOT_ORDER=scheduled
  # instead removes the manifest as soon as the pod is bound to the node, before its
  # kube-apiserver container has failed into a crash-loop back-off.
  if [ "${PIVOT_ORDER:-documented}" = scheduled ]; then
    if wait_for 120 pod_scheduled; then
      note "PIVOT_ORDER=scheduled: the pod is bound to the node $(since "$t0") s after kubectl apply; the static manifest goes now"
    else
      fail "the Deployment's pod not bound to the node 120 s after kubectl apply: $(deploy_pods | tr '\n' ' ')"
    fi
  elif wait_for "${PIVOT_WAIT:-120}" deploy_ready; then
    pass "documented order: the Deployment is ready beside the static apiserver after $(since "$t0") s"
  else
    fail "documented order: the Deployment is not ready ${PIVOT_WAIT:-120} s after kubectl apply, beside kubeadm's static apiserver (binds 0.0.0.0:6443): $(deploy_pods | tr '\n' ' ')"
    pod_diagnostics
  fi
  # Then the static manifest goes (either way: it is the only way to finish the pivot).
  t1="$(now_ms)"
  mv "$MANIFESTS/kube-apiserver.yaml" "$S/kube-apiserver.static.yaml"
  if wait_for 60 static_apiserver_gone; then
    static_stopped="$(since "$t1")"
    note "static kube-apiserver container gone $static_stopped s after its manifest was removed"
  fi
  if wait_for 420 deploy_ready; then
    pass "pivot complete: the Deployment is ready $(since "$t1") s after the static manifest was removed ($(since "$t0") s after kubectl apply): $(deploy_pods | tr '\n' ' ')"
  else
    fail "the Deployment is not ready 420 s after the static manifest was removed: $(deploy_pods | tr '\n' ' ')"
    pod_diagnostics
    step_end pivot "the pivot (measured)"
    return 1
  fi
  pod_diagnostics
  # Let the load see a few seconds of the new apiserver before it stops.
  wait_for 10 false || true
  step_end pivot "the pivot (the load measured, not asserted)"
  local refused
  refused="$(step_refused pivot)"
  if [ "$refused" = 0 ]; then
    pass "no refused connection on $NODE_IP:6443 during the pivot"
  else
    fail "$refused refused connections on $NODE_IP:6443 during the pivot"
  fi
  note "restarts after the pivot: $(control_plane_restarts)"
  note "controller-manager, scheduler and kubelet logs during the pivot: $(log_error_summary pivot)"
}

# pod_scheduled: the Deployment's pod has a node.
pod_scheduled() {
  [ -n "$(kcs get pods -l component=kube-apiserver,pod-template-hash -o jsonpath='{.items[*].spec.nodeName}' 2>/dev/null)" ]
}

# static_apiserver_gone: the kubelet runs no static pod kube-apiserver-NODE any more.
static_apiserver_gone() {
  # The kubelet's own view: no running static pod named kube-apiserver-NODE.
  ! curl -fsS --max-time 2 "http://$NODE_IP:10255/pods" | "$NODECHECK" pod-listed "kube-apiserver-$NODE_NAME"
}

# rollout NAME COMMAND...: run the change, then `kubectl rollout status`; timed.
rollout() {
  local what="$1" t0 out
  shift
  t0="$(now_ms)"
  if ! out="$("$@" 2>&1)"; then
    fail "$what: $out"
    return 1
  fi
  if kcs rollout status deployment/kube-apiserver --timeout=300s >"$S/rollout-status.log" 2>&1 && wait_for 90 one_pod_left; then
    pass "$what: rollout complete after $(since "$t0") s (kubectl rollout status: $(tail -n 1 "$S/rollout-status.log")); pods: $(deploy_pods | tr '\n' ' ')"
  else
    fail "$what: rollout not complete after $(since "$t0") s: $(tail -n 3 "$S/rollout-status.log" | tr '\n' ' ') pods: $(deploy_pods | tr '\n' ' ')"
    pod_diagnostics
    return 1
  fi
}

# pod_ready_named NAME: the Deployment's pod NAME has both containers ready.
pod_ready_named() { deploy_pods | grep -q "^$1 .*true,true"; }

one_pod_left() { [ "$(deploy_pods | grep -c .)" = 1 ]; }

rollouts() {
  local i
  log_mark rollouts
  step_start rollouts -watch-endpoints || return 1
  local want=$ROLLOUT_RESTARTS done=0
  for i in $(seq 1 "$ROLLOUT_RESTARTS"); do
    rollout "rollout restart $i/$ROLLOUT_RESTARTS" kcs rollout restart deployment/kube-apiserver && done=$((done + 1))
  done
  if [ "${IMAGE_CHANGE:-1}" = 1 ]; then
    want=$((want + 2))
    rollout "image change to kube-apiserver $OLD_APISERVER_VERSION" \
      kcs set image deployment/kube-apiserver "kube-apiserver=$IMAGE_REPO/kube-apiserver:$OLD_APISERVER_VERSION" && done=$((done + 1))
    rollout "image change from $OLD_APISERVER_VERSION to $APISERVER_VERSION" \
      kcs set image deployment/kube-apiserver "kube-apiserver=$IMAGE_REPO/kube-apiserver:$APISERVER_VERSION" && done=$((done + 1))
  fi
  step_end rollouts "the rollouts by the real controllers ($done of $want complete)"
  if [ "$done" = "$want" ]; then
    pass "$done of $want rollouts completed"
  else
    fail "only $done of $want rollouts completed"
  fi
  note "controller-manager, scheduler and kubelet logs during the rollouts: $(log_error_summary rollouts)"
  note "restarts after the rollouts: $(control_plane_restarts)"
}

# broken_rollout: a flag that never lets the new apiserver become ready: --etcd-servers
# replaced by a closed port (appending a second --etcd-servers does not break it: the flag
# is a list, and the apiserver uses the first server that answers). The rollout must stall
# with the old pod serving, then `kubectl rollout undo`.
broken_rollout() {
  local t0 before
  log_mark broken
  step_start broken -watch-endpoints || return 1
  before="$(deploy_pods | awk '{ print $1 }')"
  t0="$(now_ms)"
  local idx
  idx="$(kcs get deployment/kube-apiserver -o json | "$NODECHECK" arg-index --etcd-servers=)"
  kcs patch deployment/kube-apiserver --type=json -p \
    '[{"op": "replace", "path": "/spec/template/spec/containers/0/args/'"$idx"'", "value": "--etcd-servers=https://127.0.0.1:2"}]' >/dev/null
  if kcs rollout status deployment/kube-apiserver --timeout=120s >"$S/rollout-broken.log" 2>&1; then
    fail "broken rollout completed: $(tail -n 2 "$S/rollout-broken.log")"
  else
    pass "broken rollout stalls: kubectl rollout status --timeout=120s: $(tail -n 2 "$S/rollout-broken.log" | tr '\n' ' ')"
  fi
  # A kubectl call can fail on this busy machine: ask again for up to 15 s.
  if wait_for 15 pod_ready_named "$before"; then
    pass "the old pod $before still serves and is Ready: $(deploy_pods | tr '\n' ' ')"
  else
    fail "the old pod is not Ready during the broken rollout: $(deploy_pods | tr '\n' ' ')"
  fi
  pod_diagnostics
  t0="$(now_ms)"
  rollout "kubectl rollout undo" kcs rollout undo deployment/kube-apiserver
  if [ "$(deploy_pods | awk '{ print $1 }')" = "$before" ]; then
    pass "after the undo the old pod $before is the one left, never restarted"
  else
    fail "after the undo: $(deploy_pods | tr '\n' ' ') (the old pod was $before)"
  fi
  step_end broken "the broken rollout and its undo"
  note "controller-manager, scheduler and kubelet logs: $(log_error_summary broken)"
}

run_pivot() {
  pivot_prepare_node || return 0
  pivot_render || return 0
  pivot || return 0
  [ "${PIVOT_ONLY:-0}" = 1 ] || rollouts || true
  [ "${PIVOT_ONLY:-0}" = 1 ] || [ "${BROKEN_ROLLOUT:-1}" = 0 ] || broken_rollout || true
  # Keep every report beside the logs (KEEP_STATE=1 keeps them).
  note "reports: $S/step-*.json"
}

# pivot_teardown: the kubelet first (it would restart what is killed), then every task.
pivot_teardown() {
  if [ -n "${KUBELET_PID:-}" ]; then
    stop "$KUBELET_PID" kubelet
    KUBELET_PID=""
  fi
  local id
  for id in $(running_tasks); do
    "${CTR[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
  done
  wait_for 30 no_running_tasks || true
  # The pods were never removed, so their sandboxes still hold shims: delete every task and
  # container while containerd runs, and wait for the shims to exit.
  for id in $("${CTR[@]}" tasks ls -q 2>/dev/null); do
    "${CTR[@]}" tasks delete -f "$id" >/dev/null 2>&1 || true
  done
  for id in $("${CTR[@]}" containers ls -q 2>/dev/null); do
    "${CTR[@]}" containers delete "$id" >/dev/null 2>&1 || true
  done
  # The sandbox shims stay until their sandbox is shut down.
  for id in $("${CTR[@]}" sandboxes ls 2>/dev/null | awk 'NR > 1 { print $1 }'); do
    "${CTR[@]}" sandboxes rm -f "$id" >/dev/null 2>&1 || true
  done
  # 5 s: every run so far waited the whole 30 s it used to (CI time).
  if ! wait_for 5 no_shims; then
    # Not found why: with containerd v2.2.9 the shims of pods the kubelet never removed
    # outlive the deletion of every task, container and sandbox. They are ours (this is the
    # namespaces' PID 1), so they go the way the namespace would take them anyway.
    note "shims still running 5 s after their tasks, containers and sandboxes were removed: killed"
    local p
    for p in /proc/[0-9]*; do
      [ "$(cat "$p/comm" 2>/dev/null)" != containerd-shim ] || kill -KILL "${p#/proc/}" 2>/dev/null || true
    done
    wait_for 10 no_shims || true
  fi
}

no_shims() {
  local p
  for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" != containerd-shim ] || return 1
  done
}
