package node

import (
	"bufio"
	"bytes"
	"os"
	"os/user"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kube-apiserver-proxy/tests/cluster/internal/report"
)

func TestImageOnlyDiff(t *testing.T) {
	shipped := "spec:\n  containers:\n  - image: ghcr.io/example/kube-apiserver-proxy:v1\n    name: proxy\n  - image: registry.k8s.io/kube-apiserver:v1.37.2\n"
	local := "spec:\n  containers:\n  - image: localhost/p:dev\n    name: proxy\n  - image: localhost/a:v1\n"
	changed, images := ImageOnlyDiff(shipped, local)
	if len(changed) != 0 || strings.Join(images, " ") != "- image: localhost/p:dev - image: localhost/a:v1" {
		t.Fatalf("only images changed: changed %q, images %q", changed, images)
	}
	changed, _ = ImageOnlyDiff(shipped, strings.Replace(local, "name: proxy", "name: other", 1))
	if len(changed) != 1 || !strings.Contains(changed[0], "name: other") {
		t.Fatalf("a name changed: %q", changed)
	}
	if changed, _ = ImageOnlyDiff(shipped, local+"extra: 1\n"); len(changed) != 1 {
		t.Fatalf("a line more: %q", changed)
	}
}

func TestSummariseErrors(t *testing.T) {
	errs := []string{
		"kube-scheduler: E1203 17:20:43.123456       1 reflector.go:200] dial tcp 192.0.2.10:6443: connect: connection refused",
		"kube-scheduler: E1203 17:20:44.123456       1 reflector.go:200] dial tcp 192.0.2.10:6443: connect: connection refused",
		"kubelet: E1203 17:20:45.000000    4242 pod_workers.go:1301] \"Error syncing pod\" pod=\"kube-system/kube-apiserver-5d8f7c9b4-abcde\"",
	}
	got := SummariseErrors(errs)
	for _, want := range []string{"3 error lines, 2 of them about reaching the apiserver", "[2] kube-scheduler: reflector.go:N] dial tcp", "[1] kubelet: pod_workers.go:N] \"Error syncing pod\" pod=\"kube-system/kube-apiserver-X\""} {
		if !strings.Contains(got, want) {
			t.Errorf("summary %q lacks %q", got, want)
		}
	}
}

func TestPodLine(t *testing.T) {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver-abc"}, Status: corev1.PodStatus{
		Phase: corev1.PodRunning,
		ContainerStatuses: []corev1.ContainerStatus{
			{Ready: true, RestartCount: 0},
			{Ready: false, RestartCount: 2, State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}},
		},
	}}
	if got := PodLine(p); got != "kube-apiserver-abc Running true,false 0,2 CrashLoopBackOff" {
		t.Fatalf("PodLine: %q", got)
	}
	if got := PodLine(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "x"}}); got != "x  <none> <none> <none>" {
		t.Fatalf("PodLine of a new pod: %q", got)
	}
}

func TestReportLinesAndActions(t *testing.T) {
	var out bytes.Buffer
	n := &Scenario{Record: report.NewRecord(&out)}
	n.Pass("one %d", 1)
	n.Fail("two\nlines")
	n.Note("a note")
	if got := out.String(); got != "ok   - one 1\nFAIL - two lines\n# a note\n" {
		t.Fatalf("report: %q", got)
	}
	if n.Failed() != 1 {
		t.Fatalf("failed: %d", n.Failed())
	}
	if err := n.Do("reboot"); err == nil {
		t.Fatal("a node action without a node to ask succeeded")
	}
}

func TestDo(t *testing.T) {
	var out bytes.Buffer
	n := &Scenario{Record: report.NewRecord(&out), actions: bufio.NewReader(strings.NewReader("0\n3\nyes\n"))}
	if err := n.Do("start_kubelet", "a", "b"); err != nil {
		t.Fatalf("answered 0: %v", err)
	}
	if err := n.Do("reboot"); err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Fatalf("answered 3: %v", err)
	}
	if err := n.Do("x"); err == nil {
		t.Fatal("answered yes: no error")
	}
	if err := n.Do("y"); err == nil {
		t.Fatal("no answer: no error")
	}
	if got := out.String(); got != "@node start_kubelet a b\n@node reboot\n@node x\n@node y\n" {
		t.Fatalf("asked: %q", got)
	}
}

func TestTmpfilesOwners(t *testing.T) {
	byName := func(string) (*user.User, error) { return &user.User{Uid: "7"}, nil }
	uid := func(u *user.User) string { return u.Uid }
	if n, err := lookupID("59443", byName, uid); err != nil || n != 59443 {
		t.Fatalf("numeric: %d %v", n, err)
	}
	if n, err := lookupID("root", byName, uid); err != nil || n != 7 {
		t.Fatalf("by name: %d %v", n, err)
	}
	if _, err := lookupID("nobody-here", user.Lookup, uid); err == nil {
		t.Fatal("an unknown user was found")
	}
}

func TestListeners(t *testing.T) {
	ss := `LISTEN 0 4096 192.0.2.10:6443 0.0.0.0:* users:(("kube-apiserver-",pid=1227,fd=23),("kube-apiserver-",pid=1227,fd=24))
LISTEN 0 4096          *:6443       *:* users:(("kube-apiserver",pid=463,fd=5))
`
	if got := Listeners(ss); got != "192.0.2.10:6443 kube-apiserver-/1227; *:6443 kube-apiserver/463" {
		t.Fatalf("Listeners: %q", got)
	}
}

func TestMove(t *testing.T) {
	dir := t.TempDir()
	src, dst := dir+"/a", dir+"/b"
	if err := os.WriteFile(src, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Move(src, dst); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(src); !os.IsNotExist(err) {
		t.Fatalf("source still there: %v", err)
	}
	if b, _ := os.ReadFile(dst); string(b) != "x" {
		t.Fatalf("moved: %q", b)
	}
}
