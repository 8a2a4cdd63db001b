package node

import (
	"strings"
	"testing"
)

// Each connection failure toward an apiserver address fails; another peer's, a line without
// one, and the tolerated kinds do not.
func TestConnectionErrors(t *testing.T) {
	addrs := []string{"192.0.2.10:6443", "127.0.0.1:6443", "10.96.0.1:443"}
	lines := []string{
		`kubelet: E1205 06:00:00.000000 1 reflector.go:200] "Failed to watch" err="Get \"https://192.0.2.10:6443/api/v1/pods?watch=true\": dial tcp 192.0.2.10:6443: connect: connection refused"`,
		`kube-controller-manager: E1205 06:00:00.000000 1 leaderelection.go:1] error retrieving resource lock: Get "https://192.0.2.10:6443/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kube-controller-manager": read tcp 192.0.2.10:40000->192.0.2.10:6443: read: connection reset by peer`,
		`kube-scheduler: E1205 06:00:00.000000 1 reflector.go:1] "Unhandled Error" err="watch of *v1.Pod ended with: an error on the server (\"unable to decode an event from the watch stream: http2: client connection lost\")"`,
		`kube-proxy: E1205 06:00:00.000000 1 reflector.go:1] err="Get \"https://10.96.0.1:443/api/v1/services\": net/http: TLS handshake timeout"`,
		`kubelet: E1205 06:00:00.000000 1 event.go:1] "Unable to write event" err="Post \"https://192.0.2.10:6443/api/v1/namespaces/kube-system/events\": unexpected EOF"`,
		// Not the apiserver: containerd's socket, another port, an unrelated error.
		`kubelet: E1205 06:00:00.000000 1 remote_runtime.go:1] "ListPodSandbox" err="rpc error: code = Unavailable desc = connection error: desc = \"transport: Error while dialing: dial unix /run/containerd/containerd.sock: connect: connection refused\""`,
		`kubelet: E1205 06:00:00.000000 1 prober.go:1] err="Get \"http://127.0.0.1:10257/healthz\": dial tcp 127.0.0.1:10257: connect: connection refused"`,
		`kubelet: E1205 06:00:00.000000 1 server.go:1] err="Get \"https://127.8.9.10:6443/readyz\": dial tcp 127.8.9.10:6443: connect: connection refused"`,
		`kube-controller-manager: E1205 06:00:00.000000 1 replica_set.go:1] "Unhandled Error" err="sync failed with read version: 5 is not as new as written version: 6"`,
		`kubelet: E1205 23:43:37.316443 9627 remote_runtime.go:724] "ExecSync cmd from runtime service failed" err="rpc error: code = Unknown desc = failed to exec in container: failed to start exec \"26b6\": OCI runtime exec failed: exec failed: unable to start container process: error writing config to pipe: write init-p: broken pipe" containerID="26b6"`,
		// Tolerated: the client's own close.
		`kubelet: E1205 06:00:00.000000 1 event.go:1] "Unable to write event" err="Post \"https://192.0.2.10:6443/api/v1/namespaces/kube-system/events\": read tcp 192.0.2.10:1->192.0.2.10:6443: use of closed network connection"`,
	}
	failing, allowed := ConnectionErrors(lines, addrs)
	if len(failing) != 5 {
		t.Errorf("failing: %d lines, want the first 5:\n%s", len(failing), strings.Join(failing, "\n"))
	}
	for i, f := range failing {
		if !strings.Contains(lines[i], f[:40]) {
			t.Errorf("failing[%d] = %q, want line %d", i, f, i)
		}
	}
	if len(allowed) != 1 || !strings.Contains(allowed[0], "tolerated: Go's error for a read or write on a connection the process closed itself") {
		t.Errorf("allowed: %q", allowed)
	}
}
