package node

import (
	"fmt"
	"os"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

const (
	// kuBadFlag is a flag kube-apiserver rejects (it exits at once): the new pod of an upgrade
	// that sets it never gets ready.
	kuBadFlag = "kap-rehearsal-rejected-flag"
	// kuFailedWait is kubeadm's wait for each component in the failed upgrade
	// (UpgradeConfiguration timeouts.upgradeManifests; 5 min by default).
	kuFailedWait = 90 * time.Second
	// kuManifestDigest is the Deployment template's annotation naming kubeadm's manifest
	// (render).
	kuManifestDigest = "kube-apiserver-proxy/kubeadm-manifest-sha256"
)

// failedUpgrade: docs/runbooks/upgrade-kubernetes.md, "If the upgrade fails". An upgrade whose
// new apiserver never gets ready (an apiServer extraArg kube-apiserver rejects, set in
// kubeadm-config as an operator would) fails safe, in step with kubeadm, under the loads:
// kubeadm's wait (kuFailedWait) fails and it puts its old manifest back; kubeadm-sync, which
// never rewrote its stand-in for the rollout that did not complete, rolls the Deployment back
// to the old template; no surge pod is left; no request fails. Then, the flag taken out
// again, `kubeadm upgrade apply` succeeds and changes nothing.
func (u *upgrade) failedUpgrade() {
	s := u.startStep("failed", nil, false)
	defer u.endStep(s, "the failed upgrade and its rollback")
	gen0, hash0, digest0 := u.generation(), u.standinHash(), u.templateDigest()
	if err := u.editAPIServerArgs(func(args []any) []any {
		return append(args, map[string]any{"name": kuBadFlag, "value": "1"})
	}); err != nil {
		u.Fail("kubeadm-config: the rejected flag not set: %v", err)
		return
	}
	config := u.Path("upgrade-failed.yaml")
	if err := os.WriteFile(config, []byte(fmt.Sprintf(`apiVersion: kubeadm.k8s.io/v1beta4
kind: UpgradeConfiguration
apply:
  kubernetesVersion: %s
  certificateRenewal: false
  etcdUpgrade: false
timeouts:
  upgradeManifests: %s
`, u.Version, kuFailedWait)), 0o600); err != nil {
		u.Fail("%v", err)
		return
	}
	t0 := time.Now()
	out, err := u.kubeadm("kubeadm-failed.log", 15*time.Minute, u.Bin("kubeadm"), "upgrade", "apply", "-y",
		"--config", config, "--ignore-preflight-errors="+kuIgnore)
	took := Since(t0)
	u.Note("failed upgrade: kubeadm said: %s", kubeadmSaid(out))
	switch {
	case err == nil:
		u.Fail("kubeadm upgrade apply with --%s succeeded (%s s): the apiserver that cannot start went unnoticed", kuBadFlag, took)
	case !strings.Contains(out, "couldn't upgrade control plane. kubeadm has tried to recover everything into the earlier state"):
		u.Fail("kubeadm upgrade apply with --%s failed (%s s), but not by its wait for the apiserver: %s", kuBadFlag, took, grepTail(out, kuErrors, 3))
	default:
		u.Pass("kubeadm upgrade apply with --%s failed after %s s, its wait for kube-apiserver timed out, and it put its old manifest back: %s",
			kuBadFlag, took, grepTail(out, "static Pod hash|couldn't upgrade", 2))
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
	if !strings.Contains(u.syncLog(200), "replacing it (rollback)") {
		u.Fail("kubeadm-sync's log does not say it rolled the Deployment back: %s", u.syncLog(8))
	}
	if err := u.editAPIServerArgs(func(args []any) []any {
		var kept []any
		for _, a := range args {
			if m, ok := a.(map[string]any); !ok || m["name"] != kuBadFlag {
				kept = append(kept, a)
			}
		}
		return kept
	}); err != nil {
		u.Fail("kubeadm-config: the rejected flag not taken out: %v", err)
		return
	}
	gen2 := u.generation()
	a := u.apply("kubeadm upgrade apply "+u.Version+" after the failed one", "after-failed")
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

// editAPIServerArgs changes apiServer.extraArgs of kubeadm-config's ClusterConfiguration (a
// list of {name, value}, kubeadm.k8s.io/v1beta4) with edit: what an operator does with
// `kubectl -n kube-system edit cm kubeadm-config` (an update: it fails when the ConfigMap
// changed meanwhile).
func (u *upgrade) editAPIServerArgs(edit func([]any) []any) error {
	cms := u.Client.CoreV1().ConfigMaps("kube-system")
	cm, err := cms.Get(u.Ctx, "kubeadm-config", metav1.GetOptions{})
	if err != nil {
		return err
	}
	var cfg map[string]any
	if err := yaml.Unmarshal([]byte(cm.Data["ClusterConfiguration"]), &cfg); err != nil {
		return fmt.Errorf("data.ClusterConfiguration: %w", err)
	}
	api, _ := cfg["apiServer"].(map[string]any)
	if api == nil {
		api = map[string]any{}
	}
	args, _ := api["extraArgs"].([]any)
	api["extraArgs"] = edit(args)
	cfg["apiServer"] = api
	text, err := yaml.Marshal(cfg)
	if err != nil {
		return err
	}
	cm.Data["ClusterConfiguration"] = string(text)
	_, err = cms.Update(u.Ctx, cm, metav1.UpdateOptions{})
	return err
}
