package node

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// failedEtcdUpgrade: step 3a, docs/runbooks/upgrade-kubernetes.md, "If etcd's upgrade fails".
// An etcd upgrade whose new etcd cannot start (an etcd extraArg that etcd rejects, set in
// kubeadm-config with the new imageTag, as an operator would) fails safe under the loads,
// judged strictly: kubeadm-sync runs kubeadm's new etcd pod first as a canary (a learner
// member on its own ports and data), sees it stop, and leaves etcd's copy as it is, so etcd
// runs on untouched: the same containers, the old version, one member, no learner and no
// canary pod left. kubeadm's wait (kuFailedWait) fails, it puts its manifest back and finds
// the old etcd healthy: no data restored. The tag and the flag are then put back as they
// were for step 3.
func (u *upgrade) failedEtcdUpgrade() {
	before := u.containerIDs()
	uid0, hash0, image0 := u.etcdMirror()
	if err := u.setEtcdTag(u.etcd, u.newEtcd); err != nil {
		u.Fail("kubeadm-config's etcd imageTag not changed: %v", err)
		return
	}
	defer func() {
		if err := errors.Join(u.editExtraArgs(withoutArg(kuBadFlag), "etcd", "local"), u.setEtcdTag(u.newEtcd, u.etcd)); err != nil {
			u.Fail("kubeadm-config not put back after the failed etcd upgrade: %v", err)
		}
	}()
	if err := u.editExtraArgs(withArg(kuBadFlag, "1"), "etcd", "local"); err != nil {
		u.Fail("kubeadm-config: etcd's rejected flag not set: %v", err)
		return
	}
	config, err := u.failedConfig("upgrade-etcd-failed.yaml", true, "")
	if err != nil {
		u.Fail("%v", err)
		return
	}
	s := u.startStep("etcd-failed", u.probeOnly(), false)
	defer u.endStep(s, "the failed etcd upgrade (its canary stopped, etcd untouched)")
	t0 := time.Now()
	out, err := u.kubeadm("kubeadm-etcd-failed.log", 15*time.Minute, u.Bin("kubeadm"), "upgrade", "apply", "-y",
		"--config", config, "--ignore-preflight-errors="+kuIgnore)
	took := Since(t0)
	u.Note("failed etcd upgrade: kubeadm said: %s", kubeadmSaid(out))
	switch {
	case err == nil:
		u.Fail("kubeadm upgrade apply with etcd's --%s succeeded (%s s): the etcd that cannot start went unnoticed", kuBadFlag, took)
	case !strings.Contains(out, "rolled the state back to pre-upgrade state"):
		u.Fail("kubeadm upgrade apply with etcd's --%s failed (%s s), but not by its wait for etcd: %s", kuBadFlag, took, grepTail(out, kuErrors, 3))
	case strings.Contains(out, "Rolling back etcd data"):
		u.Fail("kubeadm restored etcd's data after %s s: the old etcd was not healthy when it put its manifest back: %s", took, grepTail(out, "etcd", 4))
	default:
		u.Pass("kubeadm upgrade apply with etcd's --%s failed after %s s by its wait for etcd, put its manifest back and found the old etcd healthy (no data restored): %s",
			kuBadFlag, took, grepTail(out, "Failed to upgrade etcd|rolled the state back", 2))
	}
	after := u.containerIDs()
	uid, hash, image := u.etcdMirror()
	if after == before && uid == uid0 && hash == hash0 && image == image0 {
		u.Pass("etcd untouched: the same containers (%s), its mirror pod's uid %s, hash %s and image %s as before", after, uid, hash, image)
	} else {
		u.Fail("etcd touched by the failed upgrade: containers %s -> %s; mirror pod uid %s -> %s, hash %s -> %s, image %s -> %s",
			before, after, uid0, uid, hash0, hash, image0, image)
	}
	version, members, err := etcdMembers()
	if want := strings.TrimPrefix(u.etcd, "v"); err == nil && version == want && len(members) == 1 && !members[0].Learner {
		u.Pass("etcd reports version %s and one member (%s): the canary's learner removed", version, members[0].Name)
	} else {
		u.Fail("etcd after the failed upgrade: version %q (want %s), members %v%s", version, want, members, errSuffix(err))
	}
	log := u.syncLog(400)
	// The operator reads why in the agent's log: the new etcd's own words, naming the flag.
	if failed := linesWith(log, "etcd's canary failed"); strings.Contains(failed, "the new etcd stopped") && strings.Contains(failed, kuBadFlag) {
		u.Pass("kubeadm-sync ran the canary and saw it stop, with etcd's reason: %s", report.Cut(failed, 600))
	} else {
		u.Fail("kubeadm-sync's log does not say the canary stopped: %s", report.Cut(linesWith(log, "canary"), 600))
	}
	// kubeadm's rollback finds the node consistent: its restored manifest is what runs.
	if same, why := copyIsKubeadms("etcd.yaml"); same {
		u.Pass("kubeadm's restored etcd.yaml is the pod the kubelet runs (%s)", why)
	} else {
		u.Fail("kubeadm's etcd.yaml and the kubelet's copy differ after the failed upgrade: %s", why)
	}
	canary := "etcd-canary-" + u.NodeName
	file := filepath.Join(kuSyncDir, "etcd-canary.yaml")
	var left string
	if u.WaitFor(60*time.Second, func() bool {
		_, err := u.Client.CoreV1().Pods("kube-system").Get(u.Ctx, canary, metav1.GetOptions{})
		_, ferr := os.Stat(file)
		left = fmt.Sprintf("pod %s: %v; %s: %v", canary, err, file, ferr)
		return apierrors.IsNotFound(err) && errors.Is(ferr, os.ErrNotExist)
	}) {
		u.Pass("no canary left: its pod file and its mirror pod gone")
	} else {
		u.Fail("the canary left behind: %s", left)
	}
}

// linesWith: the lines of a "|"-joined log that hold text, whole, joined by "|".
func linesWith(log, text string) string {
	var out []string
	for _, l := range strings.Split(log, "|") {
		if strings.Contains(l, text) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "|")
}
