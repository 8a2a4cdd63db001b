package node

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/keyutil"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

// The kubelet's client certificate rotation, which the recovery agent must follow (it reads
// the kubeconfig and the certificate it names at every attempt). kubeadm's layout:
// /var/lib/kubelet/pki/kubelet-client-current.pem, named by kubelet.conf once kubeadm's
// kubelet-finalize phase ran.
const rotationPKI = "/var/lib/kubelet/pki"

var (
	rotationCurrent = filepath.Join(rotationPKI, "kubelet-client-current.pem")
	rotationShort   = filepath.Join(rotationPKI, "kubelet-client-short.pem")
)

// ShortClientCert is a node's client certificate (O=system:nodes, CN=system:node:NODE, client
// auth only) valid from notBefore to notAfter, signed by the CA, with a fresh P-256 key: the
// certificate and the key in PEM, as the kubelet keeps them in one file.
func ShortClientCert(ca *x509.Certificate, caKey crypto.Signer, node string, serial int64, notBefore, notAfter time.Time) ([]byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(serial),
		Subject:               pkix.Name{Organization: []string{"system:nodes"}, CommonName: "system:node:" + node},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	out := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	return append(out, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})...), nil
}

// certSerial is "serial=HEX" of a certificate, as openssl prints it.
func certSerial(c *x509.Certificate) string {
	return "serial=" + strings.ToUpper(hex.EncodeToString(c.SerialNumber.Bytes()))
}

// currentCert is the certificate kubelet-client-current.pem holds now.
func currentCert() (*x509.Certificate, error) {
	certs, err := certutil.CertsFromFile(rotationCurrent)
	if err != nil {
		return nil, err
	}
	return certs[0], nil
}

func rotationSerial() string {
	c, err := currentCert()
	if err != nil {
		return ""
	}
	return certSerial(c)
}

// shortClientCert: the node's client certificate replaced by one that expires
// ROTATION_LIFETIME s from now and started 10 minutes ago (so the kubelet's rotation deadline,
// at 70-90 % of its life, has passed), signed by the cluster CA, as kubelet-client-current.pem;
// kubeadm's kubelet-finalize points kubelet.conf at it; the kubelet restarts with it, its
// rotation still off. The agent, installed next, starts with this certificate.
func (r *reboot) shortClientCert() bool {
	lifetime := time.Duration(EnvKnobInt("ROTATION_LIFETIME", 0)) * time.Second
	now := time.Now()
	r.rotationExpires = now.Add(lifetime).Truncate(time.Second)
	err := func() error {
		cas, err := certutil.CertsFromFile("/etc/kubernetes/pki/ca.crt")
		if err != nil {
			return err
		}
		key, err := keyutil.PrivateKeyFromFile("/etc/kubernetes/pki/ca.key")
		if err != nil {
			return err
		}
		signer, ok := key.(crypto.Signer)
		if !ok {
			return errors.New("the CA key cannot sign")
		}
		pemData, err := ShortClientCert(cas[0], signer, r.NodeName, 0x1000, now.Add(-10*time.Minute), r.rotationExpires)
		if err != nil {
			return err
		}
		if err := os.MkdirAll(rotationPKI, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(rotationShort, pemData, 0o600); err != nil {
			return err
		}
		if err := os.Chmod(rotationShort, 0o600); err != nil {
			return err
		}
		if err := os.Remove(rotationCurrent); err != nil && !os.IsNotExist(err) {
			return err
		}
		return os.Symlink(rotationShort, rotationCurrent)
	}()
	if err != nil {
		r.Fail("could not make a short-lived node certificate: %v", err)
		return false
	}
	out, err := r.Run(120*time.Second, r.Bin("kubeadm"), "init", "phase", "kubelet-finalize", "enable-client-cert-rotation", "--config", r.Path("kubeadm.yaml"))
	appendFile(r.Path("kubeadm.log"), out+"\n")
	conf, _ := os.ReadFile("/etc/kubernetes/kubelet.conf")
	if err != nil || !strings.Contains(string(conf), "client-certificate: "+rotationCurrent) {
		r.Fail("kubeadm init phase kubelet-finalize enable-client-cert-rotation did not point kubelet.conf at %s: %s%s", rotationCurrent, lastLines(out, 3), errSuffix(err))
		return false
	}
	r.rotationFirst = rotationSerial()
	if r.Do("kubelet_stop") != nil || r.Do("kubelet_start", "KUBELET_CERT_DIR="+rotationPKI) != nil {
		return false
	}
	r.WaitNode()
	r.Pass("the node's client certificate is kubeadm's kubelet-client-current.pem (kubelet-finalize rewrote kubelet.conf), valid until %s (%d s), %s; the kubelet uses it",
		r.rotationExpires.UTC().Format(time.TimeOnly), int(lifetime.Seconds()), r.rotationFirst)
	return true
}

func appendFile(path, s string) {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	_, _ = f.WriteString(s)
}

// rotate: the kubelet's own rotation turned on (kubeadm's auto-approval of a node's renewal;
// the controller-manager signs): it rotates at once (the deadline has passed).
func (r *reboot) rotate() bool {
	_, _ = r.Kubectl(30*time.Second, "create", "clusterrolebinding", "kubeadm:node-autoapprove-certificate-rotation",
		"--clusterrole=system:certificates.k8s.io:certificatesigningrequests:selfnodeclient", "--group=system:nodes")
	if r.Do("kubelet_stop") != nil {
		return false
	}
	t0 := time.Now()
	if r.Do("kubelet_start", "KUBELET_ROTATE_CERTIFICATES=true") != nil {
		return false
	}
	rotated := func() bool { s := rotationSerial(); return s != "" && s != r.rotationFirst }
	if !r.WaitFor(180*time.Second, rotated) {
		var lines []string
		for _, l := range strings.Split(report.FileTail(r.Path("kubelet.log"), 2000), "\n") {
			if strings.Contains(strings.ToLower(l), "certificate") {
				lines = append(lines, report.Cut(l, 300))
			}
		}
		r.Fail("the kubelet did not rotate its client certificate within 180 s: %s", strings.Join(report.Last(lines, 3), " "))
		return false
	}
	target, _ := os.Readlink(rotationCurrent)
	until := "?"
	if c, err := currentCert(); err == nil {
		until = c.NotAfter.UTC().Format("Jan _2 15:04:05 2006") + " GMT"
	}
	r.Pass("the kubelet rotated its client certificate %s s after its restart: kubelet-client-current.pem -> %s, %s, valid until %s; the old one expires at %s",
		Since(t0), target, rotationSerial(), until, r.rotationExpires.UTC().Format(time.TimeOnly))
	// The restarted kubelet runs the static pods' probes again, and holds no status for them
	// until they answer: a mirror pod may still turn unready for a moment. The next step (the
	// migration) fails on a Ready flip of the controller-manager or the scheduler, so it starts
	// once the kubelet's own view has every static pod Ready and the mirror pods agree.
	settled := func() bool {
		kubelet, err := r.KubeletPods()
		if err != nil {
			return false
		}
		api, err := r.Client.CoreV1().Pods("kube-system").List(r.Ctx, metav1.ListOptions{})
		return err == nil && nodecheck.StaticReadyInKubelet(kubelet) && nodecheck.StaticSettled(kubelet, api)
	}
	t1 := time.Now()
	if !r.WaitFor(120*time.Second, settled) {
		var seen []string
		if kubelet, err := r.KubeletPods(); err == nil {
			for i := range kubelet.Items {
				p := &kubelet.Items[i]
				seen = append(seen, fmt.Sprintf("%s ready=%v", p.Name, nodecheck.Ready(p)))
			}
		}
		r.Fail("the static pods not Ready again in the restarted kubelet within 120 s: the kubelet's view: %s", strings.Join(seen, ", "))
		return false
	}
	r.Pass("every static pod Ready again in the restarted kubelet's own view and in its mirror pod, %s s after the rotation", Since(t1))
	return true
}

// rotationExpired: the certificate the agent started with has expired: the apiserver refuses
// it (401).
func (r *reboot) rotationExpired() {
	if wait := time.Until(r.rotationExpires.Add(2 * time.Second)); wait > 0 {
		r.Settle(wait)
	}
	cert, err := tls.LoadX509KeyPair(rotationShort, rotationShort)
	if err != nil {
		r.Fail("the first node certificate: %v", err)
		return
	}
	_, err = r.get("/api/v1/nodes/"+r.NodeName, 5*time.Second, &cert)
	var status *StatusError
	switch {
	case err == nil:
		r.Fail("the first node certificate is still accepted after its expiry")
	case errors.As(err, &status) && strings.HasPrefix(status.Status, "401"):
		r.Pass("the node certificate the agent started with has expired and is refused (%v); the next checkpoint can only be written with the rotated one", err)
	default:
		r.Fail("the first node certificate after its expiry: no answer of 401 but %v", err)
	}
}

// WaitNode: the kubelet registered the node, and kubeadm's apiserver's mirror pod is Ready
// (after a restart of the kubelet).
func (n *Scenario) WaitNode() {
	t0 := time.Now()
	var ready string
	registered := func() bool {
		node, err := n.Client.CoreV1().Nodes().Get(n.Ctx, n.NodeName, metav1.GetOptions{})
		if err == nil {
			ready = nodecheck.NodeReady(node)
		}
		return err == nil
	}
	if n.WaitFor(120*time.Second, registered) {
		n.Pass("kubelet registered node %s after %s s", n.NodeName, Since(t0))
		n.Note("node Ready condition: %s", ready)
	} else {
		n.Fail("node %s not registered within 120 s", n.NodeName)
		n.kubeletErrors(`^[EW][0-9]{4}`, 10)
	}
	n.mirrorPodReady("kube-system", "kube-apiserver-"+n.NodeName, 120*time.Second)
}

// MirrorReady: the pod kube-system/name exists in the apiserver and is Ready.
func (n *Scenario) MirrorReady(name string) bool { return n.mirrorReady("kube-system", name) }
