package scenario

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"
)

// A scenario's checks are its Record; the results file keeps "passed", "problems" and
// "notes", and the rehearsal's lines keep their form.
func TestResultSaysItsRecord(t *testing.T) {
	r := &Result{Name: "steady", Duration: 31 * time.Second}
	r.Fail("lost %d requests", 2)
	r.Note("a figure")
	r.Passed = r.Failed() == 0
	raw, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Name     string   `json:"name"`
		Passed   bool     `json:"passed"`
		Problems []string `json:"problems"`
		Notes    []string `json:"notes"`
	}
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatal(err)
	}
	if got.Name != "steady" || got.Passed || len(got.Problems) != 1 || got.Problems[0] != "lost 2 requests" || len(got.Notes) != 1 || got.Notes[0] != "a figure" {
		t.Fatalf("results JSON: %s", raw)
	}
	var out bytes.Buffer
	printResult(&out, r)
	if want := "FAIL steady (31s)\n    lost 2 requests\n    note: a figure\n"; out.String() != want {
		t.Fatalf("printed %q, want %q", out.String(), want)
	}
	clean := &Result{Name: "setup", Passed: true}
	if raw, _ := json.Marshal(clean); bytes.Contains(raw, []byte("problems")) || !bytes.Contains(raw, []byte(`"passed":true`)) {
		t.Fatalf("a clean result: %s", raw)
	}
}
