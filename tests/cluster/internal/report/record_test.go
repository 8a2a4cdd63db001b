package report

import (
	"bytes"
	"reflect"
	"testing"
)

// The smoke format: what tests/cluster/node/smoke counts ("ok   - ", "FAIL - ") and prints.
func TestRecordWritesTheSmokeFormat(t *testing.T) {
	var out bytes.Buffer
	r := NewRecord(&out)
	r.Pass("one %d", 1)
	r.Fail("two\nlines")
	r.WriteLine("@node reboot")
	r.Note("a note")
	if !r.Check(true, "held") || r.Check(false, "did not") {
		t.Fatal("Check does not return its verdict")
	}
	want := "ok   - one 1\nFAIL - two lines\n@node reboot\n# a note\nok   - held\nFAIL - did not\n"
	if got := out.String(); got != want {
		t.Fatalf("written: %q, want %q", got, want)
	}
	if r.Passed() != 2 || r.Failed() != 2 {
		t.Fatalf("passed %d, failed %d", r.Passed(), r.Failed())
	}
}

func TestRecordKeeps(t *testing.T) {
	var r Record
	r.Fail("lost %d", 3)
	r.Note("a figure")
	r.Pass("fine")
	r.Fail("cut")
	if got := r.Failures(); !reflect.DeepEqual(got, []string{"lost 3", "cut"}) {
		t.Errorf("Failures: %q", got)
	}
	if got := r.Notes(); !reflect.DeepEqual(got, []string{"a figure"}) {
		t.Errorf("Notes: %q", got)
	}
	var none Record
	if none.Failures() != nil || none.Failed() != 0 {
		t.Error("an empty record has failures")
	}
}
