// Package procfs reads processes from a /proc tree (a fake one in tests): their numbers and
// names. A process's task directory has the same layout, so the same functions read its
// threads.
package procfs

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
)

// Pids lists the processes under proc (its numeric entries), in numeric order.
func Pids(proc string) ([]int, error) {
	entries, err := os.ReadDir(proc)
	if err != nil {
		return nil, err
	}
	var ps []int
	for _, e := range entries {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			ps = append(ps, n)
		}
	}
	sort.Ints(ps)
	return ps, nil
}

// Comm is the name of process pid under proc; an error once it has exited.
func Comm(proc string, pid int) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("%s/%d/comm", proc, pid))
	return strings.TrimRight(string(b), "\n"), err
}
