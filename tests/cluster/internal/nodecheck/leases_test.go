package nodecheck

import (
	"testing"
	"time"
)

func TestLeaderGap(t *testing.T) {
	t0 := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	same := []LeaseSample{{"a", at(0), at(2)}, {"a", at(0), at(4)}, {"a", at(0), at(6)}}
	if n, gap := LeaderGap(same); n != 0 || gap != 0 {
		t.Errorf("one holder: %d handovers, gap %s", n, gap)
	}
	// a renews until 6 s, releases; b acquires at 9.5 s; b renews; c takes over at 12 s.
	moved := []LeaseSample{{"a", at(0), at(6)}, {"", at(0), at(6)}, {"b", at(9.5), at(9.5)}, {"b", at(9.5), at(11)}, {"c", at(12), at(12)}}
	if n, gap := LeaderGap(moved); n != 2 || gap != 3500*time.Millisecond {
		t.Errorf("two handovers, the longest 3.5 s: %d, %s", n, gap)
	}
	// The same identity acquiring again (after an expiry) is a handover too.
	again := []LeaseSample{{"a", at(0), at(1)}, {"a", at(20), at(20)}}
	if n, gap := LeaderGap(again); n != 1 || gap != 19*time.Second {
		t.Errorf("a re-acquisition: %d, %s", n, gap)
	}
	if line, ok := LeaderLine("kube-scheduler", again, 15*time.Second); ok || line != "kube-scheduler: 1 handovers, the longest time without a leader 19.0 s (lease 15s)" {
		t.Errorf("19 s without a leader, lease 15 s: %q %t", line, ok)
	}
	if _, ok := LeaderLine("kube-scheduler", moved, 15*time.Second); !ok {
		t.Errorf("3.5 s without a leader is within a 15 s lease")
	}
}
