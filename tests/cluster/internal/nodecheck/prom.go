package nodecheck

import (
	"cmp"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"
)

// PromAnswer is what Prometheus's HTTP API answers to a query (/api/v1/query) or for its
// targets (/api/v1/targets).
type PromAnswer struct {
	Data struct {
		Result []struct {
			Metric map[string]string `json:"metric"`
			Value  []any             `json:"value"`  // [time, "value"] of an instant vector
			Values [][]any           `json:"values"` // the same for each point of a range
		} `json:"result"`
		ActiveTargets []struct {
			Labels    map[string]string `json:"labels"`
			Health    string            `json:"health"`
			LastError string            `json:"lastError"`
		} `json:"activeTargets"`
	} `json:"data"`
}

// Values are the values of an instant query, space-separated ("none" if empty).
func (a *PromAnswer) Values() string {
	var v []string
	for _, r := range a.Data.Result {
		if len(r.Value) == 2 {
			v = append(v, fmt.Sprint(r.Value[1]))
		}
	}
	return cmp.Or(strings.Join(v, " "), "none")
}

// AlertNames are the sorted alertname labels of a query's result ("none" if empty).
func (a *PromAnswer) AlertNames() string {
	var v []string
	for _, r := range a.Data.Result {
		name, ok := r.Metric["alertname"]
		if !ok {
			name = "?"
		}
		v = append(v, name)
	}
	sort.Strings(v)
	return cmp.Or(strings.Join(v, " "), "none")
}

// Times are the times (UTC, HH:MM:SS) of every point of a range query ("none" if none).
func (a *PromAnswer) Times() string {
	var v []string
	for _, r := range a.Data.Result {
		for _, p := range r.Values {
			if len(p) > 0 {
				if t, ok := p[0].(float64); ok {
					v = append(v, time.Unix(int64(t), 0).UTC().Format("15:04:05"))
				}
			}
		}
	}
	return cmp.Or(strings.Join(v, " "), "none")
}

// OneTargetUp: exactly one active target, and it is up.
func (a *PromAnswer) OneTargetUp() bool {
	t := a.Data.ActiveTargets
	return len(t) == 1 && t[0].Health == "up"
}

// Targets are "LABELS HEALTH" of each active target (labels as JSON), and their last errors.
func (a *PromAnswer) Targets() (targets, errors string) {
	var ts, es []string
	for _, t := range a.Data.ActiveTargets {
		labels, _ := json.Marshal(t.Labels)
		ts = append(ts, string(labels)+" "+t.Health)
		es = append(es, fmt.Sprintf("%q", t.LastError))
	}
	return strings.Join(ts, " "), "[" + strings.Join(es, ", ") + "]"
}
