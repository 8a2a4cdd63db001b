package load

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

// Report is what one run of the load generator saw, written as JSON.
type Report struct {
	Started time.Time `json:"started"`
	// Issuing: how long the workloads sent requests (from Start's return to Stop).
	Issuing  time.Duration `json:"issuing_ns"`
	Duration time.Duration `json:"duration_ns"`
	// Requests counts client-go calls by workload ("create", "list", "kubectl", …): ok and
	// failed (after client-go's own retries; a call still pending when the load stopped
	// failed too, as "pending-at-stop").
	Requests map[string]*Count `json:"requests"`
	// Failures counts failed calls by error kind.
	Failures map[string]int64 `json:"failures"`
	// Attempts: every HTTP attempt of every client, under client-go's retries.
	Attempts AttemptCount `json:"attempts"`
	// Samples keeps the first few messages of each kind of failure (calls, attempts,
	// connections).
	Samples map[string][]string `json:"samples,omitempty"`
	// Informers: per resource, the initial sync, watch restarts and relists.
	Informers map[string]*InformerCount `json:"informers"`
	// Streams: long-lived watch requests, how they ended.
	Streams StreamCount `json:"streams"`
	// Deliveries: per watch (each stream, the ConfigMap informer), how soon it delivered the
	// events of the writers' writes (delivery.go).
	Deliveries map[string]*DeliveryCount `json:"deliveries"`
	// Connections: every TCP connection of every client.
	Connections ConnCount `json:"connections"`
	// Latency per second of the run: the requests of every request workload that completed
	// in that second (a second without one is missing).
	Latency []Window `json:"latency"`
	// Overall latency percentiles, milliseconds.
	Overall Window `json:"overall"`
}

// Count is ok/failed for one workload.
type Count struct {
	OK     int64 `json:"ok"`
	Failed int64 `json:"failed"`
}

// InformerCount tells how an informer's reflector talked to the apiserver. The first list (or
// watch-list) fills the cache; every later one is a relist, which client-go does only after a
// watch ended with an error or could not be resumed. Relists are counted by what came before:
//
//   - RelistsExpired: the watch got an ERROR event "Expired": its resourceVersion is older
//     than a new apiserver's watch cache reaches back (any apiserver restart causes it for a
//     resource that did not change meanwhile);
//   - RelistsShortWatch: the apiserver ended the watch cleanly (end of stream, or GOAWAY with
//     NO_ERROR) less than a second after it began, which client-go treats as an error: a
//     watch that started on a connection to an apiserver about to end its watches at shutdown;
//   - Relists: everything else, i.e. a watch cut on the way (reset, unexpected EOF) or a
//     request that failed: errors of the path, which must not happen.
//
// A clean end of a stream can only come from the apiserver (the proxy does not speak HTTP).
type InformerCount struct {
	Lists int64 `json:"lists"`
	// Watches: plain watch requests, each resuming from a resourceVersion without a relist
	// (with client-go's watch-list the first sync is itself a watch and counts as a list).
	Watches           int64            `json:"watches"`
	Relists           int64            `json:"relists"`
	RelistsExpired    int64            `json:"relists_expired"`
	RelistsShortWatch int64            `json:"relists_short_watch"`
	Events            int64            `json:"events"`
	WatchEnds         map[string]int64 `json:"watch_ends"`
	Ends              []WatchEnd       `json:"ends,omitempty"`
	Errors            map[string]int64 `json:"errors"`
	lastEnd           string
	lastOpen          time.Duration
}

// WatchEnd is one watch response that ended: when (seconds into the run), how, after how long
// open (seconds) and with how many bytes received.
type WatchEnd struct {
	At    float64 `json:"at_s"`
	How   string  `json:"how"`
	Open  float64 `json:"open_s"`
	Bytes int64   `json:"bytes"`
}

// StreamCount counts the long-lived watch requests of the streaming workload.
type StreamCount struct {
	Opened int64 `json:"opened"`
	Events int64 `json:"events"`
	// EndedByServer: the stream ended cleanly (the apiserver finished it, e.g. while draining).
	EndedByServer int64 `json:"ended_by_server"`
	// Expired: the stream's resourceVersion was too old for the apiserver it resumed on.
	Expired int64 `json:"expired"`
	// Cut: the stream ended with an error (reset, unexpected EOF, decode error).
	Cut map[string]int64 `json:"cut"`
}

// Window holds latency percentiles (milliseconds) of the requests that completed in one window.
type Window struct {
	At    float64 `json:"at_s"`
	Count int     `json:"count"`
	P50   float64 `json:"p50_ms"`
	P99   float64 `json:"p99_ms"`
	P999  float64 `json:"p999_ms"`
	Max   float64 `json:"max_ms"`
	// Over1s: how many took longer than a second (the requests that waited: for an etcd
	// restart, how many met it).
	Over1s int `json:"over_1s"`
}

// recorder collects the report from many goroutines.
type recorder struct {
	mu        sync.Mutex
	start     time.Time
	stopped   time.Time
	report    Report
	latencies map[int][]time.Duration
	all       []time.Duration
}

func newRecorder() *recorder {
	now := time.Now()
	return &recorder{
		start: now,
		report: Report{
			Started:     now,
			Requests:    map[string]*Count{},
			Failures:    map[string]int64{},
			Attempts:    AttemptCount{Failed: map[string]int64{}},
			Samples:     map[string][]string{},
			Informers:   map[string]*InformerCount{},
			Streams:     StreamCount{Cut: map[string]int64{}},
			Connections: ConnCount{DialErrors: map[string]int64{}, Errors: map[string]int64{}},
		},
		latencies: map[int][]time.Duration{},
	}
}

// request records one client-go call of workload `kind`; pending: it was still waiting for
// its answer when the load stopped.
func (r *recorder) request(kind string, began time.Time, err error, pending bool) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.report.Requests[kind]
	if c == nil {
		c = &Count{}
		r.report.Requests[kind] = c
	}
	switch {
	case pending:
		c.Failed++
		r.report.Failures[PendingAtStop]++
		r.sample(PendingAtStop, fmt.Sprintf("%s: sent %s before the load stopped", kind, now.Sub(began).Round(time.Millisecond)))
	case err != nil:
		c.Failed++
		r.failure(kind, err)
	default:
		c.OK++
		took := now.Sub(began)
		second := int(now.Sub(r.start) / time.Second)
		r.latencies[second] = append(r.latencies[second], took)
		r.all = append(r.all, took)
	}
}

// PendingAtStop is the failure kind of a request that had no answer when the load stopped
// (after the grace it is given).
const PendingAtStop = "pending-at-stop"

// failure counts err under its kind; the caller holds the lock.
func (r *recorder) failure(workload string, err error) {
	kind := Classify(err)
	r.report.Failures[kind]++
	r.sample(kind, workload+": "+err.Error())
}

// sample keeps msg as an example of kind (the first few of each); the caller holds the lock.
func (r *recorder) sample(kind, msg string) {
	if len(r.report.Samples[kind]) < 3 {
		r.report.Samples[kind] = append(r.report.Samples[kind], msg)
	}
}

// completedEach: every workload of cfg has completed at least one request.
func (r *recorder) completedEach(cfg Config) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.report.idleWorkloads(cfg)) == 0
}

// begin marks the start of the run proper: every workload issues requests from now on.
func (r *recorder) begin() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.start = time.Now()
	r.report.Started = r.start
}

// stop marks the moment the workloads stop issuing requests.
func (r *recorder) stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopped = time.Now()
	r.report.Issuing = r.stopped.Sub(r.start)
}

func (r *recorder) informer(resource string) *InformerCount {
	c := r.report.Informers[resource]
	if c == nil {
		c = &InformerCount{WatchEnds: map[string]int64{}, Errors: map[string]int64{}}
		r.report.Informers[resource] = c
	}
	return c
}

func (r *recorder) withInformer(resource string, f func(*InformerCount)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(r.informer(resource))
}

func (r *recorder) withStreams(f func(*StreamCount)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.report.Streams)
}

// finish computes the latency windows and returns the report.
func (r *recorder) finish() Report {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.report.Duration = time.Since(r.start)
	seconds := make([]int, 0, len(r.latencies))
	for s := range r.latencies {
		seconds = append(seconds, s)
	}
	sort.Ints(seconds)
	r.report.Latency = r.report.Latency[:0]
	for _, s := range seconds {
		w := percentiles(r.latencies[s])
		w.At = float64(s)
		r.report.Latency = append(r.report.Latency, w)
	}
	r.report.Overall = percentiles(r.all)
	r.report.Connections.FirstByte = percentiles(r.report.Connections.firstBytes)
	return r.report
}

func percentiles(d []time.Duration) Window {
	if len(d) == 0 {
		return Window{}
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	at := func(q float64) float64 {
		i := int(q * float64(len(s)-1))
		return float64(s[i]) / float64(time.Millisecond)
	}
	over := len(s) - sort.Search(len(s), func(i int) bool { return s[i] > time.Second })
	return Window{Count: len(s), P50: at(0.50), P99: at(0.99), P999: at(0.999), Max: at(1), Over1s: over}
}

// sum adds up f over the values of m.
func sum[K comparable, V any](m map[K]V, f func(V) int64) int64 {
	var n int64
	for _, v := range m {
		n += f(v)
	}
	return n
}

func count(n int64) int64 { return n }

// TotalFailed is the number of failed requests of every workload.
func (r *Report) TotalFailed() int64 {
	return sum(r.Requests, func(c *Count) int64 { return c.Failed })
}

// TotalOK is the number of successful requests of every workload.
func (r *Report) TotalOK() int64 { return sum(r.Requests, func(c *Count) int64 { return c.OK }) }

// TotalRelists is the number of informer relists caused by errors of the path (see
// InformerCount).
func (r *Report) TotalRelists() int64 {
	return sum(r.Informers, func(c *InformerCount) int64 { return c.Relists })
}

// TotalRelistsExpired is the number of relists after an Expired watch (see InformerCount).
func (r *Report) TotalRelistsExpired() int64 {
	return sum(r.Informers, func(c *InformerCount) int64 { return c.RelistsExpired })
}

// TotalRelistsShortWatch is the number of relists after a very short watch (see InformerCount).
func (r *Report) TotalRelistsShortWatch() int64 {
	return sum(r.Informers, func(c *InformerCount) int64 { return c.RelistsShortWatch })
}

// TotalStreamCuts is the number of long-lived watch requests that ended with an error.
func (r *Report) TotalStreamCuts() int64 { return sum(r.Streams.Cut, count) }

// TotalConnErrors is the number of connections that failed (dial errors and connections
// closed before any byte included).
func (r *Report) TotalConnErrors() int64 {
	return sum(r.Connections.Errors, count) + sum(r.Connections.DialErrors, count) + r.Connections.ClosedBeforeAnyByte
}

// TotalAttemptsFailed is the number of HTTP attempts that failed, retried by client-go or not.
func (r *Report) TotalAttemptsFailed() int64 { return sum(r.Attempts.Failed, count) }

// Classify names the kind of a client-side error: what a user would see.
func Classify(err error) string {
	if err == nil {
		return "none"
	}
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		s := status.Status()
		return "http-" + strconv.Itoa(int(s.Code)) + "-" + strings.ToLower(string(s.Reason))
	}
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, syscall.ECONNRESET):
		return "reset"
	case errors.Is(err, syscall.EPIPE):
		return "broken-pipe"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "unexpected-eof"
	case errors.Is(err, io.EOF):
		return "eof"
	}
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() {
		return "timeout"
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "connection refused"):
		return "refused"
	case strings.Contains(msg, "connection reset"):
		return "reset"
	case strings.Contains(msg, "GOAWAY"):
		return "goaway"
	case strings.Contains(msg, "client connection lost"):
		return "http2-connection-lost"
	case strings.Contains(msg, "unexpected EOF"):
		return "unexpected-eof"
	case strings.Contains(msg, "EOF"):
		return "eof"
	case strings.Contains(msg, "tls:"), strings.Contains(msg, "x509:"):
		return "tls"
	case strings.Contains(msg, "Timeout"), strings.Contains(msg, "timeout"):
		return "timeout"
	}
	return "other"
}
