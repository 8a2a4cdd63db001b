package node

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// The scenarios' environment knobs, each with its direction: which values shrink or remove a
// check (a smaller count, a step left out, a switch turned off, a larger time bound). With CI
// set (InCI), such a value beyond the knob's CI floor makes the scenario fail at once, with one
// line naming the variable, its value and the floor; any shrinking value prints a NOTE line
// (on stderr and in the report), CI or not. smoke runs the same judgement before it builds
// anything (cmd/knobcheck), each scenario again when it starts.
//
// The CI floor of a count is the value `tests/cluster/run --rollouts 2` gives (.ci/run's
// setting): MIGRATE_RESTARTS=2, MIGRATE_MORE_RESTARTS=0, DS_RESTARTS=2. Every other floor is
// the default.

// Direction is which values of a knob shrink the rehearsal.
type Direction int

const (
	// Neutral: another value is another setting, not less of a check (versions, revisions).
	Neutral Direction = iota
	// Fewer: a number (a count, or seconds) below the default shrinks: fewer rollouts, a
	// shorter soak, a shorter slow start.
	Fewer
	// Longer: a time bound above the default loosens the limit it checks.
	Longer
	// Exactly: any value but the default removes a check (a switch turned off, another order).
	Exactly
	// AllOf: a list of words; a word of the default left out removes its step.
	AllOf
)

// Knob is one environment variable a scenario reads.
type Knob struct {
	Name string
	// Default is its value when unset or empty; "" when the scenario computes it
	// (KnobDefaults).
	Default string
	Dir     Direction
	// Floor is the value CI accepts at the least (Fewer) or at the most (Longer); the default
	// when empty. Exactly and AllOf knobs have the default as their floor.
	Floor string
	// Values are the accepted values (Exactly) or words (AllOf).
	Values []string
	// Scenarios are the scenarios (cmd/nodescenario's names) that read it.
	Scenarios []string
	// What is what a shrinking value does, for the NOTE and the refusal.
	What string
}

// Knobs is every environment knob of the scenarios. tests/cluster/node/README.md,
// "Environment knobs", is this table in prose.
var Knobs = []Knob{
	{Name: "ROLLOUT_RESTARTS", Default: "5", Dir: Fewer, Scenarios: []string{"pivot"}, What: "fewer rollout restarts"},
	{Name: "PIVOT_ONLY", Default: "0", Dir: Exactly, Values: []string{"0", "1"}, Scenarios: []string{"pivot"}, What: "the rollouts and the broken rollout left out"},
	{Name: "BROKEN_ROLLOUT", Default: "1", Dir: Exactly, Values: []string{"0", "1"}, Scenarios: []string{"pivot"}, What: "the broken rollout left out"},
	{Name: "PIVOT_WAIT", Default: "120", Dir: Longer, Scenarios: []string{"pivot"}, What: "a longer bound for the Deployment to be ready beside the static apiserver"},
	{Name: "PIVOT_ORDER", Default: "documented", Dir: Exactly, Values: []string{"documented", "scheduled"}, Scenarios: []string{"pivot"}, What: "the documented order's check replaced by a note"},
	{Name: "IMAGE_CHANGE", Default: "1", Dir: Exactly, Values: []string{"0", "1"}, Scenarios: []string{"pivot", "migrate", "reboot"}, What: "the image change of the rollouts left out"},
	{Name: "MIGRATE_RESTARTS", Default: "2", Dir: Fewer, Scenarios: []string{"migrate", "reboot"}, What: "fewer rollout restarts after the migration"},
	{Name: "MIGRATE_MORE_RESTARTS", Dir: Fewer, Floor: "0", Scenarios: []string{"migrate", "reboot"}, What: "fewer rollout restarts before the image change (default: 5 in all with MIGRATE_RESTARTS)"},
	{Name: "REBOOT_BOUND", Default: "180", Dir: Longer, Scenarios: []string{"reboot", "kubeadm-upgrade"}, What: "a longer bound for the control plane to serve after the reboot"},
	{Name: "CHECKPOINT_WAIT", Dir: Longer, Scenarios: []string{"reboot", "kubeadm-upgrade"}, What: "a longer bound for the checkpoint to be written (default: --checkpoint-after + 120 s)"},
	{Name: "BROKEN_SOAK", Dir: Fewer, Scenarios: []string{"reboot"}, What: "a shorter broken rollout before the reboot (default: --checkpoint-after + 30 s)"},
	{Name: "ROTATION_LIFETIME", Default: "150", Dir: Neutral, Scenarios: []string{"reboot"}},
	{Name: "LIFECYCLE_STEPS", Default: "legacy drain slow daemonset", Dir: AllOf, Values: []string{"legacy", "drain", "slow", "slowprev", "daemonset"}, Scenarios: []string{"lifecycle"}, What: "steps left out"},
	{Name: "LEGACY_REF", Default: "9739f68", Dir: Neutral, Scenarios: []string{"lifecycle"}},
	{Name: "SLOW_START", Default: "60s", Dir: Fewer, Scenarios: []string{"lifecycle"}, What: "a shorter slow start"},
	{Name: "SLOW_START_PREVIOUS", Default: "120s", Dir: Fewer, Scenarios: []string{"lifecycle"}, What: "a shorter slow start under the previous probes"},
	{Name: "DS_RESTARTS", Default: "3", Dir: Fewer, Floor: "2", Scenarios: []string{"lifecycle"}, What: "fewer DaemonSet rollout restarts"},
	{Name: "ETCD_VERSION", Default: "v3.6.16", Dir: Neutral, Scenarios: []string{"kubeadm-upgrade"}},
	{Name: "KU_ETCD_VERSION", Default: "v3.7.0", Dir: Neutral, Scenarios: []string{"kubeadm-upgrade"}},
}

// KnobNamed is the knob of Knobs with that name; it panics on a name not in the table (a
// scenario reading a knob the table does not declare is a bug).
func KnobNamed(name string) Knob {
	for _, k := range Knobs {
		if k.Name == name {
			return k
		}
	}
	panic("knob " + name + " is not in Knobs")
}

// EnvKnob is the knob's value, or its default when unset or empty.
func EnvKnob(name string) string { return Env(name, KnobNamed(name).Default) }

// EnvKnobInt is EnvKnob as a number; def for a knob whose default is computed.
func EnvKnobInt(name string, def int) int {
	if d := KnobNamed(name).Default; d != "" {
		def, _ = strconv.Atoi(d)
	}
	return EnvInt(name, def)
}

// Judge judges value (as set; "" is unset) of the knob against def (its default, Default when
// empty) and the CI floor: a note when the value shrinks the rehearsal, an error when it is
// not a value of the knob, or when ci is set and it shrinks beyond the floor.
func (k Knob) Judge(value, def string, ci bool) (note string, err error) {
	if def == "" {
		def = k.Default
	}
	if value == "" || k.Dir == Neutral {
		return "", nil
	}
	floor := k.Floor
	if floor == "" {
		floor = def
	}
	var shrinks, beyond bool
	detail := ""
	switch k.Dir {
	case Fewer, Longer:
		duration := k.Default != "" && !isInt(k.Default) // SLOW_START: "60s"
		v, ok := knobNumber(value, duration)
		if !ok && duration {
			return "", fmt.Errorf("%s=%s is not a duration (60s, 2m)", k.Name, value)
		} else if !ok {
			return "", fmt.Errorf("%s=%s is not a whole number", k.Name, value)
		}
		d, dok := knobNumber(def, duration)
		f, fok := knobNumber(floor, duration)
		if !dok {
			// The computed default is unknown (the manifest could not be read): the scenario
			// judges it again once it knows.
			return "", nil
		}
		if k.Dir == Fewer {
			shrinks, beyond = v < d, fok && v < f
		} else {
			shrinks, beyond = v > d, fok && v > f
		}
	case Exactly:
		if !slices.Contains(k.Values, value) {
			return "", fmt.Errorf("%s=%s is not one of %s", k.Name, value, strings.Join(k.Values, ", "))
		}
		shrinks, beyond = value != def, value != floor
	case AllOf:
		words := strings.Fields(value)
		for _, w := range words {
			if !slices.Contains(k.Values, w) {
				return "", fmt.Errorf("%s=%q: %s is not one of %s", k.Name, value, w, strings.Join(k.Values, ", "))
			}
		}
		var left []string
		for _, w := range strings.Fields(def) {
			if !slices.Contains(words, w) {
				left = append(left, w)
			}
		}
		shrinks = len(left) > 0
		beyond = shrinks
		for _, w := range strings.Fields(floor) {
			beyond = beyond || !slices.Contains(words, w)
		}
		if shrinks {
			detail = ": " + strings.Join(left, ", ")
		}
	}
	if !shrinks && !beyond {
		return "", nil
	}
	if ci && beyond {
		return "", fmt.Errorf("CI is set: %s=%q is refused, %s%s; the CI floor is %s=%q", k.Name, value, k.What, detail, k.Name, floor)
	}
	limit := "refused with CI set"
	if !beyond {
		limit = fmt.Sprintf("CI floor %s", floor)
	}
	return fmt.Sprintf("NOTE: %s=%q shrinks the rehearsal: %s%s (default %q, %s)", k.Name, value, k.What, detail, def, limit), nil
}

// knobNumber reads a count or a number of seconds as EnvInt does ("120"), or, for a knob
// whose default is a duration, a Go duration ("60s", "2m") in seconds.
func knobNumber(s string, duration bool) (float64, bool) {
	if !duration {
		n, err := strconv.Atoi(s)
		return float64(n), err == nil
	}
	d, err := time.ParseDuration(s)
	return d.Seconds(), err == nil
}

func isInt(s string) bool { _, err := strconv.Atoi(s); return err == nil }

// JudgeKnobs judges every knob of scenario as lookup gives them, with the computed defaults of
// defs: the notes and the refusals, one line each.
func JudgeKnobs(scenario string, lookup func(string) string, defs map[string]string, ci bool) (notes []string, errs []string) {
	for _, k := range Knobs {
		if !slices.Contains(k.Scenarios, scenario) {
			continue
		}
		note, err := k.Judge(lookup(k.Name), defs[k.Name], ci)
		if err != nil {
			errs = append(errs, err.Error())
		} else if note != "" {
			notes = append(notes, note)
		}
	}
	return notes, errs
}

// KnobScenarios are the scenarios that read knobs (cmd/nodescenario's names).
func KnobScenarios() []string {
	var s []string
	for _, k := range Knobs {
		for _, sc := range k.Scenarios {
			if !slices.Contains(s, sc) {
				s = append(s, sc)
			}
		}
	}
	return s
}

// KnobDefaults are the defaults the scenarios compute: MIGRATE_MORE_RESTARTS from
// MIGRATE_RESTARTS, CHECKPOINT_WAIT and BROKEN_SOAK from the recovery agent's
// --checkpoint-after in repo's manifest (left out when it cannot be read).
func KnobDefaults(repo string, lookup func(string) string) map[string]string {
	restarts := 2
	if v, err := strconv.Atoi(lookup("MIGRATE_RESTARTS")); err == nil {
		restarts = v
	}
	defs := map[string]string{"MIGRATE_MORE_RESTARTS": strconv.Itoa(max(0, 5-restarts))}
	if manifest, err := os.ReadFile(filepath.Join(repo, agentManifest)); err == nil {
		if after := int(CheckpointAfter(string(manifest)).Seconds()); after > 0 {
			defs["CHECKPOINT_WAIT"] = strconv.Itoa(after + 120)
			defs["BROKEN_SOAK"] = strconv.Itoa(after + 30)
		}
	}
	return defs
}

// CheckKnobs judges the scenario's knobs as the environment sets them: each note goes to the
// report and to stderr; each refusal is a failed check. False when one was refused: the
// scenario stops at once.
func (n *Scenario) CheckKnobs(scenario string) bool {
	notes, errs := JudgeKnobs(scenario, os.Getenv, KnobDefaults(n.Repo, os.Getenv), InCI())
	for _, note := range notes {
		fmt.Fprintln(os.Stderr, note)
		n.Note("%s", note)
	}
	for _, e := range errs {
		fmt.Fprintln(os.Stderr, e)
		n.Fail("%s", e)
	}
	return len(errs) == 0
}
