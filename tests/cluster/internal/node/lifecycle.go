package node

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/report"
	"kube-apiserver-proxy/tests/cluster/internal/step"
)

// The lifecycle rehearsals (`smoke --lifecycle`), once the kubeadm-style control plane runs
// (the real kubelet, containerd, runc, etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler), on a node prepared as for the pivot:
//
//  1. the previous release's Deployment (selector component/tier, PDB minAvailable 1) from git
//     (LEGACY_REF), pivoted to from kubeadm's static pod (that pivot's outage belongs to the
//     migration and is only noted here); `kubectl drain` of the only controller then waits for
//     ever on the budget (shown with a 60 s timeout);
//  2. the selector upgrade of docs/runbooks/selector-upgrade.md to manifests/single-controller
//     as it is now;
//  3. `kubectl drain` of the only controller, with and without --disable-eviction;
//  4. a rollout to an apiserver that takes SLOW_START (60s) longer to start, and back;
//  5. the move to manifests/ha-daemonset (the DaemonSet's pod beside the Deployment's, then the
//     Deployment deleted), DS_RESTARTS (3) DaemonSet rollouts, and a drain that leaves the
//     DaemonSet's pod alone.
//
// Every step runs under the load and its observers (lifecycle.begin): connects on NODE_IP:6443
// every 20 ms and the client-go load, held to the tier's strict criteria; default/kubernetes
// never without a ready address; no restart and no Ready flip of an apiserver pod that is not
// being deleted, nor of the controller-manager and the scheduler. The reports land in
// step-<step>.json of the state directory. From the selector upgrade on, a real Prometheus
// (Debian's `prometheus`, when installed) scrapes the pods with the job prometheus-operator
// makes of manifests/monitoring's PodMonitor (every 5s) and evaluates its alerts (see
// lifecycle_prom.go).
//
// Environment: LEGACY_REF (the git revision of the previous release's manifests, 9739f68),
// SLOW_START (60s), DS_RESTARTS (3), LIFECYCLE_STEPS (which of legacy, drain, slow, slowprev,
// daemonset to run; all but slowprev by default; without legacy the current manifests are
// applied straight away), SLOW_START_PREVIOUS (120s: slowprev's start, longer than the
// previous probes allow).
func RunLifecycle(n *Scenario) {
	lc := &lifecycle{n: n, steps: Steps(EnvKnob("LIFECYCLE_STEPS"))}
	if !n.CheckKnobs("lifecycle") || !n.PrepareNode() {
		return
	}
	if lc.steps["legacy"] {
		if !lc.legacy() {
			return
		}
	} else if !lc.straight() {
		return
	}
	lc.prometheusStart()
	if lc.steps["drain"] {
		lc.drain("evict")
		lc.drain("delete")
	}
	if lc.steps["slow"] {
		lc.slow()
	}
	if lc.steps["slowprev"] {
		lc.slowPrevious()
	}
	if lc.steps["daemonset"] {
		lc.daemonset()
	}
	lc.prometheusCheck()
	lc.prometheusStop()
	n.Note("reports: %s, %s/", n.Path("step-*.json"), n.Path("prometheus"))
}

type lifecycle struct {
	n     *Scenario
	steps map[string]bool
	// uid is the proxies' uid every rendering keeps once the previous release made the node
	// (0: the manifests' own).
	uid  int
	prom *prometheus
}

// Steps is the set of LIFECYCLE_STEPS' words.
func Steps(list string) map[string]bool {
	s := map[string]bool{}
	for _, w := range strings.Fields(list) {
		s[w] = true
	}
	return s
}

const apiServerPods = "component=kube-apiserver"

// pods are "name ready|notready restarts deleting|- node" of every kube-apiserver pod that is
// not kubeadm's mirror pod: the previous release's, the Deployment's and the DaemonSet's.
func (lc *lifecycle) pods() []string {
	list, err := lc.n.Client.CoreV1().Pods("kube-system").List(lc.n.Ctx, metav1.ListOptions{LabelSelector: apiServerPods})
	if err != nil {
		return []string{"(" + err.Error() + ")"}
	}
	return nodecheck.APIServerPods(list)
}

func (lc *lifecycle) podsLine() string {
	if p := lc.pods(); len(p) > 0 {
		return strings.Join(p, "; ")
	}
	return "no pods"
}

func (lc *lifecycle) podNames() []string { return PodNames(lc.pods()) }

// PodNames are the sorted names of APIServerPods lines.
func PodNames(lines []string) []string {
	var names []string
	for _, l := range lines {
		if f := strings.Fields(l); len(f) > 0 {
			names = append(names, f[0])
		}
	}
	sort.Strings(names)
	return names
}

// OneReadyPod: the APIServerPods lines are one pod, ready, never restarted, not being deleted.
func OneReadyPod(lines []string) bool {
	if len(lines) != 1 {
		return false
	}
	f := strings.Fields(lines[0])
	return len(f) == 5 && f[1] == "ready" && f[2] == "0" && f[3] == "-"
}

// APodRestarted: a pod of the APIServerPods lines that is not being deleted has restarted a
// container.
func APodRestarted(lines []string) bool {
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) == 5 && f[3] == "-" {
			if r, err := strconv.Atoi(f[2]); err == nil && r > 0 {
				return true
			}
		}
	}
	return false
}

// PodNodes are the nodes of APIServerPods lines, space-separated.
func PodNodes(lines []string) string {
	var nodes []string
	for _, l := range lines {
		if f := strings.Fields(l); len(f) == 5 {
			nodes = append(nodes, f[4])
		}
	}
	return strings.Join(nodes, " ")
}

func (lc *lifecycle) oneReadyPod() bool { return OneReadyPod(lc.pods()) }

func (lc *lifecycle) deployReady() bool { return lc.n.DeployReady() && lc.oneReadyPod() }

func (lc *lifecycle) daemonSetDone() bool {
	d, err := lc.n.Client.AppsV1().DaemonSets("kube-system").Get(lc.n.Ctx, "kube-apiserver", metav1.GetOptions{})
	return err == nil && DaemonSetDone(d)
}

func (lc *lifecycle) dsReady() bool { return lc.daemonSetDone() && lc.oneReadyPod() }

// DaemonSetDone is what `kubectl rollout status daemonset/…` waits for: a rolling update whose
// latest generation the controller saw, with every desired pod updated and available.
func DaemonSetDone(d *appsv1.DaemonSet) bool {
	st := d.Status
	return d.Spec.UpdateStrategy.Type == appsv1.RollingUpdateDaemonSetStrategyType &&
		d.Generation <= st.ObservedGeneration &&
		st.UpdatedNumberScheduled >= st.DesiredNumberScheduled && st.NumberAvailable >= st.DesiredNumberScheduled
}

// BudgetCountsOne: the disruption controller has seen the budget's latest generation and
// counts one healthy pod.
func BudgetCountsOne(p *policyv1.PodDisruptionBudget) bool {
	return p.Status.CurrentHealthy == 1 && p.Status.ObservedGeneration == p.Generation
}

func (lc *lifecycle) budget() (*policyv1.PodDisruptionBudget, error) {
	return lc.n.Client.PolicyV1().PodDisruptionBudgets("kube-system").Get(lc.n.Ctx, "kube-apiserver", metav1.GetOptions{})
}

// events is "COUNT x MESSAGE; …" of the events of that reason on kube-apiserver pods (probe
// failures are reason Unhealthy, preStop failures FailedPreStopHook).
func (lc *lifecycle) events(reason string) string {
	list, err := lc.n.Client.CoreV1().Events("kube-system").List(lc.n.Ctx, metav1.ListOptions{FieldSelector: "reason=" + reason})
	if err != nil {
		return "(" + err.Error() + ")"
	}
	return nodecheck.EventSummary(list, "kube-apiserver-")
}

// kubectlLog runs kubectl as Kubectl does and keeps its output in a log file of the state
// directory.
func (lc *lifecycle) kubectlLog(log string, timeout time.Duration, args ...string) (string, error) {
	out, err := lc.n.Kubectl(timeout, args...)
	_ = os.WriteFile(lc.n.Path(log), []byte(out+"\n"), 0o644)
	return out, err
}

// Kustomization is the overlay lifecycle renders through: the local images, and with uid
// not 0 the patch that keeps the proxies' uid (docs/runbooks/selector-upgrade.md, step 0: an
// installation upgraded from a release whose proxies ran as another uid keeps it; old and new
// pods hand over to each other only with one uid).
func Kustomization(overlay, proxyImage, imageRepo, version string, uid int) string {
	i := strings.LastIndex(proxyImage, ":")
	k := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../manifests/%s
images:
  - name: ghcr.io/example/kube-apiserver-proxy
    newName: %s
    newTag: %s
  - name: registry.k8s.io/kube-apiserver
    newName: %s/kube-apiserver
    newTag: %s
`, overlay, proxyImage[:i], proxyImage[i+1:], imageRepo, version)
	if uid == 0 {
		return k
	}
	return k + strings.ReplaceAll(`patches:
  - target:
      kind: Deployment|DaemonSet
      name: kube-apiserver
    patch: |-
      - op: test
        path: /spec/template/spec/initContainers/0/name
        value: install-proxy
      - op: replace
        path: /spec/template/spec/initContainers/0/securityContext/runAsUser
        value: UID
      - op: replace
        path: /spec/template/spec/initContainers/0/securityContext/runAsGroup
        value: UID
      - op: test
        path: /spec/template/spec/containers/1/name
        value: proxy
      - op: replace
        path: /spec/template/spec/containers/1/securityContext/runAsUser
        value: UID
      - op: replace
        path: /spec/template/spec/containers/1/securityContext/runAsGroup
        value: UID
`, "UID", strconv.Itoa(uid))
}

// render renders src's manifests/OVERLAY with the local images (and the kept uid) into
// NAME.yaml of the state directory; a failure is reported as what's.
func (lc *lifecycle) render(what, name, overlay, src string) bool {
	n := lc.n
	k := n.Path("kustomize-" + name)
	err := os.MkdirAll(filepath.Join(k, "local"), 0o755)
	if err == nil {
		_, err = n.Run(30*time.Second, "cp", "-r", filepath.Join(src, "manifests"), filepath.Join(k, "manifests"))
	}
	if err == nil {
		err = os.WriteFile(filepath.Join(k, "local/kustomization.yaml"),
			[]byte(Kustomization(overlay, n.ProxyImage(), n.ImageRepo, n.Version, lc.uid)), 0o644)
	}
	var out string
	if err == nil {
		out, err = n.Kubectl(60*time.Second, "kustomize", filepath.Join(k, "local"))
	}
	if err == nil {
		err = os.WriteFile(n.Path(name+".yaml"), []byte(out+"\n"), 0o644)
	}
	if err != nil {
		n.Fail("%s: kubectl kustomize failed: %s", what, report.Cut(err.Error(), 300))
		return false
	}
	return true
}

// endpoints applies default/kubernetes for the node address, as docs/operations.md says with
// the single-controller overlay (--endpoint-reconciler-type=none), when the proxy has the
// subcommand.
func (lc *lifecycle) endpoints() string {
	if _, err := lc.n.Run(10*time.Second, lc.n.Bin("kube-apiserver-proxy"), "kubernetes-endpoints", "--help"); err != nil {
		return ""
	}
	out, err := lc.n.EndpointsApply()
	return out + errSuffix(err)
}

// begin starts a step under the load and its observers: connects on NODE_IP:6443,
// default/kubernetes, the controller-manager and the scheduler, and every kube-apiserver pod
// (kubeadm's mirror pod left out), none of which may restart or turn unready unless it is
// being deleted (unless restarts are the step's point). nil when it did not start.
func (lc *lifecycle) begin(name string, restartsExpected bool) *lcStep {
	o := lc.n.Watched()
	o.Endpoints = true
	if !restartsExpected {
		o.WatchPods = []string{"kube-system/" + apiServerPods}
	}
	mark := lc.n.MarkLogs()
	st := lc.n.StartStep(name, o)
	if st == nil {
		return nil
	}
	return &lcStep{lc: lc, st: st, mark: mark}
}

type lcStep struct {
	lc   *lifecycle
	st   *Step
	mark LogMark
}

// end is the step's verdict, and what the logs say.
func (s *lcStep) end(what string) *step.Report {
	n := s.lc.n
	rep := s.st.End(what)
	n.LogVerdict(what, s.mark, s.st.ReportOnly)
	n.Note("%s: restarts: %s", what, n.ControlPlaneRestarts())
	return rep
}

// pivotTo applies a rendering and pivots to it from kubeadm's static pod in the order that
// completes (the static manifest moved out once the pod is bound); the outage is measured
// in step name, not asserted (the migration owns a pivot without refused connections).
// ready, if not nil, reports the Deployment ready (applied: kubectl apply's time, moved: the
// static manifest's).
func (lc *lifecycle) pivotTo(name, manifest, what string, ready func(applied, moved time.Time)) bool {
	n := lc.n
	o := n.Watched()
	o.NoLoad = true
	st := n.StartStep(name, o)
	if st != nil {
		st.ReportOnly = true
	}
	t0 := time.Now()
	if out, err := lc.kubectlLog("apply-"+name+".log", 60*time.Second, "apply", "-f", manifest); err != nil {
		n.Fail("%s: kubectl apply: %v %s", what, err, report.Cut(out, 300))
		st.End(what + " pivot (measured)")
		return false
	}
	n.WaitFor(120*time.Second, n.PodScheduled)
	t1 := time.Now()
	if err := Move(filepath.Join(n.Manifests, "kube-apiserver.yaml"), n.Path("kube-apiserver.static.yaml")); err != nil {
		n.Fail("%s: remove the static manifest: %v", what, err)
	}
	if !n.WaitFor(420*time.Second, lc.deployReady) {
		n.Fail("%s: the Deployment is not ready: %s", what, lc.podsLine())
		st.End(what + " pivot (measured)")
		return false
	}
	if ready != nil {
		ready(t0, t1)
	}
	st.End(what + ": the pivot from kubeadm's static pod (measured, not this rehearsal's subject)")
	return true
}

// straight: the current manifests applied straight away (LIFECYCLE_STEPS without legacy).
func (lc *lifecycle) straight() bool {
	if !lc.render("start", "current", "single-controller", lc.n.Repo) {
		return false
	}
	lc.endpoints()
	return lc.pivotTo("start", lc.n.Path("current.yaml"), "start", nil)
}

// 1. The previous release: pivot to its Deployment, then show that a drain waits for ever.
func (lc *lifecycle) legacy() bool {
	n := lc.n
	ref := EnvKnob("LEGACY_REF")
	src := n.Path("legacy")
	if err := os.MkdirAll(src, 0o755); err != nil {
		n.Fail("legacy: %v", err)
		return false
	}
	if out, err := n.Run(60*time.Second, "sh", "-c", `git -C "$1" archive "$2" manifests | tar -x -C "$3"`, "sh", n.Repo, ref, src); err != nil {
		n.Fail("legacy: cannot read manifests/ at %s from git: %s", ref, report.Cut(out+" "+err.Error(), 200))
		return false
	}
	if pdb, _ := os.ReadFile(filepath.Join(src, "manifests/base/pdb.yaml")); !strings.Contains(string(pdb), "component: kube-apiserver") {
		n.Fail("legacy: %s is not a release with the component/tier selector", ref)
		return false
	}
	if !lc.render("legacy", "legacy", "single-controller", src) {
		return false
	}
	// The node as that release made it: its tmpfiles.d owner (its proxies' uid, 65532), which
	// the releases after it keep on such a node.
	uid, err := Tmpfiles(filepath.Join(src, "manifests/node/tmpfiles.d/kube-apiserver-proxy.conf"), false)
	if err != nil {
		n.Fail("legacy: the node's directories as %s's tmpfiles.d makes them: %v", ref, err)
		return false
	}
	lc.uid = uid
	n.Pass("legacy: node directories as %s's tmpfiles.d makes them (uid %d, kept by the upgrade): %s", ref, uid, DirModes())
	ready := func(applied, moved time.Time) {
		n.Pass("legacy: the previous release's Deployment (%s) runs, %s s after kubectl apply (%s s after the static manifest went): %s",
			ref, Since(applied), Since(moved), lc.podsLine())
	}
	if !lc.pivotTo("legacy_pivot", n.Path("legacy.yaml"), "legacy", ready) {
		return false
	}
	// The previous budget (minAvailable 1 of 1 replica): drain never completes. Once the
	// disruption controller counts the pod healthy, that is: before, the pod counts as
	// unhealthy, unhealthyPodEvictionPolicy AlwaysAllow lets the drain evict it, and the
	// previous manifests (no toleration of the cordon) leave the node with no apiserver, for
	// good: its replacement cannot be scheduled, and nothing can uncordon the node without an
	// apiserver. (Seen in one run of this rehearsal, with the drain 8 s after the pivot.)
	if !n.WaitFor(120*time.Second, func() bool { p, err := lc.budget(); return err == nil && BudgetCountsOne(p) }) {
		status := "?"
		if p, err := lc.budget(); err != nil {
			status = err.Error()
		} else if b, err := json.Marshal(p.Status); err == nil {
			status = string(b)
		}
		n.Fail("legacy: the budget never counted the pod healthy: %s", status)
		return false
	}
	t0 := time.Now()
	out, err := lc.kubectlLog("drain-legacy.log", 90*time.Second, "drain", n.NodeName, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=60s")
	switch refusal := BudgetRefusal(out); {
	case err == nil:
		n.Fail("legacy: kubectl drain completed with the previous budget (minAvailable 1): %s", lastLines(out, 3))
	case refusal == "":
		// It must not complete for the budget's reason, not for any error.
		n.Fail("legacy: kubectl drain did not complete, but not because the budget refused the eviction: %s", lastLines(out, 3))
	default:
		n.Pass("legacy: with the previous budget kubectl drain does not complete (--timeout=60s, %s s): %s", Since(t0), refusal)
	}
	_, _ = n.Kubectl(30*time.Second, "uncordon", n.NodeName)
	return lc.upgradeSelector()
}

var budgetRefusal = regexp.MustCompile(`Cannot evict pod as it would violate[^.]*`)

// BudgetRefusal is the eviction's refusal in kubectl drain's output, "" when there is none.
func BudgetRefusal(out string) string { return budgetRefusal.FindString(out) }

// 2. docs/runbooks/selector-upgrade.md.
func (lc *lifecycle) upgradeSelector() bool {
	n := lc.n
	if !lc.render("upgrade", "current", "single-controller", n.Repo) {
		return false
	}
	old := lc.podNames()
	st := lc.begin("upgrade", false)
	if st == nil {
		return false
	}
	var log strings.Builder
	t0 := time.Now()
	// a. Remove the Deployment, not its ReplicaSet and pod: the old pod serves on.
	out, _ := n.Kubectls(60*time.Second, "delete", "deployment", "kube-apiserver", "--cascade=orphan")
	log.WriteString(out + "\n")
	// b. Apply the new manifests: a new Deployment (new selector), the budget updated. The
	//    overlay switches the apiserver to the none endpoint reconciler: the endpoints first
	//    (docs/operations.md, "The kubernetes Service endpoints").
	log.WriteString(lc.endpoints() + "\n")
	out, _ = n.Kubectl(60*time.Second, "apply", "-f", n.Path("current.yaml"))
	log.WriteString(out + "\n")
	// c. Its pod starts beside the old one and takes the socket by handoff when Ready.
	if n.WaitFor(300*time.Second, n.DeployReady) {
		n.Note("upgrade: the new Deployment is ready %s s after the old one was orphaned: %s", Since(t0), lc.podsLine())
	} else {
		n.Fail("upgrade: the new Deployment is not ready: %s", lc.podsLine())
	}
	// d. Delete the old ReplicaSet (it takes its pod with it).
	const oldRS = "component=kube-apiserver,!app.kubernetes.io/name"
	var rs []string
	if list, err := n.Client.AppsV1().ReplicaSets("kube-system").List(n.Ctx, metav1.ListOptions{LabelSelector: oldRS}); err == nil {
		for _, r := range list.Items {
			rs = append(rs, "replicaset.apps/"+r.Name)
		}
	}
	out, _ = n.Kubectls(60*time.Second, "delete", "rs", "-l", oldRS, "--wait=false")
	log.WriteString(out + "\n")
	_ = os.WriteFile(n.Path("upgrade.log"), []byte(log.String()), 0o644)
	// The old (lease) apiserver tries to empty the endpoints at its SIGTERM: the admission
	// policy applied with them in b. denies it (docs/operations.md).
	if n.WaitFor(180*time.Second, func() bool { return lc.oneReadyPod() && !anyOf(lc.podNames(), old) }) {
		n.Pass("upgrade: selector moved to app.kubernetes.io/name+part-of in %s s; old ReplicaSet %s deleted; pods: %s -> %s",
			Since(t0), strings.Join(rs, " "), strings.Join(old, " "), strings.Join(lc.podNames(), " "))
	} else {
		n.Fail("upgrade: not one new Ready pod after %s s: %s (log: %s)", Since(t0), lc.podsLine(), lastLines(log.String(), 5))
	}
	if p, err := lc.budget(); err != nil {
		n.Note("upgrade: budget now: %v", err)
	} else {
		spec, _ := json.Marshal(p.Spec)
		_ = os.WriteFile(n.Path("pdb.json"), spec, 0o644)
		n.Note("upgrade: budget now %s", spec)
	}
	st.end("selector upgrade")
	return true
}

// anyOf: some of names is among of.
func anyOf(names, of []string) bool {
	for _, a := range names {
		for _, b := range of {
			if a == b {
				return true
			}
		}
	}
	return false
}

var drainedLine = regexp.MustCompile(`(?m)^.*(evicted|deleted).*$`)

// Drained are the lines of kubectl drain's output that say a pod was evicted or deleted.
func Drained(out string) string {
	return strings.Join(drainedLine.FindAllString(out, -1), " ")
}

// 3. kubectl drain of the only controller, with eviction (mode evict) and without (delete).
func (lc *lifecycle) drain(mode string) {
	n := lc.n
	name, args, how := "drain_"+mode, []string{}, "(eviction)"
	if mode == "delete" {
		args, how = []string{"--disable-eviction"}, "--disable-eviction"
	}
	before := lc.podNames()
	st := lc.begin(name, false)
	if st == nil {
		return
	}
	t0 := time.Now()
	out, err := lc.kubectlLog(name+".log", 620*time.Second, append([]string{"drain", n.NodeName, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=600s"}, args...)...)
	if err == nil {
		n.Pass("kubectl drain %s of the only controller completed in %s s: %s", how, Since(t0), Drained(out))
	} else {
		n.Fail("kubectl drain %s did not complete in %s s: %s", how, Since(t0), lastLines(out, 3))
	}
	if n.WaitFor(120*time.Second, lc.oneReadyPod) {
		after := lc.podNames()
		n.Check(!slicesEqual(after, before), "drain (%s): the apiserver pod was replaced on the cordoned node: %s -> %s (%s)",
			mode, strings.Join(before, " "), strings.Join(after, " "), PodNodes(lc.pods()))
	} else {
		n.Fail("drain (%s): no single Ready apiserver pod after the drain: %s", mode, lc.podsLine())
	}
	if prestop := lc.events("FailedPreStopHook"); prestop == "none" {
		n.Pass("drain (%s): no preStop hook failed", mode)
	} else {
		n.Fail("drain (%s): preStop hooks failed: %s", mode, prestop)
	}
	if _, err := n.Kubectl(30*time.Second, "uncordon", n.NodeName); err != nil {
		n.Fail("kubectl uncordon failed: %v", err)
	}
	st.end("drain (" + mode + ")")
}

func slicesEqual(a, b []string) bool {
	return strings.Join(a, " ") == strings.Join(b, " ")
}

func (lc *lifecycle) slowImage() string {
	return lc.n.ImageRepo + "/kube-apiserver:" + lc.n.Version + "-slow"
}

func (lc *lifecycle) plainImage() string {
	return "kube-apiserver=" + lc.n.ImageRepo + "/kube-apiserver:" + lc.n.Version
}

// buildSlowImage builds the slow apiserver's image (../node/slowstart as
// /usr/local/bin/kube-apiserver, the real binary beside it) and has the node import it.
func (lc *lifecycle) buildSlowImage(slowStart string) error {
	n := lc.n
	build := exec.CommandContext(n.Ctx, "go", "build", "-mod=readonly", "-trimpath", "-o", n.Bin("slowstart"), "./slowstart")
	build.Dir = filepath.Join(n.Repo, "tests/cluster/node")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./slowstart: %w: %s", err, lastLines(string(out), 3))
	}
	tar := n.Path("images/kube-apiserver-slow.tar")
	if out, err := n.Run(300*time.Second, n.Path("images/bin/mkimage"), "-name", lc.slowImage(), "-out", tar,
		"-entrypoint", "/usr/local/bin/kube-apiserver", "-env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin,SLOW_START="+slowStart,
		n.Bin("slowstart")+"=/usr/local/bin/kube-apiserver", n.Bin("kube-apiserver")+"=/usr/local/bin/kube-apiserver.real"); err != nil {
		return fmt.Errorf("mkimage: %w: %s", err, lastLines(out, 3))
	}
	return n.Do("image_import", tar)
}

// 4. An apiserver that takes SLOW_START longer to start: a rollout to it, and back.
func (lc *lifecycle) slow() {
	n := lc.n
	slowStart := EnvKnob("SLOW_START")
	if err := lc.buildSlowImage(slowStart); err != nil {
		n.Fail("slow start: image %s not built: %v", lc.slowImage(), err)
		return
	}
	st := lc.begin("slow", false)
	if st == nil {
		return
	}
	t0 := time.Now()
	_, _ = n.Kubectls(30*time.Second, "set", "image", "deployment/kube-apiserver", "kube-apiserver="+lc.slowImage())
	status, err := n.Kubectls(440*time.Second, "rollout", "status", "deployment/kube-apiserver", "--timeout=420s")
	if err == nil && n.WaitFor(120*time.Second, lc.oneReadyPod) {
		n.Pass("slow start: the rollout to an apiserver that waits %s before it starts completed in %s s: %s", slowStart, Since(t0), lc.podsLine())
	} else {
		n.Fail("slow start: rollout not complete after %s s: %s %s", Since(t0), lastLines(status, 2), lc.podsLine())
	}
	n.Note("slow start: probe events: %s", lc.events("Unhealthy"))
	t0 = time.Now()
	_, _ = n.Kubectls(30*time.Second, "set", "image", "deployment/kube-apiserver", lc.plainImage())
	if _, err := n.Kubectls(320*time.Second, "rollout", "status", "deployment/kube-apiserver", "--timeout=300s"); err == nil && n.WaitFor(120*time.Second, lc.oneReadyPod) {
		n.Note("slow start: back to the plain image in %s s", Since(t0))
	} else {
		n.Fail("slow start: the rollout back to the plain image did not complete")
	}
	// No container restarted and no Ready condition flipped: the step's pod watch.
	st.end("slow start")
}

// 4b. (LIFECYCLE_STEPS with slowprev) The same slow start, SLOW_START_PREVIOUS (120s) long,
// with the previous release's probes (no start-up probe, readiness failureThreshold 1): the
// kubelet restarts the slow apiserver (liveness: 10s + 8 x 10s); then with the current probes:
// no restart. Needs slow's image (run slow first).
func (lc *lifecycle) slowPrevious() {
	n := lc.n
	wait := EnvKnob("SLOW_START_PREVIOUS")
	st := lc.begin("slowprev", true)
	if st == nil {
		return
	}
	// The previous probes, the slow image, and the longer wait (the container's env overrides
	// the image's), in one change of the template: one rollout.
	t0 := time.Now()
	patch := fmt.Sprintf(`[
    {"op": "remove", "path": "/spec/template/spec/containers/0/startupProbe"},
    {"op": "replace", "path": "/spec/template/spec/containers/0/readinessProbe/failureThreshold", "value": 1},
    {"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": %q},
    {"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": {"name": "SLOW_START", "value": %q}}]`, lc.slowImage(), wait)
	if out, err := n.Kubectls(30*time.Second, "patch", "deployment/kube-apiserver", "--type=json", "-p", patch); err != nil {
		n.Fail("slow start, previous probes: kubectl patch: %v %s", err, report.Cut(out, 300))
	}
	if n.WaitFor(300*time.Second, func() bool { return APodRestarted(lc.pods()) }) {
		n.Pass("slow start, previous probes: the kubelet restarted the apiserver that waits %s, %s s into the rollout: %s", wait, Since(t0), lc.podsLine())
	} else {
		n.Fail("slow start, previous probes: no restart within 300 s: %s", lc.podsLine())
	}
	n.Note("slow start, previous probes: probe events: %s", lc.events("Unhealthy"))
	// Back to the current template (the old pod served throughout: maxUnavailable 0).
	_, _ = n.Kubectls(30*time.Second, "rollout", "undo", "deployment/kube-apiserver")
	if !n.WaitFor(300*time.Second, lc.deployReady) {
		n.Fail("slow start, previous probes: the undo did not complete: %s", lc.podsLine())
	}
	t0 = time.Now()
	_, _ = n.Kubectls(30*time.Second, "set", "image", "deployment/kube-apiserver", "kube-apiserver="+lc.slowImage())
	_, _ = n.Kubectls(30*time.Second, "set", "env", "deployment/kube-apiserver", "-c", "kube-apiserver", "SLOW_START="+wait)
	if _, err := n.Kubectls(620*time.Second, "rollout", "status", "deployment/kube-apiserver", "--timeout=600s"); err == nil && n.WaitFor(120*time.Second, lc.oneReadyPod) {
		n.Pass("slow start, current probes: the apiserver that waits %s rolled out in %s s without a restart: %s", wait, Since(t0), lc.podsLine())
	} else {
		n.Fail("slow start, current probes: not rolled out after %s s: %s", Since(t0), lc.podsLine())
	}
	_, _ = n.Kubectls(30*time.Second, "set", "env", "deployment/kube-apiserver", "-c", "kube-apiserver", "SLOW_START-")
	_, _ = n.Kubectls(30*time.Second, "set", "image", "deployment/kube-apiserver", lc.plainImage())
	if _, err := n.Kubectls(320*time.Second, "rollout", "status", "deployment/kube-apiserver", "--timeout=300s"); err != nil || !n.WaitFor(120*time.Second, lc.oneReadyPod) {
		n.Fail("slow start: the rollout back to the plain image did not complete")
	}
	st.end("slow start, previous and current probes")
}

// 5. The DaemonSet overlay: the move from the Deployment, rollouts, a drain; each step stops
// the rest when its load did not start.
func (lc *lifecycle) daemonset() {
	if lc.render("daemonset", "daemonset", "ha-daemonset", lc.n.Repo) && lc.dsMove() && lc.dsRollouts() {
		lc.dsDrain()
	}
}

// dsMove: the DaemonSet applied beside the Deployment, then the Deployment deleted.
func (lc *lifecycle) dsMove() bool {
	n := lc.n
	st := lc.begin("ds_move", false)
	if st == nil {
		return false
	}
	var log strings.Builder
	t0 := time.Now()
	out, err := n.Kubectl(60*time.Second, "apply", "-f", n.Path("daemonset.yaml"))
	log.WriteString(out + "\n")
	if err != nil {
		n.Fail("daemonset: kubectl apply: %v %s", err, report.Cut(out, 300))
	}
	if n.WaitFor(300*time.Second, lc.daemonSetDone) {
		n.Note("daemonset: its pod is Ready beside the Deployment's %s s after kubectl apply: %s", Since(t0), lc.podsLine())
	} else {
		n.Fail("daemonset: its pod is not Ready: %s", lc.podsLine())
	}
	out, _ = n.Kubectls(60*time.Second, "delete", "deployment", "kube-apiserver")
	log.WriteString(out + "\n")
	out, _ = n.Kubectls(60*time.Second, "delete", "pdb", "kube-apiserver")
	log.WriteString(out + "\n")
	_ = os.WriteFile(n.Path("apply-ds.log"), []byte(log.String()), 0o644)
	if n.WaitFor(240*time.Second, lc.dsReady) {
		n.Pass("daemonset: moved from the Deployment in %s s: %s", Since(t0), lc.podsLine())
	} else {
		n.Fail("daemonset: not one Ready DaemonSet pod after the Deployment's deletion: %s", lc.podsLine())
	}
	st.end("move to the DaemonSet")
	return true
}

// dsRollouts: DS_RESTARTS rollout restarts of the DaemonSet, each surging on the node.
func (lc *lifecycle) dsRollouts() bool {
	n := lc.n
	restarts := EnvKnobInt("DS_RESTARTS", 0)
	st := lc.begin("ds_rollouts", false)
	if st == nil {
		return false
	}
	for i := 1; i <= restarts; i++ {
		t0 := time.Now()
		before := lc.podNames()
		_, _ = n.Kubectls(30*time.Second, "rollout", "restart", "daemonset/kube-apiserver")
		status, err := n.Kubectls(320*time.Second, "rollout", "status", "daemonset/kube-apiserver", "--timeout=300s")
		if err == nil && n.WaitFor(120*time.Second, lc.dsReady) {
			n.Pass("daemonset rollout restart %d/%d complete after %s s: %s -> %s", i, restarts, Since(t0), strings.Join(before, " "), strings.Join(lc.podNames(), " "))
		} else {
			n.Fail("daemonset rollout restart %d/%d not complete after %s s: %s %s", i, restarts, Since(t0), lastLines(status, 2), lc.podsLine())
		}
	}
	// maxSurge 1 on one node: the new pod ran beside the old one before it went.
	most := 0
	if rep := st.end("DaemonSet rollouts"); rep != nil {
		most = rep.MostPodsAtOnce("kube-apiserver")
	}
	if most == 2 {
		n.Pass("daemonset: each rollout surged on the node (two pods at once, never zero)")
	} else {
		n.Fail("daemonset: no surge seen on the node: at most %d pods at once", most)
	}
	return true
}

// dsDrain: kubectl drain --ignore-daemonsets leaves the apiserver's DaemonSet pod alone.
func (lc *lifecycle) dsDrain() {
	n := lc.n
	st := lc.begin("ds_drain", false)
	if st == nil {
		return
	}
	before := lc.podNames()
	t0 := time.Now()
	if out, err := lc.kubectlLog("ds_drain.log", 320*time.Second, "drain", n.NodeName, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s"); err == nil {
		after := lc.podNames()
		if slicesEqual(after, before) {
			n.Pass("daemonset: kubectl drain --ignore-daemonsets completed in %s s and left the apiserver pod alone (%s)", Since(t0), strings.Join(after, " "))
		} else {
			n.Fail("daemonset: the drain replaced the apiserver pod: %s -> %s", strings.Join(before, " "), strings.Join(after, " "))
		}
	} else {
		n.Fail("daemonset: kubectl drain did not complete: %s", lastLines(out, 3))
	}
	if _, err := n.Kubectl(30*time.Second, "uncordon", n.NodeName); err != nil {
		n.Fail("kubectl uncordon failed: %v", err)
	}
	st.end("drain with the DaemonSet")
}
