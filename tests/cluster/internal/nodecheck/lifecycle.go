package nodecheck

import (
	"fmt"
	"regexp"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// APIServerPods are "name ready|notready restarts deleting|- node" of every pod that is not a
// mirror pod (owned by the Node): ready when both its containers are.
func APIServerPods(pods *corev1.PodList) []string {
	var lines []string
	for _, p := range pods.Items {
		mirror := false
		for _, o := range p.OwnerReferences {
			mirror = mirror || o.Kind == "Node"
		}
		if mirror {
			continue
		}
		cs := p.Status.ContainerStatuses
		ready, restarts := len(cs) == 2, int32(0)
		for _, c := range cs {
			ready = ready && c.Ready
			restarts += c.RestartCount
		}
		state, deleting, node := "notready", "-", p.Spec.NodeName
		if ready {
			state = "ready"
		}
		if p.DeletionTimestamp != nil {
			deleting = "deleting"
		}
		if node == "" {
			node = "-"
		}
		lines = append(lines, fmt.Sprintf("%s %s %d %s %s", p.Name, state, restarts, deleting, node))
	}
	return lines
}

var digits = regexp.MustCompile(`[0-9]+`)

// EventSummary is "COUNT x MESSAGE; …" of the events on pods named prefix…, the six most
// frequent messages (numbers written N, cut at 140 characters), "none" without any.
func EventSummary(events *corev1.EventList, prefix string) string {
	counts := map[string]int32{}
	var order []string
	for _, e := range events.Items {
		if !strings.HasPrefix(e.InvolvedObject.Name, prefix) {
			continue
		}
		m := []rune(digits.ReplaceAllString(e.Message, "N"))
		msg := string(m[:min(len(m), 140)])
		if _, ok := counts[msg]; !ok {
			order = append(order, msg)
		}
		n := e.Count
		if n == 0 { // left out of the JSON: one
			n = 1
		}
		counts[msg] += n
	}
	// Most frequent first; equal counts in the order first seen.
	sort.SliceStable(order, func(i, j int) bool { return counts[order[i]] > counts[order[j]] })
	var parts []string
	for _, m := range order[:min(len(order), 6)] {
		parts = append(parts, fmt.Sprintf("%d x %s", counts[m], m))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, "; ")
}
