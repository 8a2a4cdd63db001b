package node

import (
	"encoding/json"
	"strings"
	"testing"

	"kube-apiserver-proxy/tests/cluster/internal/step"
)

func TestRenderedSummary(t *testing.T) {
	yaml := "apiVersion: v1\nkind: Endpoints\n---\nkind: Deployment\nspec:\n  containers:\n  - image: localhost/p:dev\n  - image: \"localhost/kube-apiserver:v1.36.3\"\n---\nkind: PodDisruptionBudget\n    kind: nested\n"
	objects, image := renderedSummary(yaml)
	if objects != 3 || image != `"localhost/kube-apiserver:v1.36.3"` {
		t.Fatalf("renderedSummary: %d objects, image %q", objects, image)
	}
}

func TestStoredValue(t *testing.T) {
	value := []byte("k8s:enc:aescbc:v1:key1:\x01\x02 and the rest of the ciphertext")
	answer, _ := json.Marshal(map[string]any{"kvs": []map[string][]byte{{"value": value}}})
	got, err := storedValue(answer)
	if err != nil || got != `b'k8s:enc:aescbc:v1:key1:\x01'` {
		t.Fatalf("storedValue: %q, %v", got, err)
	}
	if got, err := storedValue([]byte(`{"header": {}}`)); err != nil || got != "none" {
		t.Fatalf("storedValue of a missing key: %q, %v", got, err)
	}
	if _, err := storedValue([]byte("curl: (7) refused")); err == nil {
		t.Fatal("storedValue of no answer: no error")
	}
}

func stepReport(t *testing.T, s string) *step.Report {
	t.Helper()
	var r step.Report
	if err := json.Unmarshal([]byte(s), &r); err != nil {
		t.Fatal(err)
	}
	return &r
}

const kuReport = `{"load": {"duration_ns": 84200000000,
  "requests": {"get": {"ok": 1200, "failed": 17}, "list": {"ok": 26, "failed": 0}},
  "informers": {"secrets": {"relists": 2}}, "streams": {"cut": {"eof": 1}}},
 "probes": [{"address": "192.0.2.10:6443", "refused": 3, "timeouts": 1}],
 "tcp": {}, "problems": ["17 client-go requests failed", "no request completed in 71 seconds"]}`

func TestPodVerdict(t *testing.T) {
	line, clean := podVerdict(stepReport(t, kuReport))
	if clean || line != "load 1226 requests ok, 17 failed; relists 2; problems: 17 client-go requests failed; no request completed in 71 seconds" {
		t.Fatalf("podVerdict: %q, clean %t", line, clean)
	}
	line, clean = podVerdict(stepReport(t, `{"load": {"duration_ns": 1, "requests": {"get": {"ok": 5}}}, "tcp": {}, "problems": []}`))
	if !clean || line != "load 5 requests ok, 0 failed; relists 0; problems: none" {
		t.Fatalf("podVerdict of a clean report: %q, clean %t", line, clean)
	}
	if _, clean := podVerdict(stepReport(t, `{"tcp": {}, "problems": []}`)); clean {
		t.Fatal("a report without a load is clean")
	}
}

func TestTableRow(t *testing.T) {
	row, ok := tableRow("etcd (NODE_IP)", stepReport(t, kuReport), nil)
	want := "etcd (NODE_IP)             84.2      1243      17        3        2        1"
	if !ok || row != want {
		t.Fatalf("tableRow:\n got %q\nwant %q", row, want)
	}
	if _, ok := tableRow("x", nil, nil); ok {
		t.Fatal("a row without a report")
	}
	if _, ok := tableRow("x", stepReport(t, `{"tcp": {}, "problems": []}`), nil); ok {
		t.Fatal("a row without a load")
	}
}

const applyLog = `[upgrade/config] Making sure the configuration is correct:
[upgrade/staticpods] Preparing for "etcd" upgrade
[upgrade/staticpods] Current and new manifests of etcd are equal, skipping upgrade
[upgrade/etcd] Waiting for etcd to become available
[upgrade/staticpods] Writing new Static Pod manifests to "/etc/kubernetes/tmp/kubeadm-upgraded-manifests"
[upgrade] SUCCESS! A control plane node of your cluster was upgraded to "v1.37.2".
W1203 15:55:00.000000 1 staticpods.go:1] [upgrade/etcd] etcd is slow: error timed out
`

func TestKubeadmSaid(t *testing.T) {
	got := kubeadmSaid(applyLog)
	want := `[upgrade/staticpods] Preparing for "etcd" upgrade|[upgrade/staticpods] Current and new manifests of etcd are equal, skipping upgrade|[upgrade/etcd] Waiting for etcd to become available|[upgrade] SUCCESS! A control plane node of your cluster was upgraded to "v1.37.2".`
	if got != want {
		t.Fatalf("kubeadmSaid:\n got %q\nwant %q", got, want)
	}
	if got := grepTail(applyLog, kuErrors, 3); got != "W1203 15:55:00.000000 1 staticpods.go:1] [upgrade/etcd] etcd is slow: error timed out" {
		t.Fatalf("grepTail: %q", got)
	}
	if got := grepTail("ERROR one\nfine\nfatal two\nerror three\n", kuErrors, 2); got != "fatal two|error three" {
		t.Fatalf("grepTail of the last 2: %q", got)
	}
}

func TestPlanRows(t *testing.T) {
	plan := "Upgrade to the latest version in the v1.36 series:\n\nCOMPONENT                 NODE         CURRENT   TARGET\n" +
		"kube-apiserver            smoke-node   v1.36.3   v1.37.2\nkube-controller-manager   smoke-node   v1.36.3   v1.37.2\n" +
		"kube-scheduler            smoke-node   v1.36.3   v1.37.2\nkube-proxy                             1.36.3    v1.37.2\n" +
		"etcd                      smoke-node   v3.6.16   3.7.0-0\n"
	rows, moves := planRows(plan, "v1.36.3", "v1.37.2")
	if !moves || rows != "kube-apiserver smoke-node v1.36.3 v1.37.2|kube-controller-manager smoke-node v1.36.3 v1.37.2|kube-scheduler smoke-node v1.36.3 v1.37.2|etcd smoke-node v3.6.16 3.7.0-0" {
		t.Fatalf("planRows: %q, moves %t", rows, moves)
	}
	if _, moves := planRows(strings.ReplaceAll(plan, "v1.36.3   v1.37.2", "v1.37.2   v1.37.2"), "v1.36.3", "v1.37.2"); moves {
		t.Fatal("a plan without the apiserver's move moves it")
	}
	if _, moves := planRows("kube-apiserver smoke-node v1x36x3 v1.37.2\n", "v1.36.3", "v1.37.2"); moves {
		t.Fatal("the versions' dots match any character")
	}
}

func TestSkipLines(t *testing.T) {
	b := []byte("one\ntwo\nthree\n")
	for k, want := range map[int]string{0: "one\ntwo\nthree\n", 1: "two\nthree\n", 3: "", 5: ""} {
		if got := string(skipLines(b, k)); got != want {
			t.Errorf("skipLines(%d) = %q, want %q", k, got, want)
		}
	}
	if got := string(skipLines([]byte("one\ntwo"), 1)); got != "two" {
		t.Errorf("skipLines of a last line without a newline: %q", got)
	}
}

func TestMembers(t *testing.T) {
	answer := []byte(`{"header":{"cluster_id":"1"},"members":[{"ID":"8e9e05c52164694d","name":"smoke-node","peerURLs":["https://192.0.2.10:2380"],"clientURLs":["https://192.0.2.10:2379"]},{"ID":"2","name":"next","isLearner":true}]}`)
	got, err := Members(answer)
	if err != nil || len(got) != 2 || got[0] != (Member{Name: "smoke-node"}) || got[1] != (Member{Name: "next", Learner: true}) {
		t.Errorf("Members = %+v, %v", got, err)
	}
	if _, err := Members([]byte("not json")); err == nil {
		t.Error("Members(not json): no error")
	}
}
