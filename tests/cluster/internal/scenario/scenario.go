// Package scenario holds the rehearsal's scenarios: one node, one etcd, the Deployment's pods
// replaced one by one under a client-go load (and in ha.go an HA control plane of two more
// controllers on the same etcd).
package scenario

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"kube-apiserver-proxy/tests/cluster/internal/cluster"
	"kube-apiserver-proxy/tests/cluster/internal/load"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// Options of a run.
type Options struct {
	Repo, Proxy, HAProxy     string
	APIServerOld, OldVersion string
	APIServer, Version       string
	Kubeadm, Etcd, NodeIP    string
	// PlantedProxy: the proxy built with its planted faults, for the self-test scenarios.
	PlantedProxy string
	// PreviousProxy and PreviousManifests: the previous release's binary and its manifests
	// directory (tests/previous-release), for the scenario previous-release.
	PreviousProxy, PreviousManifests string
	Work                             string
	Rollouts, ProxyUID               int
	Only                             map[string]bool
	APIServerArgs                    []string
}

// Results of a run, written as JSON.
type Results struct {
	Node      string        `json:"node_ip"`
	Versions  []string      `json:"versions"`
	Duration  time.Duration `json:"duration_ns"`
	Scenarios []*Result     `json:"scenarios"`
}

// Result of one scenario.
type Result struct {
	Name         string              `json:"name"`
	Design       cluster.Design      `json:"design,omitempty"`
	Gate         cluster.Gate        `json:"gate,omitempty"`
	Passed       bool                `json:"passed"`
	Duration     time.Duration       `json:"duration_ns"`
	Rollouts     []Rollout           `json:"rollouts,omitempty"`
	Load         *load.Report        `json:"load,omitempty"`
	TCP          cluster.TCPCounters `json:"tcp,omitempty"`
	EmptyKubeSvc []cluster.Gap       `json:"kubernetes_service_empty,omitempty"`
	// AddressAbsent: intervals in which one controller's address was missing from
	// default/kubernetes while others were listed (HA control planes).
	AddressAbsent []cluster.Absence `json:"kubernetes_service_address_absent,omitempty"`
	// Proxies: each proxy process sampled during the scenario, its descriptors and memory
	// from the first samples to the last (leaks.go).
	Proxies []cluster.ProxyLife `json:"proxies,omitempty"`
	// Record is the scenario's checks: each failure a problem, each note a figure (in the
	// JSON as "problems" and "notes").
	report.Record
}

// MarshalJSON is the result with its record's failures as "problems" and its notes as "notes".
func (r *Result) MarshalJSON() ([]byte, error) {
	type fields Result
	return json.Marshal(struct {
		*fields
		Problems []string `json:"problems,omitempty"`
		Notes    []string `json:"notes,omitempty"`
	}{(*fields)(r), r.Failures(), r.Notes()})
}

// Rollout is one pod replaced by the next.
type Rollout struct {
	From        string              `json:"from"`
	To          string              `json:"to"`
	Ready       time.Duration       `json:"ready_after_ns"`
	OldStopped  time.Duration       `json:"old_stopped_after_ns"`
	Termination cluster.Termination `json:"termination"`
}

// env is the state shared by the scenarios: the node and the pod currently serving.
type env struct {
	o       Options
	node    *cluster.Node
	tmpl    *cluster.Template
	current *cluster.Pod
	seq     int
	eps     *cluster.EndpointsWatcher
}

// RunAll sets the node up and runs every scenario in order (each starts from the pod the
// previous one left serving).
func RunAll(ctx context.Context, o Options) *Results {
	res := &Results{Node: o.NodeIP, Versions: []string{o.OldVersion, o.Version}}
	e := &env{o: o}
	defer e.cleanup()
	setup := &Result{Name: "setup"}
	res.Scenarios = append(res.Scenarios, setup)
	began := time.Now()
	if err := e.setup(ctx); err != nil {
		setup.Fail("%v", err)
		printResult(os.Stdout, setup)
		return res
	}
	setup.Passed = true
	setup.Duration = time.Since(began)
	printResult(os.Stdout, setup)

	for _, s := range scenarios() {
		if o.Only != nil && !o.Only[s.name] || o.Only == nil && byHand[s.name] {
			continue
		}
		r := &Result{Name: s.name}
		res.Scenarios = append(res.Scenarios, r)
		began := time.Now()
		e.eps.Take()
		e.eps.TakeErrors()
		e.node.Leaks.Take()
		s.run(ctx, e, r)
		// Every proxy of this project's design that lived through the scenario: back to its
		// baseline of descriptors and memory (the HAProxy design is not sampled). A self-test
		// took its planted pods' samples already, as its own.
		lives := e.node.Leaks.Take()
		for _, p := range cluster.LeakProblems(lives) {
			r.Fail("%s", p)
		}
		r.Proxies = append(r.Proxies, lives...)
		behind := e.eps.Behind(ctx)
		r.EmptyKubeSvc = append(r.EmptyKubeSvc, e.eps.Take()...)
		watchErrors := e.eps.TakeErrors()
		if behind != "" {
			watchErrors = append(watchErrors, behind)
		}
		// With --endpoint-reconciler-type=none no rollout of this proxy's design may leave
		// in-cluster clients without the Service's address, not even for a moment; and the
		// watcher, a client of the node address too, must not lose its watch.
		if r.Design == cluster.Sidecar {
			for _, g := range r.EmptyKubeSvc {
				r.Fail("default/kubernetes %s without a ready address for %s from %s", g.Object, g.Duration.Round(time.Millisecond), g.From.Format("15:04:05.000"))
			}
			for _, err := range watchErrors {
				r.Fail("the default/kubernetes watcher's watch failed: %s", err)
			}
			if want := s.rollouts(o); len(r.Rollouts) != want {
				r.Fail("%d rollouts completed, %d asked for", len(r.Rollouts), want)
			}
		}
		if ctx.Err() != nil {
			r.Fail("interrupted: %v", ctx.Err())
		}
		// Each scenario starts from the pod the previous one left: it must be the shipped
		// design with the proxy under test (a comparison's or a planted proxy's stop would
		// be counted against the next scenario's load).
		if c := e.current; c != nil && (c.Opts.Design != cluster.Sidecar || c.Opts.Proxy != o.Proxy) {
			r.Fail("left %s serving (design %s, proxy %s) instead of the shipped design with the proxy under test", c.Opts.Name, c.Opts.Design, c.Opts.Proxy)
		}
		r.Duration = time.Since(began)
		r.Passed = r.Failed() == 0
		printResult(os.Stdout, r)
		if e.current == nil || ctx.Err() != nil {
			break
		}
	}
	return res
}

func (e *env) setup(ctx context.Context) error {
	var err error
	// The Deployment as the single-controller overlay renders it (kube-apiserver with
	// --endpoint-reconciler-type=none, among others).
	if e.tmpl, err = cluster.RenderTemplate(filepath.Join(e.o.Repo, "manifests", "single-controller")); err != nil {
		return err
	}
	if e.node, err = cluster.NewNode(ctx, e.o.Kubeadm, filepath.Join(e.o.Work, "node"), e.o.NodeIP, e.o.Version, e.o.ProxyUID); err != nil {
		return fmt.Errorf("kubeadm: %w", err)
	}
	e.node.Leaks = cluster.StartLeakWatch()
	if err := e.node.StartEtcd(ctx, e.o.Etcd); err != nil {
		return err
	}
	// The first pod runs the older version: the upgrade scenario rolls it to the newer one.
	if e.current, err = e.startPod(ctx, cluster.Sidecar, e.o.APIServerOld, nil, nil); err != nil {
		return err
	}
	if err := e.current.WaitReady(ctx, cluster.GatePod, 3*time.Minute); err != nil {
		return err
	}
	if err := grantAdmins(ctx, filepath.Join(e.node.Dir, "super-admin.conf")); err != nil {
		return err
	}
	// The overlay's apiserver writes no endpoints: they are applied once, as
	// docs/operations.md says.
	if err := cluster.ApplyKubernetesEndpoints(ctx, e.node.AdminConf, e.o.Proxy, e.o.NodeIP); err != nil {
		return err
	}
	if e.eps, err = cluster.WatchEndpoints(ctx, e.node.AdminConf); err != nil {
		return err
	}
	for _, object := range []string{"endpoints", "endpointslice"} {
		if e.eps.Empty(object) {
			return fmt.Errorf("default/kubernetes %s without a ready address after kubernetes-endpoints was applied", object)
		}
	}
	return nil
}

// grantAdmins binds kubeadm's admin.conf group to cluster-admin, as `kubeadm init` does
// (with superAdmin, kubeadm's super-admin.conf, whose group is system:masters).
func grantAdmins(ctx context.Context, superAdmin string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", superAdmin)
	if err != nil {
		return err
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	_, err = c.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "kubeadm:cluster-admins"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "cluster-admin"},
		Subjects:   []rbacv1.Subject{{Kind: "Group", APIGroup: "rbac.authorization.k8s.io", Name: "kubeadm:cluster-admins"}},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create ClusterRoleBinding kubeadm:cluster-admins: %w", err)
	}
	return nil
}

func (e *env) startPod(ctx context.Context, design cluster.Design, apiserver string, apiArgs, proxyArgs []string) (*cluster.Pod, error) {
	e.seq++
	return cluster.StartPod(ctx, e.node, e.tmpl, cluster.PodOptions{
		Name:               fmt.Sprintf("pod-%02d", e.seq),
		Design:             design,
		APIServer:          apiserver,
		Proxy:              e.o.Proxy,
		HAProxy:            e.o.HAProxy,
		ExtraAPIServerArgs: append(append([]string{}, e.o.APIServerArgs...), apiArgs...),
		ExtraProxyArgs:     proxyArgs,
	})
}

// rollout replaces the current pod as the Deployment does with maxSurge 1, maxUnavailable 0:
// start the new pod beside the old one, wait for gate, then stop the old pod (SIGTERM to all
// its containers together, SIGKILL after the grace period), and wait until it is gone.
func (e *env) rollout(ctx context.Context, r *Result, design cluster.Design, gate cluster.Gate, apiserver string, apiArgs, proxyArgs []string) bool {
	return step(ctx, r, "", gate, &e.current, func() (*cluster.Pod, error) {
		return e.startPod(ctx, design, apiserver, apiArgs, proxyArgs)
	})
}

// step is one rollout step of the pod *current: start the next one, wait for gate, stop the
// old one, and record it in r; prefix goes before every problem it reports.
func step(ctx context.Context, r *Result, prefix string, gate cluster.Gate, current **cluster.Pod, start func() (*cluster.Pod, error)) bool {
	began := time.Now()
	next, err := start()
	if err != nil {
		r.Fail("%sstart pod: %v", prefix, err)
		return false
	}
	if err := next.WaitReady(ctx, gate, 3*time.Minute); err != nil {
		r.Fail("%s%v", prefix, err)
		next.Kill()
		return false
	}
	ready := time.Since(began)
	old := *current
	*current = next
	t := old.Terminate()
	r.Rollouts = append(r.Rollouts, Rollout{
		From: old.Opts.Name, To: next.Opts.Name, Ready: ready, OldStopped: time.Since(began), Termination: t,
	})
	if len(t.Killed) > 0 {
		msg := fmt.Sprintf("%srollout %s -> %s: %v did not exit within the grace period (SIGKILLed)", prefix, old.Opts.Name, next.Opts.Name, t.Killed)
		if r.Design == cluster.HAProxy {
			// The comparison's figures, not a claim of this project.
			r.Note("%s", msg)
		} else {
			r.Fail("%s", msg)
		}
	}
	return true
}

func (e *env) cleanup() {
	if e.eps != nil {
		e.eps.Stop()
	}
	if e.current != nil {
		e.current.Kill()
	}
	if e.node != nil {
		e.node.Leaks.Stop()
		e.node.Stop()
	}
}

// printResult says a scenario's result as the rehearsal prints it: "PASS NAME (DURATION)" or
// "FAIL …" with the load's summary, then each problem and each note on an indented line.
func printResult(w io.Writer, r *Result) {
	status := "PASS"
	if !r.Passed {
		status = "FAIL"
	}
	line := fmt.Sprintf("%s %s (%s)", status, r.Name, r.Duration.Round(time.Second))
	if r.Load != nil {
		line += fmt.Sprintf(": %d rollouts, %s", len(r.Rollouts), r.Load.Summary())
	}
	if len(r.EmptyKubeSvc) > 0 {
		var longest time.Duration
		for _, g := range r.EmptyKubeSvc {
			longest = max(longest, g.Duration)
		}
		line += fmt.Sprintf("; default/kubernetes without a ready address %d times (longest %s)", len(r.EmptyKubeSvc), longest.Round(100*time.Millisecond))
	}
	fmt.Fprintln(w, line)
	for _, p := range r.Failures() {
		fmt.Fprintln(w, "    "+p)
	}
	for _, n := range r.Notes() {
		fmt.Fprintln(w, "    note: "+n)
	}
}
