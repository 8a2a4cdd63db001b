package node

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// goBack: docs/runbooks/going-back.md for a controller migrated with kubeadm-sync, after the
// kubeadm upgrades: the stand-in moved out of the kubelet's directory (the agent stops),
// kubeadm's manifest rendered from kubeadm-config with --permit-port-sharing=true, then under
// the loads migrate-back into the kubelet's directory, the Deployment deleted, `kubeadm-sync
// --undo`, and the kubelet restarted on kubeadm's directory. Strict: 0 failed requests, 0
// refused connects, no restart of etcd, the controller-manager or the scheduler (their
// containers the same before and after), and kubeadm's apiserver in the container migrate-back
// started; kubeadm's files then carry the pods' UIDs and `kubeadm upgrade plan` reads them.
func (u *upgrade) goBack() {
	if err := os.MkdirAll(u.gb(""), 0o755); err != nil {
		u.Fail("going back: %v", err)
		return
	}
	// The agent's stand-in out first: it would put its copies back and roll the Deployment.
	standin := filepath.Join(kuSyncDir, "kube-apiserver.yaml")
	if err := Move(standin, u.gb("kube-apiserver-standin.yaml")); err != nil {
		u.Fail("going back: the stand-in's manifest: %v", err)
		return
	}
	stopped := u.WaitFor(90*time.Second, func() bool {
		out, err := u.Run(5*time.Second, "pgrep", "-f", "kube-apiserver-proxy kubeadm-sync")
		return err != nil && strings.TrimSpace(out) == ""
	})
	_, back := os.Stat(standin)
	if !u.Check(stopped && os.IsNotExist(back), "the kubeadm-sync agent stopped once its manifest left %s, and did not write it back", kuSyncDir) {
		return
	}
	// Reboot recovery, as the runbook's step 3 says: from kubeadm's directory and, the agent
	// stopped, its copy in the kubelet's.
	u.removeRecovery(kuManifests, kuSyncDir)
	if !u.renderKubeadms() {
		u.Fail("kubeadm init phase control-plane apiserver (dry run) failed: %s", Tail(u.gb("kubeadm.log"), 3))
		return
	}
	kubeadms, _ := os.ReadFile(filepath.Join(kuManifests, "kube-apiserver.yaml"))
	rendered, _ := os.ReadFile(u.gb("out/kube-apiserver.yaml"))
	u.Pass("kubeadm rendered kube-apiserver.yaml from kubeadm-config; beside kubeadm's own manifest it adds: %s",
		strings.Join(AddedLines(string(kubeadms), string(rendered)), " "))

	before := u.containerIDs()
	watch := u.Watched()
	watch.Restarts = []string{"kube-system/component in (etcd,kube-controller-manager,kube-scheduler)"}
	s := u.startStep("goback", &watch, false)
	deleted, ok := u.swapBack(kuSyncDir)
	if !ok {
		u.endStep(s, "going back")
		return
	}
	mirror := "kube-apiserver-" + u.NodeName
	if !u.WaitFor(120*time.Second, func() bool { return u.MirrorReady(mirror) }) {
		u.Fail("kubeadm's apiserver's mirror pod %s not Ready after migrate-back: %s", mirror, u.podLine(mirror))
	}
	apiserver := u.containerOf(mirror)
	rc := u.runLogged(60*time.Second, u.gb("undo.log"), false, nil, u.Bin("kube-apiserver-proxy"), "kubeadm-sync", "--undo")
	if !u.Check(rc == 0, "kubeadm-sync --undo: exit %d: %s", rc, report.Cut(lastLines(report.FileTail(u.gb("undo.log"), 2000), 1), 300)) {
		u.endStep(s, "going back")
		return
	}
	uids := u.kubeadmUIDs()
	restarted := time.Now()
	if u.Do("ku_kubelet_manifests", kuManifests) != nil {
		u.endStep(s, "going back")
		return
	}
	ready := u.WaitFor(180*time.Second, func() bool {
		for _, c := range []string{"etcd", "kube-controller-manager", "kube-scheduler", "kube-apiserver"} {
			if !u.MirrorReady(c + "-" + u.NodeName) {
				return false
			}
		}
		return true
	})
	// A restarted kubelet starts a static pod's readiness from the file's pod, which has no
	// status: a container with a readiness probe (etcd's) is NotReady until its probe's first
	// result (prober_manager.go, setReadyStateOnKubeletRestart). The runbook restarts the kubelet,
	// so such a flip is the kubelet's; one that does not end within the step is still a problem.
	s.both.Excuse(restarted, time.Now().Add(30*time.Second), "the kubelet restarted on kubeadm's directory, at "+restarted.Format("15:04:05.000"))
	// The kubelet's view: every static pod read from kubeadm's directory under its old UID.
	after := u.containerIDs()
	u.Check(ready && after == before && u.containerOf(mirror) == apiserver,
		"the kubelet on %s again: every static pod Ready and kept running (etcd, controller-manager, scheduler: %s -> %s; kubeadm's apiserver %s -> %s); kubeadm's files carry the UIDs %s",
		kuManifests, before, after, report.Cut(apiserver, 24), report.Cut(u.containerOf(mirror), 24), uids)
	u.Settle(10 * time.Second)
	u.endStep(s, fmt.Sprintf("going back after the upgrades (the Deployment deleted at +%d s)", deleted))
	u.Check(OnlyKubeadmListens(u.Listeners6443()), "only kubeadm's apiserver listens on port 6443: %s", u.Listeners6443())
	out, err := u.kubeadm("kubeadm-plan-after-goback.log", 3*time.Minute, u.Bin("kubeadm"), "upgrade", "plan", u.Version, "--ignore-preflight-errors="+kuIgnore)
	u.Check(err == nil, "kubeadm upgrade plan after going back reads kubeadm's layout%s: %s", errSuffix(err), report.Cut(kubeadmSaid(out), 300))
	u.Note("restarts after going back: %s; left of the install: %s", u.ControlPlaneRestarts(), strings.Join(u.leftovers(), " "))
}

// kubeadmUIDs: "file uid; " of each manifest in kubeadm's directory.
func (u *upgrade) kubeadmUIDs() string {
	var b strings.Builder
	for _, f := range []string{"etcd.yaml", "kube-apiserver.yaml", "kube-controller-manager.yaml", "kube-scheduler.yaml"} {
		text, err := os.ReadFile(filepath.Join(kuManifests, f))
		uid := "(none)"
		if err != nil {
			uid = err.Error()
		} else if m := manifestUID.FindStringSubmatch(string(text)); m != nil {
			uid = report.Cut(m[1], 12)
		}
		b.WriteString(f + " " + uid + "; ")
	}
	return b.String()
}

var manifestUID = regexp.MustCompile(`(?m)^  uid: "?([0-9a-zA-Z-]+)"?$`)
