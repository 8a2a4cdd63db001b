package node

import (
	"os"
	"path/filepath"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/report"
	"kube-apiserver-proxy/tests/cluster/internal/step"
)

// rebootStep: docs/runbooks/reboot-recovery.md on a controller kubeadm-sync follows, after the
// upgrades. Once the checkpoint is of the pod that serves, a power cycle (the node action
// reboot: every process killed, /run and the runtime's state emptied, the pods' cgroups gone),
// the tmpfiles.d directories made again, then containerd and the kubelet (v1.37.2, on the
// agent's directory) started and nothing else. The recovery agent, a copy in the kubelet's
// directory, activates the checkpoint into kubeadm's directory (its --static-pod-dir as
// shipped); kubeadm-sync, itself a static pod again, copies it into the kubelet's; the control
// plane must serve within REBOOT_BOUND of the runtime's start, and from then on the
// Deployment's pod takes over with no refused connect and no failed request: the checkpoint
// retired from both directories, the recovery instance gone, the listening sockets handed
// over. kube-proxy must be back (the next step's load in a pod needs its rules).
func (u *upgrade) rebootStep() {
	manifest, err := os.ReadFile(filepath.Join(u.Repo, agentManifest))
	after := CheckpointAfter(string(manifest))
	if err != nil || after == 0 {
		u.Fail("no --checkpoint-after=Ns in %s%s", agentManifest, errSuffix(err))
		return
	}
	r := &reboot{Scenario: u.Scenario, after: after,
		checkpointWait: time.Duration(EnvKnobInt("CHECKPOINT_WAIT", int(after.Seconds())+120)) * time.Second,
		bound:          time.Duration(EnvKnobInt("REBOOT_BOUND", 180)) * time.Second}
	good := u.ThePod()
	if !r.waitCheckpoint(good, "before the reboot") || !r.reboot() {
		return
	}
	tBoot := time.Now()
	if u.Do("containerd_start") != nil || u.Do("kubelet_start") != nil {
		return
	}
	active := filepath.Join(kuManifests, activeManifestName)
	copied := filepath.Join(kuSyncDir, activeManifestName)
	exists := func(p string) func() bool {
		return func() bool { _, err := os.Stat(p); return err == nil }
	}
	if !u.WaitFor(120*time.Second, exists(active)) {
		u.Fail("no checkpoint activated in %s 120 s after the runtime's start: %s; agent log: %s",
			kuManifests, dirNames(kuManifests, true), report.Cut(Tail(u.recoveryLog(), 3), 900))
		return
	}
	u.Note("the recovery agent activated the checkpoint into kubeadm's directory %s s after the runtime's start: %s", Since(tBoot), checkpointOf(active))
	if u.WaitFor(60*time.Second, exists(copied)) {
		u.Pass("kubeadm-sync copied the activated checkpoint into the kubelet's directory %s s after the runtime's start", Since(tBoot))
	} else {
		u.Fail("kubeadm-sync did not copy the activated checkpoint into %s within 60 s: %s", kuSyncDir, dirNames(kuSyncDir, true))
		return
	}
	if !u.WaitFor(r.bound, r.readyz) {
		u.Fail("the control plane does not serve %d s after the runtime's start", int(r.bound.Seconds()))
		return
	}
	u.Pass("the control plane serves again (GET /readyz on %s:6443) %s s after the runtime's start, within the bound of %d s, with no manual step",
		u.NodeIP, Since(tBoot), int(r.bound.Seconds()))

	// Both loads (the node address, 127.0.0.1); the controllers are not watched: the power
	// cycle restarted them.
	st := u.StartBoth("reboot", &step.Options{Kubeconfig: u.Admin, Probes: []string{u.NodeIP + ":6443"}}, false)
	recovery := "kube-apiserver-checkpoint-" + u.NodeName
	servedBy := checkpointOf(copied)
	if u.kubeletRuns(recovery) && servedBy == "kube-system/"+good {
		u.Pass("the recovery instance is the checkpoint of %s, the pod that served before the reboot", good)
	} else {
		u.Fail("the recovery instance: kubelet runs it: %s; of '%s' (want kube-system/%s)", yesNo(u.kubeletRuns(recovery)), servedBy, good)
	}
	tTake := time.Now()
	if u.WaitFor(600*time.Second, func() bool { return u.PodReady(good) }) &&
		u.WaitFor(300*time.Second, func() bool { return !exists(active)() && !exists(copied)() }) &&
		u.WaitFor(180*time.Second, r.recoveryPodGone) {
		u.Pass("takeover: the Deployment's pod %s is ready, the checkpoint retired from both directories and the recovery instance gone %s s after the control plane served (%s s after the runtime's start)",
			good, Since(tTake), Since(tBoot))
	} else {
		known, _ := u.kubeletKnows(recovery)
		u.Fail("takeover not complete: pods %s; activated checkpoint in kubeadm's directory: %s, in the kubelet's: %s; kubelet knows the recovery pod: %s",
			u.DeployPodsLine(), yesNo(exists(active)()), yesNo(exists(copied)()), yesNo(known))
		u.PodDiagnostics()
	}
	// The controllers restarted with the node: each new one waits out its predecessor's Lease.
	if u.waitLeaders(180*time.Second, "after the reboot's takeover") {
		line, _ := u.leadersLive()
		u.Pass("the controllers lead again (seen %s s after the runtime's start): %s", Since(tBoot), line)
	}
	u.Settle(10 * time.Second)
	st.End("the reboot, from the takeover on")
	r.handedOverFromRecovery(good)
	u.kubeProxyBack(tBoot)
}

// kubeProxyBack: kube-proxy's pod ready again after the reboot at boot, 10.96.0.1 in its rules.
func (u *upgrade) kubeProxyBack(boot time.Time) {
	if u.WaitFor(180*time.Second, func() bool { return u.kubeProxyReadySince(boot) }) {
		u.Pass("kube-proxy ready again after the reboot, 10.96.0.1 in its rules")
	} else {
		u.Fail("kube-proxy not ready again 180 s after the takeover: %s", report.Cut(u.logsBySelector("k8s-app=kube-proxy", 5), 600))
	}
}
