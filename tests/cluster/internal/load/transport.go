package load

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

// watchObserver is told how each watch response body ended, how long it had been open and
// how many bytes it carried.
type watchObserver func(resource, how string, open time.Duration, bytes int64)

// observingTransport sees every request of one client: it counts the reflectors' lists and
// watches per resource and how each watch stream ended (io.EOF when the apiserver finished it,
// an error kind when it was cut). Only what crosses the wire is counted, so it sees exactly
// what client-go did, whatever its own retry and watch-list logic decided.
type observingTransport struct {
	next    http.RoundTripper
	request func(resource string, watch, initialEvents bool, err error)
	ended   watchObserver
	closing *atomic.Bool
}

func (t *observingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	q := req.URL.Query()
	watch := q.Get("watch") == "true" || q.Get("watch") == "1"
	initial := q.Get("sendInitialEvents") == "true"
	resource := resourceOf(req.URL.Path)
	resp, err := t.next.RoundTrip(req)
	if t.request != nil {
		t.request(resource, watch, initial, err)
	}
	if err != nil || !watch || t.ended == nil {
		return resp, err
	}
	resp.Body = &observedBody{ReadCloser: resp.Body, resource: resource, ended: t.ended, closing: t.closing, began: time.Now()}
	return resp, nil
}

// resourceOf is the resource of a collection path: /api/v1/namespaces/x/configmaps ->
// configmaps. Informers and streams only ever ask for collections.
func resourceOf(path string) string {
	path = strings.TrimRight(path, "/")
	return path[strings.LastIndex(path, "/")+1:]
}

type observedBody struct {
	io.ReadCloser
	resource string
	ended    watchObserver
	closing  *atomic.Bool
	done     atomic.Bool
	began    time.Time
	bytes    int64
	head     []byte // the first bytes of the stream: an ERROR event is told apart by it
}

// Watch ends that are the apiserver's own doing: the stream finished, or the apiserver sent
// GOAWAY and closed the connection while draining (client-go resumes both from the last
// resourceVersion).
const (
	EndedByServer       = "ended-by-server"
	EndedByServerGoaway = "ended-by-server-goaway"
	StoppedByClient     = "stopped-by-client"
)

func (b *observedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.bytes += int64(n)
	if len(b.head) < 1024 {
		b.head = append(b.head, p[:min(n, 1024-len(b.head))]...)
	}
	if err != nil && b.done.CompareAndSwap(false, true) {
		how := Classify(err)
		switch {
		case errors.Is(err, io.EOF):
			how = EndedByServer
		case b.closing.Load():
			how = StoppedByClient
		case how == "goaway" && strings.Contains(err.Error(), "ErrCode=NO_ERROR"):
			how = EndedByServerGoaway
		}
		b.end(how)
	}
	return n, err
}

// end reports how the watch ended; a stream whose first event is an ERROR (a Status object)
// ended with that status, whoever closed it then.
func (b *observedBody) end(how string) {
	if reason := errorEventReason(b.head); reason != "" {
		how = ErrorEventPrefix + reason
	}
	b.ended(b.resource, how, time.Since(b.began), b.bytes)
}

// ErrorEventPrefix starts the end of a watch whose server sent an ERROR event.
const ErrorEventPrefix = "error-event-"

// errorEventReason is the reason of the ERROR event a watch stream starts with, or "". The
// stream is protobuf or JSON: the event type and the Status reason appear as plain strings.
func errorEventReason(head []byte) string {
	if !bytes.Contains(head[:min(len(head), 16)], []byte("ERROR")) {
		return ""
	}
	for _, reason := range []string{"Expired", "Gone", "TooLargeResourceVersion", "InternalError", "Timeout"} {
		if bytes.Contains(head, []byte(reason)) {
			return reason
		}
	}
	return "Other"
}

func (b *observedBody) Close() error {
	// A body closed before it ended is the client stopping the watch itself (the reflector's
	// resync, the end of the run): not an error of the server or of the path to it.
	if b.done.CompareAndSwap(false, true) {
		b.end(StoppedByClient)
	}
	return b.ReadCloser.Close()
}
