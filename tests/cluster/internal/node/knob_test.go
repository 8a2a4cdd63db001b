package node

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

func TestKnobJudge(t *testing.T) {
	for _, c := range []struct {
		name, value, def string
		ci               bool
		note, err        string // substrings; "" = none
	}{
		// Unset: the default, nothing to say.
		{"IMAGE_CHANGE", "", "", true, "", ""},
		{"IMAGE_CHANGE", "1", "", true, "", ""},
		{"IMAGE_CHANGE", "0", "", false, `NOTE: IMAGE_CHANGE="0" shrinks the rehearsal: the image change of the rollouts left out (default "1", refused with CI set)`, ""},
		{"IMAGE_CHANGE", "0", "", true, "", `CI is set: IMAGE_CHANGE="0" is refused, the image change of the rollouts left out; the CI floor is IMAGE_CHANGE="1"`},
		{"IMAGE_CHANGE", "yes", "", false, "", "IMAGE_CHANGE=yes is not one of 0, 1"},
		{"PIVOT_ONLY", "1", "", true, "", `PIVOT_ONLY="1" is refused`},
		{"BROKEN_ROLLOUT", "0", "", true, "", `BROKEN_ROLLOUT="0" is refused`},
		{"PIVOT_ORDER", "scheduled", "", true, "", `PIVOT_ORDER="scheduled" is refused`},
		// Counts: fewer shrinks; more is more.
		{"MIGRATE_RESTARTS", "5", "", true, "", ""},
		{"MIGRATE_RESTARTS", "2", "", true, "", ""},
		{"MIGRATE_RESTARTS", "1", "", false, "NOTE: MIGRATE_RESTARTS=\"1\"", ""},
		{"MIGRATE_RESTARTS", "1", "", true, "", `MIGRATE_RESTARTS="1" is refused, fewer rollout restarts after the migration; the CI floor is MIGRATE_RESTARTS="2"`},
		{"MIGRATE_RESTARTS", "two", "", true, "", "MIGRATE_RESTARTS=two is not a whole number"},
		// .ci/run's --rollouts 2: at the floor, said as a note.
		{"MIGRATE_MORE_RESTARTS", "0", "3", true, `(default "3", CI floor 0)`, ""},
		{"MIGRATE_MORE_RESTARTS", "-1", "3", true, "", "the CI floor is MIGRATE_MORE_RESTARTS=\"0\""},
		{"DS_RESTARTS", "2", "", true, `DS_RESTARTS="2" shrinks the rehearsal: fewer DaemonSet rollout restarts (default "3", CI floor 2)`, ""},
		{"DS_RESTARTS", "1", "", true, "", `DS_RESTARTS="1" is refused`},
		{"DS_RESTARTS", "7", "", true, "", ""},
		// Time bounds: longer loosens; shorter is stricter.
		{"REBOOT_BOUND", "120", "", true, "", ""},
		{"REBOOT_BOUND", "181", "", true, "", `REBOOT_BOUND="181" is refused, a longer bound`},
		{"REBOOT_BOUND", "240", "", false, `REBOOT_BOUND="240" shrinks the rehearsal`, ""},
		{"REBOOT_BOUND", "4m", "", false, "", "REBOOT_BOUND=4m is not a whole number"},
		{"CHECKPOINT_WAIT", "300", "180", true, "", `the CI floor is CHECKPOINT_WAIT="180"`},
		{"CHECKPOINT_WAIT", "300", "", true, "", ""}, // the default unknown: judged later
		// Durations: a shorter slow start shrinks.
		{"SLOW_START", "30s", "", true, "", `SLOW_START="30s" is refused`},
		{"SLOW_START", "90s", "", true, "", ""},
		{"SLOW_START", "1m", "", true, "", ""},
		{"SLOW_START", "90", "", true, "", "SLOW_START=90 is not a duration"},
		{"BROKEN_SOAK", "10", "90", true, "", "BROKEN_SOAK=\"10\" is refused"},
		// Steps: one left out is refused; one added is not.
		{"LIFECYCLE_STEPS", "legacy drain slow slowprev daemonset", "", true, "", ""},
		{"LIFECYCLE_STEPS", "slow slowprev", "", true, "", `LIFECYCLE_STEPS="slow slowprev" is refused, steps left out: legacy, drain, daemonset; the CI floor is LIFECYCLE_STEPS="legacy drain slow daemonset"`},
		{"LIFECYCLE_STEPS", "slow slowprev", "", false, "steps left out: legacy, drain, daemonset", ""},
		{"LIFECYCLE_STEPS", "legacy drian slow daemonset", "", false, "", "drian is not one of"},
		// Neutral: any value.
		{"LEGACY_REF", "abc1234", "", true, "", ""},
		{"KU_ETCD_VERSION", "v3.7.1", "", true, "", ""},
		{"ROTATION_LIFETIME", "30", "", true, "", ""},
	} {
		note, err := KnobNamed(c.name).Judge(c.value, c.def, c.ci)
		errText := ""
		if err != nil {
			errText = err.Error()
		}
		if !match(note, c.note) || !match(errText, c.err) {
			t.Errorf("%s=%q (default %q, ci %v): note %q, error %q; want %q, %q", c.name, c.value, c.def, c.ci, note, errText, c.note, c.err)
		}
	}
}

func match(got, want string) bool {
	if want == "" {
		return got == ""
	}
	return strings.Contains(got, want)
}

// The refusal is one line that names the variable, its value and the floor.
func TestKnobRefusalIsOneLine(t *testing.T) {
	for _, k := range Knobs {
		if k.Dir == Neutral {
			continue
		}
		value := map[Direction]string{Fewer: "-1", Longer: "99999", AllOf: "slowprev"}[k.Dir]
		if k.Dir == Fewer && !isInt(k.Default) && k.Default != "" {
			value = "1s"
		}
		if k.Dir == Exactly {
			value = k.Values[0]
			if value == k.Default {
				value = k.Values[1]
			}
		}
		def := "" // the table's
		if k.Default == "" {
			def = "60" // a computed one
		}
		_, err := k.Judge(value, def, true)
		if err == nil || strings.Contains(err.Error(), "\n") || !strings.Contains(err.Error(), k.Name+"=") || !strings.Contains(err.Error(), "CI floor") {
			t.Errorf("%s=%s with CI: %v", k.Name, value, err)
		}
	}
}

func TestJudgeKnobsByScenario(t *testing.T) {
	env := map[string]string{"MIGRATE_RESTARTS": "2", "MIGRATE_MORE_RESTARTS": "0", "DS_RESTARTS": "2", "IMAGE_CHANGE": "0"}
	lookup := func(k string) string { return env[k] }
	defs := KnobDefaults("../../../..", lookup)
	if defs["MIGRATE_MORE_RESTARTS"] != "3" || defs["CHECKPOINT_WAIT"] != "180" || defs["BROKEN_SOAK"] != "90" {
		t.Fatalf("computed defaults: %v", defs)
	}
	// IMAGE_CHANGE is the migration's (also run by the reboot's rehearsal) and the pivot's,
	// not the lifecycle's.
	if notes, errs := JudgeKnobs("lifecycle", lookup, defs, true); len(errs) != 0 || len(notes) != 1 || !strings.Contains(notes[0], "DS_RESTARTS") {
		t.Errorf("lifecycle: %q %q", notes, errs)
	}
	for _, sc := range []string{"migrate", "reboot"} {
		if _, errs := JudgeKnobs(sc, lookup, defs, true); len(errs) != 1 || !strings.Contains(errs[0], "IMAGE_CHANGE") {
			t.Errorf("%s: %q", sc, errs)
		}
	}
	// tests/cluster/run --rollouts 2 with CI: notes, no refusal.
	delete(env, "IMAGE_CHANGE")
	for _, sc := range KnobScenarios() {
		if _, errs := JudgeKnobs(sc, lookup, defs, true); len(errs) != 0 {
			t.Errorf("%s with --rollouts 2: %q", sc, errs)
		}
	}
	if notes, _ := JudgeKnobs("migrate", lookup, defs, true); len(notes) != 1 || !strings.Contains(notes[0], "MIGRATE_MORE_RESTARTS") {
		t.Errorf("migrate notes: %q", notes)
	}
	// --rollouts 1 with CI: refused.
	env["MIGRATE_RESTARTS"], env["DS_RESTARTS"] = "1", "1"
	for _, sc := range []string{"migrate", "lifecycle"} {
		if _, errs := JudgeKnobs(sc, lookup, KnobDefaults("../../../..", lookup), true); len(errs) != 1 {
			t.Errorf("%s with --rollouts 1: %q", sc, errs)
		}
	}
}

// Every knob the package reads is in the table, by name; every default the table gives is the
// one its doc comments give.
func TestEveryKnobDeclared(t *testing.T) {
	files, _ := os.ReadDir(".")
	read := regexp.MustCompile(`(?:Env|EnvInt|EnvKnob|EnvKnobInt|Getenv)\("([A-Z_]+)"`)
	for _, f := range files {
		if !strings.HasSuffix(f.Name(), ".go") || strings.HasSuffix(f.Name(), "_test.go") || f.Name() == "knob.go" {
			continue
		}
		src, _ := os.ReadFile(f.Name())
		for _, m := range read.FindAllStringSubmatch(string(src), -1) {
			if m[1] == "CI" || m[1] == "PATH" {
				continue
			}
			if !slices.ContainsFunc(Knobs, func(k Knob) bool { return k.Name == m[1] }) {
				t.Errorf("%s reads %s, which Knobs does not declare", f.Name(), m[1])
			}
		}
	}
}
