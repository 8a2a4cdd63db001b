// Command nodecheck is the checks of the real-kubelet stage (tests/cluster/node) that the
// shell scripts ask of the JSON the kubelet, the apiserver, kubectl and cmd/loadgen give them.
// The object comes on stdin (or in FILE); the verdict is the exit status (0 yes, 1 no or the
// input unreadable, 2 bad usage), a value is printed on stdout.
//
//	nodecheck pod-ready                      < pod       its Ready condition is True
//	nodecheck pod-ready-prefix PREFIX        < podlist   some pod PREFIX-… is Ready
//	nodecheck pod-listed NAME                < podlist   a pod NAME is listed
//	nodecheck pod-running NAME               < podlist   a pod NAME is Running
//	nodecheck pod-ip NAME                    < podlist   prints pod NAME's IP
//	nodecheck pods                           < podlist   prints "name node phase" per pod
//	nodecheck node-ready                     < node      prints "STATUS REASON: MESSAGE"
//	nodecheck rollout-done                   < deployment  the rollout is complete
//	nodecheck arg-index PREFIX               < deployment  prints the index of the first
//	                                                       container's first arg PREFIX…
//	nodecheck git-version                    < /version or `kubectl version -o json`
//	nodecheck kubectl-at-least MAJOR.MINOR   < `kubectl version --client -o json`
//	nodecheck annotation FILE KEY            prints the pod's annotation (nothing if none)
//	nodecheck flag FILE CONTAINER FLAG       prints each value of FLAG=… of the container
//	nodecheck checkpoint-problems FILE       prints how the checkpoint is not a pod of its own
//	nodecheck refused REPORT                 prints the refused connects of a loadgen report
//	nodecheck report REPORT                  prints a loadgen report on one line (step.Line)
//	nodecheck most-pods REPORT SELECTOR      prints the most pods one pod watch saw at once
//	nodecheck static-settled KUBELET API     the kubelet's static pods (its /pods, JSON) are
//	                                         the Ready mirror pods of the apiserver's (JSON)
//	nodecheck etcd-down                      < kubelet log: how long etcd was down
//	nodecheck audited NAME SINCE             < audit log: a request for NAME at/after SINCE
//	nodecheck etcd-value                     < etcd's JSON range answer: its value's first
//	                                           24 bytes as Python prints bytes
//	nodecheck apiserver-pods                 < podlist   prints "name ready|notready restarts
//	                                                     deleting|- node" of non-mirror pods
//	nodecheck events PREFIX                  < eventlist prints the six most frequent
//	                                                     messages on pods PREFIX…
//	nodecheck prom values|alerts|times|targets-up|targets|errors
//	                                         < a Prometheus API answer: instant values,
//	                                           alert names, range times (UTC), one target
//	                                           up (verdict), the targets, their last errors
//	nodecheck prom-config MANIFESTS STATE    writes a plain Prometheus's configuration for
//	                                         manifests/monitoring (rendered) into STATE
//	nodecheck prom-sd NODE_IP STATE          until SIGTERM: the PodMonitor's pods into
//	                                         STATE/sd.json every 2 s (file discovery)
//	nodecheck replace-image-tag OLD NEW      < kubeadm-config ConfigMap: the same with the
//	                                           ClusterConfiguration's imageTag OLD made NEW
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"kube-apiserver-proxy/tests/cluster/internal/nodecheck"
	"kube-apiserver-proxy/tests/cluster/internal/step"
)

// errNo is a check's "no": exit status 1 without a message.
var errNo = fmt.Errorf("no")

type usageError string

func (e usageError) Error() string { return string(e) }

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: nodecheck SUBCOMMAND [ARGS] (see the source's header)")
		os.Exit(2)
	}
	err := run(os.Args[1], os.Args[2:], os.Stdin, os.Stdout)
	switch e := err.(type) {
	case nil:
	case usageError:
		fmt.Fprintf(os.Stderr, "nodecheck %s: %s\n", os.Args[1], string(e))
		os.Exit(2)
	default:
		if err != errNo {
			fmt.Fprintf(os.Stderr, "nodecheck %s: %v\n", os.Args[1], err)
		}
		os.Exit(1)
	}
}

func verdict(ok bool) error {
	if ok {
		return nil
	}
	return errNo
}

func args(a []string, n int, names string) error {
	if len(a) != n {
		return usageError("want " + names)
	}
	return nil
}

func decode(r io.Reader, what string, v any) error {
	if err := json.NewDecoder(r).Decode(v); err != nil {
		return fmt.Errorf("reading %s: %w", what, err)
	}
	return nil
}

func readFile(path string, v any) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return decode(f, path, v)
}

func run(cmd string, a []string, in io.Reader, out io.Writer) error {
	switch cmd {
	case "pod-ready":
		var p corev1.Pod
		if err := decode(in, "a pod", &p); err != nil {
			return err
		}
		return verdict(nodecheck.Ready(&p))
	case "pod-ready-prefix", "pod-listed", "pod-running", "pod-ip":
		if err := args(a, 1, "one pod name"); err != nil {
			return err
		}
		var pods corev1.PodList
		if err := decode(in, "a pod list", &pods); err != nil {
			return err
		}
		switch cmd {
		case "pod-ready-prefix":
			return verdict(nodecheck.ReadyWithPrefix(&pods, a[0]))
		case "pod-listed":
			return verdict(nodecheck.Named(&pods, a[0]) != nil)
		case "pod-running":
			return verdict(nodecheck.Running(&pods, a[0]))
		}
		if p := nodecheck.Named(&pods, a[0]); p != nil {
			fmt.Fprintln(out, p.Status.PodIP)
		}
		return nil
	case "pods":
		var pods corev1.PodList
		if err := decode(in, "a pod list", &pods); err != nil {
			return err
		}
		for _, l := range nodecheck.Lines(&pods) {
			fmt.Fprintln(out, l)
		}
		return nil
	case "node-ready":
		var n corev1.Node
		if err := decode(in, "a node", &n); err != nil {
			return err
		}
		if s := nodecheck.NodeReady(&n); s != "" {
			fmt.Fprintln(out, s)
		}
		return nil
	case "rollout-done", "arg-index":
		var d appsv1.Deployment
		if err := decode(in, "a Deployment", &d); err != nil {
			return err
		}
		if cmd == "rollout-done" {
			return verdict(nodecheck.RolloutDone(&d))
		}
		if err := args(a, 1, "an argument prefix"); err != nil {
			return err
		}
		i := nodecheck.ArgIndex(&d, a[0])
		if i < 0 {
			return fmt.Errorf("no argument %s… in the first container", a[0])
		}
		fmt.Fprintln(out, i)
		return nil
	case "git-version":
		var v struct {
			GitVersion    string `json:"gitVersion"`
			ServerVersion *struct {
				GitVersion string `json:"gitVersion"`
			} `json:"serverVersion"`
		}
		if err := decode(in, "a version", &v); err != nil {
			return err
		}
		if v.ServerVersion != nil {
			v.GitVersion = v.ServerVersion.GitVersion
		}
		if v.GitVersion == "" {
			return fmt.Errorf("no gitVersion (nor serverVersion.gitVersion)")
		}
		fmt.Fprintln(out, v.GitVersion)
		return nil
	case "kubectl-at-least":
		if err := args(a, 1, "MAJOR.MINOR"); err != nil {
			return err
		}
		var v struct {
			Client struct{ Major, Minor string } `json:"clientVersion"`
		}
		if err := decode(in, "kubectl's version", &v); err != nil {
			return err
		}
		ok, err := nodecheck.AtLeast(v.Client.Major, v.Client.Minor, a[0])
		if err != nil {
			return err
		}
		return verdict(ok)
	case "annotation":
		if err := args(a, 2, "FILE KEY"); err != nil {
			return err
		}
		// A missing or half-written file has no annotation: nothing printed, not an error.
		var p corev1.Pod
		if readFile(a[0], &p) == nil && p.Annotations[a[1]] != "" {
			fmt.Fprintln(out, p.Annotations[a[1]])
		}
		return nil
	case "flag":
		if err := args(a, 3, "FILE CONTAINER FLAG"); err != nil {
			return err
		}
		var p corev1.Pod
		if err := readFile(a[0], &p); err != nil {
			return err
		}
		for _, v := range nodecheck.FlagValues(&p, a[1], a[2]) {
			fmt.Fprintln(out, v)
		}
		return nil
	case "checkpoint-problems":
		if err := args(a, 1, "FILE"); err != nil {
			return err
		}
		var p corev1.Pod
		var raw struct {
			Spec map[string]json.RawMessage `json:"spec"`
		}
		if err := readFile(a[0], &p); err != nil {
			return err
		}
		if err := readFile(a[0], &raw); err != nil {
			return err
		}
		keys := map[string]bool{}
		for k := range raw.Spec {
			keys[k] = true
		}
		fmt.Fprintln(out, strings.Join(nodecheck.CheckpointProblems(&p, keys), "; "))
		return nil
	case "refused":
		if err := args(a, 1, "REPORT"); err != nil {
			return err
		}
		r, err := step.Read(a[0])
		if err != nil {
			return err
		}
		fmt.Fprintln(out, strconv.FormatInt(r.Refused(), 10))
		return nil
	case "report", "most-pods":
		if cmd == "report" {
			if err := args(a, 1, "REPORT"); err != nil {
				return err
			}
		} else if err := args(a, 2, "REPORT SELECTOR"); err != nil {
			return err
		}
		r, err := step.Read(a[0])
		if err != nil {
			return err
		}
		if cmd == "most-pods" {
			fmt.Fprintln(out, r.MostPodsAtOnce(a[1]))
			return nil
		}
		line, err := r.Line()
		if err != nil {
			return fmt.Errorf("%s: %w", a[0], err)
		}
		fmt.Fprintln(out, line)
		return nil
	case "static-settled":
		if err := args(a, 2, "the kubelet's pods and the apiserver's (JSON)"); err != nil {
			return err
		}
		var kubelet, api corev1.PodList
		if err := decode(strings.NewReader(a[0]), "the kubelet's pods", &kubelet); err != nil {
			return err
		}
		if err := decode(strings.NewReader(a[1]), "the apiserver's pods", &api); err != nil {
			return err
		}
		return verdict(nodecheck.StaticSettled(&kubelet, &api))
	case "etcd-down":
		s, err := nodecheck.EtcdDown(in)
		if err != nil {
			return err
		}
		fmt.Fprintln(out, s)
		return nil
	case "audited":
		if err := args(a, 2, "NAME SINCE"); err != nil {
			return err
		}
		ok, err := nodecheck.Audited(in, a[0], a[1])
		if err != nil {
			return err
		}
		return verdict(ok)
	case "etcd-value":
		var r struct {
			KVs []struct {
				Value []byte `json:"value"` // base64 in the JSON
			} `json:"kvs"`
		}
		if err := decode(in, "etcd's range answer", &r); err != nil {
			return err
		}
		if len(r.KVs) == 0 {
			fmt.Fprintln(out, "none")
			return nil
		}
		v := r.KVs[0].Value
		fmt.Fprintln(out, nodecheck.PyBytes(v[:min(len(v), 24)]))
		return nil
	case "apiserver-pods":
		var pods corev1.PodList
		if err := decode(in, "a pod list", &pods); err != nil {
			return err
		}
		for _, l := range nodecheck.APIServerPods(&pods) {
			fmt.Fprintln(out, l)
		}
		return nil
	case "events":
		if err := args(a, 1, "a pod name prefix"); err != nil {
			return err
		}
		var events corev1.EventList
		if err := decode(in, "an event list", &events); err != nil {
			return err
		}
		fmt.Fprintln(out, nodecheck.EventSummary(&events, a[0]))
		return nil
	case "prom":
		if err := args(a, 1, "values, alerts, times, targets-up, targets or errors"); err != nil {
			return err
		}
		var p nodecheck.PromAnswer
		if err := decode(in, "Prometheus's answer", &p); err != nil {
			return err
		}
		targets, errors := p.Targets()
		switch a[0] {
		case "values":
			fmt.Fprintln(out, p.Values())
		case "alerts":
			fmt.Fprintln(out, p.AlertNames())
		case "times":
			fmt.Fprintln(out, p.Times())
		case "targets-up":
			return verdict(p.OneTargetUp())
		case "targets":
			fmt.Fprintln(out, targets)
		case "errors":
			fmt.Fprintln(out, errors)
		default:
			return usageError("unknown prom answer " + a[0])
		}
		return nil
	case "prom-config", "prom-sd":
		if err := args(a, 2, "two arguments"); err != nil {
			return err
		}
		if cmd == "prom-config" {
			return promConfig(a[0], a[1])
		}
		return promSD(a[0], a[1])
	case "replace-image-tag":
		if err := args(a, 2, "OLD NEW"); err != nil {
			return err
		}
		// Every field as it came: the result goes back with kubectl replace.
		var cm map[string]any
		if err := decode(in, "a ConfigMap", &cm); err != nil {
			return err
		}
		data, _ := cm["data"].(map[string]any)
		cfg, ok := data["ClusterConfiguration"].(string)
		if !ok {
			return fmt.Errorf("no data.ClusterConfiguration")
		}
		data["ClusterConfiguration"] = strings.ReplaceAll(cfg, "imageTag: "+a[0], "imageTag: "+a[1])
		return json.NewEncoder(out).Encode(cm)
	}
	return usageError("unknown subcommand (see the source's header)")
}
