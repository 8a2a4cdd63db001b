//go:build tools

// Package tools pins the CNI plugins this module builds: the node's pod network is
// macvlan with host-local addresses, plus loopback.
package tools

import (
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
	_ "github.com/containernetworking/plugins/plugins/main/macvlan"
)
