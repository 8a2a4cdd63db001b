// Package step is the report of one step of the real-kubelet stage (tests/cluster/node): what
// cmd/loadgen writes and what the scenarios (internal/node) read back.
package step

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"kube-apiserver-proxy/tests/cluster/internal/cluster"
	"kube-apiserver-proxy/tests/cluster/internal/load"
)

// Report is what one step saw.
type Report struct {
	Load      *load.Report        `json:"load,omitempty"`
	Probes    []load.ProbeCount   `json:"probes,omitempty"`
	Endpoints *EndpointsRecord    `json:"endpoints,omitempty"`
	Pods      []cluster.PodWatch  `json:"pods,omitempty"`
	TCP       cluster.TCPCounters `json:"tcp"`
	Problems  []string            `json:"problems"`
	Notes     []string            `json:"notes,omitempty"`
}

// EndpointsRecord: every interval default/kubernetes had no ready address, and the watcher's
// own failures.
type EndpointsRecord struct {
	Gaps   []cluster.Gap `json:"gaps"`
	Errors []string      `json:"watch_errors,omitempty"`
}

// Read reads a report written by cmd/loadgen.
func Read(path string) (*Report, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r Report
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &r, nil
}

// Refused is the number of refused connects of every prober.
func (r *Report) Refused() int64 {
	var n int64
	for _, p := range r.Probes {
		n += p.Refused
	}
	return n
}

// ProbeFailures is the number of failed connects of every prober: refused, timed out or
// otherwise.
func (r *Report) ProbeFailures() int64 {
	var n int64
	for _, p := range r.Probes {
		n += p.Refused + p.Timeouts
		for _, c := range p.Other {
			n += c
		}
	}
	return n
}

// MostPodsAtOnce is the most pods seen at once by the pod watches whose selector contains
// selector (0 when none).
func (r *Report) MostPodsAtOnce(selector string) int {
	most := 0
	for _, w := range r.Pods {
		if strings.Contains(w.Selector, selector) && w.Most > most {
			most = w.Most
		}
	}
	return most
}

// Line is the report on one line: seconds, requests, failed requests, refused connects, failed
// connects of any kind, relists, cut watches, then the problems ("none" when there are none).
// A report without the load (-load=false) has no such line.
func (r *Report) Line() (string, error) {
	if r.Load == nil {
		return "", fmt.Errorf("no load in the report")
	}
	l := r.Load
	problems := strings.Join(r.Problems, "; ")
	if problems == "" {
		problems = "none"
	}
	return fmt.Sprintf("%.1f %d %d %d %d %d %d %s", l.Duration.Seconds(), l.TotalOK()+l.TotalFailed(), l.TotalFailed(),
		r.Refused(), r.ProbeFailures(), l.TotalRelists(), l.TotalStreamCuts(), problems), nil
}
