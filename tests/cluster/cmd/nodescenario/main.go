// Command nodescenario runs scenarios of the real-kubelet stage (package node) on the node
// tests/cluster/node/smoke has set up, from inside its namespaces, one after the other:
//
//	nodescenario -state S -repo REPO -node-ip IP -node-name NAME -manifests DIR
//	             -image-repo REPO -version V -old-version V [-standalone]  SCENARIO...
//
// Each SCENARIO is one of the map below: the node's own checks (static-pods; with an apiserver
// apiserver, controllers, deployment, stop-control-plane) and the operator's scenarios (pivot,
// migrate, reboot, lifecycle, kubeadm-upgrade). One that finds the node unable to go on (the
// apiserver never ready, a controller's mirror pod not Ready) ends the run. -standalone: the
// kubelet runs without an apiserver (no client; static-pods only). The report goes to stdout
// in smoke's format ("ok   - …", "FAIL - …", "# …"); a node action a scenario needs is asked
// as a line "@node ACTION ARGS…" on stdout and answered with its exit status on a line of
// stdin (smoke runs this as a coprocess). Exit status: 0 when the scenarios ran (their checks
// say how it went), 1 when they could not run, 2 for bad usage.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"

	"kube-apiserver-proxy/tests/cluster/internal/node"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// scenarios: each returns whether the node can go on to the next.
var scenarios = map[string]func(*node.Scenario) bool{
	"apiserver":          node.RunAPIServer,
	"controllers":        node.RunControllers,
	"deployment":         node.RunDeployment,
	"static-pods":        node.RunStaticPods,
	"stop-control-plane": node.RunStopControlPlane,
	"pivot":              last(node.RunPivot),
	"migrate":            last(node.RunMigrate),
	"reboot":             last(node.RunReboot),
	"lifecycle":          last(node.RunLifecycle),
	"kubeadm-upgrade":    last(node.RunKubeadmUpgrade),
}

// last is an operator's scenario, which leaves the node as it ends (smoke tears it down).
func last(run func(*node.Scenario)) func(*node.Scenario) bool {
	return func(n *node.Scenario) bool { run(n); return true }
}

func main() {
	var c node.Config
	flag.StringVar(&c.State, "state", "", "smoke's state directory")
	flag.StringVar(&c.Repo, "repo", "", "the repository")
	flag.StringVar(&c.NodeIP, "node-ip", "", "the node's address")
	flag.StringVar(&c.NodeName, "node-name", "", "the node's name")
	flag.StringVar(&c.Manifests, "manifests", "/etc/kubernetes/manifests", "the kubelet's static pod directory")
	flag.StringVar(&c.ImageRepo, "image-repo", "", "the local images' repository")
	flag.StringVar(&c.Version, "version", "", "the kube-apiserver version")
	flag.StringVar(&c.OldVersion, "old-version", "", "the older kube-apiserver version (the image change)")
	flag.BoolVar(&c.Standalone, "standalone", false, "the kubelet runs without an apiserver")
	flag.Parse()
	ok := flag.NArg() > 0
	for _, name := range flag.Args() {
		_, known := scenarios[name]
		ok = ok && known && !(c.Standalone && name != "static-pods")
	}
	if !ok || c.State == "" || c.Repo == "" || c.NodeIP == "" || c.NodeName == "" || c.ImageRepo == "" || c.Version == "" {
		names := make([]string, 0, len(scenarios))
		for name := range scenarios {
			names = append(names, name)
		}
		sort.Strings(names)
		fmt.Fprintln(os.Stderr, "nodescenario: want -state, -repo, -node-ip, -node-name, -image-repo, -version and scenarios of: "+strings.Join(names, ", ")+" (-standalone: static-pods only)")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	n, err := node.New(ctx, c, os.Stdout, os.Stdin)
	if err != nil {
		report.NewRecord(os.Stdout).Fail("nodescenario %s: %v", strings.Join(flag.Args(), " "), err)
		os.Exit(1)
	}
	for i, name := range flag.Args() {
		if !scenarios[name](n) {
			n.Note("%s: the node cannot go on; not run: %s", name, strings.Join(flag.Args()[i+1:], " "))
			return
		}
	}
}
