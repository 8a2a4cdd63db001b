package cluster

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// PodHistory is what a PodWatcher saw of one pod.
type PodHistory struct {
	Name      string    `json:"name"`
	FirstSeen time.Time `json:"first_seen"`
	LastSeen  time.Time `json:"last_seen"`
	ReadyAt   time.Time `json:"ready_at,omitzero"`
	Flips     int       `json:"ready_flips"`
	// Unready: from each flip (Ready true to false) until Ready again (To zero: not again).
	Unready  []Span        `json:"unready,omitempty"`
	Mirror   bool          `json:"mirror,omitempty"`
	Restarts int32         `json:"restarts"`
	Ready    bool          `json:"-"`
	base     int32         // restarts when first seen
	Seen     time.Duration `json:"seen_ns"`
}

// Span is a time from From to To.
type Span struct {
	From time.Time `json:"from"`
	To   time.Time `json:"to,omitzero"`
}

// Excuse is a window in which a mirror pod's Ready flip that ended within the step is known
// to belong to the kubelet, not to the subject of the step, and Why.
type Excuse struct {
	From, To time.Time
	Why      string
}

// excused: every Ready flip of h ended and began within one of excuses, and h is a mirror pod.
func (h *PodHistory) excused(excuses []Excuse) bool {
	if !h.Mirror {
		return false
	}
	for _, u := range h.Unready {
		if u.To.IsZero() || !slices.ContainsFunc(excuses, func(e Excuse) bool {
			return !u.From.Before(e.From) && !u.From.After(e.To)
		}) {
			return false
		}
	}
	return true
}

// PodWatch is a PodWatcher's record: every pod and the most seen at once.
type PodWatch struct {
	Selector string        `json:"selector"`
	Pods     []*PodHistory `json:"pods"`
	Most     int           `json:"most_at_once"`
	Errors   []string      `json:"watch_errors,omitempty"`
}

// Problems: a Ready condition that went from true to false while the pod was not being
// deleted (unless the flips of a mirror pod are excused: each began within an excuse's window
// and ended), a container restart, a watch that failed. Excused flips are in notes.
func (w *PodWatch) Problems(excuses []Excuse) (p, notes []string) {
	for _, h := range w.Pods {
		flips := h.Flips
		if flips > 0 && h.excused(excuses) {
			notes = append(notes, fmt.Sprintf("pod %s: %d Ready flips, excused (%s): %s", h.Name, flips, whys(excuses), spans(h.Unready)))
			flips = 0
		}
		if flips > 0 || h.Restarts > 0 {
			p = append(p, fmt.Sprintf("pod %s: %d Ready flips, %d restarts%s", h.Name, h.Flips, h.Restarts, unreadyClause(h.Unready)))
		}
	}
	for _, e := range w.Errors {
		p = append(p, "pod watch ("+w.Selector+") failed: "+e)
	}
	return p, notes
}

func whys(excuses []Excuse) string {
	var w []string
	for _, e := range excuses {
		w = append(w, e.Why)
	}
	return strings.Join(w, "; ")
}

// spans: "unready from 15:04:05.000 for 0.412 s, …" (or "until the end").
func spans(u []Span) string {
	var parts []string
	for _, s := range u {
		if s.To.IsZero() {
			parts = append(parts, "unready from "+s.From.Format("15:04:05.000")+" until the end")
		} else {
			parts = append(parts, fmt.Sprintf("unready from %s for %.3f s", s.From.Format("15:04:05.000"), s.To.Sub(s.From).Seconds()))
		}
	}
	return strings.Join(parts, ", ")
}

func unreadyClause(u []Span) string {
	if len(u) == 0 {
		return ""
	}
	return " (" + spans(u) + ")"
}

// String: one clause per pod (seen for how long, when Ready, flips, restarts), then the most
// pods seen at once.
func (w *PodWatch) String() string {
	var parts []string
	for _, h := range w.Pods {
		ready := "never Ready"
		if !h.ReadyAt.IsZero() {
			ready = fmt.Sprintf("Ready after %.0f s", h.ReadyAt.Sub(h.FirstSeen).Seconds())
		}
		parts = append(parts, fmt.Sprintf("%s: seen %.0f s, %s, %d Ready flips, %d restarts", h.Name, h.Seen.Seconds(), ready, h.Flips, h.Restarts))
	}
	parts = append(parts, fmt.Sprintf("at most %d pods at once", w.Most))
	return strings.Join(parts, "; ")
}

// PodWatcher follows the pods of one namespace and label selector through an informer.
type PodWatcher struct {
	mu      sync.Mutex
	watch   PodWatch
	byUID   map[string]*PodHistory
	mirrors bool
	list    func() []any
	// behind: Behind for the informer (set at the start).
	behind func(context.Context) string
	cancel context.CancelFunc
	done   chan struct{}
}

// WatchPods starts following the pods of namespace matching selector with the clients of
// kubeconfig. mirrors: count the kubelet's mirror pods of static pods too (owned by a Node).
func WatchPods(parent context.Context, kubeconfig, namespace, selector string, mirrors bool) (*PodWatcher, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(parent)
	w := &PodWatcher{watch: PodWatch{Selector: namespace + "/" + selector}, byUID: map[string]*PodHistory{}, mirrors: mirrors, cancel: cancel, done: make(chan struct{})}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = selector }))
	inf := factory.Core().V1().Pods().Informer()
	w.list = inf.GetStore().List
	w.behind = func(ctx context.Context) string {
		return Behind(ctx, "the pod watcher of "+w.watch.Selector, WatcherCatchUp,
			func() Versions { return storeVersions(inf.GetStore()) },
			func(ctx context.Context) (Versions, error) {
				l, err := client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
				if err != nil {
					return nil, err
				}
				return versionsOf(l.Items), nil
			})
	}
	update := func(any) { w.observe(w.list()) }
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: update, UpdateFunc: func(_, o any) { update(o) }, DeleteFunc: update,
	}); err != nil {
		cancel()
		return nil, err
	}
	if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if ApiserversOwnWatchEnd(err) || ctx.Err() != nil {
			return
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		w.watch.Errors = append(w.watch.Errors, fmt.Sprintf("%s: %v", time.Now().Format("15:04:05.000"), err))
	}); err != nil {
		cancel()
		return nil, err
	}
	factory.Start(ctx.Done())
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			cancel()
			return nil, fmt.Errorf("watch %v: not synced", typ)
		}
	}
	go func() {
		<-ctx.Done()
		factory.Shutdown()
		close(w.done)
	}()
	return w, nil
}

func mirror(p *corev1.Pod) bool {
	for _, o := range p.OwnerReferences {
		if o.Kind == "Node" {
			return true
		}
	}
	return false
}

func (w *PodWatcher) observe(objs []any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	n := 0
	for _, o := range objs {
		p, ok := o.(*corev1.Pod)
		if !ok || (!w.mirrors && mirror(p)) {
			continue
		}
		n++
		ready := false
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady {
				ready = c.Status == corev1.ConditionTrue
			}
		}
		var restarts int32
		for _, c := range p.Status.ContainerStatuses {
			restarts += c.RestartCount
		}
		h := w.byUID[string(p.UID)]
		if h == nil {
			h = &PodHistory{Name: p.Name, FirstSeen: now, base: restarts, Mirror: mirror(p)}
			w.byUID[string(p.UID)] = h
			w.watch.Pods = append(w.watch.Pods, h)
		}
		if h.Ready && !ready && p.DeletionTimestamp == nil {
			h.Flips++
			h.Unready = append(h.Unready, Span{From: now})
		}
		if ready && len(h.Unready) > 0 && h.Unready[len(h.Unready)-1].To.IsZero() {
			h.Unready[len(h.Unready)-1].To = now
		}
		if ready && h.ReadyAt.IsZero() {
			h.ReadyAt = now
		}
		h.Ready, h.LastSeen, h.Seen = ready, now, now.Sub(h.FirstSeen)
		h.Restarts = max(h.Restarts, restarts-h.base)
	}
	w.watch.Most = max(w.watch.Most, n)
}

// Stop ends the watcher and returns its record; a watcher that did not catch up with the
// apiserver within WatcherCatchUp (a hung watch, blind to every change after it) is one of its
// errors.
func (w *PodWatcher) Stop() PodWatch {
	behind := w.behind(context.Background())
	w.observe(w.list())
	w.cancel()
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	sort.SliceStable(w.watch.Pods, func(i, j int) bool { return w.watch.Pods[i].FirstSeen.Before(w.watch.Pods[j].FirstSeen) })
	if behind != "" {
		w.watch.Errors = append(w.watch.Errors, behind)
	}
	return w.watch
}
