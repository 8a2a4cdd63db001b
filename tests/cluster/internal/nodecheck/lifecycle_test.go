package nodecheck

import (
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func TestAPIServerPods(t *testing.T) {
	l := decode[corev1.PodList](t, `{"items": [
	  {"metadata": {"name": "kube-apiserver-n", "ownerReferences": [{"kind": "Node", "name": "n"}]},
	   "status": {"containerStatuses": [{"ready": true}]}},
	  {"metadata": {"name": "kube-apiserver-a"}, "spec": {"nodeName": "n"},
	   "status": {"containerStatuses": [{"ready": true, "restartCount": 1}, {"ready": true, "restartCount": 2}]}},
	  {"metadata": {"name": "kube-apiserver-b", "deletionTimestamp": "2026-12-03T13:00:00Z"},
	   "status": {"containerStatuses": [{"ready": true}]}},
	  {"metadata": {"name": "kube-apiserver-c"}, "spec": {"nodeName": "n"},
	   "status": {"containerStatuses": [{"ready": true}, {"ready": false}]}}]}`)
	want := []string{"kube-apiserver-a ready 3 - n", "kube-apiserver-b notready 0 deleting -", "kube-apiserver-c notready 0 - n"}
	if got := APIServerPods(l); !reflect.DeepEqual(got, want) {
		t.Errorf("APIServerPods = %q, want %q", got, want)
	}
}

func TestEventSummary(t *testing.T) {
	l := decode[corev1.EventList](t, `{"items": [
	  {"involvedObject": {"name": "kube-apiserver-a"}, "message": "Readiness probe failed: HTTP 500 at 10.0.0.1", "count": 2},
	  {"involvedObject": {"name": "kube-apiserver-b"}, "message": "Startup probe failed"},
	  {"involvedObject": {"name": "kube-apiserver-c"}, "message": "Readiness probe failed: HTTP 503 at 10.0.0.2"},
	  {"involvedObject": {"name": "etcd-n"}, "message": "Readiness probe failed: HTTP 500"}]}`)
	if got, want := EventSummary(l, "kube-apiserver-"), "3 x Readiness probe failed: HTTP N at N.N.N.N; 1 x Startup probe failed"; got != want {
		t.Errorf("EventSummary = %q, want %q", got, want)
	}
	if got := EventSummary(l, "absent-"); got != "none" {
		t.Errorf("EventSummary without events = %q", got)
	}
	long := decode[corev1.EventList](t, `{"items": [{"involvedObject": {"name": "p"}, "message": "`+strings.Repeat("é", 200)+`"}]}`)
	if got := EventSummary(long, "p"); got != "1 x "+strings.Repeat("é", 140) {
		t.Errorf("EventSummary of a long message = %q", got)
	}
}

func TestPromAnswer(t *testing.T) {
	q := decode[PromAnswer](t, `{"data": {"result": [
	  {"metric": {"alertname": "B"}, "value": [1764766800.1, "1"], "values": [[1764766800.9, "0"], [1764766805, "0"]]},
	  {"metric": {}, "value": [1764766800.1, "2"]}]}}`)
	if got := q.Values(); got != "1 2" {
		t.Errorf("Values = %q", got)
	}
	if got := q.AlertNames(); got != "? B" {
		t.Errorf("AlertNames = %q", got)
	}
	if got := q.Times(); got != "13:00:00 13:00:05" {
		t.Errorf("Times = %q", got)
	}
	empty := decode[PromAnswer](t, `{"data": {"result": []}}`)
	if empty.Values() != "none" || empty.AlertNames() != "none" || empty.Times() != "none" {
		t.Errorf("an empty answer is not none: %q %q %q", empty.Values(), empty.AlertNames(), empty.Times())
	}
	targets := decode[PromAnswer](t, `{"data": {"activeTargets": [{"labels": {"job": "j"}, "health": "up"}]}}`)
	if !targets.OneTargetUp() {
		t.Errorf("one target up: OneTargetUp is false")
	}
	for _, s := range []string{
		`{"data": {"activeTargets": [{"health": "down", "lastError": "refused"}]}}`,
		`{"data": {"activeTargets": [{"health": "up"}, {"health": "up"}]}}`,
		`{"data": {"activeTargets": []}}`,
	} {
		if decode[PromAnswer](t, s).OneTargetUp() {
			t.Errorf("%s: OneTargetUp is true", s)
		}
	}
}

func TestPodTargets(t *testing.T) {
	pods := decode[corev1.PodList](t, `{"items": [
	  {"metadata": {"name": "kube-apiserver-a", "namespace": "kube-system"}, "spec": {"nodeName": "n",
	    "initContainers": [{"name": "setup"}], "containers": [{"name": "kube-apiserver"}, {"name": "proxy"}]},
	   "status": {"podIP": "192.0.2.10", "phase": "Running"}},
	  {"metadata": {"name": "pending"}, "spec": {"containers": [{"name": "c"}]}}]}`)
	g := PodTargets(pods.Items)
	if len(g) != 3 {
		t.Fatalf("PodTargets: %d groups, want 3 (a pod without IP has none): %+v", len(g), g)
	}
	if g[0].Labels["__meta_kubernetes_pod_container_init"] != "true" || g[2].Labels["__meta_kubernetes_pod_container_name"] != "proxy" ||
		g[2].Targets[0] != "192.0.2.10" || g[2].Labels["__meta_kubernetes_pod_phase"] != "Running" {
		t.Errorf("PodTargets = %+v", g)
	}
}

const monitoring = `apiVersion: monitoring.coreos.com/v1
kind: PodMonitor
metadata: {name: kube-apiserver-proxy, namespace: kube-system}
spec:
  selector: {matchLabels: {component: kube-apiserver}}
  podMetricsEndpoints:
  - path: /metrics
    relabelings:
    - {action: keep, sourceLabels: [__meta_kubernetes_pod_container_name], regex: proxy}
---
apiVersion: monitoring.coreos.com/v1
kind: PodMonitor
metadata: {name: second, namespace: kube-system}
spec: {selector: {matchLabels: {x: y}}, podMetricsEndpoints: [{}]}
---
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata: {name: rules}
spec: {groups: [{name: g, rules: [{alert: A, expr: up == 0, for: 5m}]}]}
`

func TestPromConfig(t *testing.T) {
	f, err := PromConfig(strings.NewReader(monitoring), "/state")
	if err != nil {
		t.Fatal(err)
	}
	cfg := string(f.Config)
	for _, want := range []string{"replacement: kube-system/kube-apiserver-proxy", "source_labels:\n    - __meta_kubernetes_pod_container_name",
		"regex: proxy", "- /state/rules.yaml", "- /state/sd.json", "metrics_path: /metrics"} {
		if !strings.Contains(cfg, want) {
			t.Errorf("the configuration does not say %q:\n%s", want, cfg)
		}
	}
	if strings.Contains(cfg, "sourceLabels") {
		t.Errorf("the configuration keeps the operator's sourceLabels:\n%s", cfg)
	}
	if string(f.Selector) != `{"component":"kube-apiserver"}` || !strings.Contains(string(f.Rules), "alert: A") {
		t.Errorf("selector %s, rules %s", f.Selector, f.Rules)
	}
	// The control copy: renamed, no `for`, the same expression.
	if !strings.Contains(string(f.Rules), "- name: controls\n  rules:\n  - alert: ControlA\n    expr: up == 0\n") {
		t.Errorf("no control copy of alert A in the rules:\n%s", f.Rules)
	}
	if _, controls, _ := strings.Cut(string(f.Rules), "name: controls"); strings.Contains(controls, "for:") {
		t.Errorf("the control copy keeps a for:\n%s", f.Rules)
	}
	if _, err := PromConfig(strings.NewReader("kind: PodMonitor\n"), "/state"); err == nil {
		t.Errorf("manifests without a PrometheusRule: no error")
	}
}
