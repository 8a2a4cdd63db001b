package scenario

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/cluster"
)

// nodeIPv6 is the node's IPv6 address in this scenario (documentation prefix, like 192.0.2.10;
// only ever on the runner's own veth, in its own network namespace).
const nodeIPv6 = "2001:db8::10"

// ipv6Node: the node gets an IPv6 address beside its IPv4 one, and the pods are given what the
// kubelet gives a pod on an IPv6-first dual-stack node: status.hostIP = the IPv6 address,
// status.hostIPs = both. The shipped manifest's proxy then serves port 6443 on both addresses
// (`--listen-host=$(HOST_IPS)`) and the node's scrape address on `[$(HOST_IP)]:9444`;
// `$(HOST_IP):6443` would have been no address at all (the proxy exits 2). The apiserver keeps
// advertising the IPv4 address (the cluster's Service network is IPv4 here). One rollout onto
// such a pod, then --rollouts more under the client-go load sent to https://[2001:db8::10]:6443
// (strict: nothing may fail), each handing over the IPv6 listening socket (its SO_COOKIE stays
// from the first dual-stack pod to the last) while the IPv4 address keeps answering. Then back
// to the single-stack pod, and the address goes.
func ipv6Node(ctx context.Context, e *env, r *Result) {
	r.Design, r.Gate = cluster.Sidecar, cluster.GatePod
	remove, err := e.node.AddAddress(ctx, nodeIPv6)
	if err != nil {
		r.Fail("add %s to the node: %v", nodeIPv6, err)
		return
	}
	defer func() {
		if err := remove(); err != nil {
			r.Fail("remove %s: %v", nodeIPv6, err)
		}
	}()
	dualStack := func() (*cluster.Pod, error) {
		e.seq++
		return cluster.StartPod(ctx, e.node, e.tmpl, cluster.PodOptions{
			Name:      fmt.Sprintf("pod-%02d", e.seq),
			Design:    cluster.Sidecar,
			APIServer: e.o.APIServer,
			Proxy:     e.o.Proxy,
			HostIP:    nodeIPv6,
			HostIPs:   nodeIPv6 + "," + e.o.NodeIP,
			// The manifest's --advertise-address=$(HOST_IP) would be the IPv6 address; the
			// Service network and the endpoints of this cluster are IPv4.
			ExtraAPIServerArgs: append(append([]string{}, e.o.APIServerArgs...), "--advertise-address="+e.o.NodeIP),
		})
	}
	v6 := net.JoinHostPort(nodeIPv6, "6443")
	v4 := net.JoinHostPort(e.o.NodeIP, "6443")
	if !step(ctx, r, "onto the dual-stack pod: ", cluster.GatePod, &e.current, dualStack) {
		return
	}
	first, err := listenerCookies(e.current)
	if err != nil {
		r.Fail("%v", err)
		return
	}
	if len(first[v6]) == 0 || len(first[v4]) == 0 {
		r.Fail("pod %s serves %v, want %s and %s", e.current.Opts.Name, first, v6, v4)
		return
	}
	kubeconfig := filepath.Join(e.node.Dir, "admin-ipv6.conf")
	if err := cluster.Kubeconfig(e.node.AdminConf, kubeconfig, "https://"+v6); err != nil {
		r.Fail("%v", err)
		return
	}
	client, err := e.node.APIServerClient("", "")
	if err != nil {
		r.Fail("%v", err)
		return
	}
	underLoadOn(ctx, kubeconfig, r, true, func() {
		for i := 0; i < e.o.Rollouts && ctx.Err() == nil; i++ {
			if !step(ctx, r, "", cluster.GatePod, &e.current, dualStack) {
				return
			}
			now, err := listenerCookies(e.current)
			if err != nil {
				r.Fail("%v", err)
			} else if !slices.Equal(now[v6], first[v6]) || !slices.Equal(now[v4], first[v4]) {
				r.Fail("after rollout %d pod %s holds %v, want the first dual-stack pod's %v", i+1, e.current.Opts.Name, now, first)
			}
			// Both families answer, and the node's scrape address is on the IPv6 address.
			for _, addr := range []string{v6, v4} {
				if code, err := get(client, "https://"+addr+"/readyz"); err != nil || code != http.StatusOK {
					r.Fail("after rollout %d: GET https://%s/readyz: %d %v", i+1, addr, code, err)
				}
			}
			scrape := "http://" + net.JoinHostPort(nodeIPv6, "9444") + "/metrics"
			body, err := getBody(scrape)
			if err != nil {
				r.Fail("after rollout %d: %s: %v", i+1, scrape, err)
			} else if !strings.Contains(body, `pod="`+e.current.Opts.Name+`"`) {
				r.Fail("after rollout %d: %s does not cover pod %s", i+1, scrape, e.current.Opts.Name)
			}
		}
	})
	r.Note("IPv6 listening sockets %v and IPv4 %v kept across the rollouts", first[v6], first[v4])
	// Back to the pod every other scenario expects (IPv4 only), outside the load on the IPv6
	// address: that pod does not take the IPv6 socket.
	step(ctx, r, "back to the single-stack pod: ", cluster.GatePod, &e.current, func() (*cluster.Pod, error) {
		return e.startPod(ctx, cluster.Sidecar, e.o.APIServer, nil, nil)
	})
}

// listenerCookies maps each listening address of the pod's proxy to the SO_COOKIEs of its
// sockets (one per worker thread), sorted.
func listenerCookies(p *cluster.Pod) (map[string][]uint64, error) {
	b, err := os.ReadFile(filepath.Join(p.Shared, "admin"))
	if err != nil {
		return nil, err
	}
	body, err := getBody("http://" + strings.TrimSpace(string(b)) + "/status")
	if err != nil {
		return nil, err
	}
	var status struct {
		Listeners []struct {
			Address string `json:"address"`
			Cookie  uint64 `json:"cookie"`
		} `json:"listeners"`
	}
	if err := json.Unmarshal([]byte(body), &status); err != nil {
		return nil, fmt.Errorf("%s /status: %w", p.Opts.Name, err)
	}
	out := map[string][]uint64{}
	for _, l := range status.Listeners {
		out[l.Address] = append(out[l.Address], l.Cookie)
	}
	for _, cookies := range out {
		slices.Sort(cookies)
	}
	return out, nil
}

func get(client *http.Client, url string) (int, error) {
	resp, err := client.Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

func getBody(url string) (string, error) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	return string(b), nil
}
