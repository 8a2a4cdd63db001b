package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// asMain, set to 1 in its environment, makes the test binary nodecheck itself (TestMain): a
// test runs a subcommand as the separate process the shell runs, whose own command line the
// subcommand must not count.
const asMain = "NODECHECK_TEST_AS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(asMain) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// nodecheckProcess runs nodecheck with args as its own process and returns its pid and what it
// printed; it must exit 0.
func nodecheckProcess(t *testing.T, args ...string) (int, string) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), asMain+"=1")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("nodecheck %q: %v", args, err)
	}
	return cmd.Process.Pid, out.String()
}

// runHost runs the subcommand args in this process: what it printed, and its verdict.
func runHost(args ...string) (string, error) {
	var out bytes.Buffer
	err := run(args[0], args[1:], strings.NewReader(""), &out)
	return out.String(), err
}

// sleeper starts exe (a sleep) with argv0 for 60 s; it is killed and reaped when the test ends.
func sleeper(t *testing.T, exe, argv0 string) *exec.Cmd {
	t.Helper()
	cmd := &exec.Cmd{Path: exe, Args: []string{argv0, "60"}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

func sleepPath(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// copyOf copies the executable src to a file named name, the name (comm) its processes get.
func copyOf(t *testing.T, src, name string) string {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

// waitState waits (10 s at most) until the process pid is in state (its status's "State:").
func waitState(t *testing.T, pid int, state string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if s, _ := processState(procRoot, pid); s == state {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d not in state %s after 10 s", pid, state)
		}
	}
}

// A live process is listed by its name, a zombie is not, nor the process once reaped; with none
// left nothing at all is printed.
func TestProcessesOfAChild(t *testing.T) {
	name := fmt.Sprintf("ncsleep%d", os.Getpid())
	child := sleeper(t, copyOf(t, sleepPath(t), name), name)
	entry := fmt.Sprintf("%d:%s ", child.Process.Pid, name)
	listed := func() string {
		t.Helper()
		// Two globs, both this test's only: another run's node may be up on the host.
		out, err := runHost("processes", fmt.Sprintf("no-such-%d", os.Getpid()), fmt.Sprintf("nc*%d", os.Getpid()))
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	if out := listed(); out != entry+"\n" {
		t.Errorf("live: printed %q, want %q", out, entry+"\n")
	}
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	waitState(t, child.Process.Pid, "Z")
	if out := listed(); out != "" {
		t.Errorf("zombie: printed %q, want nothing", out)
	}
	_ = child.Wait()
	if out := listed(); out != "" {
		t.Errorf("reaped: printed %q, want nothing", out)
	}
}

// nodecheck leaves itself out: the test process, of the same name, is listed, its nodecheck
// process is not.
func TestProcessesLeavesItselfOut(t *testing.T) {
	self := comm(procRoot, os.Getpid(), "")
	pid, out := nodecheckProcess(t, "processes", self)
	fields := strings.Fields(out)
	if !slices.Contains(fields, fmt.Sprintf("%d:%s", os.Getpid(), self)) {
		t.Errorf("printed %q, without the test process %d", out, os.Getpid())
	}
	if slices.Contains(fields, fmt.Sprintf("%d:%s", pid, self)) {
		t.Errorf("printed %q, with nodecheck's own process %d", out, pid)
	}
}

// A process whose command line names the state directory is a leak, nodecheck's own (which
// names it too) is not; one in the test netns is said to be there, nodecheck's own again not.
func TestHostLeaksOfAChild(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state")
	child := sleeper(t, sleepPath(t), state+"/bin/sleep")
	name := comm(procRoot, child.Process.Pid, "")
	pid, out := nodecheckProcess(t, "host-leaks", "", state)
	if want := fmt.Sprintf("pid %d (%s) mentions the state dir; \n", child.Process.Pid, name); out != want {
		t.Errorf("printed %q, want %q (nodecheck was %d)", out, want, pid)
	}
	netns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", child.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	pid, out = nodecheckProcess(t, "host-leaks", netns, state)
	if want := fmt.Sprintf("pid %d (%s) in the test netns; ", child.Process.Pid, name); !strings.Contains(out, want) {
		t.Errorf("printed %q, without %q", out, want)
	}
	if own := fmt.Sprintf("pid %d (", pid); strings.Contains(out, own) {
		t.Errorf("printed %q, with nodecheck's own process %d", out, pid)
	}
	_ = child.Process.Kill()
	_ = child.Wait()
	if _, out = nodecheckProcess(t, "host-leaks", "", state); out != "" {
		t.Errorf("once the child is gone: printed %q, want nothing", out)
	}
}

// fakeProc writes a /proc of processes: their files by pid, and the link ns/net if given.
func fakeProc(t *testing.T, procs map[int]map[string]string) string {
	t.Helper()
	proc := t.TempDir()
	for pid, files := range procs {
		dir := fmt.Sprintf("%s/%d", proc, pid)
		must(t, os.MkdirAll(dir+"/ns", 0o755))
		for name, content := range files {
			if name == "ns/net" {
				must(t, os.Symlink(content, dir+"/ns/net"))
			} else {
				must(t, os.WriteFile(dir+"/"+name, []byte(content), 0o644))
			}
		}
	}
	must(t, os.WriteFile(proc+"/uptime", []byte("1.0 1.0\n"), 0o644))
	return proc
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestProcessesFakeProc(t *testing.T) {
	proc := fakeProc(t, map[int]map[string]string{
		20:  {"comm": "containerd-shim\n", "status": "Name:\tcontainerd-shim\nState:\tS (sleeping)\n"},
		21:  {"comm": "kubelet\n", "status": "State:\tZ (zombie)\n"},
		22:  {"comm": "runc\n"}, // exited between its comm and its status
		23:  {"comm": "bash\n", "status": "State:\tR (running)\n"},
		24:  {"comm": "kubelet\n", "status": "State:\tS (sleeping)\n"}, // nodecheck itself
		100: {"comm": "containerd\n", "status": "State:\tD (disk sleep)\n"},
	})
	got, err := processes(proc, []string{"containerd*", "kubelet", "runc"}, 24)
	if want := []string{"20:containerd-shim ", "100:containerd "}; err != nil || !slices.Equal(got, want) {
		t.Errorf("got %q, %v; want %q", got, err, want)
	}
}

func TestHostLeaksFakeProc(t *testing.T) {
	proc := fakeProc(t, map[int]map[string]string{
		10: {"comm": "kubelet\n", "cmdline": "/s/bin/kubelet\x00--root-dir\x00/s/kubelet\x00", "ns/net": "net:[1]"},
		11: {"comm": "pause\n", "cmdline": "/pause\x00", "ns/net": "net:[2]"},
		12: {"comm": "shim\n", "cmdline": "shim\x00-id\x00/s\x00", "ns/net": "net:[2]"},
		13: {"cmdline": "x /s/y", "ns/net": "net:[1]"},                          // exited: no comm
		14: {"comm": "bash\n", "cmdline": "/s\x00/ok\x00", "ns/net": "net:[1]"}, // "/s /ok" holds no "/s/"
		15: {"comm": "nodecheck\n", "cmdline": "nodecheck\x00host-leaks\x00/s/\x00", "ns/net": "net:[2]"},
		16: {"comm": "kthreadd\n"},
	})
	got, err := hostLeaks(proc, "net:[2]", "/s/", 15)
	want := []string{
		"pid 10 (kubelet) mentions the state dir; ",
		"pid 11 (pause) in the test netns; ",
		"pid 12 (shim) in the test netns; ",
		"pid 13 () mentions the state dir; ",
	}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("got %q, %v; want %q", got, err, want)
	}
	got, _ = hostLeaks(proc, "", "/s/", 15)
	if want := []string{"pid 10 (kubelet) mentions the state dir; ", "pid 13 () mentions the state dir; "}; !slices.Equal(got, want) {
		t.Errorf("without a netns: got %q, want %q", got, want)
	}
}

// fakeCgroups makes the directories dirs under root, then writes files (path: content).
func fakeCgroups(t *testing.T, root string, dirs []string, files map[string]string) {
	t.Helper()
	for _, d := range dirs {
		must(t, os.MkdirAll(root+"/"+d, 0o755))
	}
	for f, content := range files {
		must(t, os.WriteFile(root+"/"+f, []byte(content), 0o644))
	}
}

// In a plain directory tree a file stands for a cgroup's control files: its directory cannot
// be removed. Empty directories are removed deepest first in one pass; what is left is said
// as the shell reads it.
func TestCgroupRemoveFakeTree(t *testing.T) {
	proc := fakeProc(t, map[int]map[string]string{30: {"comm": "pause\n"}, 32: {"comm": "runc\n"}})
	top := t.TempDir() + "/top"
	fakeCgroups(t, top, []string{"empty/deeper/deepest", "busy", "stuck", "parent/child"}, map[string]string{
		"busy/cgroup.procs":         "31\n30\n",
		"busy/tasks":                "30\n31\n32\n",
		"stuck/cgroup.procs":        "",
		"parent/child/cgroup.procs": "",
	})
	keep := t.TempDir() + "/keep" // empty, but at depth 0
	must(t, os.Mkdir(keep, 0o755))
	var out bytes.Buffer
	err := cgroupRemove(proc, []string{top, top + "/absent", keep}, 1, 0, &out)
	want := "0.0\n" +
		top + "/busy: 30 (pause) 31 (gone) 32 (runc); " +
		top + "/parent/child: no process; rmdir: directory not empty; " +
		top + "/stuck: no process; rmdir: directory not empty; \n"
	if err != errNo || out.String() != want {
		t.Errorf("printed %q, %v; want %q, %v", out.String(), err, want, errNo)
	}
	if _, err := os.Stat(top + "/empty"); !os.IsNotExist(err) {
		t.Errorf("%s/empty not removed: %v", top, err)
	}
	if !isDir(top) || !isDir(keep) {
		t.Errorf("%s or %s removed at MINDEPTH 1", top, keep)
	}
	must(t, os.RemoveAll(top+"/busy"))
	must(t, os.RemoveAll(top+"/stuck"))
	must(t, os.RemoveAll(top+"/parent/child/cgroup.procs"))
	out.Reset()
	if err := cgroupRemove(proc, []string{top}, 0, 0, &out); err != nil || out.String() != "0.0\n" || isDir(top) {
		t.Errorf("MINDEPTH 0, all empty: printed %q, %v; %s left: %v", out.String(), err, top, isDir(top))
	}
}

// cgroup-remove waits for a cgroup to empty: here its control file goes after 300 ms.
func TestCgroupRemoveWaits(t *testing.T) {
	top := t.TempDir() + "/top"
	fakeCgroups(t, top, []string{"pod"}, map[string]string{"pod/cgroup.procs": "30\n"})
	go func() {
		time.Sleep(300 * time.Millisecond)
		_ = os.Remove(top + "/pod/cgroup.procs")
	}()
	var out bytes.Buffer
	err := cgroupRemove(t.TempDir(), []string{top}, 0, 5*time.Second, &out)
	if secs, _ := strconv.ParseFloat(strings.TrimSpace(out.String()), 64); err != nil || secs < 0.3 || isDir(top) {
		t.Errorf("printed %q, %v; want at least 0.3 s and %s gone", out.String(), err, top)
	}
}

// The hierarchies are those with a cgroup.procs file, links to them included; in a v2 one
// (cgroup.controllers) nothing is created. Each prints the topmost directory not there before.
func TestCgroupMakeFakeTree(t *testing.T) {
	hier := t.TempDir()
	fakeCgroups(t, hier, []string{"cpu,cpuacct", "memory/a", "pids", "unified", "notes", ".hidden"}, map[string]string{
		"cpu,cpuacct/cgroup.procs": "", "memory/cgroup.procs": "", "pids/cgroup.procs": "",
		"unified/cgroup.procs": "", "unified/cgroup.controllers": "cpu memory pids\n",
		".hidden/cgroup.procs": "", "rdma": "",
	})
	must(t, os.Symlink("cpu,cpuacct", hier+"/cpu"))
	var out bytes.Buffer
	if err := cgroupMake(hier, "/a/b/c", &out); err != nil {
		t.Fatal(err)
	}
	want := strings.Join([]string{
		hier + "/cpu/a",
		hier + "/cpu,cpuacct/a/b/c", // made just before, through the link cpu
		hier + "/memory/a/b",
		hier + "/pids/a",
		hier + "/unified/a",
	}, "\n") + "\n"
	if out.String() != want {
		t.Errorf("printed %q, want %q", out.String(), want)
	}
	for _, h := range []string{"cpu,cpuacct", "memory", "pids"} {
		if !isDir(hier + "/" + h + "/a/b/c") {
			t.Errorf("%s/a/b/c not made", h)
		}
	}
	if _, err := os.Stat(hier + "/unified/a"); !os.IsNotExist(err) {
		t.Errorf("unified/a made in the v2 hierarchy: %v", err)
	}
}

// realCgroups is the v1 hierarchy the real cgroup test puts its child in (pids, else memory)
// and the controller it is mounted for. Without root or a v1 hierarchy the test is skipped, or
// fails with CI set: there the real cgroupfs must be tested.
func realCgroups(t *testing.T) (h, controller string) {
	t.Helper()
	why := "not root"
	if os.Geteuid() == 0 {
		for _, c := range []string{"pids", "memory"} {
			h := cgroupRoot + "/" + c
			if isFile(h+"/cgroup.procs") && !isFile(h+"/cgroup.controllers") {
				return h, c
			}
		}
		why = "no v1 hierarchy at " + cgroupRoot + "/pids or /memory"
	}
	if ci := os.Getenv("CI"); ci != "" && ci != "false" && ci != "0" {
		t.Fatalf("CI is set and the real cgroupfs cannot be tested: %s", why)
	}
	t.Skipf("SKIPPED, cgroup-make and cgroup-remove NOT tested on the real cgroupfs: %s", why)
	return "", ""
}

// ownCgroup is this process's cgroup in the hierarchy of controller.
func ownCgroup(t *testing.T, controller string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/cgroup")
	must(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.SplitN(l, ":", 3); len(f) == 3 && slices.Contains(strings.Split(f[1], ","), controller) {
			return f[2]
		}
	}
	t.Fatalf("no %s cgroup in /proc/self/cgroup", controller)
	return ""
}

// realHierarchies lists the hierarchies as the shell's glob /sys/fs/cgroup/*/ with a
// cgroup.procs file, each with the topmost level of root not there yet (h+root when all are).
func realHierarchies(t *testing.T, root string) (hs, tops []string) {
	t.Helper()
	all, err := filepath.Glob(cgroupRoot + "/*")
	must(t, err)
	for _, h := range all {
		if !isDir(h) || !isFile(h+"/cgroup.procs") {
			continue
		}
		top, p := h+root, h
		for _, part := range strings.Split(root[1:], "/") {
			if p += "/" + part; !isDir(p) {
				top = p
				break
			}
		}
		hs, tops = append(hs, h), append(tops, top)
	}
	return hs, tops
}

// removeChain removes (rmdir) dir and its parents up to top, those that are empty.
func removeChain(dir, top string) {
	for d := dir; len(d) >= len(top); d = filepath.Dir(d) {
		_ = os.Remove(d)
	}
}

// On the real cgroupfs: ROOT is made in each v1 hierarchy, not in a v2 one, the tops printed
// are the levels that were not there, and in the cpuset hierarchy each level has cpus and
// memory nodes (a process can join it). cgroup-remove leaves a cgroup with a process in it,
// saying which, removes the others, and waits for the process to go.
func TestCgroupsReal(t *testing.T) {
	held, controller := realCgroups(t)
	unique := strings.TrimSuffix(ownCgroup(t, controller), "/") + fmt.Sprintf("/nodecheck-test-%d", os.Getpid())
	root := unique + "/pod/container"
	hs, tops := realHierarchies(t, root)
	t.Cleanup(func() {
		for i, h := range hs {
			removeChain(h+root, tops[i])
		}
	})
	out, err := runHost("cgroup-make", root)
	if want := strings.Join(tops, "\n") + "\n"; err != nil || out != want {
		t.Fatalf("cgroup-make %s: printed %q, %v; want %q", root, out, err, want)
	}
	holders := []string{held}
	for _, h := range hs {
		if v2 := isFile(h + "/cgroup.controllers"); v2 == isDir(h+root) {
			t.Errorf("%s: made %v, v2 %v", h+root, isDir(h+root), v2)
		}
	}
	if cpuset := cgroupRoot + "/cpuset"; isFile(cpuset+"/cpuset.cpus") && !isFile(cpuset+"/cgroup.controllers") {
		checkCpusets(t, cpuset, root)
		holders = append(holders, cpuset)
	}
	child := sleeper(t, sleepPath(t), "sleep")
	for _, h := range holders {
		must(t, os.WriteFile(h+root+"/cgroup.procs", []byte(strconv.Itoa(child.Process.Pid)), 0o644))
	}
	// The test removes from its unique level down: a level above it (the printed top) may be
	// another run's too by now.
	var dirs []string
	for _, h := range hs {
		dirs = append(dirs, h+unique)
	}
	checkRemoveHeld(t, dirs, hs, holders, root, child)
	checkRemoveWaits(t, dirs, child)
}

func checkCpusets(t *testing.T, cpuset, root string) {
	t.Helper()
	p := cpuset
	for _, part := range strings.Split(root[1:], "/") {
		p += "/" + part
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if b, err := os.ReadFile(p + "/" + f); err != nil || strings.TrimSpace(string(b)) == "" {
				t.Errorf("%s/%s: %q, %v; want it set", p, f, b, err)
			}
		}
	}
}

// checkRemoveHeld: with the child in the deepest cgroup of holders, cgroup-remove gives up
// after 1 s and names it there; the other hierarchies' cgroups are removed.
func checkRemoveHeld(t *testing.T, dirs, hs, holders []string, root string, child *exec.Cmd) {
	t.Helper()
	out, err := runHost(append([]string{"cgroup-remove", "1", "0"}, dirs...)...)
	want := ""
	for _, h := range hs {
		if slices.Contains(holders, h) {
			want += fmt.Sprintf("%s: %d (%s); ", h+root, child.Process.Pid, comm(procRoot, child.Process.Pid, ""))
		}
	}
	lines := strings.Split(out, "\n")
	secs, _ := strconv.ParseFloat(lines[0], 64)
	if err != errNo || len(lines) != 3 || secs < 1 || lines[1] != want {
		t.Fatalf("cgroup-remove 1 with a process in: printed %q, %v; want at least 1 s, then %q", out, err, want)
	}
	for i, h := range hs {
		if !slices.Contains(holders, h) && isDir(dirs[i]) {
			t.Errorf("%s left, no process in it", dirs[i])
		}
	}
}

// checkRemoveWaits: cgroup-remove removes all once the child, killed 500 ms after it started,
// has gone.
func checkRemoveWaits(t *testing.T, dirs []string, child *exec.Cmd) {
	t.Helper()
	type result struct {
		out string
		err error
	}
	done := make(chan result)
	go func() {
		out, err := runHost(append([]string{"cgroup-remove", "10", "0"}, dirs...)...)
		done <- result{out, err}
	}()
	time.Sleep(500 * time.Millisecond)
	_ = child.Process.Kill()
	_ = child.Wait()
	r := <-done
	if secs, _ := strconv.ParseFloat(strings.TrimSpace(r.out), 64); r.err != nil || secs < 0.5 {
		t.Errorf("cgroup-remove 10, the process killed after 500 ms: printed %q, %v; want 0.5 s or more", r.out, r.err)
	}
	for _, d := range dirs {
		if isDir(d) {
			t.Errorf("%s left", d)
		}
	}
}
