package cluster

import (
	"time"
)

// Absence is an interval in which one address was missing from the ready addresses of
// default/kubernetes while the object itself may still have listed others: what a controller
// of an HA control plane loses while its apiserver is replaced.
type Absence struct {
	Address  string        `json:"address"`
	Object   string        `json:"object"` // "endpoints" or "endpointslice"
	From     time.Time     `json:"from"`
	Duration time.Duration `json:"duration_ns"`
	Open     bool          `json:"open,omitempty"` // still missing when taken
}

// Track starts recording every interval in which addr is missing from the Endpoints or from
// the union of the EndpointSlices (see TakeAbsences).
func (w *EndpointsWatcher) Track(addr string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.tracked[addr]; ok {
		return
	}
	w.tracked[addr] = map[string]time.Time{}
	now := time.Now()
	for _, object := range []string{"endpoints", "endpointslice"} {
		if !w.addrs[object][addr] {
			w.tracked[addr][object] = now
		}
	}
}

// Lists reports whether object ("endpoints" or "endpointslice") lists addr as ready now.
func (w *EndpointsWatcher) Lists(object, addr string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.addrs[object][addr]
}

// TakeAbsences returns the absences of the tracked addresses recorded since the last call
// (one still going on up to now, marked open) and forgets them.
func (w *EndpointsWatcher) TakeAbsences() []Absence {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := w.absences
	w.absences = nil
	now := time.Now()
	for addr, missing := range w.tracked {
		for object, from := range missing {
			out = append(out, Absence{Address: addr, Object: object, From: from, Duration: now.Sub(from), Open: true})
			// The rest belongs to the next period: never report a stretch twice.
			missing[object] = now
		}
	}
	return out
}

// observeAddresses records object's ready addresses now; w.mu is held.
func (w *EndpointsWatcher) observeAddresses(object string, addrs map[string]bool) {
	w.addrs[object] = addrs
	now := time.Now()
	for addr, missing := range w.tracked {
		from, absent := missing[object]
		switch {
		case !addrs[addr] && !absent:
			missing[object] = now
		case addrs[addr] && absent:
			delete(missing, object)
			w.absences = append(w.absences, Absence{Address: addr, Object: object, From: from, Duration: now.Sub(from)})
		}
	}
}
