package cluster

import (
	"context"
	"testing"
	"time"
)

func TestPoll(t *testing.T) {
	n := 0
	if !Poll(context.Background(), time.Millisecond, time.Minute, func() bool { n++; return n == 3 }) {
		t.Fatalf("Poll gave up on a condition that became true at the third check")
	}
	if Poll(context.Background(), time.Millisecond, 20*time.Millisecond, func() bool { return false }) {
		t.Fatalf("Poll returned true for a condition that never was")
	}
	// A cancelled context ends the wait long before its timeout.
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	start := time.Now()
	if Poll(ctx, time.Millisecond, time.Minute, func() bool { return false }) {
		t.Fatalf("Poll returned true after its context was cancelled")
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("Poll took %s after its context was cancelled (timeout 1m)", took)
	}
}
