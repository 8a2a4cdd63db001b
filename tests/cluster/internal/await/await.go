// Package await is the tier's one way to wait: a condition with a name is checked at once and
// then at an interval until it holds, the timeout passes or the context ends; a wait that ends
// without it says what it waited for, for how long, and what the condition saw last.
//
//	err := await.Until(ctx, 200*time.Millisecond, time.Minute, await.Seen("etcd healthy", func() (bool, string) {
//		…
//		return resp.StatusCode == 200, resp.Status
//	}))
//	// err: "etcd healthy: not within 1m0s (last seen: 503 Service Unavailable)"
//
// A condition that cannot hold any more (a container exited) ends the wait at once with its
// error. Holds is the same wait for a caller that says itself what failed.
package await

import (
	"context"
	"fmt"
	"time"
)

// Condition is what a wait waits for.
type Condition struct {
	// Name says what holds when the wait succeeds: "etcd healthy", "pod pod-03 pod-ready".
	Name string
	// Check looks once: whether the condition holds, and what it saw (said when the wait ends
	// without it; "" says nothing). An error means the condition can no longer hold: the wait
	// ends at once and returns it.
	Check func() (holds bool, seen string, err error)
}

// Named is a condition that sees nothing but whether it holds.
func Named(name string, holds func() bool) Condition {
	return Condition{Name: name, Check: func() (bool, string, error) { return holds(), "", nil }}
}

// Seen is a condition that says what it saw on each check.
func Seen(name string, check func() (holds bool, seen string)) Condition {
	return Condition{Name: name, Check: func() (bool, string, error) {
		ok, seen := check()
		return ok, seen, nil
	}}
}

// NotMet is a wait that ended without its condition: the timeout passed or, with Cause set,
// the context ended first.
type NotMet struct {
	Condition string
	// Waited is how long the wait lasted; Timeout what it was given.
	Waited, Timeout time.Duration
	// Last is what the condition saw on its last check ("" when it says nothing).
	Last string
	// Cause is the context's error when the wait was interrupted, nil on a timeout.
	Cause error
}

func (e *NotMet) Error() string {
	msg := fmt.Sprintf("%s: not within %s", e.Condition, e.Timeout)
	if e.Cause != nil {
		msg = fmt.Sprintf("%s: interrupted after %s: %v", e.Condition, e.Waited.Round(time.Millisecond), e.Cause)
	}
	if e.Last != "" {
		msg += " (last seen: " + e.Last + ")"
	}
	return msg
}

// Unwrap is the context's error of an interrupted wait.
func (e *NotMet) Unwrap() error { return e.Cause }

// Until checks c at once and then every interval until it holds (nil), it fails for good (its
// error), timeout passes or ctx ends (*NotMet). The check at the deadline is the last.
func Until(ctx context.Context, interval, timeout time.Duration, c Condition) error {
	began := time.Now()
	deadline := began.Add(timeout)
	for {
		holds, seen, err := c.Check()
		switch {
		case err != nil:
			return err
		case holds:
			return nil
		case ctx.Err() != nil:
			return &NotMet{Condition: c.Name, Waited: time.Since(began), Timeout: timeout, Last: seen, Cause: ctx.Err()}
		}
		left := time.Until(deadline)
		if left <= 0 {
			return &NotMet{Condition: c.Name, Waited: time.Since(began), Timeout: timeout, Last: seen}
		}
		select {
		case <-ctx.Done():
		case <-time.After(min(interval, left)):
		}
	}
}

// Holds is Until for a condition without a name or a state: whether it held in time. The
// caller says what failed.
func Holds(ctx context.Context, interval, timeout time.Duration, holds func() bool) bool {
	return Until(ctx, interval, timeout, Named("", holds)) == nil
}
