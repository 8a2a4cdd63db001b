package node

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"kube-apiserver-proxy/tests/cluster/internal/procfs"
)

// workerSlice is the scheduling slice the proxy's worker threads ask for by default
// (`--worker-slice`, 100 µs), in nanoseconds as /proc/PID/task/TID/sched shows it.
const workerSlice = 100_000

// CheckWorkerSlices checks that the worker threads of every proxy running on the node
// (`/kube-apiserver-proxy run`, the Deployment's sidecar under the RuntimeDefault seccomp
// profile) run with the slice `--worker-slice` asks for by default: the profile must let
// sched_setattr through, and the proxy logs it only at debug level when it works.
func (n *Scenario) CheckWorkerSlices(when string) bool {
	procs, err := ProxySlices("/proc")
	switch {
	case err != nil:
		return n.Check(false, "%s: the proxies' worker slices: %v", when, err)
	case len(procs) == 0:
		return n.Check(false, "%s: the proxies' worker slices: no `kube-apiserver-proxy run` process on the node", when)
	}
	seen, bad := sliceVerdict(procs)
	return n.Check(len(bad) == 0, "%s: every proxy's worker threads run with the %d ns slice of --worker-slice's default (%s)%s",
		when, workerSlice, strings.Join(seen, "; "), failures(bad))
}

// sliceVerdict is, per proxy, its worker count (seen) and each worker or proxy that is not at
// the default slice (bad).
func sliceVerdict(procs []ProxySlice) (seen, bad []string) {
	for _, p := range procs {
		seen = append(seen, fmt.Sprintf("pid %d: %d workers", p.PID, len(p.Workers)))
		if len(p.Workers) == 0 {
			bad = append(bad, fmt.Sprintf("pid %d has no worker thread", p.PID))
		}
		for name, slice := range p.Workers {
			if slice != workerSlice {
				bad = append(bad, fmt.Sprintf("pid %d %s: %d ns", p.PID, name, slice))
			}
		}
	}
	return seen, bad
}

func failures(bad []string) string {
	if len(bad) == 0 {
		return ""
	}
	return ": " + strings.Join(bad, "; ")
}

// ProxySlice is one proxy process and the slices of its worker threads, by thread name.
type ProxySlice struct {
	PID     int
	Workers map[string]int64
}

// ProxySlices finds the `kube-apiserver-proxy run` processes under proc and reads each worker
// thread's se.slice; an error when a worker's sched file shows none (a kernel before EEVDF's
// slices, 6.12).
func ProxySlices(proc string) ([]ProxySlice, error) {
	ps, err := procfs.Pids(proc)
	if err != nil {
		return nil, err
	}
	var out []ProxySlice
	for _, pid := range ps {
		cmdline, err := os.ReadFile(fmt.Sprintf("%s/%d/cmdline", proc, pid))
		argv := strings.Split(string(cmdline), "\x00")
		if err != nil || len(argv) < 2 || filepath.Base(argv[0]) != "kube-apiserver-proxy" || argv[1] != "run" {
			continue
		}
		p := ProxySlice{PID: pid, Workers: map[string]int64{}}
		task := fmt.Sprintf("%s/%d/task", proc, pid)
		threads, _ := procfs.Pids(task)
		for _, tid := range threads {
			name, err := procfs.Comm(task, tid)
			if err != nil || !strings.HasPrefix(name, "worker-") {
				continue
			}
			sched, err := os.ReadFile(fmt.Sprintf("%s/%d/sched", task, tid))
			if err != nil {
				continue // gone meanwhile
			}
			slice, ok := schedSlice(string(sched))
			if !ok {
				return nil, fmt.Errorf("pid %d %s: no se.slice in its sched file (a kernel before 6.12?)", pid, name)
			}
			p.Workers[name] = slice
		}
		out = append(out, p)
	}
	return out, nil
}

// schedSlice is the se.slice line's value of a /proc/PID/task/TID/sched file.
func schedSlice(sched string) (int64, bool) {
	for _, line := range strings.Split(sched, "\n") {
		if rest, ok := strings.CutPrefix(line, "se.slice"); ok {
			v, err := strconv.ParseInt(strings.TrimSpace(strings.TrimLeft(rest, " :")), 10, 64)
			return v, err == nil
		}
	}
	return 0, false
}
