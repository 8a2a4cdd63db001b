package cluster

import (
	"bufio"
	"os"
	"strconv"
	"strings"
)

// TCPCounters are the network namespace's TCP counters that say a connection was reset or
// dropped: every process of the rehearsal (clients, proxies, apiservers) lives in the
// namespace, so a reset anywhere shows here.
type TCPCounters map[string]int64

// tcpCounterNames: Tcp OutRsts (resets sent) and the TcpExt reasons behind them.
var tcpCounterNames = []string{
	"Tcp:OutRsts", "Tcp:AttemptFails", "Tcp:EstabResets",
	"TcpExt:TCPAbortOnClose", "TcpExt:TCPAbortOnData", "TcpExt:TCPAbortOnTimeout",
	"TcpExt:TCPAbortOnLinger", "TcpExt:TCPAbortFailed", "TcpExt:ListenOverflows", "TcpExt:ListenDrops",
}

// ReadTCPCounters reads /proc/net/snmp and /proc/net/netstat of this namespace.
func ReadTCPCounters() TCPCounters {
	c := TCPCounters{}
	for _, file := range []string{"/proc/net/snmp", "/proc/net/netstat"} {
		f, err := os.Open(file)
		if err != nil {
			continue
		}
		s := bufio.NewScanner(f)
		var header []string
		for s.Scan() {
			fields := strings.Fields(s.Text())
			if len(fields) < 2 {
				continue
			}
			if header == nil || header[0] != fields[0] {
				header = fields
				continue
			}
			for i := 1; i < len(fields) && i < len(header); i++ {
				if v, err := strconv.ParseInt(fields[i], 10, 64); err == nil {
					c[header[0]+header[i]] = v
				}
			}
			header = nil
		}
		f.Close()
	}
	out := TCPCounters{}
	for _, n := range tcpCounterNames {
		out[n] = c[n]
	}
	return out
}

// Since is c minus an earlier reading.
func (c TCPCounters) Since(before TCPCounters) TCPCounters {
	d := TCPCounters{}
	for k, v := range c {
		d[k] = v - before[k]
	}
	return d
}
