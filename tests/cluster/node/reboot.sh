# shellcheck shell=bash
# shellcheck disable=SC2154 # here, S, CTR and the rest come from smoke, which sources this
# Reboot recovery (issue 13 point 1), sourced by `smoke --reboot` after pivot.sh, inside the
# namespaces, once the kubeadm-style control plane runs:
#
#   1. the node is prepared (manifests/node/tmpfiles.d, with the checkpoint directory) and the
#      recovery agent manifests/node/kube-apiserver-recovery.yaml is installed as a static pod;
#   2. the pivot to the Deployment of manifests/single-controller, as migrate.sh does it
#      (`kube-apiserver-proxy migrate`, checked there);
#   3. the checkpoint: written by the recovery agent once the Deployment's pod stayed ready for
#      --checkpoint-after; a completed rollout moves it to the new pod; a broken rollout left in
#      progress for longer than --checkpoint-after does not;
#   4. the "reboot": every process of the node killed with SIGKILL (kubelet, containerd, shims,
#      every container, etcd included), what lives in /run and in the runtime's state dropped,
#      the mounts of the pods' volumes and root file systems gone, the pods' cgroups removed;
#      kept: etcd's data, /etc/kubernetes, /var/lib/kubelet, the images and the checkpoint
#      directory; the node's tmpfiles.d directories are created again, as systemd-tmpfiles does
#      at boot; then containerd and the kubelet are started again, with nothing else;
#   5. the control plane must serve (GET /readyz on NODE_IP:6443) within REBOOT_BOUND seconds of
#      the runtime's start, from the recovery instance (the checkpoint of the good pod, not the
#      broken one); from then on a TCP connect loop (every 20 ms) and the client-go load run,
#      until the Deployment's good pod is ready, the recovery instance has been retired and is
#      gone, and the Deployment's proxy holds the listening socket: 0 refused, 0 failed;
#   6. `kubectl rollout undo` of the broken rollout completes.
#
# Environment: REBOOT_BOUND (180 s), CHECKPOINT_WAIT (the agent's --checkpoint-after plus
# 120 s), BROKEN_SOAK (--checkpoint-after plus 30 s: how long the broken rollout runs before the
# reboot). Uses from smoke and pivot.sh: S, CTR, NODE_IP, NODE_NAME, IMAGE_REPO, MANIFESTS,
# CGROUP_CREATED, pass, fail, note, wait_for, now_ms, since, api, kc, kcs, step_*,
# deploy_pods, deploy_ready, pod_scheduled, static_apiserver_gone, rollout,
# pod_diagnostics, start_containerd, start_kubelet, pod_json.

CHECKPOINT_DIR=/var/lib/kube-apiserver-proxy/checkpoint
CHECKPOINT_FILE="$CHECKPOINT_DIR/kube-apiserver.json"
ACTIVE_MANIFEST_NAME=kube-apiserver-checkpoint.json
REBOOT_BOUND="${REBOOT_BOUND:-180}"

# checkpoint_of: "namespace/name" of the pod the checkpoint is a copy of (empty if none).
checkpoint_of() {
  python3 -c '
import json, sys
try:
    print(json.load(open(sys.argv[1]))["metadata"]["annotations"]["kube-apiserver-proxy/checkpoint-of"])
except Exception:
    pass' "${1:-$CHECKPOINT_FILE}"
}
checkpoint_is() { [ "$(checkpoint_of)" = "kube-system/$1" ]; }

# checkpoint_flag FILE CONTAINER FLAG: the value of --FLAG=… in CONTAINER's args of the checkpoint.
checkpoint_flag() {
  python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))
for c in p["spec"]["containers"]:
    if c["name"] == sys.argv[2]:
        for a in (c.get("command") or []) + (c.get("args") or []):
            if a.startswith(sys.argv[3] + "="):
                print(a.split("=", 1)[1])' "$1" "$2" "$3"
}

# good_pod: the Deployment's single pod (when exactly one).
the_pod() { deploy_pods | awk 'NR == 1 { print $1 }'; }

# kubelet_runs NAME: the kubelet's /pods lists a running pod NAME.
kubelet_runs() {
  pod_json | python3 -c '
import json, sys
for p in json.load(sys.stdin).get("items") or []:
    if p["metadata"]["name"] == sys.argv[1] and (p.get("status") or {}).get("phase") == "Running":
        sys.exit(0)
sys.exit(1)' "$1"
}
kubelet_knows() {
  pod_json | python3 -c '
import json, sys
sys.exit(0 if any(p["metadata"]["name"] == sys.argv[1] for p in json.load(sys.stdin).get("items") or []) else 1)' "$1"
}
checkpoint_inactive() { [ ! -e "$MANIFESTS/$ACTIVE_MANIFEST_NAME" ]; }
recovery_pod_gone() { ! kubelet_knows "kube-apiserver-checkpoint-$NODE_NAME" && [ -z "$(checkpoint_tasks)" ]; }

# checkpoint_tasks: running containerd tasks of the recovery instance (by the kubelet's labels).
checkpoint_tasks() {
  local id
  for id in $(running_tasks); do
    "${CTR[@]}" containers info "$id" 2>/dev/null | grep -q "\"io.kubernetes.pod.name\": \"kube-apiserver-checkpoint-$NODE_NAME\"" && echo "$id"
  done
}

# agent_log PATTERN: the recovery agent's log messages matching PATTERN.
agent_log() {
  cat "$S"/pod-logs/kube-system_kube-apiserver-recovery-*/recover/*.log 2>/dev/null \
    | grep -o '"message":"recover: [^"]*"[^}]*' | grep -- "$1" | cut -c1-300 || true
}

readyz() { curl -fsS --max-time 3 --cacert /etc/kubernetes/pki/ca.crt "https://$NODE_IP:6443/readyz"; }

reboot_install_agent() {
  local src="$here/../../../manifests/node/kube-apiserver-recovery.yaml"
  sed "s|image: ghcr.io/example/kube-apiserver-proxy:v0.1.0|image: $PROXY_IMAGE|" "$src" >"$S/kube-apiserver-recovery.yaml"
  if ! grep -q "image: $PROXY_IMAGE" "$S/kube-apiserver-recovery.yaml"; then
    fail "could not set the image of manifests/node/kube-apiserver-recovery.yaml"
    return 1
  fi
  mv "$S/kube-apiserver-recovery.yaml" "$MANIFESTS/kube-apiserver-recovery.yaml"
  if wait_for 120 kubelet_runs "kube-apiserver-recovery-$NODE_NAME"; then
    pass "recovery agent installed as a static pod (manifests/node/kube-apiserver-recovery.yaml, only the image changed) and running"
  else
    fail "recovery agent static pod not running within 120 s"
    return 1
  fi
}

# wait_checkpoint POD WHAT: the checkpoint names POD within CHECKPOINT_WAIT seconds.
wait_checkpoint() {
  local pod="$1" what="$2" t0
  t0="$(now_ms)"
  if wait_for "$CHECKPOINT_WAIT" checkpoint_is "$pod"; then
    pass "$what: the checkpoint is of $pod, written $(since "$t0") s after the rollout completed (--checkpoint-after=$CHECKPOINT_AFTER; $(agent_log 'checkpoint written' | tail -n 1))"
  else
    fail "$what: the checkpoint is not of $pod after $CHECKPOINT_WAIT s: it is of '$(checkpoint_of)'; $(find "$CHECKPOINT_DIR" -maxdepth 1 -printf '%f %m %u; ' 2>&1)"
    agent_log checkpoint | tail -n 5 | sed 's/^/#   /'
    return 1
  fi
}

check_checkpoint_content() {
  local f="$CHECKPOINT_FILE" problems
  problems="$(python3 - "$f" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
bad = []
if p["metadata"]["name"] != "kube-apiserver-checkpoint": bad.append("name")
if p["metadata"].get("labels", {}).get("component") == "kube-apiserver": bad.append("Deployment labels kept")
s = p["spec"]
for k in ("nodeName", "serviceAccountName", "priority"):
    if k in s: bad.append(k + " kept")
for v in s.get("volumes", []):
    if "projected" in v or "secret" in v: bad.append("volume " + v["name"] + " kept")
proxy = [c for c in s["containers"] if c["name"] == "proxy"][0]
args = (proxy.get("command") or []) + (proxy.get("args") or [])
if not any(a.startswith("--retire-file=") for a in args): bad.append("no --retire-file")
print("; ".join(bad))
EOF
)"
  if [ -z "$problems" ]; then
    pass "the checkpoint is a static pod of its own: name kube-apiserver-checkpoint, own labels, no service account or token volume, the proxy a recovery instance (--retire-file); $(stat -c '%n %a %U' "$CHECKPOINT_DIR" "$f" | tr '\n' ' ')"
  else
    fail "checkpoint content: $problems"
  fi
}

# broken_in_progress: the broken rollout's new pod exists and is not ready, the good one is.
broken_running() {
  deploy_pods | awk -v good="$1" '$1 != good && $2 == "Running"' | grep -q .
}

reboot_broken_rollout() {
  local good="$1" idx t0 before_mtime
  before_mtime="$(stat -c %Y "$CHECKPOINT_FILE")"
  idx="$(kcs get deployment/kube-apiserver -o json | python3 -c '
import json, sys
c = json.load(sys.stdin)["spec"]["template"]["spec"]["containers"][0]
print([i for i, a in enumerate(c["args"]) if a.startswith("--etcd-servers=")][0])')"
  kcs patch deployment/kube-apiserver --type=json -p \
    '[{"op": "replace", "path": "/spec/template/spec/containers/0/args/'"$idx"'", "value": "--etcd-servers=https://127.0.0.1:2"}]' >/dev/null
  t0="$(now_ms)"
  if wait_for 120 broken_running "$good"; then
    note "broken rollout (--etcd-servers=https://127.0.0.1:2): its pod runs $(since "$t0") s after the patch: $(deploy_pods | tr '\n' ' ')"
  else
    fail "the broken rollout's pod does not run after 120 s: $(deploy_pods | tr '\n' ' ')"
    return 1
  fi
  # Longer than --checkpoint-after: were it ever ready, it would have been checkpointed.
  wait_for "$BROKEN_SOAK" false || true
  if [ "$(checkpoint_of)" = "kube-system/$good" ] && [ "$(stat -c %Y "$CHECKPOINT_FILE")" = "$before_mtime" ] \
    && [ "$(checkpoint_flag "$CHECKPOINT_FILE" kube-apiserver --etcd-servers)" = https://127.0.0.1:2379 ]; then
    pass "broken rollout in progress for $(since "$t0") s (> --checkpoint-after): the checkpoint is still the good pod $good, unchanged, --etcd-servers=https://127.0.0.1:2379; pods: $(deploy_pods | tr '\n' ' ')"
  else
    fail "the broken rollout changed the checkpoint: of '$(checkpoint_of)', --etcd-servers=$(checkpoint_flag "$CHECKPOINT_FILE" kube-apiserver --etcd-servers)"
  fi
}

# reboot_node: what a power cycle leaves of the node.
reboot_node() {
  local keep=" 1 $$ $BASHPID " p pid left
  for _ in $(seq 1 100); do
    left=()
    for p in /proc/[0-9]*; do
      pid="${p#/proc/}"
      case "$keep" in *" $pid "*) continue ;; esac
      [ "$(awk '/^State:/ { print $2 }' "$p/status" 2>/dev/null)" != Z ] || continue
      [ -e "$p/status" ] || continue
      left+=("$pid")
    done
    [ ${#left[@]} -gt 0 ] || break
    kill -KILL "${left[@]}" 2>/dev/null || true
    sleep 0.1
  done
  wait "$KUBELET_PID" "$CONTAINERD_PID" 2>/dev/null || true
  KUBELET_PID="" CONTAINERD_PID=""
  if [ ${#left[@]} -gt 0 ]; then
    fail "reboot: processes still alive after SIGKILL: ${left[*]}"
    return 1
  fi
  # Mounts that a reboot drops: the containers' root file systems and shm, the pods' tmpfs
  # volumes, everything below /run.
  local m n=0
  while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    n=$((n + 1))
  done < <(awk '{ print $5 }' /proc/self/mountinfo | grep -E "^($S/containerd/|$S/kubelet/|/run/)" | awk '{ print length, $0 }' | sort -rn | cut -d' ' -f2-)
  # /run is a tmpfs: empty after a boot. So is the runtime's state (/run/containerd on a node).
  find /run -mindepth 1 -maxdepth 1 -exec rm -rf {} + 2>/dev/null || true
  rm -rf "$S/containerd/state" "$S/containerd/runc"
  # The pods' cgroups are gone after a boot (the cgroup root itself is this test's).
  local h
  for h in /sys/fs/cgroup/*/; do
    [ -d "${h%/}$CGROUP_ROOT" ] || continue
    find "${h%/}$CGROUP_ROOT" -mindepth 1 -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  # What systemd-tmpfiles creates at boot (manifests/node/tmpfiles.d).
  tmpfiles_create || return 1
  pass "reboot: every node process killed (SIGKILL), $n mounts of pods and /run dropped, /run and the runtime's state emptied, pod cgroups removed; kept: etcd data, /etc/kubernetes, /var/lib/kubelet, images, $CHECKPOINT_DIR; tmpfiles.d applied again"
}

tmpfiles_create() {
  local conf="$here/../../../manifests/node/tmpfiles.d/kube-apiserver-proxy.conf" typ path mode uid gid _
  while read -r typ path mode uid gid _; do
    [ "$typ" = d ] || continue
    mkdir -p "$path" && chmod "$mode" "$path" && chown "$uid:$gid" "$path" || return 1
  done < <(grep -v '^#' "$conf")
}

# deploy_pod_ready NAME: the Deployment's pod NAME has both containers ready.
deploy_pod_ready() { deploy_pods | grep -q "^$1 .*true,true"; }

reboot_recover() {
  local good="$1" broken="$2" t_boot t_serve t_take served_by
  t_boot="$(now_ms)"
  start_containerd || return 1
  start_kubelet || return 1
  local active="$MANIFESTS/$ACTIVE_MANIFEST_NAME"
  if wait_for 120 test -f "$active"; then
    note "the recovery agent activated the checkpoint $(since "$t_boot") s after the runtime's start: $(checkpoint_of "$active")"
  else
    fail "no checkpoint activated in $MANIFESTS 120 s after the runtime's start: $(find "$MANIFESTS" -maxdepth 1 -printf '%f '); agent log: $(tail -n 3 "$S"/pod-logs/kube-system_kube-apiserver-recovery-*/recover/*.log 2>/dev/null | cut -c1-300 | tr '\n' ' ')"
    return 1
  fi
  if wait_for "$REBOOT_BOUND" readyz; then
    t_serve="$(since "$t_boot")"
    pass "the control plane serves again (GET /readyz on $NODE_IP:6443) $t_serve s after the runtime's start, within the bound of $REBOOT_BOUND s, with no manual step"
  else
    fail "the control plane does not serve $REBOOT_BOUND s after the runtime's start"
    pod_json 2>&1 | head -c 1500 | sed 's/^/#   /'
    return 1
  fi
  # From the takeover on: every connect and the client-go load must succeed.
  step_start takeover -watch-endpoints || true
  served_by="$(checkpoint_of "$active")"
  if kubelet_runs "kube-apiserver-checkpoint-$NODE_NAME" && [ "$served_by" = "kube-system/$good" ] \
    && [ "$(checkpoint_flag "$active" kube-apiserver --etcd-servers)" = https://127.0.0.1:2379 ]; then
    pass "the recovery instance is the checkpoint of the good pod $good (--etcd-servers=https://127.0.0.1:2379), not the broken rollout's ${broken:-pod}"
  else
    fail "the recovery instance: kubelet runs it: $(kubelet_runs "kube-apiserver-checkpoint-$NODE_NAME" && echo yes || echo no); of '$served_by'; --etcd-servers=$(checkpoint_flag "$active" kube-apiserver --etcd-servers)"
  fi
  t_take="$(now_ms)"
  if wait_for 600 deploy_pod_ready "$good" && wait_for 300 checkpoint_inactive \
    && wait_for 180 recovery_pod_gone; then
    pass "takeover: the Deployment's pod $good is ready, the recovery instance was retired and is gone $(since "$t_take") s after the control plane served ($(since "$t_boot") s after the runtime's start)"
  else
    fail "takeover not complete: pods $(deploy_pods | tr '\n' ' '); manifest still there: $([ -e "$MANIFESTS/$ACTIVE_MANIFEST_NAME" ] && echo yes || echo no); kubelet knows the recovery pod: $(kubelet_knows "kube-apiserver-checkpoint-$NODE_NAME" && echo yes || echo no)"
    pod_diagnostics
  fi
  # Let the load see the Deployment's apiserver alone for a few seconds.
  wait_for 10 false || true
  # The overlay's apiservers (the recovery instance's too: it is a checkpoint of one) run
  # with --endpoint-reconciler-type=none: nothing may empty the kubernetes Service.
  step_end takeover "from the takeover on: client-go load, connects, default/kubernetes, no controller restart"
  local log
  log="$(kcs logs "$good" -c proxy 2>&1)"
  # Shared at its start (one kernel queue with the recovery instance), adopted at the recovery
  # instance's drain: the same sockets, so the adoption brings none it did not hold ("new":0).
  if grep -q 'handoff: sockets shared by peer.*"sockets":[1-9]' <<<"$log" \
    && grep "handoff: adopted peer's listening sockets" <<<"$log" | head -n 1 | grep -q '"new":0'; then
    pass "the Deployment's proxy shared the recovery instance's listening sockets, then adopted them at its drain (the same sockets): $(grep -E 'sockets shared by peer.*"sockets":[1-9]|adopted peer' <<<"$log" | head -n 2 | grep -oE '"message":"[^"]*"|"(sockets|offered|taken|new)":[0-9]+' | tr '\n' ' ')"
  else
    fail "no handoff from the recovery instance in the Deployment's proxy log: $(grep -i handoff <<<"$log" | tail -n 5 | cut -c1-200 | tr '\n' ' ')"
  fi
  note "recovery agent log: $(agent_log 'activated\|retired\|not activated' | tail -n 4 | tr '\n' ' ')"
}

run_reboot() {
  pivot_prepare_node || return 0
  pivot_render || return 0
  CHECKPOINT_AFTER="$(grep -o -- '--checkpoint-after=[0-9]*s' "$here/../../../manifests/node/kube-apiserver-recovery.yaml" | head -n 1 | cut -d= -f2)"
  if [ -z "$CHECKPOINT_AFTER" ]; then
    fail "no --checkpoint-after=Ns in manifests/node/kube-apiserver-recovery.yaml"
    return 0
  fi
  local after_s="${CHECKPOINT_AFTER%s}"
  CHECKPOINT_WAIT="${CHECKPOINT_WAIT:-$((after_s + 120))}"
  BROKEN_SOAK="${BROKEN_SOAK:-$((after_s + 30))}"
  reboot_install_agent || return 0
  # The pivot as shipped: migrate.sh (the migration from kubeadm's static apiserver).
  migrate_local_kubeconfig || return 0
  migrate || return 0
  local first second
  first="$(the_pod)"
  wait_checkpoint "$first" "after the pivot" || return 0
  check_checkpoint_content
  rollout "rollout restart" kcs rollout restart deployment/kube-apiserver || return 0
  second="$(the_pod)"
  wait_checkpoint "$second" "after a completed rollout" || return 0
  reboot_broken_rollout "$second" || return 0
  local broken
  broken="$(deploy_pods | awk -v good="$second" '$1 != good { print $1 }' | head -n 1)"
  reboot_node || return 0
  reboot_recover "$second" "$broken" || return 0
  rollout "kubectl rollout undo of the broken rollout, after the recovery" kcs rollout undo deployment/kube-apiserver || true
  note "reports: $S/step-*.json"
}
