//go:build tools

// Package tools pins the runc command this module builds.
package tools

import (
	_ "github.com/opencontainers/runc"
)
