// Command nodescenario runs one scenario of the real-kubelet stage (package node) on the node
// tests/cluster/node/smoke has set up, from inside its namespaces:
//
//	nodescenario -state S -repo REPO -node-ip IP -node-name NAME -manifests DIR
//	             -image-repo REPO -version V -old-version V  SCENARIO
//
// SCENARIO is one of the map below (pivot, migrate, reboot, lifecycle, kubeadm-upgrade). The
// report goes to stdout in smoke's format ("ok   - …", "FAIL - …", "# …"); a node action the
// scenario needs is asked as a line "@node ACTION ARGS…" on stdout and answered with its exit
// status on a line of stdin (smoke runs this as a coprocess). Exit status: 0 when the scenario
// ran (its checks say how it went), 1 when it
// could not run, 2 for bad usage.
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

var scenarios = map[string]func(*node.Scenario){
	"pivot":           node.RunPivot,
	"migrate":         node.RunMigrate,
	"reboot":          node.RunReboot,
	"lifecycle":       node.RunLifecycle,
	"kubeadm-upgrade": node.RunKubeadmUpgrade,
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
	flag.Parse()
	run, ok := scenarios[flag.Arg(0)]
	if flag.NArg() != 1 || !ok || c.State == "" || c.Repo == "" || c.NodeIP == "" || c.NodeName == "" || c.ImageRepo == "" || c.Version == "" {
		names := make([]string, 0, len(scenarios))
		for name := range scenarios {
			names = append(names, name)
		}
		sort.Strings(names)
		fmt.Fprintln(os.Stderr, "nodescenario: want -state, -repo, -node-ip, -node-name, -image-repo, -version and one of: "+strings.Join(names, ", "))
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	n, err := node.New(ctx, c, os.Stdout, os.Stdin)
	if err != nil {
		report.NewRecord(os.Stdout).Fail("nodescenario %s: %v", flag.Arg(0), err)
		os.Exit(1)
	}
	run(n)
}
