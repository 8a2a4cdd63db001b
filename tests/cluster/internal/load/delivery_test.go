package load

import (
	"strings"
	"testing"
	"time"
)

// Deliveries against writes: a watch that delivers each write at once, one that delivers late,
// one that stops (hung), and writes answered out of resourceVersion order.
func TestDeliveries(t *testing.T) {
	t0 := time.Now()
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	d := newDeliveries(10 * time.Second)
	for _, w := range []string{"fine", "late", "hung"} {
		d.watcher(w, nil)
	}
	d.saw("fine", "5", at(0))
	d.wrote("5", at(0.1)) // delivered before the writer had its answer
	d.wrote("8", at(1))
	d.wrote("7", at(1.1)) // answered after 8
	d.saw("fine", "8", at(1.2))
	d.saw("late", "8", at(12))
	d.saw("hung", "5", at(0.5))
	d.wrote("x", at(2)) // not a resourceVersion: ignored
	got := d.finish(at(30))
	if c := got["fine"]; c.Writes != 3 || c.Late != 0 || c.Missing != 0 || c.MaxLagMS > 300 {
		t.Errorf("fine: %+v", *c)
	}
	if c := got["late"]; c.Late != 3 || c.Missing != 0 || c.MaxLagMS < 11900 {
		t.Errorf("late: %+v", *c)
	}
	if c := got["hung"]; c.Missing != 2 || c.Late != 2 || c.MaxLagMS < 28900 {
		t.Errorf("hung: %+v", *c)
	}
	p := strings.Join(DeliveryProblems(got, 10*time.Second), "\n")
	for _, want := range []string{"watch hung hung: 2 of 3 writes never delivered", "watch late delivered 3 of 3 writes later than 10s"} {
		if !strings.Contains(p, want) {
			t.Errorf("problems %q do not say %q", p, want)
		}
	}
	if strings.Contains(p, "fine") {
		t.Errorf("problems name a watch that delivered in time: %q", p)
	}
}

// A polled watch (an informer) is read by pollAll; caughtUp holds once every write is delivered.
func TestDeliveriesPolled(t *testing.T) {
	rv := "1"
	d := newDeliveries(DeliveryBound)
	d.watcher("informer", func() string { return rv })
	d.wrote("3", time.Now())
	d.pollAll(time.Now())
	if d.caughtUp() {
		t.Fatal("caughtUp before the informer reached the write")
	}
	rv = "4"
	d.pollAll(time.Now())
	if !d.caughtUp() {
		t.Fatal("not caughtUp after the informer passed the write")
	}
}
