package scenario

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/await"
	"kube-apiserver-proxy/tests/cluster/internal/cluster"
	"kube-apiserver-proxy/tests/cluster/internal/load"
)

type spec struct {
	name string
	run  func(ctx context.Context, e *env, r *Result)
	// rollouts: how many the scenario must complete (of its own design's pods).
	rollouts func(o Options) int
}

// byHand are the scenarios that check nothing of this project (figures only, for
// docs/benchmarks.md's comparison): they run when named with --scenarios, not by default.
var byHand = map[string]bool{"haproxy-sidecar": true}

func none(Options) int              { return 0 }
func fixed(n int) func(Options) int { return func(Options) int { return n } }
func asked(o Options) int           { return o.Rollouts }

// scenarios in the order they run; each starts from the pod the previous one left serving.
func scenarios() []spec {
	return []spec{
		{"steady", steady, none},
		{"upgrade", upgrade, fixed(1)},
		{"rollouts-pod-ready", func(ctx context.Context, e *env, r *Result) {
			rollouts(ctx, e, r, cluster.GatePod)
		}, asked},
		{"rollouts-apiserver-ready", func(ctx context.Context, e *env, r *Result) {
			rollouts(ctx, e, r, cluster.GateAPIServer)
		}, asked},
		// To the previous release's pod (its build, its manifests) and back.
		{"previous-release", previousRelease, fixed(2)},
		{"kubernetes-service-switch", kubernetesServiceSwitch, fixed(2)},
		{"anonymous-auth-off", anonymousOff, fixed(2)},
		{"broken-rollout-stalls", brokenRolloutStalls, none},
		// Onto the dual-stack pod, --rollouts under load, back to the single-stack pod.
		{"ipv6-node", ipv6Node, func(o Options) int { return o.Rollouts + 2 }},
		// HAProxy's design in, --rollouts, the hand-made proxy pod in, --rollouts, the shipped
		// pod back.
		{"handmade-rollouts", handmadeRollouts, func(o Options) int { return 2*o.Rollouts + 3 }},
		// The tier's self-test: each must catch its planted fault (figures of the faulty run
		// in the JSON; the clean control is every scenario above).
		{"self-test-close-every-25th", selfTest("close-every25th", "closed before any byte"), none},
		{"self-test-close-while-draining", selfTest("close-while-draining", "closed before any byte"), none},
		{"self-test-cut-at-handoff", selfTest("cut-at-handoff", "cut", "watches ended by", "relists"), none},
		// Faults that close nothing: a connection that hangs open, new connections that wait,
		// descriptors that leak.
		{"self-test-hang-after-10s", selfTest("hang-after-10s", "hung:", "later than", "slowest request", load.PendingAtStop), none},
		{"self-test-stall-3s", selfTest("stall-3s", "stalled connections"), none},
		{"self-test-leak-fd-per-check", selfTest("leak-fd-per-check", "descriptor leak"), none},
		{"ha-surge-kubernetes-service", haSurgeKubernetesService, asked},
		// Figures only (docs/benchmarks.md's comparison): by hand, not by default.
		{"haproxy-sidecar", haproxySidecar, asked},
		// As shipped, the switch, --rollouts more, and back.
		{"client-address-transparent", clientAddressTransparent, func(o Options) int { return o.Rollouts + 3 }},
	}
}

// Names are the scenarios' names, in the order they run.
func Names() []string {
	var names []string
	for _, s := range scenarios() {
		names = append(names, s.name)
	}
	return names
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
		r.Fail("pod %s holds no listening socket (%v)", e.current.Opts.Name, err)
		return
	}
	underLoad(ctx, e, r, true, func() {
		for i := 0; i < e.o.Rollouts && ctx.Err() == nil; i++ {
			if !e.rollout(ctx, r, cluster.Sidecar, gate, e.o.APIServer, nil, nil) {
				return
			}
			now, err := e.current.ListenerCookies()
			if err != nil || !slices.Equal(now, first) {
				r.Fail("after rollout %d pod %s holds listening sockets %v (%v), want the first pod's %v",
					i+1, e.current.Opts.Name, now, err, first)
			}
		}
	})
}

// previousRelease hands the node's listening socket between this build and the previous
// release, really built (a pinned commit of this repository, tests/previous-release), as a
// Deployment rollout does both ways under the load: a rollback to the previous release's pod
// (its proxy, its manifests' Deployment, single-controller), then the upgrade back to this
// build's pod. The node address (what the load uses) is served by the same listening sockets
// throughout: the pod that ends holds for it the cookies the first one held, never bound
// again. The previous release's pods serve the node address only, not 127.0.0.1:6443 (its
// /status shows no cookies): a rollback to it closes this build's 127.0.0.1:6443 sockets,
// and the pod back binds them anew (docs/runbooks/rollout.md, "The previous release").
func previousRelease(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.Sidecar, cluster.GatePod
	if e.o.PreviousProxy == "" || e.o.PreviousManifests == "" {
		r.Fail("no previous release built (--previous-proxy, --previous-manifests: tests/previous-release)")
		return
	}
	old, err := cluster.RenderTemplate(filepath.Join(e.o.PreviousManifests, "single-controller"))
	if err != nil {
		r.Fail("the previous release's manifests: %v", err)
		return
	}
	node := net.JoinHostPort(e.o.NodeIP, "6443")
	first, err := e.current.ListenerCookiesOn(node)
	if err != nil || len(first) == 0 {
		r.Fail("pod %s holds no listening socket for %s (%v)", e.current.Opts.Name, node, err)
		return
	}
	underLoad(ctx, e, r, true, func() {
		previous := func() (*cluster.Pod, error) {
			e.seq++
			return cluster.StartPod(ctx, e.node, old, cluster.PodOptions{
				Name: fmt.Sprintf("pod-%02d", e.seq), Design: cluster.Sidecar,
				APIServer: e.o.APIServer, Proxy: e.o.PreviousProxy,
				ExtraAPIServerArgs: e.o.APIServerArgs,
			})
		}
		if !step(ctx, r, "to the previous release: ", cluster.GatePod, &e.current, previous) {
			return
		}
		if ok, err := e.current.RunsProxy(e.o.PreviousProxy); !ok {
			r.Fail("pod %s does not run the previous release's proxy %s (%v)", e.current.Opts.Name, e.o.PreviousProxy, err)
		}
		if !e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, nil, nil) {
			return
		}
		now, err := e.current.ListenerCookiesOn(node)
		if err != nil || !slices.Equal(now, first) {
			r.Fail("back from the previous release, pod %s holds listening sockets %v for %s (%v), want the first pod's %v",
				e.current.Opts.Name, now, node, err, first)
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
			r.Fail("%v", err)
		} else if line := lineWith(log, denied); line == "" {
			r.Fail("the stopping lease apiserver (pod %s) did not log %q: was its removal not attempted, or not denied?", lease.Opts.Name, denied)
		} else if !strings.Contains(line, "kube-apiserver-proxy-kubernetes-endpoints") {
			r.Fail("the lease apiserver's removal failed, but not by the policy: %s", line)
		} else {
			r.Note("the stopping lease apiserver's removal was denied: %s", line)
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
		r.Fail("%v", err)
		return
	}
	cert := []string{"--health-client-cert=" + certFile, "--health-client-key=" + keyFile}
	anonymous, err := e.node.APIServerClient("", "")
	if err != nil {
		r.Fail("%v", err)
		return
	}
	underLoad(ctx, e, r, true, func() {
		if !e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, []string{"--anonymous-auth=false"}, cert) {
			return
		}
		// The pod is ready because its proxy checks with the client certificate: its
		// apiserver really refuses an anonymous request.
		if code, err := e.current.APIServerGet(anonymous, "/readyz"); err != nil || code != http.StatusUnauthorized {
			r.Fail("pod %s's apiserver (--anonymous-auth=false) answered an anonymous GET /readyz with %d (%v), want 401", e.current.Opts.Name, code, err)
		}
		e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, nil, nil)
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
			r.Fail("start pod: %v", err)
			return
		}
		// The apiserver itself becomes ready (its /readyz answers a client certificate)…
		client, err := e.node.APIServerClient(
			filepath.Join(e.node.PKI, "apiserver-kubelet-client.crt"),
			filepath.Join(e.node.PKI, "apiserver-kubelet-client.key"))
		if err != nil {
			r.Fail("%v", err)
		} else if err := await.Until(ctx, time.Second, 3*time.Minute, await.Condition{
			Name: "broken pod " + broken.Opts.Name + ": its apiserver ready",
			Check: func() (bool, string, error) {
				if err := broken.Crashed(); err != nil {
					return false, "", err
				}
				return broken.APIServerReadyz(client), "", nil
			},
		}); err != nil {
			r.Fail("broken pod's apiserver never became ready: %v", err)
		} else if err := broken.Crashed(); err != nil {
			r.Fail("broken pod's apiserver never became ready: %v", err)
		}
		// …but the pod must not, however long it is given: 10 probe periods after that…
		if err := broken.WaitReady(ctx, cluster.GatePod, 20*time.Second); err == nil {
			r.Fail("pod %s became ready although its proxy cannot check its apiserver", broken.Opts.Name)
		}
		// …and for that reason alone: both containers run, and the proxy's own backend fails
		// its check with 401.
		if err := broken.Crashed(); err != nil {
			r.Fail("the broken pod is not ready for another reason than its apiserver: %v", err)
		} else if why := ownBackendFailure(broken); !strings.Contains(why, "HTTP 401") {
			r.Fail("the broken pod's proxy does not say its own apiserver refuses the check with 401: %s", why)
		}
		if !e.current.Ready(ctx) {
			r.Fail("old pod %s is not ready while the broken rollout stalls", e.current.Opts.Name)
		}
		t := broken.Terminate()
		r.Note("broken pod removed in %s", t.SidecarStopped.Round(time.Second))
	})
}

// ownBackendFailure is why the pod's proxy finds its own backend not healthy, from /status:
// the last check's cause, or what else was found.
func ownBackendFailure(p *cluster.Pod) string {
	status, err := p.ProxyStatus()
	if err != nil {
		return err.Error()
	}
	for _, b := range status.Backends {
		if b.Source != "own" {
			continue
		}
		if b.Healthy {
			return "its own backend " + b.Address + " is healthy"
		}
		if b.LastCheck == nil {
			return "its own backend " + b.Address + " was never checked"
		}
		return b.LastCheck.Cause
	}
	return fmt.Sprintf("no own backend in /status (state %s)", status.State)
}

// haproxySidecar runs the same rollouts with the design Lokomotive shipped (HAProxy sidecar,
// readiness = the apiserver's). Its figures are reported, not asserted.
func haproxySidecar(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.HAProxy, cluster.GateAPIServer
	if e.o.HAProxy == "" {
		r.Fail("haproxy not found: install it (apt-get install haproxy) to compare")
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
	// Back to the shipped design, outside the measurement: the next scenario starts from it
	// (HAProxy's stop cuts what it carries, which would count against that scenario).
	back := &Result{}
	if !e.rollout(ctx, back, cluster.Sidecar, cluster.GatePod, e.o.APIServer, nil, nil) {
		r.Fail("rolling back to the shipped design failed: %v", back.Failures())
	}
}

// underLoad runs f under the client-go load and records what the clients saw. strict: every
// problem the load's criteria find (load.Report.Problems) is a problem of the scenario, and so
// is a listen-queue overflow or drop anywhere in the node.
func underLoad(ctx context.Context, e *env, r *Result, strict bool, f func()) {
	underLoadOn(ctx, e.node.AdminConf, r, strict, f)
}

// underLoadOn is underLoad with the clients of kubeconfig (another controller's address).
func underLoadOn(ctx context.Context, kubeconfig string, r *Result, strict bool, f func()) {
	underLoadWith(ctx, kubeconfig, r, strict, func(*load.Load) { f() })
}

// underLoadWith is underLoadOn whose f is given the running load.
func underLoadWith(ctx context.Context, kubeconfig string, r *Result, strict bool, f func(*load.Load)) {
	cfg := load.DefaultConfig(kubeconfig)
	l, err := load.Start(ctx, cfg)
	if err != nil {
		r.Fail("load: %v", err)
		return
	}
	before := cluster.ReadTCPCounters()
	f(l)
	rep := l.Stop()
	r.TCP = cluster.ReadTCPCounters().Since(before)
	r.Load = &rep
	if !strict {
		return
	}
	for _, p := range rep.Problems(load.DefaultCriteria(), cfg) {
		r.Fail("%s", p)
	}
	for _, kind := range slices.Sorted(maps.Keys(rep.Samples)) {
		if kind == load.ConnClosedByPeer {
			continue
		}
		for _, s := range rep.Samples[kind] {
			r.Note("%s", kind+": "+s)
		}
	}
	for _, c := range []string{"TcpExt:ListenOverflows", "TcpExt:ListenDrops"} {
		if n := r.TCP[c]; n > 0 {
			r.Fail("%s: %d in the node during the scenario (a listen queue overflowed or a SYN was dropped)", c, n)
		}
	}
}

// awaitResumed waits (30 s at most) until every watch of the load has resumed after the
// rollout that just ended (its old pod is gone), so on a connection to the pod now serving:
// the long-lived connections leave the old pod when its apiserver ends them, and a watch sent
// again there is answered Retry-After (5 s). The faults that spoil established connections
// (cut at the handoff, hang) must have them before the next rollout brings a pod that shares
// the listening sockets and could take them instead.
func awaitResumed(ctx context.Context, l *load.Load, r *Result) {
	since := time.Now()
	if !await.Holds(ctx, 100*time.Millisecond, 30*time.Second, func() bool { return l.WatchesResumedSince(since) }) {
		r.Note("the load's watches had not all resumed 30 s after the planted pod took over")
	}
}

// selfTest proves that the pass criteria catch a proxy that loses, hangs, stalls or leaks: pods of the
// proxy built with its planted faults (--planted-proxy, feature planted-faults) run
// --planted-fault=fault; two rollouts under the load (the first brings a planted pod in, the
// second replaces it: its drain is what the drain faults spoil) must fail the strict checks,
// and by the fault's symptom (one of symptoms in a problem). The scenario passes when they do.
// A clean pod is rolled back in afterwards, outside the measurement.
func selfTest(fault string, symptoms ...string) func(ctx context.Context, e *env, r *Result) {
	return func(ctx context.Context, e *env, r *Result) {
		if e.o.PlantedProxy == "" {
			r.Fail("no proxy built with planted faults (--planted-proxy): the tier cannot prove it catches them")
			return
		}
		planted := func() (*cluster.Pod, error) {
			e.seq++
			return cluster.StartPod(ctx, e.node, e.tmpl, cluster.PodOptions{
				Name: fmt.Sprintf("pod-%02d", e.seq), Design: cluster.Sidecar,
				APIServer: e.o.APIServer, Proxy: e.o.PlantedProxy,
				ExtraAPIServerArgs: e.o.APIServerArgs,
				ExtraProxyArgs:     []string{"--planted-fault=" + fault},
			})
		}
		inner := &Result{Name: r.Name, Design: cluster.Sidecar, Gate: cluster.GatePod}
		underLoadWith(ctx, e.node.AdminConf, inner, true, func(l *load.Load) {
			for i := 0; i < 2 && ctx.Err() == nil; i++ {
				if !step(ctx, inner, "", cluster.GatePod, &e.current, planted) {
					return
				}
				if i == 0 {
					awaitResumed(ctx, l, r)
				}
			}
		})
		// The planted pods' descriptors and memory are the inner run's (a leak is a symptom).
		inner.Proxies = e.node.Leaks.Take()
		for _, p := range cluster.LeakProblems(inner.Proxies) {
			inner.Fail("%s", p)
		}
		r.Load, r.Rollouts, r.TCP, r.Proxies = inner.Load, inner.Rollouts, inner.TCP, inner.Proxies
		// Back to a clean pod, whatever happened: the next scenario starts from it.
		back := &Result{}
		if !e.rollout(ctx, back, cluster.Sidecar, cluster.GatePod, e.o.APIServer, nil, nil) {
			r.Fail("rolling back to a pod without the planted fault failed: %v", back.Failures())
		}
		// The last planted pod's last samples, while it stopped: part of the fault's run.
		e.node.Leaks.Take()
		caught := ""
		for _, p := range inner.Failures() {
			for _, s := range symptoms {
				if caught == "" && strings.Contains(p, s) {
					caught = p
				}
			}
		}
		switch {
		case len(inner.Rollouts) != 2:
			r.Fail("the planted fault's 2 rollouts did not complete: %v", inner.Failures())
		case inner.Failed() == 0:
			r.Fail("planted fault %s went unnoticed: the pass criteria passed a faulty proxy", fault)
		case caught == "":
			r.Fail("planted fault %s was caught, but not by its symptom (%s): %v", fault, strings.Join(symptoms, " or "), inner.Failures())
		default:
			r.Note("planted fault %s caught (%d problems): %s", fault, inner.Failed(), caught)
		}
	}
}
