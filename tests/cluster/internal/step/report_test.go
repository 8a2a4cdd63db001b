package step

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

const report = `{"load": {"duration_ns": 61234000000,
  "requests": {"get": {"ok": 100, "failed": 2}, "list": {"ok": 50, "failed": 0}},
  "informers": {"configmaps": {"relists": 1}, "secrets": {"relists": 2}},
  "streams": {"cut": {"eof": 3}}},
 "probes": [{"address": "192.0.2.10:6443", "refused": 4, "timeouts": 1, "other": {"reset": 2}},
  {"address": "127.0.0.1:6443", "refused": 1, "timeouts": 0}],
 "pods": [{"selector": "kube-system/component=kube-apiserver", "most_at_once": 2},
  {"selector": "kube-system/k8s-app=kube-proxy", "most_at_once": 3}],
 "tcp": {}, "problems": ["4 refused", "1 timed out"]}`

func read(t *testing.T, s string) *Report {
	t.Helper()
	path := filepath.Join(t.TempDir(), "step.json")
	if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestReport(t *testing.T) {
	r := read(t, report)
	if got := r.Refused(); got != 5 {
		t.Errorf("Refused = %d, want 5", got)
	}
	if got := r.ProbeFailures(); got != 8 {
		t.Errorf("ProbeFailures = %d, want 8", got)
	}
	if got := r.MostPodsAtOnce("kube-apiserver"); got != 2 {
		t.Errorf("MostPodsAtOnce(kube-apiserver) = %d, want 2", got)
	}
	if got := r.MostPodsAtOnce("etcd"); got != 0 {
		t.Errorf("MostPodsAtOnce(etcd) = %d, want 0", got)
	}
	if got, err := r.Line(); err != nil || got != "61.2 152 2 5 8 3 3 4 refused; 1 timed out" {
		t.Errorf("Line = %q, %v", got, err)
	}
	clean := read(t, `{"load": {"duration_ns": 1000000000, "requests": {}}, "tcp": {}, "problems": []}`)
	if got, err := clean.Line(); err != nil || got != "1.0 0 0 0 0 0 0 none" {
		t.Errorf("Line of a clean report = %q, %v", got, err)
	}
	if _, err := read(t, `{"probes": [], "tcp": {}, "problems": []}`).Line(); err == nil {
		t.Errorf("Line of a report without load: no error")
	}
	var back map[string]any
	if b, err := json.Marshal(r); err != nil || json.Unmarshal(b, &back) != nil || back["problems"] == nil {
		t.Errorf("the report does not round-trip: %v", err)
	}
}
