package main

import (
	"bytes"
	"strings"
	"testing"
)

// The subcommands as the scripts call them: what they print, and their verdict (nil: yes).
func TestRun(t *testing.T) {
	for _, c := range []struct {
		args    []string
		in      string
		out     string
		verdict string // "" yes, "no", or the start of the error
	}{
		{[]string{"kubectl-at-least", "1.36"}, `{"clientVersion": {"major": "1", "minor": "35"}}`, "", "no"},
		{[]string{"kubectl-at-least", "1.36"}, `{"clientVersion": {"major": "1", "minor": "37"}}`, "", ""},
		{[]string{"kubectl-at-least"}, "", "", "want MAJOR.MINOR"},
		// What a failed kubectl gives: nothing, which is a "no" with a message.
		{[]string{"kubectl-at-least", "1.36"}, "", "", "reading kubectl's version"},
		// The host subcommands' bad usages (host_test.go runs them for real).
		{[]string{"cgroup-make"}, "", "", "want ROOT"},
		{[]string{"cgroup-make", "kap-node-smoke-1"}, "", "", "ROOT must be a clean absolute path"},
		{[]string{"cgroup-make", "/a/../b"}, "", "", "ROOT must be a clean absolute path"},
		{[]string{"cgroup-make", "/"}, "", "", "ROOT must be a clean absolute path"},
		{[]string{"cgroup-remove", "120"}, "", "", "want SECONDS MINDEPTH DIR..."},
		{[]string{"cgroup-remove", "1.5", "0", "/x"}, "", "", "want SECONDS MINDEPTH DIR..."},
		{[]string{"cgroup-remove", "1", "-1", "/x"}, "", "", "want SECONDS MINDEPTH DIR..."},
		{[]string{"processes"}, "", "", "want GLOB..."},
		{[]string{"processes", "kubelet", "[runc"}, "", "", "bad GLOB"},
		{[]string{"host-leaks", "net:[1]"}, "", "", "want NETNS STATE"},
		{[]string{"host-leaks", "", ""}, "", "", "STATE must not be empty"},
		// The JSON checks the scenarios make in Go now.
		{[]string{"pod-ready"}, "{}", "", "unknown subcommand"},
		{[]string{"pods"}, "{}", "", "unknown subcommand"},
		{[]string{"rollout-done"}, "{}", "", "unknown subcommand"},
		{[]string{"no-such-check"}, "", "", "unknown subcommand"},
	} {
		var out bytes.Buffer
		err := run(c.args[0], c.args[1:], strings.NewReader(c.in), &out)
		got := ""
		switch {
		case err == errNo:
			got = "no"
		case err != nil:
			got = err.Error()
		}
		if !strings.HasPrefix(got, c.verdict) || (c.verdict == "") != (err == nil) || out.String() != c.out {
			t.Errorf("%v: printed %q, verdict %q; want %q, %q", c.args, out.String(), got, c.out, c.verdict)
		}
	}
}
