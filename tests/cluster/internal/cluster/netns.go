package cluster

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"time"
)

// ClientNet is a network namespace of its own for clients off the node: joined to the node's
// namespace by a veth pair, the client's address on its end, its default route through the
// node's end. The node's namespace routes the client's address back over the pair, so a
// process run in it ([ClientNet.Command]) reaches the node address as a remote client would.
type ClientNet struct {
	Name string
	IP   net.IP
}

// NewClientNet creates namespace name (`ip netns add`, inside the rehearsal's private mount
// namespace) with the veth pair name-n (here, nodeIP/30) and name-c (there, clientIP/30).
func NewClientNet(ctx context.Context, name, nodeIP, clientIP string) (*ClientNet, error) {
	// A run that died leaves the namespace's file under /run/netns (the directory is the
	// host's; only the mounts are the rehearsal's): remove it first.
	_, _ = Run(ctx, 10*time.Second, "ip", "netns", "del", name)
	script := [][]string{
		{"ip", "netns", "add", name},
		{"ip", "link", "add", name + "-n", "type", "veth", "peer", "name", name + "-c", "netns", name},
		{"ip", "addr", "add", nodeIP + "/30", "dev", name + "-n"},
		{"ip", "link", "set", name + "-n", "up"},
		{"ip", "-n", name, "link", "set", "lo", "up"},
		{"ip", "-n", name, "addr", "add", clientIP + "/30", "dev", name + "-c"},
		{"ip", "-n", name, "link", "set", name + "-c", "up"},
		{"ip", "-n", name, "route", "add", "default", "via", nodeIP},
	}
	for _, argv := range script {
		if _, err := Run(ctx, 10*time.Second, argv...); err != nil {
			_, _ = Run(ctx, 10*time.Second, "ip", "netns", "del", name)
			return nil, fmt.Errorf("client namespace %s: %w", name, err)
		}
	}
	return &ClientNet{Name: name, IP: net.ParseIP(clientIP)}, nil
}

// Command is argv run in the namespace (`ip netns exec`: the process's own pid, so a signal
// to it reaches the command).
func (c *ClientNet) Command(argv ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", c.Name}, argv...)...)
}

// Delete removes the namespace (its end of the pair goes with it, and so does ours).
func (c *ClientNet) Delete() {
	_, _ = Run(context.Background(), 10*time.Second, "ip", "netns", "del", c.Name)
}
