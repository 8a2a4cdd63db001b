// Command pause is the pod sandbox image's only binary: it blocks until SIGTERM or SIGINT
// and exits 0, reaping any child re-parented to it in the meantime (it is PID 1 of the
// sandbox when the pod shares its process namespace).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	// `pause -v` prints the version and exits, as the upstream pause does: kubeadm's upgrade
	// preflight (CreateJob) runs a Job of the pause image with that argument.
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		os.Stdout.WriteString("pause (kube-apiserver-proxy test image)\n")
		return
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
