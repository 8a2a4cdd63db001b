package nodecheck

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func TestStaticSettled(t *testing.T) {
	const kubelet = `{"items": [
	  {"metadata": {"name": "etcd-n", "uid": "u1", "annotations": {"kubernetes.io/config.source": "file"}}},
	  {"metadata": {"name": "kube-proxy-x", "uid": "u9", "annotations": {"kubernetes.io/config.source": "api"}}}]}`
	const api = `{"items": [
	  {"metadata": {"name": "etcd-n", "annotations": {"kubernetes.io/config.mirror": "u1"}},
	   "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]}`
	if !StaticSettled(decode[corev1.PodList](t, kubelet), decode[corev1.PodList](t, api)) {
		t.Fatalf("a settled node is not settled")
	}
	for name, c := range map[string][2]string{
		"the old static pod still runs beside the new": {strings.Replace(kubelet, `]}`, `, {"metadata": {"name": "etcd-n", "uid": "u0", "annotations": {"kubernetes.io/config.source": "file"}}}]}`, 1), api},
		"the mirror shows the old pod":                 {kubelet, strings.Replace(api, `"u1"`, `"u0"`, 1)},
		"the mirror is not Ready":                      {kubelet, strings.Replace(api, `"status": "True"`, `"status": "False"`, 1)},
		"no mirror":                                    {kubelet, `{"items": []}`},
		"no static pod":                                {`{"items": []}`, api},
	} {
		if StaticSettled(decode[corev1.PodList](t, c[0]), decode[corev1.PodList](t, c[1])) {
			t.Errorf("%s: settled", name)
		}
	}
}

func TestStaticReadyInKubelet(t *testing.T) {
	pod := func(name, source, ready string) string {
		status := ""
		if ready != "" {
			status = `, "status": {"conditions": [{"type": "Ready", "status": "` + ready + `"}]}`
		}
		return `{"metadata": {"name": "` + name + `", "annotations": {"kubernetes.io/config.source": "` + source + `"}}` + status + `}`
	}
	list := func(pods ...string) *corev1.PodList {
		return decode[corev1.PodList](t, `{"items": [`+strings.Join(pods, ",")+`]}`)
	}
	proxy := pod("kube-proxy-x", "api", "")
	if !StaticReadyInKubelet(list(pod("etcd-n", "file", "True"), pod("kube-scheduler-n", "file", "True"), proxy)) {
		t.Fatalf("every static pod Ready in the kubelet, but not ready")
	}
	for name, l := range map[string]*corev1.PodList{
		// Just restarted: the scheduler's probes have not answered yet.
		"a static pod not Ready":          list(pod("etcd-n", "file", "True"), pod("kube-scheduler-n", "file", "False"), proxy),
		"a static pod with no status yet": list(pod("etcd-n", "file", "True"), pod("kube-scheduler-n", "file", ""), proxy),
		"no static pod":                   list(proxy),
	} {
		if StaticReadyInKubelet(l) {
			t.Errorf("%s: ready", name)
		}
	}
}

func TestEtcdDown(t *testing.T) {
	const log = `I1203 13:00:00.000000 1 other.go:1] "Killing container with a grace period" pod="kube-system/kube-apiserver-n"
I1203 13:00:01.000000 1 kuberuntime.go:1] "Killing container with a grace period" pod="kube-system/etcd-n"
I1203 13:00:02.500000 1 kubelet.go:1] "SyncLoop (PLEG): event for pod" pod="kube-system/etcd-n" event={"Type":"ContainerStarted"}
I1203 13:00:09.260000 1 kubelet.go:1] "SyncLoop (probe)" probe="readiness" status="ready" pod="kube-system/etcd-n"
I1203 13:00:20.000000 1 kubelet.go:1] "SyncLoop (probe)" probe="readiness" status="ready" pod="kube-system/etcd-n"
`
	for _, c := range []struct{ log, want string }{
		{log, "etcd down 8.3 s (the new container started 1.5 s after the kill)"},
		{strings.Replace(log, "ContainerStarted", "ContainerDied", 1), "etcd down 8.3 s (the new container started 8.3 s after the kill)"},
		{strings.ReplaceAll(log, `probe="readiness" status="ready"`, `probe="readiness" status=""`), "etcd killed, not Ready again in the log"},
		{strings.ReplaceAll(log, `pod="kube-system/etcd-n"`, `pod="kube-system/x"`), "etcd not restarted"},
	} {
		if got, err := EtcdDown(strings.NewReader(c.log)); err != nil || got != c.want {
			t.Errorf("EtcdDown = %q, %v; want %q", got, err, c.want)
		}
	}
}

func TestAudited(t *testing.T) {
	const log = `not json
{"objectRef": {"name": "other"}, "requestReceivedTimestamp": "2026-12-03T13:00:05.123456Z"}
{"objectRef": {"name": "ku-before-upgrade"}, "requestReceivedTimestamp": "2026-12-03T13:00:04.999999Z"}
`
	for _, c := range []struct {
		since string
		want  bool
	}{{"2026-12-03T13:00:04", true}, {"2026-12-03T13:00:05", false}} {
		if got, err := Audited(strings.NewReader(log), "ku-before-upgrade", c.since); err != nil || got != c.want {
			t.Errorf("Audited since %s = %v, %v; want %v", c.since, got, err, c.want)
		}
	}
}

func TestPyBytes(t *testing.T) {
	for in, want := range map[string]string{
		"k8s:enc:aescbc:v1:key1:\x00\xff": `b'k8s:enc:aescbc:v1:key1:\x00\xff'`,
		"a'b\"c\\\n\t\x7f":                `b'a\'b"c\\\n\t\x7f'`,
		"it's":                            `b"it's"`,
	} {
		if got := PyBytes([]byte(in)); got != want {
			t.Errorf("PyBytes(%q) = %s, want %s", in, got, want)
		}
	}
}
