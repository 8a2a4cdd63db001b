package node

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

const (
	// kuBadFlag is a flag kube-apiserver rejects (it exits at once): the new pod of an upgrade
	// that sets it never gets ready.
	kuBadFlag = "kap-rehearsal-rejected-flag"
	// kuFailedWait is kubeadm's wait for each component in the failed upgrades
	// (UpgradeConfiguration timeouts.upgradeManifests; 5 min by default).
	kuFailedWait = 60 * time.Second
	// kuAbsentImage is an apiserver image that exists nowhere (no registry answers for it on
	// the test node).
	kuAbsentImage = "localhost/kube-apiserver-proxy/kube-apiserver:v0.0.0-absent"
	// kuManifestDigest is the Deployment template's annotation naming kubeadm's manifest
	// (render).
	kuManifestDigest = "kube-apiserver-proxy/kubeadm-manifest-sha256"
)

// failure is what makes the new apiserver of a failed upgrade never get ready: set before
// `kubeadm upgrade apply`, taken out after it.
type failure struct {
	step, what string
	// set makes it so; it returns the UpgradeConfiguration's patches directory, if any.
	set  func() (patches string, err error)
	undo func() error
	// sidecar: the failure is the proxy sidecar's alone (its apiserver starts): checked on
	// the surge pod while kubeadm waits.
	sidecar bool
}

// busyPort: the apiserver's secure port set, in kubeadm-config as an operator would, to one
// the kubelet holds on every address (10250): kube-apiserver itself binds a loopback address
// of its own in the Deployment (launch) and starts, but the proxy sidecar cannot bind the node
// address on that port and exits, so the new pod never gets ready.
func (u *upgrade) busyPort() failure {
	return failure{
		step: "failed-proxy", what: "--secure-port=10250 (the kubelet's port: the proxy sidecar cannot bind it)",
		set:     func() (string, error) { return "", u.editExtraArgs(withArg("secure-port", "10250"), "apiServer") },
		undo:    func() error { return u.editExtraArgs(withoutArg("secure-port"), "apiServer") },
		sidecar: true,
	}
}

// surgeWatch records, until stop is closed, the containers of the Deployment's pods other than
// serving: the last status seen of each (name: state, restarts, last exit code).
func (u *upgrade) surgeWatch(serving string, stop <-chan struct{}) <-chan map[string]corev1.ContainerStatus {
	out := make(chan map[string]corev1.ContainerStatus, 1)
	go func() {
		seen := map[string]corev1.ContainerStatus{}
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			for _, p := range u.DeployPods() {
				if p.Name == serving {
					continue
				}
				for _, c := range p.Status.ContainerStatuses {
					seen[c.Name] = c
				}
			}
			select {
			case <-stop:
				out <- seen
				return
			case <-tick.C:
			}
		}
	}()
	return out
}

// sidecarFailed: from the surge pod's containers, whether its proxy exited (a non-zero exit
// seen, or restarts) while its apiserver container started, and a line saying so.
func sidecarFailed(seen map[string]corev1.ContainerStatus) (bool, string) {
	line := func(c corev1.ContainerStatus) string {
		exit := "-"
		if t := c.LastTerminationState.Terminated; t != nil {
			exit = fmt.Sprint(t.ExitCode)
		} else if t := c.State.Terminated; t != nil {
			exit = fmt.Sprint(t.ExitCode)
		}
		return fmt.Sprintf("%s: ready %v, started %v, restarts %d, last exit %s", c.Name, c.Ready, c.Started != nil && *c.Started, c.RestartCount, exit)
	}
	var parts []string
	for _, name := range []string{"kube-apiserver", "proxy"} {
		if c, ok := seen[name]; ok {
			parts = append(parts, line(c))
		}
	}
	proxy, okP := seen["proxy"]
	api, okA := seen["kube-apiserver"]
	exited := okP && !proxy.Ready && (proxy.RestartCount > 0 || proxy.LastTerminationState.Terminated != nil ||
		(proxy.State.Terminated != nil && proxy.State.Terminated.ExitCode != 0))
	apiStarted := okA && (api.State.Running != nil || api.Started != nil && *api.Started)
	return exited && apiStarted, strings.Join(parts, "; ")
}

// rejectedFlag: an apiServer extraArg kube-apiserver rejects (it exits at once), set in
// kubeadm-config as an operator would.
func (u *upgrade) rejectedFlag() failure {
	return failure{
		step: "failed", what: "--" + kuBadFlag + " (an apiServer extraArg kube-apiserver rejects)",
		set:  func() (string, error) { return "", u.editExtraArgs(withArg(kuBadFlag, "1"), "apiServer") },
		undo: func() error { return u.editExtraArgs(withoutArg(kuBadFlag), "apiServer") },
	}
}

// absentImage: kube-apiserver's image replaced, by a kubeadm patch of the upgrade's
// UpgradeConfiguration, with one that exists nowhere (its pull fails, the surge pod stays in
// ImagePullBackOff). kubeadm pulls the images of its configuration before it starts, not a
// patched one.
func (u *upgrade) absentImage() failure {
	return failure{
		step: "failed-image", what: "the image " + kuAbsentImage + " (a kubeadm patch of kube-apiserver's)",
		set: func() (string, error) {
			dir := u.Path("patches-failed-image")
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return "", err
			}
			patch := fmt.Sprintf(`[{"op": "replace", "path": "/spec/containers/0/image", "value": %q}]`+"\n", kuAbsentImage)
			return dir, os.WriteFile(filepath.Join(dir, "kube-apiserver+json.json"), []byte(patch), 0o644)
		},
		undo: func() error { return nil },
	}
}

// failedUpgrade: docs/runbooks/upgrade-kubernetes.md, "If the upgrade fails". An upgrade whose
// new apiserver never gets ready (f: a flag it rejects, an image that cannot be pulled) fails
// safe, in step with kubeadm, under the loads: kubeadm's wait (kuFailedWait) fails and it puts
// its old manifest back; kubeadm-sync, which never rewrote its stand-in for the rollout that
// did not complete, rolls the Deployment back to the old template; no surge pod is left; no
// request fails. Then, f undone, `kubeadm upgrade apply` succeeds and changes nothing.
func (u *upgrade) failedUpgrade(f failure) {
	s := u.startStep(f.step, nil, false)
	defer u.endStep(s, "the failed upgrade and its rollback: "+f.what)
	gen0, hash0, digest0 := u.generation(), u.standinHash(), u.templateDigest()
	serving := u.ThePod()
	rollbacks := strings.Count(u.syncLog(5000), "replacing it (rollback)")
	patches, err := f.set()
	if err != nil {
		u.Fail("%s not set: %v", f.what, err)
		return
	}
	config, err := u.failedConfig("upgrade-"+f.step+".yaml", false, patches)
	if err != nil {
		u.Fail("%v", err)
		return
	}
	t0 := time.Now()
	stopWatch := make(chan struct{})
	surge := u.surgeWatch(serving, stopWatch)
	out, err := u.kubeadm("kubeadm-"+f.step+".log", 15*time.Minute, u.Bin("kubeadm"), "upgrade", "apply", "-y",
		"--config", config, "--ignore-preflight-errors="+kuIgnore)
	took := Since(t0)
	close(stopWatch)
	failed, containers := sidecarFailed(<-surge)
	if f.sidecar {
		u.Check(failed, "the surge pod's proxy sidecar exited while its apiserver started (the failure is the sidecar's): %s", containers)
	} else {
		u.Note("the surge pod's containers while kubeadm waited: %s", containers)
	}
	u.Note("failed upgrade (%s): kubeadm said: %s", f.what, kubeadmSaid(out))
	switch {
	case err == nil:
		u.Fail("kubeadm upgrade apply with %s succeeded (%s s): the apiserver that cannot start went unnoticed", f.what, took)
	case !strings.Contains(out, "couldn't upgrade control plane. kubeadm has tried to recover everything into the earlier state"):
		u.Fail("kubeadm upgrade apply with %s failed (%s s), but not by its wait for the apiserver: %s", f.what, took, grepTail(out, kuErrors, 3))
	default:
		u.Pass("kubeadm upgrade apply with %s failed after %s s, its wait for kube-apiserver timed out, and it put its old manifest back: %s",
			f.what, took, grepTail(out, "static Pod hash|couldn't upgrade", 2))
	}
	gen1 := u.generation()
	back := func() bool {
		pods := u.DeployPods()
		return u.templateDigest() == digest0 && u.DeployReady() && len(pods) == 1
	}
	t1 := time.Now()
	if gen1 > gen0 && u.WaitFor(4*time.Minute, back) {
		u.Pass("kubeadm-sync rolled the Deployment back to kubeadm's restored manifest %s s after kubeadm gave up (generation %d -> %d): rollout complete, one pod, no surge pod left",
			Since(t1), gen0, u.generation())
	} else {
		u.Fail("the Deployment after the failed upgrade: generation %d -> %d -> %d, template's manifest %q (want %q), ready %v, pods %d; kubeadm-sync: %s",
			gen0, gen1, u.generation(), u.templateDigest(), digest0, u.DeployReady(), len(u.DeployPods()), u.syncLog(8))
	}
	if hash := u.standinHash(); hash == hash0 {
		u.Pass("the stand-in kept its hash through the failed upgrade (kubeadm's wait never saw it change)")
	} else {
		u.Fail("the stand-in's hash changed from %s to %s for a rollout that never completed", hash0, hash)
	}
	if strings.Count(u.syncLog(5000), "replacing it (rollback)") <= rollbacks {
		u.Fail("kubeadm-sync's log does not say it rolled the Deployment back: %s", u.syncLog(8))
	}
	// Reboot recovery's checkpoint: the pod that served through it, never the new one (it
	// never got ready); written by now (the last rollout completed minutes ago).
	if cp := checkpointOf(checkpointFile); cp == "kube-system/"+serving && serving != "" {
		u.Pass("the reboot checkpoint is still of %s, the pod that served through the failed upgrade", serving)
	} else {
		u.Fail("the reboot checkpoint after the failed upgrade is of %q, not of %s (the pod that served); the recovery agent: %s",
			cp, serving, strings.ReplaceAll(Tail(u.recoveryLog(), 3), "\n", "|"))
	}
	if err := f.undo(); err != nil {
		u.Fail("%s not taken out: %v", f.what, err)
		return
	}
	gen2 := u.generation()
	a := u.apply("kubeadm upgrade apply "+u.Version+" after the failed one", "after-"+f.step)
	if a.err == nil && u.generation() == gen2 && strings.Contains(a.log, "Current and new manifests of kube-apiserver are equal") {
		u.Pass("kubeadm upgrade apply %s after the failed one succeeded in %s s, the apiserver's manifest equal (no new generation)", u.Version, a.seconds)
	} else {
		u.Fail("kubeadm upgrade apply after the failed one: %v, generation %d -> %d: %s", a.err, gen2, u.generation(), lastLines(a.log, 3))
	}
}

// templateDigest is the digest of kubeadm's manifest that the Deployment's template was
// rendered from ("" when it cannot be read).
func (u *upgrade) templateDigest() string {
	d, err := u.Client.AppsV1().Deployments("kube-system").Get(u.Ctx, "kube-apiserver", metav1.GetOptions{})
	if err != nil {
		return ""
	}
	return d.Spec.Template.Annotations[kuManifestDigest]
}

// syncLog is the last lines of kubeadm-sync's log (the stand-in's container), joined by "|".
func (u *upgrade) syncLog(lines int64) string {
	log, err := u.Logs("kube-apiserver-"+u.NodeName, "kube-apiserver", lines, false)
	if err != nil {
		return err.Error()
	}
	return strings.ReplaceAll(strings.TrimSpace(log), "\n", "|")
}

// editExtraArgs changes the extraArgs under path of kubeadm-config's ClusterConfiguration
// ("apiServer", or "etcd", "local"; a list of {name, value}, kubeadm.k8s.io/v1beta4) with
// edit: what an operator does with `kubectl -n kube-system edit cm kubeadm-config` (an update:
// it fails when the ConfigMap changed meanwhile).
func (u *upgrade) editExtraArgs(edit func([]any) []any, path ...string) error {
	cms := u.Client.CoreV1().ConfigMaps("kube-system")
	cm, err := cms.Get(u.Ctx, "kubeadm-config", metav1.GetOptions{})
	if err != nil {
		return err
	}
	var cfg map[string]any
	if err := yaml.Unmarshal([]byte(cm.Data["ClusterConfiguration"]), &cfg); err != nil {
		return fmt.Errorf("data.ClusterConfiguration: %w", err)
	}
	section := cfg
	for _, key := range path {
		next, _ := section[key].(map[string]any)
		if next == nil {
			next = map[string]any{}
			section[key] = next
		}
		section = next
	}
	args, _ := section["extraArgs"].([]any)
	section["extraArgs"] = edit(args)
	text, err := yaml.Marshal(cfg)
	if err != nil {
		return err
	}
	cm.Data["ClusterConfiguration"] = string(text)
	_, err = cms.Update(u.Ctx, cm, metav1.UpdateOptions{})
	return err
}

// withArg is args and {name, value}.
func withArg(name, value string) func([]any) []any {
	return func(args []any) []any { return append(args, map[string]any{"name": name, "value": value}) }
}

// withoutArg is args without the ones named name.
func withoutArg(name string) func([]any) []any {
	return func(args []any) []any {
		var kept []any
		for _, a := range args {
			if m, ok := a.(map[string]any); !ok || m["name"] != name {
				kept = append(kept, a)
			}
		}
		return kept
	}
}

// failedConfig writes the UpgradeConfiguration of a failed upgrade step (kubeadm's wait
// kuFailedWait, no certificate renewal) to file; etcd upgraded or not; with a patches
// directory or none.
func (u *upgrade) failedConfig(file string, etcd bool, patches string) (string, error) {
	config := u.Path(file)
	text := fmt.Sprintf(`apiVersion: kubeadm.k8s.io/v1beta4
kind: UpgradeConfiguration
apply:
  kubernetesVersion: %s
  certificateRenewal: false
  etcdUpgrade: %t
`, u.Version, etcd)
	if patches != "" {
		text += fmt.Sprintf("  patches:\n    directory: %s\n", patches)
	}
	text += fmt.Sprintf("timeouts:\n  upgradeManifests: %s\n", kuFailedWait)
	return config, os.WriteFile(config, []byte(text), 0o600)
}
