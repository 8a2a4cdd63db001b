package main

import (
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/procfs"
)

// The host's trees; the functions below take them as arguments so that tests can give fake
// ones.
const (
	procRoot   = "/proc"
	cgroupRoot = "/sys/fs/cgroup"
)

// pollEvery is how often cgroup-remove looks again at the cgroups still there.
const pollEvery = 200 * time.Millisecond

// hostCommands are the host subcommands: the loops over /proc and the cgroup hierarchies smoke
// makes while it sets up and tears down the node.
//
// cgroup-make ROOT: for each hierarchy under /sys/fs/cgroup with a cgroup.procs file, prints
// the topmost directory of HIERARCHY/ROOT that does not exist yet (HIERARCHY/ROOT itself when
// it does), for the caller to remove afterwards; then, in a v1 hierarchy, creates
// HIERARCHY/ROOT, and in the cpuset one gives each new level its parent's cpus and memory
// nodes. A v2 hierarchy (cgroup.controllers; hybrid mode's /sys/fs/cgroup/unified) is left to
// runc, which creates the path itself.
//
// cgroup-remove SECONDS MINDEPTH DIR...: every cgroup directory below each DIR (DIR itself too
// with MINDEPTH 0) removed, deepest first, each once no process is left in it: a process just
// killed leaves its cgroup only when it has exited, which takes seconds on a loaded machine.
// Polls every 200 ms until every one is gone or SECONDS have passed. A DIR that does not exist
// has nothing to remove. Prints the seconds it took ("3.4"); when some are left (exit status
// 1), a second line says why, "DIR: PID (COMM) PID (COMM); " for each with processes and
// "DIR: no process; rmdir: REASON; " for each empty one rmdir refuses; one with
// subdirectories and no process is left out (its children say why).
//
// processes GLOB...: "PID:COMM " for each process whose name (comm) matches a GLOB (path.Match)
// and that is not a zombie, on one line; nothing when there is none.
//
// host-leaks NETNS STATE: "pid PID (COMM) in the test netns; " for each process whose network
// namespace (the link /proc/PID/ns/net) is NETNS, when NETNS is not empty, else
// "pid PID (COMM) mentions the state dir; " for each whose command line contains STATE; on
// one line, nothing when there is none.
//
// processes and host-leaks leave nodecheck's own process out: its command line names STATE.
var hostCommands = map[string]func(a []string, out io.Writer) error{
	"cgroup-make":   cgroupMakeCommand,
	"cgroup-remove": cgroupRemoveCommand,
	"processes":     processesCommand,
	"host-leaks":    hostLeaksCommand,
}

func cgroupMakeCommand(a []string, out io.Writer) error {
	if err := args(a, 1, "ROOT"); err != nil {
		return err
	}
	if root := a[0]; !path.IsAbs(root) || path.Clean(root) != root || root == "/" {
		return usageError("ROOT must be a clean absolute path other than /, not " + strconv.Quote(root))
	}
	return cgroupMake(cgroupRoot, a[0], out)
}

func cgroupRemoveCommand(a []string, out io.Writer) error {
	const want = "want SECONDS MINDEPTH DIR... (SECONDS and MINDEPTH whole numbers)"
	if len(a) < 2 {
		return usageError(want)
	}
	secs, err1 := strconv.Atoi(a[0])
	mindepth, err2 := strconv.Atoi(a[1])
	if err1 != nil || err2 != nil || secs < 0 || mindepth < 0 {
		return usageError(want)
	}
	return cgroupRemove(procRoot, a[2:], mindepth, time.Duration(secs)*time.Second, out)
}

func processesCommand(a []string, out io.Writer) error {
	if len(a) == 0 {
		return usageError("want GLOB...")
	}
	for _, g := range a {
		if _, err := path.Match(g, ""); err != nil {
			return usageError("bad GLOB " + strconv.Quote(g))
		}
	}
	found, err := processes(procRoot, a, os.Getpid())
	printLine(out, found)
	return err
}

func hostLeaksCommand(a []string, out io.Writer) error {
	if err := args(a, 2, "NETNS STATE (NETNS may be empty)"); err != nil {
		return err
	}
	if a[1] == "" {
		return usageError("STATE must not be empty: every command line contains it")
	}
	found, err := hostLeaks(procRoot, a[0], a[1], os.Getpid())
	printLine(out, found)
	return err
}

// printLine prints items on one line, or nothing when there are none.
func printLine(out io.Writer, items []string) {
	if len(items) > 0 {
		fmt.Fprintln(out, strings.Join(items, ""))
	}
}

// cgroupMake is cgroup-make ROOT over the hierarchies under hier.
func cgroupMake(hier, root string, out io.Writer) error {
	hs, err := hierarchies(hier)
	if err != nil {
		return err
	}
	for _, h := range hs {
		dir := h + root
		fmt.Fprintln(out, topMissing(dir))
		if isFile(h + "/cgroup.controllers") {
			continue // v2: runc creates it
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if isFile(h + "/cpuset.cpus") {
			if err := fillCpusets(h, root); err != nil {
				return err
			}
		}
	}
	return nil
}

// hierarchies lists the cgroup hierarchies mounted under hier: its directories (or links to
// directories) with a cgroup.procs file.
func hierarchies(hier string) ([]string, error) {
	entries, err := os.ReadDir(hier)
	if err != nil {
		return nil, err
	}
	var hs []string
	for _, e := range entries {
		h := filepath.Join(hier, e.Name())
		if !strings.HasPrefix(e.Name(), ".") && isFile(h+"/cgroup.procs") {
			hs = append(hs, h)
		}
	}
	return hs, nil
}

// topMissing is the topmost directory of dir's path that does not exist, or dir when it does.
func topMissing(dir string) string {
	top := dir
	for !isDir(filepath.Dir(top)) {
		top = filepath.Dir(top)
	}
	return top
}

// fillCpusets gives each level of root in the cpuset hierarchy h its parent's cpus and memory
// nodes where it has none: a new cpuset cgroup starts with neither, and no process can join it
// then.
func fillCpusets(h, root string) error {
	p := h
	for _, part := range strings.Split(strings.TrimPrefix(root, "/"), "/") {
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if err := inherit(p, p+"/"+part, f); err != nil {
				return err
			}
		}
		p += "/" + part
	}
	return nil
}

// inherit copies the file of the cgroup parent into the cgroup child, if child's is empty.
func inherit(parent, child, file string) error {
	b, err := os.ReadFile(child + "/" + file)
	if err != nil || strings.TrimRight(string(b), "\n") != "" {
		return err
	}
	if b, err = os.ReadFile(parent + "/" + file); err != nil {
		return err
	}
	return os.WriteFile(child+"/"+file, b, 0o644)
}

// cgroupRemove is cgroup-remove over dirs, waiting at most wait; proc names the processes left.
func cgroupRemove(proc string, dirs []string, mindepth int, wait time.Duration, out io.Writer) error {
	t0 := time.Now()
	left := removeEmpty(dirs, mindepth)
	for len(left) > 0 && time.Since(t0) < wait {
		time.Sleep(pollEvery)
		left = removeEmpty(dirs, mindepth)
	}
	ms := time.Since(t0).Milliseconds()
	fmt.Fprintf(out, "%d.%d\n", ms/1000, ms%1000/100)
	if len(left) == 0 {
		return nil
	}
	fmt.Fprintln(out, leftText(proc, left))
	return errNo
}

// removeEmpty removes each cgroup directory of dirs' trees (from mindepth down) that has no
// process, deepest first, and returns those still there.
func removeEmpty(dirs []string, mindepth int) []string {
	var left []string
	for _, top := range dirs {
		if fi, err := os.Lstat(top); err != nil || !fi.IsDir() {
			continue
		}
		for _, d := range subdirs(top, 0, mindepth) {
			if len(cgroupPids(d)) == 0 && syscall.Rmdir(d) == nil {
				continue
			}
			left = append(left, d)
		}
	}
	return left
}

// subdirs lists dir, depth levels below where the walk started, and the directories below it,
// each after its subdirectories, leaving out those less than mindepth below the start.
// Symbolic links are not followed; a directory that cannot be read has no subdirectories.
func subdirs(dir string, depth, mindepth int) []string {
	var ds []string
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.IsDir() {
			ds = append(ds, subdirs(filepath.Join(dir, e.Name()), depth+1, mindepth)...)
		}
	}
	if depth >= mindepth {
		ds = append(ds, dir)
	}
	return ds
}

// cgroupPids lists the processes in the cgroup dir, and in a v1 hierarchy its threads (the
// tasks file), in numeric order, each once.
func cgroupPids(dir string) []int {
	seen := map[int]bool{}
	var pids []int
	for _, f := range []string{"cgroup.procs", "tasks"} {
		b, _ := os.ReadFile(dir + "/" + f)
		for _, s := range strings.Fields(string(b)) {
			if n, err := strconv.Atoi(s); err == nil && !seen[n] {
				seen[n] = true
				pids = append(pids, n)
			}
		}
	}
	sort.Ints(pids)
	return pids
}

// leftText says what keeps each of the cgroup directories left.
func leftText(proc string, left []string) string {
	var b strings.Builder
	for _, d := range left {
		if why := holding(proc, d); why != "" {
			fmt.Fprintf(&b, "%s:%s; ", d, why)
		}
	}
	return b.String()
}

// holding says what keeps the cgroup dir: " PID (COMM)" for each process in it; nothing when
// it has subdirectories and no process (theirs say why); else why rmdir refuses it.
func holding(proc, dir string) string {
	if pids := cgroupPids(dir); len(pids) > 0 {
		var b strings.Builder
		for _, pid := range pids {
			fmt.Fprintf(&b, " %d (%s)", pid, comm(proc, pid, "gone"))
		}
		return b.String()
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.IsDir() {
			return ""
		}
	}
	reason := ""
	if err := syscall.Rmdir(dir); err != nil {
		reason = err.Error()
	}
	return " no process; rmdir: " + reason
}

// comm is the name of the process pid, or unknown when it cannot be read (it has exited).
func comm(proc string, pid int, unknown string) string {
	name, err := procfs.Comm(proc, pid)
	if err != nil {
		return unknown
	}
	return name
}

// processes is "PID:COMM " for each process under proc but self whose name matches one of
// globs and that is not a zombie; a process that exits while it looks is left out.
func processes(proc string, globs []string, self int) ([]string, error) {
	ps, err := procfs.Pids(proc)
	var found []string
	for _, pid := range ps {
		name := comm(proc, pid, "")
		if pid == self || name == "" || !matchesAny(globs, name) {
			continue
		}
		if state, ok := processState(proc, pid); ok && state != "Z" {
			found = append(found, fmt.Sprintf("%d:%s ", pid, name))
		}
	}
	return found, err
}

func matchesAny(globs []string, name string) bool {
	for _, g := range globs {
		if ok, _ := path.Match(g, name); ok {
			return true
		}
	}
	return false
}

// processState is the State field of the process pid's status ("S", "Z", …); ok is false when
// the status cannot be read.
func processState(proc string, pid int) (state string, ok bool) {
	b, err := os.ReadFile(fmt.Sprintf("%s/%d/status", proc, pid))
	if err != nil {
		return "", false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "State:" {
			return f[1], true
		}
	}
	return "", true
}

// hostLeaks is host-leaks over the processes under proc but self.
func hostLeaks(proc, netns, state string, self int) ([]string, error) {
	ps, err := procfs.Pids(proc)
	var found []string
	for _, pid := range ps {
		if pid == self {
			continue
		}
		dir := fmt.Sprintf("%s/%d", proc, pid)
		if ns, err := os.Readlink(dir + "/ns/net"); netns != "" && err == nil && ns == netns {
			found = append(found, fmt.Sprintf("pid %d (%s) in the test netns; ", pid, comm(proc, pid, "")))
		} else if cmdline, err := os.ReadFile(dir + "/cmdline"); err == nil &&
			strings.Contains(strings.ReplaceAll(string(cmdline), "\x00", " "), state) {
			found = append(found, fmt.Sprintf("pid %d (%s) mentions the state dir; ", pid, comm(proc, pid, "")))
		}
	}
	return found, err
}

func isDir(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.IsDir()
}

func isFile(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}
