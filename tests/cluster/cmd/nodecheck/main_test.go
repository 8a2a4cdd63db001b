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
		{[]string{"pod-listed", "etcd-n"}, pods, "", ""},
		{[]string{"pod-listed", "etcd"}, pods, "", "no"},
		{[]string{"pod-running", "etcd-n"}, pods, "", ""},
		{[]string{"pod-ip", "etcd-n"}, pods, "192.0.2.10\n", ""},
		{[]string{"pod-ip", "absent"}, pods, "", ""},
		// What a failed curl gives: nothing, which is a "no" with a message.
		{[]string{"pod-listed", "etcd-n"}, "", "", "reading a pod list"},
		{[]string{"pod-ready"}, `{"status": {"conditions": [{"type": "Ready", "status": "False"}]}}`, "", "no"},
		{[]string{"git-version"}, `{"gitVersion": "v1.36.3"}`, "v1.36.3\n", ""},
		{[]string{"git-version"}, `{"clientVersion": {"gitVersion": "v1.37.1"}, "serverVersion": {"gitVersion": "v1.37.2"}}`, "v1.37.2\n", ""},
		{[]string{"git-version"}, `{"clientVersion": {"gitVersion": "v1.37.1"}}`, "", "no gitVersion"},
		{[]string{"kubectl-at-least", "1.36"}, `{"clientVersion": {"major": "1", "minor": "35"}}`, "", "no"},
		{[]string{"arg-index", "--etcd-servers="}, `{"spec": {"template": {"spec": {"containers": [{"args": ["--a", "--etcd-servers=x"]}]}}}}`, "1\n", ""},
		{[]string{"arg-index", "--b="}, `{"spec": {"template": {"spec": {"containers": [{"args": ["--a"]}]}}}}`, "", "no argument --b="},
		{[]string{"etcd-value"}, `{"kvs": [{"value": "azhzOmVuYzphZXNjYmM6djE6a2V5MToAAQI="}]}`, "b'k8s:enc:aescbc:v1:key1:\\x00'\n", ""},
		{[]string{"etcd-value"}, `{}`, "none\n", ""},
		{[]string{"replace-image-tag", "v3.6.16", "v3.7.0"}, `{"kind": "ConfigMap", "data": {"ClusterConfiguration": "etcd:\n  local:\n    imageTag: v3.6.16\n"}}`,
			`{"data":{"ClusterConfiguration":"etcd:\n  local:\n    imageTag: v3.7.0\n"},"kind":"ConfigMap"}` + "\n", ""},
		{[]string{"prom", "values"}, `{"data": {"result": [{"value": [1, "1"]}]}}`, "1\n", ""},
		{[]string{"prom", "targets-up"}, `{"data": {"activeTargets": [{"health": "down"}]}}`, "", "no"},
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
