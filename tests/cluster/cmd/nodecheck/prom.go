package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
)

// promConfig writes STATE/prometheus.yaml, STATE/rules.yaml and STATE/sd-selector.json from
// the rendered manifests/monitoring.
func promConfig(manifests, state string) error {
	f, err := os.Open(manifests)
	if err != nil {
		return err
	}
	defer f.Close()
	files, err := nodecheck.PromConfig(f, state)
	if err != nil {
		return fmt.Errorf("%s: %w", manifests, err)
	}
	for name, b := range map[string][]byte{"prometheus.yaml": files.Config, "rules.yaml": files.Rules, "sd-selector.json": files.Selector} {
		if err := os.WriteFile(filepath.Join(state, name), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// promSD writes STATE/sd.json (atomically) every 2 s until SIGTERM: the pods that
// STATE/sd-selector.json selects in kube-system, as Kubernetes pod discovery would give them,
// read from the apiserver on NODE_IP:6443 as the super-admin (STATE's certificate). A failed
// round leaves the file as it was.
func promSD(nodeIP, state string) error {
	b, err := os.ReadFile(filepath.Join(state, "sd-selector.json"))
	if err != nil {
		return err
	}
	var set map[string]string
	if err := json.Unmarshal(b, &set); err != nil {
		return fmt.Errorf("sd-selector.json: %w", err)
	}
	client, err := kubernetes.NewForConfig(&rest.Config{
		Host: "https://" + net.JoinHostPort(nodeIP, "6443"),
		TLSClientConfig: rest.TLSClientConfig{
			CAFile:   "/etc/kubernetes/pki/ca.crt",
			CertFile: filepath.Join(state, "admin-client-certificate-data"),
			KeyFile:  filepath.Join(state, "admin-client-key-data"),
		},
		Timeout: 5 * time.Second,
	})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	selector := labels.SelectorFromSet(set).String()
	out := filepath.Join(state, "sd.json")
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		pods, err := client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return
		}
		b, err := json.Marshal(nodecheck.PodTargets(pods.Items))
		if err != nil || os.WriteFile(out+".tmp", b, 0o644) != nil {
			return
		}
		_ = os.Rename(out+".tmp", out)
	}, 2*time.Second)
	return nil
}
