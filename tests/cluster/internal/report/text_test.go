package report

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestCutAndLastLines(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{Cut("abcdef", 3), "abc…"},
		{Cut("abc", 3), "abc"},
		{LastLines("a\nb\nc\n", 2), "b\nc"},
		{LastLines("a", 3), "a"},
	} {
		if c.got != c.want {
			t.Errorf("%q, want %q", c.got, c.want)
		}
	}
}

func TestFirstLast(t *testing.T) {
	s := []int{1, 2, 3}
	if got := First(s, 2); !reflect.DeepEqual(got, []int{1, 2}) {
		t.Errorf("First: %v", got)
	}
	if got := Last(s, 2); !reflect.DeepEqual(got, []int{2, 3}) {
		t.Errorf("Last: %v", got)
	}
	if got := Last(s, 5); !reflect.DeepEqual(got, s) {
		t.Errorf("Last of more than there is: %v", got)
	}
	if got := First([]int(nil), 5); len(got) != 0 {
		t.Errorf("First of nothing: %v", got)
	}
}

func TestFileTail(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	if got := FileTail(path, 2); !strings.Contains(got, "no such file") {
		t.Errorf("FileTail of a missing file: %q", got)
	}
	if err := os.WriteFile(path, []byte("one\ntwo\nthree\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := FileTail(path, 2); got != "two\nthree" {
		t.Errorf("FileTail: %q", got)
	}
}

func TestGrep(t *testing.T) {
	log := "handoff one\nfine\nthe handoff two is long\n"
	got := Grep(log, 10, ContainsAny("handoff", "nothing"))
	if !reflect.DeepEqual(got, []string{"handoff on…", "the handof…"}) {
		t.Errorf("Grep: %q", got)
	}
	if got := Grep(log, 0, ContainsAny("two")); !reflect.DeepEqual(got, []string{"the handoff two is long"}) {
		t.Errorf("Grep without a cut: %q", got)
	}
}
