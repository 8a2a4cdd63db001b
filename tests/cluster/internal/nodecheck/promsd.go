package nodecheck

import (
	corev1 "k8s.io/api/core/v1"
)

// TargetGroup is one entry of a Prometheus file_sd file.
type TargetGroup struct {
	Targets []string          `json:"targets"`
	Labels  map[string]string `json:"labels"`
}

// PodTargets are the target groups Prometheus's Kubernetes pod discovery gives for pods: one
// per container (init containers too) of each pod with an IP, with its __meta_kubernetes_pod
// labels.
func PodTargets(pods []corev1.Pod) []TargetGroup {
	groups := []TargetGroup{}
	for _, p := range pods {
		if p.Status.PodIP == "" {
			continue
		}
		for _, cs := range []struct {
			init       string
			containers []corev1.Container
		}{{"true", p.Spec.InitContainers}, {"false", p.Spec.Containers}} {
			for _, c := range cs.containers {
				groups = append(groups, TargetGroup{Targets: []string{p.Status.PodIP}, Labels: map[string]string{
					"__meta_kubernetes_namespace":          p.Namespace,
					"__meta_kubernetes_pod_name":           p.Name,
					"__meta_kubernetes_pod_ip":             p.Status.PodIP,
					"__meta_kubernetes_pod_node_name":      p.Spec.NodeName,
					"__meta_kubernetes_pod_phase":          string(p.Status.Phase),
					"__meta_kubernetes_pod_container_name": c.Name,
					"__meta_kubernetes_pod_container_init": cs.init,
				}})
			}
		}
	}
	return groups
}
