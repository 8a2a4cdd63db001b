package cluster

import (
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

func pod(name string, ready, mirrored bool) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name)}}
	if mirrored {
		p.OwnerReferences = []metav1.OwnerReference{{Kind: "Node", Name: "n"}}
	}
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: status}}
	return p
}

// A mirror pod's flip within an excuse's window that ended is a note; one outside it, one
// that did not end, or one of a pod the kubelet does not mirror stays a problem.
func TestExcusedFlips(t *testing.T) {
	w := &PodWatcher{byUID: map[string]*PodHistory{}, mirrors: true}
	t0 := time.Now()
	w.observe([]any{pod("etcd", true, true), pod("web", true, false), pod("sched", true, true)})
	w.observe([]any{pod("etcd", false, true), pod("web", false, false), pod("sched", false, true)})
	w.observe([]any{pod("etcd", true, true), pod("web", true, false), pod("sched", false, true)})
	excuse := []Excuse{{From: t0, To: time.Now().Add(time.Second), Why: "the kubelet restarted"}}

	problems, notes := w.watch.Problems(excuse)
	if len(notes) != 1 || !strings.Contains(notes[0], "pod etcd: 1 Ready flips, excused (the kubelet restarted)") {
		t.Errorf("notes: %q", notes)
	}
	if len(problems) != 2 || !strings.Contains(problems[0], "pod web: 1 Ready flips") || !strings.Contains(problems[1], "pod sched: 1 Ready flips, 0 restarts (unready from") || !strings.Contains(problems[1], "until the end") {
		t.Errorf("problems: %q", problems)
	}
	late := []Excuse{{From: time.Now().Add(time.Minute), To: time.Now().Add(2 * time.Minute), Why: "later"}}
	if problems, notes := w.watch.Problems(late); len(problems) != 3 || len(notes) != 0 {
		t.Errorf("outside the window: problems %q, notes %q", problems, notes)
	}
	if problems, _ := w.watch.Problems(nil); len(problems) != 3 {
		t.Errorf("no excuse: %q", problems)
	}
}
