# shellcheck shell=bash
# shellcheck disable=SC2154,SC2034 # here, S, NODE_IP and the rest come from smoke, pivot.sh, migrate.sh; what this sets, they read
# `kubeadm upgrade` on a migrated controller (docs/runbooks/upgrade-kubernetes.md), sourced by
# `smoke --kubeadm-upgrade`:
#
#   0. the node is made by a real `kubeadm init` of $OLD_APISERVER_VERSION (ku_init: its own
#      kubeadm, kubelet, controller-manager and scheduler; the DNS and kube-proxy addons
#      disabled), with an audit policy and an encryption configuration (aescbc) in the
#      ClusterConfiguration's apiServer extraArgs and extraVolumes; a Secret is written;
#   1. the migration as the runbook says it: `render --static-pod` of kubeadm's manifest,
#      `migrate`, `kubectl apply` of render's stream, then the static pods handed to
#      `kubeadm-sync --once` and the kubelet restarted on /etc/kubernetes/kubelet-manifests
#      (nothing but kubeadm's apiserver may restart);
#   2. `kubeadm upgrade plan` and `kubeadm upgrade apply $APISERVER_VERSION` with kubeadm
#      $APISERVER_VERSION, unpatched: the apiserver (a surge rollout of the Deployment), the
#      controller-manager and the scheduler (static pods) move to the new minor;
#   3. etcd: the pinned etcd imageTag set to $KU_ETCD_VERSION in kubeadm-config and `kubeadm
#      upgrade apply` again, which upgrades etcd alone (measured: etcd restarts);
#   4. the kubelet binary replaced by $APISERVER_VERSION's and restarted: the static pods must
#      keep running (the agent's copies carry their UIDs);
#   5. a third `kubeadm upgrade apply $APISERVER_VERSION`: a no-op;
#   6. `kubeadm certs renew all`: the agent rolls the Deployment.
#
# Afterwards: the new apiserver writes the audit log, the Secret written before is still
# readable and stored encrypted in etcd, `kubectl version` shows the new server version, etcd
# runs $KU_ETCD_VERSION. Each step is judged by cmd/loadgen (pivot.sh's step_start): connects
# to NODE_IP:6443 and 127.0.0.1:6443 every 20 ms, two client-go loads (one per address) held
# to the tier's strict criteria, the `kubernetes` endpoints watcher, and in the steps that do
# not upgrade them the controller-manager and the scheduler (no restart). Step 3 reports
# without failing (-report-only): what etcd's restart costs is measured and printed. A
# per-step table closes the mode: requests, failed, refused connects, relists.
#
# Preflight errors ignored, for this test node only: kubeadm's CoreDNS checks (CoreDNS is not
# installed here) and SystemVerification (this host has cgroup v1, which kubeadm refuses since
# 1.35; the kubelet runs with failCgroupV1: false); at init also Swap and the checks of a
# node without systemd (see ku_init).

KU_SYNC_DIR=/etc/kubernetes/kubelet-manifests
KU_IGNORE=CoreDNSMigration,CoreDNSUnsupportedPlugins,SystemVerification

# The Deployment's pods by their own labels (render leaves `component` to kubeadm's pod).
deploy_pods() {
  kcs get pods -l app.kubernetes.io/name=kube-apiserver,pod-template-hash \
    -o custom-columns=NAME:.metadata.name,PHASE:.status.phase,READY:.status.containerStatuses[*].ready,RESTARTS:.status.containerStatuses[*].restartCount,WAITING:.status.containerStatuses[*].state.waiting.reason --no-headers 2>&1
}

# ku_container_ids: "name id" of the running etcd, controller-manager and scheduler containers.
ku_container_ids() {
  local c
  for c in etcd kube-controller-manager kube-scheduler; do
    printf '%s %s; ' "$c" "$(kcs get pod "$c-$NODE_NAME" -o jsonpath='{.status.containerStatuses[0].containerID}' 2>&1 | cut -c1-24)"
  done
}

# ku_generation: the Deployment's metadata.generation.
ku_generation() { kcs get deploy kube-apiserver -o jsonpath='{.metadata.generation}' 2>/dev/null; }

# ku_standin_hash: the kubernetes.io/config.hash of kube-apiserver-NODE.
ku_standin_hash() {
  kcs get pod "kube-apiserver-$NODE_NAME" -o jsonpath='{.metadata.annotations.kubernetes\.io/config\.hash}' 2>/dev/null
}

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
  INIT_VERSION="$v"
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

# ku_etcd_value KEY: the first bytes of KEY's value as stored in etcd (its JSON gateway, with
# the apiserver's etcd client certificate), printed as Python prints bytes.
ku_etcd_value() {
  local pki=/etc/kubernetes/pki
  curl -fsS --max-time 5 --cacert "$pki/etcd/ca.crt" --cert "$pki/apiserver-etcd-client.crt" \
    --key "$pki/apiserver-etcd-client.key" -X POST "https://127.0.0.1:2379/v3/kv/range" \
    -d "{\"key\": \"$(printf '%s' "$1" | base64 -w0)\"}" | "$NODECHECK" etcd-value
}

# ku_secret_check WHEN: the Secret written after init reads back, and etcd holds it encrypted
# with the aescbc key of the encryption configuration.
ku_secret_check() {
  local got stored
  got="$(kc -n default get secret ku-before-upgrade -o jsonpath='{.data.word}' 2>&1 | base64 -d 2>/dev/null)"
  stored="$(ku_etcd_value /registry/secrets/default/ku-before-upgrade 2>&1)"
  if [ "$got" = kept ] && [[ "$stored" == "b'k8s:enc:aescbc:v1:key1:"* ]]; then
    pass "$1: the Secret written after kubeadm init reads back ('$got'), stored encrypted in etcd: $stored..."
  else
    fail "$1: the Secret reads '$got', etcd holds: $stored"
  fi
}

# ku_pods_images: image of each static pod's container (etcd, controller-manager, scheduler)
# and of the Deployment's apiserver.
ku_images() {
  local c
  for c in etcd kube-controller-manager kube-scheduler; do
    printf '%s ' "$(kcs get pod "$c-$NODE_NAME" -o jsonpath='{.spec.containers[0].image}' 2>&1 | sed 's|.*/||')"
  done
  kcs get deploy kube-apiserver -o jsonpath='{.spec.template.spec.containers[?(@.name=="kube-apiserver")].image}' 2>&1 | sed 's|.*/||'
}

# ku_prepare: the pause image kubeadm's CreateJob preflight check runs (`pause -v`), under the
# name kubeadm gives it.
ku_prepare() {
  "${CTR[@]}" images tag "$PAUSE_IMAGE" "$IMAGE_REPO/pause:3.10.2" >/dev/null 2>&1 || true
}

ku_render() {
  if "$S/bins/kube-apiserver-proxy" render --static-pod "$MANIFESTS/kube-apiserver.yaml" \
    --proxy-image "$PROXY_IMAGE" >"$S/deployment.yaml" 2>"$S/render.err"; then
    pass "kube-apiserver-proxy render --static-pod $MANIFESTS/kube-apiserver.yaml: $(grep -c '^kind:' "$S/deployment.yaml") objects, apiserver image $(grep -m1 'image: .*kube-apiserver:' "$S/deployment.yaml" | sed 's/.*image: //')"
  else
    fail "render failed: $(cat "$S/render.err")"
    return 1
  fi
}

# ku_handoff: the runbook's step 6, first form: kubeadm-sync --once, the kubelet on its
# directory.
ku_handoff() {
  local before after t0
  before="$(ku_container_ids)"
  t0="$(now_ms)"
  # --once sets kubeadm's manifest aside and returns once kubeadm's apiserver has exited.
  if "$S/bins/kube-apiserver-proxy" kubeadm-sync --once --node-name "$NODE_NAME" \
    --proxy-image "$PROXY_IMAGE" >"$S/kubeadm-sync-once.log" 2>&1 && wildcard_gone; then
    pass "kubeadm-sync --once after $(since "$t0") s, kubeadm's static apiserver gone: $(ls "$KU_SYNC_DIR" | tr '\n' ' ')"
  else
    fail "kubeadm-sync --once failed: $(tail -n 5 "$S/kubeadm-sync-once.log")"
    return 1
  fi
  stop "$KUBELET_PID" kubelet
  KUBELET_EXTRA_FLAGS="--pod-manifest-path=$KU_SYNC_DIR"
  start_kubelet || return 1
  if wait_for 120 test -f "$MANIFESTS/kube-apiserver.yaml"; then
    pass "kubelet on $KU_SYNC_DIR, the agent runs and put kubeadm's manifest back $(since "$t0") s after kubeadm-sync --once"
  else
    fail "kubeadm's manifest not back in $MANIFESTS: $(ls -a "$MANIFESTS" | tr '\n' ' ')"
  fi
  if wait_for 120 mirror_ready kube-system "kube-apiserver-$NODE_NAME"; then
    pass "the agent's mirror pod kube-system/kube-apiserver-$NODE_NAME is Ready: labels $(kcs get pod "kube-apiserver-$NODE_NAME" -o jsonpath='{.metadata.labels}'), image $(kcs get pod "kube-apiserver-$NODE_NAME" -o jsonpath='{.spec.containers[0].image}')"
  else
    fail "kube-apiserver-$NODE_NAME not Ready: $(kcs get pod "kube-apiserver-$NODE_NAME" -o wide 2>&1 | tail -n 1)"
  fi
  after="$(ku_container_ids)"
  if [ "$before" = "$after" ]; then
    pass "etcd, controller-manager and scheduler kept running across the kubelet's move: $after"
  else
    fail "static pods restarted by the kubelet's move: before $before after $after"
  fi
}

# The client inside a pod: cmd/loadgen in a pod on the pod network, as a ServiceAccount bound
# to cluster-admin, whose kubeconfig names the `kubernetes` Service's address (10.96.0.1:443,
# through kube-proxy's rules) with the pod's token. Its report lands on the node.
KU_POD_REPORTS=/var/lib/ku-loadgen
ku_pod_setup() {
  mkdir -p "$KU_POD_REPORTS"
  kc apply -f - >"$S/ku-pod-setup.log" 2>&1 <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: ku-loadgen, namespace: default}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: ku-loadgen}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-admin}
subjects: [{kind: ServiceAccount, name: ku-loadgen, namespace: default}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: ku-loadgen, namespace: default}
data:
  kubeconfig: |
    apiVersion: v1
    kind: Config
    clusters:
    - name: service
      cluster:
        server: https://10.96.0.1:443
        certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
    users:
    - name: pod
      user:
        tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
    contexts:
    - name: pod
      context: {cluster: service, user: pod}
    current-context: pod
EOF
}

# ku_pod_start NAME: the pod's load for step NAME; ready once its load runs.
ku_pod_start() {
  rm -f "$KU_POD_REPORTS/$1.json" "$KU_POD_REPORTS/$1.ready"
  kc apply -f - >>"$S/ku-pod-setup.log" 2>&1 <<EOF
apiVersion: v1
kind: Pod
metadata: {name: ku-loadgen-$1, namespace: default}
spec:
  nodeName: $NODE_NAME
  serviceAccountName: ku-loadgen
  terminationGracePeriodSeconds: 90
  tolerations: [{operator: Exists}]
  containers:
  - name: loadgen
    image: $IMAGE_REPO/loadgen:dev
    imagePullPolicy: Never
    args: [-kubeconfig, /etc/ku-loadgen/kubeconfig, -out, /reports/$1.json, -ready, /reports/$1.ready]
    # A share of the CPU like the node's loads (a BestEffort pod gets 2 of 1024 shares, and
    # starves while a new apiserver starts on this 2-core node).
    resources:
      requests: {cpu: 500m, memory: 64Mi}
    volumeMounts:
    - {name: kubeconfig, mountPath: /etc/ku-loadgen}
    - {name: reports, mountPath: /reports}
  volumes:
  - name: kubeconfig
    configMap: {name: ku-loadgen}
  - name: reports
    hostPath: {path: $KU_POD_REPORTS, type: Directory}
EOF
  if wait_for 180 test -f "$KU_POD_REPORTS/$1.ready"; then
    return 0
  fi
  fail "$1: the load in a pod did not start within 180 s: $(kc -n default get pod "ku-loadgen-$1" -o wide 2>&1 | tail -n 1) $(kc -n default logs "ku-loadgen-$1" --tail=3 2>&1 | tr '\n' ' ')"
  return 1
}

# ku_pod_end NAME WHAT [report-only]: the pod deleted (SIGTERM: the load reports), its report
# judged like the node's loads: pass without problems, else fail (or a note, report-only).
ku_pod_end() {
  kc -n default delete pod "ku-loadgen-$1" --wait=false >/dev/null 2>&1
  if ! wait_for 120 test -s "$KU_POD_REPORTS/$1.json"; then
    fail "$2 (in a pod, through the kubernetes Service): no report within 120 s: $(kc -n default logs "ku-loadgen-$1" --tail=3 2>&1 | tr '\n' ' ')"
    return 0
  fi
  cp "$KU_POD_REPORTS/$1.json" "$S/step-$1-pod.json"
  local _s requests=0 failed=0 _r _b relists=0 _c problems what
  read -r _s requests failed _r _b relists _c problems < <(ku_report "$S/step-$1-pod.json") || problems="not a report"
  what="$2 (in a pod, through the kubernetes Service): load $((requests - failed)) requests ok, $failed failed; relists $relists; problems: $problems"
  if [ "$problems" = none ]; then
    pass "$what"
  elif [ "${3:-}" = report-only ]; then
    note "$what"
  else
    fail "$what"
  fi
}

# ku_step NAME [WATCH FLAGS...]: pivot.sh's step_start on both addresses (the load on
# NODE_IP:6443 with the prober of both addresses and the endpoints watcher, a second load on
# 127.0.0.1:6443); WATCH FLAGS, when given, replace STEP_WATCH for this step (a step that
# restarts the controllers does not watch them). ku_step_end NAME WHAT: their verdicts.
ku_step() {
  local name="$1"
  shift
  # shellcheck disable=SC2178 # step_start reads this array (bash's dynamic scope)
  [ $# = 0 ] || local -a STEP_WATCH=("$@")
  log_mark "$name"
  step_start "$name" -probe 127.0.0.1:6443 -watch-endpoints || true
  step_start "$name-local" -kubeconfig "$MIGRATE_LOCAL_CONF" || true
  [ -z "${KU_POD:-}" ] || ku_pod_start "$name" || true
}
ku_step_end() {
  step_end "$1" "$2 (NODE_IP:6443)"
  step_end "$1-local" "$2 (127.0.0.1:6443)"
  [ -z "${KU_POD:-}" ] || ku_pod_end "$1" "$2" "${3:-}"
  note "$2: controller-manager, scheduler and kubelet logs: $(log_error_summary "$1")"
}

# ku_migrate_check NAME: the step's report: no refused or failed connect of the probers, no
# failed request (client-go's retries included: what a client saw).
ku_migrate_check() {
  local _s _q failed _r bad _l _c problems
  if ! read -r _s _q failed _r bad _l _c problems < <(ku_report "$S/step-$1.json"); then
    fail "the migration ($1): no report"
  elif [ "$bad" = 0 ] && [ "$failed" = 0 ]; then
    pass "the migration ($1): 0 refused or failed connects, 0 failed requests; reported besides: $problems"
  else
    fail "the migration ($1): $bad refused or failed connects, $failed failed requests; reported: $problems"
  fi
}

# ku_apply WHAT LOG: `kubeadm upgrade apply $APISERVER_VERSION` with kubeadm $APISERVER_VERSION;
# sets KU_SECONDS, KU_GEN_DELTA (new generations of the Deployment), KU_HASH_CHANGED (the
# stand-in's hash kubeadm waits on).
ku_apply() {
  local what="$1" t0 gen0 hash0 rc=0
  gen0="$(ku_generation)"
  hash0="$(ku_standin_hash)"
  t0="$(now_ms)"
  PATH="$S/path:$PATH" "$S/bins/kubeadm" upgrade apply "$APISERVER_VERSION" -y --ignore-preflight-errors="$KU_IGNORE" \
    >"$S/kubeadm-$2.log" 2>&1 || rc=$?
  KU_SECONDS="$(since "$t0")"
  KU_GEN_DELTA=$(($(ku_generation) - gen0))
  KU_HASH_CHANGED=$([ "$(ku_standin_hash)" != "$hash0" ] && echo yes || echo no)
  note "$what: kubeadm said: $(grep -E '^\[upgrade' "$S/kubeadm-$2.log" | grep -E 'kube-apiserver|kube-controller|kube-scheduler|etcd|SUCCESS|equal|Restarting' | cut -c1-160 | tr '\n' '|')"
  return "$rc"
}

# ku_static_settled: every static pod the kubelet runs is the one its mirror pod shows (the
# kubelet's UID in the mirror's kubernetes.io/config.mirror), once, and Ready. A kubelet of
# another minor computes other UIDs for the same files and replaces every static pod: this is
# when it is done.
ku_static_settled() {
  local kubelet mirrors
  kubelet="$(pod_json)" && mirrors="$(kcs get pods -o json)" || return 1
  "$NODECHECK" static-settled "$kubelet" "$mirrors"
}

# ku_etcd_down NAME: from the kubelet's log since log_mark NAME, how long etcd was down: from
# the kubelet's first kill of an etcd container to etcd's next Ready (readiness probe), with
# the start of the new container between; "not restarted" when the kubelet killed none.
ku_etcd_down() {
  local from
  from="$(awk -v f="$S/kubelet.log" '$1 == f { print $2 }' "$S/logmark-$1")"
  tail -n +"$((${from:-0} + 1))" "$S/kubelet.log" | "$NODECHECK" etcd-down
}

# ku_audited NAME SINCE: the audit log (rotated files too) has a request for an object NAME
# received at or after SINCE (UTC, seconds).
ku_audited() {
  cat /var/log/kubernetes/audit/*.log 2>/dev/null | "$NODECHECK" audited "$1" "$2"
}

# ku_report FILE: what a loadgen report says, on one line: seconds, requests, failed requests,
# refused connects, failed connects of any kind, relists, cut watches, then its problems ("none"
# when it has none). Fails when FILE is not a report.
ku_report() {
  "$NODECHECK" report "$1" 2>/dev/null
}

# ku_step_table NAME...: one line per step and client (node address, 127.0.0.1, the pod):
# seconds, requests, failed, refused connects, relists, watch cuts.
ku_step_table() {
  local name suffix client seconds requests failed refused _ relists cut
  printf '# %-22s %8s %9s %7s %8s %8s %8s\n' step seconds requests failed refused relists cut
  for name in "$@"; do
    for suffix in "" -local -pod; do
      case "$suffix" in "") client=NODE_IP ;; -local) client=127.0.0.1 ;; -pod) client=pod ;; esac
      if read -r seconds requests failed refused _ relists cut _ < <(ku_report "$S/step-$name$suffix.json"); then
        printf '# %-22s %8s %9s %7s %8s %8s %8s\n' "$name ($client)" "$seconds" "$requests" "$failed" "$refused" "$relists" "$cut"
      elif [ "$suffix" != -pod ]; then
        printf '# %-22s no report\n' "$name$suffix"
      fi
    done
  done
}

# ku_migrate: migrate.sh's migration with observers that report (see run_kubeadm_upgrade).
ku_migrate() {
  local -a STEP_WATCH=(-probe "$NODE_IP:6443" -report-only)
  migrate
}

run_kubeadm_upgrade() {
  pivot_prepare_node || return 0
  kc -n default create secret generic ku-before-upgrade --from-literal=word=kept >/dev/null 2>&1 \
    || { fail "kubectl create secret: $(kc -n default create secret generic ku-before-upgrade --from-literal=word=kept 2>&1)"; return 0; }
  ku_secret_check "after kubeadm init ($OLD_APISERVER_VERSION)"
  ku_render || return 0
  migrate_local_kubeconfig || return 0
  # migrate.sh's migration, with render's stream (endpoints, Deployment, budget) as what is
  # applied, and the runbook's step 6 (first form) instead of moving the manifest away.
  migrate_static_step() { ku_handoff; }
  # The migration is judged strictly by `smoke --migrate`; here it is the way to the upgrade,
  # and its observers report (-report-only) while this mode asserts what the runbook's step 6
  # must keep: no refused connect and no failed request (ku_migrate_check). What they may
  # report besides: kubeadm's own apiserver, stopping with kubeadm's flags (no shutdown delay),
  # answers a few retried requests of connections made to it before the migration with 503
  # and resets one (rehearsed: 1 run of 2, as with the manifest moved away by hand); and a
  # restarted kubelet runs the static pods' start-up probes again, so kube-scheduler's mirror
  # pod turns unready once for a few seconds, its container untouched (ku_handoff compares
  # the containers' IDs).
  ku_migrate || return 0
  ku_migrate_check migrate
  ku_migrate_check migrate-local
  note "kubeadm-sync's log: $(kcs logs "kube-apiserver-$NODE_NAME" -c kube-apiserver --tail=5 2>&1 | tr '\n' '|' | cut -c1-600)"
  note "images before the upgrade (etcd, controller-manager, scheduler, apiserver): $(ku_images)"

  # kube-proxy (kubeadm's addon) and a client in a pod through the kubernetes Service.
  if wait_for 120 eval '[ "$(kcs get ds kube-proxy -o jsonpath="{.status.numberReady}")" = 1 ]' \
    && wait_for 60 eval 'iptables -t nat -S KUBE-SERVICES 2>/dev/null | grep -q "10.96.0.1/32"' && ku_pod_setup; then
    pass "kube-proxy $(kcs get ds kube-proxy -o jsonpath='{.spec.template.spec.containers[0].image}' | sed 's|.*:||') (kubeadm's addon, iptables mode) ready, 10.96.0.1 in its rules"
    KU_POD=1
  else
    fail "kube-proxy not ready or no rule for 10.96.0.1: $(kcs get pods -l k8s-app=kube-proxy -o wide 2>&1 | tail -n 1) $(kcs logs -l k8s-app=kube-proxy --tail=5 2>&1 | tr '\n' ' ' | cut -c1-600) $(cat "$S/ku-pod-setup.log" 2>/dev/null)"
  fi

  # 2. The minor upgrade of the control plane. kubeadm restarts the controller-manager and
  # the scheduler: this step does not watch them for restarts.
  if PATH="$S/path:$PATH" "$S/bins/kubeadm" upgrade plan "$APISERVER_VERSION" --ignore-preflight-errors="$KU_IGNORE" >"$S/kubeadm-plan.log" 2>&1 \
    && grep -qE "kube-apiserver +.*$OLD_APISERVER_VERSION +$APISERVER_VERSION" "$S/kubeadm-plan.log"; then
    pass "kubeadm upgrade plan $APISERVER_VERSION: $(grep -E '^(kube-apiserver|kube-controller-manager|kube-scheduler|etcd) ' "$S/kubeadm-plan.log" | tr -s ' ' | tr '\n' '|')"
  else
    fail "kubeadm upgrade plan $APISERVER_VERSION: $(grep -iE 'error|kube-apiserver' "$S/kubeadm-plan.log" | head -n 5 | cut -c1-300 | tr '\n' '|')"
  fi
  ku_step upgrade -probe "$NODE_IP:6443"
  if ku_apply "kubeadm upgrade apply $APISERVER_VERSION" upgrade; then
    pass "kubeadm upgrade apply $APISERVER_VERSION from $OLD_APISERVER_VERSION, unpatched, succeeded after $KU_SECONDS s; the Deployment rolled ($KU_GEN_DELTA new generations), kube-apiserver-$NODE_NAME's hash changed: $KU_HASH_CHANGED"
  else
    fail "kubeadm upgrade apply $APISERVER_VERSION failed after $KU_SECONDS s: $(grep -iE 'error|fatal|timed out' "$S/kubeadm-upgrade.log" | tail -n 5 | cut -c1-300 | tr '\n' '|')"
  fi
  ku_step_end upgrade "kubeadm upgrade apply $APISERVER_VERSION (apiserver, controller-manager, scheduler; etcd's certificates renewed)"
  note "the upgrade: $(ku_etcd_down upgrade)"
  local images
  images="$(ku_images)"
  if [[ "$images" == "etcd:$ETCD_VERSION kube-controller-manager:$APISERVER_VERSION kube-scheduler:$APISERVER_VERSION kube-apiserver:$APISERVER_VERSION" ]] \
    && wait_for 60 mirror_ready kube-system "kube-controller-manager-$NODE_NAME" \
    && wait_for 60 mirror_ready kube-system "kube-scheduler-$NODE_NAME"; then
    pass "after the upgrade: $images (etcd pinned by imageTag: kubeadm kept it)"
  else
    fail "after the upgrade, images (etcd, controller-manager, scheduler, apiserver): $images"
  fi

  if wait_for 120 eval '[ "$(kcs get ds kube-proxy -o jsonpath="{.spec.template.spec.containers[0].image}")" = "$IMAGE_REPO/kube-proxy:$APISERVER_VERSION" ] && [ "$(kcs get ds kube-proxy -o jsonpath="{.status.updatedNumberScheduled}/{.status.numberReady}")" = 1/1 ]'; then
    pass "kubeadm upgraded kube-proxy to $APISERVER_VERSION (its DaemonSet rolled, ready)"
  else
    fail "kube-proxy after the upgrade: $(kcs get ds kube-proxy -o wide 2>&1 | tail -n 1)"
  fi

  # 3. etcd: a pinned imageTag is the operator's to move (docs/runbooks/upgrade-kubernetes.md).
  local etcd_id
  etcd_id="$(ku_container_ids)"
  if kcs get cm kubeadm-config -o json | "$NODECHECK" replace-image-tag "$ETCD_VERSION" "$KU_ETCD_VERSION" \
    | kc replace -f - >/dev/null 2>"$S/etcd-tag.err"; then
    note "kubeadm-config: etcd imageTag $ETCD_VERSION -> $KU_ETCD_VERSION"
  else
    fail "kubeadm-config's etcd imageTag not changed: $(cat "$S/etcd-tag.err")"
  fi
  ku_step etcd -probe "$NODE_IP:6443" -report-only
  if ku_apply "kubeadm upgrade apply $APISERVER_VERSION (etcd $KU_ETCD_VERSION)" etcd && [ "$KU_GEN_DELTA" = 0 ] \
    && [ "$(kcs get pod "etcd-$NODE_NAME" -o jsonpath='{.spec.containers[0].image}')" = "$IMAGE_REPO/etcd:$KU_ETCD_VERSION" ]; then
    pass "kubeadm upgrade apply upgraded etcd to $KU_ETCD_VERSION after $KU_SECONDS s, the apiserver untouched (no new generation): $(ku_etcd_down etcd); containers before: $etcd_id after: $(ku_container_ids)"
  else
    fail "the etcd upgrade: generation delta $KU_GEN_DELTA, etcd image $(kcs get pod "etcd-$NODE_NAME" -o jsonpath='{.spec.containers[0].image}' 2>&1): $(grep -iE 'error|fatal|timed out' "$S/kubeadm-etcd.log" | tail -n 3 | cut -c1-300 | tr '\n' '|')"
  fi
  ku_step_end etcd "etcd's upgrade (measured, not asserted)" report-only

  # 4. The kubelet binary: stopped, replaced, started on the same files. The agent's copies
  # carry their UIDs, so the kubelet of the new minor keeps every static pod (without them it
  # would replace each, etcd's too: tests/cluster/node/README.md). A restarted kubelet runs
  # the start-up probes again, so a mirror pod may turn unready for a moment, its container
  # untouched: the step compares the containers' IDs instead of watching Ready.
  ku_step kubelet -probe "$NODE_IP:6443"
  local t0 before
  before="$(ku_container_ids)"
  t0="$(now_ms)"
  stop "$KUBELET_PID" "kubelet $OLD_APISERVER_VERSION"
  KUBELET_BIN="$S/bins/kubelet"
  ln -sf "$KUBELET_BIN" "$S/path/kubelet"
  if start_kubelet && wait_for 120 eval '[ "$(kc get node "$NODE_NAME" -o jsonpath="{.status.nodeInfo.kubeletVersion}")" = "$APISERVER_VERSION" ]' \
    && wait_for 120 node_ready; then
    pass "the kubelet upgraded to $APISERVER_VERSION: node Ready again after $(since "$t0") s; containers before: $before after: $(ku_container_ids)"
  else
    fail "the kubelet upgrade: node $(kc get node "$NODE_NAME" -o jsonpath='{.status.nodeInfo.kubeletVersion}' 2>&1), $(node_status)"
  fi
  t0="$(now_ms)"
  if wait_for 300 ku_static_settled && wait_for 120 deploy_ready && [ "$(ku_container_ids)" = "$before" ]; then
    pass "every static pod kept by the new kubelet, Ready ($(ku_etcd_down kubelet)): containers $before"
  else
    fail "the static pods after the new kubelet ($(ku_etcd_down kubelet)): containers before $before now $(ku_container_ids); $(kcs get pods -o wide 2>&1 | tr -s ' ' | tr '\n' '|')"
  fi
  ku_step_end kubelet "the kubelet's upgrade"

  # 5. Again: nothing to do.
  ku_step again
  if ku_apply "third kubeadm upgrade apply $APISERVER_VERSION" again && [ "$KU_GEN_DELTA" = 0 ] \
    && grep -q 'Current and new manifests of kube-apiserver are equal' "$S/kubeadm-again.log"; then
    pass "kubeadm upgrade apply $APISERVER_VERSION once more is a no-op for the apiserver ($KU_SECONDS s, no new generation)"
  else
    fail "kubeadm upgrade apply once more: rc or changes (generation delta $KU_GEN_DELTA): $(tail -n 3 "$S/kubeadm-again.log" | tr '\n' '|')"
  fi
  ku_step_end again "the no-op kubeadm upgrade apply"

  # 6. Certificates.
  ku_step renew
  local gen0
  gen0="$(ku_generation)"
  t0="$(now_ms)"
  if "$S/bins/kubeadm" certs renew all >"$S/kubeadm-renew.log" 2>&1 \
    && wait_for 240 eval '[ "$(ku_generation)" != "$gen0" ] && deploy_ready && one_pod_left'; then
    pass "kubeadm certs renew all: the agent rolled the Deployment, done after $(since "$t0") s"
  else
    fail "kubeadm certs renew all: no rollout of the Deployment within 240 s: $(tail -n 2 "$S/kubeadm-renew.log" | tr '\n' '|')"
  fi
  ku_step_end renew "kubeadm certs renew all"

  # What the upgrade must have kept.
  local server since
  server="$(kc version -o json 2>/dev/null | "$NODECHECK" git-version 2>&1)"
  if [ "$server" = "$APISERVER_VERSION" ]; then
    pass "kubectl version: server $server"
  else
    fail "kubectl version: server $server, not $APISERVER_VERSION"
  fi
  ku_secret_check "after the upgrade to $APISERVER_VERSION"
  since="$(date -u +%Y-%m-%dT%H:%M:%S)"
  kc -n default get secret ku-before-upgrade -o name >/dev/null 2>&1 || true
  if kcs get deploy kube-apiserver -o jsonpath='{.spec.template.spec.containers[0].args}' | grep -q 'audit-policy-file=/etc/kubernetes/audit/policy.yaml' \
    && wait_for 30 ku_audited ku-before-upgrade "$since"; then
    pass "the $APISERVER_VERSION apiserver writes the audit log: a read of the Secret after the upgrade is in it"
  else
    fail "no audit record of the read after the upgrade: $(ls -la /var/log/kubernetes/audit 2>&1 | tr '\n' ' ')"
  fi
  note "per step (load through both addresses):"
  ku_step_table migrate upgrade etcd kubelet again renew
  note "reports: $S/kubeadm-*.log, $S/step-*.json"
}
