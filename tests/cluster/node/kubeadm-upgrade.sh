# shellcheck shell=bash
# shellcheck disable=SC2154,SC2034 # S, NODE_IP and the rest come from smoke; what this sets, it reads
# `kubeadm upgrade` on a migrated controller (docs/runbooks/upgrade-kubernetes.md), sourced by
# `smoke --kubeadm-upgrade`: what only the node's shell does. The scenario itself (the
# migration with render and kubeadm-sync, `kubeadm upgrade apply` to $APISERVER_VERSION, etcd,
# the kubelet, `kubeadm certs renew all`, each step under load, the checks) is
# tests/cluster/internal/node/kubeadm_upgrade.go, run by smoke's `drive kubeadm-upgrade`.
#
#   - ku_init: the node made by a real `kubeadm init` of $OLD_APISERVER_VERSION (its own
#     kubeadm, kubelet, controller-manager and scheduler; the DNS addon disabled), with an
#     audit policy and an encryption configuration (aescbc) in the ClusterConfiguration's
#     apiServer extraArgs and extraVolumes;
#   - node_ku_kubelet_manifests DIR: the kubelet restarted on the agent's static pod directory
#     (the runbook's step 6, after `kubeadm-sync --once`);
#   - node_ku_kubelet_upgrade: the kubelet binary replaced by $APISERVER_VERSION's and
#     restarted on the same files.
#
# Preflight errors ignored at init, for this test node only: SystemVerification (this host has
# cgroup v1, which kubeadm refuses since 1.35; the kubelet runs with failCgroupV1: false), Swap
# and the checks of a node without systemd (see ku_init).

# ku_files: the audit policy and the encryption configuration the ClusterConfiguration names.
ku_files() {
  mkdir -p /etc/kubernetes/audit /var/log/kubernetes/audit /etc/kubernetes/encryption
  # Secrets only: the loads' requests would fill the log (and rotate it) within minutes.
  cat >/etc/kubernetes/audit/policy.yaml <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
rules:
- level: Metadata
  resources:
  - group: ""
    resources: [secrets]
- level: None
EOF
  cat >/etc/kubernetes/encryption/config.yaml <<EOF
apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: [secrets]
  providers:
  - aescbc:
      keys:
      - name: key1
        secret: $(head -c 32 /dev/urandom | base64 -w0)
  - identity: {}
EOF
  chmod 0600 /etc/kubernetes/encryption/config.yaml
}

# ku_config VERSION: kubeadm's configuration for `kubeadm init` of VERSION on this node.
ku_config() {
  cat <<EOF
apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint:
  advertiseAddress: $NODE_IP
  bindPort: 6443
nodeRegistration:
  name: $NODE_NAME
  criSocket: unix://$S/containerd/containerd.sock
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: $1
imageRepository: $IMAGE_REPO
clusterName: smoke
etcd:
  local:
    imageRepository: $IMAGE_REPO
    imageTag: $ETCD_VERSION
apiServer:
  extraArgs:
  - name: audit-policy-file
    value: /etc/kubernetes/audit/policy.yaml
  - name: audit-log-path
    value: /var/log/kubernetes/audit/audit.log
  - name: encryption-provider-config
    value: /etc/kubernetes/encryption/config.yaml
  extraVolumes:
  - name: audit
    hostPath: /etc/kubernetes/audit
    mountPath: /etc/kubernetes/audit
    readOnly: true
    pathType: DirectoryOrCreate
  - name: audit-log
    hostPath: /var/log/kubernetes/audit
    mountPath: /var/log/kubernetes/audit
    pathType: DirectoryOrCreate
  - name: encryption
    hostPath: /etc/kubernetes/encryption
    mountPath: /etc/kubernetes/encryption
    readOnly: true
    pathType: DirectoryOrCreate
dns:
  disabled: true
---
# kube-proxy in kubeadm's default mode; this netns's conntrack table is the kernel's to size.
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
conntrack:
  maxPerCore: 0
---
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
EOF
  kubelet_settings
}

# ku_init: `kubeadm init` of OLD_APISERVER_VERSION with that release's kubeadm, whole (no
# phase skipped but the disabled addons). Without systemd kubeadm cannot start the kubelet: as
# soon as kubeadm has written the kubelet's configuration, the kubelet is started the way
# kubeadm's systemd drop-in starts it (smoke's start_kubelet with KUBELET_KUBEADM=1), and
# kubeadm's wait-control-plane phase waits for it as on any node.
ku_init() {
  local t0 rc=0 v="$OLD_APISERVER_VERSION"
  ku_files
  ku_prepare
  # The node's name resolves (kubeadm's Hostname check; this netns reaches no DNS server).
  echo "$NODE_IP $NODE_NAME" >>/etc/hosts
  ku_config "$v" >"$S/kubeadm.yaml"
  # kubeadm's preflight wants IP forwarding (as kube-proxy does); this netns is the node's.
  sysctl -qw net.ipv4.ip_forward=1
  # kubeadm runs `kubelet --version` (its kubelet version check): the kubelet on its PATH.
  mkdir -p "$S/path"
  ln -sf "$S/bins/kubelet-$v" "$S/path/kubelet"
  t0="$(now_ms)"
  PATH="$S/path:$PATH" "$S/bins/kubeadm-$v" init --config "$S/kubeadm.yaml" \
    --ignore-preflight-errors="SystemVerification,Swap,Service-Kubelet" >"$S/kubeadm-init.log" 2>&1 &
  local init_pid=$!
  if ! wait_for 120 test -s /var/lib/kubelet/config.yaml -a -s /etc/kubernetes/kubelet.conf; then
    kill "$init_pid" 2>/dev/null || true
    fail "kubeadm $v init wrote no kubelet configuration within 120 s: $(tail -n 5 "$S/kubeadm-init.log" | tr '\n' '|')"
    return 1
  fi
  KUBELET_KUBEADM=1 KUBELET_BIN="$S/bins/kubelet-$v"
  start_kubelet || { kill "$init_pid" 2>/dev/null; return 1; }
  if ! wait_for 420 eval "! kill -0 $init_pid"; then
    kill "$init_pid" 2>/dev/null || true
    fail "kubeadm $v init not done within 420 s: $(tail -n 5 "$S/kubeadm-init.log" | tr '\n' '|')"
    return 1
  fi
  wait "$init_pid" || rc=$?
  if [ "$rc" = 0 ] && grep -q 'Your Kubernetes control-plane has initialized successfully' "$S/kubeadm-init.log"; then
    pass "kubeadm $v init succeeded after $(since "$t0") s (audit policy and encryption at rest in extraArgs/extraVolumes): $(grep -oE '^\[[a-z-]+\]' "$S/kubeadm-init.log" | uniq | tr -d '[]' | tr '\n' ' ')"
  else
    fail "kubeadm $v init failed (exit $rc): $(grep -iE 'error|fatal|timed out|\[WARNING' "$S/kubeadm-init.log" | tail -n 8 | cut -c1-300 | tr '\n' '|')"
    return 1
  fi
  note "kubeadm init's warnings: $(grep -E 'WARNING' "$S/kubeadm-init.log" | cut -c1-200 | tr '\n' '|')"
  # The super-admin's client certificate (group system:masters) for smoke's api().
  local key
  for key in client-certificate-data client-key-data; do
    awk -v k="$key:" '$1 == k { print $2 }' /etc/kubernetes/super-admin.conf | base64 -d >"$S/admin-$key"
  done
}

# ku_prepare: the pause image kubeadm's CreateJob preflight check runs (`pause -v`), under the
# name kubeadm gives it.
ku_prepare() {
  "${CTR[@]}" images tag "$PAUSE_IMAGE" "$IMAGE_REPO/pause:3.10.2" >/dev/null 2>&1 || true
}

# node_ku_kubelet_manifests DIR: the kubelet stopped and started again with
# --pod-manifest-path=DIR, what /etc/default/kubelet adds on a node.
node_ku_kubelet_manifests() {
  stop "$KUBELET_PID" kubelet
  KUBELET_EXTRA_FLAGS="--pod-manifest-path=$1"
  start_kubelet
}

# node_ku_kubelet_upgrade: the kubelet stopped, its binary replaced by $APISERVER_VERSION's
# (kubeadm's PATH too), started on the same files.
node_ku_kubelet_upgrade() {
  stop "$KUBELET_PID" "kubelet $OLD_APISERVER_VERSION"
  KUBELET_BIN="$S/bins/kubelet"
  ln -sf "$KUBELET_BIN" "$S/path/kubelet"
  start_kubelet
}
