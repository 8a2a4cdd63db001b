package node

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/report"
	"kube-apiserver-proxy/tests/cluster/internal/step"
)

// `kubeadm upgrade` on a migrated controller (docs/runbooks/upgrade-kubernetes.md,
// `smoke --kubeadm-upgrade`):
//
//  0. the node is made by a real `kubeadm init` of the older version (kubeadm-upgrade.sh's
//     ku_init: its own kubeadm, kubelet, controller-manager and scheduler; the DNS addon
//     disabled), with an audit policy and an encryption configuration (aescbc) in the
//     ClusterConfiguration's apiServer extraArgs and extraVolumes; a Secret is written here;
//  1. the migration as the runbook says it: `render --static-pod` of kubeadm's manifest,
//     `migrate`, `kubectl apply` of render's stream, then the static pods handed to
//     `kubeadm-sync --once` and the kubelet restarted on /etc/kubernetes/kubelet-manifests
//     (nothing but kubeadm's apiserver may restart);
//  2. `kubeadm upgrade plan` and `kubeadm upgrade apply VERSION` with kubeadm VERSION,
//     unpatched: the apiserver (a surge rollout of the Deployment), the controller-manager and
//     the scheduler (static pods) move to the new minor;
//  3. etcd: the pinned etcd imageTag set to KU_ETCD_VERSION in kubeadm-config and `kubeadm
//     upgrade apply` again, which upgrades etcd alone: kubeadm-sync restarts etcd in its pod
//     (the UID kept) and brings the mirror pod in line; judged with the store-restart criteria
//     (load.StoreRestartCriteria: nothing fails, each request within 8 s), and etcd itself
//     must report the new version and one member;
//  4. the kubelet binary replaced by VERSION's and restarted: the static pods must keep
//     running (the agent's copies carry their UIDs);
//  5. a third `kubeadm upgrade apply VERSION`: a no-op;
//  6. `kubeadm certs renew all`: the agent rolls the Deployment; the controllers restarted
//     for their renewed kubeconfigs; a power cycle of the node, recovered from reboot
//     recovery's checkpoint (installed after the migration, rebootStep);
//  7. going back (docs/runbooks/going-back.md, kubeadm-sync's form): the stand-in moved out,
//     migrate-back into the kubelet's directory, the Deployment deleted, `kubeadm-sync
//     --undo`, the kubelet restarted on kubeadm's directory: nothing but the apiserver
//     hand-over restarts (goBack).
//
// Afterwards: the new apiserver writes the audit log, the Secret written before is still
// readable and stored encrypted in etcd, the server version is the new one, etcd runs
// KU_ETCD_VERSION. Each step is judged by package step: connects to NODE_IP:6443 and
// 127.0.0.1:6443 every 20 ms, two client-go loads (one per address) held to the tier's strict
// criteria, the `kubernetes` endpoints watcher, and in the steps that do not upgrade them the
// controller-manager and the scheduler (no restart); from step 2 on, a third load runs in a
// pod (cmd/loadgen, through the kubernetes Service and kube-proxy). Step 3's loads wait out
// etcd's restart (its seconds without a completed request are allowed, not its failures). A
// per-step table closes the
// scenario: requests, failed, refused connects, relists.
//
// Preflight errors ignored, for this test node only: kubeadm's CoreDNS checks (CoreDNS is not
// installed here) and SystemVerification (this host has cgroup v1, which kubeadm refuses since
// 1.35; the kubelet runs with failCgroupV1: false).
//
// Environment: ETCD_VERSION (the etcd kubeadm init pinned, v3.6.16), KU_ETCD_VERSION (the one
// step 3 moves to, v3.7.0).
func RunKubeadmUpgrade(n *Scenario) {
	// render leaves `component` to kubeadm's pod: the Deployment's pods by their own labels.
	n.PodSelector = "app.kubernetes.io/name=kube-apiserver,pod-template-hash"
	u := &upgrade{Scenario: n, etcd: EnvKnob("ETCD_VERSION"), newEtcd: EnvKnob("KU_ETCD_VERSION")}
	if !n.CheckKnobs("kubeadm-upgrade") || !n.PrepareNode() {
		return
	}
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: kuSecret, Namespace: "default"}, Data: map[string][]byte{"word": []byte("kept")}}
	if _, err := n.Client.CoreV1().Secrets("default").Create(n.Ctx, secret, metav1.CreateOptions{}); err != nil {
		n.Fail("create secret default/%s: %v", kuSecret, err)
		return
	}
	u.secretCheck("after kubeadm init (" + n.OldVersion + ")")
	if !u.render() || !n.LocalKubeconfig() {
		return
	}
	// The migration is judged strictly by `smoke --migrate`; here it is the way to the
	// upgrade, and its observers report while this scenario asserts what the runbook's step 6
	// must keep: no refused connect and no failed request (migrateCheck). What they may report
	// besides: kubeadm's own apiserver, stopping with kubeadm's flags (no shutdown delay),
	// answers a few retried requests of connections made to it before the migration with 503
	// and resets one (rehearsed: 1 run of 2, as with the manifest moved away by hand); and a
	// restarted kubelet runs the static pods' start-up probes again, so kube-scheduler's mirror
	// pod turns unready once for a few seconds, its container untouched (handoff compares the
	// containers' IDs).
	if !n.Migrate(Migration{StaticStep: u.handoff, Watch: u.probeOnly(), ReportOnly: true}) {
		return
	}
	u.migrateCheck("migrate")
	u.migrateCheck("migrate-local")
	log, err := n.Logs("kube-apiserver-"+n.NodeName, "kube-apiserver", 5, false)
	if err != nil {
		log = err.Error()
	}
	n.Note("kubeadm-sync's log: %s", report.Cut(strings.ReplaceAll(strings.TrimSpace(log), "\n", "|"), 600))
	n.Note("images before the upgrade (etcd, controller-manager, scheduler, apiserver): %s", u.images())
	if !u.installRecovery() {
		return
	}
	u.kubeProxy()
	u.minor()
	u.failedEtcdUpgrade()
	u.etcdUpgrade()
	u.kubeletUpgrade()
	u.again()
	u.failedUpgrade(u.rejectedFlag())
	u.failedUpgrade(u.absentImage())
	u.failedUpgrade(u.busyPort())
	u.renew()
	u.kept()
	u.rebootStep()
	u.goBack()
	n.Note("per step (load through both addresses):")
	for _, row := range u.table("migrate", "upgrade", "etcd-failed", "etcd", "kubelet", "again", "failed", "failed-image", "failed-proxy", "renew", "restart", "reboot", "goback") {
		n.Note("%s", row)
	}
	n.Note("reports: %s, %s", n.Path("kubeadm-*.log"), n.Path("step-*.json"))
}

const (
	// kuSyncDir is the kubelet's static pod directory once kubeadm-sync follows kubeadm's.
	kuSyncDir = "/etc/kubernetes/kubelet-manifests"
	// kuManifests is kubeadm's static pod directory.
	kuManifests = "/etc/kubernetes/manifests"
	kuIgnore    = "CoreDNSMigration,CoreDNSUnsupportedPlugins,SystemVerification"
	kuSecret    = "ku-before-upgrade"
	// kuPodReports is where the load in a pod writes its report (a hostPath).
	kuPodReports = "/var/lib/ku-loadgen"
)

// upgrade is the scenario's state: the etcd versions and whether the load in a pod runs.
type upgrade struct {
	*Scenario
	etcd, newEtcd string
	pod           bool
}

// probeOnly is what the steps that restart the controllers watch: connects to NODE_IP:6443 and
// the load, no restarts.
func (u *upgrade) probeOnly() *step.Options {
	return &step.Options{Kubeconfig: u.Admin, Probes: []string{u.NodeIP + ":6443"}}
}

// kubeadm runs a kubeadm command (the new release's unless argv[0] is a path) with its output
// in the state directory's log and the kubelet of $S/path first on PATH (kubeadm asks it its
// version); the log's content comes back.
func (u *upgrade) kubeadm(log string, timeout time.Duration, argv ...string) (string, error) {
	f, err := os.Create(u.Path(log))
	if err != nil {
		return "", err
	}
	defer f.Close()
	ctx, cancel := context.WithTimeout(u.Ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), "PATH="+u.Path("path")+":"+os.Getenv("PATH"))
	cmd.Stdout, cmd.Stderr = f, f
	err = cmd.Run()
	out, _ := os.ReadFile(u.Path(log))
	return string(out), err
}

// render: `kube-apiserver-proxy render --static-pod` of kubeadm's manifest, as the runbook
// says, into deployment.yaml (what Migrate applies).
func (u *upgrade) render() bool {
	manifest := filepath.Join(u.Manifests, "kube-apiserver.yaml")
	out, err := os.Create(u.Path("deployment.yaml"))
	if err != nil {
		u.Fail("render: %v", err)
		return false
	}
	defer out.Close()
	var stderr bytes.Buffer
	cmd := exec.CommandContext(u.Ctx, u.Bin("kube-apiserver-proxy"), "render", "--static-pod", manifest, "--proxy-image", u.ProxyImage())
	cmd.Stdout, cmd.Stderr = out, &stderr
	if err := cmd.Run(); err != nil {
		u.Fail("render failed: %v %s", err, stderr.String())
		return false
	}
	rendered, _ := os.ReadFile(u.Path("deployment.yaml"))
	objects, image := renderedSummary(string(rendered))
	u.Pass("kube-apiserver-proxy render --static-pod %s: %d objects, apiserver image %s", manifest, objects, image)
	return true
}

// renderedSummary is how many objects a YAML stream has (top-level kind lines) and the first
// kube-apiserver image in it.
func renderedSummary(yaml string) (objects int, image string) {
	for _, l := range strings.Split(yaml, "\n") {
		if strings.HasPrefix(l, "kind:") {
			objects++
		}
		if i := strings.Index(l, "image: "); i >= 0 && image == "" && strings.Contains(l[i:], "kube-apiserver:") {
			image = l[i+len("image: "):]
		}
	}
	return objects, image
}

// installRecovery: reboot recovery as docs/runbooks/reboot-recovery.md installs it, on a node
// kubeadm-sync follows: manifests/recovery (its admission policies judge every later write to
// the Deployment, kubeadm-sync's included), and the agent's manifest in kubeadm's directory,
// which kubeadm-sync copies into the kubelet's. The apiserver's audit and encryption
// directories are allowed host paths (the runbook's --allow-host-path). The failed upgrades
// then check that the checkpoint stays the pod that served.
func (u *upgrade) installRecovery() bool {
	manifest, err := os.ReadFile(filepath.Join(u.Repo, agentManifest))
	if err != nil {
		u.Fail("%v", err)
		return false
	}
	return u.applyRecovery() && u.installAgent(string(manifest), kuManifests,
		"--allow-host-path=/etc/kubernetes/audit", "--allow-host-path=/var/log/kubernetes/audit",
		"--allow-host-path=/etc/kubernetes/encryption")
}

// The kubeconfig `kubeadm-sync --write-kubeconfig` writes by default, and the user it names.
const (
	agentKubeconfig = "/etc/kubernetes/kube-apiserver-proxy/kubeadm-sync.conf"
	agentUser       = "system:serviceaccount:kube-system:kube-apiserver-proxy-kubeadm-sync"
)

// handoff: the runbook's step 6, first form: kubeadm-sync --once, then the kubelet on the
// agent's directory (a node action). It reports its own checks.
func (u *upgrade) handoff() error {
	before := u.containerIDs()
	// The agent's own identity (a ServiceAccount token, the RBAC of what it calls), written
	// with kubeadm's admin.conf as the runbook says; every step after this one runs the agent
	// with it, so a call its RBAC does not allow fails the step that needs it.
	if _, err := u.kubeadm("kubeadm-sync-identity.log", time.Minute, u.Bin("kube-apiserver-proxy"), "kubeadm-sync",
		"--write-kubeconfig", "--node-name", u.NodeName); err != nil {
		u.Fail("kubeadm-sync --write-kubeconfig failed: %v %s", err, Tail(u.Path("kubeadm-sync-identity.log"), 5))
		return nil
	}
	if who, err := u.Run(30*time.Second, u.Bin("kubectl"), "--kubeconfig", agentKubeconfig, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"); !u.Check(err == nil && strings.TrimSpace(who) == agentUser,
		"the agent's kubeconfig %s authenticates as %s: %q%s", agentKubeconfig, agentUser, who, errSuffix(err)) {
		return nil
	}
	if can, _ := u.Run(30*time.Second, u.Bin("kubectl"), "--kubeconfig", agentKubeconfig, "auth", "can-i", "patch", "-n", "kube-system", "secrets"); !u.Check(strings.TrimSpace(can) == "no",
		"the agent's identity may not touch what it does not call (can-i patch secrets: %q)", strings.TrimSpace(can)) {
		return nil
	}
	t0 := time.Now()
	// --once sets kubeadm's manifest aside and returns once kubeadm's apiserver has exited.
	_, err := u.kubeadm("kubeadm-sync-once.log", 5*time.Minute, u.Bin("kube-apiserver-proxy"), "kubeadm-sync", "--once",
		"--node-name", u.NodeName, "--proxy-image", u.ProxyImage())
	if err != nil || !u.WildcardGone() {
		u.Fail("kubeadm-sync --once failed: %v %s", err, Tail(u.Path("kubeadm-sync-once.log"), 5))
		return nil
	}
	u.Pass("kubeadm-sync --once after %s s, kubeadm's static apiserver gone: %s", Since(t0), dirNames(kuSyncDir, false))
	if u.Do("ku_kubelet_manifests", kuSyncDir) != nil {
		return nil // the action reported why
	}
	manifest := filepath.Join(u.Manifests, "kube-apiserver.yaml")
	if u.WaitFor(120*time.Second, func() bool { _, err := os.Stat(manifest); return err == nil }) {
		u.Pass("kubelet on %s, the agent runs and put kubeadm's manifest back %s s after kubeadm-sync --once", kuSyncDir, Since(t0))
	} else {
		u.Fail("kubeadm's manifest not back in %s: %s", u.Manifests, dirNames(u.Manifests, true))
	}
	mirror := "kube-apiserver-" + u.NodeName
	var p *corev1.Pod
	if u.WaitFor(120*time.Second, func() bool {
		var err error
		p, err = u.Client.CoreV1().Pods("kube-system").Get(u.Ctx, mirror, metav1.GetOptions{})
		return err == nil && nodecheck.Ready(p)
	}) {
		labels, _ := json.Marshal(p.Labels)
		u.Pass("the agent's mirror pod kube-system/%s is Ready: labels %s, image %s", mirror, labels, p.Spec.Containers[0].Image)
	} else {
		u.Fail("%s not Ready: %s", mirror, u.podLine(mirror))
	}
	after := u.containerIDs()
	u.Check(after == before, "etcd, controller-manager and scheduler kept running across the kubelet's move: before %s after %s", before, after)
	return nil
}

// dirNames are the names in dir, as ls lists them (all: with the hidden ones).
func dirNames(dir string, all bool) string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err.Error()
	}
	var names []string
	for _, e := range entries {
		if all || !strings.HasPrefix(e.Name(), ".") {
			names = append(names, e.Name())
		}
	}
	return strings.Join(names, " ")
}

// migrateCheck: the migration step's report: no refused or failed connect of the probers, no
// failed request (client-go's retries included: what a client saw).
func (u *upgrade) migrateCheck(name string) {
	rep, err := step.Read(u.Path("step-" + name + ".json"))
	if err != nil || rep.Load == nil {
		u.Fail("the migration (%s): no report %v", name, err)
		return
	}
	bad, failed := rep.ProbeFailures(), rep.Load.TotalFailed()
	if bad == 0 && failed == 0 {
		u.Pass("the migration (%s): 0 refused or failed connects, 0 failed requests; reported besides: %s", name, problems(rep))
	} else {
		u.Fail("the migration (%s): %d refused or failed connects, %d failed requests; reported: %s", name, bad, failed, problems(rep))
	}
}

// problems are a report's problems on one line, "none" when it has none.
func problems(r *step.Report) string {
	if len(r.Problems) == 0 {
		return "none"
	}
	return strings.Join(r.Problems, "; ")
}

// kubeProxy: kubeadm's kube-proxy addon ready, its rules for the kubernetes Service there,
// then the load in a pod is set up for the steps to come.
func (u *upgrade) kubeProxy() {
	ds := func() string {
		d, err := u.Client.AppsV1().DaemonSets("kube-system").Get(u.Ctx, "kube-proxy", metav1.GetOptions{})
		if err != nil {
			return err.Error()
		}
		return fmt.Sprintf("image %s, desired %d, updated %d, ready %d", d.Spec.Template.Spec.Containers[0].Image,
			d.Status.DesiredNumberScheduled, d.Status.UpdatedNumberScheduled, d.Status.NumberReady)
	}
	image := ""
	ready := func() bool {
		d, err := u.Client.AppsV1().DaemonSets("kube-system").Get(u.Ctx, "kube-proxy", metav1.GetOptions{})
		if err == nil {
			image = d.Spec.Template.Spec.Containers[0].Image
		}
		return err == nil && d.Status.NumberReady == 1
	}
	var err error
	if u.WaitFor(120*time.Second, ready) && u.WaitFor(60*time.Second, kubeProxyRule) {
		if err = u.podSetup(); err == nil {
			u.Pass("kube-proxy %s (kubeadm's addon, iptables mode) ready, 10.96.0.1 in its rules", image[strings.LastIndex(image, ":")+1:])
			u.pod = true
			return
		}
	}
	logs := u.logsBySelector("k8s-app=kube-proxy", 5)
	u.Fail("kube-proxy not ready or no rule for 10.96.0.1: %s; %s %s", ds(), report.Cut(logs, 600), errSuffix(err))
}

// kubeProxyRule: kube-proxy's rules hold the kubernetes Service's address.
func kubeProxyRule() bool {
	out, err := exec.Command("iptables", "-t", "nat", "-S", "KUBE-SERVICES").Output()
	return err == nil && strings.Contains(string(out), "10.96.0.1/32")
}

// kubeProxyReadySince: kube-proxy's pod turned Ready after since (its container started again
// after a reboot) and its rules are in place.
func (u *upgrade) kubeProxyReadySince(since time.Time) bool {
	list, err := u.Client.CoreV1().Pods("kube-system").List(u.Ctx, metav1.ListOptions{LabelSelector: "k8s-app=kube-proxy"})
	if err != nil || len(list.Items) != 1 {
		return false
	}
	for _, c := range list.Items[0].Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue && c.LastTransitionTime.After(since) && kubeProxyRule()
		}
	}
	return false
}

// logsBySelector: the last lines of the logs of the kube-system pods selector selects.
func (u *upgrade) logsBySelector(selector string, tail int64) string {
	list, err := u.Client.CoreV1().Pods("kube-system").List(u.Ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, p := range list.Items {
		log, err := u.Logs(p.Name, "", tail, false)
		if err != nil {
			log = err.Error()
		}
		out = append(out, PodLine(&p)+": "+strings.ReplaceAll(strings.TrimSpace(log), "\n", " "))
	}
	return strings.Join(out, "; ")
}

// applied is what one `kubeadm upgrade apply` did.
type applied struct {
	seconds     string
	genDelta    int64 // new generations of the Deployment
	hashChanged bool  // the stand-in's hash kubeadm waits on
	log         string
	err         error
}

// apply: `kubeadm upgrade apply VERSION` with kubeadm VERSION, its output in kubeadm-LOG.log.
func (u *upgrade) apply(what, log string) applied {
	gen0, hash0 := u.generation(), u.standinHash()
	t0 := time.Now()
	out, err := u.kubeadm("kubeadm-"+log+".log", 15*time.Minute, u.Bin("kubeadm"), "upgrade", "apply", u.Version, "-y", "--ignore-preflight-errors="+kuIgnore)
	a := applied{seconds: Since(t0), log: out, err: err}
	a.genDelta = u.generation() - gen0
	a.hashChanged = u.standinHash() != hash0
	u.Note("%s: kubeadm said: %s", what, kubeadmSaid(out))
	return a
}

var kubeadmNews = regexp.MustCompile(`kube-apiserver|kube-controller|kube-scheduler|etcd|SUCCESS|equal|Restarting`)

// kubeadmSaid is what kubeadm's log says of the components: its [upgrade…] lines about them,
// each cut to 160 bytes, joined with "|".
func kubeadmSaid(log string) string {
	var out []string
	for _, l := range strings.Split(log, "\n") {
		if strings.HasPrefix(l, "[upgrade") && kubeadmNews.MatchString(l) {
			out = append(out, report.Cut(l, 160))
		}
	}
	return strings.Join(out, "|")
}

// matching are the lines of log that match re (case-insensitive), each cut to 300 bytes.
func matching(log, re string) []string {
	return report.Grep(log, 300, regexp.MustCompile("(?i)"+re).MatchString)
}

// grepTail is the last k lines of log that match re, joined with "|".
func grepTail(log, re string, k int) string {
	out := matching(log, re)
	return strings.Join(report.Last(out, k), "|")
}

// kuErrors are kubeadm's lines that say why it failed.
const kuErrors = `error|fatal|timed out`

// planRows are `kubeadm upgrade plan`'s rows of the control plane's components, and whether
// the apiserver's goes from old to new.
func planRows(log, old, new string) (string, bool) {
	var rows []string
	for _, l := range strings.Split(log, "\n") {
		for _, c := range []string{"kube-apiserver ", "kube-controller-manager ", "kube-scheduler ", "etcd "} {
			if strings.HasPrefix(l, c) {
				rows = append(rows, strings.Join(strings.Fields(l), " "))
			}
		}
	}
	moves := regexp.MustCompile(`(?m)^kube-apiserver +.*` + regexp.QuoteMeta(old) + ` +` + regexp.QuoteMeta(new))
	return strings.Join(rows, "|"), moves.MatchString(log)
}

// minor: step 2, the minor upgrade of the control plane. kubeadm restarts the
// controller-manager and the scheduler: this step does not watch them for restarts.
func (u *upgrade) minor() {
	plan, err := u.kubeadm("kubeadm-plan.log", 5*time.Minute, u.Bin("kubeadm"), "upgrade", "plan", u.Version, "--ignore-preflight-errors="+kuIgnore)
	rows, moves := planRows(plan, u.OldVersion, u.Version)
	if err == nil && moves {
		u.Pass("kubeadm upgrade plan %s: %s", u.Version, rows)
	} else {
		u.Fail("kubeadm upgrade plan %s: %v %s", u.Version, err, strings.Join(report.First(matching(plan, "error|kube-apiserver"), 5), "|"))
	}
	s := u.startStep("upgrade", u.probeOnly(), false)
	a := u.apply("kubeadm upgrade apply "+u.Version, "upgrade")
	if a.err == nil {
		u.Pass("kubeadm upgrade apply %s from %s, unpatched, succeeded after %s s; the Deployment rolled (%d new generations), kube-apiserver-%s's hash changed: %s",
			u.Version, u.OldVersion, a.seconds, a.genDelta, u.NodeName, yesNo(a.hashChanged))
	} else {
		u.Fail("kubeadm upgrade apply %s failed after %s s: %v %s", u.Version, a.seconds, a.err, grepTail(a.log, kuErrors, 5))
	}
	u.endStep(s, "kubeadm upgrade apply "+u.Version+" (apiserver, controller-manager, scheduler; etcd's certificates renewed)")
	u.Note("the upgrade: %s", u.etcdDown(s))
	images := u.images()
	want := fmt.Sprintf("etcd:%s kube-controller-manager:%s kube-scheduler:%s kube-apiserver:%s", u.etcd, u.Version, u.Version, u.Version)
	if images == want &&
		u.WaitFor(60*time.Second, func() bool { return u.MirrorReady("kube-controller-manager-" + u.NodeName) }) &&
		u.WaitFor(60*time.Second, func() bool { return u.MirrorReady("kube-scheduler-" + u.NodeName) }) {
		u.Pass("after the upgrade: %s (etcd pinned by imageTag: kubeadm kept it)", images)
	} else {
		u.Fail("after the upgrade, images (etcd, controller-manager, scheduler, apiserver): %s (want %s); %s; %s", images, want,
			u.podLine("kube-controller-manager-"+u.NodeName), u.podLine("kube-scheduler-"+u.NodeName))
	}
	proxy := u.ImageRepo + "/kube-proxy:" + u.Version
	var state string
	if u.WaitFor(120*time.Second, func() bool {
		d, err := u.Client.AppsV1().DaemonSets("kube-system").Get(u.Ctx, "kube-proxy", metav1.GetOptions{})
		if err != nil {
			state = err.Error()
			return false
		}
		state = fmt.Sprintf("image %s, updated %d, ready %d", d.Spec.Template.Spec.Containers[0].Image, d.Status.UpdatedNumberScheduled, d.Status.NumberReady)
		return d.Spec.Template.Spec.Containers[0].Image == proxy && d.Status.UpdatedNumberScheduled == 1 && d.Status.NumberReady == 1
	}) {
		u.Pass("kubeadm upgraded kube-proxy to %s (its DaemonSet rolled, ready)", u.Version)
	} else {
		u.Fail("kube-proxy after the upgrade: %s", state)
	}
}

// etcdUpgrade: step 3. A pinned imageTag is the operator's to move
// (docs/runbooks/upgrade-kubernetes.md): kubeadm-config edited, `kubeadm upgrade apply` again.
func (u *upgrade) etcdUpgrade() {
	before := u.containerIDs()
	if err := u.setEtcdTag(u.etcd, u.newEtcd); err != nil {
		u.Fail("kubeadm-config's etcd imageTag not changed: %v", err)
	} else {
		u.Note("kubeadm-config: etcd imageTag %s -> %s", u.etcd, u.newEtcd)
	}
	uid0, hash0, _ := u.etcdMirror()
	// etcd restarts under the loads: 0 failed and each request within the bound, the seconds
	// of the restart waited out (load.StoreRestartCriteria).
	watch := u.probeOnly()
	watch.Criteria = "store-restart"
	s := u.startStep("etcd", watch, false)
	a := u.apply(fmt.Sprintf("kubeadm upgrade apply %s (etcd %s)", u.Version, u.newEtcd), "etcd")
	uid, hash, image := u.etcdMirror()
	if a.err == nil && a.genDelta == 0 && image == u.ImageRepo+"/etcd:"+u.newEtcd {
		u.Pass("kubeadm upgrade apply upgraded etcd to %s after %s s, the apiserver untouched (no new generation): %s; containers before: %s after: %s",
			u.newEtcd, a.seconds, u.etcdDown(s), before, u.containerIDs())
	} else {
		u.Fail("the etcd upgrade: %v, generation delta %d, etcd image %s: %s", a.err, a.genDelta, image, grepTail(a.log, kuErrors, 3))
	}
	// etcd itself: the new version, one member (kubeadm's layout, nothing left beside it).
	version, members, err := etcdMembers()
	if want := strings.TrimPrefix(u.newEtcd, "v"); err == nil && version == want && len(members) == 1 && !members[0].Learner {
		u.Pass("etcd reports version %s and one member: %s", version, members[0].Name)
	} else {
		u.Fail("etcd after its upgrade: version %q (want %s), members %v%s", version, want, members, errSuffix(err))
	}
	// kubeadm-sync kept the pod (its UID) and brought the mirror pod in line: the pod restarted
	// in place, with no API call (a new pod waits on the API while etcd is down).
	if uid == uid0 && uid != "" && hash != hash0 {
		u.Pass("etcd restarted in its pod: the mirror pod kept (uid %s), its config hash %s -> %s and image %s set by kubeadm-sync", uid, hash0, hash, image)
	} else {
		u.Fail("etcd's pod replaced or its mirror pod not brought in line: mirror pod uid %s -> %s, config hash %s -> %s, image %s", uid0, uid, hash0, hash, image)
	}
	// The restart's short grace period is gone: the copy is kubeadm's pod again.
	var why string
	if u.WaitFor(30*time.Second, func() bool {
		var same bool
		same, why = copyIsKubeadms("etcd.yaml")
		return same
	}) {
		u.Pass("etcd's copy is kubeadm's new pod again, the restart's grace period taken out (%s)", why)
	} else {
		u.Fail("etcd's copy is not kubeadm's new pod: %s", why)
	}
	u.endStep(s, "etcd's upgrade (etcd restarted in its pod)")
}

// etcdMirror: etcd's mirror pod's UID, config hash and image (the error as image).
func (u *upgrade) etcdMirror() (uid types.UID, hash, image string) {
	p, err := u.Client.CoreV1().Pods("kube-system").Get(u.Ctx, "etcd-"+u.NodeName, metav1.GetOptions{})
	if err != nil {
		return "", "", err.Error()
	}
	return p.UID, p.Annotations["kubernetes.io/config.hash"], p.Spec.Containers[0].Image
}

// setEtcdTag: in kubeadm-config's ClusterConfiguration, etcd's imageTag from one version to
// another (an update: it fails when the ConfigMap changed meanwhile, as kubectl replace does).
func (u *upgrade) setEtcdTag(from, to string) error {
	cms := u.Client.CoreV1().ConfigMaps("kube-system")
	cm, err := cms.Get(u.Ctx, "kubeadm-config", metav1.GetOptions{})
	if err != nil {
		return err
	}
	cfg, ok := cm.Data["ClusterConfiguration"]
	if !ok {
		return fmt.Errorf("no data.ClusterConfiguration")
	}
	changed := strings.ReplaceAll(cfg, "imageTag: "+from, "imageTag: "+to)
	if changed == cfg {
		return fmt.Errorf("no imageTag: %s in the ClusterConfiguration", from)
	}
	cm.Data["ClusterConfiguration"] = changed
	_, err = cms.Update(u.Ctx, cm, metav1.UpdateOptions{})
	return err
}

// kubeletUpgrade: step 4, the kubelet binary stopped, replaced, started on the same files (a
// node action). The agent's copies carry their UIDs, so the kubelet of the new minor keeps
// every static pod (without them it would replace each, etcd's too:
// tests/cluster/node/STEPS.md). A restarted kubelet runs the start-up probes again, so a
// mirror pod may turn unready for a moment, its container untouched: the step compares the
// containers' IDs instead of watching Ready.
func (u *upgrade) kubeletUpgrade() {
	s := u.startStep("kubelet", u.probeOnly(), false)
	before := u.containerIDs()
	t0 := time.Now()
	err := u.Do("ku_kubelet_upgrade")
	if err == nil && u.WaitFor(120*time.Second, func() bool { return u.kubeletVersion() == u.Version }) &&
		u.WaitFor(120*time.Second, func() bool { return strings.HasPrefix(u.nodeReady(), "True ") }) {
		u.Pass("the kubelet upgraded to %s: node Ready again after %s s; containers before: %s after: %s", u.Version, Since(t0), before, u.containerIDs())
	} else {
		u.Fail("the kubelet upgrade: %v, node %s, %s", err, u.kubeletVersion(), u.nodeReady())
	}
	settled := func() bool {
		kubelet, err := u.KubeletPods()
		if err != nil {
			return false
		}
		api, err := u.Client.CoreV1().Pods("kube-system").List(u.Ctx, metav1.ListOptions{})
		return err == nil && nodecheck.StaticSettled(kubelet, api)
	}
	if u.WaitFor(300*time.Second, settled) && u.WaitFor(120*time.Second, u.DeployReady) && u.containerIDs() == before {
		u.Pass("every static pod kept by the new kubelet, Ready (%s): containers %s", u.etcdDown(s), before)
	} else {
		u.Fail("the static pods after the new kubelet (%s): containers before %s now %s; %s", u.etcdDown(s), before, u.containerIDs(), u.systemPods())
	}
	u.endStep(s, "the kubelet's upgrade")
}

// again: step 5, `kubeadm upgrade apply` once more: nothing to do.
func (u *upgrade) again() {
	s := u.startStep("again", nil, false)
	a := u.apply("third kubeadm upgrade apply "+u.Version, "again")
	if a.err == nil && a.genDelta == 0 && strings.Contains(a.log, "Current and new manifests of kube-apiserver are equal") {
		u.Pass("kubeadm upgrade apply %s once more is a no-op for the apiserver (%s s, no new generation)", u.Version, a.seconds)
	} else {
		u.Fail("kubeadm upgrade apply once more: %v or changes (generation delta %d): %s", a.err, a.genDelta, lastLines(a.log, 3))
	}
	u.endStep(s, "the no-op kubeadm upgrade apply")
}

// renew: step 6, `kubeadm certs renew all`: the agent rolls the Deployment.
func (u *upgrade) renew() {
	s := u.startStep("renew", nil, false)
	gen0, before := u.generation(), u.containerIDs()
	serials0, _ := etcdServes()
	t0 := time.Now()
	out, err := u.kubeadm("kubeadm-renew.log", 5*time.Minute, u.Bin("kubeadm"), "certs", "renew", "all")
	if err == nil && u.WaitFor(240*time.Second, func() bool {
		return u.generation() != gen0 && u.DeployReady() && u.OnePodLeft()
	}) {
		u.Pass("kubeadm certs renew all: the agent rolled the Deployment, done after %s s", Since(t0))
	} else {
		u.Fail("kubeadm certs renew all: %v, no rollout of the Deployment within 240 s: %s; pods: %s", err, lastLines(out, 2), u.DeployPodsLine())
	}
	// etcd needs no restart: it reads its certificate files at each handshake.
	serials, err := etcdServes()
	if after := u.containerIDs(); serials.Same() && after == before && serials.File != serials0.File {
		u.Pass("etcd serves its renewed certificate with no restart (%s; before the renewal %s; containers %s)", serials, serials0, after)
	} else {
		u.Fail("etcd after the renewal: serves the certificate of its file %v (%s%s; before the renewal: %s), containers %s -> %s", serials.Same(), serials, errSuffix(err), serials0, before, after)
	}
	u.endStep(s, "kubeadm certs renew all")
	u.restartControllers()
}

// restartControllers: docs/runbooks/upgrade-kubernetes.md step 7, after `kubeadm certs renew
// all`: the controller-manager and the scheduler restarted as kubeadm says, their manifests
// moved out of kubeadm's directory and back (the agent removes their copies, then writes them
// again). Strict: 0 failed, 0 refused; each comes back Ready in a new container.
func (u *upgrade) restartControllers() {
	s := u.startStep("restart", u.probeOnly(), false)
	defer u.endStep(s, "the controller-manager and the scheduler restarted for their renewed kubeconfigs")
	// Beside kubeadm's directory, as an operator does (a rename: the same file system).
	aside, err := os.MkdirTemp(filepath.Dir(kuManifests), "manifests-aside-")
	if err != nil {
		u.Fail("%v", err)
		return
	}
	defer os.RemoveAll(aside)
	for _, c := range []string{"kube-controller-manager", "kube-scheduler"} {
		pod := c + "-" + u.NodeName
		id0 := u.containerOf(pod)
		from, to := filepath.Join(kuManifests, c+".yaml"), filepath.Join(aside, c+".yaml")
		if err := os.Rename(from, to); err != nil {
			u.Fail("move %s out: %v", from, err)
			return
		}
		gone := u.WaitFor(90*time.Second, func() bool {
			_, err := u.Client.CoreV1().Pods("kube-system").Get(u.Ctx, pod, metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		})
		if err := os.Rename(to, from); err != nil {
			u.Fail("move %s back: %v", from, err)
			return
		}
		if gone && u.WaitFor(120*time.Second, func() bool {
			id := u.containerOf(pod)
			return u.MirrorReady(pod) && id != "" && id != id0
		}) {
			u.Pass("%s restarted by moving its manifest out and back: its pod gone, back Ready in a new container (%s -> %s)", c, report.Cut(id0, 24), report.Cut(u.containerOf(pod), 24))
		} else {
			u.Fail("%s not restarted by moving its manifest out and back: pod gone %v; now %s", c, gone, u.podLine(pod))
		}
	}
}

// containerOf: the ID of pod's first container, as its mirror pod reports it ("" when none).
func (u *upgrade) containerOf(pod string) string {
	p, err := u.Client.CoreV1().Pods("kube-system").Get(u.Ctx, pod, metav1.GetOptions{})
	if err != nil || len(p.Status.ContainerStatuses) == 0 {
		return ""
	}
	return p.Status.ContainerStatuses[0].ContainerID
}

// kept: what the upgrade must have kept: the new server version, the Secret readable and
// encrypted, the audit log written by the new apiserver.
func (u *upgrade) kept() {
	server := ""
	if v, err := u.Client.Discovery().ServerVersion(); err != nil {
		server = err.Error()
	} else {
		server = v.GitVersion
	}
	u.Check(server == u.Version, "server version (what kubectl version shows): %s, want %s", server, u.Version)
	u.secretCheck("after the upgrade to " + u.Version)
	since := time.Now().UTC().Format("2006-01-02T15:04:05")
	_, _ = u.Client.CoreV1().Secrets("default").Get(u.Ctx, kuSecret, metav1.GetOptions{})
	const policy = "audit-policy-file=/etc/kubernetes/audit/policy.yaml"
	flagged := false
	if d, err := u.Client.AppsV1().Deployments("kube-system").Get(u.Ctx, "kube-apiserver", metav1.GetOptions{}); err == nil && len(d.Spec.Template.Spec.Containers) > 0 {
		for _, a := range d.Spec.Template.Spec.Containers[0].Args {
			flagged = flagged || strings.Contains(a, policy)
		}
	}
	if flagged && u.WaitFor(30*time.Second, func() bool { return audited(kuSecret, since) }) {
		u.Pass("the %s apiserver writes the audit log: a read of the Secret after the upgrade is in it", u.Version)
	} else {
		u.Fail("no audit record of the read after the upgrade (the Deployment's %s: %t): %s", policy, flagged, dirNames("/var/log/kubernetes/audit", true))
	}
}
