// Package nodecheck holds the checks of the real-kubelet stage (tests/cluster/node) over what
// the kubelet and the apiserver answer: pods, the node, Deployments, checkpoints. Each is a
// pure function of decoded objects: the scenarios (internal/node) call them, and cmd/nodecheck
// prints the verdicts of the few that smoke's shell asks while it sets the node up.
package nodecheck

import (
	"fmt"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// Ready: the pod's Ready condition is True.
func Ready(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// ReadyWithPrefix: some pod named PREFIX-… is Ready (a static pod is NAME-NODE).
func ReadyWithPrefix(pods *corev1.PodList, prefix string) bool {
	for i := range pods.Items {
		if strings.HasPrefix(pods.Items[i].Name, prefix+"-") && Ready(&pods.Items[i]) {
			return true
		}
	}
	return false
}

// Named is the pod called name, nil if none.
func Named(pods *corev1.PodList, name string) *corev1.Pod {
	for i := range pods.Items {
		if pods.Items[i].Name == name {
			return &pods.Items[i]
		}
	}
	return nil
}

// Running: a pod called name is in phase Running.
func Running(pods *corev1.PodList, name string) bool {
	for i := range pods.Items {
		if pods.Items[i].Name == name && pods.Items[i].Status.Phase == corev1.PodRunning {
			return true
		}
	}
	return false
}

// Lines are "name node phase" of each pod ("-" for no node, "None" for no phase).
func Lines(pods *corev1.PodList) []string {
	var lines []string
	for _, p := range pods.Items {
		node, phase := p.Spec.NodeName, string(p.Status.Phase)
		if node == "" {
			node = "-"
		}
		if phase == "" {
			phase = "None"
		}
		lines = append(lines, fmt.Sprintf("%s %s %s", p.Name, node, phase))
	}
	return lines
}

// NodeReady is the node's Ready condition as "STATUS REASON: MESSAGE" ("" without one).
func NodeReady(n *corev1.Node) string {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return fmt.Sprintf("%s %s: %s", c.Status, c.Reason, c.Message)
		}
	}
	return ""
}

// RolloutDone: what `kubectl rollout status` waits for. The controller saw the latest
// generation, and all replicas are updated, available and ready, with no old ones left.
func RolloutDone(d *appsv1.Deployment) bool {
	if d.Spec.Replicas == nil || *d.Spec.Replicas == 0 {
		// Zero counts are left out of the status: a Deployment of no replicas never shows
		// them complete (as the check this replaces).
		return false
	}
	want, st := *d.Spec.Replicas, d.Status
	return st.ObservedGeneration >= d.Generation && st.UpdatedReplicas == want && st.Replicas == want &&
		st.AvailableReplicas == want && st.ReadyReplicas == want
}

// ArgIndex is the index of the first argument of the template's first container that starts
// with prefix (-1 if none): the place a JSON patch replaces.
func ArgIndex(d *appsv1.Deployment, prefix string) int {
	if len(d.Spec.Template.Spec.Containers) == 0 {
		return -1
	}
	for i, a := range d.Spec.Template.Spec.Containers[0].Args {
		if strings.HasPrefix(a, prefix) {
			return i
		}
	}
	return -1
}

// FlagValues are the values of every FLAG=… in the command and args of the pod's container.
func FlagValues(p *corev1.Pod, container, flag string) []string {
	var values []string
	for _, c := range p.Spec.Containers {
		if c.Name != container {
			continue
		}
		for _, a := range append(append([]string{}, c.Command...), c.Args...) {
			if v, ok := strings.CutPrefix(a, flag+"="); ok {
				values = append(values, v)
			}
		}
	}
	return values
}

// CheckpointProblems lists how a checkpoint (the proxy's static-pod copy of the Deployment's
// pod) falls short of a static pod of its own: its name, the Deployment's labels, fields of
// the API's pod (spec keys present at all), the service account's volumes, the proxy's
// --retire-file. specKeys are the keys of the file's spec as written.
func CheckpointProblems(p *corev1.Pod, specKeys map[string]bool) []string {
	var bad []string
	if p.Name != "kube-apiserver-checkpoint" {
		bad = append(bad, "name")
	}
	if p.Labels["component"] == "kube-apiserver" {
		bad = append(bad, "Deployment labels kept")
	}
	for _, k := range []string{"nodeName", "serviceAccountName", "priority"} {
		if specKeys[k] {
			bad = append(bad, k+" kept")
		}
	}
	for _, v := range p.Spec.Volumes {
		if v.Projected != nil || v.Secret != nil {
			bad = append(bad, "volume "+v.Name+" kept")
		}
	}
	var proxy *corev1.Container
	for i := range p.Spec.Containers {
		if p.Spec.Containers[i].Name == "proxy" {
			proxy = &p.Spec.Containers[i]
			break
		}
	}
	if proxy == nil {
		return append(bad, "no proxy container")
	}
	retire := false
	for _, a := range append(append([]string{}, proxy.Command...), proxy.Args...) {
		retire = retire || strings.HasPrefix(a, "--retire-file=")
	}
	if !retire {
		bad = append(bad, "no --retire-file")
	}
	return bad
}

// AtLeast: version MAJOR.MINOR (kubectl's "1", "36+") is at least want ("1.36").
func AtLeast(major, minor, want string) (bool, error) {
	wantMajor, wantMinor, ok := strings.Cut(want, ".")
	if !ok {
		return false, fmt.Errorf("want MAJOR.MINOR, not %q", want)
	}
	var v [4]int
	for i, s := range []string{major, strings.TrimRight(minor, "+"), wantMajor, wantMinor} {
		n, err := strconv.Atoi(s)
		if err != nil {
			return false, fmt.Errorf("version %s.%s (want %s): %w", major, minor, want, err)
		}
		v[i] = n
	}
	return v[0] > v[2] || v[0] == v[2] && v[1] >= v[3], nil
}
