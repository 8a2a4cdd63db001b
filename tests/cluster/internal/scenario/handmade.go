package scenario

import (
	"context"

	"kube-apiserver-proxy/tests/cluster/internal/cluster"
	"kube-apiserver-proxy/tests/cluster/internal/load"
)

// kubeadmShutdown are kube-apiserver's own shutdown defaults, which kubeadm keeps: the listener
// closes at SIGTERM, watches are not ended gracefully, no 429 + Retry-After (appended to the
// manifest's flags: the later flag wins).
var kubeadmShutdown = []string{
	"--shutdown-delay-duration=0s",
	"--shutdown-watch-termination-grace-period=0s",
	"--shutdown-send-retry-after=false",
}

// handmadeRollouts: pods as a hand-made configuration runs them, next to the same rollouts
// with HAProxy in front. Each proxy knows only its own pod's apiserver (no --backend-dir: the
// old pod's proxy has no other backend once its apiserver stops), the apiservers keep
// kube-apiserver's shutdown defaults (the listener closes at SIGTERM), and the old pod gets
// SIGTERM on all its containers at once when the new one is ready (no preStop hook). The
// same client-go load runs through --rollouts rollouts of HAProxy's design (Lokomotive's
// sidecar, the same apiserver flags), then through --rollouts rollouts of the proxy's. The
// proxy must lose no more requests than HAProxy does; both are reported. Then back to the
// shipped pod.
func handmadeRollouts(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.Sidecar, cluster.GatePod
	if e.o.HAProxy == "" {
		r.Fail("haproxy not found: install it (apt-get install haproxy) to compare")
		return
	}
	shipped := e.tmpl
	defer func() { e.tmpl = shipped }()
	// HAProxy first (its design switch outside the measurement).
	if !e.rollout(ctx, r, cluster.HAProxy, cluster.GateAPIServer, e.o.APIServer, kubeadmShutdown, nil) {
		return
	}
	var haproxy load.Report
	underLoad(ctx, e, r, false, func() {
		for i := 0; i < e.o.Rollouts && ctx.Err() == nil; i++ {
			if !e.rollout(ctx, r, cluster.HAProxy, cluster.GateAPIServer, e.o.APIServer, kubeadmShutdown, nil) {
				return
			}
		}
	})
	if r.Load == nil {
		return
	}
	haproxy = *r.Load
	haproxyRollouts := len(r.Rollouts) - 1
	e.tmpl = shipped.WithoutArg("proxy", "--backend-dir=")
	if !e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, kubeadmShutdown, nil) {
		return
	}
	before := len(r.Rollouts)
	underLoad(ctx, e, r, false, func() {
		for i := 0; i < e.o.Rollouts && ctx.Err() == nil; i++ {
			if !e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, kubeadmShutdown, nil) {
				return
			}
		}
	})
	proxy := r.Load
	r.Note("haproxy-sidecar: %d rollouts, %d requests ok, %d failed %v, %d of %d connections failed, %d streams cut",
		haproxyRollouts, haproxy.TotalOK(), haproxy.TotalFailed(), haproxy.Failures, haproxy.TotalConnErrors(), haproxy.Connections.Dialed, haproxy.TotalStreamCuts())
	r.Note("kube-apiserver-proxy (own backend only): %d rollouts, %d requests ok, %d failed %v, %d of %d connections failed, %d streams cut",
		len(r.Rollouts)-before, proxy.TotalOK(), proxy.TotalFailed(), proxy.Failures, proxy.TotalConnErrors(), proxy.Connections.Dialed, proxy.TotalStreamCuts())
	if proxy.TotalFailed() > haproxy.TotalFailed() {
		r.Fail("the proxy lost %d requests, HAProxy %d in the same rollouts", proxy.TotalFailed(), haproxy.TotalFailed())
	}
	// Back to the shipped pod for the scenarios after this one.
	e.tmpl = shipped
	e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, nil, nil)
}
