package cluster

import (
	"context"
	"errors"
	"maps"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestBehind(t *testing.T) {
	ctx := context.Background()
	apiserver := Versions{"default/kubernetes": "7", "default/other": "3"}
	list := func(context.Context) (Versions, error) { return apiserver, nil }

	if b := Behind(ctx, "w", time.Second, func() Versions { return Versions{"default/kubernetes": "7", "default/other": "3"} }, list); b != "" {
		t.Fatalf("caught up, but: %s", b)
	}

	// Late, then caught up: an informer whose watch resumed.
	var calls atomic.Int32
	late := func() Versions {
		if calls.Add(1) < 3 {
			return Versions{"default/kubernetes": "5", "default/other": "3"}
		}
		return Versions{"default/kubernetes": "7", "default/other": "3"}
	}
	if b := Behind(ctx, "w", 5*time.Second, late, list); b != "" {
		t.Fatalf("caught up late, but: %s", b)
	}

	// A hung watch: the change of default/kubernetes and the new object never arrive.
	hung := func() Versions { return Versions{"default/kubernetes": "5", "default/gone": "2"} }
	b := Behind(ctx, "the watcher", 500*time.Millisecond, hung, list)
	for _, want := range []string{"the watcher caught up with the apiserver: not within 500ms (last seen: ", "default/kubernetes: apiserver 7, informer 5", "default/other: apiserver 3, informer -", "default/gone: apiserver -, informer 2"} {
		if !strings.Contains(b, want) {
			t.Errorf("%q lacks %q", b, want)
		}
	}

	// The apiserver cannot be asked: not caught up either.
	failing := func(context.Context) (Versions, error) { return nil, errors.New("connection refused") }
	if b := Behind(ctx, "w", 300*time.Millisecond, func() Versions { return apiserver }, failing); !strings.Contains(b, "list: connection refused") {
		t.Errorf("list error: %q", b)
	}
}

func TestVersionsOf(t *testing.T) {
	pods := []corev1.Pod{
		{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "a", ResourceVersion: "5"}},
		{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "b", ResourceVersion: "9"}},
	}
	want := Versions{"kube-system/a": "5", "default/b": "9"}
	if got := versionsOf(pods); !maps.Equal(got, want) {
		t.Fatalf("versionsOf = %v, want %v", got, want)
	}
}
