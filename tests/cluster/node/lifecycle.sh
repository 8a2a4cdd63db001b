# shellcheck shell=bash
# shellcheck disable=SC2154 # here, S, CTR and the rest come from smoke (and pivot.sh)
# The lifecycle rehearsals (selector upgrade, drain, slow start, DaemonSet, monitoring), sourced by `smoke --lifecycle` inside its
# namespaces once the kubeadm-style control plane runs (the real kubelet, containerd, runc,
# etcd, kube-apiserver, kube-controller-manager and kube-scheduler), after pivot.sh (whose
# helpers it uses: kc, kcs, step_*, log_*, pivot_prepare_node):
#
#   1. the previous release's Deployment (selector component/tier, PDB minAvailable 1) from
#      git ($LEGACY_REF), pivoted to from kubeadm's static pod (that pivot's outage belongs to
#      the migration, migrate.sh, and is only noted here); `kubectl drain` of the only controller then waits for
#      ever on the budget (shown with a 60 s timeout);
#   2. the selector upgrade of docs/runbooks/selector-upgrade.md to manifests/single-controller
#      as it is now;
#   3. `kubectl drain` of the only controller, with and without --disable-eviction;
#   4. a rollout to an apiserver that takes $SLOW_START (60 s) longer to start, and back;
#   5. the move to manifests/ha-daemonset (the DaemonSet's pod beside the Deployment's, then
#      the Deployment deleted), $DS_RESTARTS DaemonSet rollouts, and a drain that leaves the
#      DaemonSet's pod alone.
# Every step runs under ../cmd/loadgen (lc_begin): connects on NODE_IP:6443 every 20 ms and the
# client-go load, held to the tier's strict criteria; default/kubernetes never without a ready
# address; no restart and no Ready flip of an apiserver pod that is not being deleted, nor of
# the controller-manager and the scheduler. The reports land in $S/step-<step>.json.
# From the selector upgrade on, a real Prometheus (Debian's `prometheus`, when installed)
# scrapes the pods with the job prometheus-operator makes of manifests/monitoring's PodMonitor
# (every 5s) and evaluates its alerts: one target for the node throughout, both pods of a
# rollout in one scrape, no alert firing.
#
# Environment: LEGACY_REF (git revision of the previous release's manifests, default
# 9739f68), SLOW_START (60s), DS_RESTARTS (3), LIFECYCLE_STEPS (which of legacy, drain,
# slow, slowprev, daemonset to run; default all but slowprev; without legacy the current
# manifests are applied straight away), SLOW_START_PREVIOUS (120s: slowprev's start, longer
# than the previous probes allow).

LEGACY_REF="${LEGACY_REF:-9739f68}"
SLOW_START="${SLOW_START:-60s}"
DS_RESTARTS="${DS_RESTARTS:-3}"
LIFECYCLE_STEPS="${LIFECYCLE_STEPS:-legacy drain slow daemonset}"
SLOW_IMAGE="$IMAGE_REPO/kube-apiserver:$APISERVER_VERSION-slow"
repo="$here/../../.."

lc_step() { case " $LIFECYCLE_STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

# lc_render NAME OVERLAY SRC: SRC/manifests/OVERLAY rendered with the local images into
# $S/NAME.yaml (an overlay whose only content is a kustomize images: entry per image).
lc_render() {
  local name="$1" overlay="$2" src="$3" k="$S/kustomize-$1"
  mkdir -p "$k/local"
  cp -r "$src/manifests" "$k/manifests"
  cat >"$k/local/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../manifests/$overlay
images:
  - name: ghcr.io/example/kube-apiserver-proxy
    newName: ${PROXY_IMAGE%:*}
    newTag: ${PROXY_IMAGE##*:}
  - name: registry.k8s.io/kube-apiserver
    newName: $IMAGE_REPO/kube-apiserver
    newTag: $APISERVER_VERSION
EOF
  if [ -n "${LC_UID:-}" ]; then
    # An installation upgraded from a release whose proxies ran as another uid keeps it
    # (docs/runbooks/selector-upgrade.md, step 0): old and new pods
    # hand over to each other only with one uid.
    cat >>"$k/local/kustomization.yaml" <<EOF
patches:
  - target:
      kind: Deployment|DaemonSet
      name: kube-apiserver
    patch: |-
      - op: test
        path: /spec/template/spec/initContainers/0/name
        value: install-proxy
      - op: replace
        path: /spec/template/spec/initContainers/0/securityContext/runAsUser
        value: $LC_UID
      - op: replace
        path: /spec/template/spec/initContainers/0/securityContext/runAsGroup
        value: $LC_UID
      - op: test
        path: /spec/template/spec/containers/1/name
        value: proxy
      - op: replace
        path: /spec/template/spec/containers/1/securityContext/runAsUser
        value: $LC_UID
      - op: replace
        path: /spec/template/spec/containers/1/securityContext/runAsGroup
        value: $LC_UID
EOF
  fi
  kc kustomize "$k/local" >"$S/$name.yaml" 2>"$S/kustomize-$name.err"
}

# lc_endpoints: default/kubernetes for the node address, as docs/operations.md says to apply it
# with the single-controller overlay (--endpoint-reconciler-type=none), when the proxy has the
# subcommand.
lc_endpoints() {
  if "$S/bins/kube-apiserver-proxy" kubernetes-endpoints --help >/dev/null 2>&1; then
    "$S/bins/kube-apiserver-proxy" kubernetes-endpoints --address "$NODE_IP" | kc apply -f -
  fi
}

# lc_pods: "name ready restarts deleting node" of every kube-apiserver pod that is not
# kubeadm's mirror pod (the previous release's pods, the Deployment's and the DaemonSet's).
lc_pods() {
  kcs get pods -l component=kube-apiserver -o json 2>/dev/null | "$NODECHECK" apiserver-pods
}
lc_pod_names() { lc_pods | awk '{ print $1 }' | sort | tr '\n' ' '; }
lc_one_ready_pod() { [ "$(lc_pods | grep -c .)" = 1 ] && lc_pods | grep -q ' ready 0 - '; }

# lc_begin NAME [restarts-expected]: cmd/loadgen around a step (pivot.sh's step_start): the
# client-go load and connects on NODE_IP:6443, default/kubernetes, the controller-manager and
# the scheduler, and every kube-apiserver pod (kubeadm's mirror pod left out): none may
# restart or turn unready unless it is being deleted (unless restarts are the step's point).
lc_begin() {
  log_mark "$1"
  local pods=(-watch-pods "kube-system/component=kube-apiserver")
  [ "${2:-}" != restarts-expected ] || pods=()
  step_start "$1" -watch-endpoints "${pods[@]}"
}
# lc_end NAME WHAT: loadgen's verdict on the step, and what the logs say.
lc_end() {
  step_end "$1" "$2"
  note "$2: controller-manager, scheduler and kubelet logs: $(log_error_summary "$1")"
  note "$2: restarts: $(control_plane_restarts)"
}

# step_most_pods NAME: the most kube-apiserver pods the step's pod watch saw at once.
step_most_pods() {
  "$NODECHECK" most-pods "$S/step-$1.json" kube-apiserver
}

# lc_events REASON: "count message" of the events of that reason on kube-apiserver pods
# (probe failures are reason Unhealthy, preStop failures FailedPreStopHook).
lc_events() {
  kcs get events --field-selector "reason=$1" -o json 2>/dev/null | "$NODECHECK" events kube-apiserver-
}

lc_deploy_ready() {
  kcs rollout status deployment/kube-apiserver --timeout=5s >/dev/null 2>&1 && lc_one_ready_pod
}
lc_ds_ready() {
  kcs rollout status daemonset/kube-apiserver --timeout=5s >/dev/null 2>&1 && lc_one_ready_pod
}

# lc_pdb_counts_one: the disruption controller has seen the budget and counts one healthy pod.
lc_pdb_counts_one() {
  [ "$(kcs get pdb kube-apiserver -o jsonpath='{.status.currentHealthy}/{.status.observedGeneration}/{.metadata.generation}' 2>/dev/null)" \
    = "1/$(kcs get pdb kube-apiserver -o jsonpath='{.metadata.generation}' 2>/dev/null)/$(kcs get pdb kube-apiserver -o jsonpath='{.metadata.generation}' 2>/dev/null)" ]
}

# 1. The previous release: pivot to its Deployment, then show that a drain waits for ever.
lc_legacy() {
  local src="$S/legacy" t0 t1
  mkdir -p "$src"
  if ! git -C "$repo" archive "$LEGACY_REF" manifests 2>"$S/legacy.err" | tar -x -C "$src"; then
    fail "legacy: cannot read manifests/ at $LEGACY_REF from git: $(head -c 200 "$S/legacy.err")"
    return 1
  fi
  if ! grep -q 'component: kube-apiserver' "$src/manifests/base/pdb.yaml"; then
    fail "legacy: $LEGACY_REF is not a release with the component/tier selector"
    return 1
  fi
  lc_render legacy single-controller "$src" || { fail "legacy: kubectl kustomize failed: $(head -c 300 "$S/kustomize-legacy.err")"; return 1; }
  # The node as that release made it: its tmpfiles.d owner (its proxies' uid, 65532), which
  # the releases after it keep on such a node (LC_UID).
  local typ path mode uid gid
  while read -r typ path mode uid gid _; do
    [ "$typ" = d ] || continue
    chmod "$mode" "$path" && chown "$uid:$gid" "$path" && LC_UID=$uid || return 1
  done < <(grep -v '^#' "$src/manifests/node/tmpfiles.d/kube-apiserver-proxy.conf")
  pass "legacy: node directories as $LEGACY_REF's tmpfiles.d makes them (uid $LC_UID, kept by the upgrade): $(stat -c '%n %a %u:%g' /run/kube-apiserver-proxy /run/kube-apiserver-proxy/* | tr '\n' ' ')"
  # The pivot from kubeadm's static pod, in the order that completes (the migration, migrate.sh, owns
  # a pivot without refused connections; here its outage is only noted).
  step_start legacy_pivot -load=false -report-only || true
  t0="$(now_ms)"
  kc apply -f "$S/legacy.yaml" >"$S/apply-legacy.log" 2>&1 || { fail "legacy: kubectl apply: $(cat "$S/apply-legacy.log")"; step_end legacy_pivot "legacy pivot (measured)"; return 1; }
  wait_for 120 pod_scheduled || true
  t1="$(now_ms)"
  mv "$MANIFESTS/kube-apiserver.yaml" "$S/kube-apiserver.static.yaml"
  if wait_for 420 lc_deploy_ready; then
    pass "legacy: the previous release's Deployment ($LEGACY_REF) runs, $(since "$t0") s after kubectl apply ($(since "$t1") s after the static manifest went): $(lc_pods | tr '\n' ' ')"
  else
    fail "legacy: the previous release's Deployment is not ready: $(lc_pods | tr '\n' ' ')"
    step_end legacy_pivot "legacy pivot (measured)"
    return 1
  fi
  step_end legacy_pivot "legacy: the pivot from kubeadm's static pod (measured, not this rehearsal's subject)"
  # The previous budget (minAvailable 1 of 1 replica): drain never completes. Once the
  # disruption controller counts the pod healthy, that is: before, the pod counts as
  # unhealthy, unhealthyPodEvictionPolicy AlwaysAllow lets the drain evict it, and the previous
  # manifests (no toleration of the cordon) leave the node with no apiserver, for good: its
  # replacement cannot be scheduled, and nothing can uncordon the node without an apiserver.
  # (Seen in one run of this rehearsal, with the drain 8 s after the pivot.)
  if ! wait_for 120 lc_pdb_counts_one; then
    fail "legacy: the budget never counted the pod healthy: $(kcs get pdb kube-apiserver -o jsonpath='{.status}' 2>&1)"
    return 1
  fi
  t0="$(now_ms)"
  if kc drain "$NODE_NAME" --ignore-daemonsets --delete-emptydir-data --timeout=60s >"$S/drain-legacy.log" 2>&1; then
    fail "legacy: kubectl drain completed with the previous budget (minAvailable 1): $(tail -n 3 "$S/drain-legacy.log" | tr '\n' ' ')"
  else
    pass "legacy: with the previous budget kubectl drain does not complete (--timeout=60s, $(since "$t0") s): $(grep -m1 -o 'Cannot evict pod as it would violate[^.]*' "$S/drain-legacy.log" || tail -n 1 "$S/drain-legacy.log")"
  fi
  kc uncordon "$NODE_NAME" >/dev/null 2>&1 || true
  lc_upgrade_selector
}

# 2. docs/runbooks/selector-upgrade.md.
lc_upgrade_selector() {
  local t0 old_pod old_rs
  lc_render current single-controller "$repo" || { fail "upgrade: kubectl kustomize failed: $(head -c 300 "$S/kustomize-current.err")"; return 1; }
  old_pod="$(lc_pod_names)"
  lc_begin upgrade || return 1
  t0="$(now_ms)"
  # a. Remove the Deployment, not its ReplicaSet and pod: the old pod serves on.
  kcs delete deployment kube-apiserver --cascade=orphan >"$S/upgrade.log" 2>&1
  # b. Apply the new manifests: a new Deployment (new selector), the budget updated. The
  #    overlay switches the apiserver to the none endpoint reconciler: the endpoints first
  #    (docs/operations.md, "The kubernetes Service endpoints").
  lc_endpoints >>"$S/upgrade.log" 2>&1
  kc apply -f "$S/current.yaml" >>"$S/upgrade.log" 2>&1
  # c. Its pod starts beside the old one and takes the socket by handoff when Ready.
  if wait_for 300 eval 'kcs rollout status deployment/kube-apiserver --timeout=5s'; then
    note "upgrade: the new Deployment is ready $(since "$t0") s after the old one was orphaned: $(lc_pods | tr '\n' ' ')"
  else
    fail "upgrade: the new Deployment is not ready: $(lc_pods | tr '\n' ' ')"
  fi
  # d. Delete the old ReplicaSet (it takes its pod with it).
  old_rs="$(kcs get rs -l 'component=kube-apiserver,!app.kubernetes.io/name' -o name 2>/dev/null | tr '\n' ' ')"
  # shellcheck disable=SC2086 # one name per word
  kcs delete $old_rs --wait=false >>"$S/upgrade.log" 2>&1
  # The old (lease) apiserver tries to empty the endpoints at its SIGTERM: the admission policy
  # applied with them in b. denies it (docs/operations.md).
  if wait_for 180 lc_one_ready_pod && ! lc_pod_names | grep -qw "${old_pod% }"; then
    pass "upgrade: selector moved to app.kubernetes.io/name+part-of in $(since "$t0") s; old ReplicaSet $old_rs deleted; pods: $old_pod-> $(lc_pod_names)"
  else
    fail "upgrade: not one new Ready pod after $(since "$t0") s: $(lc_pods | tr '\n' ' ') (log: $(tail -n 5 "$S/upgrade.log" | tr '\n' ' '))"
  fi
  kcs get pdb kube-apiserver -o jsonpath='{.spec}' >"$S/pdb.json" 2>&1
  note "upgrade: budget now $(cat "$S/pdb.json")"
  lc_end upgrade "selector upgrade"
}

# 3. kubectl drain of the only controller, with and without eviction.
lc_drain() {
  local mode="$1" name="drain_$1" t0 before after args=()
  [ "$mode" = delete ] && args=(--disable-eviction)
  before="$(lc_pod_names)"
  lc_begin "$name" || return 1
  t0="$(now_ms)"
  if kc drain "$NODE_NAME" --ignore-daemonsets --delete-emptydir-data --timeout=600s "${args[@]}" >"$S/$name.log" 2>&1; then
    pass "kubectl drain ${args[*]:-(eviction)} of the only controller completed in $(since "$t0") s: $(grep -E 'evicted|deleted' "$S/$name.log" | tr '\n' ' ')"
  else
    fail "kubectl drain ${args[*]:-(eviction)} did not complete in $(since "$t0") s: $(tail -n 3 "$S/$name.log" | tr '\n' ' ')"
  fi
  if wait_for 120 lc_one_ready_pod; then
    after="$(lc_pod_names)"
    if [ "$after" != "$before" ]; then
      pass "drain ($mode): the apiserver pod was replaced on the cordoned node: $before-> $after ($(lc_pods | awk '{ print $5 }'))"
    else
      fail "drain ($mode): the apiserver pod was not replaced: $after"
    fi
  else
    fail "drain ($mode): no single Ready apiserver pod after the drain: $(lc_pods | tr '\n' ' ')"
  fi
  local prestop
  prestop="$(lc_events FailedPreStopHook)"
  if [ "$prestop" = none ]; then
    pass "drain ($mode): no preStop hook failed"
  else
    fail "drain ($mode): preStop hooks failed: $prestop"
  fi
  kc uncordon "$NODE_NAME" >/dev/null 2>&1 || fail "kubectl uncordon failed"
  lc_end "$name" "drain ($mode)"
}

# 4. An apiserver that takes $SLOW_START longer to start: a rollout to it, and back.
lc_slow() {
  local t0
  if ! (cd "$here" && CGO_ENABLED=0 go build -mod=readonly -trimpath -o "$S/bins/slowstart" ./slowstart) >"$S/slowstart-build.log" 2>&1 \
    || ! "$S/images/bin/mkimage" -name "$SLOW_IMAGE" -out "$S/images/kube-apiserver-slow.tar" \
      -entrypoint /usr/local/bin/kube-apiserver -env "$UPSTREAM_PATH,SLOW_START=$SLOW_START" \
      "$S/bins/slowstart=/usr/local/bin/kube-apiserver" "$S/bins/kube-apiserver=/usr/local/bin/kube-apiserver.real" >>"$S/slowstart-build.log" 2>&1 \
    || ! "${CTR[@]}" images import "$S/images/kube-apiserver-slow.tar" >>"$S/slowstart-build.log" 2>&1; then
    fail "slow start: image $SLOW_IMAGE not built: $(tail -n 3 "$S/slowstart-build.log")"
    return 1
  fi
  lc_begin slow || return 1
  t0="$(now_ms)"
  kcs set image deployment/kube-apiserver "kube-apiserver=$SLOW_IMAGE" >/dev/null
  if kcs rollout status deployment/kube-apiserver --timeout=420s >"$S/rollout-slow.log" 2>&1 && wait_for 120 lc_one_ready_pod; then
    pass "slow start: the rollout to an apiserver that waits $SLOW_START before it starts completed in $(since "$t0") s: $(lc_pods | tr '\n' ' ')"
  else
    fail "slow start: rollout not complete after $(since "$t0") s: $(tail -n 2 "$S/rollout-slow.log" | tr '\n' ' ') $(lc_pods | tr '\n' ' ')"
  fi
  note "slow start: probe events: $(lc_events Unhealthy)"
  t0="$(now_ms)"
  kcs set image deployment/kube-apiserver "kube-apiserver=$IMAGE_REPO/kube-apiserver:$APISERVER_VERSION" >/dev/null
  if kcs rollout status deployment/kube-apiserver --timeout=300s >/dev/null 2>&1 && wait_for 120 lc_one_ready_pod; then
    note "slow start: back to the plain image in $(since "$t0") s"
  else
    fail "slow start: the rollout back to the plain image did not complete"
  fi
  # No container restarted and no Ready condition flipped: the step's pod watch.
  lc_end slow "slow start"
}

# lc_a_pod_restarted: a pod that is not being deleted has restarted a container.
lc_a_pod_restarted() { lc_pods | awk '$4 == "-" && $3 > 0 { found = 1 } END { exit !found }'; }

# 4b. (LIFECYCLE_STEPS with slowprev) The same slow start, $SLOW_START_PREVIOUS long, with the
# previous release's probes (no start-up probe, readiness failureThreshold 1): the kubelet
# restarts the slow apiserver (liveness: 10s + 8 x 10s); then with the current probes: no
# restart. Needs lc_slow's image (run slow first).
lc_slow_previous() {
  local t0 restarts
  SLOW_START_PREVIOUS="${SLOW_START_PREVIOUS:-120s}"
  lc_begin slowprev restarts-expected || return 1
  # The previous probes, the slow image, and the longer wait (the container's env overrides
  # the image's), in one change of the template: one rollout.
  t0="$(now_ms)"
  kcs patch deployment/kube-apiserver --type=json -p '[
    {"op": "remove", "path": "/spec/template/spec/containers/0/startupProbe"},
    {"op": "replace", "path": "/spec/template/spec/containers/0/readinessProbe/failureThreshold", "value": 1},
    {"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": "'"$SLOW_IMAGE"'"},
    {"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": {"name": "SLOW_START", "value": "'"$SLOW_START_PREVIOUS"'"}}]' >/dev/null
  if wait_for 300 lc_a_pod_restarted; then
    restarts="$(lc_pods | tr '\n' ' ')"
    pass "slow start, previous probes: the kubelet restarted the apiserver that waits $SLOW_START_PREVIOUS, $(since "$t0") s into the rollout: $restarts"
  else
    fail "slow start, previous probes: no restart within 300 s: $(lc_pods | tr '\n' ' ')"
  fi
  note "slow start, previous probes: probe events: $(lc_events Unhealthy)"
  # Back to the current template (the old pod served throughout: maxUnavailable 0).
  kcs rollout undo deployment/kube-apiserver >/dev/null
  wait_for 300 lc_deploy_ready || fail "slow start, previous probes: the undo did not complete: $(lc_pods | tr '\n' ' ')"
  t0="$(now_ms)"
  kcs set image deployment/kube-apiserver "kube-apiserver=$SLOW_IMAGE" >/dev/null
  kcs set env deployment/kube-apiserver -c kube-apiserver "SLOW_START=$SLOW_START_PREVIOUS" >/dev/null
  if kcs rollout status deployment/kube-apiserver --timeout=600s >/dev/null 2>&1 && wait_for 120 lc_one_ready_pod; then
    pass "slow start, current probes: the apiserver that waits $SLOW_START_PREVIOUS rolled out in $(since "$t0") s without a restart: $(lc_pods | tr '\n' ' ')"
  else
    fail "slow start, current probes: not rolled out after $(since "$t0") s: $(lc_pods | tr '\n' ' ')"
  fi
  kcs set env deployment/kube-apiserver -c kube-apiserver SLOW_START- >/dev/null
  kcs set image deployment/kube-apiserver "kube-apiserver=$IMAGE_REPO/kube-apiserver:$APISERVER_VERSION" >/dev/null
  if ! kcs rollout status deployment/kube-apiserver --timeout=300s >/dev/null 2>&1 || ! wait_for 120 lc_one_ready_pod; then
    fail "slow start: the rollout back to the plain image did not complete"
  fi
  lc_end slowprev "slow start, previous and current probes"
}

# 5. The DaemonSet overlay: the move from the Deployment, rollouts, a drain.
lc_daemonset() {
  local t0 i before after
  lc_render daemonset ha-daemonset "$repo" || { fail "daemonset: kubectl kustomize failed: $(head -c 300 "$S/kustomize-daemonset.err")"; return 1; }
  lc_begin ds_move || return 1
  t0="$(now_ms)"
  kc apply -f "$S/daemonset.yaml" >"$S/apply-ds.log" 2>&1 || fail "daemonset: kubectl apply: $(cat "$S/apply-ds.log")"
  if wait_for 300 eval 'kcs rollout status daemonset/kube-apiserver --timeout=5s'; then
    note "daemonset: its pod is Ready beside the Deployment's $(since "$t0") s after kubectl apply: $(lc_pods | tr '\n' ' ')"
  else
    fail "daemonset: its pod is not Ready: $(lc_pods | tr '\n' ' ')"
  fi
  kcs delete deployment kube-apiserver >>"$S/apply-ds.log" 2>&1
  kcs delete pdb kube-apiserver >>"$S/apply-ds.log" 2>&1
  if wait_for 240 lc_ds_ready; then
    pass "daemonset: moved from the Deployment in $(since "$t0") s: $(lc_pods | tr '\n' ' ')"
  else
    fail "daemonset: not one Ready DaemonSet pod after the Deployment's deletion: $(lc_pods | tr '\n' ' ')"
  fi
  lc_end ds_move "move to the DaemonSet"

  lc_begin ds_rollouts || return 1
  for i in $(seq 1 "$DS_RESTARTS"); do
    t0="$(now_ms)"
    before="$(lc_pod_names)"
    kcs rollout restart daemonset/kube-apiserver >/dev/null
    if kcs rollout status daemonset/kube-apiserver --timeout=300s >"$S/rollout-ds.log" 2>&1 && wait_for 120 lc_ds_ready; then
      pass "daemonset rollout restart $i/$DS_RESTARTS complete after $(since "$t0") s: $before-> $(lc_pod_names)"
    else
      fail "daemonset rollout restart $i/$DS_RESTARTS not complete after $(since "$t0") s: $(tail -n 2 "$S/rollout-ds.log" | tr '\n' ' ') $(lc_pods | tr '\n' ' ')"
    fi
  done
  lc_end ds_rollouts "DaemonSet rollouts"
  # maxSurge 1 on one node: the new pod ran beside the old one before it went.
  if [ "$(step_most_pods ds_rollouts)" = 2 ]; then
    pass "daemonset: each rollout surged on the node (two pods at once, never zero)"
  else
    fail "daemonset: no surge seen on the node: at most $(step_most_pods ds_rollouts) pods at once"
  fi

  lc_begin ds_drain || return 1
  before="$(lc_pod_names)"
  t0="$(now_ms)"
  if kc drain "$NODE_NAME" --ignore-daemonsets --delete-emptydir-data --timeout=300s >"$S/ds_drain.log" 2>&1; then
    after="$(lc_pod_names)"
    if [ "$after" = "$before" ]; then
      pass "daemonset: kubectl drain --ignore-daemonsets completed in $(since "$t0") s and left the apiserver pod alone ($after)"
    else
      fail "daemonset: the drain replaced the apiserver pod: $before-> $after"
    fi
  else
    fail "daemonset: kubectl drain did not complete: $(tail -n 3 "$S/ds_drain.log" | tr '\n' ' ')"
  fi
  kc uncordon "$NODE_NAME" >/dev/null 2>&1 || fail "kubectl uncordon failed"
  lc_end ds_drain "drain with the DaemonSet"
}

# lc_prometheus_start: Prometheus on 127.0.0.1:9090 in the node's namespace, with the scrape job
# prometheus-operator makes of manifests/monitoring's PodMonitor (the operator's own
# relabelings, then the PodMonitor's, taken from the rendered object), scraping every 5s (the
# scrape timeout is the interval: 5s, half Prometheus' default 10s. With 2s, one run on a
# machine with a load average above 20 saw `up` 0 once; its cause was not recorded, and a
# scrape that waits out an exiting peer's 1s fetch timeout comes close to 2s there), and the
# alerts of its PrometheusRule (evaluated every 5s). Debian's prometheus is built without
# Kubernetes discovery: lc_prom_sd writes what `kubernetes_sd_configs: [{role: pod}]` would
# discover into a file_sd file every 2s (pods declaring no port: one target per container, at
# the pod's IP, with the __meta_kubernetes_* labels the relabelings read).
lc_prometheus_start() {
  PROMETHEUS_BIN="$(command -v prometheus || true)"
  if [ -z "$PROMETHEUS_BIN" ]; then
    if in_ci; then
      fail "prometheus not installed (apt-get install prometheus) and CI is set: the monitoring check cannot run"
    else
      note "SKIPPED: prometheus not installed (apt-get install prometheus): the monitoring check is left out"
    fi
    return 1
  fi
  if ! kc kustomize "$repo/manifests/monitoring" >"$S/monitoring.yaml" 2>"$S/kustomize-monitoring.err"; then
    fail "prometheus: kubectl kustomize manifests/monitoring failed: $(head -c 300 "$S/kustomize-monitoring.err")"
    return 1
  fi
  "$NODECHECK" prom-config "$S/monitoring.yaml" "$S" 2>"$S/prometheus-config.err" \
    || { fail "prometheus: its configuration could not be made from manifests/monitoring: $(tail -n 2 "$S/prometheus-config.err" | tr '\n' ' ')"; return 1; }
  echo '[]' >"$S/sd.json"
  lc_prom_sd &
  PROMSD_PID=$!
  "$PROMETHEUS_BIN" --config.file="$S/prometheus.yaml" --storage.tsdb.path="$S/prometheus" \
    --web.listen-address=127.0.0.1:9090 >"$S/prometheus.log" 2>&1 &
  PROMETHEUS_PID=$!
  if wait_for 90 lc_prom_targets_up; then
    pass "prometheus (the PodMonitor's job): one target for the node, up: $(lc_prom '/api/v1/targets?state=active' | "$NODECHECK" prom targets)"
  else
    fail "prometheus: no single healthy target within 90 s: $(lc_prom '/api/v1/targets?state=active' 2>&1 | head -c 600) $(tail -n 3 "$S/prometheus.log" | tr '\n' ' ')"
    return 1
  fi
}

# lc_prom_sd: every 2s, the pods the PodMonitor selects, as Kubernetes pod discovery would
# give them, into $S/sd.json (written atomically).
lc_prom_sd() {
  exec "$NODECHECK" prom-sd "$NODE_IP" "$S"
}
lc_prom() { curl -fsS --max-time 5 "http://127.0.0.1:9090$1"; }
# lc_prom_query EXPR: the values of an instant query, space-separated ("none" if empty).
lc_prom_query() {
  curl -fsS --max-time 10 --get --data-urlencode "query=$1" http://127.0.0.1:9090/api/v1/query | "$NODECHECK" prom values
}
# lc_prom_names EXPR: the alertname labels of an instant query's result ("none" if empty).
lc_prom_names() {
  curl -fsS --max-time 10 --get --data-urlencode "query=$1" http://127.0.0.1:9090/api/v1/query | "$NODECHECK" prom alerts
}
# lc_prom_down_at JOB RANGE: the times (UTC) at which up{JOB} was 0 within RANGE.
lc_prom_down_at() {
  curl -fsS --max-time 10 --get --data-urlencode "query=(up{$1} == 0)[$2:5s]" http://127.0.0.1:9090/api/v1/query \
    | "$NODECHECK" prom times
}
lc_prom_targets_up() {
  lc_prom '/api/v1/targets?state=active' | "$NODECHECK" prom targets-up
}
# lc_prometheus_check: over the run so far, one target for the node, never down; both pods of
# a rollout in one scrape; no alert firing (the ones seen pending are listed).
lc_prometheus_check() {
  [ -n "${PROMETHEUS_PID:-}" ] || return 0
  local w="2h" targets down pods alerts job='job="kube-system/kube-apiserver-proxy"'
  targets="$(lc_prom_query "max_over_time(count(up{$job})[$w:5s])")"
  down="$(lc_prom_query "min_over_time(up{$job}[$w])")"
  pods="$(lc_prom_query "max_over_time(count(kube_apiserver_proxy_build_info)[$w:5s])")"
  if [ "$targets" = 1 ] && [ "$down" = 1 ]; then
    pass "prometheus: one scrape target for the node all along, never down"
  else
    fail "prometheus: targets at most $targets, up at least $down (want 1 and 1); down at $(lc_prom_down_at "$job" "$w"); longest scrape $(lc_prom_query "max_over_time(scrape_duration_seconds{$job}[$w])") s; last error: $(lc_prom '/api/v1/targets?state=active' | "$NODECHECK" prom errors)"
  fi
  if [ "$pods" = 2 ]; then
    pass "prometheus: one scrape of the node showed both pods of a rollout"
  else
    fail "prometheus: at most $pods pods seen in one scrape (want 2 during the rollouts)"
  fi
  # Firing at any moment of the run, not only now; pending ones are listed (a rollout's two
  # pods make RolloutStuck pending, which its 15 minutes never let fire).
  alerts="$(lc_prom_names "max_over_time(ALERTS{alertname=~\"KubeApiserverProxy.*\", alertstate=\"firing\"}[$w])")"
  if [ "$alerts" = none ]; then
    pass "prometheus: no alert of manifests/monitoring fired during the run (pending at some point: $(lc_prom_names "max_over_time(ALERTS{alertname=~\"KubeApiserverProxy.*\", alertstate=\"pending\"}[$w])"))"
  else
    fail "prometheus: alerts fired during the run: $alerts"
  fi
}
lc_prometheus_stop() {
  [ -n "${PROMETHEUS_PID:-}" ] || return 0
  kill -TERM "${PROMSD_PID:-}" 2>/dev/null || true
  kill -TERM "$PROMETHEUS_PID" 2>/dev/null || true
  wait_for 30 eval "! kill -0 $PROMETHEUS_PID 2>/dev/null" || kill -KILL "$PROMETHEUS_PID" 2>/dev/null || true
  wait "$PROMETHEUS_PID" 2>/dev/null || true
}

run_lifecycle() {
  pivot_prepare_node || return 0
  if lc_step legacy; then
    lc_legacy || return 0
  else
    # Straight to the current manifests (the pivot's outage only noted).
    lc_render current single-controller "$repo" || { fail "kubectl kustomize failed"; return 0; }
    lc_endpoints >/dev/null 2>&1
    step_start start -load=false -report-only || true
    kc apply -f "$S/current.yaml" >/dev/null 2>&1
    wait_for 120 pod_scheduled || true
    mv "$MANIFESTS/kube-apiserver.yaml" "$S/kube-apiserver.static.yaml"
    wait_for 420 lc_deploy_ready || { fail "the Deployment is not ready: $(lc_pods | tr '\n' ' ')"; step_end start "start (measured)"; return 0; }
    step_end start "start: the pivot from kubeadm's static pod (measured, not this rehearsal's subject)"
  fi
  lc_prometheus_start || true
  if lc_step drain; then
    lc_drain evict || true
    lc_drain delete || true
  fi
  if lc_step slow; then lc_slow || true; fi
  if lc_step slowprev; then lc_slow_previous || true; fi
  if lc_step daemonset; then lc_daemonset || true; fi
  lc_prometheus_check
  lc_prometheus_stop
  note "reports: $S/step-*.json, $S/prometheus/"
}
