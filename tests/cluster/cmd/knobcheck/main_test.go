package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// knobcheck (built by smoke) builds and refuses with exit status 1.
func TestKnobcheck(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a binary")
	}
	cmd := exec.Command("go", "run", ".", "-repo", "../../../..", "migrate")
	cmd.Env = append(os.Environ(), "CI=true", "IMAGE_CHANGE=0")
	out, err := cmd.Output()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.HasPrefix(string(out), "FAIL - CI is set: IMAGE_CHANGE=\"0\" is refused") {
		t.Fatalf("knobcheck: %v: %s", err, out)
	}
}
