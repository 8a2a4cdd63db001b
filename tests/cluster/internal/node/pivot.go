package node

import (
	"bufio"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// The pivot from kubeadm's static apiserver to the Deployment (`smoke --pivot`), once the
// kubeadm-style control plane runs (etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler as static pods, the node registered):
//
//  1. the node is prepared as docs/operations.md says (manifests/node/tmpfiles.d, the
//     control-plane label and taint from `kubeadm init phase mark-control-plane`);
//  2. manifests/single-controller is rendered with `kubectl kustomize`, through an overlay
//     whose only content is a kustomize `images:` entry per image (the local ones);
//  3. the pivot in the order docs/operations.md gives: apply the Deployment, wait until it
//     runs, then remove kubeadm's static kube-apiserver manifest; when the Deployment does not
//     become ready beside the static apiserver, the manifest is removed anyway and the pivot
//     completes the only way left, with the outage measured;
//  4. rollouts by the real controllers under the client-go load;
//  5. a broken rollout, which must stall with the old pod serving, and `kubectl rollout undo`.
//
// Environment: ROLLOUT_RESTARTS (5), PIVOT_ONLY=1 (stop after the pivot),
// PIVOT_ORDER=scheduled (remove the static manifest once the pod is bound, not once ready),
// PIVOT_WAIT (120 s), BROKEN_ROLLOUT=0 (skip it), IMAGE_CHANGE=0 (no image change).
func RunPivot(n *Scenario) {
	if !n.CheckKnobs("pivot") || !n.PrepareNode() || !n.Render() || !n.pivot() {
		return
	}
	if EnvKnob("PIVOT_ONLY") == "1" {
		return
	}
	n.Rollouts(EnvKnobInt("ROLLOUT_RESTARTS", 0))
	if EnvKnob("BROKEN_ROLLOUT") != "0" {
		n.BrokenRollout()
	}
	n.Note("reports: %s", n.Path("step-*.json"))
}

// Env is the environment variable name, or def when it is unset or empty.
func Env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// EnvInt is Env as a number (def when it is not one).
func EnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// TmpfilesCreate creates the directories of manifests/node/tmpfiles.d with their mode and
// owner, as `systemd-tmpfiles --create` does at boot.
func (n *Scenario) TmpfilesCreate() error {
	_, err := Tmpfiles(filepath.Join(n.Repo, "manifests/node/tmpfiles.d/kube-apiserver-proxy.conf"), true)
	return err
}

// Tmpfiles gives the directories of a tmpfiles.d file ("d" lines) their mode and owner, as
// `systemd-tmpfiles --create` does, creating them first when create is set (else they must
// exist); the owner's uid is the last line's.
func Tmpfiles(conf string, create bool) (uid int, err error) {
	f, err := os.Open(conf)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 || fields[0] != "d" {
			continue
		}
		path := fields[1]
		mode, err := strconv.ParseUint(fields[2], 8, 32)
		if err != nil {
			return 0, fmt.Errorf("%s: mode %q: %w", conf, fields[2], err)
		}
		if uid, err = lookupID(fields[3], user.Lookup, func(u *user.User) string { return u.Uid }); err != nil {
			return 0, fmt.Errorf("%s: %w", conf, err)
		}
		gid, err := lookupID(fields[4], user.LookupGroup, func(g *user.Group) string { return g.Gid })
		if err != nil {
			return 0, fmt.Errorf("%s: %w", conf, err)
		}
		if create {
			if err := os.MkdirAll(path, 0o755); err != nil {
				return 0, err
			}
		}
		if err := os.Chmod(path, os.FileMode(mode)); err != nil {
			return 0, err
		}
		if err := os.Chown(path, uid, gid); err != nil {
			return 0, err
		}
	}
	return uid, sc.Err()
}

// DirModes is "PATH MODE UID:GID" of /run/kube-apiserver-proxy and what it holds.
func DirModes() string {
	dirs, _ := filepath.Glob("/run/kube-apiserver-proxy/*")
	var modes []string
	for _, d := range append([]string{"/run/kube-apiserver-proxy"}, dirs...) {
		fi, err := os.Stat(d)
		if err != nil {
			modes = append(modes, err.Error())
			continue
		}
		st, _ := fi.Sys().(*syscall.Stat_t)
		if st == nil {
			continue
		}
		modes = append(modes, fmt.Sprintf("%s %o %d:%d", d, fi.Mode().Perm(), st.Uid, st.Gid))
	}
	return strings.Join(modes, " ")
}

// lookupID is a user or group given by number or by name (as tmpfiles.d allows).
func lookupID[T any](name string, lookup func(string) (T, error), id func(T) string) (int, error) {
	if n, err := strconv.Atoi(name); err == nil {
		return n, nil
	}
	found, err := lookup(name)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(id(found))
}

// PrepareNode prepares the node as docs/operations.md says: manifests/node/tmpfiles.d, and the
// control-plane label and taint of `kubeadm init phase mark-control-plane`.
func (n *Scenario) PrepareNode() bool {
	if err := n.TmpfilesCreate(); err != nil {
		n.Fail("node not prepared from manifests/node/tmpfiles.d: %v", err)
		return false
	}
	n.Pass("node prepared from manifests/node/tmpfiles.d: %s", DirModes())
	if out, err := n.Run(120*time.Second, n.Bin("kubeadm"), "init", "phase", "mark-control-plane", "--config", n.Path("kubeadm.yaml")); err != nil {
		n.Fail("kubeadm init phase mark-control-plane failed: %v %s", err, report.Cut(out, 300))
		return false
	}
	n.Pass("kubeadm init phase mark-control-plane: node labelled node-role.kubernetes.io/control-plane and tainted")
	return true
}

// ProxyImage is the proxy's locally built image.
func (n *Scenario) ProxyImage() string { return n.ImageRepo + "/kube-apiserver-proxy:dev" }

// Render renders manifests/single-controller with `kubectl kustomize` through an overlay
// whose only content is an `images:` entry per image, into deployment.yaml of the state
// directory, and checks it against the plain rendering: only image lines may differ.
func (n *Scenario) Render() bool {
	k := n.Path("kustomize")
	if err := os.MkdirAll(filepath.Join(k, "local"), 0o755); err != nil {
		n.Fail("render: %v", err)
		return false
	}
	if out, err := n.Run(30*time.Second, "cp", "-r", filepath.Join(n.Repo, "manifests"), filepath.Join(k, "manifests")); err != nil {
		n.Fail("render: %v %s", err, out)
		return false
	}
	kustomization := Kustomization("single-controller", n.ProxyImage(), n.ImageRepo, n.Version, 0)
	if err := os.WriteFile(filepath.Join(k, "local/kustomization.yaml"), []byte(kustomization), 0o644); err != nil {
		n.Fail("render: %v", err)
		return false
	}
	local, err := n.Kubectl(60*time.Second, "kustomize", filepath.Join(k, "local"))
	if err != nil {
		n.Fail("kubectl kustomize failed: %v", err)
		return false
	}
	shipped, err := n.Kubectl(60*time.Second, "kustomize", filepath.Join(k, "manifests/single-controller"))
	if err != nil {
		n.Fail("kubectl kustomize failed: %v", err)
		return false
	}
	_ = os.WriteFile(n.Path("deployment-shipped.yaml"), []byte(shipped+"\n"), 0o644)
	if err := os.WriteFile(n.Path("deployment.yaml"), []byte(local+"\n"), 0o644); err != nil {
		n.Fail("render: %v", err)
		return false
	}
	changed, images := ImageOnlyDiff(shipped, local)
	if len(changed) > 0 {
		n.Fail("the rendering differs in more than the images: %s", report.Cut(strings.Join(changed, " | "), 600))
		return false
	}
	n.Pass("manifests/single-controller rendered with kubectl kustomize; only the image lines differ: %s", strings.Join(images, " "))
	return true
}

// ImageOnlyDiff compares two renderings line by line: the changed lines that are not image
// lines, and the new image lines (each once).
func ImageOnlyDiff(before, after string) (changed, images []string) {
	a, b := strings.Split(before, "\n"), strings.Split(after, "\n")
	if len(a) != len(b) {
		return []string{fmt.Sprintf("%d lines, then %d", len(a), len(b))}, nil
	}
	seen := map[string]bool{}
	for i := range a {
		if a[i] == b[i] {
			continue
		}
		la, lb := strings.TrimSpace(a[i]), strings.TrimSpace(b[i])
		if !strings.HasPrefix(strings.TrimPrefix(la, "- "), "image: ") || !strings.HasPrefix(strings.TrimPrefix(lb, "- "), "image: ") {
			changed = append(changed, "-"+la+" +"+lb)
			continue
		}
		if !seen[lb] {
			seen[lb] = true
			images = append(images, lb)
		}
	}
	return changed, images
}

// pivot: the documented order, then what it takes to finish.
func (n *Scenario) pivot() bool {
	n.Note("restarts before the pivot: %s", n.ControlPlaneRestarts())
	mark := n.MarkLogs()
	// The pivot without migrate removes kubeadm's apiserver before the Deployment's can serve:
	// the client-go load's failures are measured here, not asserted; refusals are.
	st := n.StartStep("pivot", n.Watched())
	if st != nil {
		st.ReportOnly = true
	}
	t0 := time.Now()
	out, err := n.Kubectl(60*time.Second, "apply", "-f", n.Path("deployment.yaml"))
	if err != nil {
		n.Fail("kubectl apply of the rendered Deployment failed: %v", err)
		st.End("the pivot (measured)")
		return false
	}
	n.Pass("kubectl apply -f (the rendered single-controller overlay): %s", out)
	// docs/operations.md: "Remove kubeadm's static kube-apiserver manifest once the Deployment
	// runs". PIVOT_ORDER=scheduled instead removes it as soon as the pod is bound to the node,
	// before its kube-apiserver container has failed into a crash-loop back-off.
	wait := time.Duration(EnvKnobInt("PIVOT_WAIT", 0)) * time.Second
	switch {
	case EnvKnob("PIVOT_ORDER") == "scheduled":
		if n.WaitFor(120*time.Second, n.PodScheduled) {
			n.Note("PIVOT_ORDER=scheduled: the pod is bound to the node %s s after kubectl apply; the static manifest goes now", Since(t0))
		} else {
			n.Fail("the Deployment's pod not bound to the node 120 s after kubectl apply: %s", n.DeployPodsLine())
		}
	case n.WaitFor(wait, n.DeployReady):
		n.Pass("documented order: the Deployment is ready beside the static apiserver after %s s", Since(t0))
	default:
		n.Fail("documented order: the Deployment is not ready %s after kubectl apply, beside kubeadm's static apiserver (binds 0.0.0.0:6443): %s", wait, n.DeployPodsLine())
		n.PodDiagnostics()
	}
	// Then the static manifest goes (either way: it is the only way to finish the pivot).
	t1 := time.Now()
	if err := Move(filepath.Join(n.Manifests, "kube-apiserver.yaml"), n.Path("kube-apiserver.static.yaml")); err != nil {
		n.Fail("remove the static manifest: %v", err)
	}
	if n.WaitFor(60*time.Second, n.StaticAPIServerGone) {
		n.Note("static kube-apiserver container gone %s s after its manifest was removed", Since(t1))
	}
	if !n.WaitFor(420*time.Second, n.DeployReady) {
		n.Fail("the Deployment is not ready 420 s after the static manifest was removed: %s", n.DeployPodsLine())
		n.PodDiagnostics()
		st.End("the pivot (measured)")
		return false
	}
	n.Pass("pivot complete: the Deployment is ready %s s after the static manifest was removed (%s s after kubectl apply): %s", Since(t1), Since(t0), n.DeployPodsLine())
	n.PodDiagnostics()
	// Let the load see a few seconds of the new apiserver before it stops.
	n.Settle(10 * time.Second)
	if rep := st.End("the pivot (the load measured, not asserted)"); rep != nil {
		refused := rep.Refused()
		n.Check(refused == 0, "%d refused connections on %s:6443 during the pivot", refused, n.NodeIP)
	}
	n.Note("restarts after the pivot: %s", n.ControlPlaneRestarts())
	n.LogVerdict("the pivot (measured, not asserted)", mark, true)
	return true
}

// Rollouts: restarts rollout restarts of the Deployment by the real controllers, then (unless
// IMAGE_CHANGE=0) the image change to the older kube-apiserver and back, under the load.
func (n *Scenario) Rollouts(restarts int) bool {
	mark := n.MarkLogs()
	o := n.Watched()
	o.Endpoints = true
	st := n.StartStep("rollouts", o)
	if st == nil {
		return false
	}
	want, done := restarts, 0
	for i := 1; i <= restarts; i++ {
		if n.Rollout(fmt.Sprintf("rollout restart %d/%d", i, restarts), "rollout", "restart", "deployment/kube-apiserver") {
			done++
		}
	}
	if EnvKnob("IMAGE_CHANGE") == "1" {
		want += 2
		for _, change := range [][2]string{
			{"image change to kube-apiserver " + n.OldVersion, n.OldVersion},
			{"image change from " + n.OldVersion + " to " + n.Version, n.Version},
		} {
			if n.Rollout(change[0], "set", "image", "deployment/kube-apiserver", "kube-apiserver="+n.ImageRepo+"/kube-apiserver:"+change[1]) {
				done++
			}
		}
	}
	st.End(fmt.Sprintf("the rollouts by the real controllers (%d of %d complete)", done, want))
	n.Check(done == want, "%d of %d rollouts completed", done, want)
	n.LogVerdict("the rollouts by the real controllers", mark, false)
	n.Note("restarts after the rollouts: %s", n.ControlPlaneRestarts())
	return done == want
}

// BreakEtcdServers starts a rollout that never becomes ready: --etcd-servers replaced by a
// closed port (appending a second --etcd-servers does not break it: the flag is a list, and
// the apiserver uses the first server that answers).
func (n *Scenario) BreakEtcdServers() error {
	d, err := n.Client.AppsV1().Deployments("kube-system").Get(n.Ctx, "kube-apiserver", metav1.GetOptions{})
	if err != nil {
		return err
	}
	idx := nodecheck.ArgIndex(d, "--etcd-servers=")
	if idx < 0 {
		return fmt.Errorf("no --etcd-servers= in the Deployment's first container")
	}
	patch := fmt.Sprintf(`[{"op": "replace", "path": "/spec/template/spec/containers/0/args/%d", "value": "--etcd-servers=https://127.0.0.1:2"}]`, idx)
	_, err = n.Kubectls(30*time.Second, "patch", "deployment/kube-apiserver", "--type=json", "-p", patch)
	return err
}

// BrokenRollout: a rollout that never becomes ready must stall with the old pod serving, then
// `kubectl rollout undo` brings back the old pod, never restarted.
func (n *Scenario) BrokenRollout() bool {
	mark := n.MarkLogs()
	o := n.Watched()
	o.Endpoints = true
	st := n.StartStep("broken", o)
	if st == nil {
		return false
	}
	before := n.ThePod()
	if err := n.BreakEtcdServers(); err != nil {
		n.Fail("broken rollout: %v", err)
	}
	status, err := n.Kubectls(150*time.Second, "rollout", "status", "deployment/kube-apiserver", "--timeout=120s")
	// It stalls for its own reason: kubectl waited out its timeout (not an error reaching the
	// apiserver), with a new pod there that is not ready.
	stalled := err != nil && strings.Contains(status, "timed out waiting")
	var unready []string
	for _, p := range n.DeployPods() {
		if p.Name != before && !n.PodReady(p.Name) {
			unready = append(unready, p.Name)
		}
	}
	n.Check(stalled && len(unready) > 0, "broken rollout stalls: kubectl rollout status --timeout=120s waited out its timeout (%s), new pod not ready: %v", report.Cut(status, 300), unready)
	// A request can fail on this busy machine: ask again for up to 15 s.
	n.Check(n.WaitFor(15*time.Second, func() bool { return n.PodReady(before) }),
		"the old pod %s still serves and is Ready during the broken rollout: %s", before, n.DeployPodsLine())
	n.PodDiagnostics()
	n.Rollout("kubectl rollout undo", "rollout", "undo", "deployment/kube-apiserver")
	pods := n.DeployPods()
	n.Check(len(pods) == 1 && pods[0].Name == before, "after the undo the old pod %s is the one left, never restarted: %s", before, n.DeployPodsLine())
	st.End("the broken rollout and its undo")
	n.LogVerdict("the broken rollout and its undo", mark, false)
	return true
}
