package cluster

import (
	"fmt"
	"os"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// Template is the pod template of the shipped Deployment (manifests/base/deployment.yaml):
// the rehearsal runs its containers with their commands, arguments and probes as written,
// only the paths of its volumes and images mapped onto the node's directories.
type Template struct {
	Spec corev1.PodSpec
}

// LoadTemplate reads the Deployment's pod template from path.
func LoadTemplate(path string) (*Template, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var d appsv1.Deployment
	if err := yaml.Unmarshal(raw, &d); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if d.Kind != "Deployment" {
		return nil, fmt.Errorf("%s: kind %q, want Deployment", path, d.Kind)
	}
	return &Template{Spec: d.Spec.Template.Spec}, nil
}

// Container returns the named container (or init container).
func (t *Template) Container(name string) (corev1.Container, error) {
	for _, c := range append(append([]corev1.Container{}, t.Spec.InitContainers...), t.Spec.Containers...) {
		if c.Name == name {
			return c, nil
		}
	}
	return corev1.Container{}, fmt.Errorf("manifest has no container %q", name)
}

// Mapping says where a pod's paths live on this node.
type Mapping struct {
	// Exact replaces whole arguments (the commands of the images: binaries here).
	Exact map[string]string
	// Prefix replaces path prefixes and variables inside arguments, in order.
	Prefix [][2]string
}

// Apply maps every argument.
func (m Mapping) Apply(argv []string) []string {
	out := make([]string, 0, len(argv))
	for _, a := range argv {
		if v, ok := m.Exact[a]; ok {
			out = append(out, v)
			continue
		}
		for _, p := range m.Prefix {
			a = strings.ReplaceAll(a, p[0], p[1])
		}
		out = append(out, a)
	}
	return out
}

// Argv is a container's command followed by its args.
func Argv(c corev1.Container) []string {
	return append(append([]string{}, c.Command...), c.Args...)
}
