package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/await"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// Node is the control-plane node of a rehearsal: its address, its directories laid out as
// kubeadm lays out /etc/kubernetes, and its etcd.
type Node struct {
	// IP is the node address (a veth interface in the runner's network namespace).
	IP string
	// Dir holds everything: pki/, kubeconfigs, etcd data, pods/, run/.
	Dir string
	// PKI is kubeadm's certificate directory (/etc/kubernetes/pki on a real node).
	PKI string
	// Run is the node's /run/kube-apiserver-proxy (backends/ and handoff/ inside).
	Run string
	// AdminConf is kubeadm's admin.conf (server https://IP:6443).
	AdminConf string
	// ProxyUID is the uid every proxy instance runs as (the manifests' runAsUser).
	ProxyUID int
	// Leaks, when set, samples the proxy of every pod started on the node (leaks.go).
	Leaks *LeakWatch
	etcd  *Proc
}

// NewNode lays out dir and creates the PKI and kubeconfigs with `kubeadm init phase certs
// all` and `kubeadm init phase kubeconfig all`: exactly the files a kubeadm cluster has.
func NewNode(ctx context.Context, kubeadm, dir, ip, version string, proxyUID int) (*Node, error) {
	n := &Node{
		IP: ip, Dir: dir, PKI: filepath.Join(dir, "pki"), Run: filepath.Join(dir, "run"),
		AdminConf: filepath.Join(dir, "admin.conf"), ProxyUID: proxyUID,
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	config := fmt.Sprintf(`apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint:
  advertiseAddress: %[1]s
  bindPort: 6443
nodeRegistration:
  name: controller
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: %[2]s
certificatesDir: %[3]s
controlPlaneEndpoint: %[1]s:6443
`, ip, version, n.PKI)
	cfgPath := filepath.Join(dir, "kubeadm.yaml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		return nil, err
	}
	for _, phase := range [][]string{{"certs", "all"}, {"kubeconfig", "all", "--kubeconfig-dir", dir}} {
		argv := append([]string{kubeadm, "init", "phase"}, phase...)
		argv = append(argv, "--config", cfgPath)
		if _, err := Run(ctx, time.Minute, argv...); err != nil {
			return nil, err
		}
	}
	// The node's tmpfiles.d (manifests/node): /run/kube-apiserver-proxy/{backends,handoff},
	// 0700, owned by the proxies' uid.
	for _, d := range []string{n.Run, filepath.Join(n.Run, "backends"), filepath.Join(n.Run, "handoff")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
		if err := os.Chown(d, proxyUID, proxyUID); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// StartEtcd runs a single-member etcd with kubeadm's etcd certificates on 127.0.0.1:2379, as
// kubeadm's etcd static pod does.
func (n *Node) StartEtcd(ctx context.Context, etcd string) error {
	pki := filepath.Join(n.PKI, "etcd")
	p, err := Start("etcd", filepath.Join(n.Dir, "logs", "etcd.log"), -1, etcd,
		"--name=controller",
		"--data-dir="+filepath.Join(n.Dir, "etcd"),
		"--listen-client-urls=https://127.0.0.1:2379",
		"--advertise-client-urls=https://127.0.0.1:2379",
		"--listen-peer-urls=http://127.0.0.1:2380",
		"--initial-advertise-peer-urls=http://127.0.0.1:2380",
		"--initial-cluster=controller=http://127.0.0.1:2380",
		"--listen-metrics-urls=http://127.0.0.1:2381",
		"--cert-file="+filepath.Join(pki, "server.crt"),
		"--key-file="+filepath.Join(pki, "server.key"),
		"--trusted-ca-file="+filepath.Join(pki, "ca.crt"),
		"--client-cert-auth=true",
		"--snapshot-count=10000",
	)
	if err != nil {
		return err
	}
	n.etcd = p
	healthy := await.Seen("etcd healthy", func() (bool, string) {
		resp, err := http.Get("http://127.0.0.1:2381/health")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return resp.StatusCode == 200, "GET /health: " + resp.Status
	})
	if err := await.Until(ctx, 200*time.Millisecond, 60*time.Second, healthy); err != nil {
		return fmt.Errorf("%w: %s", err, report.FileTail(p.Log, 10))
	}
	return nil
}

// Stop ends etcd.
func (n *Node) Stop() {
	if n.etcd != nil {
		n.etcd.Signal(15)
		if !n.etcd.Wait(10 * time.Second) {
			n.etcd.Kill()
		}
	}
}

// APIServerClient is an HTTPS client that trusts the cluster CA and presents the given
// client certificate (empty: anonymous).
func (n *Node) APIServerClient(cert, key string) (*http.Client, error) {
	caPEM, err := os.ReadFile(filepath.Join(n.PKI, "ca.crt"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	cfg := &tls.Config{RootCAs: pool, ServerName: "kubernetes"}
	if cert != "" {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			return nil, err
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg}}, nil
}

// ProxyReadableCopy copies kubeadm's certificate and key NAME.crt/NAME.key to a directory
// the proxies' uid can read (as a Secret volume would give it) and returns their paths.
func (n *Node) ProxyReadableCopy(name string) (cert, key string, err error) {
	dir := filepath.Join(n.Dir, "proxy-secrets")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", "", err
	}
	if err := os.Chown(dir, n.ProxyUID, n.ProxyUID); err != nil {
		return "", "", err
	}
	var paths []string
	for _, ext := range []string{".crt", ".key"} {
		raw, err := os.ReadFile(filepath.Join(n.PKI, name+ext))
		if err != nil {
			return "", "", err
		}
		dst := filepath.Join(dir, name+ext)
		if err := os.WriteFile(dst, raw, 0o600); err != nil {
			return "", "", err
		}
		if err := os.Chown(dst, n.ProxyUID, n.ProxyUID); err != nil {
			return "", "", err
		}
		paths = append(paths, dst)
	}
	return paths[0], paths[1], nil
}
