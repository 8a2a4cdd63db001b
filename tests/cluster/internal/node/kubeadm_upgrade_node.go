package node

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// What the kubeadm upgrade scenario reads of the node: the static pods' containers and
// images, the Deployment's generation, the stand-in's hash, the node's kubelet, etcd's stored
// bytes, the audit log, the kubelet's log.

// podLine is PodLine of kube-system/name, or why there is none.
func (u *upgrade) podLine(name string) string {
	p, err := u.Client.CoreV1().Pods("kube-system").Get(u.Ctx, name, metav1.GetOptions{})
	if err != nil {
		return err.Error()
	}
	return PodLine(p)
}

// containerIDs: "name id; " of the running etcd, controller-manager and scheduler containers
// (the id's first 24 characters, its runtime's prefix included).
func (u *upgrade) containerIDs() string {
	var b strings.Builder
	for _, c := range []string{"etcd", "kube-controller-manager", "kube-scheduler"} {
		p, err := u.Client.CoreV1().Pods("kube-system").Get(u.Ctx, c+"-"+u.NodeName, metav1.GetOptions{})
		id := ""
		switch {
		case err != nil:
			id = err.Error()
		case len(p.Status.ContainerStatuses) > 0:
			id = p.Status.ContainerStatuses[0].ContainerID
		}
		fmt.Fprintf(&b, "%s %s; ", c, id[:min(len(id), 24)])
	}
	return b.String()
}

// images: the image (without its repository) of each static pod's container (etcd,
// controller-manager, scheduler) and of the Deployment's apiserver.
func (u *upgrade) images() string {
	var out []string
	for _, c := range []string{"etcd", "kube-controller-manager", "kube-scheduler"} {
		p, err := u.Client.CoreV1().Pods("kube-system").Get(u.Ctx, c+"-"+u.NodeName, metav1.GetOptions{})
		if err != nil {
			out = append(out, err.Error())
			continue
		}
		out = append(out, imageName(p.Spec.Containers[0].Image))
	}
	d, err := u.Client.AppsV1().Deployments("kube-system").Get(u.Ctx, "kube-apiserver", metav1.GetOptions{})
	if err != nil {
		return strings.Join(append(out, err.Error()), " ")
	}
	for _, c := range d.Spec.Template.Spec.Containers {
		if c.Name == "kube-apiserver" {
			out = append(out, imageName(c.Image))
		}
	}
	return strings.Join(out, " ")
}

func imageName(image string) string { return image[strings.LastIndex(image, "/")+1:] }

// generation is the Deployment's metadata.generation (-1 when it cannot be read for 30 s).
func (u *upgrade) generation() int64 {
	gen := int64(-1)
	u.WaitFor(30*time.Second, func() bool {
		d, err := u.Client.AppsV1().Deployments("kube-system").Get(u.Ctx, "kube-apiserver", metav1.GetOptions{})
		if err == nil {
			gen = d.Generation
		}
		return err == nil
	})
	return gen
}

// standinHash is the kubernetes.io/config.hash of the agent's kube-apiserver-NODE (what
// kubeadm waits on).
func (u *upgrade) standinHash() string {
	p, err := u.Client.CoreV1().Pods("kube-system").Get(u.Ctx, "kube-apiserver-"+u.NodeName, metav1.GetOptions{})
	if err != nil {
		return ""
	}
	return p.Annotations["kubernetes.io/config.hash"]
}

// etcdValue: the first bytes of key's value as stored in etcd (its JSON gateway, with the
// apiserver's etcd client certificate), written as Python writes bytes.
func (u *upgrade) etcdValue(key string) (string, error) {
	body, _ := json.Marshal(map[string]string{"key": base64.StdEncoding.EncodeToString([]byte(key))})
	answer, err := etcdCall("POST", "/v3/kv/range", body)
	if err != nil {
		return "", err
	}
	return storedValue(answer)
}

// etcdCall: METHOD path on etcd's client URL (https://127.0.0.1:2379, its JSON gateway under
// /v3), with the apiserver's etcd client certificate; the answer of a 200.
func etcdCall(method, path string, body []byte) ([]byte, error) {
	config, err := etcdTLS()
	if err != nil {
		return nil, err
	}
	c := http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: config}}
	req, err := http.NewRequest(method, "https://127.0.0.1:2379"+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("etcd %s: %s: %s", path, resp.Status, report.Cut(string(answer), 200))
	}
	return answer, nil
}

// kuPKI is kubeadm's certificatesDir on the test node.
const kuPKI = "/etc/kubernetes/pki"

// etcdTLS: the client side of etcd's TLS as the apiserver has it: etcd's CA, the
// apiserver-etcd-client certificate.
func etcdTLS() (*tls.Config, error) {
	ca, err := os.ReadFile(kuPKI + "/etcd/ca.crt")
	if err != nil {
		return nil, err
	}
	cert, err := tls.LoadX509KeyPair(kuPKI+"/apiserver-etcd-client.crt", kuPKI+"/apiserver-etcd-client.key")
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	return &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}}, nil
}

// etcdMembers: etcd's server version (GET /version) and its members, from etcd itself.
func etcdMembers() (version string, members []Member, err error) {
	answer, err := etcdCall("GET", "/version", nil)
	if err != nil {
		return "", nil, err
	}
	var v struct {
		Server string `json:"etcdserver"`
	}
	if err := json.Unmarshal(answer, &v); err != nil {
		return "", nil, fmt.Errorf("etcd's /version: %w", err)
	}
	if answer, err = etcdCall("POST", "/v3/cluster/member/list", []byte("{}")); err != nil {
		return v.Server, nil, err
	}
	members, err = Members(answer)
	return v.Server, members, err
}

// Member is one etcd member as its member list names it.
type Member struct {
	Name    string `json:"name"`
	Learner bool   `json:"isLearner"`
}

// Members: the members of etcd's member list answer (its JSON gateway's).
func Members(answer []byte) ([]Member, error) {
	var l struct {
		Members []Member `json:"members"`
	}
	if err := json.Unmarshal(answer, &l); err != nil {
		return nil, fmt.Errorf("etcd's member list: %w", err)
	}
	return l.Members, nil
}

// storedValue is the first 24 bytes of the value in etcd's range answer, as Python writes
// bytes ("none" when the key does not exist).
func storedValue(answer []byte) (string, error) {
	var r struct {
		KVs []struct {
			Value []byte `json:"value"` // base64 in the JSON
		} `json:"kvs"`
	}
	if err := json.Unmarshal(answer, &r); err != nil {
		return "", fmt.Errorf("etcd's range answer: %w", err)
	}
	if len(r.KVs) == 0 {
		return "none", nil
	}
	v := r.KVs[0].Value
	return nodecheck.PyBytes(v[:min(len(v), 24)]), nil
}

// secretCheck: the Secret written after init reads back, and etcd holds it encrypted with the
// aescbc key of the encryption configuration.
func (u *upgrade) secretCheck(when string) {
	got := ""
	s, err := u.Client.CoreV1().Secrets("default").Get(u.Ctx, kuSecret, metav1.GetOptions{})
	if err != nil {
		got = err.Error()
	} else {
		got = string(s.Data["word"])
	}
	stored, err := u.etcdValue("/registry/secrets/default/" + kuSecret)
	if err != nil {
		stored = err.Error()
	}
	if got == "kept" && strings.HasPrefix(stored, "b'k8s:enc:aescbc:v1:key1:") {
		u.Pass("%s: the Secret written after kubeadm init reads back ('%s'), stored encrypted in etcd: %s...", when, got, stored)
	} else {
		u.Fail("%s: the Secret reads '%s', etcd holds: %s", when, got, stored)
	}
}

// etcdDown: how long etcd was down since the step began (the kubelet's log, nodecheck.EtcdDown).
func (u *upgrade) etcdDown(s *kuStep) string {
	log := u.Path("kubelet.log")
	b, err := os.ReadFile(log)
	if err != nil {
		return err.Error()
	}
	down, err := nodecheck.EtcdDown(bytes.NewReader(skipLines(b, s.mark[log])))
	if err != nil {
		return err.Error()
	}
	return down
}

// skipLines is b without its first k lines.
func skipLines(b []byte, k int) []byte {
	for ; k > 0 && len(b) > 0; k-- {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			return nil
		}
		b = b[i+1:]
	}
	return b
}

func (u *upgrade) kubeletVersion() string {
	node, err := u.Client.CoreV1().Nodes().Get(u.Ctx, u.NodeName, metav1.GetOptions{})
	if err != nil {
		return err.Error()
	}
	return node.Status.NodeInfo.KubeletVersion
}

// nodeReady is the node's Ready condition, "Status reason: message".
func (u *upgrade) nodeReady() string {
	node, err := u.Client.CoreV1().Nodes().Get(u.Ctx, u.NodeName, metav1.GetOptions{})
	if err != nil {
		return err.Error()
	}
	return nodecheck.NodeReady(node)
}

// systemPods: PodLine of every pod in kube-system, joined with "|".
func (u *upgrade) systemPods() string {
	list, err := u.Client.CoreV1().Pods("kube-system").List(u.Ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var out []string
	for i := range list.Items {
		out = append(out, PodLine(&list.Items[i]))
	}
	return strings.Join(out, "|")
}

// audited: the audit log (rotated files too) has a request for an object name received at or
// after since.
func audited(name, since string) bool {
	files, _ := filepath.Glob("/var/log/kubernetes/audit/*.log")
	var readers []io.Reader
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil {
			readers = append(readers, bytes.NewReader(b), strings.NewReader("\n"))
		}
	}
	ok, err := nodecheck.Audited(io.MultiReader(readers...), name, since)
	return err == nil && ok
}

// etcdCertSerials: the serials of etcd's serving certificate as served on a new connection
// to its client URL and as in /etc/kubernetes/pki/etcd/server.crt (etcd reads its
// certificate files again for each handshake).
type etcdCertSerials struct{ Served, File string }

// Same: whether etcd serves the certificate of its file.
func (s etcdCertSerials) Same() bool { return s.Served != "" && s.Served == s.File }

func (s etcdCertSerials) String() string { return fmt.Sprintf("served %s, file %s", s.Served, s.File) }

// etcdServes: etcdCertSerials now.
func etcdServes() (etcdCertSerials, error) {
	pemBytes, err := os.ReadFile(kuPKI + "/etcd/server.crt")
	if err != nil {
		return etcdCertSerials{}, err
	}
	block, _ := pem.Decode(pemBytes)
	if block == nil {
		return etcdCertSerials{}, fmt.Errorf("%s/etcd/server.crt: no PEM block", kuPKI)
	}
	file, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return etcdCertSerials{}, err
	}
	s := etcdCertSerials{File: fmt.Sprintf("%x", file.SerialNumber)}
	config, err := etcdTLS()
	if err != nil {
		return s, err
	}
	d := &net.Dialer{Timeout: 5 * time.Second}
	conn, err := tls.DialWithDialer(d, "tcp", "127.0.0.1:2379", config)
	if err != nil {
		return s, err
	}
	defer conn.Close()
	s.Served = fmt.Sprintf("%x", conn.ConnectionState().PeerCertificates[0].SerialNumber)
	return s, nil
}

// copyIsKubeadms: whether the kubelet's copy of kubeadm's manifest name (kuSyncDir) is
// kubeadm's pod with only its metadata.uid added (no restart grace period or other mark of the
// agent's left), and if not, the difference in a line.
func copyIsKubeadms(name string) (bool, string) {
	read := func(path string) (map[string]any, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		var pod map[string]any
		return pod, yaml.Unmarshal(b, &pod)
	}
	kubeadm, err := read(filepath.Join(kuManifests, name))
	if err != nil {
		return false, err.Error()
	}
	copied, err := read(filepath.Join(kuSyncDir, name))
	if err != nil {
		return false, err.Error()
	}
	meta, _ := copied["metadata"].(map[string]any)
	uid, _ := meta["uid"].(string)
	delete(meta, "uid")
	if uid == "" {
		return false, "the copy has no uid"
	}
	if !reflect.DeepEqual(kubeadm, copied) {
		a, _ := json.Marshal(kubeadm)
		b, _ := json.Marshal(copied)
		return false, fmt.Sprintf("kubeadm's %s, the copy (uid aside) %s", report.Cut(string(a), 300), report.Cut(string(b), 300))
	}
	return true, "uid " + uid
}
