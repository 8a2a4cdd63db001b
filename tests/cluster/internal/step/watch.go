package step

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/cluster"
	"kube-apiserver-proxy/tests/cluster/internal/load"
)

// Options is what one step watches: the client-go load of package load on Kubeconfig's server
// (unless NoLoad), and beside it TCP connect probers, the `kubernetes` Service's endpoints,
// pods that must neither restart nor flip.
type Options struct {
	Kubeconfig string
	// Probes: HOST:PORT to connect to every 20 ms: a refused, timed-out or failed connect is a
	// problem.
	Probes []string
	// Endpoints: default/kubernetes (v1 Endpoints and EndpointSlices) must never be without a
	// ready address.
	Endpoints bool
	// WatchPods: NAMESPACE/SELECTOR of pods (mirror pods left out) that must neither restart nor
	// turn unready unless deleted. Restarts: the same, mirror pods included.
	WatchPods, Restarts []string
	NoLoad              bool
	// Criteria names the load's criteria (load.CriteriaNamed): "" is the strict default.
	Criteria string
}

// Watch is one step being watched: Start it, run the step, Stop it for the verdict.
type Watch struct {
	opts      Options
	criteria  load.Criteria
	cancel    context.CancelFunc
	load      *load.Load
	prober    *load.Prober
	endpoints *cluster.EndpointsWatcher
	pods      []*cluster.PodWatcher
	before    cluster.TCPCounters
	excuses   []cluster.Excuse
}

// Excuse: a mirror pod's Ready flips that began between from and to and ended are the
// kubelet's (why), not a problem of the step; they are said in the summary. Call before Stop.
func (w *Watch) Excuse(from, to time.Time, why string) {
	w.excuses = append(w.excuses, cluster.Excuse{From: from, To: to, Why: why})
}

// Start starts the load and the observers; it returns once everything runs (the informers
// synced), or fails when that takes longer than startTimeout.
//
// Everything runs under a context of its own, which the start deadline cancels only while
// Start has not returned: stopping the step is Stop's, and the load's requests in flight still
// get their answers (load.Stop's grace).
func Start(o Options, startTimeout time.Duration) (*Watch, error) {
	for _, s := range append(append([]string{}, o.WatchPods...), o.Restarts...) {
		if !strings.Contains(s, "/") {
			return nil, fmt.Errorf("%q: want NAMESPACE/SELECTOR", s)
		}
	}
	criteria, err := load.CriteriaNamed(o.Criteria)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	w := &Watch{opts: o, criteria: criteria, cancel: cancel}
	deadline := time.AfterFunc(startTimeout, cancel)
	err = w.start(ctx)
	if !deadline.Stop() && err == nil {
		err = fmt.Errorf("start: not running within %s", startTimeout)
	}
	if err != nil {
		if w.load != nil {
			w.load.Stop()
		}
		w.stopObservers(&Report{}, io.Discard)
		cancel()
		return nil, err
	}
	w.before = cluster.ReadTCPCounters()
	return w, nil
}

func (w *Watch) start(ctx context.Context) error {
	o := w.opts
	var err error
	if o.Endpoints {
		if w.endpoints, err = cluster.WatchEndpoints(ctx, o.Kubeconfig); err != nil {
			return fmt.Errorf("watch default/kubernetes: %w", err)
		}
	}
	for _, sel := range o.WatchPods {
		if err := w.watchPods(ctx, sel, false); err != nil {
			return err
		}
	}
	for _, sel := range o.Restarts {
		if err := w.watchPods(ctx, sel, true); err != nil {
			return err
		}
	}
	if !o.NoLoad {
		if w.load, err = load.Start(ctx, load.DefaultConfig(o.Kubeconfig)); err != nil {
			return fmt.Errorf("start the load: %w", err)
		}
	}
	if len(o.Probes) > 0 {
		w.prober = load.StartProber(ctx, o.Probes)
	}
	return nil
}

func (w *Watch) watchPods(ctx context.Context, sel string, mirrors bool) error {
	ns, selector, _ := strings.Cut(sel, "/")
	pw, err := cluster.WatchPods(ctx, w.opts.Kubeconfig, ns, selector, mirrors)
	if err != nil {
		return fmt.Errorf("watch pods %s: %w", sel, err)
	}
	w.pods = append(w.pods, pw)
	return nil
}

// Stop ends the load and every observer and judges what they saw with the tier's strict
// criteria; one summary line per observer goes to summary. The report's Problems are the
// verdict (none: the step was lossless). A step shorter than one round of every workload
// (a drain that takes a tenth of a second) runs on until each has completed a request
// (load.Load.Stop): a short step is not a load that did not run.
func (w *Watch) Stop(summary io.Writer) *Report {
	defer w.cancel()
	rep := &Report{Problems: []string{}}
	if w.load != nil {
		lr := w.load.Stop()
		rep.Load = &lr
		fmt.Fprintln(summary, "load", lr.Summary())
		rep.Problems = append(rep.Problems, lr.Problems(w.criteria, load.DefaultConfig(w.opts.Kubeconfig))...)
		for kind, samples := range lr.Samples {
			for _, s := range samples {
				rep.Notes = append(rep.Notes, kind+": "+s)
			}
		}
	}
	w.stopObservers(rep, summary)
	rep.TCP = cluster.ReadTCPCounters().Since(w.before)
	for _, c := range []string{"TcpExt:ListenOverflows", "TcpExt:ListenDrops"} {
		if n := rep.TCP[c]; n > 0 {
			rep.Problems = append(rep.Problems, fmt.Sprintf("%s: %d in the node during the step (a listen queue overflowed or a SYN was dropped)", c, n))
		}
	}
	return rep
}

func (w *Watch) stopObservers(rep *Report, summary io.Writer) {
	if w.prober != nil {
		rep.Probes = w.prober.Stop()
		for _, p := range rep.Probes {
			fmt.Fprintln(summary, "probe", p.String())
			if p.Failed() > 0 {
				rep.Problems = append(rep.Problems, "connects failed: "+p.String())
			}
			if p.Attempts == 0 {
				rep.Problems = append(rep.Problems, "the prober of "+p.Address+" made no attempt")
			}
		}
	}
	if w.endpoints != nil {
		behind := w.endpoints.Behind(context.Background())
		rec := &EndpointsRecord{Gaps: w.endpoints.Take(), Errors: w.endpoints.TakeErrors()}
		if behind != "" {
			rec.Errors = append(rec.Errors, behind)
		}
		w.endpoints.Stop()
		rep.Endpoints = rec
		fmt.Fprintf(summary, "default/kubernetes: %d gaps, %d watch errors\n", len(rec.Gaps), len(rec.Errors))
		for _, g := range rec.Gaps {
			rep.Problems = append(rep.Problems, fmt.Sprintf("default/kubernetes %s without a ready address for %s from %s", g.Object, g.Duration.Round(time.Millisecond), g.From.Format("15:04:05.000")))
		}
		for _, e := range rec.Errors {
			rep.Problems = append(rep.Problems, "the default/kubernetes watcher's watch failed: "+e)
		}
	}
	for _, pw := range w.pods {
		r := pw.Stop()
		fmt.Fprintf(summary, "pods %s: %s\n", r.Selector, r.String())
		rep.Pods = append(rep.Pods, r)
		problems, notes := r.Problems(w.excuses)
		rep.Problems = append(rep.Problems, problems...)
		for _, n := range notes {
			fmt.Fprintln(summary, n)
		}
	}
}
