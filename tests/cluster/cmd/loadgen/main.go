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

	"kube-apiserver-proxy/tests/cluster/internal/cluster"
	"kube-apiserver-proxy/tests/cluster/internal/load"
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

// observers is what runs during the step besides the load.
type observers struct {
	prober    *load.Prober
	endpoints *cluster.EndpointsWatcher
	pods      []*cluster.PodWatcher
}

func start(ctx context.Context, o options) (*load.Load, *observers, error) {
	obs := &observers{}
	var err error
	if o.endpoints {
		if obs.endpoints, err = cluster.WatchEndpoints(ctx, o.kubeconfig); err != nil {
			return nil, obs, fmt.Errorf("watch default/kubernetes: %w", err)
		}
	}
	for _, sel := range o.watchPods {
		if err := obs.watchPods(ctx, o.kubeconfig, sel, false); err != nil {
			return nil, obs, err
		}
	}
	for _, sel := range o.restarts {
		if err := obs.watchPods(ctx, o.kubeconfig, sel, true); err != nil {
			return nil, obs, err
		}
	}
	var l *load.Load
	if o.load {
		if l, err = load.Start(ctx, load.DefaultConfig(o.kubeconfig)); err != nil {
			return nil, obs, fmt.Errorf("start the load: %w", err)
		}
	}
	if len(o.probes) > 0 {
		obs.prober = load.StartProber(ctx, o.probes)
	}
	return l, obs, nil
}

func (obs *observers) watchPods(ctx context.Context, kubeconfig, sel string, mirrors bool) error {
	ns, selector, _ := strings.Cut(sel, "/")
	w, err := cluster.WatchPods(ctx, kubeconfig, ns, selector, mirrors)
	if err != nil {
		return fmt.Errorf("watch pods %s: %w", sel, err)
	}
	obs.pods = append(obs.pods, w)
	return nil
}

// stop ends every observer and judges what it saw.
func (obs *observers) stop(rep *step.Report) {
	if obs.prober != nil {
		rep.Probes = obs.prober.Stop()
		for _, p := range rep.Probes {
			fmt.Fprintln(os.Stderr, "loadgen: probe", p.String())
			if p.Failed() > 0 {
				rep.Problems = append(rep.Problems, "connects failed: "+p.String())
			}
			if p.Attempts == 0 {
				rep.Problems = append(rep.Problems, "the prober of "+p.Address+" made no attempt")
			}
		}
	}
	if obs.endpoints != nil {
		rec := &step.EndpointsRecord{Gaps: obs.endpoints.Take(), Errors: obs.endpoints.TakeErrors()}
		obs.endpoints.Stop()
		rep.Endpoints = rec
		fmt.Fprintf(os.Stderr, "loadgen: default/kubernetes: %d gaps, %d watch errors\n", len(rec.Gaps), len(rec.Errors))
		for _, g := range rec.Gaps {
			rep.Problems = append(rep.Problems, fmt.Sprintf("default/kubernetes %s without a ready address for %s from %s", g.Object, g.Duration.Round(time.Millisecond), g.From.Format("15:04:05.000")))
		}
		for _, e := range rec.Errors {
			rep.Problems = append(rep.Problems, "the default/kubernetes watcher's watch failed: "+e)
		}
	}
	for _, w := range obs.pods {
		pw := w.Stop()
		fmt.Fprintf(os.Stderr, "loadgen: pods %s: %s\n", pw.Selector, pw.String())
		rep.Pods = append(rep.Pods, pw)
		rep.Problems = append(rep.Problems, pw.Problems()...)
	}
}

func run(o options) (*step.Report, error) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	// Everything runs under the context start is given, so the start deadline cancels it
	// only while start has not returned. It is not the signal's: SIGTERM stops the step, and
	// the load's requests in flight still get their answers (load.Stop's grace).
	runCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	deadline := time.AfterFunc(o.startTimeout, cancel)
	l, obs, err := start(runCtx, o)
	if !deadline.Stop() && err == nil {
		err = fmt.Errorf("start: not running within %s", o.startTimeout)
	}
	if err != nil {
		if l != nil {
			l.Stop()
		}
		obs.stop(&step.Report{})
		return nil, err
	}
	before := cluster.ReadTCPCounters()
	if o.ready != "" {
		if err := os.WriteFile(o.ready, []byte(time.Now().UTC().Format(time.RFC3339Nano)+"\n"), 0o644); err != nil {
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
	rep := &step.Report{Problems: []string{}}
	if l != nil {
		lr := l.Stop()
		rep.Load = &lr
		fmt.Fprintln(os.Stderr, "loadgen: load", lr.Summary())
		rep.Problems = append(rep.Problems, lr.Problems(load.DefaultCriteria(), load.DefaultConfig(o.kubeconfig))...)
		for kind, samples := range lr.Samples {
			for _, s := range samples {
				rep.Notes = append(rep.Notes, kind+": "+s)
			}
		}
	}
	obs.stop(rep)
	rep.TCP = cluster.ReadTCPCounters().Since(before)
	for _, c := range []string{"TcpExt:ListenOverflows", "TcpExt:ListenDrops"} {
		if n := rep.TCP[c]; n > 0 {
			rep.Problems = append(rep.Problems, fmt.Sprintf("%s: %d in the node during the step (a listen queue overflowed or a SYN was dropped)", c, n))
		}
	}
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
