package load

import (
	"net/http"
	"strconv"
)

// AttemptCount counts every HTTP attempt of every client, as it left client-go's retry loop.
// client-go retries a GET silently after an EOF or a lost connection, and waits out a 429 or
// a 5xx that carries Retry-After before it sends the request again: the result of the call
// then says nothing of the failure. Each attempt is counted here, below that loop.
type AttemptCount struct {
	Total int64 `json:"total"`
	OK    int64 `json:"ok"`
	// RetryAfter: the answer of a draining apiserver, which client-go sends again, elsewhere:
	// 429 Too Many Requests with Retry-After (--shutdown-send-retry-after, as the manifests
	// run it), or 503 with Retry-After, "apiserver is shutting down" (without that flag, as
	// kubeadm's static apiserver does at the migration: k8s.io/apiserver
	// pkg/server/filters/waitgroup.go). Tolerated, counted apart.
	RetryAfter int64 `json:"retry_after"`
	// Expired: 410 Gone, a resourceVersion older than the apiserver's watch cache reaches
	// back (an informer lists again): the apiserver's own doing, counted apart.
	Expired int64 `json:"expired_410"`
	// Failed: every other outcome by kind: a transport error (EOF, reset, lost connection)
	// or any other HTTP status.
	Failed map[string]int64 `json:"failed"`
}

// attemptTransport sits directly on the client's HTTP transport, under client-go's retries.
type attemptTransport struct {
	next http.RoundTripper
	l    *Load
}

func (t *attemptTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := t.next.RoundTrip(req)
	// Our own end of the run, not an outcome of the path; and the set-up before the run
	// (creating what is there already is answered 409), which fails Start if it fails.
	if err != nil && (req.Context().Err() != nil || t.l.closing.Load()) || !t.l.running.Load() {
		return resp, err
	}
	kind := AttemptOutcome(resp, err)
	t.l.rec.mu.Lock()
	defer t.l.rec.mu.Unlock()
	a := &t.l.rec.report.Attempts
	a.Total++
	switch kind {
	case AttemptOK:
		a.OK++
	case AttemptRetryAfter:
		a.RetryAfter++
	case AttemptExpired:
		a.Expired++
	default:
		a.Failed[kind]++
		what := req.Method + " " + req.URL.Path
		if err != nil {
			what += ": " + err.Error()
		}
		t.l.rec.sample("attempt-"+kind, what)
	}
	return resp, err
}

// The outcomes of one attempt that are not failures.
const (
	AttemptOK         = "ok"
	AttemptRetryAfter = "retry-after"
	AttemptExpired    = "expired-410"
)

// AttemptOutcome names what one attempt came to: AttemptOK for 1xx-3xx, AttemptRetryAfter
// for 429 or 503 with a Retry-After header, AttemptExpired for 410, else a failure kind: the
// error's class (Classify) or "http-CODE". Pure.
func AttemptOutcome(resp *http.Response, err error) string {
	if err != nil {
		return Classify(err)
	}
	switch code := resp.StatusCode; {
	case code < 400:
		return AttemptOK
	case (code == http.StatusTooManyRequests || code == http.StatusServiceUnavailable) && resp.Header.Get("Retry-After") != "":
		return AttemptRetryAfter
	case code == http.StatusGone:
		return AttemptExpired
	default:
		return "http-" + strconv.Itoa(code)
	}
}
