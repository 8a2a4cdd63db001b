package node

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// The lifecycle's Prometheus: on 127.0.0.1:9090 in the node's namespace, with the scrape job
// prometheus-operator makes of manifests/monitoring's PodMonitor (the operator's own
// relabelings, then the PodMonitor's, taken from the rendered object), scraping every 5s (the
// scrape timeout is the interval: 5s, half Prometheus' default 10s. With 2s, one run on a
// machine with a load average above 20 saw `up` 0 once; its cause was not recorded, and a
// scrape that waits out an exiting peer's 1s fetch timeout comes close to 2s there), and the
// alerts of its PrometheusRule (evaluated every 5s). Debian's prometheus is built without
// Kubernetes discovery: discover writes what `kubernetes_sd_configs: [{role: pod}]` would
// discover into a file_sd file every 2s (pods declaring no port: one target per container, at
// the pod's IP, with the __meta_kubernetes_* labels the relabelings read).
type prometheus struct {
	proc       *Background
	stopSD     context.CancelFunc
	discovered chan struct{}
}

const promAddr = "http://127.0.0.1:9090"

// InCI: the CI variable is set (not empty, false or 0), as smoke's in_ci and the Rust tests'
// util::in_ci read it.
func InCI() bool {
	switch os.Getenv("CI") {
	case "", "false", "0":
		return false
	}
	return true
}

// prometheusStart starts Prometheus and its discovery; lc.prom stays nil when it does not run.
func (lc *lifecycle) prometheusStart() {
	n := lc.n
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		if InCI() {
			n.Fail("prometheus not installed (apt-get install prometheus) and CI is set: the monitoring check cannot run")
		} else {
			n.Note("SKIPPED: prometheus not installed (apt-get install prometheus): the monitoring check is left out")
		}
		return
	}
	monitoring, err := n.Kubectl(60*time.Second, "kustomize", filepath.Join(n.Repo, "manifests/monitoring"))
	if err != nil {
		n.Fail("prometheus: kubectl kustomize manifests/monitoring failed: %s", report.Cut(err.Error(), 300))
		return
	}
	_ = os.WriteFile(n.Path("monitoring.yaml"), []byte(monitoring+"\n"), 0o644)
	files, err := nodecheck.PromConfig(strings.NewReader(monitoring), n.State)
	var selector map[string]string
	if err == nil {
		err = json.Unmarshal(files.Selector, &selector)
	}
	for name, b := range map[string][]byte{"prometheus.yaml": files.Config, "rules.yaml": files.Rules, "sd.json": []byte("[]")} {
		if err == nil {
			err = os.WriteFile(n.Path(name), b, 0o644)
		}
	}
	if err != nil {
		n.Fail("prometheus: its configuration could not be made from manifests/monitoring: %v", err)
		return
	}
	ctx, cancel := context.WithCancel(n.Ctx)
	p := &prometheus{stopSD: cancel, discovered: make(chan struct{})}
	go func() {
		defer close(p.discovered)
		lc.discover(ctx, labels.SelectorFromSet(selector).String())
	}()
	p.proc, err = n.Background("prometheus.log", bin, "--config.file="+n.Path("prometheus.yaml"),
		"--storage.tsdb.path="+n.Path("prometheus"), "--web.listen-address=127.0.0.1:9090")
	if err != nil {
		cancel()
		n.Fail("prometheus: not started: %v", err)
		return
	}
	lc.prom = p
	if n.WaitFor(90*time.Second, func() bool { a, err := promGet("/api/v1/targets?state=active"); return err == nil && a.OneTargetUp() }) {
		a, _ := promGet("/api/v1/targets?state=active")
		targets, _ := a.Targets()
		n.Pass("prometheus (the PodMonitor's job): one target for the node, up: %s", targets)
		return
	}
	got := "?"
	if b, err := promRaw("/api/v1/targets?state=active"); err != nil {
		got = err.Error()
	} else {
		got = report.Cut(string(b), 600)
	}
	// It runs on: the checks at the end report what it saw.
	n.Fail("prometheus: no single healthy target within 90 s: %s %s", got, Tail(n.Path("prometheus.log"), 3))
}

// discover writes sd.json (atomically) every 2 s until ctx ends: the pods selector selects in
// kube-system, as Kubernetes pod discovery would give them. A failed round leaves the file as
// it was.
func (lc *lifecycle) discover(ctx context.Context, selector string) {
	out := lc.n.Path("sd.json")
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		pods, err := lc.n.Client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return
		}
		b, err := json.Marshal(nodecheck.PodTargets(pods.Items))
		if err != nil || os.WriteFile(out+".tmp", b, 0o644) != nil {
			return
		}
		_ = os.Rename(out+".tmp", out)
	}, 2*time.Second)
}

func promRaw(path string) ([]byte, error) {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(promAddr + path)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("%s: %s: %s", path, resp.Status, report.Cut(string(b), 300))
	}
	return b, err
}

// promGet is Prometheus's answer at path.
func promGet(path string) (*nodecheck.PromAnswer, error) {
	b, err := promRaw(path)
	if err != nil {
		return nil, err
	}
	var a nodecheck.PromAnswer
	if err := json.Unmarshal(b, &a); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &a, nil
}

// promQuery is the answer to an instant query.
func promQuery(expr string) (*nodecheck.PromAnswer, error) {
	return promGet("/api/v1/query?" + url.Values{"query": {expr}}.Encode())
}

// answer is what of an answer the report shows, or the error.
func answer(a *nodecheck.PromAnswer, err error, what func(*nodecheck.PromAnswer) string) string {
	if err != nil {
		return "(" + err.Error() + ")"
	}
	return what(a)
}

func values(expr string) string {
	a, err := promQuery(expr)
	return answer(a, err, (*nodecheck.PromAnswer).Values)
}

func alertNames(expr string) string {
	a, err := promQuery(expr)
	return answer(a, err, (*nodecheck.PromAnswer).AlertNames)
}

// prometheusCheck: over the run so far, one target for the node, never down; both pods of a
// rollout in one scrape; no alert firing (the ones seen pending are listed).
func (lc *lifecycle) prometheusCheck() {
	if lc.prom == nil {
		return
	}
	n := lc.n
	const w, job = "2h", `job="kube-system/kube-apiserver-proxy"`
	targets := values(fmt.Sprintf("max_over_time(count(up{%s})[%s:5s])", job, w))
	down := values(fmt.Sprintf("min_over_time(up{%s}[%s])", job, w))
	pods := values(fmt.Sprintf("max_over_time(count(kube_apiserver_proxy_build_info)[%s:5s])", w))
	if targets == "1" && down == "1" {
		n.Pass("prometheus: one scrape target for the node all along, never down")
	} else {
		at, err := promQuery(fmt.Sprintf("(up{%s} == 0)[%s:5s]", job, w))
		t, terr := promGet("/api/v1/targets?state=active")
		n.Fail("prometheus: targets at most %s, up at least %s (want 1 and 1); down at %s; longest scrape %s s; last error: %s",
			targets, down, answer(at, err, (*nodecheck.PromAnswer).Times),
			values(fmt.Sprintf("max_over_time(scrape_duration_seconds{%s}[%s])", job, w)),
			answer(t, terr, func(a *nodecheck.PromAnswer) string { _, e := a.Targets(); return e }))
	}
	if pods == "2" {
		n.Pass("prometheus: one scrape of the node showed both pods of a rollout")
	} else {
		n.Fail("prometheus: at most %s pods seen in one scrape (want 2 during the rollouts)", pods)
	}
	// Firing at any moment of the run, not only now; pending ones are listed (a rollout's two
	// pods make RolloutStuck pending, which its 15 minutes never let fire).
	alerts := alertNames(fmt.Sprintf(`max_over_time(ALERTS{alertname=~"KubeApiserverProxy.*", alertstate="firing"}[%s])`, w))
	if alerts == "none" {
		n.Pass("prometheus: no alert of manifests/monitoring fired during the run (pending at some point: %s)",
			alertNames(fmt.Sprintf(`max_over_time(ALERTS{alertname=~"KubeApiserverProxy.*", alertstate="pending"}[%s])`, w)))
	} else {
		n.Fail("prometheus: alerts fired during the run: %s", alerts)
	}
	// The positive controls (nodecheck.WithControls): the same expressions without their
	// `for` must fire for the conditions the run brings about, or the check above proves
	// nothing: two pods at once in every rollout (RolloutStuck's expression), and no recovery
	// agent on this node (RecoveryAgentAbsent's).
	for _, name := range []string{"KubeApiserverProxyRolloutStuck", "KubeApiserverProxyRecoveryAgentAbsent"} {
		control := nodecheck.ControlPrefix + name
		fired := alertNames(fmt.Sprintf(`count by (alertname) (max_over_time(ALERTS{alertname=%q, alertstate="firing"}[%s]))`, control, w))
		n.Check(fired == control, "prometheus: the control copy of %s (its expression without `for`) fired during the run: %s", name, fired)
	}
}

// prometheusStop stops the discovery and Prometheus (SIGTERM, SIGKILL after 30 s).
func (lc *lifecycle) prometheusStop() {
	p := lc.prom
	if p == nil {
		return
	}
	lc.prom = nil
	p.stopSD()
	<-p.discovered
	p.proc.Signal(syscall.SIGTERM)
	if !lc.n.WaitFor(30*time.Second, p.proc.Exited) {
		p.proc.Signal(syscall.SIGKILL)
	}
	p.proc.ExitCode()
}
