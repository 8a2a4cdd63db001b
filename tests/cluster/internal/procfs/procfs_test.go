package procfs

import (
	"os"
	"slices"
	"testing"
)

// This process is among the real /proc's, under its own name; its threads under its task
// directory.
func TestPidsAndComm(t *testing.T) {
	self := os.Getpid()
	ps, err := Pids("/proc")
	if err != nil || !slices.Contains(ps, self) || !slices.IsSorted(ps) {
		t.Fatalf("Pids: %d not among %v (%v)", self, ps, err)
	}
	if name, err := Comm("/proc", self); err != nil || name == "" {
		t.Fatalf("Comm: %q %v", name, err)
	}
	tasks, err := Pids("/proc/self/task")
	if err != nil || !slices.Contains(tasks, self) {
		t.Fatalf("threads: %v %v", tasks, err)
	}
	if _, err := Comm("/proc", -1); err == nil {
		t.Fatal("no such process: an error")
	}
}
