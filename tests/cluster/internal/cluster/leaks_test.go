package cluster

import (
	"strings"
	"testing"
	"time"
)

func TestMetricSum(t *testing.T) {
	text := `# HELP kube_apiserver_proxy_connections_active Client connections being carried.
kube_apiserver_proxy_connections_active 7
kube_apiserver_proxy_connections_active_x 100
kube_apiserver_proxy_backend_active_connections{backend="127.0.0.2:6443"} 4
kube_apiserver_proxy_backend_active_connections{backend="127.0.0.3:6443",source="dir"} 3
`
	if got := MetricSum(text, "kube_apiserver_proxy_connections_active"); got != 7 {
		t.Errorf("connections_active = %v, want 7", got)
	}
	if got := MetricSum(text, "kube_apiserver_proxy_backend_active_connections"); got != 7 {
		t.Errorf("backend_active_connections = %v, want 7", got)
	}
	if got := MetricSum(text, "kube_apiserver_proxy_missing"); got != 0 {
		t.Errorf("missing = %v, want 0", got)
	}
}

// A flat proxy with transients passes; one that gains a descriptor every 2 s fails, naming
// it; too few samples are not judged.
func TestLeakProblems(t *testing.T) {
	t0 := time.Now()
	series := func(n int, f func(i int) int) []ProxySample {
		var s []ProxySample
		for i := 0; i < n; i++ {
			s = append(s, ProxySample{At: t0.Add(time.Duration(i) * time.Second), FDs: 40 + f(i), Unexplained: 20 + f(i), RSSKiB: 20000})
		}
		return s
	}
	flat := Life("pod-01", 10, series(30, func(i int) int { return []int{0, 2, 1, 0, 3}[i%5] }))
	leaking := Life("pod-02", 11, series(30, func(i int) int { return i / 2 }))
	short := Life("pod-03", 12, series(LeakMinSamples-1, func(i int) int { return 5 * i }))
	p := LeakProblems([]ProxyLife{flat, leaking, short})
	if len(p) != 1 || !strings.Contains(p[0], "descriptor leak: proxy of pod-02") {
		t.Fatalf("problems %q: want one descriptor leak of pod-02", p)
	}
	if flat.FDGrowth != 0 || leaking.FDGrowth != 12 {
		t.Errorf("growth: flat %d, leaking %d", flat.FDGrowth, leaking.FDGrowth)
	}
}
