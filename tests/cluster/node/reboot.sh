# shellcheck shell=bash
# shellcheck disable=SC2154 # S, CTR, CGROUP_ROOT and the rest come from smoke, which sources this
# Reboot recovery's node actions, sourced by `smoke --reboot`: what only the node's shell can
# do for the scenario (tests/cluster/internal/node/reboot.go, run by `drive reboot`), which asks
# for them as "@node ACTION ARGS...". Uses from smoke: S, CGROUP_ROOT, KUBELET_PID,
# CONTAINERD_PID, DRIVER_KEEP, pass, fail, stop, start_containerd, start_kubelet.

# node_kubelet_stop: the kubelet stopped (SIGTERM), its pods left running.
node_kubelet_stop() {
  [ -n "${KUBELET_PID:-}" ] || return 0
  stop "$KUBELET_PID" kubelet
  KUBELET_PID=""
}

# node_kubelet_start [NAME=VALUE...]: the kubelet started (smoke's start_kubelet), with the
# settings given first; kept for its later starts. KUBELET_CERT_DIR: its --cert-dir;
# KUBELET_ROTATE_CERTIFICATES: its rotateCertificates.
node_kubelet_start() {
  local kv
  # shellcheck disable=SC2034 # read by start_kubelet in smoke
  for kv in "$@"; do
    case "$kv" in
      KUBELET_CERT_DIR=*) KUBELET_CERT_DIR="${kv#*=}" ;;
      KUBELET_ROTATE_CERTIFICATES=*) KUBELET_ROTATE_CERTIFICATES="${kv#*=}" ;;
      *)
        fail "kubelet_start: unknown setting $kv"
        return 2
        ;;
    esac
  done
  start_kubelet
}

# node_containerd_start: containerd started (smoke's start_containerd).
node_containerd_start() { start_containerd; }

# node_reboot: what a power cycle leaves of the node. Every process of the namespaces but this
# shell and the scenario's driver killed (SIGKILL: kubelet, containerd, shims, every container,
# etcd included); the mounts of the pods' volumes and root file systems, and what lives in /run
# and in the runtime's state, dropped; the pods' cgroups removed. Kept: etcd's data,
# /etc/kubernetes, /var/lib/kubelet, the images, the checkpoint directory. The directories
# systemd-tmpfiles creates at boot are the scenario's to create again.
node_reboot() {
  local keep=" 1 $$ $BASHPID ${DRIVER_KEEP:-} " p pid left t0 deadline=$((SECONDS + 120))
  t0="$(now_ms)"
  # SIGKILL until none is left (a process may fork while it is being killed), 120 s at most:
  # exiting takes seconds on a machine another run shares.
  while :; do
    left=()
    for p in /proc/[0-9]*; do
      pid="${p#/proc/}"
      case "$keep" in *" $pid "*) continue ;; esac
      [ "$(awk '/^State:/ { print $2 }' "$p/status" 2>/dev/null)" != Z ] || continue
      [ -e "$p/status" ] || continue
      left+=("$pid")
    done
    if [ ${#left[@]} -eq 0 ] || [ "$SECONDS" -ge "$deadline" ]; then break; fi
    kill -KILL "${left[@]}" 2>/dev/null || true
    sleep 0.1
  done
  wait "$KUBELET_PID" "$CONTAINERD_PID" 2>/dev/null || true
  KUBELET_PID="" CONTAINERD_PID=""
  if [ ${#left[@]} -gt 0 ]; then
    local what="" pid
    for pid in "${left[@]}"; do what+=" $pid ($(cat "/proc/$pid/comm" 2>/dev/null || echo gone))"; done
    fail "reboot: processes still alive 120 s after SIGKILL:$what"
    return 1
  fi
  local killed
  killed="$(since "$t0")"
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
  # The pods' cgroups are gone after a boot (the cgroup root itself is this test's): each
  # removed once its killed processes have left it (smoke's rm_cgroups).
  local h roots=()
  for h in /sys/fs/cgroup/*/; do
    [ ! -d "${h%/}$CGROUP_ROOT" ] || roots+=("${h%/}$CGROUP_ROOT")
  done
  if ! rm_cgroups 60 1 "${roots[@]}"; then
    fail "reboot: pod cgroups not empty 60 s after SIGKILL: $CGROUPS_LEFT"
    return 1
  fi
  pass "reboot: every node process killed (SIGKILL, all gone after $killed s) but the scenario's driver, $n mounts of pods and /run dropped, /run and the runtime's state emptied, pod cgroups removed (empty after $CGROUPS_WAITED s); kept: etcd data, /etc/kubernetes, /var/lib/kubelet, images, /var/lib/kube-apiserver-proxy/checkpoint"
}
