package node

import (
	"fmt"
	"regexp"
	"strings"

	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// The controllers (controller-manager, scheduler, kube-proxy) and the kubelet retry by
// themselves: a proxy that resets or refuses their connections loses them nothing a load
// would count, and shows only in their logs. These are the error lines (klog E) that say a
// connection to the apiserver failed on the way.
var (
	// connFailure: a connection refused, reset, ended (EOF), a TLS handshake that failed, an
	// i/o timeout, a lost HTTP/2 connection or a broken pipe.
	connFailure = regexp.MustCompile(`connection refused|connection reset|(^|[^A-Za-z])(unexpected )?EOF([^A-Za-z]|$)|TLS handshake|i/o timeout|http2: client connection lost|broken pipe|use of closed network connection`)
	// notAPIServer: lines about another peer than the apiserver (containerd's socket, the
	// kubelet's and the controllers' own ports, etcd), and the kubelet's gRPC calls to the
	// container runtime (remote_runtime.go, "rpc error:": an exec probe into a container that
	// is stopping ends with runc's "write init-p: broken pipe"): the apiserver is spoken to over
	// HTTP only.
	notAPIServer = regexp.MustCompile(`unix|\.sock|:10250|:10255|:10257|:10259|:2379|:2380|remote_runtime\.go|rpc error:`)
)

// toleration is a kind of connection error line that is not the path's doing, and why.
type toleration struct {
	match *regexp.Regexp
	why   string
}

// tolerated lists the connection error lines that do not fail a step, each with its reason.
var tolerated = []toleration{
	{regexp.MustCompile(`use of closed network connection`),
		"Go's error for a read or write on a connection the process closed itself (the client's own close: client-go closes its idle and its lost connections, the kubelet all of them when its client certificate changes), not one the other side ended"},
}

// ConnectionErrors sorts error lines ("WRITER: LINE") that say a connection to an apiserver
// address failed: those that fail a step, and those tolerated (with why). apiAddresses are
// the host:port the clients reach the apiserver on. Pure.
func ConnectionErrors(lines []string, apiAddresses []string) (failing, allowed []string) {
	for _, line := range lines {
		if !connFailure.MatchString(line) || notAPIServer.MatchString(line) {
			continue
		}
		// A line that names an address must name one of the apiserver's; one that names
		// none (a watch that ended with "http2: client connection lost") is the apiserver's:
		// it is the only server these clients speak HTTP to.
		if hasAddress.MatchString(line) && !mentionsAny(line, apiAddresses) {
			continue
		}
		why := ""
		for _, t := range tolerated {
			if t.match.MatchString(line) {
				why = t.why
				break
			}
		}
		if why != "" {
			allowed = append(allowed, report.Cut(line, 300)+" (tolerated: "+why+")")
		} else {
			failing = append(failing, report.Cut(line, 400))
		}
	}
	return failing, allowed
}

var hasAddress = regexp.MustCompile(`[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+:[0-9]+|\[[0-9a-f:]+\]:[0-9]+`)

func mentionsAny(line string, addrs []string) bool {
	for _, a := range addrs {
		if strings.Contains(line, a) {
			return true
		}
	}
	return false
}

// APIAddresses are where the node's clients reach the apiserver: the node address, the
// loopback address (kube-proxy, the kubelet's kubeconfig after the migration) and the
// `kubernetes` Service's cluster IP.
func (n *Scenario) APIAddresses() []string {
	return []string{n.NodeIP + ":6443", "127.0.0.1:6443", "[::1]:6443", "localhost:6443", "10.96.0.1:443"}
}

// LogVerdict notes the control plane's error lines since mark (SummariseErrors), and fails
// the step `what` on each connection error toward the apiserver among them (reportOnly: notes
// them instead, for a step whose outage is measured, not asserted). Tolerated lines are noted
// with why.
func (n *Scenario) LogVerdict(what string, since LogMark, reportOnly bool) {
	lines := n.ErrorLines(since)
	summary := "no error lines"
	if len(lines) > 0 {
		summary = SummariseErrors(lines)
	}
	n.Note("%s: controller-manager, scheduler, kube-proxy and kubelet logs: %s", what, summary)
	failing, allowed := ConnectionErrors(lines, n.APIAddresses())
	for _, a := range report.First(allowed, 6) {
		n.Note("%s: %s", what, a)
	}
	if len(failing) == 0 {
		n.Pass("%s: no connection to the apiserver failed in the controllers' and the kubelet's logs", what)
		return
	}
	msg := fmt.Sprintf("%s: %d connections to the apiserver failed in the controllers' and the kubelet's logs: %s",
		what, len(failing), strings.Join(report.First(failing, 4), " | "))
	if reportOnly {
		n.Note("measured: %s", msg)
		return
	}
	n.Fail("%s", msg)
}
