// Package node is the scenarios of the real-kubelet stage (tests/cluster/node): what an
// operator does to a kubeadm-made node — the pivot, the migration, the rollouts, reboot
// recovery, the lifecycle rehearsals, `kubeadm upgrade` — and the checks of each step, run
// with client-go against the node's real control plane.
//
// The node itself (namespaces, containerd, the kubelet, the "reboot") is the shell's:
// tests/cluster/node/smoke sets it up, runs cmd/nodescenario inside it and carries out the
// node actions a scenario asks for (Scenario.Do). A scenario records its checks in a
// report.Record written to stdout in smoke's own format, one line per check: "ok   - …",
// "FAIL - …", "# …" (a note).
package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"kube-apiserver-proxy/tests/cluster/internal/await"
	"kube-apiserver-proxy/tests/cluster/internal/cluster"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// Config is the node as smoke set it up.
type Config struct {
	State      string // smoke's state directory ($S): logs, reports, bins/
	Repo       string // the repository (manifests/ comes from there)
	NodeIP     string
	NodeName   string
	Manifests  string // the kubelet's static pod directory
	ImageRepo  string // the local images' repository (localhost/kube-apiserver-proxy)
	Version    string // the kube-apiserver (and kubeadm) version
	OldVersion string // the older kube-apiserver, for the image change
	Standalone bool   // the kubelet runs without an apiserver: no Client
}

// Scenario is one scenario run on the node smoke set up: the node as the scenario sees it
// (its Config, a client-go client as the super-admin), the scenario's report (Pass, Fail,
// Note) and its line to smoke for node actions (Do). Methods name it n: the node, seen from
// this scenario. (The rehearsal's simulated node machine is cluster.Node.)
type Scenario struct {
	Config
	Admin string // the super-admin kubeconfig
	// PodSelector selects the Deployment's pods (DeploymentPods when empty).
	PodSelector string
	Client      kubernetes.Interface
	Ctx         context.Context
	// Record is the scenario's report: Pass, Fail, Note, Check, each a line on smoke's stdout.
	*report.Record

	actions *bufio.Reader
}

// New connects to the node's apiserver as kubeadm's super-admin (no Client when the node is
// Standalone). Node actions are asked on out
// and answered on actions (smoke's coprocess); with actions nil, Do fails.
func New(ctx context.Context, cfg Config, out io.Writer, actions io.Reader) (*Scenario, error) {
	n := &Scenario{Config: cfg, Admin: "/etc/kubernetes/super-admin.conf", Ctx: ctx, Record: report.NewRecord(out)}
	if actions != nil {
		n.actions = bufio.NewReader(actions)
	}
	if cfg.Standalone {
		return n, nil
	}
	rc, err := clientcmd.BuildConfigFromFlags("", n.Admin)
	if err != nil {
		return nil, err
	}
	rc.Timeout = 10 * time.Second
	if n.Client, err = kubernetes.NewForConfig(rc); err != nil {
		return nil, err
	}
	return n, nil
}

// Do asks smoke to carry out a node action (its shell function node_ACTION with args) and
// waits for its exit status: what only the node's owner can do, such as starting the kubelet
// or power-cycling the node. The action reports its own checks.
func (n *Scenario) Do(action string, args ...string) error {
	if n.actions == nil {
		return fmt.Errorf("node action %s: no node to ask (not run by smoke)", action)
	}
	n.WriteLine("@node " + strings.Join(append([]string{action}, args...), " "))
	answer, err := n.actions.ReadString('\n')
	if err != nil {
		return fmt.Errorf("node action %s: no answer: %w", action, err)
	}
	rc, err := strconv.Atoi(strings.TrimSpace(answer))
	if err != nil {
		return fmt.Errorf("node action %s: answer %q", action, answer)
	}
	if rc != 0 {
		return fmt.Errorf("node action %s: exit status %d", action, rc)
	}
	return nil
}

// Path is a file in the state directory.
func (n *Scenario) Path(name string) string { return filepath.Join(n.State, name) }

// Bin is a binary smoke put in the state directory (kubectl, kubeadm, the proxy, …).
func (n *Scenario) Bin(name string) string { return filepath.Join(n.State, "bins", name) }

// Since is the time since t in seconds with one decimal, as the report writes it.
func Since(t time.Time) string { return fmt.Sprintf("%.1f", time.Since(t).Seconds()) }

// WaitFor checks cond at once and then every 200 ms until it holds (true) or timeout passes
// (await.Holds); the caller says what failed.
func (n *Scenario) WaitFor(timeout time.Duration, cond func() bool) bool {
	return await.Holds(n.Ctx, 200*time.Millisecond, timeout, cond)
}

// Settle lets whatever runs (the loads) see d more of the node as it is.
func (n *Scenario) Settle(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-n.Ctx.Done():
	case <-t.C:
	}
}

// Run runs a command to completion within timeout; its combined output comes back trimmed,
// with the error (which names the command and the output's last lines).
func (n *Scenario) Run(timeout time.Duration, argv ...string) (string, error) {
	out, err := cluster.Run(n.Ctx, timeout, argv...)
	return strings.TrimSpace(string(out)), err
}

// Kubectl runs kubectl as the super-admin: the operator's own commands (apply, kustomize,
// rollout, set image, patch) are run the way the runbooks write them.
func (n *Scenario) Kubectl(timeout time.Duration, args ...string) (string, error) {
	argv := append([]string{n.Bin("kubectl"), "--kubeconfig", n.Admin, "--request-timeout=10s"}, args...)
	return n.Run(timeout, argv...)
}

// Kubectls is Kubectl in kube-system.
func (n *Scenario) Kubectls(timeout time.Duration, args ...string) (string, error) {
	return n.Kubectl(timeout, append([]string{"-n", "kube-system"}, args...)...)
}

// Background starts a command with its output in a log file of the state directory; the
// caller waits for it (Proc.Exited, Proc.Wait).
func (n *Scenario) Background(log string, argv ...string) (*Background, error) {
	f, err := os.Create(n.Path(log))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, err
	}
	b := &Background{Log: n.Path(log), done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		f.Close()
		b.code = cmd.ProcessState.ExitCode()
		b.err = err
		close(b.done)
	}()
	b.cmd = cmd
	return b, nil
}

// Background is a command started by Scenario.Background.
type Background struct {
	Log  string
	cmd  *exec.Cmd
	done chan struct{}
	code int
	err  error
}

// Exited: the command has exited.
func (b *Background) Exited() bool {
	select {
	case <-b.done:
		return true
	default:
		return false
	}
}

// ExitCode is the exit status once Exited (-1 for a signal).
func (b *Background) ExitCode() int { <-b.done; return b.code }

// Signal signals the command (nothing once it has exited).
func (b *Background) Signal(sig os.Signal) {
	if !b.Exited() {
		_ = b.cmd.Process.Signal(sig)
	}
}

// Move moves a file as mv does: a rename, or a copy and a removal across file systems (the
// node's /etc is an overlay, the state directory is not).
func Move(src, dst string) error {
	if err := os.Rename(src, dst); err == nil || !errors.Is(err, syscall.EXDEV) {
		return err
	}
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	st, err := os.Stat(src)
	if err != nil {
		return err
	}
	if err := os.WriteFile(dst, b, st.Mode().Perm()); err != nil {
		return err
	}
	return os.Remove(src)
}

// lastLines is report.LastLines on one line.
func lastLines(s string, k int) string {
	return strings.ReplaceAll(report.LastLines(s, k), "\n", " ")
}

// Tail is the end of a file as one line (the report's diagnostics), at most n lines.
func Tail(path string, lines int) string {
	return strings.Join(strings.Fields(strings.ReplaceAll(report.FileTail(path, lines), "\n", " | ")), " ")
}

// yesNo is a flag as the report writes it.
func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
