package node

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/step"
)

// The kubeadm upgrade scenario's steps under load: the node's two loads and their observers
// (package step), the load in a pod through the kubernetes Service, the closing table.

// The client inside a pod: cmd/loadgen on the pod network, as a ServiceAccount bound to
// cluster-admin, whose kubeconfig names the `kubernetes` Service's address (10.96.0.1:443,
// through kube-proxy's rules) with the pod's token. Its report lands on the node.
const podKubeconfig = `apiVersion: v1
kind: Config
clusters:
- name: service
  cluster:
    server: https://10.96.0.1:443
    certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
users:
- name: pod
  user:
    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
contexts:
- name: pod
  context: {cluster: service, user: pod}
current-context: pod
`

func (u *upgrade) podSetup() error {
	if err := os.MkdirAll(kuPodReports, 0o755); err != nil {
		return err
	}
	meta := metav1.ObjectMeta{Name: "ku-loadgen", Namespace: "default"}
	_, err := u.Client.CoreV1().ServiceAccounts("default").Create(u.Ctx, &corev1.ServiceAccount{ObjectMeta: meta}, metav1.CreateOptions{})
	if err == nil || apierrors.IsAlreadyExists(err) {
		_, err = u.Client.RbacV1().ClusterRoleBindings().Create(u.Ctx, &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: "ku-loadgen"},
			RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "cluster-admin"},
			Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "ku-loadgen", Namespace: "default"}},
		}, metav1.CreateOptions{})
	}
	if err == nil || apierrors.IsAlreadyExists(err) {
		_, err = u.Client.CoreV1().ConfigMaps("default").Create(u.Ctx, &corev1.ConfigMap{ObjectMeta: meta,
			Data: map[string]string{"kubeconfig": podKubeconfig}}, metav1.CreateOptions{})
	}
	if apierrors.IsAlreadyExists(err) {
		err = nil
	}
	return err
}

// loadPod is the pod of step name's load.
func (u *upgrade) loadPod(name, criteria string) *corev1.Pod {
	grace := int64(90)
	directory := corev1.HostPathDirectory
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "ku-loadgen-" + name, Namespace: "default"},
		Spec: corev1.PodSpec{
			NodeName:                      u.NodeName,
			ServiceAccountName:            "ku-loadgen",
			TerminationGracePeriodSeconds: &grace,
			Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			Containers: []corev1.Container{{
				Name:            "loadgen",
				Image:           u.ImageRepo + "/loadgen:dev",
				ImagePullPolicy: corev1.PullNever,
				Args:            []string{"-kubeconfig", "/etc/ku-loadgen/kubeconfig", "-out", "/reports/" + name + ".json", "-ready", "/reports/" + name + ".ready", "-criteria", criteria},
				// A share of the CPU like the node's loads (a BestEffort pod gets 2 of 1024
				// shares, and starves while a new apiserver starts on this 2-core node).
				Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
					corev1.ResourceCPU: resource.MustParse("500m"), corev1.ResourceMemory: resource.MustParse("64Mi")}},
				VolumeMounts: []corev1.VolumeMount{{Name: "kubeconfig", MountPath: "/etc/ku-loadgen"}, {Name: "reports", MountPath: "/reports"}},
			}},
			Volumes: []corev1.Volume{
				{Name: "kubeconfig", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "ku-loadgen"}}}},
				{Name: "reports", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: kuPodReports, Type: &directory}}},
			},
		},
	}
}

// podStart starts the load in a pod for step name; true once its load runs.
func (u *upgrade) podStart(name, criteria string) bool {
	report, ready := filepath.Join(kuPodReports, name+".json"), filepath.Join(kuPodReports, name+".ready")
	_ = os.Remove(report)
	_ = os.Remove(ready)
	_, err := u.Client.CoreV1().Pods("default").Create(u.Ctx, u.loadPod(name, criteria), metav1.CreateOptions{})
	if err == nil && u.WaitFor(180*time.Second, func() bool { _, err := os.Stat(ready); return err == nil }) {
		return true
	}
	u.Fail("%s: the load in a pod did not start within 180 s: %s%s", name, u.loadPodState(name), errSuffix(err))
	return false
}

// loadPodState: the load pod's PodLine and its last log lines.
func (u *upgrade) loadPodState(name string) string {
	pods := u.Client.CoreV1().Pods("default")
	p, err := pods.Get(u.Ctx, "ku-loadgen-"+name, metav1.GetOptions{})
	if err != nil {
		return err.Error()
	}
	tail := int64(3)
	log, err := pods.GetLogs(p.Name, &corev1.PodLogOptions{TailLines: &tail}).DoRaw(u.Ctx)
	if err != nil {
		log = []byte(err.Error())
	}
	return PodLine(p) + " " + strings.ReplaceAll(strings.TrimSpace(string(log)), "\n", " ")
}

// podEnd deletes step name's load pod (SIGTERM: the load reports) and judges its report like
// the node's loads: a pass without problems, else a failure (a note when reportOnly).
func (u *upgrade) podEnd(name, what string, reportOnly bool) {
	what += " (in a pod, through the kubernetes Service)"
	_ = u.Client.CoreV1().Pods("default").Delete(u.Ctx, "ku-loadgen-"+name, metav1.DeleteOptions{})
	path := filepath.Join(kuPodReports, name+".json")
	var rep *step.Report
	if !u.WaitFor(120*time.Second, func() bool { r, err := step.Read(path); rep = r; return err == nil }) {
		u.Fail("%s: no report within 120 s: %s", what, u.loadPodState(name))
		return
	}
	if b, err := os.ReadFile(path); err == nil {
		_ = os.WriteFile(u.Path("step-"+name+"-pod.json"), b, 0o644)
	}
	line, clean := podVerdict(rep)
	switch {
	case clean:
		u.Pass("%s: %s", what, line)
	case reportOnly:
		u.Note("%s: %s", what, line)
	default:
		u.Fail("%s: %s", what, line)
	}
}

// podVerdict is what the load in a pod saw, on one line, and whether it saw no problem.
func podVerdict(r *step.Report) (string, bool) {
	if r.Load == nil {
		return "load 0 requests ok, 0 failed; relists 0; problems: not a report", false
	}
	return fmt.Sprintf("load %d requests ok, %d failed; relists %d; problems: %s", r.Load.TotalOK(), r.Load.TotalFailed(),
		r.Load.TotalRelists(), problems(r)), len(r.Problems) == 0
}

// kuStep is one step of the upgrade: the loads on both addresses, the load in a pod once it
// is set up, and the control plane's logs from its start.
type kuStep struct {
	name       string
	both       Both
	pod        bool
	mark       LogMark
	reportOnly bool
	// leaders stops the step's read of the controllers' Leases and says who led when.
	leaders func() (string, bool)
}

// kuLeases are the controllers' leader-election Leases (kube-system).
var kuLeases = []string{"kube-controller-manager", "kube-scheduler"}

// watchLeaders reads the controllers' Leases every 250 ms until the returned function is
// called, which says per Lease how often leadership passed and the longest time without a
// leader (nodecheck.LeaderGap), and whether each stayed within its lease's duration.
func (u *upgrade) watchLeaders() func() (string, bool) {
	ctx, cancel := context.WithCancel(u.Ctx)
	samples := map[string][]nodecheck.LeaseSample{}
	durations := map[string]time.Duration{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			for _, name := range kuLeases {
				l, err := u.Client.CoordinationV1().Leases("kube-system").Get(ctx, name, metav1.GetOptions{})
				if err != nil || l.Spec.HolderIdentity == nil {
					continue
				}
				s := nodecheck.LeaseSample{Holder: *l.Spec.HolderIdentity}
				if l.Spec.AcquireTime != nil {
					s.Acquire = l.Spec.AcquireTime.Time
				}
				if l.Spec.RenewTime != nil {
					s.Renew = l.Spec.RenewTime.Time
				}
				// The holders' duration (a released lease says 1 s).
				if l.Spec.LeaseDurationSeconds != nil && *l.Spec.HolderIdentity != "" {
					durations[name] = time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second
				}
				samples[name] = append(samples[name], s)
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return func() (string, bool) {
		cancel()
		<-done
		var lines []string
		within := true
		for _, name := range kuLeases {
			line, ok := nodecheck.LeaderLine(name, samples[name], durations[name])
			lines = append(lines, line)
			within = within && ok
		}
		return strings.Join(lines, "; "), within
	}
}

// leadersLive says who holds each controller's Lease and how long ago it was renewed, and
// whether every one is held and was renewed within its duration: a leader that works. A step
// starts only then, so that a time without a leader it measures began within it.
func (u *upgrade) leadersLive() (string, bool) {
	var parts []string
	live := true
	for _, name := range kuLeases {
		l, err := u.Client.CoordinationV1().Leases("kube-system").Get(u.Ctx, name, metav1.GetOptions{})
		switch {
		case err != nil:
			parts, live = append(parts, name+": "+err.Error()), false
		case l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" || l.Spec.RenewTime == nil || l.Spec.LeaseDurationSeconds == nil:
			parts, live = append(parts, name+": not held"), false
		default:
			ago := time.Since(l.Spec.RenewTime.Time)
			held := ago <= time.Duration(*l.Spec.LeaseDurationSeconds)*time.Second
			parts = append(parts, fmt.Sprintf("%s: %s, renewed %.1f s ago (lease %d s)", name, *l.Spec.HolderIdentity, ago.Seconds(), *l.Spec.LeaseDurationSeconds))
			live = live && held
		}
	}
	return strings.Join(parts, "; "), live
}

// waitLeaders waits up to timeout for leadersLive; false (and a failed check naming before
// what) when the controllers do not lead by then.
func (u *upgrade) waitLeaders(timeout time.Duration, before string) bool {
	live := u.WaitFor(timeout, func() bool { _, ok := u.leadersLive(); return ok })
	if !live {
		line, _ := u.leadersLive()
		u.Fail("%s: the controllers have no working leader after %.0f s: %s", before, timeout.Seconds(), line)
	}
	return live
}

// startStep starts step name: the load on NODE_IP:6443 with the probers of both addresses
// and the endpoints watcher, a second load on 127.0.0.1:6443, and the load in a pod. watch,
// when not nil, replaces Watched (a step that restarts the controllers does not watch them).
// It waits first for the controllers' leaders (waitLeaders): a step is not charged with a time
// without a leader the one before it left.
func (u *upgrade) startStep(name string, watch *step.Options, reportOnly bool) *kuStep {
	u.waitLeaders(120*time.Second, "before the step "+name)
	s := &kuStep{name: name, mark: u.MarkLogs(), reportOnly: reportOnly, leaders: u.watchLeaders()}
	s.both = u.StartBoth(name, watch, reportOnly)
	criteria := ""
	if watch != nil {
		criteria = watch.Criteria
	}
	s.pod = u.pod && u.podStart(name, criteria)
	return s
}

// endStep stops the step and reports its verdicts, then the control plane's error lines.
func (u *upgrade) endStep(s *kuStep, what string) {
	// kubeadm-sync stops a replaced controller before its successor and releases its lease:
	// the time without a leader stays within the lease's duration.
	if line, within := s.leaders(); s.reportOnly {
		u.Note("%s: the controllers' leaders: %s", what, line)
	} else {
		u.Check(within, "%s: the controllers' leaders, each time without one within its lease: %s", what, line)
	}
	s.both.End(what)
	if s.pod {
		u.podEnd(s.name, what, s.reportOnly)
	}
	u.LogVerdict(what, s.mark, s.reportOnly)
}

// table: one row per step and client (the node address, 127.0.0.1, the pod): seconds,
// requests, failed, refused connects, relists, watch cuts.
func (u *upgrade) table(steps ...string) []string {
	rows := []string{fmt.Sprintf("%-22s %8s %9s %7s %8s %8s %8s", "step", "seconds", "requests", "failed", "refused", "relists", "cut")}
	for _, name := range steps {
		for _, c := range []struct{ suffix, client string }{{"", "NODE_IP"}, {"-local", "127.0.0.1"}, {"-pod", "pod"}} {
			rep, err := step.Read(u.Path("step-" + name + c.suffix + ".json"))
			if row, ok := tableRow(name+" ("+c.client+")", rep, err); ok {
				rows = append(rows, row)
			} else if c.suffix != "-pod" {
				rows = append(rows, fmt.Sprintf("%-22s no report", name+c.suffix))
			}
		}
	}
	return rows
}

// tableRow is a step's row of the table (false when there is no report with a load).
func tableRow(label string, r *step.Report, err error) (string, bool) {
	if err != nil || r == nil {
		return "", false
	}
	line, err := r.Line()
	if err != nil {
		return "", false
	}
	// seconds requests failed refused failed-connects relists cut problems…
	f := strings.Fields(line)
	return fmt.Sprintf("%-22s %8s %9s %7s %8s %8s %8s", label, f[0], f[1], f[2], f[3], f[5], f[6]), true
}
