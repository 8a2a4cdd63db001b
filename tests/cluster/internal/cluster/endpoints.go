package cluster

import (
	"context"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// Gap is an interval in which default/kubernetes had no ready address.
type Gap struct {
	Object   string        `json:"object"` // "endpoints" or "endpointslice"
	From     time.Time     `json:"from"`
	Duration time.Duration `json:"duration_ns"`
	Open     bool          `json:"open,omitempty"` // still empty when the watcher stopped
}

// EndpointsWatcher records every interval in which the `kubernetes` Service's Endpoints or
// EndpointSlice has no ready address, as in-cluster clients would find it.
type EndpointsWatcher struct {
	mu     sync.Mutex
	since  map[string]time.Time // object -> when it became empty
	gaps   []Gap
	cancel context.CancelFunc
	done   chan struct{}
}

// WatchEndpoints starts the watcher with the clients of kubeconfig.
func WatchEndpoints(parent context.Context, kubeconfig string) (*EndpointsWatcher, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(parent)
	w := &EndpointsWatcher{since: map[string]time.Time{}, cancel: cancel, done: make(chan struct{})}
	eps := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace("default"),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", "kubernetes").String()
		}))
	slices := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace("default"),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.LabelSelector = labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: "kubernetes"}).String()
		}))
	epInf := eps.Core().V1().Endpoints().Informer()
	slInf := slices.Discovery().V1().EndpointSlices().Informer()
	handler := func(object string, store func() cache.Store, ready func(any) bool) cache.ResourceEventHandlerFuncs {
		update := func() {
			any := false
			for _, o := range store().List() {
				if ready(o) {
					any = true
				}
			}
			w.observe(object, any)
		}
		return cache.ResourceEventHandlerFuncs{
			AddFunc:    func(any) { update() },
			UpdateFunc: func(any, any) { update() },
			DeleteFunc: func(any) { update() },
		}
	}
	if _, err := epInf.AddEventHandler(handler("endpoints", epInf.GetStore, endpointsReady)); err != nil {
		cancel()
		return nil, err
	}
	if _, err := slInf.AddEventHandler(handler("endpointslice", slInf.GetStore, sliceReady)); err != nil {
		cancel()
		return nil, err
	}
	eps.Start(ctx.Done())
	slices.Start(ctx.Done())
	eps.WaitForCacheSync(ctx.Done())
	slices.WaitForCacheSync(ctx.Done())
	go func() {
		<-ctx.Done()
		eps.Shutdown()
		slices.Shutdown()
		close(w.done)
	}()
	return w, nil
}

func endpointsReady(o any) bool {
	ep, ok := o.(*corev1.Endpoints)
	if !ok {
		return false
	}
	for _, s := range ep.Subsets {
		if len(s.Addresses) > 0 {
			return true
		}
	}
	return false
}

func sliceReady(o any) bool {
	s, ok := o.(*discoveryv1.EndpointSlice)
	if !ok {
		return false
	}
	for _, e := range s.Endpoints {
		if e.Conditions.Ready == nil || *e.Conditions.Ready {
			return true
		}
	}
	return false
}

func (w *EndpointsWatcher) observe(object string, ready bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	from, empty := w.since[object]
	switch {
	case !ready && !empty:
		w.since[object] = time.Now()
	case ready && empty:
		delete(w.since, object)
		w.gaps = append(w.gaps, Gap{Object: object, From: from, Duration: time.Since(from)})
	}
}

// Take returns the gaps recorded since the last Take (an open one up to now, marked open)
// and forgets them.
func (w *EndpointsWatcher) Take() []Gap {
	w.mu.Lock()
	defer w.mu.Unlock()
	gaps := w.gaps
	w.gaps = nil
	now := time.Now()
	for object, from := range w.since {
		gaps = append(gaps, Gap{Object: object, From: from, Duration: now.Sub(from), Open: true})
		// The rest of this gap belongs to the next period: never report a stretch twice.
		w.since[object] = now
	}
	return gaps
}

// Stop ends the watcher.
func (w *EndpointsWatcher) Stop() {
	w.cancel()
	<-w.done
}
