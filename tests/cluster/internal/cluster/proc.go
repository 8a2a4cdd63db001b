package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// Proc is one child process (a container's main process, etcd) with its output in a log file.
type Proc struct {
	Name string
	Log  string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// Start runs argv with its output appended to log. uid < 0 keeps ours.
func Start(name, log string, uid int, argv ...string) (*Proc, error) {
	if err := os.MkdirAll(filepath.Dir(log), 0o755); err != nil {
		return nil, err
	}
	out, err := os.OpenFile(log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = out, out
	// Its own process group: a signal to the group reaches what it started too, and a
	// Ctrl-C of the runner does not reach it before the runner has stopped it in order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if uid >= 0 {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}
	}
	if err := cmd.Start(); err != nil {
		out.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Proc{Name: name, Log: log, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		out.Close()
		close(p.done)
	}()
	return p, nil
}

// Signal sends sig to the process.
func (p *Proc) Signal(sig syscall.Signal) { _ = p.cmd.Process.Signal(sig) }

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Wait waits up to timeout for the process to exit; false if it is still running.
func (p *Proc) Wait(timeout time.Duration) bool {
	select {
	case <-p.done:
		return true
	case <-time.After(timeout):
		return false
	}
}

// ExitCode is the exit status (-1 when killed by a signal or still running).
func (p *Proc) ExitCode() int {
	if !p.Exited() {
		return -1
	}
	var exitErr *exec.ExitError
	if p.err == nil {
		return 0
	}
	if errors.As(p.err, &exitErr) {
		return exitErr.ExitCode()
	}
	return -1
}

// Kill ends the process group at once and waits for it.
func (p *Proc) Kill() {
	if p.Exited() {
		return
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
}

// Run runs argv to completion with a deadline and returns its combined output.
func Run(ctx context.Context, timeout time.Duration, argv ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s: %w: %s", filepath.Base(argv[0]), err, report.LastLines(string(out), 5))
	}
	return out, nil
}
