package node

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// DeploymentPods is the selector of the kube-apiserver Deployment's pods (mirror pods have no
// pod-template-hash); Scenario.PodSelector, unless a scenario renders other labels.
const DeploymentPods = "component=kube-apiserver,pod-template-hash"

func (n *Scenario) podSelector() string {
	if n.PodSelector != "" {
		return n.PodSelector
	}
	return DeploymentPods
}

// DeployPods are the Deployment's pods, oldest first.
func (n *Scenario) DeployPods() []corev1.Pod {
	list, err := n.Client.CoreV1().Pods("kube-system").List(n.Ctx, metav1.ListOptions{LabelSelector: n.podSelector()})
	if err != nil {
		return nil
	}
	pods := list.Items
	sort.SliceStable(pods, func(i, j int) bool {
		return pods[i].CreationTimestamp.Before(&pods[j].CreationTimestamp)
	})
	return pods
}

// PodLine is "name phase ready restarts waiting" of a pod, the columns kubectl would print
// (ready and restarts per container, comma-separated; "<none>" when no container waits).
func PodLine(p *corev1.Pod) string {
	var ready, restarts, waiting []string
	for _, c := range p.Status.ContainerStatuses {
		ready = append(ready, strconv.FormatBool(c.Ready))
		restarts = append(restarts, strconv.Itoa(int(c.RestartCount)))
		if c.State.Waiting != nil {
			waiting = append(waiting, c.State.Waiting.Reason)
		}
	}
	return fmt.Sprintf("%s %s %s %s %s", p.Name, p.Status.Phase, cmp.Or(strings.Join(ready, ","), "<none>"),
		cmp.Or(strings.Join(restarts, ","), "<none>"), cmp.Or(strings.Join(waiting, ","), "<none>"))
}

// DeployPodsLine is every pod's PodLine, for the report.
func (n *Scenario) DeployPodsLine() string {
	var lines []string
	pods := n.DeployPods()
	for i := range pods {
		line := PodLine(&pods[i])
		if pods[i].DeletionTimestamp != nil {
			line += " (deleting)"
		}
		lines = append(lines, line)
	}
	if lines == nil {
		return "no pods"
	}
	return strings.Join(lines, "; ")
}

// PodReady: the Deployment's pod name exists and all its containers are ready.
func (n *Scenario) PodReady(name string) bool {
	p, err := n.Client.CoreV1().Pods("kube-system").Get(n.Ctx, name, metav1.GetOptions{})
	if err != nil || len(p.Status.ContainerStatuses) == 0 {
		return false
	}
	for _, c := range p.Status.ContainerStatuses {
		if !c.Ready {
			return false
		}
	}
	return true
}

// OnePodLeft: the Deployment has exactly one pod.
func (n *Scenario) OnePodLeft() bool {
	list, err := n.Client.CoreV1().Pods("kube-system").List(n.Ctx, metav1.ListOptions{LabelSelector: n.podSelector()})
	return err == nil && len(list.Items) == 1
}

// ThePod is the name of the Deployment's oldest pod ("" if none).
func (n *Scenario) ThePod() string {
	if pods := n.DeployPods(); len(pods) > 0 {
		return pods[0].Name
	}
	return ""
}

// DeployReady is what `kubectl rollout status` checks, through the API.
func (n *Scenario) DeployReady() bool {
	d, err := n.Client.AppsV1().Deployments("kube-system").Get(n.Ctx, "kube-apiserver", metav1.GetOptions{})
	return err == nil && nodecheck.RolloutDone(d)
}

// PodScheduled: some pod of the Deployment is bound to a node.
func (n *Scenario) PodScheduled() bool {
	for _, p := range n.DeployPods() {
		if p.Spec.NodeName != "" {
			return true
		}
	}
	return false
}

// ControlPlaneRestarts are the restart counts of the controller-manager and the scheduler,
// as their mirror pods report them: "kube-controller-manager N; kube-scheduler N; ".
func (n *Scenario) ControlPlaneRestarts() string {
	var b strings.Builder
	for _, c := range []string{"kube-controller-manager", "kube-scheduler"} {
		p, err := n.Client.CoreV1().Pods("kube-system").Get(n.Ctx, c+"-"+n.NodeName, metav1.GetOptions{})
		switch {
		case err != nil:
			fmt.Fprintf(&b, "%s %v; ", c, err)
		case len(p.Status.ContainerStatuses) == 0:
			fmt.Fprintf(&b, "%s ; ", c)
		default:
			fmt.Fprintf(&b, "%s %d; ", c, p.Status.ContainerStatuses[0].RestartCount)
		}
	}
	return b.String()
}

// Logs is a container's log (previous: the one before its last restart), at most tail lines
// (0: all).
func (n *Scenario) Logs(pod, container string, tail int64, previous bool) (string, error) {
	o := &corev1.PodLogOptions{Container: container, Previous: previous}
	if tail > 0 {
		o.TailLines = &tail
	}
	b, err := n.Client.CoreV1().Pods("kube-system").GetLogs(pod, o).DoRaw(n.Ctx)
	return string(b), err
}

// PodDiagnostics notes the container states, the last log lines and the events of the
// Deployment's pods.
func (n *Scenario) PodDiagnostics() {
	for _, p := range n.DeployPods() {
		n.Note("pod/%s:", p.Name)
		for _, c := range append(append([]corev1.ContainerStatus{}, p.Status.InitContainerStatuses...), p.Status.ContainerStatuses...) {
			state, _ := json.Marshal(c.State)
			last, _ := json.Marshal(c.LastTerminationState)
			n.Note("    %s ready=%t restarts=%d %s last=%s", c.Name, c.Ready, c.RestartCount, state, last)
		}
		for _, c := range []string{"kube-apiserver", "proxy"} {
			n.Note("  %s log (last 6 lines):", c)
			log, err := n.Logs(p.Name, c, 6, false)
			if err != nil {
				log = err.Error()
			}
			for _, l := range strings.Split(strings.TrimSpace(log), "\n") {
				n.Note("    %s", report.Cut(l, 400))
			}
			if prev, err := n.Logs(p.Name, c, 4, true); err == nil {
				for _, l := range strings.Split(strings.TrimSpace(prev), "\n") {
					n.Note("    previous: %s", report.Cut(l, 400))
				}
			}
		}
	}
	events, err := n.Client.CoreV1().Events("kube-system").List(n.Ctx, metav1.ListOptions{})
	if err != nil {
		n.Note("events: %v", err)
		return
	}
	items := events.Items
	sort.SliceStable(items, func(i, j int) bool { return items[i].LastTimestamp.Before(&items[j].LastTimestamp) })
	n.Note("events:")
	var mine []string
	for _, e := range items {
		if deploymentPod.MatchString(e.InvolvedObject.Name) {
			mine = append(mine, fmt.Sprintf("%s %s %s/%s: %s", e.LastTimestamp.Format(time.TimeOnly), e.Reason, e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Message))
		}
	}
	for _, l := range report.Last(mine, 12) {
		n.Note("    %s", report.Cut(l, 300))
	}
}

var deploymentPod = regexp.MustCompile(`kube-apiserver-[0-9a-f]{5,}`)

// KubeletPods are the pods the kubelet itself runs (its read-only port's /pods).
func (n *Scenario) KubeletPods() (*corev1.PodList, error) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + n.NodeIP + ":10255/pods")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("kubelet /pods: %s", resp.Status)
	}
	var pods corev1.PodList
	return &pods, json.NewDecoder(resp.Body).Decode(&pods)
}

// StaticAPIServerGone: the kubelet lists no static pod kube-apiserver-NODE any more.
func (n *Scenario) StaticAPIServerGone() bool {
	pods, err := n.KubeletPods()
	return err == nil && nodecheck.Named(pods, "kube-apiserver-"+n.NodeName) == nil
}

// Rollout runs a change of the Deployment (kubectl), then `kubectl rollout status` until the
// rollout completes and one pod is left; timed.
func (n *Scenario) Rollout(what string, kubectl ...string) bool {
	t0 := time.Now()
	if out, err := n.Kubectls(30*time.Second, kubectl...); err != nil {
		n.Fail("%s: %v: %s", what, err, out)
		return false
	}
	status, err := n.Kubectls(320*time.Second, "rollout", "status", "deployment/kube-apiserver", "--timeout=300s")
	if err == nil && n.WaitFor(90*time.Second, n.OnePodLeft) {
		n.Pass("%s: rollout complete after %s s (kubectl rollout status: %s); pods: %s", what, Since(t0), lastLines(status, 1), n.DeployPodsLine())
		return true
	}
	n.Fail("%s: rollout not complete after %s s: %s pods: %s", what, Since(t0), report.Cut(status, 300), n.DeployPodsLine())
	n.PodDiagnostics()
	return false
}

// The control plane's logs: the controller-manager's, the scheduler's and kube-proxy's (their
// pods' log files) and the kubelet's.
func (n *Scenario) logFiles() []string {
	var files []string
	for _, pattern := range []string{"kube-system_kube-controller-manager-*/*/*.log", "kube-system_kube-scheduler-*/*/*.log", "kube-system_kube-proxy-*/*/*.log"} {
		m, _ := filepath.Glob(filepath.Join(n.State, "pod-logs", pattern))
		files = append(files, m...)
	}
	return append(files, n.Path("kubelet.log"))
}

// LogMark remembers how long each control-plane log is; LogVerdict(what, mark, …) judges the
// klog error lines written since.
type LogMark map[string]int

// MarkLogs is a LogMark of now.
func (n *Scenario) MarkLogs() LogMark {
	m := LogMark{}
	for _, f := range n.logFiles() {
		m[f] = countLines(f)
	}
	return m
}

func countLines(path string) int {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	lines := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines++
	}
	return lines
}

var (
	klogError = regexp.MustCompile(`(^| )E[0-9]{4} `)
	reaching  = regexp.MustCompile(`connection refused|connection reset|EOF|http2|GOAWAY|i/o timeout|deadline exceeded|Too Many Requests|unable to handle the request|broken pipe|dial tcp|TLS handshake|no route`)
	klogHead  = regexp.MustCompile(`^(.* )?E[0-9]{4} [0-9:.]+ +[0-9]+ `)
	podNames  = regexp.MustCompile(`kube-apiserver-[0-9a-z]{8,10}(-[0-9a-z]{5})?`)
	numbers   = regexp.MustCompile(`[0-9]{3,}`)
	ids       = regexp.MustCompile(`(task|containerID=)[^ ]*`)
)

// ErrorLines are the klog error lines (E....) the control plane wrote since the mark, each
// after its writer's name.
func (n *Scenario) ErrorLines(since LogMark) []string {
	var errs []string
	for _, f := range n.logFiles() {
		label := "kubelet"
		if filepath.Base(f) != "kubelet.log" {
			// The pod's log directory: NAMESPACE_NAME_UID.
			label = filepath.Base(filepath.Dir(filepath.Dir(f)))
			label = strings.TrimPrefix(label[:max(0, strings.LastIndex(label, "_"))], "kube-system_")
			label = strings.TrimSuffix(label, "-"+n.NodeName)
		}
		file, err := os.Open(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(file)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for i := 0; sc.Scan(); i++ {
			if i >= since[f] && klogError.MatchString(sc.Text()) {
				errs = append(errs, label+": "+sc.Text())
			}
		}
		file.Close()
	}
	return errs
}

// SummariseErrors is how many error lines ("WRITER: LINE") there are, how many of them
// about reaching the apiserver, and the kinds (numbers and pod hashes blanked) with their
// counts, most frequent first.
func SummariseErrors(errs []string) string {
	conn := 0
	kinds := map[string]int{}
	for _, e := range errs {
		if reaching.MatchString(e) {
			conn++
		}
		writer, line, _ := strings.Cut(e, ": ")
		line = klogHead.ReplaceAllString(line, "")
		line = podNames.ReplaceAllString(line, "kube-apiserver-X")
		line = numbers.ReplaceAllString(line, "N")
		line = ids.ReplaceAllString(line, "$1 X")
		kinds[report.Cut(writer+": "+line, 230)]++
	}
	keys := make([]string, 0, len(kinds))
	for k := range kinds {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if kinds[keys[i]] != kinds[keys[j]] {
			return kinds[keys[i]] > kinds[keys[j]]
		}
		return keys[i] < keys[j]
	})
	var b strings.Builder
	fmt.Fprintf(&b, "%d error lines, %d of them about reaching the apiserver; by kind:", len(errs), conn)
	for _, k := range report.First(keys, 12) {
		fmt.Fprintf(&b, " [%d] %s;", kinds[k], k)
	}
	return b.String()
}
