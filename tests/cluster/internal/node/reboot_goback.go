package node

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// The way back to kubeadm's static apiserver (docs/runbooks/going-back.md), after everything
// else of the reboot scenario: from a Deployment whose proxy sockets were bound by the recovery
// instance (the proxies' uid), at another version than the copy saved at the migration.

// goBackDir is where the way back keeps kubeadm's files and the logs, in the state directory.
const goBackDir = "kubeadm-back"

func (n *Scenario) gb(name string) string { return n.Path(filepath.Join(goBackDir, name)) }

// runLogged runs a command to completion with its output in a file (appended to when add):
// its exit status (-1 when it did not run or was killed).
func (n *Scenario) runLogged(timeout time.Duration, log string, add bool, env []string, argv ...string) int {
	flags := os.O_CREATE | os.O_WRONLY | os.O_TRUNC
	if add {
		flags = os.O_CREATE | os.O_WRONLY | os.O_APPEND
	}
	f, err := os.OpenFile(log, flags, 0o644)
	if err != nil {
		return -1
	}
	defer f.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), env...)
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(f, err)
		return -1
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-done:
		case <-time.After(timeout):
			_ = cmd.Process.Kill()
		case <-n.Ctx.Done():
			_ = cmd.Process.Kill()
		}
	}()
	_ = cmd.Wait()
	close(done)
	return cmd.ProcessState.ExitCode()
}

// uploadConfig records kubeadm-config's ClusterConfiguration as kubeadm does (`kubeadm init`,
// or `kubeadm upgrade apply VERSION --skip-phases control-plane`).
func (r *reboot) uploadConfig(version string) bool {
	base, err := os.ReadFile(r.Path("kubeadm.yaml"))
	if err != nil {
		r.Fail("kubeadm init phase upload-config kubeadm: %v", err)
		return false
	}
	cfg := regexp.MustCompile(`(?m)^kubernetesVersion: .*$`).ReplaceAllString(string(base), "kubernetesVersion: "+version)
	path := r.gb("kubeadm-" + version + ".yaml")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		r.Fail("kubeadm init phase upload-config kubeadm: %v", err)
		return false
	}
	if rc := r.runLogged(120*time.Second, r.gb("upload.log"), true, nil, r.Bin("kubeadm"), "init", "phase", "upload-config", "kubeadm",
		"--config", path, "--kubeconfig", r.Admin); rc != 0 {
		r.Fail("kubeadm init phase upload-config kubeadm (%s): exit %d: %s", version, rc, Tail(r.gb("upload.log"), 3))
		return false
	}
	return true
}

// renderKubeadms: kubeadm's manifest for this node from the cluster's ClusterConfiguration
// (kubeadm-config), with the documented patch, into out/ (kubeadm's dry-run directory).
func (n *Scenario) renderKubeadms() bool {
	out := n.gb("out")
	_ = os.RemoveAll(out)
	if err := os.MkdirAll(n.gb("patches"), 0o755); err != nil {
		return false
	}
	patch := `[{"op": "add", "path": "/spec/containers/0/command/-", "value": "--permit-port-sharing=true"}]` + "\n"
	if os.WriteFile(n.gb("patches/kube-apiserver+json.json"), []byte(patch), 0o644) != nil {
		return false
	}
	cm, err := n.Client.CoreV1().ConfigMaps("kube-system").Get(n.Ctx, "kubeadm-config", metav1.GetOptions{})
	if err != nil {
		appendFile(n.gb("kubeadm.log"), err.Error()+"\n")
		return false
	}
	cfg := fmt.Sprintf(`apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
dryRun: true
localAPIEndpoint: {advertiseAddress: %s, bindPort: 6443}
nodeRegistration: {name: %s}
patches: {directory: %s}
---
%s`, n.NodeIP, n.NodeName, n.gb("patches"), cm.Data["ClusterConfiguration"])
	if os.WriteFile(n.gb("kubeadm.yaml"), []byte(cfg), 0o644) != nil {
		return false
	}
	rc := n.runLogged(120*time.Second, n.gb("kubeadm.log"), false, []string{"KUBEADM_INIT_DRYRUN_DIR=" + out},
		n.Bin("kubeadm"), "init", "phase", "control-plane", "apiserver", "--config", n.gb("kubeadm.yaml"))
	fi, err := os.Stat(filepath.Join(out, "kube-apiserver.yaml"))
	return rc == 0 && err == nil && fi.Size() > 0
}

// migrateBack is migrate-back's command line with kubeadm's rendered manifest, into staticDir
// (the kubelet's static pod directory).
func (n *Scenario) migrateBack(staticDir string) []string {
	return []string{n.Bin("kube-apiserver-proxy"), "migrate-back", "--manifest", n.gb("out/kube-apiserver.yaml"),
		"--static-pod-dir", staticDir, "--handoff-dir", HandoffDir, "--timeout", "600s"}
}

var kubeadmWildcard = regexp.MustCompile(`^(\*|0\.0\.0\.0|\[::\]):6443 .*kube-apiserver`)

// OnlyKubeadmListens: the one listener on port 6443 (Listeners6443) is kube-apiserver's
// wildcard socket.
func OnlyKubeadmListens(listeners string) bool {
	var l []string
	for _, s := range strings.Split(listeners, "; ") {
		if strings.TrimSpace(s) != "" {
			l = append(l, s)
		}
	}
	return len(l) == 1 && kubeadmWildcard.MatchString(l[0])
}

var migrateBackStep = regexp.MustCompile(`migrate-back: [^=]*`)

// MigrateBackSteps: what migrate-back said it did (the first 8 of its messages, each up to its
// first field), counted: "N MESSAGE;" sorted by message.
func MigrateBackSteps(log string) string {
	var msgs []string
	for _, l := range strings.Split(log, "\n") {
		msgs = append(msgs, migrateBackStep.FindAllString(l, -1)...)
	}
	msgs = report.First(msgs, 8)
	count := map[string]int{}
	for _, m := range msgs {
		count[m]++
	}
	keys := make([]string, 0, len(count))
	for k := range count {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%d %s;", count[k], strings.Join(strings.Fields(k), " "))
	}
	return b.String()
}

// AddedLines are the lines of after that are not in before (the "> " side of a diff, by
// line content), trimmed.
func AddedLines(before, after string) []string {
	have := map[string]int{}
	for _, l := range strings.Split(before, "\n") {
		have[l]++
	}
	var added []string
	for _, l := range strings.Split(after, "\n") {
		if have[l] > 0 {
			have[l]--
			continue
		}
		if t := strings.TrimSpace(l); t != "" {
			added = append(added, t)
		}
	}
	return added
}

// leftovers are the objects of the install still there (a failed lookup other than "not
// found" counts, with its error).
func (n *Scenario) leftovers() []string {
	var left []string
	check := func(name string, err error) {
		switch {
		case err == nil:
			left = append(left, name)
		case !apierrors.IsNotFound(err):
			left = append(left, name+" ("+err.Error()+")")
		}
	}
	vap := n.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies()
	for _, name := range []string{"kube-apiserver-proxy-workload", "kube-apiserver-proxy-pods", "kube-apiserver-proxy-kubernetes-endpoints"} {
		_, err := vap.Get(n.Ctx, name, metav1.GetOptions{})
		check("validatingadmissionpolicy/"+name, err)
	}
	_, err := n.Client.RbacV1().Roles("kube-system").Get(n.Ctx, "kube-apiserver-proxy:recover", metav1.GetOptions{})
	check("role/kube-apiserver-proxy:recover", err)
	_, err = n.Client.RbacV1().RoleBindings("kube-system").Get(n.Ctx, "kube-apiserver-proxy:recover", metav1.GetOptions{})
	check("rolebinding/kube-apiserver-proxy:recover", err)
	_, err = n.Client.AppsV1().Deployments("kube-system").Get(n.Ctx, "kube-apiserver", metav1.GetOptions{})
	check("deployment/kube-apiserver", err)
	_, err = n.Client.PolicyV1().PodDisruptionBudgets("kube-system").Get(n.Ctx, "kube-apiserver", metav1.GetOptions{})
	check("poddisruptionbudget/kube-apiserver", err)
	_, err = n.Client.DiscoveryV1().EndpointSlices("default").Get(n.Ctx, "kubernetes-kube-apiserver-proxy", metav1.GetOptions{})
	check("endpointslice/kubernetes-kube-apiserver-proxy", err)
	for _, p := range []string{filepath.Join(n.Manifests, "kube-apiserver-recovery.yaml"), CheckpointDir} {
		if _, err := os.Stat(p); err == nil {
			left = append(left, p)
		}
	}
	return left
}

// serviceSlices are the kubernetes Service's EndpointSlices, by name.
func (n *Scenario) serviceSlices() string {
	list, err := n.Client.DiscoveryV1().EndpointSlices("default").List(n.Ctx, metav1.ListOptions{LabelSelector: "kubernetes.io/service-name=kubernetes"})
	if err != nil {
		return err.Error()
	}
	var names []string
	for _, s := range list.Items {
		names = append(names, "endpointslice.discovery.k8s.io/"+s.Name)
	}
	return strings.Join(names, " ")
}

// goBack: the Deployment's apiserver moved to another version, kubeadm's record of it, the
// manifest kubeadm renders from it; reboot recovery removed; then `migrate-back` under the two
// loads, the Deployment deleted, and only kubeadm's static apiserver left.
func (r *reboot) goBack() {
	if err := os.MkdirAll(r.gb(""), 0o755); err != nil {
		r.Fail("going back: %v", err)
		return
	}
	if !r.goBackPrepare() {
		return
	}
	r.removeRecovery(r.Manifests)
	mark := r.MarkLogs()
	if !r.migrateBackUnderLoad() {
		return
	}
	r.checkWentBack()
	r.Note("restarts after going back: %s", r.ControlPlaneRestarts())
	r.LogVerdict("going back", mark, false)
}

// goBackPrepare: an upgrade after the migration (the Deployment's image moved to the old
// version), migrate-back refusing kubeadm's manifest while kubeadm's record is of another
// version, then kubeadm's record updated and its manifest rendered for the version serving.
func (r *reboot) goBackPrepare() bool {
	saved := r.Path("kube-apiserver.static.yaml")
	// kubeadm-config as `kubeadm init` left it (these phases never uploaded it).
	if !r.uploadConfig(r.Version) {
		return false
	}
	// An upgrade after the migration, as documented: the image, then kubeadm's record.
	oldImage := r.ImageRepo + "/kube-apiserver:" + r.OldVersion
	if !r.Rollout(fmt.Sprintf("the Deployment's apiserver moved to %s (a version other than the copy saved at the migration, %s)", r.OldVersion, r.Version),
		"set", "image", "deployment/kube-apiserver", "kube-apiserver="+oldImage) {
		return false
	}
	// kubeadm's record not updated yet: migrate-back refuses the manifest kubeadm renders from it.
	if !r.renderKubeadms() {
		r.Fail("kubeadm init phase control-plane apiserver (dry run) failed: %s", Tail(r.gb("kubeadm.log"), 3))
		return false
	}
	rc := r.runLogged(660*time.Second, r.gb("refused.log"), false, nil, r.migrateBack(r.Manifests)...)
	refused, _ := os.ReadFile(r.gb("refused.log"))
	_, staticErr := os.Stat(filepath.Join(r.Manifests, "kube-apiserver.yaml"))
	want := regexp.MustCompile("the manifest runs .*:" + regexp.QuoteMeta(r.Version) + " but the apiserver serving now is " + regexp.QuoteMeta(r.OldVersion))
	if rc == 2 && want.Match(refused) && os.IsNotExist(staticErr) {
		r.Pass("migrate-back refuses kubeadm's manifest of another version than the one serving (exit 2, nothing touched): %s", report.Cut(lastLines(string(refused), 1), 220))
	} else {
		r.Fail("migrate-back with a manifest of %s while %s serves: exit %d: %s; kube-apiserver.yaml in the static pod directory: %s",
			r.Version, r.OldVersion, rc, lastLines(string(refused), 2), yesNo(staticErr == nil))
	}
	if !r.uploadConfig(r.OldVersion) {
		return false
	}
	rendered := r.renderKubeadms()
	manifest, _ := os.ReadFile(r.gb("out/kube-apiserver.yaml"))
	if !rendered || !regexp.MustCompile(`(?m)image: `+regexp.QuoteMeta(oldImage)+`$`).Match(manifest) {
		r.Fail("kubeadm's manifest is not of %s: %s %s", r.OldVersion, grepLines(string(manifest), "image:"), Tail(r.gb("kubeadm.log"), 2))
		return false
	}
	before, _ := os.ReadFile(saved)
	r.Pass("kubeadm rendered kube-apiserver.yaml for %s from kubeadm-config; it differs from the copy saved at the migration in: %s",
		r.OldVersion, strings.Join(AddedLines(string(before), string(manifest)), " "))
	return true
}

// removeRecovery: reboot recovery goes first (the agent's static pod, its checkpoint and
// manifests/recovery): its manifest moved out of dir, and removed from each of copies (the
// kubelet's directory on a node kubeadm-sync followed: its copy there).
func (n *Scenario) removeRecovery(dir string, copies ...string) {
	agent := "kube-apiserver-recovery-" + n.NodeName
	if err := Move(filepath.Join(dir, "kube-apiserver-recovery.yaml"), n.gb("kube-apiserver-recovery.yaml")); err != nil {
		n.Fail("the recovery agent's manifest: %v", err)
	}
	for _, c := range copies {
		if err := os.Remove(filepath.Join(c, "kube-apiserver-recovery.yaml")); err != nil {
			n.Fail("the recovery agent's manifest: %v", err)
		}
	}
	if n.WaitFor(60*time.Second, func() bool { known, ok := n.kubeletKnows(agent); return ok && !known }) {
		_ = os.RemoveAll(CheckpointDir)
		out, _ := n.Kubectl(60*time.Second, "delete", "-k", filepath.Join(n.Repo, "manifests/recovery"))
		n.Pass("reboot recovery removed: the agent's static pod, %s, manifests/recovery (%s)", CheckpointDir, strings.ReplaceAll(out, "\n", " "))
	} else {
		n.Fail("the recovery agent still runs 60 s after its manifest was moved away")
	}
}

// migrateBackUnderLoad: migrate-back under the load on both addresses: kubeadm's apiserver
// binds beside the proxy, the Deployment is deleted, migrate-back takes the proxy's sockets
// and closes them; then the rest of the install goes. False: migrate-back did not start.
func (r *reboot) migrateBackUnderLoad() bool {
	r.Note("listeners on port 6443 before going back: %s", r.Listeners6443())
	steps := r.StartBoth("goback", nil, false)
	deleted, ok := r.swapBack(r.Manifests)
	if !ok {
		steps.End("going back")
		return false
	}
	r.Settle(15 * time.Second)
	steps.End(fmt.Sprintf("going back, the Deployment deleted at +%d s", deleted))
	return true
}

// swapBack: migrate-back into staticDir (kubeadm's apiserver binds beside the proxy), the
// Deployment deleted, migrate-back takes the proxy's sockets and closes them; then what
// kubernetes-endpoints added and the node's directories go. It returns when the Deployment was
// deleted (seconds after migrate-back started); false: migrate-back did not start.
func (n *Scenario) swapBack(staticDir string) (deleted int, started bool) {
	t0 := time.Now()
	mb, err := n.Background(filepath.Join(goBackDir, "migrate-back.log"), n.migrateBack(staticDir)...)
	if err != nil {
		n.Fail("migrate-back: %v", err)
		return 0, false
	}
	if n.WaitFor(300*time.Second, func() bool { return strings.Contains(report.FileTail(mb.Log, 1000), "delete the Deployment now") }) {
		n.Pass("migrate-back: kubeadm's apiserver binds 0.0.0.0:6443 beside the proxy and is ready %s s after migrate-back started: %s",
			Since(t0), report.Cut(MigrateBackSteps(report.FileTail(mb.Log, 1000)), 600))
	} else {
		// The Deployment stays: the runbook deletes it only once migrate-back says so.
		n.Fail("migrate-back: kubeadm's apiserver not ready within 300 s: %s; listeners: %s", Tail(mb.Log, 3), n.Listeners6443())
		mb.Signal(syscall.SIGTERM)
		return 0, false
	}
	n.Note("listeners on port 6443 with both: %s", n.Listeners6443())
	t1 := time.Now()
	out1, _ := n.Kubectls(60*time.Second, "delete", "deployment", "kube-apiserver", "--wait=false")
	out2, _ := n.Kubectls(60*time.Second, "delete", "pdb", "kube-apiserver")
	_ = os.WriteFile(n.gb("delete.log"), []byte(out1+"\n"+out2+"\n"), 0o644)
	if n.WaitFor(420*time.Second, mb.Exited) {
		if rc := mb.ExitCode(); rc == 0 {
			n.Pass("migrate-back done %s s after the Deployment's deletion (exit 0): %s", Since(t1),
				strings.Join(report.Grep(report.FileTail(mb.Log, 1000), 250, report.ContainsAny("closed with nothing reset", "done:")), " "))
		} else {
			n.Fail("migrate-back exited %d: %s", rc, Tail(mb.Log, 3))
		}
	} else {
		n.Fail("migrate-back still waiting 420 s after the Deployment's deletion: %s; listeners: %s", Tail(mb.Log, 3), n.Listeners6443())
		mb.Signal(syscall.SIGTERM)
	}
	n.Check(n.WaitFor(60*time.Second, func() bool { return OnlyKubeadmListens(n.Listeners6443()) }),
		"only kubeadm's apiserver listens on port 6443: %s", n.Listeners6443())
	// What kubernetes-endpoints added (kubeadm's lease reconciler writes the rest itself), then
	// the node's directories.
	out3, _ := n.Kubectl(60*time.Second, "-n", "default", "delete", "endpointslice", "kubernetes-kube-apiserver-proxy")
	out4, _ := n.Kubectl(60*time.Second, "delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", "kube-apiserver-proxy-kubernetes-endpoints")
	_ = os.WriteFile(n.gb("delete-rest.log"), []byte(out3+"\n"+out4+"\n"), 0o644)
	_ = os.RemoveAll("/run/kube-apiserver-proxy")
	_ = os.RemoveAll("/var/lib/kube-apiserver-proxy")
	return int(t1.Sub(t0).Seconds()), true
}

// checkWentBack: kubeadm's static apiserver serves the old version, its mirror pod is Ready
// and nothing of the install is left.
func (r *reboot) checkWentBack() {
	version := ""
	body, err := r.get("/version", 5*time.Second, nil)
	if err == nil {
		var v struct {
			GitVersion string `json:"gitVersion"`
		}
		if err = json.Unmarshal(body, &v); err == nil {
			version = v.GitVersion
		}
	}
	if err != nil {
		version = err.Error()
	}
	mirror := "kube-apiserver-" + r.NodeName
	if version == r.OldVersion && r.WaitFor(120*time.Second, func() bool { return r.MirrorReady(mirror) }) {
		r.Pass("kubeadm's static apiserver serves %s (not the saved copy's %s); its mirror pod %s is Ready", version, r.Version, mirror)
	} else {
		r.Fail("after going back: /version says %s; mirror pod %s Ready: %s", version, mirror, yesNo(r.MirrorReady(mirror)))
	}
	if left := r.leftovers(); len(left) == 0 {
		r.Pass("nothing of the install is left (admission policies, Role, RoleBinding, Deployment, PodDisruptionBudget, the second EndpointSlice, the agent, the checkpoint); the Service's slices: %s", r.serviceSlices())
	} else {
		r.Fail("left after going back: %s", strings.Join(left, " "))
	}
}
