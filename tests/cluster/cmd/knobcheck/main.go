// Knobcheck judges the environment knobs of one scenario of the real-kubelet stage (package
// node, knob.go) before smoke builds anything, so that a knob CI refuses fails the mode in its
// first seconds rather than after the control plane is up:
//
//	cd tests/cluster && go run ./cmd/knobcheck -repo ../.. SCENARIO
//
// Prints each refusal as "FAIL - …" and each note as "# NOTE: …", on stdout (smoke's report)
// and on stderr. Exit status: 0 when nothing was refused, 1 otherwise, 2 for bad usage.
package main

import (
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"

	"kube-apiserver-proxy/tests/cluster/internal/node"
	"kube-apiserver-proxy/tests/cluster/internal/report"
)

func main() {
	repo := flag.String("repo", "../..", "the repository (the recovery agent's manifest gives two defaults)")
	flag.Parse()
	if flag.NArg() != 1 || !slices.Contains(node.KnobScenarios(), flag.Arg(0)) {
		fmt.Fprintln(os.Stderr, "knobcheck: want one of: "+strings.Join(node.KnobScenarios(), ", "))
		os.Exit(2)
	}
	notes, errs := node.JudgeKnobs(flag.Arg(0), os.Getenv, node.KnobDefaults(*repo, os.Getenv), node.InCI())
	rec := report.NewRecord(os.Stdout)
	for _, n := range notes {
		rec.Note("%s", n)
		fmt.Fprintln(os.Stderr, n)
	}
	for _, e := range errs {
		rec.Fail("%s", e)
		fmt.Fprintln(os.Stderr, e)
	}
	if len(errs) > 0 {
		os.Exit(1)
	}
}
