package node

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// The node's own checks, before any scenario of the proxy: what smoke's modes without a
// scenario rehearse (`smoke`, `--with-apiserver`, `--with-control-plane`), and the control
// plane's coming up that every mode with an apiserver waits for first.
//
//   - RunAPIServer: kubeadm's static kube-apiserver (and etcd) ready, the node registered by
//     the kubelet, the apiserver's mirror pod Ready;
//   - RunControllers: the controller-manager's and the scheduler's mirror pods Ready;
//   - RunDeployment: a Deployment run, rolled (`kubectl rollout restart`'s patch) and deleted
//     by the real controllers;
//   - RunStaticPods: a static pod on the host network (runtime, exec probe, SIGTERM on
//     removal) and one on the pod network (the macvlan CNI), with their mirror pods and the
//     node's Ready condition when an apiserver runs;
//   - RunStopControlPlane: the controllers', the apiserver's and etcd's manifests removed,
//     each pod gone.

// The test image's pods (tests/cluster/node/nodetest) and their ports.
const (
	staticPodName = "nodetest"
	testPort      = 18080 // the static pod's, on the node address (host network)
	podNetPort    = 18081 // the pod-network pod's, on its pod IP
	deployPort    = 18082 // the Deployment's pods'
	nodetestReply = "nodetest ok"
)

// NodetestImage is the test image's name, as smoke imports it.
func (n *Scenario) NodetestImage() string { return n.ImageRepo + "/nodetest:1" }

// RunAPIServer waits for kubeadm's control plane: kube-apiserver's /readyz, the node's
// registration and the apiserver's mirror pod. False when the apiserver never answered (the
// scenarios after it cannot run).
func RunAPIServer(n *Scenario) bool {
	t0 := time.Now()
	ready := func() bool {
		_, err := n.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(n.Ctx)
		return err == nil
	}
	if !n.WaitFor(240*time.Second, ready) {
		n.Fail("kube-apiserver not ready within 240 s")
		n.runtimeDiagnostics()
		return false
	}
	version := "?"
	if v, err := n.Client.Discovery().ServerVersion(); err == nil {
		version = v.GitVersion
	}
	n.Pass("kube-apiserver %s ready (static pod, etcd static pod) after %s s", version, Since(t0))
	n.WaitNode()
	return true
}

// RunControllers waits for the mirror pods of kube-controller-manager and kube-scheduler.
// False when either is not Ready (a scenario needs both).
func RunControllers(n *Scenario) bool {
	ok := true
	for _, c := range []string{"kube-controller-manager", "kube-scheduler"} {
		ok = n.mirrorPodReady("kube-system", c+"-"+n.NodeName, 120*time.Second) && ok
	}
	return ok
}

// mirrorPodReady checks that the mirror pod ns/name is Ready in the apiserver within timeout.
func (n *Scenario) mirrorPodReady(ns, name string, timeout time.Duration) bool {
	return n.Check(n.WaitFor(timeout, func() bool { return n.mirrorReady(ns, name) }),
		"mirror pod %s/%s is Ready in the apiserver (%s s at most)", ns, name, seconds(timeout))
}

func (n *Scenario) mirrorReady(ns, name string) bool {
	p, err := n.Client.CoreV1().Pods(ns).Get(n.Ctx, name, metav1.GetOptions{})
	return err == nil && nodecheck.Ready(p)
}

// nodeStatus is the node's Ready condition as "STATUS REASON: MESSAGE" ("" while the node is
// not registered).
func (n *Scenario) nodeStatus() string {
	node, err := n.Client.CoreV1().Nodes().Get(n.Ctx, n.NodeName, metav1.GetOptions{})
	if err != nil {
		return ""
	}
	return nodecheck.NodeReady(node)
}

// ref is a pointer to a copy of v (the API's optional fields).
func ref[T any](v T) *T { return &v }

func seconds(d time.Duration) string { return fmt.Sprintf("%.0f", d.Seconds()) }

// RunStaticPods runs the test image as two static pods, one after the other: on the host
// network, then on the pod network.
func RunStaticPods(n *Scenario) bool {
	n.hostNetworkPod()
	n.podNetworkPod()
	return true
}

// staticPod writes a static pod's manifest the way an operator should: elsewhere first, then
// renamed in, so that the kubelet never reads half of it.
func (n *Scenario) staticPod(p *corev1.Pod) error {
	p.APIVersion, p.Kind = "v1", "Pod"
	p.Namespace = "default"
	b, err := yaml.Marshal(p)
	if err != nil {
		return err
	}
	tmp := n.Path(p.Name + ".yaml")
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return Move(tmp, n.manifest(p.Name))
}

func (n *Scenario) manifest(name string) string { return n.Manifests + "/" + name + ".yaml" }

// nodetest is the test image's container: `nodetest serve ADDR [MARKER]`, ready when
// `nodetest probe PROBE...` passes.
func (n *Scenario) nodetest(serve, probe []string) corev1.Container {
	return corev1.Container{
		Name: "nodetest", Image: n.NodetestImage(), ImagePullPolicy: corev1.PullNever,
		Command: append([]string{"/nodetest", "serve"}, serve...),
		ReadinessProbe: &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: append([]string{"/nodetest", "probe"}, probe...)}},
			PeriodSeconds: 1, FailureThreshold: 3,
		},
	}
}

// hostNetworkPod: a static pod on the host network whose exec readiness probe reaches its
// server on the node address; removed again, its container must stop on SIGTERM (it writes
// a marker into its hostPath volume) and take its sandbox with it.
func (n *Scenario) hostNetworkPod() {
	baseline, _ := n.runningTasks()
	marker := n.Path("marker")
	if err := os.MkdirAll(marker, 0o755); err != nil {
		n.Fail("marker directory: %v", err)
		return
	}
	addr := net.JoinHostPort(n.NodeIP, fmt.Sprint(testPort))
	c := n.nodetest([]string{addr, "/marker/terminated"}, []string{addr})
	c.VolumeMounts = []corev1.VolumeMount{{Name: "marker", MountPath: "/marker"}}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: staticPodName},
		Spec: corev1.PodSpec{
			HostNetwork: true, TerminationGracePeriodSeconds: ref[int64](10),
			Containers: []corev1.Container{c},
			Volumes: []corev1.Volume{{Name: "marker", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{
				Path: marker, Type: ref(corev1.HostPathDirectory)}}}},
		},
	}
	if err := n.staticPod(pod); err != nil {
		n.Fail("static pod manifest: %v", err)
		return
	}
	t0 := time.Now()
	if !n.WaitFor(90*time.Second, func() bool { return n.imageRunning(n.NodetestImage()) }) {
		n.Fail("static pod's container not running within 90 s")
		n.runtimeDiagnostics()
		return
	}
	n.Pass("static pod's container runs (containerd task RUNNING) after %s s", Since(t0))
	if n.WaitFor(60*time.Second, func() bool { return n.kubeletReady(staticPodName) }) {
		n.Pass("exec readiness probe passes: pod Ready in the kubelet's /pods after %s s", Since(t0))
	} else {
		pods, err := n.KubeletPods()
		n.Fail("pod not Ready within 60 s: %s", kubeletView(pods, err))
	}
	n.Check(answers(addr), "hostNetwork container answers on %s", addr)
	if n.Client != nil {
		n.mirrorPodReady("default", staticPodName+"-"+n.NodeName, 60*time.Second)
	}

	_ = os.Remove(n.manifest(staticPodName))
	t0 = time.Now()
	if n.WaitFor(60*time.Second, func() bool { return n.tasksAre(baseline) }) {
		n.Pass("manifest removed: container and sandbox stopped after %s s", Since(t0))
	} else {
		n.Fail("test pod's tasks still running 60 s after the manifest was removed")
	}
	got, _ := os.ReadFile(marker + "/terminated")
	n.Check(strings.TrimSpace(string(got)) == "terminated",
		"container stopped on SIGTERM within its grace period (marker in its hostPath volume)")
}

// podNetworkPod: a static pod in its own network namespace (a macvlan and an address from the
// CNI plugins), reached from the host at its pod IP, and Ready only when it reaches the node
// address (the kubelet's read-only port) from there.
func (n *Scenario) podNetworkPod() {
	baseline, _ := n.runningTasks()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "podnet"},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: ref[int64](10),
			Containers: []corev1.Container{n.nodetest([]string{fmt.Sprintf(":%d", podNetPort)},
				[]string{fmt.Sprintf("127.0.0.1:%d", podNetPort), n.NodeIP + ":10255"})},
		},
	}
	if err := n.staticPod(pod); err != nil {
		n.Fail("pod-network pod manifest: %v", err)
		return
	}
	t0 := time.Now()
	var ip string
	hasIP := func() bool { ip = n.kubeletPodIP("podnet"); return ip != "" }
	addr := func() string { return net.JoinHostPort(ip, fmt.Sprint(podNetPort)) }
	if n.WaitFor(90*time.Second, hasIP) && n.WaitFor(60*time.Second, func() bool { return answers(addr()) }) {
		n.Pass("pod-network pod (macvlan CNI) answers at its pod IP %s after %s s", addr(), Since(t0))
	} else {
		n.Fail("pod-network pod not reachable at its pod IP %q within the deadline", ip)
		n.kubeletErrors(`^E[0-9]{4}.*(?i:cni|network|sandbox)`, 5)
	}
	n.Check(n.WaitFor(30*time.Second, func() bool { return n.kubeletReady("podnet") }),
		"pod-network pod Ready: from its own network namespace it reaches %s:10255 (30 s at most)", n.NodeIP)
	if n.Client != nil {
		ready := func() bool { return strings.HasPrefix(n.nodeStatus(), "True") }
		if n.WaitFor(60*time.Second, ready) {
			n.Pass("node %s is Ready (the CNI config is loaded)", n.NodeName)
		} else {
			n.Fail("node %s not Ready: %s", n.NodeName, n.nodeStatus())
		}
	}
	_ = os.Remove(n.manifest("podnet"))
	t0 = time.Now()
	if n.WaitFor(60*time.Second, func() bool { return n.tasksAre(baseline) }) {
		n.Pass("pod-network pod removed after %s s", Since(t0))
	} else {
		n.Fail("pod-network pod's tasks still running 60 s after its manifest was removed")
	}
}

// kubeletReady: a static pod NAME-… is Ready in the kubelet's own view.
func (n *Scenario) kubeletReady(name string) bool {
	pods, err := n.KubeletPods()
	return err == nil && nodecheck.ReadyWithPrefix(pods, name)
}

// kubeletPodIP is the IP the kubelet reports for static pod name ("" until known).
func (n *Scenario) kubeletPodIP(name string) string {
	pods, err := n.KubeletPods()
	if err != nil {
		return ""
	}
	if p := nodecheck.Named(pods, name+"-"+n.NodeName); p != nil {
		return p.Status.PodIP
	}
	return ""
}

// kubeletView is the kubelet's pods as the report shows them on a failure.
func kubeletView(pods *corev1.PodList, err error) string {
	if err != nil {
		return err.Error()
	}
	return strings.Join(nodecheck.Lines(pods), "; ")
}

// answers: the test server at addr greets us within 2 s.
func answers(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	line, _ := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line) == nodetestReply
}

// Ctr runs containerd's ctr on the node's runtime, in the kubelet's namespace, and returns
// its stdout: on a cgroup v1 host ctr writes a deprecation warning on stderr first, which no
// parse of its output may see (stderr goes into the error).
func (n *Scenario) Ctr(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(n.Ctx, 30*time.Second)
	defer cancel()
	argv := append([]string{"--address", n.Path("containerd/containerd.sock"), "-n", "k8s.io"}, args...)
	cmd := exec.CommandContext(ctx, n.Bin("ctr"), argv...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, lastLines(stderr.String(), 3))
	}
	return string(out), nil
}

// containerInfo is what `ctr containers info ID` says of a container: its image and labels
// (the kubelet's io.kubernetes.pod.name and the rest). An error when ctr failed or its
// output is not the container's JSON: a check must not read "no such container" into it.
func (n *Scenario) containerInfo(id string) (image string, labels map[string]string, err error) {
	info, err := n.Ctr("containers", "info", id)
	if err != nil {
		return "", nil, err
	}
	var c struct {
		Image  string
		Labels map[string]string
	}
	if err := json.Unmarshal([]byte(info), &c); err != nil {
		return "", nil, fmt.Errorf("ctr containers info %s: %w: %s", id, err, report.Cut(info, 200))
	}
	return c.Image, c.Labels, nil
}

// runningTasks are the ids of the runtime's RUNNING tasks, sorted.
func (n *Scenario) runningTasks() ([]string, error) {
	ls, err := n.Ctr("tasks", "ls")
	if err != nil {
		return nil, err
	}
	ids := RunningTasks(ls)
	slices.Sort(ids)
	return ids, nil
}

// tasksAre: the running tasks are exactly these (the ones before a pod came).
func (n *Scenario) tasksAre(want []string) bool {
	ids, err := n.runningTasks()
	return err == nil && slices.Equal(ids, want)
}

// imageRunning: a container from image has a running task (false when the runtime did not
// answer: callers wait for it to hold, or for its opposite, imageGone).
func (n *Scenario) imageRunning(image string) bool {
	running, ok := n.imageTasks(image)
	return ok && running
}

// imageGone: the runtime answered, and no container from image has a running task.
func (n *Scenario) imageGone(image string) bool {
	running, ok := n.imageTasks(image)
	return ok && !running
}

// imageTasks: whether a container from image has a running task; ok is false when the
// runtime's answer could not be read.
func (n *Scenario) imageTasks(image string) (running, ok bool) {
	ids, ok := n.runningContainers(func(img string, _ map[string]string) bool { return img == image })
	return len(ids) > 0, ok
}

// runningContainers are the running tasks whose container match picks, by its image and
// labels; ok is false when the runtime's answer could not be read (a task that ended between
// the listing and the question is left out).
func (n *Scenario) runningContainers(match func(image string, labels map[string]string) bool) (ids []string, ok bool) {
	running, err := n.runningTasks()
	if err != nil {
		return nil, false
	}
	for _, id := range running {
		image, labels, err := n.containerInfo(id)
		switch {
		case err != nil && !n.taskGone(id):
			return nil, false
		case err == nil && match(image, labels):
			ids = append(ids, id)
		}
	}
	return ids, true
}

// taskGone: the task id is no longer listed (it ended between a listing and a question).
func (n *Scenario) taskGone(id string) bool {
	ids, err := n.runningTasks()
	return err == nil && !slices.Contains(ids, id)
}

// runtimeDiagnostics notes the runtime's containers and the kubelet's last errors.
func (n *Scenario) runtimeDiagnostics() {
	if ls, err := n.Ctr("containers", "ls"); err == nil {
		for _, line := range strings.Split(ls, "\n") {
			n.Note("  %s", line)
		}
	}
	n.kubeletErrors(`^[EW][0-9]{4}`, 20)
}

// kubeletErrors notes the last k lines of the kubelet's log (of its last 5,000) that match
// pattern.
func (n *Scenario) kubeletErrors(pattern string, k int) {
	re := regexp.MustCompile(pattern)
	for _, line := range report.Last(report.Grep(report.FileTail(n.Path("kubelet.log"), 5000), 300, re.MatchString), k) {
		n.Note("  %s", line)
	}
}

// RunDeployment: a Deployment of the test image created, rolled and deleted through the
// apiserver; the scheduler binds its pods and the controller-manager's controllers run them.
func RunDeployment(n *Scenario) bool {
	deployments := n.Client.AppsV1().Deployments("default")
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: staticPodName},
		Spec: appsv1.DeploymentSpec{
			Replicas: ref[int32](1),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": staticPodName}},
			Strategy: appsv1.DeploymentStrategy{Type: appsv1.RollingUpdateDeploymentStrategyType, RollingUpdate: &appsv1.RollingUpdateDeployment{
				MaxSurge: ref(intstr.FromInt32(1)), MaxUnavailable: ref(intstr.FromInt32(0))}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": staticPodName}},
				Spec: corev1.PodSpec{TerminationGracePeriodSeconds: ref[int64](10), Containers: []corev1.Container{
					n.nodetest([]string{fmt.Sprintf(":%d", deployPort)}, []string{fmt.Sprintf("127.0.0.1:%d", deployPort)})}},
			},
		},
	}
	t0 := time.Now()
	if _, err := deployments.Create(n.Ctx, d, metav1.CreateOptions{}); err != nil {
		n.Fail("could not create the Deployment: %v", err)
		return true
	}
	if !n.WaitFor(120*time.Second, n.testDeploymentDone) {
		n.Fail("Deployment not ready within 120 s: %s", n.testPodsLine())
		n.kubeletErrors(`^E[0-9]{4}`, 5)
		return true
	}
	n.Pass("Deployment scheduled and run by kube-scheduler and kube-controller-manager, ready after %s s: %s", Since(t0), n.testPodsLine())
	// What `kubectl rollout restart` does: a new template annotation, so a new ReplicaSet
	// surges one pod and the old one goes once the new one is ready.
	before := n.testPodNames()
	t0 = time.Now()
	patch := fmt.Sprintf(`{"spec": {"template": {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": %q}}}}}`,
		time.Now().UTC().Format(time.RFC3339))
	_, err := deployments.Patch(n.Ctx, staticPodName, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{})
	onePod := func() bool { return len(n.testPodNames()) == 1 }
	if err == nil && n.WaitFor(120*time.Second, n.testDeploymentDone) && !slices.Equal(n.testPodNames(), before) &&
		n.WaitFor(60*time.Second, onePod) {
		n.Pass("rollout restart completed by the real controllers after %s s: %v -> %v", Since(t0), before, n.testPodNames())
	} else {
		n.Fail("rollout restart did not complete within the deadline (patch: %v): %s", err, n.testPodsLine())
	}
	t0 = time.Now()
	err = deployments.Delete(n.Ctx, staticPodName, metav1.DeleteOptions{PropagationPolicy: ref(metav1.DeletePropagationForeground)})
	if err != nil && !apierrors.IsNotFound(err) {
		n.Note("deleting the Deployment: %v", err)
	}
	noPods := func() bool { return len(n.testPodNames()) == 0 }
	if n.WaitFor(90*time.Second, noPods) && n.WaitFor(60*time.Second, func() bool { return n.imageGone(n.NodetestImage()) }) {
		n.Pass("Deployment deleted: its pods are gone after %s s", Since(t0))
	} else {
		n.Fail("Deployment's pods still there 90 s after its deletion: %s", n.testPodsLine())
	}
	return true
}

// testDeploymentDone is what `kubectl rollout status` checks, for the test Deployment.
func (n *Scenario) testDeploymentDone() bool {
	d, err := n.Client.AppsV1().Deployments("default").Get(n.Ctx, staticPodName, metav1.GetOptions{})
	return err == nil && nodecheck.RolloutDone(d)
}

func (n *Scenario) testPods() (*corev1.PodList, error) {
	return n.Client.CoreV1().Pods("default").List(n.Ctx, metav1.ListOptions{LabelSelector: "app=" + staticPodName})
}

// testPodNames are the names of the test Deployment's pods, sorted (nil when the apiserver
// did not answer).
func (n *Scenario) testPodNames() []string {
	pods, err := n.testPods()
	if err != nil {
		return nil
	}
	var names []string
	for _, p := range pods.Items {
		names = append(names, p.Name)
	}
	slices.Sort(names)
	return names
}

// testPodsLine is "name node phase" of each of the test Deployment's pods.
func (n *Scenario) testPodsLine() string {
	pods, err := n.testPods()
	if err != nil {
		return err.Error()
	}
	return strings.Join(nodecheck.Lines(pods), "; ")
}

// RunStopControlPlane removes kubeadm's static pod manifests in the order a node's owner
// would: the controllers, then the apiserver (it would wait for etcd), then etcd; each pod
// must be gone within 60 s.
func RunStopControlPlane(n *Scenario) bool {
	image := func(c string) string { return n.ImageRepo + "/" + c + ":" + n.Version }
	gone := func(c string) func() bool { return func() bool { return n.imageGone(image(c)) } }
	t0 := time.Now()
	if _, err := os.Stat(n.manifest("kube-controller-manager")); err == nil {
		_ = os.Remove(n.manifest("kube-controller-manager"))
		_ = os.Remove(n.manifest("kube-scheduler"))
		n.Check(n.WaitFor(60*time.Second, gone("kube-controller-manager")) && n.WaitFor(60*time.Second, gone("kube-scheduler")),
			"controller-manager and scheduler manifests removed: stopped after %s s (60 s at most)", Since(t0))
	}
	t0 = time.Now()
	_ = os.Remove(n.manifest("kube-apiserver"))
	n.Check(n.WaitFor(60*time.Second, gone("kube-apiserver")),
		"kube-apiserver manifest removed: its container stopped after %s s (60 s at most)", Since(t0))
	t0 = time.Now()
	_ = os.Remove(n.manifest("etcd"))
	none := func() bool { ids, err := n.runningTasks(); return err == nil && len(ids) == 0 }
	if n.WaitFor(60*time.Second, none) {
		n.Pass("etcd manifest removed: every pod stopped after %s s", Since(t0))
	} else {
		ids, _ := n.runningTasks()
		n.Fail("tasks still running 60 s after the etcd manifest was removed: %v", ids)
	}
	return true
}
