package scenario

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/await"
	"kube-apiserver-proxy/tests/cluster/internal/cluster"
)

// haEtcdPrefix keeps the HA control plane's objects apart from the single controller's in the
// one etcd: its own default/kubernetes, its own endpoint leases, nothing of the single
// controller's touched.
const haEtcdPrefix = "/registry-ha-surge"

// haController is one controller of the HA control plane: its node and the pod serving it.
type haController struct {
	name string
	node *cluster.Node
	pod  *cluster.Pod
	seq  int
	// removeAddress takes the controller's address off the interface again.
	removeAddress func() error
}

// haSurgeKubernetesService: the `kubernetes` Service of an HA control plane as
// manifests/ha-surge ships it (kube-apiserver's default lease endpoint reconciler,
// --advertise-address = the controller's address) with two controllers on their own
// addresses, sharing the PKI and the etcd. Controller a is rolled --rollouts times the way
// ha-surge does a step on one node (the new pod beside the old one, its proxy takes the
// listening socket, the old pod stopped) under the client-go load on a's address. Each step
// removes a's address from default/kubernetes twice (the new apiserver at its start, the old
// one at SIGTERM; both hold the one lease keyed by that address) until the next reconcile;
// b's address must keep the Service non-empty throughout. How long a's address was missing
// is recorded per step, not asserted.
func haSurgeKubernetesService(ctx context.Context, e *env, r *Result) {
	haSurge(ctx, e, r, 2)
}

// haSurge runs haSurgeKubernetesService with n controllers (the first is rolled; the
// default/kubernetes watcher and the admin RBAC go through the last).
func haSurge(ctx context.Context, e *env, r *Result, n int) {
	r.Design, r.Gate = cluster.Sidecar, cluster.GatePod
	tmpl, err := cluster.RenderTemplate(filepath.Join(e.o.Repo, "manifests", "ha-surge"))
	if err != nil {
		r.Fail("%v", err)
		return
	}
	api, err := tmpl.Container("kube-apiserver")
	if err != nil {
		r.Fail("%v", err)
		return
	}
	for _, a := range api.Args {
		if strings.HasPrefix(a, "--endpoint-reconciler-type=") && a != "--endpoint-reconciler-type=lease" {
			r.Fail("manifests/ha-surge renders kube-apiserver with %s; this scenario is about the lease reconciler", a)
			return
		}
	}
	// Every controller's proxy also listens on 127.0.0.1:6443, its node's loopback. Here all
	// controllers share one namespace, whose 127.0.0.1:6443 is the single controller's.
	tmpl = tmpl.WithoutArg("proxy", "--listen=127.0.0.1:")

	ctrls, ok := startControllers(ctx, e, r, tmpl, n)
	// The next scenarios find the node as before: one controller, one address.
	defer func() {
		for _, c := range ctrls {
			if c.pod != nil {
				c.pod.Kill()
			}
			if err := c.removeAddress(); err != nil {
				r.Fail("remove controller address %s: %v", c.node.IP, err)
			}
		}
	}()
	if !ok {
		return
	}
	a, last := ctrls[0], ctrls[len(ctrls)-1]
	kubeconfig := func(c *haController, name string) string { return filepath.Join(c.node.Dir, name) }
	for _, c := range ctrls {
		for _, name := range []string{"admin.conf", "super-admin.conf"} {
			if err := cluster.Kubeconfig(filepath.Join(e.node.Dir, name), kubeconfig(c, name), "https://"+net.JoinHostPort(c.node.IP, "6443")); err != nil {
				r.Fail("%v", err)
				return
			}
		}
	}
	if err := grantAdmins(ctx, kubeconfig(last, "super-admin.conf")); err != nil {
		r.Fail("%v", err)
		return
	}
	eps, err := cluster.WatchEndpoints(ctx, kubeconfig(last, "admin.conf"))
	if err != nil {
		r.Fail("watch default/kubernetes: %v", err)
		return
	}
	defer eps.Stop()
	for _, c := range ctrls {
		eps.Track(c.node.IP)
	}
	listed := func(ip string) bool { return eps.Lists("endpoints", ip) && eps.Lists("endpointslice", ip) }
	if !await.Holds(ctx, 100*time.Millisecond, 60*time.Second, func() bool {
		for _, c := range ctrls {
			if !listed(c.node.IP) {
				return false
			}
		}
		return true
	}) {
		r.Fail("default/kubernetes does not list every controller's address 60s after they were ready")
		return
	}
	// The start-up (an empty Service until the first apiserver is ready) is not measured.
	eps.Take()
	eps.TakeAbsences()

	first, err := a.pod.ListenerCookies()
	if err != nil || len(first) == 0 {
		r.Fail("pod %s holds no listening socket (%v)", a.pod.Opts.Name, err)
		return
	}
	underLoadOn(ctx, kubeconfig(a, "admin.conf"), r, true, func() {
		for i := 0; i < e.o.Rollouts && ctx.Err() == nil; i++ {
			if !a.roll(ctx, e, r, tmpl) {
				return
			}
			// The new apiserver adds a's address at its first reconcile after it is ready
			// (every 10 s, not configurable).
			if !await.Holds(ctx, 100*time.Millisecond, 60*time.Second, func() bool { return listed(a.node.IP) }) {
				r.Fail("step %d: %s's address not back in default/kubernetes 60s after the old pod stopped", i+1, a.name)
			}
			absent := eps.TakeAbsences()
			r.AddressAbsent = append(r.AddressAbsent, absent...)
			r.Note("step %d on %s: %s", i+1, a.name, describeAbsences(absent, ctrls))
			now, err := a.pod.ListenerCookies()
			if err != nil || !slices.Equal(now, first) {
				r.Fail("after step %d pod %s holds listening sockets %v (%v), want the first pod's %v",
					i+1, a.pod.Opts.Name, now, err, first)
			}
		}
	})
	// Every interval without any ready address fails the scenario (RunAll).
	r.EmptyKubeSvc = append(r.EmptyKubeSvc, eps.Take()...)
	r.AddressAbsent = append(r.AddressAbsent, eps.TakeAbsences()...)
}

// startControllers puts n controller addresses next to the node address (its last byte + 1,
// + 2, …) and starts one pod on each, all ready.
func startControllers(ctx context.Context, e *env, r *Result, tmpl *cluster.Template, n int) ([]*haController, bool) {
	base := net.ParseIP(e.o.NodeIP).To4()
	if base == nil {
		r.Fail("node address %s is not IPv4", e.o.NodeIP)
		return nil, false
	}
	var ctrls []*haController
	for i := 0; i < n; i++ {
		ip := net.IPv4(base[0], base[1], base[2], base[3]+byte(i+1)).String()
		c := &haController{name: string(rune('a' + i))}
		var err error
		if c.node, err = e.node.Controller(c.name, ip); err != nil {
			r.Fail("%v", err)
			return ctrls, false
		}
		if c.removeAddress, err = e.node.AddAddress(ctx, ip); err != nil {
			r.Fail("controller address %s: %v", ip, err)
			return ctrls, false
		}
		ctrls = append(ctrls, c)
		if c.pod, err = c.start(ctx, e, tmpl); err != nil {
			r.Fail("controller %s: start pod: %v", c.name, err)
			return ctrls, false
		}
	}
	for _, c := range ctrls {
		if err := c.pod.WaitReady(ctx, cluster.GatePod, 3*time.Minute); err != nil {
			r.Fail("controller %s: %v", c.name, err)
			return ctrls, false
		}
	}
	return ctrls, true
}

func (c *haController) start(ctx context.Context, e *env, tmpl *cluster.Template) (*cluster.Pod, error) {
	c.seq++
	return cluster.StartPod(ctx, c.node, tmpl, cluster.PodOptions{
		Name:               fmt.Sprintf("%s-%02d", c.name, c.seq),
		Design:             cluster.Sidecar,
		APIServer:          e.o.APIServer,
		Proxy:              e.o.Proxy,
		ExtraAPIServerArgs: append(append([]string{}, e.o.APIServerArgs...), "--etcd-prefix="+haEtcdPrefix),
	})
}

// roll replaces the controller's pod as a step of ha-surge's rollout does on that node: the
// new pod beside the old one, ready, then the old pod stopped (as env.rollout).
func (c *haController) roll(ctx context.Context, e *env, r *Result, tmpl *cluster.Template) bool {
	return step(ctx, r, "controller "+c.name+": ", cluster.GatePod, &c.pod, func() (*cluster.Pod, error) {
		return c.start(ctx, e, tmpl)
	})
}

// describeAbsences says, per controller and object, how often and how long its address was
// missing: "a (192.0.2.11) missing from endpoints 2x, 9.1s in all (longest 6.0s); …".
func describeAbsences(absent []cluster.Absence, ctrls []*haController) string {
	var parts []string
	for _, c := range ctrls {
		for _, object := range []string{"endpoints", "endpointslice"} {
			var count int
			var total, longest time.Duration
			for _, a := range absent {
				if a.Address == c.node.IP && a.Object == object {
					count++
					total += a.Duration
					longest = max(longest, a.Duration)
				}
			}
			if count > 0 {
				parts = append(parts, fmt.Sprintf("%s (%s) missing from %s %dx, %s in all (longest %s)",
					c.name, c.node.IP, object, count, total.Round(100*time.Millisecond), longest.Round(100*time.Millisecond)))
			}
		}
	}
	if len(parts) == 0 {
		return "no controller's address missing from default/kubernetes"
	}
	return strings.Join(parts, "; ")
}
