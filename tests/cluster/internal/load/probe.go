package load

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"
)

// ProbeCount is what a connect prober saw on one address: every attempt is a TCP connect,
// closed at once. A refused connect, a connect that times out and any other error are each
// a failure (a dropped SYN shows as a timeout).
type ProbeCount struct {
	Address  string           `json:"address"`
	Attempts int64            `json:"attempts"`
	OK       int64            `json:"ok"`
	Refused  int64            `json:"refused"`
	Timeouts int64            `json:"timeouts"`
	Other    map[string]int64 `json:"other"`
	// RefusedWindows: the stretches of consecutive refusals (from, for how long).
	RefusedWindows []ProbeWindow `json:"refused_windows,omitempty"`
}

// ProbeWindow is a stretch of consecutive refusals.
type ProbeWindow struct {
	From     time.Time     `json:"from"`
	Duration time.Duration `json:"duration_ns"`
}

// Failed is the number of attempts that did not connect.
func (c *ProbeCount) Failed() int64 { return c.Refused + c.Timeouts + sum(c.Other, count) }

// String: "ADDR: N refused, N timeouts, N other errors of N connects (refused for …)".
func (c *ProbeCount) String() string {
	s := fmt.Sprintf("%s: %d refused, %d timeouts, %d other errors %v of %d connects", c.Address, c.Refused, c.Timeouts, sum(c.Other, count), c.Other, c.Attempts)
	for i, w := range c.RefusedWindows {
		if i == 0 {
			s += " (refused for"
		}
		s += fmt.Sprintf(" %s", w.Duration.Round(time.Millisecond))
		if i == len(c.RefusedWindows)-1 {
			s += ")"
		}
	}
	return s
}

// Prober connects to each of its addresses in turn, every Period, until stopped.
type Prober struct {
	Period, Timeout time.Duration
	counts          []*ProbeCount
	mu              sync.Mutex
	cancel          context.CancelFunc
	done            chan struct{}
}

// StartProber starts connecting to addrs (host:port), each every 20 ms, with a 1 s timeout.
func StartProber(parent context.Context, addrs []string) *Prober {
	ctx, cancel := context.WithCancel(parent)
	p := &Prober{Period: 20 * time.Millisecond, Timeout: time.Second, cancel: cancel, done: make(chan struct{})}
	for _, a := range addrs {
		p.counts = append(p.counts, &ProbeCount{Address: a, Other: map[string]int64{}})
	}
	go p.run(ctx)
	return p
}

func (p *Prober) run(ctx context.Context) {
	defer close(p.done)
	refusedSince := make([]time.Time, len(p.counts))
	for ctx.Err() == nil {
		began := time.Now()
		for i, c := range p.counts {
			t := time.Now()
			conn, err := (&net.Dialer{Timeout: p.Timeout}).DialContext(ctx, "tcp", c.Address)
			if ctx.Err() != nil {
				break
			}
			p.mu.Lock()
			c.Attempts++
			kind := ProbeOutcome(err)
			switch kind {
			case "ok":
				conn.Close()
				c.OK++
			case "refused":
				c.Refused++
			case "timeout":
				c.Timeouts++
			default:
				c.Other[kind]++
			}
			if kind == "refused" && refusedSince[i].IsZero() {
				refusedSince[i] = t
			} else if kind != "refused" && !refusedSince[i].IsZero() {
				c.RefusedWindows = append(c.RefusedWindows, ProbeWindow{From: refusedSince[i], Duration: t.Sub(refusedSince[i])})
				refusedSince[i] = time.Time{}
			}
			p.mu.Unlock()
		}
		select {
		case <-ctx.Done():
		case <-time.After(p.Period - time.Since(began)):
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, c := range p.counts {
		if !refusedSince[i].IsZero() {
			c.RefusedWindows = append(c.RefusedWindows, ProbeWindow{From: refusedSince[i], Duration: time.Since(refusedSince[i])})
		}
	}
}

// ProbeOutcome names the result of one connect: "ok", "refused", "timeout" or another kind
// (Classify). Pure.
func ProbeOutcome(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	}
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() {
		return "timeout"
	}
	return Classify(err)
}

// Stop ends the prober and returns what it saw per address.
func (p *Prober) Stop() []ProbeCount {
	p.cancel()
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]ProbeCount, len(p.counts))
	for i, c := range p.counts {
		out[i] = *c
	}
	return out
}
