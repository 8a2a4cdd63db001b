// Command loadgen watches one step of the real-kubelet stage (tests/cluster/node): the
// client-go load of package load, and beside it whatever else the step asks for: TCP connect
// probers, the `kubernetes` Service's endpoints, pods that must neither restart nor flip, the
// node's listen-queue counters. It runs until SIGTERM or SIGINT (or -duration), then judges
// what it saw with the same strict criteria as the real-cluster tier's scenarios.
//
//	loadgen -kubeconfig admin.conf -out report.json [-ready FILE] [-duration 10m]
//	        [-probe HOST:PORT]... [-watch-endpoints] [-watch-pods NS/SELECTOR]...
//	        [-watch-restarts NS/SELECTOR]... [-load=false] [-report-only]
//
// The ready file is written once everything runs (the informers synced), so that a script
// starts what it measures only then. The report (JSON) goes to -out; one summary line per
// observer and one line per problem go to stderr. Exit status: 0 when no problem was found
// (or with -report-only, for a step whose outage is measured rather than asserted), 1 when one
// was, or when the load could not start or the report could not be written; 2 for bad usage.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/step"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

type options struct {
	kubeconfig, out, ready      string
	duration, startTimeout      time.Duration
	probes, watchPods, restarts list
	endpoints, load, reportOnly bool
	criteria                    string
}

func main() {
	var o options
	flag.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig of the clients (its server is the address under test)")
	flag.StringVar(&o.out, "out", "", "file to write the report to (JSON; default stdout)")
	flag.DurationVar(&o.duration, "duration", 0, "stop after this long (0: only on SIGTERM/SIGINT)")
	flag.StringVar(&o.ready, "ready", "", "file to create once everything runs")
	flag.DurationVar(&o.startTimeout, "start-timeout", 2*time.Minute, "deadline for the load and the watchers to start")
	flag.Var(&o.probes, "probe", "HOST:PORT to connect to every 20 ms (repeatable): a refused, timed-out or failed connect is a problem")
	flag.BoolVar(&o.endpoints, "watch-endpoints", false, "default/kubernetes (v1 Endpoints and EndpointSlices) must never be without a ready address")
	flag.Var(&o.watchPods, "watch-pods", "NAMESPACE/SELECTOR of pods (mirror pods left out) that must neither restart nor turn unready unless deleted (repeatable)")
	flag.Var(&o.restarts, "watch-restarts", "NAMESPACE/SELECTOR of pods (mirror pods too) that must neither restart nor turn unready (repeatable)")
	flag.BoolVar(&o.load, "load", true, "run the client-go load (false: only the observers)")
	flag.BoolVar(&o.reportOnly, "report-only", false, "print the problems but exit 0: the step's outage is measured, not asserted")
	flag.StringVar(&o.criteria, "criteria", "", "the load's criteria: default (strict) or store-restart (etcd restarts: seconds without a completion and the p99 not bounded)")
	flag.Parse()
	if o.kubeconfig == "" || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "loadgen: -kubeconfig is required, and no arguments")
		os.Exit(2)
	}
	for _, s := range append(append(list{}, o.watchPods...), o.restarts...) {
		if !strings.Contains(s, "/") {
			fmt.Fprintf(os.Stderr, "loadgen: %q: want NAMESPACE/SELECTOR\n", s)
			os.Exit(2)
		}
	}
	rep, err := run(o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
	for _, p := range rep.Problems {
		fmt.Fprintln(os.Stderr, "loadgen: PROBLEM:", p)
	}
	if len(rep.Problems) > 0 {
		for _, n := range rep.Notes {
			fmt.Fprintln(os.Stderr, "loadgen: PROBLEM: sample:", n)
		}
	}
	if len(rep.Problems) > 0 && !o.reportOnly {
		os.Exit(1)
	}
}

// prefixed writes each line it is given to stderr after "loadgen: ".
type prefixed struct{}

func (prefixed) Write(b []byte) (int, error) {
	for _, line := range strings.SplitAfter(string(b), "\n") {
		if line != "" {
			fmt.Fprint(os.Stderr, "loadgen: "+line)
		}
	}
	return len(b), nil
}

func run(o options) (*step.Report, error) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	w, err := step.Start(step.Options{
		Kubeconfig: o.kubeconfig, Probes: o.probes, Endpoints: o.endpoints,
		WatchPods: o.watchPods, Restarts: o.restarts, NoLoad: !o.load, Criteria: o.criteria,
	}, o.startTimeout)
	if err != nil {
		return nil, err
	}
	if o.ready != "" {
		if err := os.WriteFile(o.ready, []byte(time.Now().UTC().Format(time.RFC3339Nano)+"\n"), 0o644); err != nil {
			w.Stop(prefixed{})
			return nil, err
		}
	}
	if o.duration > 0 {
		t := time.NewTimer(o.duration)
		defer t.Stop()
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	} else {
		<-ctx.Done()
	}
	rep := w.Stop(prefixed{})
	data, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return nil, err
	}
	if o.out == "" {
		_, err = os.Stdout.Write(append(data, '\n'))
	} else {
		err = os.WriteFile(o.out, append(data, '\n'), 0o644)
	}
	return rep, err
}
