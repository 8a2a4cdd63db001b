// Command nodetest is the test image's only binary.
//
//	nodetest serve ADDR [MARKER]  listen on ADDR (TCP), answer each connection with
//	                              "nodetest ok\n", write /tmp/ready once listening; on
//	                              SIGTERM write MARKER (if given) and exit 0
//	nodetest probe ADDR [DIAL...] exit 0 if /tmp/ready exists, ADDR answers "nodetest ok"
//	                              and each DIAL address accepts a TCP connection
//
// The smoke test runs serve as a hostNetwork container and probe as its exec readiness
// probe, so a ready container proves the runtime, the exec path and the host network.
package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"
)

const (
	readyFile = "/tmp/ready"
	greeting  = "nodetest ok"
)

func main() {
	if len(os.Args) < 3 || (os.Args[1] == "serve" && len(os.Args) > 4) {
		fmt.Fprintln(os.Stderr, "usage: nodetest serve ADDR [MARKER] | nodetest probe ADDR [DIAL...]")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve":
		marker := ""
		if len(os.Args) == 4 {
			marker = os.Args[3]
		}
		serve(os.Args[2], marker)
	case "probe":
		if err := probe(os.Args[2], os.Args[3:]); err != nil {
			fmt.Fprintln(os.Stderr, "probe:", err)
			os.Exit(1)
		}
	default:
		fmt.Fprintln(os.Stderr, "unknown mode", os.Args[1])
		os.Exit(2)
	}
}

func serve(addr, marker string) {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		os.Exit(1)
	}
	if err := os.MkdirAll("/tmp", 0o1777); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := os.WriteFile(readyFile, []byte("ready\n"), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("nodetest: serving on", ln.Addr())
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			_, _ = fmt.Fprintln(c, greeting)
			_ = c.Close()
		}
	}()
	s := <-sigs
	fmt.Println("nodetest: got", s, "- exiting")
	_ = ln.Close()
	if marker != "" {
		if err := os.WriteFile(marker, []byte(s.String()+"\n"), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "marker:", err)
			os.Exit(1)
		}
	}
}

func probe(addr string, dial []string) error {
	if _, err := os.Stat(readyFile); err != nil {
		return err
	}
	for _, d := range dial {
		c, err := net.DialTimeout("tcp", d, 2*time.Second)
		if err != nil {
			return err
		}
		_ = c.Close()
	}
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != greeting+"\n" {
		return fmt.Errorf("unexpected answer %q", line)
	}
	return nil
}
