package nodecheck

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// PromFiles are what a plain Prometheus needs to scrape as prometheus-operator would for
// manifests/monitoring: its configuration, the PrometheusRule's rules and the PodMonitor's
// pod selector (matchLabels, for the file-based discovery that stands in for Kubernetes's).
type PromFiles struct {
	Config, Rules, Selector []byte
}

// ControlPrefix names the control copy of each alert (WithControls).
const ControlPrefix = "Control"

// WithControls is the PrometheusRule's spec with a group more, "controls": a copy of every
// alert rule, renamed ControlPrefix+name and without its `for`, so that it fires as soon as
// its expression matches. A check that no alert fired passes as well when no expression ever
// matches a series (a metric renamed, a label that the scrape does not set); the controls
// whose condition the run brings about (two pods of a rollout at once, the recovery agent
// absent) must fire, which proves the rules are evaluated against the series the node
// exports. The shipped alerts keep their names (KubeApiserverProxy…): the controls never
// match an alert name check. Pure (spec is not changed).
func WithControls(spec map[string]any) map[string]any {
	out := map[string]any{}
	for k, v := range spec {
		out[k] = v
	}
	groups, _ := spec["groups"].([]any)
	var controls []any
	for _, g := range groups {
		group, _ := g.(map[string]any)
		rules, _ := group["rules"].([]any)
		for _, r := range rules {
			rule, _ := r.(map[string]any)
			name, ok := rule["alert"].(string)
			if !ok {
				continue
			}
			control := map[string]any{"alert": ControlPrefix + name, "expr": rule["expr"]}
			if labels, ok := rule["labels"]; ok {
				control["labels"] = labels
			}
			controls = append(controls, control)
		}
	}
	out["groups"] = append(append([]any{}, groups...), map[string]any{"name": "controls", "rules": controls})
	return out
}

// PromConfig makes PromFiles from the rendered manifests/monitoring (YAML documents); state
// is the directory the files go to (the rules file and the discovery file are named in the
// configuration).
func PromConfig(manifests io.Reader, state string) (*PromFiles, error) {
	var podMonitor, rule map[string]any
	d := utilyaml.NewYAMLOrJSONDecoder(manifests, 4096)
	for {
		var doc map[string]any
		if err := d.Decode(&doc); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, err
		}
		// The first of each (manifests/monitoring has more PodMonitors: the node's comes first).
		switch {
		case doc["kind"] == "PodMonitor" && podMonitor == nil:
			podMonitor = doc
		case doc["kind"] == "PrometheusRule" && rule == nil:
			rule = doc
		}
	}
	if podMonitor == nil || rule == nil {
		return nil, fmt.Errorf("no PodMonitor or no PrometheusRule in the manifests")
	}
	spec, _ := podMonitor["spec"].(map[string]any)
	meta, _ := podMonitor["metadata"].(map[string]any)
	endpoints, _ := spec["podMetricsEndpoints"].([]any)
	if len(endpoints) == 0 {
		return nil, fmt.Errorf("the PodMonitor has no podMetricsEndpoints")
	}
	ep, _ := endpoints[0].(map[string]any)
	relabel := []any{
		// What prometheus-operator puts first for a PodMonitor (pkg/prometheus/promcfg.go).
		map[string]any{"source_labels": []string{"__meta_kubernetes_pod_phase"}, "regex": "(Failed|Succeeded)", "action": "drop"},
		map[string]any{"source_labels": []string{"__meta_kubernetes_namespace"}, "target_label": "namespace"},
		map[string]any{"source_labels": []string{"__meta_kubernetes_pod_container_name"}, "target_label": "container"},
		map[string]any{"source_labels": []string{"__meta_kubernetes_pod_name"}, "target_label": "pod"},
		map[string]any{"target_label": "job", "replacement": fmt.Sprintf("%v/%v", meta["namespace"], meta["name"])},
	}
	snake := map[string]string{"sourceLabels": "source_labels", "targetLabel": "target_label"}
	relabelings, _ := ep["relabelings"].([]any)
	for _, r := range relabelings {
		m, _ := r.(map[string]any)
		out := map[string]any{}
		for k, v := range m {
			if s, ok := snake[k]; ok {
				k = s
			}
			out[k] = v
		}
		relabel = append(relabel, out)
	}
	path := "/metrics"
	if p, ok := ep["path"].(string); ok {
		path = p
	}
	cfg := map[string]any{
		"global":     map[string]any{"scrape_interval": "5s", "scrape_timeout": "5s", "evaluation_interval": "5s"},
		"rule_files": []string{state + "/rules.yaml"},
		"scrape_configs": []any{map[string]any{
			"job_name":        "podMonitor/kube-system/kube-apiserver-proxy/0",
			"metrics_path":    path,
			"file_sd_configs": []any{map[string]any{"files": []string{state + "/sd.json"}, "refresh_interval": "2s"}},
			"relabel_configs": relabel,
		}},
	}
	var f PromFiles
	var err error
	if f.Config, err = yaml.Marshal(cfg); err != nil {
		return nil, err
	}
	spec2, _ := rule["spec"].(map[string]any)
	if f.Rules, err = yaml.Marshal(WithControls(spec2)); err != nil {
		return nil, err
	}
	selector, _ := spec["selector"].(map[string]any)
	if f.Selector, err = json.Marshal(selector["matchLabels"]); err != nil {
		return nil, err
	}
	return &f, nil
}
