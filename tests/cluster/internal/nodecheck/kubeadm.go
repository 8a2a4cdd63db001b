package nodecheck

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// StaticReadyInKubelet: every static pod the kubelet runs (config.source file) is Ready in the
// kubelet's own view (its /pods: the status its status manager holds now). A restarted kubelet
// runs each static pod's start-up and readiness probes again and holds no status until they
// answer, so its mirror pods may still turn unready for a moment after StaticSettled; once the
// kubelet's own view is Ready, the restart is behind them.
func StaticReadyInKubelet(kubelet *corev1.PodList) bool {
	n := 0
	for i := range kubelet.Items {
		p := &kubelet.Items[i]
		if p.Annotations["kubernetes.io/config.source"] != "file" {
			continue
		}
		n++
		if !Ready(p) {
			return false
		}
	}
	return n > 0
}

// StaticSettled: every static pod the kubelet runs (config.source file) is there once and is
// the one its mirror pod in the apiserver shows (the kubelet's UID in the mirror's
// kubernetes.io/config.mirror), and that mirror pod is Ready. A kubelet of another minor
// computes other UIDs for the same files and replaces every static pod: this is when it is
// done.
func StaticSettled(kubelet, api *corev1.PodList) bool {
	const source, mirrorOf = "kubernetes.io/config.source", "kubernetes.io/config.mirror"
	seen := map[string]bool{}
	var static []*corev1.Pod
	for i := range kubelet.Items {
		p := &kubelet.Items[i]
		if p.Annotations[source] != "file" {
			continue
		}
		if seen[p.Name] {
			return false
		}
		seen[p.Name] = true
		static = append(static, p)
	}
	if len(static) == 0 {
		return false
	}
	mirrors := map[string]*corev1.Pod{}
	for i := range api.Items {
		if _, ok := api.Items[i].Annotations[mirrorOf]; ok {
			mirrors[api.Items[i].Name] = &api.Items[i]
		}
	}
	for _, p := range static {
		m := mirrors[p.Name]
		if m == nil || m.Annotations[mirrorOf] != string(p.UID) || !Ready(m) {
			return false
		}
	}
	return true
}

var klogTime = regexp.MustCompile(`^[IWE]\d{4} (\d\d:\d\d:\d\d\.\d+)`)

// EtcdDown reads the kubelet's log and says how long etcd was down: from the kubelet's first
// kill of an etcd container to etcd's next Ready (readiness probe), with the start of the new
// container between; "not restarted" when the kubelet killed none.
func EtcdDown(log io.Reader) (string, error) {
	at := func(line string) *time.Time {
		m := klogTime.FindStringSubmatch(line)
		if m == nil {
			return nil
		}
		t, err := time.Parse("15:04:05.999999999", m[1])
		if err != nil {
			return nil
		}
		return &t
	}
	var kill, start, ready *time.Time
	s := bufio.NewScanner(log)
	s.Buffer(make([]byte, 0, 64*1024), 16*1024*1024)
	for s.Scan() {
		line := s.Text()
		if !strings.Contains(line, `pod="kube-system/etcd-`) {
			continue
		}
		if kill == nil && strings.Contains(line, "Killing container with a grace period") {
			kill = at(line)
		} else if kill != nil && start == nil && strings.Contains(line, "ContainerStarted") {
			start = at(line)
		} else if kill != nil && strings.Contains(line, `probe="readiness" status="ready"`) {
			ready = at(line)
			break
		}
	}
	if err := s.Err(); err != nil {
		return "", err
	}
	switch {
	case kill == nil:
		return "etcd not restarted", nil
	case ready == nil:
		return "etcd killed, not Ready again in the log", nil
	}
	if start == nil {
		start = ready
	}
	return fmt.Sprintf("etcd down %.1f s (the new container started %.1f s after the kill)",
		ready.Sub(*kill).Seconds(), start.Sub(*kill).Seconds()), nil
}

// Audited: the audit log (one JSON event a line) has a request for an object called name
// received at or after since (UTC, "2006-01-02T15:04:05").
func Audited(log io.Reader, name, since string) (bool, error) {
	s := bufio.NewScanner(log)
	s.Buffer(make([]byte, 0, 64*1024), 16*1024*1024)
	for s.Scan() {
		var e struct {
			ObjectRef *struct {
				Name string `json:"name"`
			} `json:"objectRef"`
			Received string `json:"requestReceivedTimestamp"`
		}
		if json.Unmarshal(s.Bytes(), &e) != nil || e.ObjectRef == nil || e.ObjectRef.Name != name {
			continue
		}
		received := e.Received
		if len(received) > 19 {
			received = received[:19]
		}
		if received >= since {
			return true, nil
		}
	}
	return false, s.Err()
}

// PyBytes writes b as Python writes a bytes value (b'k8s:enc:aescbc:v1:key1:\x00…'): how the
// first bytes of a value stored in etcd are shown.
func PyBytes(b []byte) string {
	quote := byte('\'')
	if strings.IndexByte(string(b), '\'') >= 0 && strings.IndexByte(string(b), '"') < 0 {
		quote = '"'
	}
	var s strings.Builder
	s.WriteString("b")
	s.WriteByte(quote)
	for _, c := range b {
		switch {
		case c == quote || c == '\\':
			s.WriteByte('\\')
			s.WriteByte(c)
		case c == '\t':
			s.WriteString(`\t`)
		case c == '\n':
			s.WriteString(`\n`)
		case c == '\r':
			s.WriteString(`\r`)
		case c < ' ' || c >= 0x7f:
			fmt.Fprintf(&s, `\x%02x`, c)
		default:
			s.WriteByte(c)
		}
	}
	s.WriteByte(quote)
	return s.String()
}
