package node

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeCtr is a Scenario whose bins/ctr is a script: on a cgroup v1 host the real one writes
// a deprecation warning on stderr before it answers.
func fakeCtr(t *testing.T, script string) *Scenario {
	t.Helper()
	state := t.TempDir()
	if err := os.MkdirAll(filepath.Join(state, "bins"), 0o755); err != nil {
		t.Fatal(err)
	}
	body := "#!/bin/sh\necho 'level=warning msg=\"DEPRECATION: cgroup v1\"' >&2\n" + script
	if err := os.WriteFile(filepath.Join(state, "bins", "ctr"), []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	return &Scenario{Config: Config{State: state}, Ctx: context.Background()}
}

// The runtime's answers are read from ctr's stdout alone: a warning on stderr is no task and
// no part of a container's JSON.
func TestCtrReadsStdoutOnly(t *testing.T) {
	n := fakeCtr(t, `case "$5 $6" in
"tasks ls") printf 'TASK PID STATUS\nc1 10 RUNNING\nc2 11 STOPPED\n' ;;
"containers info") printf '{"Image": "localhost/x:1", "Labels": {"io.kubernetes.pod.name": "p"}}\n' ;;
esac
`)
	ids, err := n.runningTasks()
	if err != nil || strings.Join(ids, " ") != "c1" {
		t.Fatalf("running tasks: %v %v", ids, err)
	}
	image, labels, err := n.containerInfo("c1")
	if err != nil || image != "localhost/x:1" || labels["io.kubernetes.pod.name"] != "p" {
		t.Fatalf("container info: %q %v %v", image, labels, err)
	}
	if !n.imageRunning("localhost/x:1") || n.imageGone("localhost/x:1") || !n.imageGone("localhost/y:1") {
		t.Fatal("image checks")
	}
}

// An answer that is not a container's JSON is an error, never "not that image": a check that
// waits for a container to be gone must not pass on an unreadable runtime.
func TestUnreadableContainerIsNotGone(t *testing.T) {
	n := fakeCtr(t, `case "$5 $6" in
"tasks ls") printf 'TASK PID STATUS\nc1 10 RUNNING\n' ;;
"containers info") echo 'not json' ;;
esac
`)
	if _, _, err := n.containerInfo("c1"); err == nil {
		t.Fatal("garbage read as a container")
	}
	if n.imageGone("localhost/x:1") || n.imageRunning("localhost/x:1") {
		t.Fatal("an unreadable runtime says nothing about an image")
	}
	r := &reboot{Scenario: n}
	if _, ok := r.checkpointTasks(); ok {
		t.Fatal("checkpointTasks read an unreadable runtime as an answer")
	}
}
