// Command rehearse runs the real-cluster scenarios: real etcd and kube-apiserver instances
// started from the shipped Deployment's containers (manifests/base), rolled one by one as the
// Deployment does, under a client-go load, and reports what the clients saw.
//
// It expects to run as root inside a private network namespace whose node address is --node-ip
// (tests/cluster/run sets that up). It prints one line per scenario and then
// "N passed, N failed", and writes every figure as JSON to --results.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/scenario"
)

func main() {
	var o scenario.Options
	var only string
	flag.StringVar(&o.Repo, "repo", ".", "repository root (manifests/base/deployment.yaml is read from it)")
	flag.StringVar(&o.Proxy, "proxy", "", "kube-apiserver-proxy binary")
	flag.StringVar(&o.PlantedProxy, "planted-proxy", "", "kube-apiserver-proxy built with --features planted-faults (the self-test scenarios; empty: they fail)")
	flag.StringVar(&o.PreviousProxy, "previous-proxy", "", "kube-apiserver-proxy of the previous release (tests/previous-release; empty: scenario previous-release fails)")
	flag.StringVar(&o.PreviousManifests, "previous-manifests", "", "the previous release's manifests directory (tests/previous-release)")
	flag.StringVar(&o.HAProxy, "haproxy", "", "haproxy binary (the Lokomotive design; empty: that scenario fails)")
	flag.StringVar(&o.APIServerOld, "apiserver-old", "", "kube-apiserver binary of the older version")
	flag.StringVar(&o.OldVersion, "old-version", "v1.36.3", "version of --apiserver-old")
	flag.StringVar(&o.APIServer, "apiserver", "", "kube-apiserver binary of the newer version")
	flag.StringVar(&o.Version, "version", "v1.37.2", "version of --apiserver")
	flag.StringVar(&o.Kubeadm, "kubeadm", "", "kubeadm binary (PKI and kubeconfigs)")
	flag.StringVar(&o.Etcd, "etcd", "", "etcd binary")
	flag.StringVar(&o.NodeIP, "node-ip", "", "the node address (on an interface of this namespace)")
	flag.StringVar(&o.Work, "work", "", "work directory (default: a new temporary one)")
	flag.IntVar(&o.Rollouts, "rollouts", 10, "rollouts per rollout scenario")
	flag.IntVar(&o.ProxyUID, "proxy-uid", 59443, "uid of every proxy instance (the manifests' runAsUser)")
	flag.Func("apiserver-arg", "an argument appended to every apiserver's (repeatable; for experiments)", func(v string) error {
		o.APIServerArgs = append(o.APIServerArgs, v)
		return nil
	})
	results := flag.String("results", "cluster-results.json", "where the JSON results go")
	flag.StringVar(&only, "scenarios", "", "comma-separated scenario names to run (default: all but haproxy-sidecar, figures only, run when named)")
	flag.Parse()

	for name, v := range map[string]string{"--proxy": o.Proxy, "--apiserver": o.APIServer, "--apiserver-old": o.APIServerOld, "--kubeadm": o.Kubeadm, "--etcd": o.Etcd, "--node-ip": o.NodeIP} {
		if v == "" {
			fmt.Fprintf(os.Stderr, "rehearse: %s is required\n", name)
			os.Exit(2)
		}
	}
	if only != "" {
		o.Only = map[string]bool{}
		known := scenario.Names()
		for _, n := range strings.Split(only, ",") {
			n = strings.TrimSpace(n)
			if !slices.Contains(known, n) {
				fmt.Fprintf(os.Stderr, "rehearse: --scenarios: unknown scenario %q (known: %s)\n", n, strings.Join(known, ", "))
				os.Exit(2)
			}
			o.Only[n] = true
		}
	}
	if o.Work == "" {
		dir, err := os.MkdirTemp("", "kap-cluster-")
		if err != nil {
			fmt.Fprintf(os.Stderr, "rehearse: %v\n", err)
			os.Exit(1)
		}
		o.Work = dir
	}
	o.Work, _ = filepath.Abs(o.Work)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	began := time.Now()
	res := scenario.RunAll(ctx, o)
	res.Duration = time.Since(began)

	raw, _ := json.MarshalIndent(res, "", "  ")
	if err := os.WriteFile(*results, raw, 0o644); err != nil {
		fmt.Fprintf(os.Stderr, "rehearse: write %s: %v\n", *results, err)
	}
	passed, failed := 0, 0
	for _, s := range res.Scenarios {
		if s.Passed {
			passed++
		} else {
			failed++
		}
	}
	fmt.Printf("results: %s (work directory with every log: %s)\n", *results, o.Work)
	fmt.Printf("%d passed, %d failed\n", passed, failed)
	if failed > 0 || passed == 0 {
		os.Exit(1)
	}
}
