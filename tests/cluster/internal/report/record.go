package report

import (
	"fmt"
	"io"
	"strings"
	"sync"
)

// Kind is what an entry of a Record says.
type Kind int

const (
	// Pass is a check that held.
	Pass Kind = iota
	// Fail is a check that did not hold.
	Fail
	// Note is a figure or a diagnostic, neither a pass nor a failure.
	Note
)

// prefix is the kind as a line of the smoke format begins: tests/cluster/node/smoke counts
// the "ok   - " and "FAIL - " lines and prints the rest as they come.
var prefix = map[Kind]string{Pass: "ok   - ", Fail: "FAIL - ", Note: "# "}

// Entry is one check's outcome, or a note.
type Entry struct {
	Kind    Kind
	Message string
}

// Line is the entry as one line of the smoke format: "ok   - …", "FAIL - …" or "# …", the
// message's newlines made spaces.
func (e Entry) Line() string {
	return prefix[e.Kind] + strings.ReplaceAll(e.Message, "\n", " ")
}

// Record is how every check of the tier is recorded, the same way in the rehearsal's
// scenarios and in the real-kubelet stage's: in order, each a pass, a failure or a note. A
// Record with an output writes each entry there as its Line when it is recorded (the
// real-kubelet stage's scenarios, read by smoke as they run); one without keeps them for its
// owner to say (the rehearsal's results). Safe for concurrent use; the zero Record keeps
// entries and writes nothing.
type Record struct {
	mu      sync.Mutex
	out     io.Writer
	entries []Entry
}

// NewRecord is a Record that writes each entry to out as it is recorded (nil: it writes
// nothing).
func NewRecord(out io.Writer) *Record { return &Record{out: out} }

// Pass, Fail and Note record one entry.
func (r *Record) Pass(format string, a ...any) { r.add(Pass, format, a...) }
func (r *Record) Fail(format string, a ...any) { r.add(Fail, format, a...) }
func (r *Record) Note(format string, a ...any) { r.add(Note, format, a...) }

// Check records a pass or a failure with the same message, as ok says, and returns ok.
func (r *Record) Check(ok bool, format string, a ...any) bool {
	if ok {
		r.Pass(format, a...)
	} else {
		r.Fail(format, a...)
	}
	return ok
}

func (r *Record) add(k Kind, format string, a ...any) {
	e := Entry{Kind: k, Message: fmt.Sprintf(format, a...)}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.entries = append(r.entries, e)
	if r.out != nil {
		fmt.Fprintln(r.out, e.Line())
	}
}

// WriteLine writes a line that is no entry (a request to smoke, "@node …") to the output,
// between entries, never inside one.
func (r *Record) WriteLine(line string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.out != nil {
		fmt.Fprintln(r.out, line)
	}
}

// Passed and Failed are how many checks held and how many did not.
func (r *Record) Passed() int { return r.count(Pass) }
func (r *Record) Failed() int { return r.count(Fail) }

func (r *Record) count(k Kind) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, e := range r.entries {
		if e.Kind == k {
			n++
		}
	}
	return n
}

// Failures and Notes are the messages of the failed checks and of the notes, in order.
func (r *Record) Failures() []string { return r.messages(Fail) }
func (r *Record) Notes() []string    { return r.messages(Note) }

func (r *Record) messages(k Kind) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.entries {
		if e.Kind == k {
			out = append(out, e.Message)
		}
	}
	return out
}
