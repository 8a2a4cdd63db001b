package load

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestAttemptOutcome(t *testing.T) {
	resp := func(code int, retryAfter string) *http.Response {
		r := &http.Response{StatusCode: code, Header: http.Header{}}
		if retryAfter != "" {
			r.Header.Set("Retry-After", retryAfter)
		}
		return r
	}
	for _, c := range []struct {
		resp *http.Response
		err  error
		want string
	}{
		{resp(200, ""), nil, AttemptOK},
		{resp(201, ""), nil, AttemptOK},
		{resp(429, "1"), nil, AttemptRetryAfter},
		{resp(429, ""), nil, "http-429"},
		{resp(503, "1"), nil, AttemptRetryAfter},
		{resp(503, ""), nil, "http-503"},
		{resp(500, "1"), nil, "http-500"},
		{resp(410, ""), nil, AttemptExpired},
		{resp(403, ""), nil, "http-403"},
		{nil, io.EOF, "eof"},
		{nil, fmt.Errorf("read: %w", syscall.ECONNRESET), "reset"},
		{nil, errors.New("http2: client connection lost"), "http2-connection-lost"},
	} {
		if got := AttemptOutcome(c.resp, c.err); got != c.want {
			t.Errorf("AttemptOutcome(%v, %v) = %q, want %q", c.resp, c.err, got, c.want)
		}
	}
}

func TestConnEnd(t *testing.T) {
	for _, c := range []struct {
		err  error
		read int64
		want string
	}{
		// Accepted and closed on the way: the TLS server never said hello.
		{io.EOF, 0, ConnClosedBeforeAnyByte},
		{syscall.ECONNRESET, 0, ConnClosedBeforeAnyByte},
		{io.ErrUnexpectedEOF, 0, ConnClosedBeforeAnyByte},
		// The apiserver closing after GOAWAY: counted apart, not a failure by itself.
		{io.EOF, 4096, ConnClosedByPeer},
		{syscall.ECONNRESET, 4096, "reset"},
		{syscall.EPIPE, 10, "broken-pipe"},
	} {
		if got := ConnEnd(c.err, c.read); got != c.want {
			t.Errorf("ConnEnd(%v, %d) = %q, want %q", c.err, c.read, got, c.want)
		}
	}
}

// clean is a report of a lossless 10 s run of cfg's every workload, 100 requests a second.
func clean(cfg Config) *Report {
	r := &Report{
		Issuing:     10 * time.Second,
		Requests:    map[string]*Count{},
		Failures:    map[string]int64{},
		Attempts:    AttemptCount{Failed: map[string]int64{}},
		Informers:   map[string]*InformerCount{"configmaps": {WatchEnds: map[string]int64{EndedByServerGoaway: 1}}},
		Streams:     StreamCount{Opened: 4, Cut: map[string]int64{}},
		Connections: ConnCount{DialErrors: map[string]int64{}, Errors: map[string]int64{}},
		Overall:     Window{Count: 1000, P50: 8, P99: 50, Max: 300},
		Deliveries: map[string]*DeliveryCount{
			"stream-0": {Writes: 300, P99LagMS: 20, MaxLagMS: 900}, "informer-configmaps": {Writes: 300, MaxLagMS: 40},
		},
	}
	r.Connections.FirstByte = Window{Count: 400, P50: 3, P99: 40, Max: 200}
	for _, k := range expectedWorkloads(cfg) {
		r.Requests[k] = &Count{OK: 1000 / int64(len(expectedWorkloads(cfg)))}
	}
	for s := 0; s < 10; s++ {
		r.Latency = append(r.Latency, Window{At: float64(s), Count: 100})
	}
	return r
}

func TestProblems(t *testing.T) {
	cfg := DefaultConfig("")
	c := DefaultCriteria()
	if p := clean(cfg).Problems(c, cfg); len(p) != 0 {
		t.Fatalf("a clean run has problems: %v", p)
	}
	for _, tc := range []struct {
		name  string
		plant func(*Report)
		want  string
	}{
		{"failed request", func(r *Report) { r.Requests["get"].Failed = 1; r.Failures["eof"] = 1 }, "requests failed"},
		{"pending at stop", func(r *Report) { r.Requests["get"].Failed = 1; r.Failures[PendingAtStop] = 1 }, PendingAtStop},
		{"attempt retried away", func(r *Report) { r.Attempts.Failed["eof"] = 1 }, "attempts failed"},
		{"relist", func(r *Report) { r.Informers["configmaps"].Relists = 1 }, "relists"},
		{"cut stream", func(r *Report) { r.Streams.Cut["unexpected-eof"] = 1 }, "cut"},
		{"cut informer watch", func(r *Report) { r.Informers["configmaps"].WatchEnds["reset"] = 1 }, "watches ended by [reset]"},
		{"closed before any byte", func(r *Report) { r.Connections.ClosedBeforeAnyByte = 1 }, "closed before any byte"},
		{"dial error", func(r *Report) { r.Connections.DialErrors["refused"] = 1 }, "connections failed"},
		{"a workload that never ran", func(r *Report) { delete(r.Requests, "kubectl") }, `workload "kubectl"`},
		{"no stream", func(r *Report) { r.Streams.Opened = 0 }, "no long-lived watch"},
		{"too few requests", func(r *Report) {
			for _, c := range r.Requests {
				c.OK = 1
			}
		}, "did not run"},
		{"a silent second", func(r *Report) { r.Latency = append(r.Latency[:3], r.Latency[6:]...) }, "no request completed in 3 seconds of the run: 3-5"},
		{"slow request", func(r *Report) { r.Overall.Max = 12000 }, "slowest request"},
		{"stalled requests", func(r *Report) { r.Overall.P99 = 3100 }, "stalled requests: latency p99 3100 ms"},
		{"stalled connections", func(r *Report) { r.Connections.FirstByte.P99 = 3050 }, "stalled connections: time to the first byte (TLS ServerHello) p99 3050 ms"},
		{"hung watch", func(r *Report) { r.Deliveries["stream-0"].Missing, r.Deliveries["stream-0"].Late = 40, 40 }, "watch stream-0 hung: 40 of 300 writes never delivered"},
		{"late watch", func(r *Report) { r.Deliveries["informer-configmaps"].Late = 1 }, "watch informer-configmaps delivered 1 of 300 writes later than 10s"},
		{"a watch that followed nothing", func(r *Report) { r.Deliveries["stream-0"].Writes = 0 }, "watch stream-0 followed no write"},
	} {
		r := clean(cfg)
		tc.plant(r)
		p := r.Problems(c, cfg)
		if !strings.Contains(strings.Join(p, "\n"), tc.want) {
			t.Errorf("%s: problems %q do not say %q", tc.name, p, tc.want)
		}
	}
}

// An etcd restart's seconds without a completed request, its 5 s request and its p99 of
// seconds pass the store-restart criteria; a failed request, a cut watch, a request past the
// bound (etcd's full 7 s drain: 10.5 s; the replaced pod's 32.7 s), a late event or stalled
// connections still fail them.
func TestStoreRestartCriteria(t *testing.T) {
	cfg := DefaultConfig("")
	c, err := CriteriaNamed("store-restart")
	if err != nil {
		t.Fatal(err)
	}
	restart := func(r *Report) {
		r.Latency = append(r.Latency[:3], r.Latency[8:]...)
		r.Overall.P99, r.Overall.Max = 3100, 5200
	}
	r := clean(cfg)
	restart(r)
	if p := r.Problems(c, cfg); len(p) != 0 {
		t.Errorf("an etcd restart of 5 s: %v", p)
	}
	// (Its slowest request is within the default bound too: the store-restart one is lower.)
	if p := r.Problems(DefaultCriteria(), cfg); len(p) != 2 {
		t.Errorf("the default criteria must see the silence and the p99: %v", p)
	}
	for _, plant := range []func(*Report){
		func(r *Report) { r.Requests["get"].Failed = 1; r.Failures["http-504-timeout"] = 1 },
		func(r *Report) { r.Streams.Cut["unexpected-eof"] = 1 },
		func(r *Report) { r.Overall.Max = 10522 },
		func(r *Report) { r.Overall.Max = 32700 },
		func(r *Report) { r.Deliveries["stream-0"].Late = 1 },
		func(r *Report) { r.Connections.FirstByte.P99 = 3050 },
	} {
		r := clean(cfg)
		restart(r)
		plant(r)
		if p := r.Problems(c, cfg); len(p) != 1 {
			t.Errorf("store-restart criteria: want one problem, got %q", p)
		}
	}
	if _, err := CriteriaNamed("lenient"); err == nil {
		t.Error("an unknown name must be refused")
	}
}

func TestPercentilesCountTheRequestsThatWaited(t *testing.T) {
	var d []time.Duration
	for _, ms := range []int{5, 900, 1000, 1001, 9000, 30, 2500} {
		d = append(d, time.Duration(ms)*time.Millisecond)
	}
	w := percentiles(d)
	if w.Over1s != 3 || w.Count != 7 || w.Max != 9000 {
		t.Errorf("percentiles: %+v (want 3 over a second of 7, max 9000 ms)", w)
	}
	if w := percentiles(d[:2]); w.Over1s != 0 {
		t.Errorf("none over a second: %+v", w)
	}
}

func TestRanges(t *testing.T) {
	if got := ranges([]int{1, 3, 4, 5, 9, 10}); got != "1, 3-5, 9-10" {
		t.Errorf("ranges = %q", got)
	}
}

// A load stopped before each workload completed a request (a step of a tenth of a second)
// runs on until each has, and no longer; one that never completes is reported after the bound.
func TestStopAwaitsEveryWorkload(t *testing.T) {
	cfg := Config{Writers: 1}
	l := newLoad(t.Context(), cfg)
	go func() {
		for _, kind := range []string{"create", "update", "delete"} {
			time.Sleep(30 * time.Millisecond) // the writer's pause between its requests
			l.rec.request(kind, time.Now(), nil, false)
		}
	}()
	if rep := l.Stop(); len(rep.idleWorkloads(cfg)) > 0 {
		t.Fatalf("Stop did not wait for every workload: %v completed no request", rep.idleWorkloads(cfg))
	}
	l = &Load{cfg: Config{Writers: 1, Readers: 1}, rec: newRecorder(), issuing: t.Context()}
	for _, kind := range []string{"create", "update", "delete", "list"} {
		l.rec.request(kind, time.Now(), nil, false)
	}
	l.rec.request("get", time.Now(), errors.New("refused"), false)
	if l.awaitEveryWorkload(100 * time.Millisecond) {
		t.Fatal("awaitEveryWorkload: true though get completed no request")
	}
}
