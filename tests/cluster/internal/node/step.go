package node

import (
	"encoding/json"
	"os"
	"strings"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/step"
)

// Watched is what a step watches unless it says otherwise: the client-go load on NODE_IP:6443
// as the super-admin, connects to NODE_IP:6443 every 20 ms, and the controller-manager and the
// scheduler, which must not restart.
func (n *Node) Watched() step.Options {
	return step.Options{
		Kubeconfig: n.Admin,
		Probes:     []string{n.NodeIP + ":6443"},
		Restarts:   []string{"kube-system/component in (kube-controller-manager,kube-scheduler)"},
	}
}

// Step is one step of a scenario under the load and its observers (package step), judged with
// the tier's strict criteria when it ends.
type Step struct {
	n          *Node
	name       string
	w          *step.Watch
	ReportOnly bool // the step's outage is measured, not asserted
}

// StartStep starts the load and the observers of o and returns once they run; when they do not
// within 180 s, that is a failed check and the step is nil (End on it fails the step too).
func (n *Node) StartStep(name string, o step.Options) *Step {
	w, err := step.Start(o, 180*time.Second)
	if err != nil {
		n.Fail("%s: the load and its observers did not start within 180 s: %v", name, err)
		return nil
	}
	return &Step{n: n, name: name, w: w}
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
			s.n.Note("%s, measured: %s", what, strings.Join(first(rep.Problems, 12), "; "))
		}
		return rep
	}
	problems := first(rep.Problems, 12)
	for _, note := range first(rep.Notes, 6) {
		problems = append(problems, "sample: "+note)
	}
	s.n.Fail("%s: %s -- %s", what, strings.Join(problems, "; "), clauses)
	return rep
}

func first(s []string, n int) []string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
