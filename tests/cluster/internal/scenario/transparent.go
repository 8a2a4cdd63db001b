package scenario

import (
	"bufio"
	"bytes"
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"kube-apiserver-proxy/tests/cluster/internal/await"
	"kube-apiserver-proxy/tests/cluster/internal/cluster"
	"kube-apiserver-proxy/tests/cluster/internal/report"
	steprep "kube-apiserver-proxy/tests/cluster/internal/step"
)

// auditPolicy is the apiservers' audit policy in this scenario: every request of the two
// clients' identities at Metadata level (who, from where, what), nothing else (the log stays
// small).
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
    users: [%q, %q]
  - level: None
`

// remoteLoad is cmd/loadgen running in a client namespace.
type remoteLoad struct {
	net       *cluster.ClientNet
	cmd       *exec.Cmd
	out, log  string
	done      chan struct{}
	waitError error
}

// startRemoteLoad runs loadgen (built beside the rehearse binary by tests/cluster/run) in net
// with kubeconfig, and waits until its load runs.
func startRemoteLoad(ctx context.Context, work string, net *cluster.ClientNet, kubeconfig string) (*remoteLoad, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	bin := filepath.Join(filepath.Dir(self), "loadgen")
	base := filepath.Join(work, "loadgen-"+net.Name)
	l := &remoteLoad{net: net, out: base + ".json", log: base + ".log", done: make(chan struct{})}
	ready := base + ".ready"
	logFile, err := os.Create(l.log)
	if err != nil {
		return nil, err
	}
	l.cmd = net.Command(bin, "-kubeconfig", kubeconfig, "-out", l.out, "-ready", ready)
	l.cmd.Stdout, l.cmd.Stderr = logFile, logFile
	if err := l.cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("loadgen in %s: %w", net.Name, err)
	}
	go func() {
		l.waitError = l.cmd.Wait()
		logFile.Close()
		close(l.done)
	}()
	running := await.Until(ctx, 200*time.Millisecond, 3*time.Minute, await.Named("loadgen in "+net.Name+": its load running", func() bool {
		select {
		case <-l.done:
			return true
		default:
		}
		_, err := os.Stat(ready)
		return err == nil
	}))
	select {
	case <-l.done:
		return nil, fmt.Errorf("loadgen in %s exited before its load ran: %s", net.Name, report.FileTail(l.log, 5))
	default:
	}
	if running != nil {
		l.stop()
		return nil, fmt.Errorf("%w: %s", running, report.FileTail(l.log, 5))
	}
	return l, nil
}

// stop ends the load (SIGTERM) and reads its report.
func (l *remoteLoad) stop() (*steprep.Report, error) {
	_ = l.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-l.done:
	case <-time.After(2 * time.Minute):
		_ = l.cmd.Process.Kill()
		<-l.done
	}
	raw, err := os.ReadFile(l.out)
	if err != nil {
		return nil, fmt.Errorf("no report (%v): %s", l.waitError, report.FileTail(l.log, 5))
	}
	var rep steprep.Report
	if err := json.Unmarshal(raw, &rep); err != nil {
		return nil, fmt.Errorf("%s: %w", l.out, err)
	}
	return &rep, nil
}

// loadUserAgent is the user agent of every request of package load.
const loadUserAgent = "kube-apiserver-proxy-cluster-load"

// offPeriod is how long the load runs against the pod as shipped before the switch.
const offPeriod = 15 * time.Second

// clientAddressTransparent: kube-apiserver sees each client's own address with
// --client-address transparent (docs/operations.md, "What the apiserver sees"). Two clients
// off the node, each in a network namespace of its own with an address and an identity of its
// own (admin.conf from 198.51.100.2, super-admin.conf from 198.51.100.6), run the client-go
// load while the pod is replaced: first by the pod as single-controller ships it, then by the
// pod of single-controller-transparent (its init container installs the policy routing, its
// sidecar starts as root and switches to the proxy uid with CAP_NET_RAW), --rollouts times
// more, and back. The apiservers write a real audit log (log backend, the policy above): with
// the mode off every request of both clients comes from 127.0.0.1; once the switch is done,
// every one from its client's own address, none from loopback. Both loads under the strict
// criteria of every rollout scenario (0 failed requests, 0 refused or reset connections).
func clientAddressTransparent(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.Sidecar, cluster.GatePod
	shipped := e.tmpl
	defer func() { e.tmpl = shipped }()
	transparent, err := cluster.RenderTemplate(filepath.Join(e.o.Repo, "manifests", "single-controller-transparent"))
	if err != nil {
		r.Fail("%v", err)
		return
	}
	superAdmin := filepath.Join(e.node.Dir, "super-admin.conf")
	users := map[string]string{}
	for _, conf := range []string{e.node.AdminConf, superAdmin} {
		if users[conf], err = kubeconfigUser(conf); err != nil {
			r.Fail("%v", err)
			return
		}
	}
	policy := filepath.Join(e.o.Work, "audit-policy.yaml")
	if err := os.WriteFile(policy, fmt.Appendf(nil, auditPolicy, users[e.node.AdminConf], users[superAdmin]), 0o644); err != nil {
		r.Fail("%v", err)
		return
	}
	audit := []string{"--audit-policy-file=" + policy, "--audit-log-path=-"}

	a, err := cluster.NewClientNet(ctx, "kapca", "198.51.100.1", "198.51.100.2")
	if err != nil {
		r.Fail("%v", err)
		return
	}
	defer a.Delete()
	b, err := cluster.NewClientNet(ctx, "kapcb", "198.51.100.5", "198.51.100.6")
	if err != nil {
		r.Fail("%v", err)
		return
	}
	defer b.Delete()
	want := map[string]string{users[e.node.AdminConf]: a.IP.String(), users[superAdmin]: b.IP.String()}

	// Each client is the load generator run in its namespace (the whole process there: its
	// every connection comes from its address), judged by loadgen with the tier's strict
	// criteria.
	var clients []*remoteLoad
	for _, c := range []struct {
		net        *cluster.ClientNet
		kubeconfig string
	}{{a, e.node.AdminConf}, {b, superAdmin}} {
		l, err := startRemoteLoad(ctx, e.o.Work, c.net, c.kubeconfig)
		if err != nil {
			r.Fail("%v", err)
			for _, l := range clients {
				l.stop()
			}
			return
		}
		clients = append(clients, l)
	}

	var pods []*cluster.Pod
	roll := func() bool {
		if !e.rollout(ctx, r, cluster.Sidecar, cluster.GatePod, e.o.APIServer, audit, nil) {
			return false
		}
		pods = append(pods, e.current)
		return true
	}
	var off, on [2]time.Time
	before := cluster.ReadTCPCounters()
	func() {
		// The pod as shipped, writing the audit log.
		if !roll() {
			return
		}
		off[0] = time.Now()
		select {
		case <-ctx.Done():
		case <-time.After(offPeriod):
		}
		off[1] = time.Now()
		// The switch: from here on the old pod, its proxy and the connections it carried
		// are gone.
		e.tmpl = transparent
		if !roll() {
			return
		}
		on[0] = time.Now()
		for i := 0; i < e.o.Rollouts && ctx.Err() == nil; i++ {
			if !roll() {
				return
			}
		}
		on[1] = time.Now()
		// And back, under the same load.
		e.tmpl = shipped
		roll()
	}()
	r.TCP = cluster.ReadTCPCounters().Since(before)
	for _, c := range []string{"TcpExt:ListenOverflows", "TcpExt:ListenDrops"} {
		if n := r.TCP[c]; n > 0 {
			r.Fail("%s: %d in the node during the scenario (a listen queue overflowed or a SYN was dropped)", c, n)
		}
	}
	for i, l := range clients {
		rep, err := l.stop()
		if err != nil {
			r.Fail("client %s: %v", l.net.IP, err)
			continue
		}
		for _, p := range rep.Problems {
			r.Fail("client %s: %s", l.net.IP, p)
		}
		if rep.Load != nil {
			if i == 0 {
				r.Load = rep.Load
			}
			r.Note("client %s: %s", l.net.IP, rep.Load.Summary())
		}
	}
	if _, err := cluster.Run(ctx, 30*time.Second, e.o.Proxy, "transparent-routes", "--remove"); err != nil {
		r.Fail("transparent-routes --remove: %v", err)
	}
	if on[1].IsZero() {
		return
	}
	events, err := auditEvents(pods)
	if err != nil {
		r.Fail("%v", err)
		return
	}
	loopback := map[string]string{}
	for user := range want {
		loopback[user] = "127.0.0.1"
	}
	checkSources(r, "mode off", events, off, loopback)
	checkSources(r, "mode on", events, on, want)
}

// auditEvent is what this scenario reads of an audit event.
type auditEvent struct {
	Kind      string   `json:"kind"`
	UserAgent string   `json:"userAgent"`
	SourceIPs []string `json:"sourceIPs"`
	User      struct {
		Username string `json:"username"`
	} `json:"user"`
	Received time.Time `json:"requestReceivedTimestamp"`
}

// auditEvents reads the audit events the pods' apiservers wrote to their logs
// (--audit-log-path=-: stdout, between klog's lines).
func auditEvents(pods []*cluster.Pod) ([]auditEvent, error) {
	var events []auditEvent
	for _, p := range pods {
		f, err := os.Open(p.APIServerLog())
		if err != nil {
			return nil, err
		}
		s := bufio.NewScanner(f)
		s.Buffer(make([]byte, 1<<20), 1<<20)
		for s.Scan() {
			line := s.Bytes()
			if !bytes.HasPrefix(line, []byte(`{"kind":"Event"`)) {
				continue
			}
			var ev auditEvent
			if err := json.Unmarshal(line, &ev); err == nil {
				events = append(events, ev)
			}
		}
		err = s.Err()
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p.APIServerLog(), err)
		}
	}
	return events, nil
}

// checkSources: every load request of each user received within window came from want[user],
// and there were some.
func checkSources(r *Result, phase string, events []auditEvent, window [2]time.Time, want map[string]string) {
	seen := map[string]map[string]int{}
	for _, ev := range events {
		if ev.UserAgent != loadUserAgent || ev.Received.Before(window[0]) || ev.Received.After(window[1]) {
			continue
		}
		if _, ok := want[ev.User.Username]; !ok {
			continue
		}
		source := "none"
		if len(ev.SourceIPs) > 0 {
			source = ev.SourceIPs[0]
		}
		if seen[ev.User.Username] == nil {
			seen[ev.User.Username] = map[string]int{}
		}
		seen[ev.User.Username][source]++
	}
	users := make([]string, 0, len(want))
	for u := range want {
		users = append(users, u)
	}
	sort.Strings(users)
	for _, user := range users {
		sources := seen[user]
		var parts []string
		total := 0
		for source, n := range sources {
			parts = append(parts, fmt.Sprintf("%s: %d", source, n))
			total += n
		}
		sort.Strings(parts)
		r.Note("%s, audit log: %s's requests by source address: %s", phase, user, strings.Join(parts, ", "))
		if total == 0 {
			r.Fail("%s: no audited request of %s between %s and %s", phase, user, window[0].Format("15:04:05"), window[1].Format("15:04:05"))
		}
		for source, n := range sources {
			if source != want[user] {
				r.Fail("%s: %d requests of %s audited from %s, want all from %s", phase, n, user, source, want[user])
			}
			if ip := net.ParseIP(source); want[user] != "127.0.0.1" && ip != nil && ip.IsLoopback() {
				r.Fail("%s: a client off the node appears as %s", phase, source)
			}
		}
	}
}

// kubeconfigUser is the user name of a kubeconfig's client certificate (its CN).
func kubeconfigUser(path string) (string, error) {
	cfg, err := clientcmd.LoadFromFile(path)
	if err != nil {
		return "", err
	}
	kctx := cfg.Contexts[cfg.CurrentContext]
	if kctx == nil {
		return "", fmt.Errorf("%s: no current context", path)
	}
	auth := cfg.AuthInfos[kctx.AuthInfo]
	if auth == nil {
		return "", fmt.Errorf("%s: no user", path)
	}
	block, _ := pem.Decode(auth.ClientCertificateData)
	if block == nil {
		return "", fmt.Errorf("%s: no client certificate", path)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	return cert.Subject.CommonName, nil
}
