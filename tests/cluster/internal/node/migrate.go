package node

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"kube-apiserver-proxy/tests/cluster/internal/report"
	"kube-apiserver-proxy/tests/cluster/internal/step"
)

// The migration from kubeadm's static kube-apiserver to the Deployment (`smoke --migrate`),
// once the kubeadm-style control plane runs. It follows docs/runbooks/migrate-from-kubeadm.md:
//
//  1. the node is prepared (manifests/node/tmpfiles.d, the control-plane label and taint), and
//     `kube-apiserver-proxy kubernetes-endpoints` applied (the overlay's apiserver runs with
//     --endpoint-reconciler-type=none);
//  2. `kube-apiserver-proxy migrate --listen NODE_IP:6443 --listen 127.0.0.1:6443` starts, as
//     root: SO_REUSEPORT on kubeadm's 0.0.0.0:6443 socket, the two addresses bound beside it
//     (not listening), then it waits on the handoff directory as uid 59443;
//  3. `kubectl apply` of manifests/single-controller: `launch` starts the apiserver on another
//     port of its 127.a.b.c (6443 is held by the wildcard socket), the proxy asks its peers for
//     sockets and `migrate` hands it both addresses;
//  4. once the Deployment is ready, kubeadm's static manifest is removed;
//  5. MIGRATE_RESTARTS (2) rollouts of the Deployment (the first one brings the apiserver back
//     to 6443), then pivot's rollouts: MIGRATE_MORE_RESTARTS more restarts (5 in all by
//     default) and the image change (IMAGE_CHANGE=0 leaves it out).
//
// Throughout, a step (package step) judges each part: a prober connects to NODE_IP:6443 and
// 127.0.0.1:6443 in turn (each every 20 ms), and every refused, timed-out or failed connect is
// a failure; two client-go loads run, one per address (the one on 127.0.0.1 with
// `tls-server-name: kubernetes`: the serving certificate has no 127.0.0.1), each held to the
// tier's strict criteria; a watcher follows the `kubernetes` Endpoints and the Service's
// EndpointSlices: neither may ever be without a ready address (the overlay's none reconciler,
// and `kubernetes-endpoints` applied before step 2, whose admission policy keeps kubeadm's
// stopping lease apiserver from emptying them); the controller-manager and the scheduler must
// not restart.
func RunMigrate(n *Scenario) {
	if !n.CheckKnobs("migrate") || !n.PrepareNode() || !n.Render() || !n.LocalKubeconfig() {
		return
	}
	if !n.Migrate(Migration{}) {
		return
	}
	restarts := EnvKnobInt("MIGRATE_RESTARTS", 0)
	n.MigrateRollouts(restarts)
	// Then the rollouts of pivot by the real controllers: more rollout restarts (5 in all with
	// the ones above) and the image change v1.36 -> v1.37 and back.
	n.Rollouts(EnvKnobInt("MIGRATE_MORE_RESTARTS", max(0, 5-restarts)))
	n.Note("reports: %s, %s", n.Path("step-*.json"), n.Path("migrate.log"))
}

// HandoffDir is the proxies' handoff directory (manifests/node/tmpfiles.d).
const HandoffDir = "/run/kube-apiserver-proxy/handoff"

// LocalAdmin is the super-admin kubeconfig on https://127.0.0.1:6443 (see LocalKubeconfig).
func (n *Scenario) LocalAdmin() string { return n.Path("local-super-admin.conf") }

// LocalKubeconfig writes the super-admin kubeconfig pointed at 127.0.0.1:6443 (as kubeadm's
// kubeconfigs may be), with the server name the serving certificate has, and checks that it
// reaches the apiserver.
func (n *Scenario) LocalKubeconfig() bool {
	cfg, err := clientcmd.LoadFromFile(n.Admin)
	if err == nil {
		for _, c := range cfg.Clusters {
			c.Server = "https://127.0.0.1:6443"
			c.TLSServerName = "kubernetes"
		}
		err = clientcmd.WriteToFile(*cfg, n.LocalAdmin())
	}
	if err == nil {
		err = n.readyz(n.LocalAdmin())
	}
	return n.Check(err == nil, "a kubeconfig on https://127.0.0.1:6443 (tls-server-name: kubernetes) reaches kubeadm's apiserver%s", errSuffix(err))
}

func errSuffix(err error) string {
	if err == nil {
		return ""
	}
	return ": " + err.Error()
}

// readyz asks /readyz through a kubeconfig.
func (n *Scenario) readyz(kubeconfig string) error {
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	rc.Timeout = 10 * time.Second
	c, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	_, err = c.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(n.Ctx)
	return err
}

// Listeners6443 are the TCP listeners on port 6443 (address and processes), as ss shows them.
func (n *Scenario) Listeners6443() string {
	out, err := exec.Command("ss", "-Hltnp", "sport = :6443").Output()
	if err != nil {
		return "ss: " + err.Error()
	}
	return Listeners(string(out))
}

// Listeners is ss -Hltnp's output as "ADDRESS PROCESS/PID…" per listener, joined with "; ".
func Listeners(ss string) string {
	var l []string
	for _, line := range strings.Split(strings.TrimSpace(ss), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		entry := f[3]
		seen := map[string]bool{}
		for _, m := range ssProcess.FindAllStringSubmatch(line, -1) {
			if p := m[1] + "/" + m[2]; !seen[p] {
				seen[p] = true
				entry += " " + p
			}
		}
		l = append(l, entry)
	}
	return strings.Join(l, "; ")
}

var ssProcess = regexp.MustCompile(`\("([^"]*)",pid=([0-9]+)`)

// WildcardGone: nothing listens on *:6443, 0.0.0.0:6443 or [::]:6443.
func (n *Scenario) WildcardGone() bool {
	listeners := n.Listeners6443()
	if strings.HasPrefix(listeners, "ss: ") {
		return false
	}
	for _, l := range strings.Split(listeners, "; ") {
		for _, w := range []string{"*:6443 ", "0.0.0.0:6443 ", "[::]:6443 "} {
			if strings.HasPrefix(l+" ", w) {
				return false
			}
		}
	}
	return true
}

// LaunchLines is what `launch` said in each Deployment pod's apiserver container.
func (n *Scenario) LaunchLines() string {
	var b strings.Builder
	for _, p := range n.DeployPods() {
		log, _ := n.Logs(p.Name, "kube-apiserver", 0, false)
		var lines []string
		for _, l := range strings.Split(log, "\n") {
			if strings.HasPrefix(l, "launch:") {
				lines = append(lines, l)
			}
		}
		fmt.Fprintf(&b, "%s: %s; ", p.Name, strings.Join(lines, " "))
	}
	return b.String()
}

// EndpointsApply applies default/kubernetes as docs/operations.md says for the single
// controller (--endpoint-reconciler-type=none): `kubernetes-endpoints | kubectl apply -f -`.
func (n *Scenario) EndpointsApply() (string, error) {
	out, err := n.Run(60*time.Second, "sh", "-c", fmt.Sprintf("%q kubernetes-endpoints --address %q | %q --kubeconfig %q --request-timeout=10s apply -f -",
		n.Bin("kube-apiserver-proxy"), n.NodeIP, n.Bin("kubectl"), n.Admin))
	return out, err
}

// Migration is how a scenario runs the migration.
type Migration struct {
	// StaticStep makes kubeadm's static apiserver go (default: its manifest moved away; the
	// runbook's other form in the kubeadm upgrade scenario).
	StaticStep func() error
	// Watch replaces Watched for the step on NODE_IP:6443 (its probes, endpoints and
	// kubeconfig are added).
	Watch *step.Options
	// ReportOnly: the two steps report their problems rather than fail on them.
	ReportOnly bool
}

// Migrate runs the migration (steps 1 to 4 of RunMigrate) under two steps, "migrate" (the
// load on NODE_IP:6443, both addresses probed, default/kubernetes) and "migrate-local" (the
// load on 127.0.0.1:6443); false when it could not go on.
func (n *Scenario) Migrate(m Migration) bool {
	n.Note("restarts before the migration: %s", n.ControlPlaneRestarts())
	n.Note("listeners on port 6443 before: %s", n.Listeners6443())
	mark := n.MarkLogs()
	steps := n.StartBoth("migrate", m.Watch, m.ReportOnly)
	end := steps.End
	t0 := time.Now()

	// The kubernetes Service's endpoints for the overlay's none reconciler (docs/operations.md).
	out, err := n.EndpointsApply()
	n.Check(err == nil, "kubernetes-endpoints --address %s | kubectl apply -f -: %s%s", n.NodeIP, lastLines(out, 3), errSuffix(err))

	n.migrateRefuses()

	// Step 1: as root on the node (docs/runbooks/migrate-from-kubeadm.md).
	mig, err := n.Background("migrate.log", n.Bin("kube-apiserver-proxy"), "migrate", "--listen", n.NodeIP+":6443",
		"--listen", "127.0.0.1:6443", "--handoff-dir", HandoffDir, "--timeout", "600s")
	if err != nil || !n.WaitFor(30*time.Second, func() bool { return strings.Contains(report.FileTail(mig.Log, 100), "waiting for a proxy") }) {
		n.Fail("kube-apiserver-proxy migrate did not get ready: %v %s", err, Tail(n.Path("migrate.log"), 5))
		end("the migration")
		return false
	}
	n.Pass("kube-apiserver-proxy migrate waits for the proxy after %s s: %s", Since(t0), report.Cut(stripLogHeads(report.FileTail(mig.Log, 3)), 500))
	n.Note("listeners on port 6443 with migrate waiting: %s", n.Listeners6443())
	n.Note("addresses in use that migrate found: %s", report.Cut(grepLines(report.FileTail(mig.Log, 200), "address in use", "could not look everywhere"), 600))

	// Step 2: the Deployment.
	t1 := time.Now()
	if out, err := n.Kubectl(60*time.Second, "apply", "-f", n.Path("deployment.yaml")); err != nil {
		n.Fail("kubectl apply of the rendered Deployment failed: %v %s", err, out)
		mig.Signal(os.Interrupt)
		end("the migration")
		return false
	}
	if n.WaitFor(420*time.Second, mig.Exited) {
		rc := mig.ExitCode()
		said := grepLines(report.FileTail(mig.Log, 200), "handed to the proxy")
		if rc != 0 {
			said = lastLines(report.FileTail(mig.Log, 3), 3)
		}
		n.Check(rc == 0, "migrate handed the sockets over %s s after kubectl apply (exit %d): %s", Since(t1), rc, report.Cut(said, 300))
	} else {
		n.Fail("migrate still waiting 420 s after kubectl apply: %s; pods: %s", Tail(mig.Log, 3), n.DeployPodsLine())
		n.PodDiagnostics()
	}
	if n.WaitFor(300*time.Second, n.DeployReady) {
		n.Pass("the Deployment is ready beside kubeadm's static apiserver %s s after kubectl apply: %s", Since(t1), n.DeployPodsLine())
	} else {
		n.Fail("the Deployment is not ready 300 s after kubectl apply: %s", n.DeployPodsLine())
		n.PodDiagnostics()
	}
	n.Note("launch: %s", n.LaunchLines())
	n.Note("listeners on port 6443 with both apiservers: %s", n.Listeners6443())

	// Step 3: kubeadm's static apiserver goes. Its lease reconciler tries to empty the
	// Endpoints at its SIGTERM: the admission policy of `kubernetes-endpoints` denies it. What
	// counts is that the apiserver closed its wildcard socket (it does at once, with kubeadm's
	// flags; the process may drain on).
	t2 := time.Now()
	static := m.StaticStep
	if static == nil {
		static = func() error {
			return Move(filepath.Join(n.Manifests, "kube-apiserver.yaml"), n.Path("kube-apiserver.static.yaml"))
		}
	}
	if err := static(); err != nil {
		n.Fail("kubeadm's static apiserver: %v", err)
	}
	n.Check(n.WaitFor(90*time.Second, n.WildcardGone), "kubeadm's wildcard socket closed %s s after its manifest was removed (%s s after migrate started): listeners %s",
		Since(t2), Since(t0), n.Listeners6443())
	// Let the loads see some seconds of the Deployment alone.
	n.Settle(15 * time.Second)
	end(fmt.Sprintf("the migration (the static manifest went at +%d s)", int(t2.Sub(t0).Seconds())))
	n.Note("restarts after the migration: %s", n.ControlPlaneRestarts())
	n.LogVerdict("the migration", mark, m.ReportOnly)
	return true
}

// migrateRefuses: an address in use that the proxy would not take (127.0.0.1, which the local
// load uses): migrate refuses before it touches anything.
func (n *Scenario) migrateRefuses() {
	out, err := exec.CommandContext(n.Ctx, n.Bin("kube-apiserver-proxy"), "migrate", "--listen", n.NodeIP+":6443",
		"--handoff-dir", HandoffDir, "--timeout", "10s").CombinedOutput()
	rc := 0
	if ee, ok := err.(*exec.ExitError); ok {
		rc = ee.ExitCode()
	} else if err != nil {
		rc = -1
	}
	last := lastLines(string(out), 1)
	ok := rc == 2 && regexp.MustCompile(`127\.0\.0\.1:6443 \([0-9]* established connection`).MatchString(last) &&
		!strings.Contains(last, n.NodeIP+":6443 (")
	n.Check(ok, "migrate without 127.0.0.1 refuses (exit 2, nothing touched): exit %d: %s", rc, report.Cut(last, 300))
}

// MigrateRollouts: rollout restarts after the migration under the two loads; the first one
// brings the apiserver back to port 6443 of its 127.a.b.c.
func (n *Scenario) MigrateRollouts(restarts int) bool {
	mark := n.MarkLogs()
	steps := n.StartBoth("migrate-rollouts", nil, false)
	if !steps.Started() {
		steps.End("the rollouts after the migration")
		return false
	}
	done := 0
	for i := 1; i <= restarts; i++ {
		if n.Rollout(fmt.Sprintf("rollout restart %d/%d after the migration", i, restarts), "rollout", "restart", "deployment/kube-apiserver") {
			done++
		}
		n.Note("launch: %s", n.LaunchLines())
	}
	steps.End("the rollouts after the migration")
	n.Check(done == restarts, "%d of %d rollouts after the migration completed", done, restarts)
	launch := n.LaunchLines()
	n.Check(regexp.MustCompile(`:6443 *;`).MatchString(launch), "the apiserver is back on port 6443 of its 127.a.b.c: %s", launch)
	n.Note("listeners on port 6443 after the rollouts: %s", n.Listeners6443())
	n.Note("restarts after the rollouts: %s", n.ControlPlaneRestarts())
	n.LogVerdict("the rollouts", mark, false)
	return done == restarts
}

// grepLines are the lines of s that contain any of the words, joined with "; ".
func grepLines(s string, words ...string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		for _, w := range words {
			if i := strings.Index(l, w); i >= 0 {
				out = append(out, l[i:])
				break
			}
		}
	}
	return strings.Join(out, "; ")
}

// stripLogHeads drops the proxy's log line heads (time, level, target), joining the lines.
func stripLogHeads(s string) string {
	var out []string
	for _, l := range strings.Split(strings.TrimSpace(s), "\n") {
		out = append(out, logHead.ReplaceAllString(l, ""))
	}
	return strings.Join(out, " ")
}

var logHead = regexp.MustCompile(`^\S*\s*INFO \S* `)
