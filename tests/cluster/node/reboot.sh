# shellcheck shell=bash
# shellcheck disable=SC2154 # here, S, CTR and the rest come from smoke, which sources this
# Reboot recovery, sourced by `smoke --reboot` after pivot.sh, inside the
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
  "$NODECHECK" annotation "${1:-$CHECKPOINT_FILE}" kube-apiserver-proxy/checkpoint-of
}
checkpoint_is() { [ "$(checkpoint_of)" = "kube-system/$1" ]; }

# checkpoint_flag FILE CONTAINER FLAG: the value of --FLAG=… in CONTAINER's args of the checkpoint.
checkpoint_flag() {
  "$NODECHECK" flag "$1" "$2" "$3"
}

# good_pod: the Deployment's single pod (when exactly one).
the_pod() { deploy_pods | awk 'NR == 1 { print $1 }'; }

# kubelet_runs NAME: the kubelet's /pods lists a running pod NAME.
kubelet_runs() {
  pod_json | "$NODECHECK" pod-running "$1"
}
kubelet_knows() {
  pod_json | "$NODECHECK" pod-listed "$1"
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

# reboot_apply_recovery: manifests/recovery (the node identity's reads for the agent's owner
# check, the admission policies on the apiserver workload), before the agent, as documented.
reboot_apply_recovery() {
  if kc apply -k "$here/../../../manifests/recovery" >"$S/recovery-apply.log" 2>&1; then
    pass "kubectl apply -k manifests/recovery: $(tr '\n' ' ' <"$S/recovery-apply.log")"
  else
    fail "kubectl apply -k manifests/recovery: $(tail -n 3 "$S/recovery-apply.log")"
    return 1
  fi
}

# reboot_install_agent: the agent's manifest with the image set, and, as
# docs/runbooks/reboot-recovery.md says, its repository in --allow-image-repository and the
# cluster's imageRepository added.
reboot_install_agent() {
  local src="$here/../../../manifests/node/kube-apiserver-recovery.yaml"
  sed -e "s|image: ghcr.io/example/kube-apiserver-proxy:v0.1.0|image: $PROXY_IMAGE|" \
    -e "s|^\( *\)- --allow-image-repository=ghcr.io/example/kube-apiserver-proxy\$|\1- --allow-image-repository=${PROXY_IMAGE%:*}\n\1- --allow-image-repository=$IMAGE_REPO/kube-apiserver|" \
    "$src" >"$S/kube-apiserver-recovery.yaml"
  if ! grep -q "image: $PROXY_IMAGE" "$S/kube-apiserver-recovery.yaml" \
    || ! grep -q -- "--allow-image-repository=$IMAGE_REPO/kube-apiserver$" "$S/kube-apiserver-recovery.yaml"; then
    fail "could not set the image of manifests/node/kube-apiserver-recovery.yaml"
    return 1
  fi
  mv "$S/kube-apiserver-recovery.yaml" "$MANIFESTS/kube-apiserver-recovery.yaml"
  if wait_for 120 kubelet_runs "kube-apiserver-recovery-$NODE_NAME"; then
    pass "recovery agent installed as a static pod (manifests/node/kube-apiserver-recovery.yaml: the image and its repository set, $IMAGE_REPO/kube-apiserver allowed) and running"
  else
    fail "recovery agent static pod not running within 120 s"
    return 1
  fi
}

# The kubelet's client certificate rotation (the agent reads the kubeconfig and the certificate
# it names at every attempt). kubeadm's layout: /var/lib/kubelet/pki/kubelet-client-current.pem,
# named by kubelet.conf once kubeadm's kubelet-finalize phase ran.
ROTATION_PKI=/var/lib/kubelet/pki
ROTATION_LIFETIME="${ROTATION_LIFETIME:-150}"

# rotation_serial: the serial of the certificate kubelet-client-current.pem holds now.
rotation_serial() { openssl x509 -noout -serial -in "$ROTATION_PKI/kubelet-client-current.pem" 2>/dev/null; }
rotated() { [ "$(rotation_serial)" != "$ROTATION_FIRST" ]; }

# reboot_short_client_cert: the node's client certificate replaced by one that expires
# ROTATION_LIFETIME s from now and started 10 minutes ago (so the kubelet's rotation deadline,
# at 70-90 % of its life, has passed), signed by the cluster CA, as kubelet-client-current.pem;
# kubeadm's kubelet-finalize points kubelet.conf at it; the kubelet restarts with it, its
# rotation still off. The agent, installed next, starts with this certificate.
reboot_short_client_cert() {
  local d="$S/rotation" start end
  mkdir -p "$d" "$ROTATION_PKI"
  cat >"$d/ca.cnf" <<EOF
[ca]
default_ca = signer
[signer]
database = $d/index.txt
new_certs_dir = $d
serial = $d/serial
default_md = sha256
policy = any
copy_extensions = none
x509_extensions = client
unique_subject = no
[any]
organizationName = supplied
commonName = supplied
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
EOF
  : >"$d/index.txt"
  echo 1000 >"$d/serial"
  start="$(date -u -d '-10 min' +%Y%m%d%H%M%SZ)"
  ROTATION_EXPIRES="$(($(date +%s) + ROTATION_LIFETIME))"
  end="$(date -u -d "@$ROTATION_EXPIRES" +%Y%m%d%H%M%SZ)"
  if ! { openssl ecparam -name prime256v1 -genkey -noout -out "$d/key.pem" \
    && openssl req -new -key "$d/key.pem" -subj "/O=system:nodes/CN=system:node:$NODE_NAME" -out "$d/csr.pem" \
    && openssl ca -batch -config "$d/ca.cnf" -cert /etc/kubernetes/pki/ca.crt -keyfile /etc/kubernetes/pki/ca.key \
      -in "$d/csr.pem" -out "$d/cert.pem" -startdate "$start" -enddate "$end" -notext; } >"$d/openssl.log" 2>&1; then
    fail "could not make a short-lived node certificate: $(tail -n 3 "$d/openssl.log")"
    return 1
  fi
  cat "$d/cert.pem" "$d/key.pem" >"$ROTATION_PKI/kubelet-client-short.pem"
  chmod 600 "$ROTATION_PKI/kubelet-client-short.pem"
  ln -sfn "$ROTATION_PKI/kubelet-client-short.pem" "$ROTATION_PKI/kubelet-client-current.pem"
  if ! "$S/bins/kubeadm" init phase kubelet-finalize enable-client-cert-rotation --config "$S/kubeadm.yaml" >>"$S/kubeadm.log" 2>&1 \
    || ! grep -q "client-certificate: $ROTATION_PKI/kubelet-client-current.pem" /etc/kubernetes/kubelet.conf; then
    fail "kubeadm init phase kubelet-finalize enable-client-cert-rotation did not point kubelet.conf at $ROTATION_PKI/kubelet-client-current.pem: $(tail -n 3 "$S/kubeadm.log")"
    return 1
  fi
  ROTATION_FIRST="$(rotation_serial)"
  stop "$KUBELET_PID" kubelet
  # shellcheck disable=SC2034 # read by start_kubelet in smoke
  KUBELET_CERT_DIR="$ROTATION_PKI"
  start_kubelet || return 1
  wait_node || return 1
  pass "the node's client certificate is kubeadm's kubelet-client-current.pem (kubelet-finalize rewrote kubelet.conf), valid until $(date -u -d "@$ROTATION_EXPIRES" +%T) ($ROTATION_LIFETIME s), $ROTATION_FIRST; the kubelet uses it"
}

# reboot_rotate: the kubelet's own rotation turned on (kubeadm's auto-approval of a node's
# renewal; the controller-manager signs): it rotates at once (the deadline has passed).
reboot_rotate() {
  local t0
  kc create clusterrolebinding kubeadm:node-autoapprove-certificate-rotation \
    --clusterrole=system:certificates.k8s.io:certificatesigningrequests:selfnodeclient --group=system:nodes >/dev/null 2>&1 || true
  stop "$KUBELET_PID" kubelet
  # shellcheck disable=SC2034 # read by start_kubelet in smoke
  KUBELET_ROTATE_CERTIFICATES=true
  t0="$(now_ms)"
  start_kubelet || return 1
  if wait_for 180 rotated; then
    pass "the kubelet rotated its client certificate $(since "$t0") s after its restart: kubelet-client-current.pem -> $(readlink "$ROTATION_PKI/kubelet-client-current.pem"), $(rotation_serial), valid until $(openssl x509 -noout -enddate -in "$ROTATION_PKI/kubelet-client-current.pem" | cut -d= -f2); the old one expires at $(date -u -d "@$ROTATION_EXPIRES" +%T)"
  else
    fail "the kubelet did not rotate its client certificate within 180 s: $(grep -i 'certificate' "$S/kubelet.log" | tail -n 3 | cut -c1-300)"
    return 1
  fi
}

# reboot_rotation_expired: the certificate the agent started with has expired (the apiserver
# refuses it: checked with curl).
reboot_rotation_expired() {
  local wait=$((ROTATION_EXPIRES - $(date +%s) + 2))
  [ "$wait" -le 0 ] || wait_for "$wait" false || true
  if curl -fsS --max-time 5 --cacert /etc/kubernetes/pki/ca.crt --cert "$ROTATION_PKI/kubelet-client-short.pem" \
    "https://$NODE_IP:6443/api/v1/nodes/$NODE_NAME" >/dev/null 2>"$S/rotation/curl.err"; then
    fail "the first node certificate is still accepted after its expiry"
  else
    pass "the node certificate the agent started with has expired and is refused ($(tail -n 1 "$S/rotation/curl.err" | cut -c1-120)); the next checkpoint can only be written with the rotated one"
  fi
}

# reboot_agent_metrics: the agent's metrics on NODE_IP:9445 (its manifest's --metrics-listen).
reboot_agent_metrics() {
  local m written verified refused
  m="$(curl -fsS --max-time 5 "http://$NODE_IP:9445/metrics" 2>&1)" || true
  written="$(awk '$1 == "kube_apiserver_proxy_checkpoint_written_timestamp_seconds" { print $2 }' <<<"$m")"
  verified="$(awk '$1 == "kube_apiserver_proxy_checkpoint_verified_timestamp_seconds" { print $2 }' <<<"$m")"
  refused="$(awk '$1 == "kube_apiserver_proxy_checkpoint_refused" { print $2 }' <<<"$m")"
  if [ "${written:-0}" != 0 ] && [ "${verified:-0}" != 0 ] && [ "$refused" = 0 ]; then
    pass "the agent's metrics on $NODE_IP:9445: the checkpoint written at $written (age $(($(date +%s) - ${written%.*})) s), found current at $verified, refused $refused; $(grep '^kube_apiserver_proxy_checkpoint_attempts_total' <<<"$m" | tr '\n' ' ')"
  else
    fail "the agent's metrics on $NODE_IP:9445: written '$written', verified '$verified', refused '$refused': $(head -c 300 <<<"$m")"
  fi
}

# reboot_admission: manifests/recovery's admission policies refuse a user whom RBAC lets patch
# the Deployment and create pods in kube-system; the real controllers' rollouts go on (the
# rollout restart that follows).
reboot_admission() {
  kc create clusterrole smoke-mallory --verb=get,list,patch,update,create \
    --resource=deployments,pods,replicasets >/dev/null 2>&1 || true
  kc create clusterrolebinding smoke-mallory --clusterrole=smoke-mallory --user=mallory >/dev/null 2>&1 || true
  local patch run
  patch="$(kcs --as=mallory patch deployment kube-apiserver --type=merge \
    -p '{"spec":{"template":{"metadata":{"annotations":{"smoke/mallory":"x"}}}}}' 2>&1)" || true
  run="$(kcs --as=mallory run impostor --image="$PROXY_IMAGE" --restart=Never \
    --labels=app.kubernetes.io/name=kube-apiserver,app.kubernetes.io/part-of=kube-apiserver-proxy 2>&1)" || true
  if grep -q "ValidatingAdmissionPolicy 'kube-apiserver-proxy-workload'.*denied" <<<"$patch" \
    && grep -q "ValidatingAdmissionPolicy 'kube-apiserver-proxy-pods'.*denied" <<<"$run" \
    && kcs --as=mallory auth can-i patch deployments >/dev/null 2>&1; then
    pass "admission: a user RBAC lets patch deployments and create pods in kube-system is refused both: $(cut -c1-200 <<<"$patch") | $(cut -c1-160 <<<"$run")"
  else
    fail "admission: mallory's patch: $patch; mallory's labelled pod: $run"
  fi
  kc delete clusterrolebinding smoke-mallory >/dev/null 2>&1 || true
  kc delete clusterrole smoke-mallory >/dev/null 2>&1 || true
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
  problems="$("$NODECHECK" checkpoint-problems "$f" 2>&1)"
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
  idx="$(kcs get deployment/kube-apiserver -o json | "$NODECHECK" arg-index --etcd-servers=)"
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
  # From the takeover on: every connect and the client-go load must succeed. The power cycle
  # restarted the controller-manager and the scheduler (their mirror pods say so once the
  # kubelet reaches the API again, during this step): it does not watch them; their restart
  # count is checked after it, the reboot's one and no more.
  local watch=("${STEP_WATCH[@]}")
  STEP_WATCH=(-probe "$NODE_IP:6443")
  step_start takeover -watch-endpoints || true
  STEP_WATCH=("${watch[@]}")
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
  step_end takeover "from the takeover on: client-go load, connects, default/kubernetes"
  local restarts
  restarts="$(control_plane_restarts)"
  if [ "$restarts" = "kube-controller-manager 1; kube-scheduler 1; " ]; then
    pass "the controller-manager and the scheduler restarted once each, by the reboot: $restarts"
  else
    fail "controller-manager and scheduler restarts after the reboot (1 each expected, the reboot's): $restarts"
  fi
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
  reboot_apply_recovery || return 0
  reboot_short_client_cert || return 0
  reboot_install_agent || return 0
  reboot_rotate || return 0
  # The pivot as shipped: migrate.sh (the migration from kubeadm's static apiserver).
  migrate_local_kubeconfig || return 0
  migrate || return 0
  local first second
  first="$(the_pod)"
  wait_checkpoint "$first" "after the pivot" || return 0
  check_checkpoint_content
  reboot_agent_metrics
  reboot_admission
  reboot_rotation_expired
  rollout "rollout restart" kcs rollout restart deployment/kube-apiserver || return 0
  second="$(the_pod)"
  wait_checkpoint "$second" "after a completed rollout, with the rotated certificate" || return 0
  reboot_broken_rollout "$second" || return 0
  local broken
  broken="$(deploy_pods | awk -v good="$second" '$1 != good { print $1 }' | head -n 1)"
  reboot_node || return 0
  reboot_recover "$second" "$broken" || return 0
  rollout "kubectl rollout undo of the broken rollout, after the recovery" kcs rollout undo deployment/kube-apiserver || true
  reboot_go_back || true
  note "reports: $S/step-*.json"
}

# --- The way back to kubeadm's static apiserver (docs/runbooks/going-back.md), after everything
# above: from a Deployment whose proxy sockets were bound by the recovery instance (the
# proxies' uid), at another version than the copy saved at the migration.

GOBACK="$S/kubeadm-back"

# goback_render: kubeadm's manifest for this node from the cluster's ClusterConfiguration
# (kubeadm-config), with the documented patch, into $GOBACK/out (kubeadm's dry-run directory).
goback_render() {
  rm -rf "$GOBACK/out"
  mkdir -p "$GOBACK/patches"
  echo '[{"op": "add", "path": "/spec/containers/0/command/-", "value": "--permit-port-sharing=true"}]' \
    >"$GOBACK/patches/kube-apiserver+json.json"
  { cat <<EOF
apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
dryRun: true
localAPIEndpoint: {advertiseAddress: $NODE_IP, bindPort: 6443}
nodeRegistration: {name: $NODE_NAME}
patches: {directory: $GOBACK/patches}
---
EOF
    kcs get cm kubeadm-config -o jsonpath='{.data.ClusterConfiguration}'
  } >"$GOBACK/kubeadm.yaml"
  KUBEADM_INIT_DRYRUN_DIR="$GOBACK/out" "$S/bins/kubeadm" init phase control-plane apiserver \
    --config "$GOBACK/kubeadm.yaml" >"$GOBACK/kubeadm.log" 2>&1 && [ -s "$GOBACK/out/kube-apiserver.yaml" ]
}

# upload_kubeadm_config VERSION: kubeadm-config's ClusterConfiguration as kubeadm records it
# (`kubeadm init`, or `kubeadm upgrade apply VERSION --skip-phases control-plane`).
upload_kubeadm_config() {
  sed "s/^kubernetesVersion: .*/kubernetesVersion: $1/" "$S/kubeadm.yaml" >"$GOBACK/kubeadm-$1.yaml"
  "$S/bins/kubeadm" init phase upload-config kubeadm --config "$GOBACK/kubeadm-$1.yaml" \
    --kubeconfig "$PIVOT_ADMIN" >>"$GOBACK/upload.log" 2>&1
}

migrate_back_cmd() {
  "$S/bins/kube-apiserver-proxy" migrate-back --manifest "$GOBACK/out/kube-apiserver.yaml" \
    --static-pod-dir "$MANIFESTS" --handoff-dir "$HANDOFF_DIR" --timeout 600s
}

# only_kubeadm_listens: the one listener on port 6443 is kube-apiserver's wildcard socket.
only_kubeadm_listens() {
  local l
  l="$(listeners_6443)"
  [ "$(tr ';' '\n' <<<"$l" | grep -c .)" = 1 ] && grep -qE '^(\*|0\.0\.0\.0|\[::\]):6443 .*kube-apiserver' <<<"$l"
}

# leftovers: objects of the install still there.
leftovers() {
  local what
  for what in "validatingadmissionpolicy kube-apiserver-proxy-workload" \
    "validatingadmissionpolicy kube-apiserver-proxy-pods" \
    "validatingadmissionpolicy kube-apiserver-proxy-kubernetes-endpoints" \
    "-n kube-system role kube-apiserver-proxy:recover" \
    "-n kube-system rolebinding kube-apiserver-proxy:recover" \
    "-n kube-system deployment kube-apiserver" "-n kube-system pdb kube-apiserver" \
    "-n default endpointslice kubernetes-kube-apiserver-proxy"; do
    # shellcheck disable=SC2086 # the words are arguments
    kc get $what -o name 2>/dev/null
  done
  [ ! -e "$MANIFESTS/kube-apiserver-recovery.yaml" ] || echo "$MANIFESTS/kube-apiserver-recovery.yaml"
  [ ! -e "$CHECKPOINT_DIR" ] || echo "$CHECKPOINT_DIR"
}

reboot_go_back() {
  local saved="$S/kube-apiserver.static.yaml" t0 rc old_image
  mkdir -p "$GOBACK"
  # kubeadm-config as `kubeadm init` left it (these phases never uploaded it).
  upload_kubeadm_config "$APISERVER_VERSION" || { fail "kubeadm init phase upload-config kubeadm: $(tail -n 3 "$GOBACK/upload.log")"; return 1; }
  # An upgrade after the migration, as documented: the image, then kubeadm's record.
  old_image="$IMAGE_REPO/kube-apiserver:$OLD_APISERVER_VERSION"
  rollout "the Deployment's apiserver moved to $OLD_APISERVER_VERSION (a version other than the copy saved at the migration, $APISERVER_VERSION)" \
    kcs set image deployment/kube-apiserver "kube-apiserver=$old_image" || return 1
  # kubeadm's record not updated yet: migrate-back refuses the manifest kubeadm renders from it.
  if ! goback_render; then
    fail "kubeadm init phase control-plane apiserver (dry run) failed: $(tail -n 3 "$GOBACK/kubeadm.log")"
    return 1
  fi
  rc=0
  migrate_back_cmd >"$GOBACK/refused.log" 2>&1 || rc=$?
  if [ "$rc" = 2 ] && grep -q "the manifest runs .*:$APISERVER_VERSION but the apiserver serving now is $OLD_APISERVER_VERSION" "$GOBACK/refused.log" \
    && [ ! -e "$MANIFESTS/kube-apiserver.yaml" ]; then
    pass "migrate-back refuses kubeadm's manifest of another version than the one serving (exit 2, nothing touched): $(tail -n 1 "$GOBACK/refused.log" | cut -c1-220)"
  else
    fail "migrate-back with a manifest of $APISERVER_VERSION while $OLD_APISERVER_VERSION serves: exit $rc: $(tail -n 2 "$GOBACK/refused.log")"
  fi
  upload_kubeadm_config "$OLD_APISERVER_VERSION" || { fail "upload-config $OLD_APISERVER_VERSION: $(tail -n 3 "$GOBACK/upload.log")"; return 1; }
  if goback_render && grep -q "image: $old_image$" "$GOBACK/out/kube-apiserver.yaml"; then
    pass "kubeadm rendered kube-apiserver.yaml for $OLD_APISERVER_VERSION from kubeadm-config; it differs from the copy saved at the migration in: $(diff "$saved" "$GOBACK/out/kube-apiserver.yaml" | grep '^>' | sed 's/^> *//' | tr '\n' ' ')"
  else
    fail "kubeadm's manifest is not of $OLD_APISERVER_VERSION: $(grep 'image:' "$GOBACK/out/kube-apiserver.yaml" 2>&1) $(tail -n 2 "$GOBACK/kubeadm.log")"
    return 1
  fi

  # Reboot recovery goes first.
  mv "$MANIFESTS/kube-apiserver-recovery.yaml" "$GOBACK/"
  if wait_for 60 eval "! kubelet_knows kube-apiserver-recovery-$NODE_NAME"; then
    rm -rf "$CHECKPOINT_DIR"
    kc delete -k "$here/../../../manifests/recovery" >"$GOBACK/delete-recovery.log" 2>&1 || true
    pass "reboot recovery removed: the agent's static pod, $CHECKPOINT_DIR, manifests/recovery ($(tr '\n' ' ' <"$GOBACK/delete-recovery.log"))"
  else
    fail "the recovery agent still runs 60 s after its manifest was moved away"
  fi

  note "listeners on port 6443 before going back: $(listeners_6443)"
  log_mark goback
  step_start goback -probe 127.0.0.1:6443 -watch-endpoints || true
  step_start goback-local -kubeconfig "$MIGRATE_LOCAL_CONF" || true
  t0="$(now_ms)"
  migrate_back_cmd >"$GOBACK/migrate-back.log" 2>&1 &
  local pid=$!
  if wait_for 300 grep -q 'delete the Deployment now' "$GOBACK/migrate-back.log"; then
    pass "migrate-back: kubeadm's apiserver binds 0.0.0.0:6443 beside the proxy and is ready $(since "$t0") s after migrate-back started: $(grep -o 'migrate-back: [^=]*' "$GOBACK/migrate-back.log" | head -n 8 | sort | uniq -c | tr -s ' ' | tr '\n' ';' | cut -c1-600)"
  else
    fail "migrate-back: kubeadm's apiserver not ready within 300 s: $(tail -n 3 "$GOBACK/migrate-back.log"); listeners: $(listeners_6443)"
  fi
  note "listeners on port 6443 with both: $(listeners_6443)"
  local t1
  t1="$(now_ms)"
  kcs delete deployment kube-apiserver --wait=false >"$GOBACK/delete.log" 2>&1 || true
  kcs delete pdb kube-apiserver >>"$GOBACK/delete.log" 2>&1 || true
  if wait_for 420 eval "! kill -0 $pid 2>/dev/null"; then
    rc=0
    wait "$pid" || rc=$?
    if [ "$rc" = 0 ]; then
      pass "migrate-back done $(since "$t1") s after the Deployment's deletion (exit 0): $(grep -E 'closed with nothing reset|done:' "$GOBACK/migrate-back.log" | cut -c1-250 | tr '\n' ' ')"
    else
      fail "migrate-back exited $rc: $(tail -n 3 "$GOBACK/migrate-back.log")"
    fi
  else
    fail "migrate-back still waiting 420 s after the Deployment's deletion: $(tail -n 3 "$GOBACK/migrate-back.log"); listeners: $(listeners_6443)"
    kill "$pid" 2>/dev/null || true
  fi
  if wait_for 60 only_kubeadm_listens; then
    pass "only kubeadm's apiserver listens on port 6443: $(listeners_6443)"
  else
    fail "listeners on port 6443: $(listeners_6443)"
  fi
  # What kubernetes-endpoints added (kubeadm's lease reconciler writes the rest itself), then
  # the node's directories.
  kc -n default delete endpointslice kubernetes-kube-apiserver-proxy >"$GOBACK/delete-rest.log" 2>&1 || true
  kc delete validatingadmissionpolicybinding,validatingadmissionpolicy kube-apiserver-proxy-kubernetes-endpoints >>"$GOBACK/delete-rest.log" 2>&1 || true
  rm -rf /run/kube-apiserver-proxy /var/lib/kube-apiserver-proxy
  wait_for 15 false || true
  step_end goback "going back: client-go load on NODE_IP:6443, connects to both addresses, default/kubernetes, no controller restart (the Deployment deleted at +$(((t1 - t0) / 1000)) s)"
  step_end goback-local "going back: client-go load on 127.0.0.1:6443"
  local version
  version="$(curl -fsS --max-time 5 --cacert /etc/kubernetes/pki/ca.crt "https://$NODE_IP:6443/version" 2>&1 | "$NODECHECK" git-version 2>&1)" || true
  if [ "$version" = "$OLD_APISERVER_VERSION" ] && wait_for 120 mirror_ready kube-system "kube-apiserver-$NODE_NAME"; then
    pass "kubeadm's static apiserver serves $version (not the saved copy's $APISERVER_VERSION); its mirror pod kube-apiserver-$NODE_NAME is Ready"
  else
    fail "after going back: /version says $version; mirror pod: $(kcs get pod "kube-apiserver-$NODE_NAME" -o wide 2>&1 | tail -n 1)"
  fi
  local left
  left="$(leftovers | tr '\n' ' ')"
  if [ -z "$left" ]; then
    pass "nothing of the install is left (admission policies, Role, RoleBinding, Deployment, PodDisruptionBudget, the second EndpointSlice, the agent, the checkpoint); the Service's slices: $(kc -n default get endpointslices -l kubernetes.io/service-name=kubernetes -o name | tr '\n' ' ')"
  else
    fail "left after going back: $left"
  fi
  note "restarts after going back: $(control_plane_restarts)"
  note "controller-manager, scheduler and kubelet logs going back: $(log_error_summary goback)"
}
