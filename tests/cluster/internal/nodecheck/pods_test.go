package nodecheck

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

func decode[T any](t *testing.T, s string) *T {
	t.Helper()
	var v T
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("decoding %s: %v", s, err)
	}
	return &v
}

const pods = `{"items": [
  {"metadata": {"name": "nodetest-smoke-node"}, "spec": {"nodeName": "smoke-node"},
   "status": {"phase": "Running", "podIP": "192.0.2.10",
     "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]}},
  {"metadata": {"name": "podnet-smoke-node"}, "spec": {},
   "status": {"conditions": [{"type": "Ready", "status": "False"}]}}]}`

func TestPods(t *testing.T) {
	l := decode[corev1.PodList](t, pods)
	for _, c := range []struct {
		prefix string
		want   bool
	}{{"nodetest", true}, {"podnet", false}, {"nodetest-smoke-node", false}, {"nodetest-smoke", true}, {"absent", false}} {
		if got := ReadyWithPrefix(l, c.prefix); got != c.want {
			t.Errorf("ReadyWithPrefix(%q) = %v, want %v", c.prefix, got, c.want)
		}
	}
	if !Running(l, "nodetest-smoke-node") || Running(l, "podnet-smoke-node") || Running(l, "nodetest") {
		t.Errorf("Running: only nodetest-smoke-node runs")
	}
	if Named(l, "podnet-smoke-node") == nil || Named(l, "podnet") != nil {
		t.Errorf("Named: podnet-smoke-node is listed, podnet is not")
	}
	want := []string{"nodetest-smoke-node smoke-node Running", "podnet-smoke-node - None"}
	if got := Lines(l); !reflect.DeepEqual(got, want) {
		t.Errorf("Lines = %q, want %q", got, want)
	}
}

func TestNodeReady(t *testing.T) {
	n := decode[corev1.Node](t, `{"status": {"conditions": [{"type": "MemoryPressure", "status": "False"},
	  {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"}]}}`)
	if got, want := NodeReady(n), "True KubeletReady: kubelet is posting ready status"; got != want {
		t.Errorf("NodeReady = %q, want %q", got, want)
	}
	if got := NodeReady(decode[corev1.Node](t, `{}`)); got != "" {
		t.Errorf("NodeReady of a node without conditions = %q", got)
	}
}

func TestRolloutDone(t *testing.T) {
	const done = `{"metadata": {"generation": 3}, "spec": {"replicas": 1},
	  "status": {"observedGeneration": 3, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1, "readyReplicas": 1}}`
	if !RolloutDone(decode[appsv1.Deployment](t, done)) {
		t.Fatalf("a complete rollout is not done")
	}
	for name, s := range map[string]string{
		"old generation seen": strings.Replace(done, `"observedGeneration": 3`, `"observedGeneration": 2`, 1),
		"an old pod left":     strings.Replace(done, `"replicas": 1, "updated`, `"replicas": 2, "updated`, 1),
		"new pod not ready":   strings.Replace(done, `"readyReplicas": 1`, `"readyReplicas": 0`, 1),
		"not available":       strings.Replace(done, `, "availableReplicas": 1`, ``, 1),
		"not updated":         strings.Replace(done, `"updatedReplicas": 1`, `"updatedReplicas": 0`, 1),
		"no status":           `{"metadata": {"generation": 1}, "spec": {"replicas": 1}}`,
		"zero replicas":       `{"metadata": {"generation": 1}, "spec": {"replicas": 0}, "status": {"observedGeneration": 1}}`,
	} {
		if RolloutDone(decode[appsv1.Deployment](t, s)) {
			t.Errorf("%s: RolloutDone is true", name)
		}
	}
}

func TestArgIndex(t *testing.T) {
	d := decode[appsv1.Deployment](t, `{"spec": {"template": {"spec": {"containers": [
	  {"name": "kube-apiserver", "args": ["--advertise-address=192.0.2.10", "--etcd-servers=https://127.0.0.1:2379"]},
	  {"name": "proxy", "args": ["--etcd-servers=elsewhere"]}]}}}}`)
	if got := ArgIndex(d, "--etcd-servers="); got != 1 {
		t.Errorf("ArgIndex = %d, want 1", got)
	}
	if got := ArgIndex(d, "--absent="); got != -1 {
		t.Errorf("ArgIndex of an absent flag = %d, want -1", got)
	}
}

const checkpoint = `{"metadata": {"name": "kube-apiserver-checkpoint", "labels": {"component": "kube-apiserver-checkpoint"},
  "annotations": {"kube-apiserver-proxy/checkpoint-of": "kube-system/kube-apiserver-abc"}},
 "spec": {"volumes": [{"name": "pki", "hostPath": {"path": "/etc/kubernetes/pki"}}],
  "containers": [{"name": "kube-apiserver", "command": ["kube-apiserver"], "args": ["--etcd-servers=https://127.0.0.1:2379"]},
   {"name": "proxy", "args": ["--listen=192.0.2.10:6443", "--retire-file=/run/retire"]}]}}`

func checkpointProblems(t *testing.T, s string) []string {
	var raw struct{ Spec map[string]json.RawMessage }
	if err := json.Unmarshal([]byte(s), &raw); err != nil {
		t.Fatal(err)
	}
	keys := map[string]bool{}
	for k := range raw.Spec {
		keys[k] = true
	}
	return CheckpointProblems(decode[corev1.Pod](t, s), keys)
}

func TestCheckpointProblems(t *testing.T) {
	if p := checkpointProblems(t, checkpoint); len(p) != 0 {
		t.Fatalf("a good checkpoint has problems: %v", p)
	}
	for _, c := range []struct{ from, to, want string }{
		{`"name": "kube-apiserver-checkpoint"`, `"name": "kube-apiserver-abc"`, "name"},
		{`"component": "kube-apiserver-checkpoint"`, `"component": "kube-apiserver"`, "Deployment labels kept"},
		{`"spec": {`, `"spec": {"nodeName": "",`, "nodeName kept"},
		{`"spec": {`, `"spec": {"serviceAccountName": "default",`, "serviceAccountName kept"},
		{`"spec": {`, `"spec": {"priority": 0,`, "priority kept"},
		{`"volumes": [`, `"volumes": [{"name": "token", "projected": {"sources": []}},`, "volume token kept"},
		{`"volumes": [`, `"volumes": [{"name": "s", "secret": {"secretName": "x"}},`, "volume s kept"},
		{`, "--retire-file=/run/retire"`, ``, "no --retire-file"},
		{`{"name": "proxy"`, `{"name": "sidecar"`, "no proxy container"},
	} {
		s := strings.Replace(checkpoint, c.from, c.to, 1)
		if p := checkpointProblems(t, s); !reflect.DeepEqual(p, []string{c.want}) {
			t.Errorf("%s: problems %q, want %q", c.want, p, c.want)
		}
	}
	p := decode[corev1.Pod](t, checkpoint)
	if got := FlagValues(p, "kube-apiserver", "--etcd-servers"); !reflect.DeepEqual(got, []string{"https://127.0.0.1:2379"}) {
		t.Errorf("FlagValues = %q", got)
	}
	if got := FlagValues(p, "kube-apiserver", "--etcd"); got != nil {
		t.Errorf("FlagValues of a prefix of a flag = %q, want none", got)
	}
}

func TestAtLeast(t *testing.T) {
	for _, c := range []struct {
		major, minor string
		want         bool
	}{{"1", "36", true}, {"1", "37+", true}, {"1", "35", false}, {"2", "0", true}, {"0", "99", false}} {
		if got, err := AtLeast(c.major, c.minor, "1.36"); err != nil || got != c.want {
			t.Errorf("AtLeast(%s, %s, 1.36) = %v, %v; want %v", c.major, c.minor, got, err, c.want)
		}
	}
	if _, err := AtLeast("1", "x", "1.36"); err == nil {
		t.Errorf("AtLeast of minor x: no error")
	}
}
