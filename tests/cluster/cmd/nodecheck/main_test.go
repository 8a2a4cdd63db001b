package main

import (
	"bytes"
	"strings"
	"testing"
)

// The subcommands as the scripts call them: what they print, and their verdict (nil: yes).
func TestRun(t *testing.T) {
	const pods = `{"items": [{"metadata": {"name": "etcd-n"}, "status": {"phase": "Running", "podIP": "192.0.2.10"}}]}`
	for _, c := range []struct {
		args    []string
		in      string
		out     string
		verdict string // "" yes, "no", or the start of the error
	}{
		{[]string{"pod-ip", "etcd-n"}, pods, "192.0.2.10\n", ""},
		{[]string{"pod-ip", "absent"}, pods, "", ""},
		{[]string{"pod-ready-prefix", "etcd"}, pods, "", "no"},
		{[]string{"pods"}, pods, "etcd-n - Running\n", ""},
		// What a failed curl gives: nothing, which is a "no" with a message.
		{[]string{"pod-ip", "etcd-n"}, "", "", "reading a pod list"},
		{[]string{"pod-ready"}, `{"status": {"conditions": [{"type": "Ready", "status": "False"}]}}`, "", "no"},
		{[]string{"kubectl-at-least", "1.36"}, `{"clientVersion": {"major": "1", "minor": "35"}}`, "", "no"},
		{[]string{"kubectl-at-least", "1.36"}, `{"clientVersion": {"major": "1", "minor": "37"}}`, "", ""},
		{[]string{"rollout-done"}, `{"spec": {"replicas": 1}, "status": {"replicas": 1}}`, "", "no"},
		{[]string{"node-ready"}, `{"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"}]}}`, "True KubeletReady: ok\n", ""},
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
