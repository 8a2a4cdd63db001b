package node

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

func TestCheckpointAfter(t *testing.T) {
	m := "        - --metrics-listen=0.0.0.0:9445\n        - --checkpoint-after=60s\n        - --checkpoint-after=5s\n"
	if got := CheckpointAfter(m); got != time.Minute {
		t.Fatalf("the first flag: %v", got)
	}
	if got := CheckpointAfter("- --checkpoint-after=1m\n"); got != 0 {
		t.Fatalf("only seconds count: %v", got)
	}
}

func TestRunningTasks(t *testing.T) {
	ls := "TASK      PID     STATUS    \nabc       4242    RUNNING\ndef       0       STOPPED\njkl       18      PAUSED\nghi       17      RUNNING\n"
	if got := strings.Join(RunningTasks(ls), " "); got != "abc ghi" {
		t.Fatalf("running tasks: %q", got)
	}
	if got := RunningTasks("TASK PID STATUS\n"); len(got) != 0 {
		t.Fatalf("none: %q", got)
	}
}

func TestAgentMessages(t *testing.T) {
	log := `2026-12-03T07:44:00Z stderr F {"timestamp":"x","level":"INFO","fields":{"message":"recover: checkpoint written: ready","pod":"kube-system/a"},"target":"recover"}
2026-12-03T07:45:00Z stderr F {"timestamp":"x","level":"INFO","fields":{"message":"recover: checkpoint activated: runs","of":"kube-system/a"},"target":"recover"}
2026-12-03T07:45:00Z stderr F {"timestamp":"x","fields":{"message":"serving metrics"}}`
	got := AgentMessages(log, regexp.MustCompile("checkpoint written"))
	if len(got) != 1 || got[0] != `"message":"recover: checkpoint written: ready","pod":"kube-system/a"` {
		t.Fatalf("written: %q", got)
	}
	if got := AgentMessages(log, regexp.MustCompile("activated|retired")); len(got) != 1 || !strings.Contains(got[0], `"of":"kube-system/a"`) {
		t.Fatalf("activated: %q", got)
	}
	if got := AgentMessages(log, regexp.MustCompile("metrics")); len(got) != 0 {
		t.Fatalf("only the agent's recover messages: %q", got)
	}
}

func TestAgentManifest(t *testing.T) {
	shipped := "    - name: recover\n      image: ghcr.io/example/kube-apiserver-proxy:v0.1.0\n      args:\n        - --allow-image-repository=ghcr.io/example/kube-apiserver-proxy\n        - --checkpoint-after=60s\n"
	got, err := AgentManifest(shipped, "localhost/r/kube-apiserver-proxy:dev", "localhost/r")
	if err != nil {
		t.Fatal(err)
	}
	want := "    - name: recover\n      image: localhost/r/kube-apiserver-proxy:dev\n      args:\n" +
		"        - --allow-image-repository=localhost/r/kube-apiserver-proxy\n        - --allow-image-repository=localhost/r/kube-apiserver\n" +
		"        - --checkpoint-after=60s\n"
	if got != want {
		t.Fatalf("manifest:\n%s\nwant:\n%s", got, want)
	}
	if _, err := AgentManifest(strings.Replace(shipped, "v0.1.0", "v0.2.0", 1), "i:dev", "r"); err == nil {
		t.Fatal("another shipped image must be an error")
	}
}

func TestPromValues(t *testing.T) {
	m := "# HELP kube_apiserver_proxy_checkpoint_refused x\nkube_apiserver_proxy_checkpoint_refused 0\n" +
		"kube_apiserver_proxy_checkpoint_refused_total 3\nkube_apiserver_proxy_checkpoint_written_timestamp_seconds 1796283942.5\n"
	if got := PromValues(m, "kube_apiserver_proxy_checkpoint_refused"); len(got) != 1 || got[0] != "0" {
		t.Fatalf("refused: %q", got)
	}
	if got := PromValues(m, "kube_apiserver_proxy_checkpoint_written_timestamp_seconds"); len(got) != 1 || got[0] != "1796283942.5" {
		t.Fatalf("written: %q", got)
	}
	if got := PromValues(m, "kube_apiserver_proxy_checkpoint_verified_timestamp_seconds"); len(got) != 0 {
		t.Fatalf("missing: %q", got)
	}
}

func TestProxyHandoff(t *testing.T) {
	shared := `{"fields":{"message":"handoff: sockets shared by peer","sockets":4,"peer":1}}`
	adopted := `{"fields":{"message":"handoff: adopted peer's listening sockets","offered":4,"taken":4,"new":0}}`
	later := `{"fields":{"message":"handoff: adopted peer's listening sockets","offered":4,"taken":4,"new":2}}`
	if s, a := ProxyHandoff(shared + "\n" + adopted + "\n" + later); !s || !a {
		t.Fatalf("shared then adopted the same: %t %t", s, a)
	}
	if _, a := ProxyHandoff(shared + "\n" + later + "\n" + adopted); a {
		t.Fatal("the first adoption brought new sockets")
	}
	if s, _ := ProxyHandoff(strings.Replace(shared, `"sockets":4`, `"sockets":0`, 1) + "\n" + adopted); s {
		t.Fatal("no socket shared")
	}
	want := `"message":"handoff: sockets shared by peer" "sockets":4 "message":"handoff: adopted peer's listening sockets" "offered":4 "taken":4 "new":0`
	if got := HandoffSummary(shared + "\n" + adopted + "\n" + later); got != want {
		t.Fatalf("summary %q", got)
	}
}

func TestOnlyKubeadmListens(t *testing.T) {
	if !OnlyKubeadmListens("*:6443 kube-apiserver/24292") {
		t.Fatal("kubeadm's wildcard alone")
	}
	if OnlyKubeadmListens("*:6443 kube-apiserver/1; 192.0.2.10:6443 kube-apiserver-/2") {
		t.Fatal("two listeners")
	}
	if OnlyKubeadmListens("192.0.2.10:6443 kube-apiserver/2") || OnlyKubeadmListens("") {
		t.Fatal("not the wildcard")
	}
}

func TestMigrateBackSteps(t *testing.T) {
	log := `x INFO m: migrate-back: SO_REUSEPORT set listen.addr=1
x INFO m: migrate-back: SO_REUSEPORT set listen.addr=2
x INFO m: migrate-back: kubeadm's manifest is in place
x INFO m: migrate-back: a device device=dummy`
	if got := MigrateBackSteps(log); got != "2 migrate-back: SO_REUSEPORT set listen.addr;1 migrate-back: a device device;1 migrate-back: kubeadm's manifest is in place;" {
		t.Fatalf("steps %q", got)
	}
}

func TestAddedLines(t *testing.T) {
	before := "spec:\n  - kube-apiserver\n  image: a:v1.37.2\n"
	after := "spec:\n  - kube-apiserver\n  - --permit-port-sharing=true\n  - kube-apiserver\n  image: a:v1.36.3\n"
	if got := strings.Join(AddedLines(before, after), " "); got != "- --permit-port-sharing=true - kube-apiserver image: a:v1.36.3" {
		t.Fatalf("added %q", got)
	}
}

func TestShortClientCert(t *testing.T) {
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubernetes"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(der)
	start, end := time.Now().Add(-10*time.Minute).Truncate(time.Second), time.Now().Add(150*time.Second).Truncate(time.Second)
	data, err := ShortClientCert(ca, caKey, "smoke-node", 0x1000, start, end)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.X509KeyPair(data, data)
	if err != nil {
		t.Fatalf("the kubelet's one file (certificate and key): %v", err)
	}
	block, _ := pem.Decode(data)
	c, _ := x509.ParseCertificate(block.Bytes)
	if c.Subject.CommonName != "system:node:smoke-node" || strings.Join(c.Subject.Organization, ",") != "system:nodes" {
		t.Fatalf("subject %v", c.Subject)
	}
	if !c.NotBefore.Equal(start) || !c.NotAfter.Equal(end) || c.IsCA || len(c.ExtKeyUsage) != 1 || c.ExtKeyUsage[0] != x509.ExtKeyUsageClientAuth {
		t.Fatalf("validity %v-%v, CA %t, usages %v", c.NotBefore, c.NotAfter, c.IsCA, c.ExtKeyUsage)
	}
	if certSerial(c) != "serial=1000" || pair.PrivateKey == nil {
		t.Fatalf("serial %s", certSerial(c))
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	if _, err := c.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, CurrentTime: time.Now()}); err != nil {
		t.Fatalf("signed by the CA for client auth: %v", err)
	}
}

// The checkpoint as the recovery agent writes it (JSON) and as kubeadm-sync copies it (YAML)
// read alike.
func TestCheckpointOfJSONAndYAML(t *testing.T) {
	dir := t.TempDir()
	for name, text := range map[string]string{
		"agent.json": `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"c","annotations":{"kube-apiserver-proxy/checkpoint-of":"kube-system/p-1"}}}`,
		"copy.json":  "apiVersion: v1\nkind: Pod\nmetadata:\n  name: c\n  uid: u\n  annotations:\n    kube-apiserver-proxy/checkpoint-of: kube-system/p-1\n",
	} {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		if got := checkpointOf(path); got != "kube-system/p-1" {
			t.Errorf("%s: checkpointOf = %q", name, got)
		}
	}
}
