# shellcheck shell=bash
# shellcheck disable=SC2154 # here, S, NODE_IP and the rest come from smoke, pivot.sh, migrate.sh
# `kubeadm upgrade` on a migrated controller (docs/operations.md, "Upgrading Kubernetes on a
# migrated controller"), sourced by `smoke --kubeadm-upgrade` after pivot.sh and migrate.sh,
# whose helpers it uses, once the kubeadm-made control plane (v1.37.2) runs:
#
#   1. the migration as the runbook says it: `render --static-pod` of kubeadm's manifest,
#      `migrate`, `kubectl apply` of render's stream, then the static pods handed to
#      `kubeadm-sync --once` and the kubelet restarted on /etc/kubernetes/kubelet-manifests
#      (nothing but kubeadm's apiserver may restart);
#   2. an audit policy added to kubeadm's ClusterConfiguration (extraArgs, extraVolumes), and
#      `kubeadm upgrade apply v1.37.2`, unpatched: it must succeed, the Deployment must roll
#      (surge) to kubeadm's new manifest, the new apiserver must write the audit log;
#   3. a second `kubeadm upgrade apply v1.37.2`: a no-op for the apiserver;
#   4. `kubeadm certs renew all`: the agent rolls the Deployment.
#
# Each step is judged by cmd/loadgen (pivot.sh's step_start): connects to NODE_IP:6443 and
# 127.0.0.1:6443 every 20 ms, two client-go loads (one per address) held to the tier's strict
# criteria, the `kubernetes` endpoints watcher, the controller-manager and the scheduler (no
# restart). Preflight errors ignored, for this
# test node only: kubeadm's CoreDNS checks (CoreDNS is not installed here; the DNS and
# kube-proxy addons are disabled in the ClusterConfiguration) and SystemVerification (this host
# has cgroup v1, which kubeadm refuses since 1.35; the kubelet runs with failCgroupV1: false).

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

ku_prepare() {
  # What `kubeadm init` does after its phases, for `kubeadm upgrade`: the kubeadm-config and
  # kubelet-config ConfigMaps (and the kubeadm:cluster-admins binding admin.conf needs); the
  # kubelet's instance configuration with the CRI socket; the pause image kubeadm's CreateJob
  # check runs (`pause -v`).
  if "$S/bins/kubeadm" init phase upload-config all --config "$S/kubeadm.yaml" >>"$S/kubeadm.log" 2>&1; then
    pass "kubeadm init phase upload-config all: kubeadm-config and kubelet-config uploaded"
  else
    fail "kubeadm init phase upload-config all failed: $(tail -n 3 "$S/kubeadm.log")"
    return 1
  fi
  # The kubelet here reads $S/kubelet-config.yaml; kubeadm's kubelet-config phase backs up and
  # rewrites /var/lib/kubelet/config.yaml, which a kubeadm node has.
  mkdir -p /var/lib/kubelet
  cp "$S/kubelet-config.yaml" /var/lib/kubelet/config.yaml
  cat >/var/lib/kubelet/instance-config.yaml <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://$S/containerd/containerd.sock
EOF
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

# ku_step NAME [LOADGEN FLAGS...]: pivot.sh's step_start on both addresses (the load on
# NODE_IP:6443 with the prober of both addresses and the endpoints watcher, a second load on
# 127.0.0.1:6443); ku_step_end NAME WHAT: their verdicts.
ku_step() {
  local name="$1"
  shift
  log_mark "$name"
  step_start "$name" -probe 127.0.0.1:6443 -watch-endpoints "$@" || true
  step_start "$name-local" -kubeconfig "$MIGRATE_LOCAL_CONF" "$@" || true
}
ku_step_end() {
  step_end "$1" "$2 (NODE_IP:6443)"
  step_end "$1-local" "$2 (127.0.0.1:6443)"
  note "$2: controller-manager, scheduler and kubelet logs: $(log_error_summary "$1")"
}

# ku_migrate_check NAME: the step's report: no refused or failed connect of the probers, no
# failed request (client-go's retries included: what a client saw).
ku_migrate_check() {
  local verdict ok bad failed problems
  verdict="$(python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
bad = sum(p["refused"] + p["timeouts"] + sum((p.get("other") or {}).values()) for p in r.get("probes") or [])
failed = sum(c["failed"] for c in r["load"]["requests"].values())
print("ok" if bad == 0 and failed == 0 else "bad", bad, failed, "; ".join(r.get("problems") or []) or "none")' "$S/step-$1.json")" \
    || verdict="bad ? ? no report"
  read -r ok bad failed problems <<<"$verdict"
  if [ "$ok" = ok ]; then
    pass "the migration ($1): 0 refused or failed connects, 0 failed requests; reported besides: $problems"
  else
    fail "the migration ($1): $bad refused or failed connects, $failed failed requests; reported: $problems"
  fi
}

ku_audit_config() {
  mkdir -p /etc/kubernetes/audit /var/log/kubernetes/audit
  cat >/etc/kubernetes/audit/policy.yaml <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
rules:
- level: Metadata
EOF
  cat "$S/kubeadm.yaml" >"$S/kubeadm-audit.yaml"
  cat >>"$S/kubeadm-audit.yaml" <<'EOF'
apiServer:
  extraArgs:
  - name: audit-policy-file
    value: /etc/kubernetes/audit/policy.yaml
  - name: audit-log-path
    value: /var/log/kubernetes/audit/audit.log
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
dns:
  disabled: true
proxy:
  disabled: true
EOF
  "$S/bins/kubeadm" init phase upload-config kubeadm --config "$S/kubeadm-audit.yaml" >>"$S/kubeadm.log" 2>&1
}

ku_apply() {
  local what="$1" t0 gen0 hash0 rc=0
  gen0="$(ku_generation)"
  hash0="$(ku_standin_hash)"
  t0="$(now_ms)"
  "$S/bins/kubeadm" upgrade apply "$APISERVER_VERSION" -y --ignore-preflight-errors="$KU_IGNORE" \
    >"$S/kubeadm-$2.log" 2>&1 || rc=$?
  KU_SECONDS="$(since "$t0")"
  KU_GEN_DELTA=$(($(ku_generation) - gen0))
  KU_HASH_CHANGED=$([ "$(ku_standin_hash)" != "$hash0" ] && echo yes || echo no)
  note "$what: kubeadm said: $(grep -E '^\[upgrade' "$S/kubeadm-$2.log" | grep -E 'kube-apiserver|etcd|SUCCESS|equal|Restarting' | cut -c1-160 | tr '\n' '|')"
  return "$rc"
}

run_kubeadm_upgrade() {
  pivot_prepare_node || return 0
  ku_prepare || return 0
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
  local watch=("${STEP_WATCH[@]}")
  STEP_WATCH=(-probe "$NODE_IP:6443" -report-only)
  migrate || { STEP_WATCH=("${watch[@]}"); return 0; }
  STEP_WATCH=("${watch[@]}")
  ku_migrate_check migrate
  ku_migrate_check migrate-local
  note "kubeadm-sync's log: $(kcs logs "kube-apiserver-$NODE_NAME" -c kube-apiserver --tail=5 2>&1 | tr '\n' '|' | cut -c1-600)"

  ku_audit_config || { fail "upload of the audit configuration failed: $(tail -n 3 "$S/kubeadm.log")"; return 0; }
  ku_step apply
  if ku_apply "kubeadm upgrade apply $APISERVER_VERSION (audit added)" apply; then
    pass "kubeadm upgrade apply $APISERVER_VERSION, unpatched, succeeded after $KU_SECONDS s; the Deployment rolled ($KU_GEN_DELTA new generations), kube-apiserver-$NODE_NAME's hash changed: $KU_HASH_CHANGED"
  else
    fail "kubeadm upgrade apply failed after $KU_SECONDS s: $(grep -iE 'error|fatal|timed out' "$S/kubeadm-apply.log" | tail -n 5 | cut -c1-300 | tr '\n' '|')"
  fi
  ku_step_end apply "kubeadm upgrade apply"
  if kcs get deploy kube-apiserver -o jsonpath='{.spec.template.spec.containers[0].args}' | grep -q 'audit-policy-file=/etc/kubernetes/audit/policy.yaml' \
    && wait_for 30 test -s /var/log/kubernetes/audit/audit.log; then
    pass "the Deployment's apiserver runs kubeadm's new flags and writes the audit log ($(wc -l </var/log/kubernetes/audit/audit.log) lines)"
  else
    fail "the audit flags did not reach the Deployment, or no audit log: $(ls -la /var/log/kubernetes/audit 2>&1 | tr '\n' ' ')"
  fi

  ku_step again
  if ku_apply "second kubeadm upgrade apply $APISERVER_VERSION" again && [ "$KU_GEN_DELTA" = 0 ] \
    && grep -q 'Current and new manifests of kube-apiserver are equal' "$S/kubeadm-again.log"; then
    pass "a second kubeadm upgrade apply $APISERVER_VERSION is a no-op for the apiserver ($KU_SECONDS s, no new generation)"
  else
    fail "second kubeadm upgrade apply: rc or changes (generation delta $KU_GEN_DELTA): $(tail -n 3 "$S/kubeadm-again.log" | tr '\n' '|')"
  fi
  ku_step_end again "the second kubeadm upgrade apply"

  ku_step renew
  local gen0 t0
  gen0="$(ku_generation)"
  t0="$(now_ms)"
  if "$S/bins/kubeadm" certs renew all >"$S/kubeadm-renew.log" 2>&1 \
    && wait_for 240 eval '[ "$(ku_generation)" != "$gen0" ] && deploy_ready && one_pod_left'; then
    pass "kubeadm certs renew all: the agent rolled the Deployment, done after $(since "$t0") s"
  else
    fail "kubeadm certs renew all: no rollout of the Deployment within 240 s: $(tail -n 2 "$S/kubeadm-renew.log" | tr '\n' '|')"
  fi
  ku_step_end renew "kubeadm certs renew all"
  note "reports: $S/kubeadm-*.log, $S/load-*.json, $S/probe-*.json"
}
