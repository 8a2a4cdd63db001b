package cluster

import (
	"testing"
	"time"
)

func newWatcher() *EndpointsWatcher {
	return &EndpointsWatcher{since: map[string]time.Time{}, addrs: map[string]map[string]bool{}, tracked: map[string]map[string]time.Time{}}
}

func TestEndpointsGapAccounting(t *testing.T) {
	w := newWatcher()
	// The state at the start counts: an object found empty is a gap from then on.
	w.observe("endpoints", map[string]bool{})
	w.observe("endpointslice", map[string]bool{"192.0.2.10": true})
	if !w.Empty("endpoints") || w.Empty("endpointslice") {
		t.Fatalf("Empty: endpoints %v, endpointslice %v", w.Empty("endpoints"), w.Empty("endpointslice"))
	}
	gaps := w.Take()
	if len(gaps) != 1 || gaps[0].Object != "endpoints" || !gaps[0].Open {
		t.Fatalf("first Take: %+v, want one open endpoints gap", gaps)
	}
	// A gap is reported once: the next period starts where the last one ended.
	w.observe("endpoints", map[string]bool{"192.0.2.10": true})
	w.observe("endpointslice", map[string]bool{})
	w.observe("endpointslice", map[string]bool{"192.0.2.10": true})
	gaps = w.Take()
	if len(gaps) != 2 || gaps[0].Open || gaps[1].Open {
		t.Fatalf("second Take: %+v, want the end of the endpoints gap and the whole slice gap, both closed", gaps)
	}
	if gaps := w.Take(); len(gaps) != 0 {
		t.Fatalf("third Take: %+v, want none", gaps)
	}
}
