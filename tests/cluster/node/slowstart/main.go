// Command slowstart stands in for kube-apiserver in the slow-start rehearsal
// (internal/node/lifecycle.go): it waits $SLOW_START (a Go duration, default 60s), then execs
// $SLOW_START_EXEC (default /usr/local/bin/kube-apiserver.real) with its own arguments and
// environment, in place (same pid: the kubelet's SIGTERM reaches the real binary). Installed
// as /usr/local/bin/kube-apiserver in an image beside the real one, it makes an apiserver
// that takes that much longer to start, as a slow etcd or a large cluster's caches would.
// SIGTERM during the wait ends it (the default action).
package main

import (
	"fmt"
	"os"
	"syscall"
	"time"
)

func main() {
	delay := 60 * time.Second
	if v := os.Getenv("SLOW_START"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			fmt.Fprintf(os.Stderr, "slowstart: SLOW_START=%q: %v\n", v, err)
			os.Exit(2)
		}
		delay = d
	}
	target := os.Getenv("SLOW_START_EXEC")
	if target == "" {
		target = "/usr/local/bin/kube-apiserver.real"
	}
	fmt.Fprintf(os.Stderr, "slowstart: waiting %s before exec %s\n", delay, target)
	time.Sleep(delay)
	err := syscall.Exec(target, append([]string{target}, os.Args[1:]...), os.Environ())
	fmt.Fprintf(os.Stderr, "slowstart: exec %s: %v\n", target, err)
	os.Exit(1)
}
