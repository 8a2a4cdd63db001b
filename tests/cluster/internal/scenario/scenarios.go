package scenario

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/cluster"
	"kube-apiserver-proxy/tests/cluster/internal/load"
)

type spec struct {
	name string
	run  func(ctx context.Context, e *env, r *Result)
}

// scenarios in the order they run; each starts from the pod the previous one left serving.
func scenarios() []spec {
	return []spec{
		{"steady", steady},
		{"upgrade", upgrade},
		{"rollouts-pod-ready", func(ctx context.Context, e *env, r *Result) {
			rollouts(ctx, e, r, cluster.GatePod)
		}},
		{"rollouts-apiserver-ready", func(ctx context.Context, e *env, r *Result) {
			rollouts(ctx, e, r, cluster.GateAPIServer)
		}},
		{"kubernetes-service-switch", kubernetesServiceSwitch},
		{"anonymous-auth-off", anonymousOff},
		{"broken-rollout-stalls", brokenRolloutStalls},
		{"ipv6-node", ipv6Node},
		{"handmade-rollouts", handmadeRollouts},
		{"ha-surge-kubernetes-service", haSurgeKubernetesService},
		{"haproxy-sidecar", haproxySidecar},
	}
}

// steady is the control: the same load for a while with no rollout. Whatever it counts is
// the load's own noise, and it must be none.
func steady(ctx context.Context, e *env, r *Result) {
	r.Design = cluster.Sidecar
	underLoad(ctx, e, r, true, func() {
		select {
		case <-ctx.Done():
		case <-time.After(30 * time.Second):
		}
	})
}

// upgrade rolls the older apiserver version to the newer one on the same etcd.
func upgrade(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.Sidecar, cluster.GatePod
	underLoad(ctx, e, r, true, func() {
		e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, nil, nil)
	})
}

// rollouts replaces the pod --rollouts times, waiting for gate each time. The node address
// is served by one listening socket from the first pod to the last: handed from proxy to
// proxy, never bound again (its SO_COOKIE stays).
func rollouts(ctx context.Context, e *env, r *Result, gate cluster.Gate) {
	r.Design, r.Gate = cluster.Sidecar, gate
	first, err := e.current.ListenerCookies()
	if err != nil || len(first) == 0 {
		r.fail("pod %s holds no listening socket (%v)", e.current.Opts.Name, err)
		return
	}
	underLoad(ctx, e, r, true, func() {
		for i := 0; i < e.o.Rollouts && ctx.Err() == nil; i++ {
			if !e.rollout(ctx, r, cluster.Sidecar, gate, e.o.APIServer, nil, nil) {
				return
			}
			now, err := e.current.ListenerCookies()
			if err != nil || !slices.Equal(now, first) {
				r.fail("after rollout %d pod %s holds listening sockets %v (%v), want the first pod's %v",
					i+1, e.current.Opts.Name, now, err, first)
			}
		}
	})
}

// kubernetesServiceSwitch: the one moment a lease reconciler still runs on a single controller
// (an install from before --endpoint-reconciler-type=none, or kubeadm's static pod at the
// migration): a pod with the lease reconciler rolled in, then rolled out to the overlay's pod,
// as docs/operations.md tells. The stopping lease apiserver is the last of its lease and tries
// to empty the Endpoints (and through them the `kubernetes` EndpointSlice); the admission policy
// of kubernetes-endpoints (applied in setup) denies it that write, so neither view is ever
// without the node address.
func kubernetesServiceSwitch(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.Sidecar, cluster.GatePod
	overlay := e.tmpl
	defer func() { e.tmpl = overlay }()
	underLoad(ctx, e, r, true, func() {
		e.tmpl = overlay.WithoutAPIServerArg("--endpoint-reconciler-type=")
		if !e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, nil, nil) {
			return
		}
		lease := e.current
		e.tmpl = overlay
		if !e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, nil, nil) {
			return
		}
		// The lease apiserver is gone; its last act was the removal, which the policy denied.
		const denied = "Unable to remove endpoints from kubernetes service"
		if log, err := os.ReadFile(lease.APIServerLog()); err != nil {
			r.fail("%v", err)
		} else if line := lineWith(log, denied); line == "" {
			r.fail("the stopping lease apiserver (pod %s) did not log %q: was its removal not attempted, or not denied?", lease.Opts.Name, denied)
		} else if !strings.Contains(line, "kube-apiserver-proxy-kubernetes-endpoints") {
			r.fail("the lease apiserver's removal failed, but not by the policy: %s", line)
		} else {
			r.Notes = append(r.Notes, "the stopping lease apiserver's removal was denied: "+line)
		}
	})
	// Every gap of either view fails the scenario (Run), as for every rollout of this design.
}

// lineWith is the last line of log containing s, or "".
func lineWith(log []byte, s string) string {
	lines := strings.Split(string(log), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], s) {
			return strings.TrimSpace(lines[i])
		}
	}
	return ""
}

// anonymousOff: an apiserver with --anonymous-auth=false, its proxy health-checking /readyz
// with a client certificate of the cluster CA (kubeadm's apiserver-kubelet-client), rolled in
// and out again under load.
func anonymousOff(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.Sidecar, cluster.GatePod
	// kubeadm's keys are 0600 root and the proxy runs as uid 59443: the client certificate
	// reaches it as a Secret would (its own copy, readable by that uid).
	certFile, keyFile, err := e.node.ProxyReadableCopy("apiserver-kubelet-client")
	if err != nil {
		r.fail("%v", err)
		return
	}
	cert := []string{"--health-client-cert=" + certFile, "--health-client-key=" + keyFile}
	underLoad(ctx, e, r, true, func() {
		if e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, []string{"--anonymous-auth=false"}, cert) {
			e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, nil, nil)
		}
	})
}

// brokenRolloutStalls: a new pod whose proxy cannot pass its own apiserver's check (anonymous
// auth off, no client certificate: /readyz answers 401) never becomes ready, the old pod keeps
// serving, and removing the broken pod (the rollback) costs the clients nothing.
func brokenRolloutStalls(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.Sidecar, cluster.GatePod
	underLoad(ctx, e, r, true, func() {
		broken, err := e.startPod(ctx, cluster.Sidecar, e.o.APIServer, []string{"--anonymous-auth=false"}, nil)
		if err != nil {
			r.fail("start pod: %v", err)
			return
		}
		// The apiserver itself becomes ready (its /readyz answers a client certificate)…
		client, err := e.node.APIServerClient(
			filepath.Join(e.node.PKI, "apiserver-kubelet-client.crt"),
			filepath.Join(e.node.PKI, "apiserver-kubelet-client.key"))
		if err != nil {
			r.fail("%v", err)
		} else if !cluster.Eventually(3*time.Minute, time.Second, func() bool {
			return broken.Crashed() != nil || broken.APIServerReadyz(client)
		}) || broken.Crashed() != nil {
			r.fail("broken pod's apiserver never became ready: %v", broken.Crashed())
		}
		// …but the pod must not, however long it is given: 10 probe periods after that.
		if err := broken.WaitReady(ctx, cluster.GatePod, 20*time.Second); err == nil {
			r.fail("pod %s became ready although its proxy cannot check its apiserver", broken.Opts.Name)
		}
		if !e.current.Ready(ctx) {
			r.fail("old pod %s is not ready while the broken rollout stalls", e.current.Opts.Name)
		}
		t := broken.Terminate()
		r.Notes = append(r.Notes, fmt.Sprintf("broken pod removed in %s", t.SidecarStopped.Round(time.Second)))
	})
}

// haproxySidecar runs the same rollouts with the design Lokomotive shipped (HAProxy sidecar,
// readiness = the apiserver's). Its figures are reported, not asserted.
func haproxySidecar(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.HAProxy, cluster.GateAPIServer
	if e.o.HAProxy == "" {
		r.fail("haproxy not found: install it (apt-get install haproxy) to compare")
		return
	}
	// Switch designs first, outside the measurement.
	if !e.rollout(ctx, r, cluster.HAProxy, cluster.GateAPIServer, e.o.APIServer, nil, nil) {
		return
	}
	r.Rollouts = nil
	underLoad(ctx, e, r, false, func() {
		for i := 0; i < e.o.Rollouts && ctx.Err() == nil; i++ {
			if !e.rollout(ctx, r, cluster.HAProxy, cluster.GateAPIServer, e.o.APIServer, nil, nil) {
				return
			}
		}
	})
}

// underLoad runs f under the client-go load and records what the clients saw. strict: every
// failed request, error-caused relist, cut stream and reset is a problem of the scenario.
func underLoad(ctx context.Context, e *env, r *Result, strict bool, f func()) {
	underLoadOn(ctx, e.node.AdminConf, r, strict, f)
}

// underLoadOn is underLoad with the clients of kubeconfig (another controller's address).
func underLoadOn(ctx context.Context, kubeconfig string, r *Result, strict bool, f func()) {
	l, err := load.Start(ctx, load.DefaultConfig(kubeconfig))
	if err != nil {
		r.fail("load: %v", err)
		return
	}
	before := cluster.ReadTCPCounters()
	f()
	r.TCP = cluster.ReadTCPCounters().Since(before)
	rep := l.Stop()
	r.Load = &rep
	if !strict {
		return
	}
	if n := rep.TotalFailed(); n > 0 {
		r.fail("%d client-go requests failed: %v", n, rep.Failures)
		for kind, samples := range rep.Samples {
			for _, s := range samples {
				r.fail("  %s: %s", kind, s)
			}
		}
	}
	if n := rep.TotalRelists(); n > 0 {
		r.fail("%d informer relists (each caused by an error)", n)
	}
	if n := rep.TotalStreamCuts(); n > 0 {
		r.fail("%d long-lived watch requests cut: %v", n, rep.Streams.Cut)
	}
	if n := rep.TotalConnErrors(); n > 0 {
		r.fail("%d client connections failed: dial %v, established %v", n, rep.Connections.DialErrors, rep.Connections.Errors)
	}
	for resource, c := range rep.Informers {
		var kinds []string
		for how := range c.WatchEnds {
			switch how {
			case load.EndedByServer, load.EndedByServerGoaway, load.StoppedByClient, load.ErrorEventPrefix + "Expired":
			default:
				kinds = append(kinds, how)
			}
		}
		sort.Strings(kinds)
		if len(kinds) > 0 {
			r.fail("informer %s: watches ended by %v", resource, kinds)
		}
	}
}
