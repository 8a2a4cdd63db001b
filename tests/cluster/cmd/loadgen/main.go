// Command loadgen runs the client-go load of package load against a kubeconfig until it gets
// SIGTERM or SIGINT, or a duration passes, and writes what the load saw as JSON.
//
//	loadgen -kubeconfig admin.conf -out report.json [-duration 10m] [-ready ready-file]
//
// The ready file is written once the informers have synced and every workload runs, so that
// a script can start what it measures only then. A summary line goes to stderr at the end;
// the exit status is 0 whatever the load saw (the report says it), 1 when the load could not
// start or the report could not be written.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"kube-apiserver-proxy/tests/cluster/internal/load"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the clients (its server is the address under test)")
	out := flag.String("out", "", "file to write the report to (JSON; default stdout)")
	duration := flag.Duration("duration", 0, "stop after this long (0: only on SIGTERM/SIGINT)")
	ready := flag.String("ready", "", "file to create once the load runs")
	startTimeout := flag.Duration("start-timeout", 2*time.Minute, "deadline for the load to start")
	flag.Parse()
	if *kubeconfig == "" {
		fmt.Fprintln(os.Stderr, "loadgen: -kubeconfig is required")
		os.Exit(2)
	}
	if err := run(*kubeconfig, *out, *ready, *duration, *startTimeout); err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
}

func run(kubeconfig, out, ready string, duration, startTimeout time.Duration) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	// The load runs under the context Start is given, so the start deadline cancels it only
	// while Start has not returned.
	loadCtx, cancelLoad := context.WithCancel(ctx)
	defer cancelLoad()
	deadline := time.AfterFunc(startTimeout, cancelLoad)
	l, err := load.Start(loadCtx, load.DefaultConfig(kubeconfig))
	if !deadline.Stop() && err == nil {
		l.Stop()
		return fmt.Errorf("start: not running within %s", startTimeout)
	}
	if err != nil {
		return fmt.Errorf("start: %w", err)
	}
	if ready != "" {
		if err := os.WriteFile(ready, []byte(time.Now().UTC().Format(time.RFC3339Nano)+"\n"), 0o644); err != nil {
			l.Stop()
			return err
		}
	}
	if duration > 0 {
		t := time.NewTimer(duration)
		defer t.Stop()
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	} else {
		<-ctx.Done()
	}
	rep := l.Stop()
	data, err := json.MarshalIndent(&rep, "", "  ")
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "loadgen: %d ok, %d failed, %d relists (+%d after Expired), %d stream cuts, %d connection errors in %s\n",
		rep.TotalOK(), rep.TotalFailed(), rep.TotalRelists(), rep.TotalRelistsExpired(), rep.TotalStreamCuts(),
		rep.TotalConnErrors(), rep.Duration.Round(time.Millisecond))
	if out == "" {
		_, err = os.Stdout.Write(append(data, '\n'))
		return err
	}
	return os.WriteFile(out, append(data, '\n'), 0o644)
}
