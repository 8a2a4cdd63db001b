package cluster

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// ProxySample is one reading of a proxy process: its open descriptors and resident memory as
// the kernel counts them (/proc), and the connections the proxy says it carries.
type ProxySample struct {
	At  time.Time `json:"at"`
	FDs int       `json:"fds"`
	// Unexplained: descriptors beyond those of the connections it carries (client and
	// backend sockets) and its idle pooled splice pipes: listeners, sockets of its own
	// endpoints, event loops, health checks in flight. Flat in a process that leaks nothing.
	Unexplained int   `json:"unexplained_fds"`
	RSSKiB      int64 `json:"rss_kib"`
}

// ProxyLife is what was sampled of one pod's proxy in one window (a scenario).
type ProxyLife struct {
	Pod     string        `json:"pod"`
	PID     int           `json:"pid"`
	Samples int           `json:"samples"`
	Span    time.Duration `json:"span_ns"`
	// Baseline and End: the least unexplained descriptors (and resident KiB) among the first
	// and among the last LeakWindow samples: a transient (a health check, an accept) lifts a
	// sample, never all of them.
	BaselineFDs, EndFDs       int   `json:"-"`
	BaselineRSSKiB, EndRSSKiB int64 `json:"-"`
	FDGrowth                  int   `json:"fd_growth"`
	RSSGrowthKiB              int64 `json:"rss_growth_kib"`
	MaxFDs                    int   `json:"max_fds"`
	samples                   []ProxySample
}

// Leak bounds: what a proxy that lived through a scenario may have grown, between the first
// and the last samples of the scenario (a sample a second). The descriptors a proxy needs do
// not grow with time: its listeners, its endpoints, its event loops and the connections it
// carries (counted apart); a health check's socket lives for one check, every 2 s. Memory
// grows to a plateau (buffers for the connections at their most, the allocator's arenas),
// well within the margin.
const (
	LeakFDMargin     = 8
	LeakRSSMarginKiB = 64 << 10
	// LeakWindow samples make a baseline or an end; LeakMinSamples are needed to judge.
	LeakWindow     = 5
	LeakMinSamples = 15
	// LeakSettle: the samples of a pod's first seconds are left out (it starts its threads,
	// takes the listening sockets, makes its first checks).
	LeakSettle = 10 * time.Second
)

// LeakWatch samples the proxy of every pod it is given, every second, until stopped.
type LeakWatch struct {
	mu   sync.Mutex
	pods map[*Pod]*ProxyLife
	stop chan struct{}
	done chan struct{}
}

// StartLeakWatch starts sampling (pods are added with Add; StartPod adds them when the node
// has a LeakWatch).
func StartLeakWatch() *LeakWatch {
	w := &LeakWatch{pods: map[*Pod]*ProxyLife{}, stop: make(chan struct{}), done: make(chan struct{})}
	go w.run()
	return w
}

// Add samples p's proxy from now on (a pod of another design is ignored).
func (w *LeakWatch) Add(p *Pod) {
	if w == nil || p.sidecar == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.pods[p] = &ProxyLife{Pod: p.Opts.Name, PID: p.sidecar.cmd.Process.Pid}
}

func (w *LeakWatch) run() {
	defer close(w.done)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		w.mu.Lock()
		pods := make([]*Pod, 0, len(w.pods))
		for p := range w.pods {
			pods = append(pods, p)
		}
		w.mu.Unlock()
		for _, p := range pods {
			if p.sidecar.Exited() || time.Since(p.Started) < LeakSettle {
				continue
			}
			s, err := p.sampleProxy()
			if err != nil {
				continue
			}
			w.mu.Lock()
			if l := w.pods[p]; l != nil {
				l.samples = append(l.samples, s)
			}
			w.mu.Unlock()
		}
	}
}

// Take returns what was sampled of each proxy since the last Take (one entry per proxy that
// has samples) and starts a new window; proxies that exited are forgotten.
func (w *LeakWatch) Take() []ProxyLife {
	if w == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	var lives []ProxyLife
	for p, l := range w.pods {
		if len(l.samples) > 0 {
			lives = append(lives, Life(l.Pod, l.PID, l.samples))
		}
		l.samples = nil
		if p.sidecar.Exited() {
			delete(w.pods, p)
		}
	}
	sort.Slice(lives, func(i, j int) bool { return lives[i].Pod < lives[j].Pod })
	return lives
}

// Stop ends the sampling.
func (w *LeakWatch) Stop() {
	if w == nil {
		return
	}
	close(w.stop)
	<-w.done
}

// Life sums up samples of one proxy. Pure.
func Life(pod string, pid int, samples []ProxySample) ProxyLife {
	l := ProxyLife{Pod: pod, PID: pid, Samples: len(samples)}
	if len(samples) == 0 {
		return l
	}
	l.Span = samples[len(samples)-1].At.Sub(samples[0].At)
	k := min(LeakWindow, len(samples))
	least := func(s []ProxySample) (int, int64) {
		fds, rss := s[0].Unexplained, s[0].RSSKiB
		for _, x := range s[1:] {
			fds, rss = min(fds, x.Unexplained), min(rss, x.RSSKiB)
		}
		return fds, rss
	}
	l.BaselineFDs, l.BaselineRSSKiB = least(samples[:k])
	l.EndFDs, l.EndRSSKiB = least(samples[len(samples)-k:])
	l.FDGrowth, l.RSSGrowthKiB = l.EndFDs-l.BaselineFDs, l.EndRSSKiB-l.BaselineRSSKiB
	for _, s := range samples {
		l.MaxFDs = max(l.MaxFDs, s.FDs)
	}
	return l
}

// LeakProblems: every proxy sampled long enough whose descriptors or memory did not come back
// to their baseline within the margins. Pure.
func LeakProblems(lives []ProxyLife) []string {
	var p []string
	for _, l := range lives {
		if l.Samples < LeakMinSamples {
			continue
		}
		if l.FDGrowth > LeakFDMargin {
			p = append(p, fmt.Sprintf("descriptor leak: proxy of %s (pid %d) holds %d descriptors beyond its connections after %s, %d at the start (margin %d; %d open at most)",
				l.Pod, l.PID, l.EndFDs, l.Span.Round(time.Second), l.BaselineFDs, LeakFDMargin, l.MaxFDs))
		}
		if l.RSSGrowthKiB > LeakRSSMarginKiB {
			p = append(p, fmt.Sprintf("memory leak: proxy of %s (pid %d) resident %d KiB after %s, %d KiB at the start (margin %d KiB)",
				l.Pod, l.PID, l.EndRSSKiB, l.Span.Round(time.Second), l.BaselineRSSKiB, LeakRSSMarginKiB))
		}
	}
	return p
}

// sampleProxy reads the pod's proxy: its descriptors and memory from /proc, what it carries
// from its own metrics (read between two counts of the descriptors; the lesser count is kept,
// so that the metrics' own connection does not count).
func (p *Pod) sampleProxy() (ProxySample, error) {
	pid := p.sidecar.cmd.Process.Pid
	fds1, err := countFDs(pid)
	if err != nil {
		return ProxySample{}, err
	}
	text, err := p.proxyMetrics()
	if err != nil {
		return ProxySample{}, err
	}
	fds2, err := countFDs(pid)
	if err != nil {
		return ProxySample{}, err
	}
	rss, err := rssKiB(pid)
	if err != nil {
		return ProxySample{}, err
	}
	fds := min(fds1, fds2)
	carried := MetricSum(text, "kube_apiserver_proxy_connections_active") +
		MetricSum(text, "kube_apiserver_proxy_backend_active_connections") +
		2*MetricSum(text, "kube_apiserver_proxy_splice_pipes_pooled")
	return ProxySample{At: time.Now(), FDs: fds, Unexplained: fds - int(carried), RSSKiB: rss}, nil
}

// ProxyMetric is the sum of the series of metric name (its full name) that the pod's proxy
// exports.
func (p *Pod) ProxyMetric(name string) (float64, error) {
	text, err := p.proxyMetrics()
	if err != nil {
		return 0, err
	}
	return MetricSum(text, name), nil
}

func (p *Pod) proxyMetrics() (string, error) {
	resp, err := p.adminGet("/metrics", 2*time.Second)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s /metrics: %s", p.Opts.Name, resp.Status)
	}
	text, err := io.ReadAll(resp.Body)
	return string(text), err
}

// MetricSum adds up every series of the metric name in a Prometheus text exposition (0 when
// there is none). Pure.
func MetricSum(text, name string) float64 {
	var total float64
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) {
			continue
		}
		rest := line[len(name):]
		if rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		fields := strings.Fields(rest[strings.LastIndex(rest, "}")+1:])
		if len(fields) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(fields[0], 64); err == nil {
			total += v
		}
	}
	return total
}

func countFDs(pid int) (int, error) {
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(entries), err
}

func rssKiB(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		}
	}
	return 0, fmt.Errorf("pid %d: no VmRSS", pid)
}
