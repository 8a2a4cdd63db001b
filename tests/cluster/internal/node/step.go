package node

import (
	"encoding/json"
	"os"
	"strings"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/report"
	"kube-apiserver-proxy/tests/cluster/internal/step"
)

// Watched is what a step watches unless it says otherwise: the client-go load on NODE_IP:6443
// as the super-admin, connects to NODE_IP:6443 every 20 ms, and the controller-manager and the
// scheduler, which must not restart.
func (n *Scenario) Watched() step.Options {
	return step.Options{
		Kubeconfig: n.Admin,
		Probes:     []string{n.NodeIP + ":6443"},
		Restarts:   []string{"kube-system/component in (kube-controller-manager,kube-scheduler)"},
	}
}

// Step is one step of a scenario under the load and its observers (package step), judged with
// the tier's strict criteria when it ends.
type Step struct {
	n          *Scenario
	name       string
	w          *step.Watch
	ReportOnly bool // the step's outage is measured, not asserted
}

// StartStep starts the load and the observers of o and returns once they run; when they do not
// within 180 s, that is a failed check and the step is nil (End on it fails the step too).
func (n *Scenario) StartStep(name string, o step.Options) *Step {
	w, err := step.Start(o, 180*time.Second)
	if err != nil {
		n.Fail("%s: the load and its observers did not start within 180 s: %v", name, err)
		return nil
	}
	return &Step{n: n, name: name, w: w}
}

// Excuse: step.Watch.Excuse.
func (s *Step) Excuse(from, to time.Time, why string) {
	if s != nil {
		s.w.Excuse(from, to, why)
	}
}

// End stops the step and reports it: a pass when it was lossless, a failure with every problem
// found otherwise. The report is kept in the state directory as step-NAME.json.
func (s *Step) End(what string) *step.Report {
	if s == nil {
		return nil
	}
	var summary strings.Builder
	rep := s.w.Stop(&summary)
	if data, err := json.MarshalIndent(rep, "", "  "); err == nil {
		_ = os.WriteFile(s.n.Path("step-"+s.name+".json"), append(data, '\n'), 0o644)
	}
	clauses := strings.Join(strings.Split(strings.TrimSpace(summary.String()), "\n"), " | ")
	if len(rep.Problems) == 0 || s.ReportOnly {
		s.n.Pass("%s: %s", what, clauses)
		if len(rep.Problems) > 0 {
			s.n.Note("%s, measured: %s", what, strings.Join(report.First(rep.Problems, 12), "; "))
		}
		return rep
	}
	problems := report.First(rep.Problems, 12)
	for _, note := range report.First(rep.Notes, 6) {
		problems = append(problems, "sample: "+note)
	}
	s.n.Fail("%s: %s -- %s", what, strings.Join(problems, "; "), clauses)
	return rep
}

// Both is a step on both addresses of port 6443 at once: the load on NODE_IP:6443 with the
// probers of NODE_IP:6443 and 127.0.0.1:6443 and the endpoints watcher, and a second load on
// 127.0.0.1:6443 (LocalAdmin, `tls-server-name: kubernetes`): what the migration, the way
// back and the kubeadm upgrade are judged by. Its reports are step-NAME.json and
// step-NAME-local.json.
type Both struct{ Remote, Local *Step }

// StartBoth starts step name from watch (Watched when nil): its probers and pod watches go
// with both loads; reportOnly: the two report their problems rather than fail on them.
func (n *Scenario) StartBoth(name string, watch *step.Options, reportOnly bool) Both {
	o := n.Watched()
	if watch != nil {
		o = *watch
	}
	remote := o
	remote.Probes = append(append([]string{}, o.Probes...), "127.0.0.1:6443")
	remote.Endpoints = true
	b := Both{
		Remote: n.StartStep(name, remote),
		Local:  n.StartStep(name+"-local", step.Options{Kubeconfig: n.LocalAdmin(), Probes: o.Probes, Restarts: o.Restarts, Criteria: o.Criteria}),
	}
	for _, s := range []*Step{b.Remote, b.Local} {
		if s != nil {
			s.ReportOnly = reportOnly
		}
	}
	return b
}

// Started: both loads run.
func (b Both) Started() bool { return b.Remote != nil && b.Local != nil }

// Excuse excuses mirror pods' Ready flips in both (step.Watch.Excuse).
func (b Both) Excuse(from, to time.Time, why string) {
	b.Remote.Excuse(from, to, why)
	b.Local.Excuse(from, to, why)
}

// End ends both and reports each: "WHAT (NODE_IP:6443 …)" and "WHAT (127.0.0.1:6443 …)".
func (b Both) End(what string) {
	b.Remote.End(what + " (NODE_IP:6443: client-go load, connects to both addresses, default/kubernetes)")
	b.Local.End(what + " (127.0.0.1:6443: client-go load)")
}
