// Command nodecheck is the host plumbing and the checks smoke's shell (tests/cluster/node) asks
// for while it sets up and tears down the node: the host's cgroups, processes and leaks, and the
// checks of the JSON kubectl gives it. The scenarios that run on the node (cmd/nodescenario)
// make their checks in Go with internal/nodecheck. The verdict is the exit status (0 yes, 1 no
// or an error, 2 bad usage); values are printed on stdout.
//
//	nodecheck kubectl-at-least MAJOR.MINOR   < `kubectl version --client -o json`
//	nodecheck cgroup-make ROOT               ROOT made in each v1 cgroup hierarchy; prints, one
//	                                         a line, each hierarchy's topmost new directory
//	nodecheck cgroup-remove SECONDS MINDEPTH DIR...  the cgroups below each DIR removed once
//	                                         empty; prints the seconds waited, then what is left
//	nodecheck processes GLOB...              prints "PID:COMM " per live process named GLOB
//	nodecheck host-leaks NETNS STATE         prints "pid PID (COMM) …; " per process in the
//	                                         network namespace NETNS or naming STATE
//
// host.go says more of each host subcommand.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
)

// errNo is a check's "no": exit status 1 without a message.
var errNo = fmt.Errorf("no")

type usageError string

func (e usageError) Error() string { return string(e) }

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: nodecheck SUBCOMMAND [ARGS] (see the source's header)")
		os.Exit(2)
	}
	err := run(os.Args[1], os.Args[2:], os.Stdin, os.Stdout)
	switch e := err.(type) {
	case nil:
	case usageError:
		fmt.Fprintf(os.Stderr, "nodecheck %s: %s\n", os.Args[1], string(e))
		os.Exit(2)
	default:
		if err != errNo {
			fmt.Fprintf(os.Stderr, "nodecheck %s: %v\n", os.Args[1], err)
		}
		os.Exit(1)
	}
}

func verdict(ok bool) error {
	if ok {
		return nil
	}
	return errNo
}

func args(a []string, n int, names string) error {
	if len(a) != n {
		return usageError("want " + names)
	}
	return nil
}

func decode(r io.Reader, what string, v any) error {
	if err := json.NewDecoder(r).Decode(v); err != nil {
		return fmt.Errorf("reading %s: %w", what, err)
	}
	return nil
}

func run(cmd string, a []string, in io.Reader, out io.Writer) error {
	if host, ok := hostCommands[cmd]; ok {
		return host(a, out)
	}
	switch cmd {
	case "kubectl-at-least":
		if err := args(a, 1, "MAJOR.MINOR"); err != nil {
			return err
		}
		var v struct {
			Client struct{ Major, Minor string } `json:"clientVersion"`
		}
		if err := decode(in, "kubectl's version", &v); err != nil {
			return err
		}
		ok, err := nodecheck.AtLeast(v.Client.Major, v.Client.Minor, a[0])
		if err != nil {
			return err
		}
		return verdict(ok)
	}
	return usageError("unknown subcommand (see the source's header)")
}
