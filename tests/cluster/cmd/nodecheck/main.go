// Command nodecheck is the checks smoke (tests/cluster/node) itself makes while it sets the
// node up, of the JSON the kubelet, the apiserver and kubectl give it; the scenarios that run on
// the node (cmd/nodescenario) make theirs in Go with the same functions (internal/nodecheck).
// The object comes on stdin; the verdict is the exit status (0 yes, 1 no or the input
// unreadable, 2 bad usage), a value is printed on stdout.
//
//	nodecheck pod-ready                      < pod       its Ready condition is True
//	nodecheck pod-ready-prefix PREFIX        < podlist   some pod PREFIX-… is Ready
//	nodecheck pod-ip NAME                    < podlist   prints pod NAME's IP
//	nodecheck pods                           < podlist   prints "name node phase" per pod
//	nodecheck node-ready                     < node      prints "STATUS REASON: MESSAGE"
//	nodecheck rollout-done                   < deployment  the rollout is complete
//	nodecheck kubectl-at-least MAJOR.MINOR   < `kubectl version --client -o json`
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

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
	switch cmd {
	case "pod-ready":
		var p corev1.Pod
		if err := decode(in, "a pod", &p); err != nil {
			return err
		}
		return verdict(nodecheck.Ready(&p))
	case "pod-ready-prefix", "pod-ip":
		if err := args(a, 1, "one pod name"); err != nil {
			return err
		}
		var pods corev1.PodList
		if err := decode(in, "a pod list", &pods); err != nil {
			return err
		}
		if cmd == "pod-ready-prefix" {
			return verdict(nodecheck.ReadyWithPrefix(&pods, a[0]))
		}
		if p := nodecheck.Named(&pods, a[0]); p != nil {
			fmt.Fprintln(out, p.Status.PodIP)
		}
		return nil
	case "pods":
		var pods corev1.PodList
		if err := decode(in, "a pod list", &pods); err != nil {
			return err
		}
		for _, l := range nodecheck.Lines(&pods) {
			fmt.Fprintln(out, l)
		}
		return nil
	case "node-ready":
		var n corev1.Node
		if err := decode(in, "a node", &n); err != nil {
			return err
		}
		if s := nodecheck.NodeReady(&n); s != "" {
			fmt.Fprintln(out, s)
		}
		return nil
	case "rollout-done":
		var d appsv1.Deployment
		if err := decode(in, "a Deployment", &d); err != nil {
			return err
		}
		return verdict(nodecheck.RolloutDone(&d))
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
