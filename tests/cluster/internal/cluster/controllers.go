package cluster

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
)

// Controller is another control-plane node beside n, on address ip (see AddAddress): its own
// pods/ and /run/kube-apiserver-proxy (backends/ and handoff/ are node-local: the proxies of
// two controllers never see each other), and n's PKI, kubeconfigs and etcd, as the
// controllers of a kubeadm HA cluster share the CA and the etcd cluster.
func (n *Node) Controller(name, ip string) (*Node, error) {
	dir := filepath.Join(n.Dir, "controllers", name)
	c := &Node{
		IP: ip, Dir: dir, PKI: n.PKI, Run: filepath.Join(dir, "run"),
		AdminConf: n.AdminConf, ProxyUID: n.ProxyUID,
	}
	// Traversable by the proxies' uid, as the node's own directory is.
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	for _, d := range []string{c.Run, filepath.Join(c.Run, "backends"), filepath.Join(c.Run, "handoff")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
		if err := os.Chown(d, n.ProxyUID, n.ProxyUID); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// AddAddress puts ip/32 (an IPv6 ip: ip/128, usable at once: no duplicate address detection)
// on the interface that carries the node address (a second controller's address, or the
// node's IPv6 address, in the runner's network namespace) and returns what removes it again.
func (n *Node) AddAddress(ctx context.Context, ip string) (remove func() error, err error) {
	dev, err := interfaceOf(n.IP)
	if err != nil {
		return nil, err
	}
	prefix, extra := ip+"/32", []string{}
	if net.ParseIP(ip).To4() == nil {
		prefix, extra = ip+"/128", []string{"nodad"}
	}
	if _, err := Run(ctx, 10*time.Second, append([]string{"ip", "addr", "add", prefix, "dev", dev}, extra...)...); err != nil {
		return nil, err
	}
	return func() error {
		_, err := Run(context.Background(), 10*time.Second, "ip", "addr", "del", prefix, "dev", dev)
		return err
	}, nil
}

func interfaceOf(ip string) (string, error) {
	ifaces, err := net.Interfaces()
	if err != nil {
		return "", err
	}
	for _, i := range ifaces {
		addrs, err := i.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.String() == ip {
				return i.Name, nil
			}
		}
	}
	return "", fmt.Errorf("no interface has the node address %s", ip)
}

// Kubeconfig writes to dst a copy of the kubeconfig src whose clusters point at server and
// verify the apiserver under the name `kubernetes` (kubeadm's serving certificate has the
// first controller's address only; every apiserver's certificate names `kubernetes`).
func Kubeconfig(src, dst, server string) error {
	cfg, err := clientcmd.LoadFromFile(src)
	if err != nil {
		return err
	}
	for _, c := range cfg.Clusters {
		c.Server = server
		c.TLSServerName = "kubernetes"
	}
	return clientcmd.WriteToFile(*cfg, dst)
}
