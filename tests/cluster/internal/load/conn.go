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
// a reset (it retries a GET, and a reset watch looks like its end), so resets are counted
// here, under TLS, where the kernel reports them.
type ConnCount struct {
	Dialed     int64            `json:"dialed"`
	DialErrors map[string]int64 `json:"dial_errors"`
	// Errors: connections that saw a read or write error other than the end of the stream.
	Errors map[string]int64 `json:"errors"`
}

// dial opens a TCP connection and watches it for errors.
func (l *Load) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	dial := l.cfg.Dialer
	if dial == nil {
		dial = (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	}
	c, err := dial(ctx, network, addr)
	l.rec.mu.Lock()
	defer l.rec.mu.Unlock()
	if err != nil {
		if ctx.Err() == nil {
			l.rec.report.Connections.DialErrors[Classify(err)]++
		}
		return nil, err
	}
	l.rec.report.Connections.Dialed++
	return &watchedConn{Conn: c, l: l}, nil
}

type watchedConn struct {
	net.Conn
	l      *Load
	closed atomic.Bool
	failed atomic.Bool
}

func (c *watchedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
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

// check counts the first real error of the connection: not its end (EOF), not our own close,
// not the end of the run.
func (c *watchedConn) check(err error) {
	if err == nil || errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || c.closed.Load() || c.l.closing.Load() {
		return
	}
	if c.failed.CompareAndSwap(false, true) {
		c.l.rec.mu.Lock()
		c.l.rec.report.Connections.Errors[Classify(err)]++
		c.l.rec.mu.Unlock()
	}
}
