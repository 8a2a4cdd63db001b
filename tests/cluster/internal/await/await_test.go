package await

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestUntilHolds(t *testing.T) {
	checks := 0
	err := Until(context.Background(), time.Millisecond, time.Second, Named("third check", func() bool {
		checks++
		return checks == 3
	}))
	if err != nil || checks != 3 {
		t.Fatalf("Until: %v after %d checks", err, checks)
	}
}

func TestUntilChecksAtOnce(t *testing.T) {
	began := time.Now()
	if err := Until(context.Background(), time.Hour, time.Hour, Named("true", func() bool { return true })); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(began); d > time.Second {
		t.Fatalf("a condition that holds at once waited %s", d)
	}
}

// The planted failure: a condition that never holds ends the wait at its timeout, with a
// message that names it and says what it saw last.
func TestUntilNeverHolds(t *testing.T) {
	checks := 0
	began := time.Now()
	err := Until(context.Background(), 10*time.Millisecond, 50*time.Millisecond, Seen("the pod ready", func() (bool, string) {
		checks++
		return false, fmt.Sprintf("check %d: probe failed", checks)
	}))
	var notMet *NotMet
	if !errors.As(err, &notMet) {
		t.Fatalf("Until of a condition that never holds: %v", err)
	}
	want := fmt.Sprintf("the pod ready: not within 50ms (last seen: check %d: probe failed)", checks)
	if err.Error() != want {
		t.Errorf("message %q, want %q", err, want)
	}
	if d := time.Since(began); d < 50*time.Millisecond || d > 5*time.Second {
		t.Errorf("waited %s for a 50 ms timeout", d)
	}
	if checks < 3 {
		t.Errorf("%d checks in 50 ms at 10 ms", checks)
	}
	if notMet.Cause != nil || errors.Is(err, context.Canceled) {
		t.Errorf("a timeout with a cause: %v", notMet.Cause)
	}
}

func TestUntilNamedSaysNoState(t *testing.T) {
	err := Until(context.Background(), time.Millisecond, 5*time.Millisecond, Named("never", func() bool { return false }))
	if err == nil || err.Error() != "never: not within 5ms" {
		t.Fatalf("Until: %v", err)
	}
}

func TestUntilFinalError(t *testing.T) {
	final := errors.New("container exited")
	checks := 0
	err := Until(context.Background(), time.Millisecond, time.Hour, Condition{Name: "ready", Check: func() (bool, string, error) {
		checks++
		if checks == 2 {
			return false, "", final
		}
		return false, "starting", nil
	}})
	if err != final || checks != 2 {
		t.Fatalf("Until: %v after %d checks, want the condition's own error at once", err, checks)
	}
}

func TestUntilInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	err := Until(ctx, time.Millisecond, time.Hour, Seen("never", func() (bool, string) { return false, "no" }))
	if !errors.Is(err, context.Canceled) || !strings.HasPrefix(err.Error(), "never: interrupted after ") || !strings.HasSuffix(err.Error(), ": context canceled (last seen: no)") {
		t.Fatalf("Until, interrupted: %v", err)
	}
}

func TestHolds(t *testing.T) {
	if !Holds(context.Background(), time.Millisecond, time.Second, func() bool { return true }) {
		t.Error("Holds of true")
	}
	if Holds(context.Background(), time.Millisecond, 5*time.Millisecond, func() bool { return false }) {
		t.Error("Holds of false")
	}
}
