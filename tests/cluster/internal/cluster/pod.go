package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"

	"kube-apiserver-proxy/tests/cluster/internal/await"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// Design is what stands in front of each pod's apiserver on the node address.
type Design string

const (
	// Sidecar is this project: the manifests' kube-apiserver-proxy sidecar.
	Sidecar Design = "kube-apiserver-proxy"
	// HAProxy is the design Lokomotive shipped in 2020: an HAProxy sidecar per pod in TCP mode
	// (SO_REUSEPORT on the node address, one server: the pod's own apiserver, no health
	// check), started once the apiserver accepts connections, stopped by the same SIGTERM.
	HAProxy Design = "haproxy-sidecar"
)

// Gate is what the rollout waits for before it stops the old pod.
type Gate string

const (
	// GatePod is the pod's readiness as the manifests define it (every container's probe).
	GatePod Gate = "pod-ready"
	// GateAPIServer is the new apiserver's /readyz alone: the order a static-pod swap gives.
	GateAPIServer Gate = "apiserver-ready"
)

// PodOptions describe one pod of the Deployment.
type PodOptions struct {
	Name      string
	Design    Design
	APIServer string // kube-apiserver binary (the image's)
	Proxy     string // kube-apiserver-proxy binary (the image's)
	HAProxy   string // haproxy binary, for Design HAProxy
	// ExtraAPIServerArgs and ExtraProxyArgs are appended to the manifest's (later flags win).
	ExtraAPIServerArgs []string
	ExtraProxyArgs     []string
	// HostIP and HostIPs are what the kubelet would give status.hostIP and status.hostIPs
	// (comma-separated); default: the node's address alone.
	HostIP, HostIPs string
}

// Pod is one running pod: its apiserver container and its sidecar, as the kubelet runs them.
type Pod struct {
	Opts      PodOptions
	Dir       string
	Shared    string
	Started   time.Time
	node      *Node
	tmpl      *Template
	mapping   Mapping
	apiserver *Proc
	sidecar   *Proc
	probes    [][]string
	period    time.Duration
	grace     time.Duration
}

// StartPod runs the pod's init container, then its containers.
func StartPod(ctx context.Context, node *Node, tmpl *Template, opts PodOptions) (*Pod, error) {
	dir := filepath.Join(node.Dir, "pods", opts.Name)
	p := &Pod{Opts: opts, Dir: dir, Shared: filepath.Join(dir, "shared"), node: node, tmpl: tmpl, Started: time.Now()}
	bin := filepath.Join(dir, "proxy-bin")
	for _, d := range []string{p.Shared, bin} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	// emptyDirs are world-writable, as the kubelet makes them.
	for _, d := range []string{p.Shared, bin} {
		if err := os.Chmod(d, 0o777); err != nil {
			return nil, err
		}
	}
	p.mapping = Mapping{
		Exact: map[string]string{"kube-apiserver": opts.APIServer, "/kube-apiserver-proxy": opts.Proxy},
		Prefix: [][2]string{
			{"/proxy-bin/", bin + "/"},
			{"/shared/", p.Shared + "/"},
			{"/etc/kubernetes/pki", node.PKI},
			{"/run/kube-apiserver-proxy", node.Run},
			{"$(HOST_IPS)", or(opts.HostIPs, or(opts.HostIP, node.IP))},
			{"$(HOST_IP)", or(opts.HostIP, node.IP)},
			{"$(POD_NAME)", opts.Name},
		},
	}
	p.grace = 30 * time.Second
	if g := tmpl.Spec.TerminationGracePeriodSeconds; g != nil {
		p.grace = time.Duration(*g) * time.Second
	}
	logs := filepath.Join(dir, "logs")

	for _, init := range tmpl.Spec.InitContainers {
		uid, argv := p.credentials(init, p.mapping.Apply(Argv(init)))
		initProc, err := Start(init.Name, filepath.Join(logs, init.Name+".log"), uid, argv...)
		if err != nil {
			return nil, err
		}
		if !initProc.Wait(30*time.Second) || initProc.ExitCode() != 0 {
			initProc.Kill()
			return nil, fmt.Errorf("pod %s: init container %s failed: %s", opts.Name, init.Name, report.FileTail(initProc.Log, 5))
		}
	}

	api, err := tmpl.Container("kube-apiserver")
	if err != nil {
		return nil, err
	}
	apiArgv := append(p.mapping.Apply(Argv(api)), opts.ExtraAPIServerArgs...)
	if p.apiserver, err = Start("kube-apiserver", filepath.Join(logs, "kube-apiserver.log"), -1, apiArgv...); err != nil {
		return nil, err
	}
	p.period = 2 * time.Second
	if api.ReadinessProbe != nil && api.ReadinessProbe.PeriodSeconds > 0 {
		p.period = time.Duration(api.ReadinessProbe.PeriodSeconds) * time.Second
	}

	switch opts.Design {
	case Sidecar:
		proxy, err := tmpl.Container("proxy")
		if err != nil {
			return nil, err
		}
		uid, argv := p.credentials(proxy, append(p.mapping.Apply(Argv(proxy)), opts.ExtraProxyArgs...))
		if p.sidecar, err = Start("proxy", filepath.Join(logs, "proxy.log"), uid, argv...); err != nil {
			p.kill()
			return nil, err
		}
		for _, c := range []string{"kube-apiserver", "proxy"} {
			ct, _ := tmpl.Container(c)
			if ct.ReadinessProbe == nil || ct.ReadinessProbe.Exec == nil {
				p.kill()
				return nil, fmt.Errorf("manifest: container %s has no exec readiness probe", c)
			}
			p.probes = append(p.probes, p.mapping.Apply(ct.ReadinessProbe.Exec.Command))
		}
	case HAProxy:
		if err := p.startHAProxy(ctx); err != nil {
			p.kill()
			return nil, err
		}
		p.probes = [][]string{p.apiserverReadyz()}
	default:
		return nil, fmt.Errorf("unknown design %q", opts.Design)
	}
	node.Leaks.Add(p)
	return p, nil
}

// credentials is how the kubelet starts container c with argv: a container of this workload
// runs as the proxy's uid, unless its securityContext says runAsUser 0 (client-address-
// transparent's); that one runs as root with exactly the capabilities it adds (setpriv:
// bounding set, hence permitted and effective at exec) and no new privileges, as a container
// runtime gives them. uid -1: ours (root).
func (p *Pod) credentials(c corev1.Container, argv []string) (int, []string) {
	sc := c.SecurityContext
	if sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		return p.node.ProxyUID, argv
	}
	caps := "-all"
	if sc.Capabilities != nil {
		for _, c := range sc.Capabilities.Add {
			caps += ",+" + strings.ToLower(string(c))
		}
	}
	wrap := []string{"setpriv", "--bounding-set=" + caps, "--inh-caps=-all"}
	if sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation {
		wrap = append(wrap, "--no-new-privs")
	}
	return -1, append(append(wrap, "--"), argv...)
}

// apiserverReadyz is the probe of the pod's apiserver /readyz on its own loopback address.
func (p *Pod) apiserverReadyz() []string {
	return []string{
		filepath.Join(p.Dir, "proxy-bin", "kube-apiserver-proxy"), "probe",
		"--address-file=" + filepath.Join(p.Shared, "address"),
		"--ca-file=" + filepath.Join(p.node.PKI, "ca.crt"),
		"--path=/readyz", "--timeout=3s",
	}
}

// startHAProxy starts Lokomotive's sidecar: wait until the apiserver accepts connections
// (its `nc -z` loop), then haproxy in TCP mode with its timeouts, in front of that one server.
func (p *Pod) startHAProxy(ctx context.Context) error {
	var backend string
	accepts := await.Condition{Name: "pod " + p.Opts.Name + ": apiserver accepting connections", Check: func() (bool, string, error) {
		if p.apiserver.Exited() {
			return false, "", fmt.Errorf("pod %s: apiserver exited before it accepted connections", p.Opts.Name)
		}
		b, err := os.ReadFile(filepath.Join(p.Shared, "address"))
		if err != nil {
			return false, err.Error(), nil
		}
		backend = strings.TrimSpace(string(b))
		c, err := net.DialTimeout("tcp", backend, time.Second)
		if err != nil {
			return false, err.Error(), nil
		}
		c.Close()
		return true, "", nil
	}}
	if err := await.Until(ctx, 200*time.Millisecond, 3*time.Minute, accepts); err != nil {
		return fmt.Errorf("%w: %s", err, report.FileTail(p.apiserver.Log, 10))
	}
	cfg := fmt.Sprintf(`global
    # maxconn from the fd limit, as in Lokomotive's config (none set).
defaults
    mode tcp
    timeout connect 5s
    timeout client 30s
    timeout client-fin 30s
    timeout server 30s
    timeout tunnel 21d
frontend kube-apiserver
    bind %s:6443
    default_backend kube-apiserver
backend kube-apiserver
    server kube-apiserver %s
`, p.node.IP, backend)
	path := filepath.Join(p.Shared, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return err
	}
	var err error
	p.sidecar, err = Start("haproxy", filepath.Join(p.Dir, "logs", "haproxy.log"), p.node.ProxyUID, p.Opts.HAProxy, "-W", "-db", "-f", path)
	return err
}

// WaitReady waits until gate holds, probing every period as the kubelet does; it fails early
// when a container exits.
func (p *Pod) WaitReady(ctx context.Context, gate Gate, timeout time.Duration) error {
	probes := p.probes
	if gate == GateAPIServer {
		probes = [][]string{p.apiserverReadyz()}
	}
	return await.Until(ctx, p.period, timeout, await.Condition{Name: fmt.Sprintf("pod %s %s", p.Opts.Name, gate), Check: func() (bool, string, error) {
		if err := p.Crashed(); err != nil {
			return false, "", err
		}
		for _, probe := range probes {
			if !runProbe(ctx, probe) {
				return false, "probe failed: " + report.Cut(strings.Join(probe[1:], " "), 200), nil
			}
		}
		return true, "", nil
	}})
}

// APIServerReadyz asks the pod's apiserver for /readyz on its own loopback address with
// client (see Node.APIServerClient): true on 200.
func (p *Pod) APIServerReadyz(client *http.Client) bool {
	code, err := p.APIServerGet(client, "/readyz")
	return err == nil && code == http.StatusOK
}

// APIServerGet sends GET path to the pod's apiserver on its own loopback address with client
// and returns the status code.
func (p *Pod) APIServerGet(client *http.Client, path string) (int, error) {
	b, err := os.ReadFile(filepath.Join(p.Shared, "address"))
	if err != nil {
		return 0, err
	}
	resp, err := client.Get("https://" + strings.TrimSpace(string(b)) + path)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// ProxyStatus is what the pod's proxy says of itself on /status (the parts the scenarios read).
type ProxyStatus struct {
	State     string `json:"state"`
	Ready     bool   `json:"ready"`
	Listeners []struct {
		Address string `json:"address"`
		Cookie  uint64 `json:"cookie"`
	} `json:"listeners"`
	Backends []struct {
		Address   string `json:"address"`
		Source    string `json:"source"`
		Healthy   bool   `json:"healthy"`
		LastCheck *struct {
			Result string `json:"result"`
			Cause  string `json:"cause"`
		} `json:"last_check"`
	} `json:"backends"`
}

// ProxyStatus reads the pod's proxy's admin /status (the address it wrote to /shared/admin).
func (p *Pod) ProxyStatus() (*ProxyStatus, error) {
	resp, err := p.adminGet("/status", 5*time.Second)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var status ProxyStatus
	if err := json.NewDecoder(resp.Body).Decode(&status); err != nil {
		return nil, fmt.Errorf("%s /status: %w", p.Opts.Name, err)
	}
	return &status, nil
}

// adminGet sends GET path to the pod's proxy's admin endpoint (the address it wrote to
// /shared/admin).
func (p *Pod) adminGet(path string, timeout time.Duration) (*http.Response, error) {
	b, err := os.ReadFile(filepath.Join(p.Shared, "admin"))
	if err != nil {
		return nil, err
	}
	return (&http.Client{Timeout: timeout}).Get("http://" + strings.TrimSpace(string(b)) + path)
}

// ListenerCookies are the SO_COOKIEs of the listening sockets the pod's proxy holds.
func (p *Pod) ListenerCookies() ([]uint64, error) {
	status, err := p.ProxyStatus()
	if err != nil {
		return nil, err
	}
	var cookies []uint64
	for _, l := range status.Listeners {
		cookies = append(cookies, l.Cookie)
	}
	return cookies, nil
}

// RunsProxy reports whether the pod's proxy process runs a file with the bytes of bin (the
// pod runs its own copy of the image's binary).
func (p *Pod) RunsProxy(bin string) (bool, error) {
	running, err := os.ReadFile(fmt.Sprintf("/proc/%d/exe", p.sidecar.cmd.Process.Pid))
	if err != nil {
		return false, err
	}
	want, err := os.ReadFile(bin)
	if err != nil {
		return false, err
	}
	return bytes.Equal(running, want), nil
}

// ListenerCookiesOn are the SO_COOKIEs of the listening sockets the pod's proxy holds for
// address (host:port, as its /status writes it).
func (p *Pod) ListenerCookiesOn(address string) ([]uint64, error) {
	status, err := p.ProxyStatus()
	if err != nil {
		return nil, err
	}
	var cookies []uint64
	for _, l := range status.Listeners {
		if l.Address == address {
			cookies = append(cookies, l.Cookie)
		}
	}
	return cookies, nil
}

// Ready runs the pod's readiness probes once.
func (p *Pod) Ready(ctx context.Context) bool {
	for _, probe := range p.probes {
		if !runProbe(ctx, probe) {
			return false
		}
	}
	return true
}

func runProbe(ctx context.Context, argv []string) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return exec.CommandContext(ctx, argv[0], argv[1:]...).Run() == nil
}

// Crashed says which container exited, if one did.
func (p *Pod) Crashed() error {
	for _, c := range []*Proc{p.apiserver, p.sidecar} {
		if c != nil && c.Exited() {
			return fmt.Errorf("pod %s: container %s exited with %d: %s", p.Opts.Name, c.Name, c.ExitCode(), report.FileTail(c.Log, 8))
		}
	}
	return nil
}

// Termination is how a pod's containers ended.
type Termination struct {
	APIServerExit    int           `json:"apiserver_exit"`
	SidecarExit      int           `json:"sidecar_exit"`
	APIServerStopped time.Duration `json:"apiserver_stopped_ns"`
	SidecarStopped   time.Duration `json:"sidecar_stopped_ns"`
	Killed           []string      `json:"killed,omitempty"`
}

// Terminate stops the pod as the kubelet does: SIGTERM to every container at once, SIGKILL to
// what is left after terminationGracePeriodSeconds.
func (p *Pod) Terminate() Termination {
	began := time.Now()
	procs := []*Proc{p.apiserver, p.sidecar}
	for _, c := range procs {
		if c != nil {
			c.Signal(syscall.SIGTERM)
		}
	}
	var t Termination
	stopped := make([]time.Duration, 2)
	for i, c := range procs {
		if c == nil {
			continue
		}
		remaining := p.grace - time.Since(began)
		if !c.Wait(remaining) {
			t.Killed = append(t.Killed, c.Name)
			c.Kill()
		}
		stopped[i] = time.Since(began)
	}
	t.APIServerStopped, t.SidecarStopped = stopped[0], stopped[1]
	t.APIServerExit = p.apiserver.ExitCode()
	if p.sidecar != nil {
		t.SidecarExit = p.sidecar.ExitCode()
	}
	return t
}

func (p *Pod) kill() {
	for _, c := range []*Proc{p.apiserver, p.sidecar} {
		if c != nil {
			c.Kill()
		}
	}
}

// Kill ends the pod's containers at once (cleanup).
func (p *Pod) Kill() { p.kill() }

// APIServerLog is the path of the pod's kube-apiserver log.
func (p *Pod) APIServerLog() string { return p.apiserver.Log }

// or is a, or b when a is empty.
func or(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
