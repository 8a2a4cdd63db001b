package node

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/report"
	"kube-apiserver-proxy/tests/cluster/internal/step"
)

// Reboot recovery (`smoke --reboot`), once the kubeadm-style control plane runs:
//
//  1. the node is prepared (manifests/node/tmpfiles.d, with the checkpoint directory),
//     manifests/recovery applied, the node's client certificate made short-lived, and the
//     recovery agent manifests/node/kube-apiserver-recovery.yaml installed as a static pod;
//     then the kubelet's certificate rotation is turned on (the agent must follow it);
//  2. the migration to the Deployment of manifests/single-controller, as RunMigrate does it
//     (`kube-apiserver-proxy migrate`), and once the first checkpoint is written RunMigrate's
//     rollouts by the real controllers: MIGRATE_RESTARTS rollout restarts, then
//     MIGRATE_MORE_RESTARTS more and the image change v1.36 -> v1.37 and back (IMAGE_CHANGE),
//     each under the loads and judged as there (this mode is the migration's rehearsal in CI:
//     `smoke --migrate` runs the same steps without the reboot, for debugging); once migrated,
//     the Deployment's proxy (RuntimeDefault seccomp) runs its worker threads with
//     `--worker-slice`'s default 100 µs slice (CheckWorkerSlices);
//  3. the checkpoint: written by the recovery agent once the Deployment's pod stayed ready for
//     --checkpoint-after; a completed rollout moves it to the new pod (written with the rotated
//     certificate: the first one has expired by then); a broken rollout left in progress for
//     longer than --checkpoint-after does not;
//  4. the "reboot" (the node action reboot): every process of the node killed with SIGKILL
//     (kubelet, containerd, shims, every container, etcd included), what lives in /run and in
//     the runtime's state dropped, the mounts of the pods' volumes and root file systems gone,
//     the pods' cgroups removed; kept: etcd's data, /etc/kubernetes, /var/lib/kubelet, the
//     images and the checkpoint directory; the node's tmpfiles.d directories are created again,
//     as systemd-tmpfiles does at boot; then containerd and the kubelet are started again, with
//     nothing else;
//  5. the control plane must serve (GET /readyz on NODE_IP:6443) within REBOOT_BOUND seconds of
//     the runtime's start, from the recovery instance (the checkpoint of the good pod, not the
//     broken one); from then on connects (every 20 ms) and the client-go load run, until the
//     Deployment's good pod is ready, the recovery instance has been retired and is gone, and
//     the Deployment's proxy holds the listening socket: 0 refused, 0 failed;
//  6. `kubectl rollout undo` of the broken rollout completes;
//  7. the way back to kubeadm's static apiserver (docs/runbooks/going-back.md), see goBack.
//
// Environment: REBOOT_BOUND (180 s), CHECKPOINT_WAIT (the agent's --checkpoint-after plus
// 120 s), BROKEN_SOAK (--checkpoint-after plus 30 s: how long the broken rollout runs before the
// reboot), ROTATION_LIFETIME (150 s: the short client certificate's).
func RunReboot(n *Scenario) {
	r := &reboot{Scenario: n, bound: time.Duration(EnvKnobInt("REBOOT_BOUND", 0)) * time.Second}
	if !n.CheckKnobs("reboot") || !n.PrepareNode() || !n.Render() {
		return
	}
	manifest, err := os.ReadFile(filepath.Join(n.Repo, agentManifest))
	after := CheckpointAfter(string(manifest))
	if err != nil || after == 0 {
		n.Fail("no --checkpoint-after=Ns in %s%s", agentManifest, errSuffix(err))
		return
	}
	r.after = after
	r.checkpointWait = time.Duration(EnvKnobInt("CHECKPOINT_WAIT", int(after.Seconds())+120)) * time.Second
	r.brokenSoak = time.Duration(EnvKnobInt("BROKEN_SOAK", int(after.Seconds())+30)) * time.Second
	if !r.applyRecovery() || !r.shortClientCert() || !r.installAgent(string(manifest), r.Manifests) || !r.rotate() {
		return
	}
	// The pivot as shipped: the migration from kubeadm's static apiserver.
	if !n.LocalKubeconfig() || !n.Migrate(Migration{}) {
		return
	}
	n.CheckWorkerSlices("after the migration")
	first := n.ThePod()
	if !r.waitCheckpoint(first, "after the pivot") {
		return
	}
	r.checkContent()
	r.agentMetrics()
	r.admission()
	r.rotationExpired()
	// The migration's rollouts (RunMigrate's); the last pod they leave is the checkpoint's next.
	restarts := EnvKnobInt("MIGRATE_RESTARTS", 0)
	if !n.MigrateRollouts(restarts) || !n.Rollouts(EnvKnobInt("MIGRATE_MORE_RESTARTS", max(0, 5-restarts))) {
		return
	}
	second := n.ThePod()
	if !r.waitCheckpoint(second, "after the completed rollouts, with the rotated certificate") || !r.brokenRollout(second) {
		return
	}
	broken := ""
	for _, p := range n.DeployPods() {
		if p.Name != second {
			broken = p.Name
			break
		}
	}
	if !r.reboot() || !r.recover(second, broken) {
		return
	}
	n.Rollout("kubectl rollout undo of the broken rollout, after the recovery", "rollout", "undo", "deployment/kube-apiserver")
	r.goBack()
	n.Note("reports: %s", n.Path("step-*.json"))
}

const (
	agentManifest = "manifests/node/kube-apiserver-recovery.yaml"
	// CheckpointDir is the recovery agent's (manifests/node/tmpfiles.d).
	CheckpointDir      = "/var/lib/kube-apiserver-proxy/checkpoint"
	checkpointFile     = CheckpointDir + "/kube-apiserver.json"
	activeManifestName = "kube-apiserver-checkpoint.json"
	checkpointOfKey    = "kube-apiserver-proxy/checkpoint-of"
)

// reboot is the scenario's state between its steps.
type reboot struct {
	*Scenario
	after, checkpointWait, brokenSoak, bound time.Duration
	// The short-lived client certificate: its serial and its end.
	rotationFirst   string
	rotationExpires time.Time
}

var checkpointAfterFlag = regexp.MustCompile(`--checkpoint-after=([0-9]+)s`)

// CheckpointAfter is the agent's first --checkpoint-after=Ns in its manifest (0 if none).
func CheckpointAfter(manifest string) time.Duration {
	m := checkpointAfterFlag.FindStringSubmatch(manifest)
	if m == nil {
		return 0
	}
	s, _ := strconv.Atoi(m[1])
	return time.Duration(s) * time.Second
}

// readPod reads a static pod manifest written as JSON (the checkpoint).
func readPod(path string) (*corev1.Pod, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	// JSON (the recovery agent's checkpoint) or YAML (kubeadm-sync's copy of an activated one).
	var p corev1.Pod
	if err := yaml.Unmarshal(b, &p); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &p, nil
}

// checkpointOf is "namespace/name" of the pod the checkpoint at path is a copy of ("" if none,
// or the file is missing or half-written).
func checkpointOf(path string) string {
	p, err := readPod(path)
	if err != nil {
		return ""
	}
	return p.Annotations[checkpointOfKey]
}

// checkpointFlag is the value of --FLAG=… in the container's args of the checkpoint at path
// (several are joined with spaces).
func checkpointFlag(path, container, flag string) string {
	p, err := readPod(path)
	if err != nil {
		return err.Error()
	}
	return strings.Join(nodecheck.FlagValues(p, container, flag), " ")
}

// kubeletRuns: the kubelet's /pods lists pod name running; kubeletKnows: it lists it at all.
// ok is false when the kubelet did not answer.
func (n *Scenario) kubeletRuns(name string) bool {
	pods, err := n.KubeletPods()
	return err == nil && nodecheck.Running(pods, name)
}

func (n *Scenario) kubeletKnows(name string) (known, ok bool) {
	pods, err := n.KubeletPods()
	if err != nil {
		return false, false
	}
	return nodecheck.Named(pods, name) != nil, true
}

// RunningTasks are the ids of the RUNNING tasks in `ctr tasks ls` output.
func RunningTasks(ls string) []string {
	var ids []string
	for i, line := range strings.Split(ls, "\n") {
		f := strings.Fields(line)
		if i > 0 && len(f) >= 3 && f[2] == "RUNNING" {
			ids = append(ids, f[0])
		}
	}
	return ids
}

// checkpointTasks are the running containerd tasks of the recovery instance (by the
// kubelet's labels); ok is false when the runtime's answer could not be read (a check that
// took an unreadable answer for "none" would pass with the instance still running).
func (r *reboot) checkpointTasks() (ids []string, ok bool) {
	return r.runningContainers(func(_ string, labels map[string]string) bool {
		return labels["io.kubernetes.pod.name"] == "kube-apiserver-checkpoint-"+r.NodeName
	})
}

// recoveryPodGone: the kubelet no longer knows the recovery instance and none of its
// containers runs.
func (r *reboot) recoveryPodGone() bool {
	known, ok := r.kubeletKnows("kube-apiserver-checkpoint-" + r.NodeName)
	if !ok || known {
		return false
	}
	tasks, ok := r.checkpointTasks()
	return ok && len(tasks) == 0
}

var agentMessage = regexp.MustCompile(`"message":"recover: [^"]*"[^}]*`)

// AgentMessages are the recovery agent's log messages (its JSON lines from "message" to the
// end of the object) that match re, each cut to 300 bytes.
func AgentMessages(log string, re *regexp.Regexp) []string {
	var out []string
	for _, m := range agentMessage.FindAllString(log, -1) {
		if re.MatchString(m) {
			out = append(out, report.Cut(m, 300))
		}
	}
	return out
}

// agentLog is AgentMessages of the recovery agent's container logs, the last k of them,
// joined with spaces.
func (r *reboot) agentLog(re string, k int) string {
	m := AgentMessages(r.recoveryAgentLogs(), regexp.MustCompile(re))
	return strings.Join(report.Last(m, k), " ")
}

// recoveryLogs are the recovery agent's container log files, kept by smoke under pod-logs/.
const recoveryLogs = "pod-logs/kube-system_kube-apiserver-recovery-*/recover/*.log"

// recoveryAgentLogs is every container log of the recovery agent, one after the other.
func (n *Scenario) recoveryAgentLogs() string {
	files, _ := filepath.Glob(n.Path(recoveryLogs))
	var b strings.Builder
	for _, f := range files {
		data, _ := os.ReadFile(f)
		b.Write(data)
	}
	return b.String()
}

// recoveryLog is the path of the recovery agent's newest container log, or "".
func (n *Scenario) recoveryLog() string {
	files, _ := filepath.Glob(n.Path(recoveryLogs))
	if len(files) == 0 {
		files, _ = filepath.Glob("/var/log/pods/kube-system_kube-apiserver-recovery-*/recover/*.log")
	}
	if len(files) == 0 {
		return ""
	}
	return files[len(files)-1]
}

// get is an HTTPS GET on NODE_IP:6443 trusting the cluster CA, with a client certificate
// when cert is given; an answer of 400 or more is an error (*StatusError).
func (r *reboot) get(path string, timeout time.Duration, cert *tls.Certificate) ([]byte, error) {
	ca, err := os.ReadFile("/etc/kubernetes/pki/ca.crt")
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	cfg := &tls.Config{RootCAs: pool}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	c := http.Client{Timeout: timeout, Transport: &http.Transport{TLSClientConfig: cfg}}
	defer c.CloseIdleConnections()
	return httpGet(&c, "https://"+r.NodeIP+":6443"+path)
}

// StatusError is an HTTP answer of 400 or more.
type StatusError struct{ Status string }

func (e *StatusError) Error() string { return "HTTP " + e.Status }

func httpGet(c *http.Client, url string) ([]byte, error) {
	resp, err := c.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if resp.StatusCode >= 400 {
		return body, &StatusError{resp.Status}
	}
	return body, err
}

func (r *reboot) readyz() bool {
	_, err := r.get("/readyz", 3*time.Second, nil)
	return err == nil
}

// applyRecovery: manifests/recovery (the node identity's reads for the agent's owner check,
// the admission policies on the apiserver workload), before the agent, as documented.
func (n *Scenario) applyRecovery() bool {
	out, err := n.Kubectl(60*time.Second, "apply", "-k", filepath.Join(n.Repo, "manifests/recovery"))
	return n.Check(err == nil, "kubectl apply -k manifests/recovery: %s%s", strings.ReplaceAll(out, "\n", " "), errSuffix(err))
}

// AgentManifest is the agent's manifest with the image set, and, as
// docs/runbooks/reboot-recovery.md says, its repository in --allow-image-repository and the
// cluster's imageRepository (REPO/kube-apiserver) added, and then the flags extra.
func AgentManifest(shipped, image, imageRepo string, extra ...string) (string, error) {
	const shippedImage = "image: ghcr.io/example/kube-apiserver-proxy:v0.1.0"
	lines := strings.Split(shipped, "\n")
	var out []string
	image0, allowed := false, false
	for _, l := range lines {
		indent := l[:len(l)-len(strings.TrimLeft(l, " "))]
		switch strings.TrimSpace(l) {
		case shippedImage:
			l = strings.Replace(l, shippedImage, "image: "+image, 1)
			image0 = true
		case "- --allow-image-repository=ghcr.io/example/kube-apiserver-proxy":
			out = append(out, indent+"- --allow-image-repository="+image[:strings.LastIndex(image, ":")])
			for _, e := range extra {
				out = append(out, indent+"- "+e)
			}
			l = indent + "- --allow-image-repository=" + imageRepo + "/kube-apiserver"
			allowed = true
		}
		out = append(out, l)
	}
	if !image0 || !allowed {
		return "", fmt.Errorf("could not set the image of %s (image line found: %t, --allow-image-repository line found: %t)", agentManifest, image0, allowed)
	}
	return strings.Join(out, "\n"), nil
}

// installAgent installs the agent as a static pod, its manifest in dir (the runbook's
// /etc/kubernetes/manifests), with the flags extra.
func (n *Scenario) installAgent(shipped, dir string, extra ...string) bool {
	m, err := AgentManifest(shipped, n.ProxyImage(), n.ImageRepo, extra...)
	if err == nil {
		// Written beside it, hidden (the kubelet skips dot files), then renamed in: the kubelet
		// never reads a half-written manifest.
		tmp := filepath.Join(dir, ".kube-apiserver-recovery.yaml")
		if err = os.WriteFile(tmp, []byte(m), 0o644); err == nil {
			err = os.Rename(tmp, filepath.Join(dir, "kube-apiserver-recovery.yaml"))
		}
	}
	if err != nil {
		n.Fail("%v", err)
		return false
	}
	if !n.WaitFor(120*time.Second, func() bool { return n.kubeletRuns("kube-apiserver-recovery-" + n.NodeName) }) {
		n.Fail("recovery agent static pod not running within 120 s")
		return false
	}
	n.Pass("recovery agent installed as a static pod (%s in %s: the image and its repository set, %s/kube-apiserver allowed%s) and running",
		agentManifest, dir, n.ImageRepo, strings.Join(append([]string{""}, extra...), ", "))
	return true
}

// PromValues are the values of the samples called name (no labels) in a Prometheus text
// exposition, in order.
func PromValues(text, name string) []string {
	var v []string
	for _, l := range strings.Split(text, "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == name {
			v = append(v, f[1])
		}
	}
	return v
}

// agentMetrics: the agent's metrics on NODE_IP:9445 (its manifest's --metrics-listen).
func (r *reboot) agentMetrics() {
	c := http.Client{Timeout: 5 * time.Second}
	body, err := httpGet(&c, "http://"+r.NodeIP+":9445/metrics")
	m := string(body)
	if err != nil {
		m = err.Error() + " " + m
	}
	one := func(name string) string {
		return strings.Join(PromValues(m, "kube_apiserver_proxy_checkpoint_"+name), "\n")
	}
	written, verified, refused := one("written_timestamp_seconds"), one("verified_timestamp_seconds"), one("refused")
	set := func(v string) bool { return v != "" && v != "0" }
	if !set(written) || !set(verified) || refused != "0" {
		r.Fail("the agent's metrics on %s:9445: written '%s', verified '%s', refused '%s': %s", r.NodeIP, written, verified, refused, report.Cut(m, 300))
		return
	}
	age := "?"
	if w, err := strconv.ParseFloat(written, 64); err == nil {
		age = strconv.FormatInt(time.Now().Unix()-int64(w), 10)
	}
	var attempts []string
	for _, l := range strings.Split(m, "\n") {
		if strings.HasPrefix(l, "kube_apiserver_proxy_checkpoint_attempts_total") {
			attempts = append(attempts, l)
		}
	}
	r.Pass("the agent's metrics on %s:9445: the checkpoint written at %s (age %s s), found current at %s, refused %s; %s",
		r.NodeIP, written, age, verified, refused, strings.Join(attempts, " "))
}

var (
	workloadDenied = regexp.MustCompile(`ValidatingAdmissionPolicy 'kube-apiserver-proxy-workload'.*denied`)
	podsDenied     = regexp.MustCompile(`ValidatingAdmissionPolicy 'kube-apiserver-proxy-pods'.*denied`)
)

// admission: manifests/recovery's admission policies refuse a user whom RBAC lets patch the
// Deployment and create pods in kube-system; the real controllers' rollouts go on (the
// rollout restart that follows).
func (r *reboot) admission() {
	_, _ = r.Kubectl(30*time.Second, "create", "clusterrole", "smoke-mallory", "--verb=get,list,patch,update,create",
		"--resource=deployments,pods,replicasets")
	_, _ = r.Kubectl(30*time.Second, "create", "clusterrolebinding", "smoke-mallory", "--clusterrole=smoke-mallory", "--user=mallory")
	patch, _ := r.Kubectls(30*time.Second, "--as=mallory", "patch", "deployment", "kube-apiserver", "--type=merge",
		"-p", `{"spec":{"template":{"metadata":{"annotations":{"smoke/mallory":"x"}}}}}`)
	run, _ := r.Kubectls(30*time.Second, "--as=mallory", "run", "impostor", "--image="+r.ProxyImage(), "--restart=Never",
		"--labels=app.kubernetes.io/name=kube-apiserver,app.kubernetes.io/part-of=kube-apiserver-proxy")
	_, canErr := r.Kubectls(30*time.Second, "--as=mallory", "auth", "can-i", "patch", "deployments")
	if workloadDenied.MatchString(patch) && podsDenied.MatchString(run) && canErr == nil {
		r.Pass("admission: a user RBAC lets patch deployments and create pods in kube-system is refused both: %s | %s", report.Cut(patch, 200), report.Cut(run, 160))
	} else {
		r.Fail("admission: mallory's patch: %s; mallory's labelled pod: %s; can mallory patch deployments: %s", patch, run, yesNo(canErr == nil))
	}
	_, _ = r.Kubectl(30*time.Second, "delete", "clusterrolebinding", "smoke-mallory")
	_, _ = r.Kubectl(30*time.Second, "delete", "clusterrole", "smoke-mallory")
}

// waitCheckpoint: the checkpoint names pod within CHECKPOINT_WAIT.
func (r *reboot) waitCheckpoint(pod, what string) bool {
	t0 := time.Now()
	if r.WaitFor(r.checkpointWait, func() bool { return checkpointOf(checkpointFile) == "kube-system/"+pod }) {
		r.Pass("%s: the checkpoint is of %s, written %s s after the rollout completed (--checkpoint-after=%ds; %s)",
			what, pod, Since(t0), int(r.after.Seconds()), r.agentLog("checkpoint written", 1))
		return true
	}
	var entries []string
	for _, p := range append([]string{CheckpointDir}, globAll(CheckpointDir+"/*")...) {
		entries = append(entries, statLine(p))
	}
	r.Fail("%s: the checkpoint is not of %s after %d s: it is of '%s'; %s", what, pod, int(r.checkpointWait.Seconds()), checkpointOf(checkpointFile), strings.Join(entries, "; "))
	m := AgentMessages(r.recoveryAgentLogs(), regexp.MustCompile("checkpoint"))
	for _, l := range report.Last(m, 5) {
		r.Note("  %s", l)
	}
	return false
}

func globAll(pattern string) []string {
	m, _ := filepath.Glob(pattern)
	return m
}

// statLine is "PATH MODE OWNER" (stat -c '%n %a %U').
func statLine(path string) string {
	fi, err := os.Stat(path)
	if err != nil {
		return err.Error()
	}
	owner := "?"
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		owner = strconv.Itoa(int(st.Uid))
		if u, err := user.LookupId(owner); err == nil {
			owner = u.Username
		}
	}
	return fmt.Sprintf("%s %o %s", path, fi.Mode().Perm(), owner)
}

// checkContent: the checkpoint is a static pod of its own.
func (r *reboot) checkContent() {
	problems := "unreadable"
	if b, err := os.ReadFile(checkpointFile); err != nil {
		problems = err.Error()
	} else {
		var p corev1.Pod
		var raw struct {
			Spec map[string]json.RawMessage `json:"spec"`
		}
		if err := json.Unmarshal(b, &p); err != nil {
			problems = err.Error()
		} else if err := json.Unmarshal(b, &raw); err != nil {
			problems = err.Error()
		} else {
			keys := map[string]bool{}
			for k := range raw.Spec {
				keys[k] = true
			}
			problems = strings.Join(nodecheck.CheckpointProblems(&p, keys), "; ")
		}
	}
	if problems != "" {
		r.Fail("checkpoint content: %s", problems)
		return
	}
	r.Pass("the checkpoint is a static pod of its own: name kube-apiserver-checkpoint, own labels, no service account or token volume, the proxy a recovery instance (--retire-file); %s %s",
		statLine(CheckpointDir), statLine(checkpointFile))
}

func mtime(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return -1
	}
	return fi.ModTime().Unix()
}

// brokenRollout: a rollout that never becomes ready (--etcd-servers on a closed port), left in
// progress for longer than --checkpoint-after: the checkpoint stays the good pod's.
func (r *reboot) brokenRollout(good string) bool {
	before := mtime(checkpointFile)
	if err := r.BreakEtcdServers(); err != nil {
		r.Fail("broken rollout: %v", err)
		return false
	}
	t0 := time.Now()
	running := func() bool {
		for _, p := range r.DeployPods() {
			if p.Name != good && p.Status.Phase == corev1.PodRunning {
				return true
			}
		}
		return false
	}
	if !r.WaitFor(120*time.Second, running) {
		r.Fail("the broken rollout's pod does not run after 120 s: %s", r.DeployPodsLine())
		return false
	}
	r.Note("broken rollout (--etcd-servers=https://127.0.0.1:2): its pod runs %s s after the patch: %s", Since(t0), r.DeployPodsLine())
	// Longer than --checkpoint-after: were it ever ready, it would have been checkpointed.
	r.Settle(r.brokenSoak)
	of, etcd := checkpointOf(checkpointFile), checkpointFlag(checkpointFile, "kube-apiserver", "--etcd-servers")
	if of == "kube-system/"+good && mtime(checkpointFile) == before && etcd == "https://127.0.0.1:2379" {
		r.Pass("broken rollout in progress for %s s (> --checkpoint-after): the checkpoint is still the good pod %s, unchanged, --etcd-servers=https://127.0.0.1:2379; pods: %s",
			Since(t0), good, r.DeployPodsLine())
	} else {
		r.Fail("the broken rollout changed the checkpoint: of '%s', --etcd-servers=%s, modified: %s", of, etcd, yesNo(mtime(checkpointFile) != before))
	}
	return true
}

// reboot: the node action (every process but smoke's and this one killed, mounts, /run, the
// runtime's state and the pods' cgroups dropped), then what systemd-tmpfiles does at boot.
func (r *reboot) reboot() bool {
	if err := r.Do("reboot"); err != nil {
		return false
	}
	err := r.TmpfilesCreate()
	return r.Check(err == nil, "boot: the directories of manifests/node/tmpfiles.d created again, as systemd-tmpfiles does at boot%s", errSuffix(err))
}

// recover: containerd and the kubelet started, nothing else; the control plane must come
// back from the checkpoint of the good pod and be handed over to the Deployment losslessly.
func (r *reboot) recover(good, broken string) bool {
	tBoot := time.Now()
	if r.Do("containerd_start") != nil || r.Do("kubelet_start") != nil {
		return false
	}
	active := filepath.Join(r.Manifests, activeManifestName)
	exists := func() bool { _, err := os.Stat(active); return err == nil }
	if !r.WaitFor(120*time.Second, exists) {
		var names []string
		for _, p := range globAll(filepath.Join(r.Manifests, "*")) {
			names = append(names, filepath.Base(p))
		}
		tail := ""
		if log := r.recoveryLog(); log != "" {
			tail = report.Cut(Tail(log, 3), 900)
		}
		r.Fail("no checkpoint activated in %s 120 s after the runtime's start: %s; agent log: %s", r.Manifests, strings.Join(names, " "), tail)
		return false
	}
	r.Note("the recovery agent activated the checkpoint %s s after the runtime's start: %s", Since(tBoot), checkpointOf(active))
	if !r.WaitFor(r.bound, r.readyz) {
		r.Fail("the control plane does not serve %d s after the runtime's start", int(r.bound.Seconds()))
		if pods, err := r.KubeletPods(); err == nil {
			b, _ := json.Marshal(pods)
			r.Note("  %s", report.Cut(string(b), 1500))
		}
		return false
	}
	r.Pass("the control plane serves again (GET /readyz on %s:6443) %s s after the runtime's start, within the bound of %d s, with no manual step", r.NodeIP, Since(tBoot), int(r.bound.Seconds()))

	// From the takeover on: every connect and the client-go load must succeed. The power cycle
	// restarted the controller-manager and the scheduler (their mirror pods say so once the
	// kubelet reaches the API again, during this step): it does not watch them; their restart
	// count is checked after it, the reboot's one and no more.
	st := r.StartStep("takeover", step.Options{Kubeconfig: r.Admin, Probes: []string{r.NodeIP + ":6443"}, Endpoints: true})
	recovery := "kube-apiserver-checkpoint-" + r.NodeName
	runs := r.kubeletRuns(recovery)
	servedBy, etcd := checkpointOf(active), checkpointFlag(active, "kube-apiserver", "--etcd-servers")
	if broken == "" {
		broken = "pod"
	}
	if runs && servedBy == "kube-system/"+good && etcd == "https://127.0.0.1:2379" {
		r.Pass("the recovery instance is the checkpoint of the good pod %s (--etcd-servers=https://127.0.0.1:2379), not the broken rollout's %s", good, broken)
	} else {
		r.Fail("the recovery instance: kubelet runs it: %s; of '%s'; --etcd-servers=%s", yesNo(runs), servedBy, etcd)
	}
	tTake := time.Now()
	if r.WaitFor(600*time.Second, func() bool { return r.PodReady(good) }) &&
		r.WaitFor(300*time.Second, func() bool { return !exists() }) &&
		r.WaitFor(180*time.Second, r.recoveryPodGone) {
		r.Pass("takeover: the Deployment's pod %s is ready, the recovery instance was retired and is gone %s s after the control plane served (%s s after the runtime's start)",
			good, Since(tTake), Since(tBoot))
	} else {
		known, _ := r.kubeletKnows(recovery)
		r.Fail("takeover not complete: pods %s; manifest still there: %s; kubelet knows the recovery pod: %s", r.DeployPodsLine(), yesNo(exists()), yesNo(known))
		r.PodDiagnostics()
	}
	// Let the load see the Deployment's apiserver alone for a few seconds.
	r.Settle(10 * time.Second)
	// The overlay's apiservers (the recovery instance's too: it is a checkpoint of one) run
	// with --endpoint-reconciler-type=none: nothing may empty the kubernetes Service.
	st.End("from the takeover on: client-go load, connects, default/kubernetes")
	restarts := r.ControlPlaneRestarts()
	r.Check(restarts == "kube-controller-manager 1; kube-scheduler 1; ",
		"the controller-manager and the scheduler restarted once each, by the reboot (1 each expected): %s", restarts)
	r.handedOverFromRecovery(good)
	return true
}

// handedOverFromRecovery: the proxy of the Deployment's pod good shared the recovery
// instance's listening sockets at its start (one kernel queue with it), then adopted them at
// the recovery instance's drain: the same sockets, so the adoption brings none it did not hold
// ("new":0). The agent's decisions are noted.
func (r *reboot) handedOverFromRecovery(good string) {
	log, err := r.Logs(good, "proxy", 0, false)
	if err != nil {
		log = err.Error()
	}
	if shared, adopted := ProxyHandoff(log); shared && adopted {
		r.Pass("the Deployment's proxy shared the recovery instance's listening sockets, then adopted them at its drain (the same sockets): %s", HandoffSummary(log))
	} else {
		r.Fail("no handoff from the recovery instance in the Deployment's proxy log: %s", handoffTail(log))
	}
	r.Note("recovery agent log: %s", strings.ReplaceAll(r.agentLog(`activated|retired|not activated`, 4), "\n", "|"))
}

var (
	sharedByPeer = regexp.MustCompile(`handoff: sockets shared by peer.*"sockets":[1-9]`)
	handoffKeys  = regexp.MustCompile(`"message":"[^"]*"|"(sockets|offered|taken|new)":[0-9]+`)
)

// ProxyHandoff reads a proxy's log: it shared a peer's listening sockets (at least one), and
// the first adoption of its peer's sockets brought none it did not hold ("new":0).
func ProxyHandoff(log string) (shared, adoptedSame bool) {
	for _, l := range strings.Split(log, "\n") {
		if sharedByPeer.MatchString(l) {
			shared = true
		}
		if strings.Contains(l, "handoff: adopted peer's listening sockets") {
			return shared, strings.Contains(l, `"new":0`)
		}
	}
	return shared, false
}

// HandoffSummary: the messages and counts of the first two sharing or adoption lines.
func HandoffSummary(log string) string {
	var out []string
	lines := 0
	for _, l := range strings.Split(log, "\n") {
		if lines == 2 {
			break
		}
		if sharedByPeer.MatchString(l) || strings.Contains(l, "adopted peer") {
			lines++
			out = append(out, handoffKeys.FindAllString(l, -1)...)
		}
	}
	return strings.Join(out, " ")
}

// handoffTail is the last five lines of log that speak of the handoff, joined with spaces.
func handoffTail(log string) string {
	return strings.Join(report.Last(report.Grep(log, 200, func(l string) bool {
		return strings.Contains(strings.ToLower(l), "handoff")
	}), 5), " ")
}
