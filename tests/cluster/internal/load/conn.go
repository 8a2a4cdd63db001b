package load

import (
	"context"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"time"
)

// ConnCount counts the TCP connections of every client and how they failed. client-go hides
// a reset or an EOF (it retries a GET, and a cut watch looks like its end), so connections are
// watched here, under TLS, where the kernel reports what happened to them.
type ConnCount struct {
	Dialed     int64            `json:"dialed"`
	DialErrors map[string]int64 `json:"dial_errors"`
	// Errors: connections that saw a read or write error other than the end of the stream.
	Errors map[string]int64 `json:"errors"`
	// ClosedBeforeAnyByte: connections the other side ended (EOF or reset) before it sent a
	// single byte. A TLS server always answers first with its ServerHello, so nothing the
	// apiserver does looks like this: it is a connection accepted and closed on the way.
	ClosedBeforeAnyByte int64 `json:"closed_before_any_byte"`
	// ClosedByPeer: connections the other side ended cleanly after it had sent something
	// (the apiserver closes a connection after HTTP/2 GOAWAY when it drains or when the
	// connection idled): not a failure by itself; a request or watch it cut is counted where
	// the client saw it.
	ClosedByPeer int64 `json:"closed_by_peer"`
	// FirstByte: how long each new connection waited, from the end of its TCP handshake, for
	// the first byte from the other side: the TLS ServerHello, the answer to the ClientHello
	// the client sends at once. The kernel completes the TCP handshake before anything
	// accepts the connection, so this is what a proxy that stalls new connections delays
	// (milliseconds, over the run; Count is the connections measured).
	FirstByte  Window `json:"first_byte"`
	firstBytes []time.Duration
}

// dial opens a TCP connection and watches it for errors.
func (l *Load) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext(ctx, network, addr)
	l.rec.mu.Lock()
	defer l.rec.mu.Unlock()
	if err != nil {
		if ctx.Err() == nil && !l.closing.Load() {
			kind := Classify(err)
			l.rec.report.Connections.DialErrors[kind]++
			l.rec.sample("dial-"+kind, err.Error())
		}
		return nil, err
	}
	l.rec.report.Connections.Dialed++
	return &watchedConn{Conn: c, l: l, dialed: time.Now()}, nil
}

type watchedConn struct {
	net.Conn
	l      *Load
	dialed time.Time
	read   atomic.Int64
	closed atomic.Bool
	ended  atomic.Bool
}

func (c *watchedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && c.read.Add(int64(n)) == int64(n) && !c.l.closing.Load() {
		took := time.Since(c.dialed)
		c.l.rec.mu.Lock()
		c.l.rec.report.Connections.firstBytes = append(c.l.rec.report.Connections.firstBytes, took)
		c.l.rec.mu.Unlock()
	}
	c.check(err)
	return n, err
}

func (c *watchedConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.check(err)
	return n, err
}

func (c *watchedConn) Close() error {
	c.closed.Store(true)
	return c.Conn.Close()
}

// check records how the connection ended, once: our own close and the end of the run are
// not counted; an end from the other side before any byte is a failure, a clean end after
// some is counted apart, any other error is a failure.
func (c *watchedConn) check(err error) {
	if err == nil || errors.Is(err, net.ErrClosed) || c.closed.Load() || c.l.closing.Load() {
		return
	}
	if !c.ended.CompareAndSwap(false, true) {
		return
	}
	kind := ConnEnd(err, c.read.Load())
	r := c.l.rec
	r.mu.Lock()
	defer r.mu.Unlock()
	switch kind {
	case ConnClosedByPeer:
		r.report.Connections.ClosedByPeer++
	case ConnClosedBeforeAnyByte:
		r.report.Connections.ClosedBeforeAnyByte++
		r.sample("conn-"+kind, c.RemoteAddr().String()+": "+err.Error())
	default:
		r.report.Connections.Errors[kind]++
		r.sample("conn-"+kind, c.RemoteAddr().String()+": "+err.Error())
	}
}

// How a connection ended, besides the error kinds of Classify.
const (
	ConnClosedBeforeAnyByte = "closed-before-any-byte"
	ConnClosedByPeer        = "closed-by-peer"
)

// ConnEnd names how a connection that had read `read` bytes ended with err (not nil, not our
// own close). Pure.
func ConnEnd(err error, read int64) string {
	kind := Classify(err)
	if read == 0 && (kind == "eof" || kind == "reset" || kind == "unexpected-eof") {
		return ConnClosedBeforeAnyByte
	}
	if errors.Is(err, io.EOF) {
		return ConnClosedByPeer
	}
	return kind
}
