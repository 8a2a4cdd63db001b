package node

import (
	"os"
	"path/filepath"
	"testing"
)

// A fake /proc: one proxy with two workers (one at the kernel's slice), another process.
func TestProxySlices(t *testing.T) {
	proc := t.TempDir()
	write := func(path, body string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(proc, path)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, path), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	sched := func(slice string) string {
		return "kube-apiserver- (7, #threads: 3)\n----\nse.exec_start : 1.0\nse.slice : " + slice + "\nse.nr_migrations : 0\n"
	}
	write("7/cmdline", "/kube-apiserver-proxy\x00run\x00--listen=:6443\x00")
	write("7/task/7/comm", "kube-apiserver-\n")
	write("7/task/7/sched", sched("3000000"))
	write("7/task/8/comm", "worker-0\n")
	write("7/task/8/sched", sched("100000"))
	write("7/task/9/comm", "worker-1\n")
	write("7/task/9/sched", sched("3000000"))
	write("9/cmdline", "/kube-apiserver-proxy\x00kubeadm-sync\x00")
	write("12/cmdline", "kube-apiserver\x00--etcd-servers=x\x00")
	got, err := ProxySlices(proc)
	if err != nil || len(got) != 1 || got[0].PID != 7 || len(got[0].Workers) != 2 ||
		got[0].Workers["worker-0"] != 100000 || got[0].Workers["worker-1"] != 3000000 {
		t.Fatalf("ProxySlices: %+v %v", got, err)
	}
	if _, bad := sliceVerdict(got); len(bad) != 1 || bad[0] != "pid 7 worker-1: 3000000 ns" {
		t.Fatalf("a worker at the kernel's slice must be named: %q", bad)
	}
	if _, bad := sliceVerdict([]ProxySlice{{PID: 3, Workers: map[string]int64{"worker-0": 100000}}}); len(bad) != 0 {
		t.Fatalf("all at the default: %q", bad)
	}
	if _, bad := sliceVerdict([]ProxySlice{{PID: 3, Workers: map[string]int64{}}}); len(bad) != 1 {
		t.Fatalf("a proxy without workers must be named: %q", bad)
	}
	write("7/task/9/sched", "no slice here\n")
	if _, err := ProxySlices(proc); err == nil {
		t.Fatal("a worker without se.slice must be an error, not a pass")
	}
}
