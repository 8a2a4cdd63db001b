package cluster

import (
	"context"
	"fmt"
	"os/exec"
	"reflect"
	"strings"
	"sync"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/retry"
)

// Gap is an interval in which default/kubernetes had no ready address.
type Gap struct {
	Object   string        `json:"object"` // "endpoints" or "endpointslice"
	From     time.Time     `json:"from"`
	Duration time.Duration `json:"duration_ns"`
	Open     bool          `json:"open,omitempty"` // still empty when the watcher stopped
}

// EndpointsWatcher records every interval in which the `kubernetes` Service's Endpoints or
// EndpointSlice has no ready address, as in-cluster clients would find it. An object that is
// not there at all has no ready address: the watcher starts from what it finds at its start,
// not from its first change. The watcher's own watch errors are recorded too (a watcher that
// lost its watch would see no gap).
type EndpointsWatcher struct {
	mu     sync.Mutex
	since  map[string]time.Time // object -> when it became empty
	gaps   []Gap
	errors []string
	cancel context.CancelFunc
	done   chan struct{}
	// behind: Behind for both informers (set at the start).
	behind func(context.Context) string
	// The ready addresses each object lists now, and the absences of tracked addresses
	// (addresses.go).
	addrs    map[string]map[string]bool
	tracked  map[string]map[string]time.Time // address -> object -> missing since
	absences []Absence
}

// WatchEndpoints starts the watcher with the clients of kubeconfig.
func WatchEndpoints(parent context.Context, kubeconfig string) (*EndpointsWatcher, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	cfg.WarningHandler = rest.NoWarnings{} // "v1 Endpoints is deprecated": watched on purpose
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(parent)
	w := &EndpointsWatcher{
		since: map[string]time.Time{}, cancel: cancel, done: make(chan struct{}),
		addrs: map[string]map[string]bool{}, tracked: map[string]map[string]time.Time{},
	}
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
	handler := func(object string, store func() cache.Store, ready func(any) []string) cache.ResourceEventHandlerFuncs {
		update := func() {
			addrs := map[string]bool{}
			for _, o := range store().List() {
				for _, a := range ready(o) {
					addrs[a] = true
				}
			}
			w.observe(object, addrs)
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
	for object, inf := range map[string]cache.SharedIndexInformer{"endpoints": epInf, "endpointslice": slInf} {
		if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
			if ApiserversOwnWatchEnd(err) || ctx.Err() != nil {
				return
			}
			w.mu.Lock()
			defer w.mu.Unlock()
			w.errors = append(w.errors, fmt.Sprintf("%s %s: %v", time.Now().Format("15:04:05.000"), object, err))
		}); err != nil {
			cancel()
			return nil, err
		}
	}
	eps.Start(ctx.Done())
	slices.Start(ctx.Done())
	for _, synced := range []map[reflect.Type]bool{eps.WaitForCacheSync(ctx.Done()), slices.WaitForCacheSync(ctx.Done())} {
		for typ, ok := range synced {
			if !ok {
				cancel()
				return nil, fmt.Errorf("watch %v of default/kubernetes: not synced", typ)
			}
		}
	}
	epSel := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", "kubernetes").String()}
	slSel := metav1.ListOptions{LabelSelector: labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: "kubernetes"}).String()}
	w.behind = func(ctx context.Context) string {
		if b := Behind(ctx, "the default/kubernetes Endpoints watcher", WatcherCatchUp,
			func() Versions { return storeVersions(epInf.GetStore()) },
			func(ctx context.Context) (Versions, error) {
				l, err := client.CoreV1().Endpoints("default").List(ctx, epSel)
				if err != nil {
					return nil, err
				}
				return versionsOf(l.Items), nil
			}); b != "" {
			return b
		}
		return Behind(ctx, "the default/kubernetes EndpointSlice watcher", WatcherCatchUp,
			func() Versions { return storeVersions(slInf.GetStore()) },
			func(ctx context.Context) (Versions, error) {
				l, err := client.DiscoveryV1().EndpointSlices("default").List(ctx, slSel)
				if err != nil {
					return nil, err
				}
				return versionsOf(l.Items), nil
			})
	}
	// The state at the start, whatever it is: an object that is missing or empty now is a gap
	// from now on (no event would ever say so).
	handler("endpoints", epInf.GetStore, endpointsReady).OnAdd(nil, true)
	handler("endpointslice", slInf.GetStore, sliceReady).OnAdd(nil, true)
	go func() {
		<-ctx.Done()
		eps.Shutdown()
		slices.Shutdown()
		close(w.done)
	}()
	return w, nil
}

// endpointsReady are the ready addresses of an Endpoints (its subsets' addresses).
func endpointsReady(o any) []string {
	ep, ok := o.(*corev1.Endpoints)
	if !ok {
		return nil
	}
	var out []string
	for _, s := range ep.Subsets {
		for _, a := range s.Addresses {
			out = append(out, a.IP)
		}
	}
	return out
}

// sliceReady are the addresses of an EndpointSlice's ready endpoints (no condition: ready).
func sliceReady(o any) []string {
	s, ok := o.(*discoveryv1.EndpointSlice)
	if !ok {
		return nil
	}
	var out []string
	for _, e := range s.Endpoints {
		if e.Conditions.Ready == nil || *e.Conditions.Ready {
			out = append(out, e.Addresses...)
		}
	}
	return out
}

func (w *EndpointsWatcher) observe(object string, addrs map[string]bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.observeAddresses(object, addrs)
	ready := len(addrs) > 0
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

// TakeErrors returns the watcher's own watch errors since the last call and forgets them.
func (w *EndpointsWatcher) TakeErrors() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	errs := w.errors
	w.errors = nil
	return errs
}

// Behind says whether the watcher's informers hold what the apiserver lists (""), waiting
// up to WatcherCatchUp for them to catch up; else why not (a hung watch: see Behind).
func (w *EndpointsWatcher) Behind(ctx context.Context) string {
	return w.behind(ctx)
}

// Stop ends the watcher.
func (w *EndpointsWatcher) Stop() {
	w.cancel()
	<-w.done
}

// Empty reports whether object ("endpoints" or "endpointslice") has no ready address now
// (missing, or listing none).
func (w *EndpointsWatcher) Empty(object string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, empty := w.since[object]
	return empty
}

// ApplyKubernetesEndpoints runs `proxy kubernetes-endpoints --address ip` and applies what it
// prints, as `| kubectl apply -f -` does in docs/operations.md: each object created, or
// replaced when it exists.
func ApplyKubernetesEndpoints(ctx context.Context, kubeconfig, proxy, ip string) error {
	out, err := exec.CommandContext(ctx, proxy, "kubernetes-endpoints", "--address", ip).Output()
	if err != nil {
		return fmt.Errorf("%s kubernetes-endpoints: %w", proxy, err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	// "v1 Endpoints is deprecated": known, and the objects are applied on purpose.
	cfg.WarningHandler = rest.NoWarnings{}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	decode := scheme.Codecs.UniversalDeserializer()
	for _, doc := range strings.Split(string(out), "\n---\n") {
		obj, _, err := decode.Decode([]byte(doc), nil, nil)
		if err != nil {
			return fmt.Errorf("kubernetes-endpoints printed an object client-go cannot read: %w", err)
		}
		switch o := obj.(type) {
		case *corev1.Endpoints:
			api := client.CoreV1().Endpoints(o.Namespace)
			err = createOrReplace(ctx, o, func() (metav1.Object, error) { return api.Get(ctx, o.Name, metav1.GetOptions{}) },
				func() error { _, err := api.Create(ctx, o, metav1.CreateOptions{}); return err },
				func() error { _, err := api.Update(ctx, o, metav1.UpdateOptions{}); return err })
		case *discoveryv1.EndpointSlice:
			api := client.DiscoveryV1().EndpointSlices(o.Namespace)
			err = createOrReplace(ctx, o, func() (metav1.Object, error) { return api.Get(ctx, o.Name, metav1.GetOptions{}) },
				func() error { _, err := api.Create(ctx, o, metav1.CreateOptions{}); return err },
				func() error { _, err := api.Update(ctx, o, metav1.UpdateOptions{}); return err })
		case *admissionregistrationv1.ValidatingAdmissionPolicy:
			api := client.AdmissionregistrationV1().ValidatingAdmissionPolicies()
			err = createOrReplace(ctx, o, func() (metav1.Object, error) { return api.Get(ctx, o.Name, metav1.GetOptions{}) },
				func() error { _, err := api.Create(ctx, o, metav1.CreateOptions{}); return err },
				func() error { _, err := api.Update(ctx, o, metav1.UpdateOptions{}); return err })
		case *admissionregistrationv1.ValidatingAdmissionPolicyBinding:
			api := client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings()
			err = createOrReplace(ctx, o, func() (metav1.Object, error) { return api.Get(ctx, o.Name, metav1.GetOptions{}) },
				func() error { _, err := api.Create(ctx, o, metav1.CreateOptions{}); return err },
				func() error { _, err := api.Update(ctx, o, metav1.UpdateOptions{}); return err })
		default:
			return fmt.Errorf("kubernetes-endpoints printed an unexpected %T", obj)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func createOrReplace(ctx context.Context, o metav1.Object, get func() (metav1.Object, error), create, update func() error) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := get()
		if apierrors.IsNotFound(err) {
			return create()
		}
		if err != nil {
			return err
		}
		o.SetResourceVersion(cur.GetResourceVersion())
		return update()
	})
}

// ApiserversOwnWatchEnd: a watch error that is the apiserver's own doing, after which the
// reflector lists again as every client does: a resourceVersion older than a new apiserver's
// watch cache reaches back (Expired, Gone), or a watch the apiserver ended cleanly less than
// a second after it began ("very short watch": it began on a connection to an apiserver about
// to end its watches at shutdown). What the load's informers tell apart on the wire (the
// relists_expired and relists_short_watch of load.InformerCount); a cut on the way shows
// there.
func ApiserversOwnWatchEnd(err error) bool {
	return apierrors.IsResourceExpired(err) || apierrors.IsGone(err) || strings.Contains(err.Error(), "very short watch")
}
