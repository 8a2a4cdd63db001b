package nodecheck

import (
	"fmt"
	"time"
)

// LeaseSample is what one read of a leader-election Lease showed: its holder and the times it
// names (acquired, last renewed).
type LeaseSample struct {
	Holder         string
	Acquire, Renew time.Time
}

// LeaderGap is, from the reads of one Lease in time order, how often leadership passed to
// another holder (a restarted controller has a new identity) and the longest time without a
// leader: from the last renewal of one holder to the acquisition by the next.
func LeaderGap(samples []LeaseSample) (handovers int, longest time.Duration) {
	var last *LeaseSample
	for i := range samples {
		s := samples[i]
		if s.Holder == "" {
			continue // released: the next holder's acquisition ends the gap
		}
		if last != nil && (s.Holder != last.Holder || s.Acquire.After(last.Acquire)) {
			handovers++
			if gap := s.Acquire.Sub(last.Renew); gap > longest {
				longest = gap
			}
		}
		last = &samples[i]
	}
	return handovers, longest
}

// LeaderLine says LeaderGap of a Lease in a line, and whether the longest time without a
// leader stayed within the lease's duration (the time a stopped leader's successor waits when
// nothing releases the lease).
func LeaderLine(name string, samples []LeaseSample, duration time.Duration) (string, bool) {
	n, gap := LeaderGap(samples)
	if n == 0 {
		return fmt.Sprintf("%s: one leader throughout", name), true
	}
	return fmt.Sprintf("%s: %d handovers, the longest time without a leader %.1f s (lease %s)", name, n, gap.Seconds(), duration), gap <= duration
}
