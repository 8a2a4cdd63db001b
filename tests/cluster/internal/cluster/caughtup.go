package cluster

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/client-go/tools/cache"

	"kube-apiserver-proxy/tests/cluster/internal/await"
)

// WatcherCatchUp bounds how long an observer's informer (the default/kubernetes watcher, the
// pod watchers) may take, at the end of a scenario or step, to hold what the apiserver lists:
// the load's own bound for a watch to deliver a write (load.DeliveryBound).
const WatcherCatchUp = 10 * time.Second

// Versions are the objects an informer holds or the apiserver lists: namespace/name ->
// resourceVersion.
type Versions map[string]string

// versionsOf are the objects of a list the apiserver returned.
func versionsOf[T any, P interface {
	*T
	GetNamespace() string
	GetName() string
	GetResourceVersion() string
}](items []T) Versions {
	v := Versions{}
	for i := range items {
		o := P(&items[i])
		v[o.GetNamespace()+"/"+o.GetName()] = o.GetResourceVersion()
	}
	return v
}

// storeVersions are the objects of an informer's store.
func storeVersions(store cache.Store) Versions {
	v := Versions{}
	for _, o := range store.List() {
		if m, err := meta.Accessor(o); err == nil {
			v[m.GetNamespace()+"/"+m.GetName()] = m.GetResourceVersion()
		}
	}
	return v
}

// Behind compares what an observer's informer holds (have) with what the apiserver lists now
// (list, a quorum read), for up to bound: "" as soon as they are the same, else why not. An
// observer whose watch hangs (the connection kept open, nothing relayed: no byte, no FIN)
// misses every change after the hang, so it would report nothing wrong about them: its store
// stays behind the apiserver's and this says so. A watch that ended with an error is seen by
// the watch error handlers; one that only resumed late catches up here; one that hangs while
// nothing changes missed nothing.
func Behind(ctx context.Context, what string, bound time.Duration, have func() Versions, list func(context.Context) (Versions, error)) string {
	caughtUp := await.Seen(what+" caught up with the apiserver", func() (bool, string) {
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		want, err := list(lctx)
		if err != nil {
			return false, fmt.Sprintf("list: %v", err)
		}
		got := have()
		return maps.Equal(want, got), versionsDiff(want, got)
	})
	if err := await.Until(ctx, 200*time.Millisecond, bound, caughtUp); err != nil {
		return err.Error() + " (a hung watch?)"
	}
	return ""
}

// versionsDiff says which objects differ: "ns/name: apiserver RV, informer RV" (absent: -).
func versionsDiff(want, got Versions) string {
	keys := slices.Sorted(maps.Keys(want))
	for k := range got {
		if _, ok := want[k]; !ok {
			keys = append(keys, k)
		}
	}
	var out []string
	for _, k := range keys {
		w, g := want[k], got[k]
		if w == g {
			continue
		}
		out = append(out, fmt.Sprintf("%s: apiserver %s, informer %s", k, orDash(w), orDash(g)))
	}
	return strings.Join(out, "; ")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
