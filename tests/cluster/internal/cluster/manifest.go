package cluster

import (
	"fmt"
	"os"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
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

// RenderTemplate renders the kustomization in dir (an overlay of manifests/) as
// `kubectl kustomize` does and returns its kube-apiserver Deployment's pod template.
func RenderTemplate(dir string) (*Template, error) {
	resources, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize %s: %w", dir, err)
	}
	for _, r := range resources.Resources() {
		if r.GetKind() != "Deployment" || r.GetName() != "kube-apiserver" {
			continue
		}
		raw, err := r.AsYAML()
		if err != nil {
			return nil, err
		}
		var d appsv1.Deployment
		if err := yaml.Unmarshal(raw, &d); err != nil {
			return nil, fmt.Errorf("%s: %w", dir, err)
		}
		return &Template{Spec: d.Spec.Template.Spec}, nil
	}
	return nil, fmt.Errorf("%s renders no Deployment kube-apiserver", dir)
}

// WithoutAPIServerArg returns a copy of the template whose kube-apiserver container lacks the
// arguments starting with prefix (the flags of another overlay, or of an older install).
func (t *Template) WithoutAPIServerArg(prefix string) *Template {
	return t.WithoutArg("kube-apiserver", prefix)
}

// WithoutArg returns a copy of the template whose container lacks the arguments starting
// with prefix.
func (t *Template) WithoutArg(container, prefix string) *Template {
	out := &Template{Spec: *t.Spec.DeepCopy()}
	for i, c := range out.Spec.Containers {
		if c.Name != container {
			continue
		}
		var args []string
		for _, a := range c.Args {
			if !strings.HasPrefix(a, prefix) {
				args = append(args, a)
			}
		}
		out.Spec.Containers[i].Args = args
	}
	return out
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
