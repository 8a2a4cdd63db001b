package load

import (
	"fmt"
	"sort"
	"strconv"
	"sync"
	"time"
)

// DeliveryBound is how long a watch may take to deliver the event of an object the writers
// wrote, from the moment the write was answered. Watches deliver in resourceVersion order, so
// a watch that delivered an event or a bookmark at or past a write's resourceVersion has
// delivered that write. Measured here: an event arrives within 150 ms, except at a rollout:
// the draining apiserver ends its watches, the watch sent again on the same connection is
// answered 429 with Retry-After (--shutdown-send-retry-after), and client-go resumes it 5 s
// later, on the new apiserver (5.0-5.3 s, every watch at once, in each rollout). 10 s is
// that with room, and far below what hides a hung watch otherwise: client-go's HTTP/2
// health check declares a silent connection lost after 30 s + 15 s, and a watch on HTTP/1.1
// is never declared lost.
const DeliveryBound = 10 * time.Second

// DeliveryCount is what one watch delivered of the writers' writes.
type DeliveryCount struct {
	// Writes: the writes (create, update) answered while the watch was part of the run.
	Writes int64 `json:"writes"`
	// Late: writes whose event came later than the bound after the write was answered, or
	// not before the load stopped.
	Late int64 `json:"late"`
	// Missing: writes still not delivered when the load stopped (a hung watch), counted in
	// Late too.
	Missing int64 `json:"missing_at_stop"`
	// P99LagMS and MaxLagMS: the wait of the writes for their event (delivered or, for the
	// missing ones, until the stop), milliseconds.
	P99LagMS float64 `json:"p99_lag_ms"`
	MaxLagMS float64 `json:"max_lag_ms"`
	lags     []time.Duration
}

// write is one answered write: its resourceVersion and when its answer came.
type write struct {
	rv uint64
	at time.Time
}

// deliveries follows every watch of the load against every write of its writers. A watch
// that stops delivering (its connection hangs: no byte, no end) shows here as writes whose
// events do not come, whatever the watch itself believes.
type deliveries struct {
	mu       sync.Mutex
	bound    time.Duration
	watchers map[string]*deliveryWatcher
	last     uint64 // the highest resourceVersion written
}

type deliveryWatcher struct {
	count   DeliveryCount
	seen    uint64    // the highest resourceVersion delivered
	seenAt  time.Time // when the mark last moved
	pending []write   // writes not delivered yet
	// poll reads the watch's progress where it is not reported event by event (an
	// informer's last synced resourceVersion); nil otherwise.
	poll func() string
}

func newDeliveries(bound time.Duration) *deliveries {
	return &deliveries{bound: bound, watchers: map[string]*deliveryWatcher{}}
}

// watcher adds a watch, following the writes answered from now on (poll may be nil).
func (d *deliveries) watcher(name string, poll func() string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.watchers[name] = &deliveryWatcher{poll: poll}
}

// wrote records an answered write (rv: the written object's resourceVersion).
func (d *deliveries) wrote(rv string, at time.Time) {
	n, err := strconv.ParseUint(rv, 10, 64)
	if err != nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.last = max(d.last, n)
	for _, w := range d.watchers {
		w.count.Writes++
		if n <= w.seen {
			// Delivered before the writer had its answer.
			w.count.lags = append(w.count.lags, 0)
			continue
		}
		w.pending = append(w.pending, write{rv: n, at: at})
	}
}

// saw records that watch name delivered resourceVersion rv at time at (an event, a bookmark,
// or the list a watch resumed from).
func (d *deliveries) saw(name, rv string, at time.Time) {
	n, err := strconv.ParseUint(rv, 10, 64)
	if err != nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if w := d.watchers[name]; w != nil {
		w.advance(n, at, d.bound)
	}
}

// advance moves the delivered mark to rv: every pending write at or below it was delivered at
// time at.
func (w *deliveryWatcher) advance(rv uint64, at time.Time, bound time.Duration) {
	if rv <= w.seen {
		return
	}
	w.seen, w.seenAt = rv, at
	kept := w.pending[:0]
	for _, wr := range w.pending {
		if wr.rv > rv {
			kept = append(kept, wr)
			continue
		}
		lag := at.Sub(wr.at)
		w.count.lags = append(w.count.lags, lag)
		if lag > bound {
			w.count.Late++
		}
	}
	w.pending = kept
}

// poll reads the progress of the watches that are polled.
func (d *deliveries) pollAll(now time.Time) {
	d.mu.Lock()
	polls := map[string]func() string{}
	for name, w := range d.watchers {
		if w.poll != nil {
			polls[name] = w.poll
		}
	}
	d.mu.Unlock()
	for name, poll := range polls {
		d.saw(name, poll(), now)
	}
}

// deliveredSince says whether every watch delivered something after t.
func (d *deliveries) deliveredSince(t time.Time) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, w := range d.watchers {
		if !w.seenAt.After(t) {
			return false
		}
	}
	return true
}

// caughtUp says whether every watch has delivered every write answered so far.
func (d *deliveries) caughtUp() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, w := range d.watchers {
		if len(w.pending) > 0 {
			return false
		}
	}
	return true
}

// finish counts what is still pending at now as missing (and late), and returns the counts.
func (d *deliveries) finish(now time.Time) map[string]*DeliveryCount {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]*DeliveryCount{}
	for name, w := range d.watchers {
		c := w.count
		for _, wr := range w.pending {
			c.Missing++
			c.Late++
			c.lags = append(c.lags, now.Sub(wr.at))
		}
		if len(c.lags) > 0 {
			p := percentiles(c.lags)
			c.P99LagMS, c.MaxLagMS = p.P99, p.Max
		}
		c.lags = nil
		out[name] = &c
	}
	return out
}

// DeliveryProblems lists the watches that delivered a write late or never, and those that
// followed no write at all (nothing was proven of them). Pure.
func DeliveryProblems(counts map[string]*DeliveryCount, bound time.Duration) []string {
	names := make([]string, 0, len(counts))
	for name := range counts {
		names = append(names, name)
	}
	sort.Strings(names)
	var p []string
	for _, name := range names {
		c := counts[name]
		switch {
		case c.Writes == 0:
			p = append(p, fmt.Sprintf("watch %s followed no write: its delivery was never checked", name))
		case c.Missing > 0:
			p = append(p, fmt.Sprintf("watch %s hung: %d of %d writes never delivered (the oldest waited %.0f ms when the load stopped; bound %s)", name, c.Missing, c.Writes, c.MaxLagMS, bound))
		case c.Late > 0:
			p = append(p, fmt.Sprintf("watch %s delivered %d of %d writes later than %s (slowest %.0f ms)", name, c.Late, c.Writes, bound, c.MaxLagMS))
		}
	}
	return p
}
