// Package report is how the tier's checks are recorded and said: a Record of passes,
// failures and notes (record.go), and the text helpers that shape a diagnostic into a report
// line (text.go).
package report

import (
	"os"
	"strings"
)

// Cut shortens s to at most max bytes and marks the cut with "…" (a report line stays
// readable).
func Cut(s string, max int) string {
	if len(s) <= max {
		return s
	}
	return s[:max] + "…"
}

// First is the first n items of s (all when it has fewer).
func First[T any](s []T, n int) []T {
	return s[:min(len(s), n)]
}

// Last is the last n items of s (all when it has fewer).
func Last[T any](s []T, n int) []T {
	return s[max(0, len(s)-n):]
}

// LastLines is the last n lines of text (all when it has fewer), without its final newline.
func LastLines(text string, n int) string {
	return strings.Join(Last(strings.Split(strings.TrimRight(text, "\n"), "\n"), n), "\n")
}

// FileTail is the last n lines of a file (a log), or why it could not be read.
func FileTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	return LastLines(string(b), n)
}

// Grep is the lines of text that match, each cut to at most cut bytes (0: not cut).
func Grep(text string, cut int, match func(line string) bool) []string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if match(l) {
			if cut > 0 {
				l = Cut(l, cut)
			}
			out = append(out, l)
		}
	}
	return out
}

// ContainsAny matches a line that contains one of words.
func ContainsAny(words ...string) func(line string) bool {
	return func(line string) bool {
		for _, w := range words {
			if strings.Contains(line, w) {
				return true
			}
		}
		return false
	}
}
