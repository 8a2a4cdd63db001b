package node

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

func TestSteps(t *testing.T) {
	s := Steps(" legacy  drain\tslow ")
	if !s["legacy"] || !s["drain"] || !s["slow"] || s["daemonset"] || s[""] || len(s) != 3 {
		t.Fatalf("Steps: %v", s)
	}
}

func TestAPIServerPodLines(t *testing.T) {
	one := []string{"kube-apiserver-7d4857fd64-nzvn2 ready 0 - smoke-node"}
	if !OneReadyPod(one) {
		t.Errorf("one ready pod: %q", one)
	}
	for _, lines := range [][]string{
		nil,
		{"kube-apiserver-a notready 0 - smoke-node"},
		{"kube-apiserver-a ready 1 - smoke-node"},
		{"kube-apiserver-a ready 0 deleting smoke-node"},
		{"kube-apiserver-a ready 0 - smoke-node", "kube-apiserver-b ready 0 - smoke-node"},
	} {
		if OneReadyPod(lines) {
			t.Errorf("not one ready pod: %q", lines)
		}
	}
	two := []string{"kube-apiserver-b ready 0 - n1", "kube-apiserver-a notready 3 deleting -"}
	if got := strings.Join(PodNames(two), " "); got != "kube-apiserver-a kube-apiserver-b" {
		t.Errorf("PodNames: %q", got)
	}
	if got := PodNodes(two); got != "n1 -" {
		t.Errorf("PodNodes: %q", got)
	}
	// A deleted pod's restarts are not the kubelet restarting the slow apiserver.
	if APodRestarted(two) {
		t.Errorf("a restart of a pod being deleted counted: %q", two)
	}
	if !APodRestarted(append(two, "kube-apiserver-c notready 1 - n1")) {
		t.Errorf("the restart of a live pod not counted")
	}
	if !anyOf([]string{"b", "c"}, []string{"a", "c"}) || anyOf([]string{"b"}, []string{"a", "c"}) {
		t.Errorf("anyOf")
	}
}

func TestDaemonSetDone(t *testing.T) {
	ds := func(gen, observed int64, desired, updated, available int32) *appsv1.DaemonSet {
		d := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Generation: gen}}
		d.Spec.UpdateStrategy.Type = appsv1.RollingUpdateDaemonSetStrategyType
		d.Status = appsv1.DaemonSetStatus{ObservedGeneration: observed, DesiredNumberScheduled: desired,
			UpdatedNumberScheduled: updated, NumberAvailable: available}
		return d
	}
	if !DaemonSetDone(ds(2, 2, 1, 1, 1)) {
		t.Errorf("a complete rollout is not done")
	}
	for name, d := range map[string]*appsv1.DaemonSet{
		"spec not observed": ds(3, 2, 1, 1, 1),
		"not updated":       ds(2, 2, 1, 0, 1),
		"not available":     ds(2, 2, 1, 1, 0),
	} {
		if DaemonSetDone(d) {
			t.Errorf("%s: done", name)
		}
	}
	onDelete := ds(2, 2, 1, 1, 1)
	onDelete.Spec.UpdateStrategy.Type = appsv1.OnDeleteDaemonSetStrategyType
	if DaemonSetDone(onDelete) {
		t.Errorf("OnDelete: done (kubectl rollout status refuses it)")
	}
}

func TestBudgetCountsOne(t *testing.T) {
	p := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Generation: 2}}
	p.Status.CurrentHealthy, p.Status.ObservedGeneration = 1, 2
	if !BudgetCountsOne(p) {
		t.Errorf("one healthy, generation seen: %+v", p.Status)
	}
	p.Status.ObservedGeneration = 1
	if BudgetCountsOne(p) {
		t.Errorf("an older generation counted")
	}
	p.Status.CurrentHealthy, p.Status.ObservedGeneration = 0, 2
	if BudgetCountsOne(p) {
		t.Errorf("no healthy pod counted as one")
	}
}

func TestKustomization(t *testing.T) {
	plain := Kustomization("single-controller", "localhost/r/kube-apiserver-proxy:dev", "localhost/r", "v1.37.2", 0)
	var k struct {
		Resources []string
		Images    []struct{ Name, NewName, NewTag string }
		Patches   []struct {
			Target struct{ Kind, Name string }
			Patch  string
		}
	}
	if err := yaml.Unmarshal([]byte(plain), &k); err != nil {
		t.Fatal(err)
	}
	if len(k.Resources) != 1 || k.Resources[0] != "../manifests/single-controller" || len(k.Patches) != 0 ||
		len(k.Images) != 2 || k.Images[0].NewName != "localhost/r/kube-apiserver-proxy" || k.Images[0].NewTag != "dev" ||
		k.Images[1].NewName != "localhost/r/kube-apiserver" || k.Images[1].NewTag != "v1.37.2" {
		t.Fatalf("plain: %+v", k)
	}
	kept := Kustomization("ha-daemonset", "localhost/r/kube-apiserver-proxy:dev", "localhost/r", "v1.37.2", 65532)
	if err := yaml.Unmarshal([]byte(kept), &k); err != nil {
		t.Fatal(err)
	}
	var ops []struct {
		Op, Path string
		Value    any
	}
	if len(k.Patches) != 1 || k.Patches[0].Target.Kind != "Deployment|DaemonSet" {
		t.Fatalf("the uid patch: %+v", k.Patches)
	}
	if err := yaml.Unmarshal([]byte(k.Patches[0].Patch), &ops); err != nil {
		t.Fatal(err)
	}
	uids := 0
	for _, o := range ops {
		if o.Op == "replace" && (strings.HasSuffix(o.Path, "/runAsUser") || strings.HasSuffix(o.Path, "/runAsGroup")) {
			if o.Value != float64(65532) {
				t.Errorf("%s: %v", o.Path, o.Value)
			}
			uids++
		}
	}
	if uids != 4 || len(ops) != 6 {
		t.Fatalf("want 4 uid replacements of 6 operations: %+v", ops)
	}
}

func TestDrainOutput(t *testing.T) {
	refused := "node/smoke-node cordoned\nevicting pod kube-system/kube-apiserver-x\n" +
		"error when evicting pods/\"kube-apiserver-x\" -n \"kube-system\" (will retry after 5s): Cannot evict pod as it would violate the pod's disruption budget.\n" +
		"error: unable to drain node \"smoke-node\" due to error: global timeout reached: 1m0s, continuing command...\n"
	if got := BudgetRefusal(refused); got != "Cannot evict pod as it would violate the pod's disruption budget" {
		t.Errorf("BudgetRefusal: %q", got)
	}
	if got := BudgetRefusal("a\nlast line"); got != "" {
		t.Errorf("BudgetRefusal without one: %q", got)
	}
	drained := "node/smoke-node cordoned\nevicting pod kube-system/kube-apiserver-x\npod/kube-apiserver-x evicted\nnode/smoke-node drained\n"
	if got := Drained(drained); got != "pod/kube-apiserver-x evicted" {
		t.Errorf("Drained: %q", got)
	}
}

func TestTmpfilesOwn(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("chown needs root")
	}
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "a/b")
	if err := os.MkdirAll(b, 0o755); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, "conf")
	text := "# comment\nd " + a + " 0700 65532 65532 -\nd " + b + " 0750 65532 65533 -\nL /x - - - - /y\n"
	if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	uid, err := Tmpfiles(conf, false)
	if err != nil || uid != 65532 {
		t.Fatalf("uid %d, %v", uid, err)
	}
	fi, _ := os.Stat(b)
	if fi.Mode().Perm() != 0o750 {
		t.Errorf("mode %o", fi.Mode().Perm())
	}
}

func TestInCI(t *testing.T) {
	for v, want := range map[string]bool{"": false, "false": false, "0": false, "true": true, "1": true} {
		t.Setenv("CI", v)
		if InCI() != want {
			t.Errorf("CI=%q: %t", v, !want)
		}
	}
}
