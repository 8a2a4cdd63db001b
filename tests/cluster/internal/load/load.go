// Package load is a client-go load generator: the clients a real control plane has, with
// what each of them saw counted.
//
//   - informers on several resource types with event handlers (their own client, one shared
//     HTTP/2 connection, as controllers have); relists and watch restarts counted on the wire;
//   - writers: create, update and delete loops on ConfigMaps;
//   - readers: LIST and GET loops on one shared HTTP/2 connection;
//   - kubectl-like clients: a fresh connection (new transport) for every request;
//   - streams: long-lived watch requests, resumed from their last resourceVersion when the
//     apiserver ends them (as a reflector does), counted as cut when they end with an error;
//   - long lists: a LIST of several megabytes, so that one is in flight when an apiserver
//     starts to drain.
//
// Nothing here talks HTTP itself: every request goes through client-go.
package load

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// Config says how much of each workload to run.
type Config struct {
	// Kubeconfig of the clients (its server is the address under test).
	Kubeconfig string
	// Namespace the writers, readers and streams work in (created if missing).
	Namespace string
	// Writers, Readers, Kubectls, Streams and LongLists: goroutines of each workload.
	Writers, Readers, Kubectls, Streams, LongLists int
	// BulkObjects ConfigMaps of BulkSize bytes each make up the long LIST (in their own
	// namespace, created once and kept).
	BulkObjects, BulkSize int
	// Pause between two requests of one worker.
	Pause time.Duration
}

// DefaultConfig is a load that a 2-core machine running two apiservers and etcd carries.
func DefaultConfig(kubeconfig string) Config {
	return Config{
		Kubeconfig: kubeconfig,
		Namespace:  "load",
		Writers:    4,
		Readers:    4,
		Kubectls:   4,
		Streams:    4,
		LongLists:  1,
		// 400 x 16 KiB: a 6.4 MiB LIST, about half a second here.
		BulkObjects: 400,
		BulkSize:    16 << 10,
		Pause:       50 * time.Millisecond,
	}
}

// Load is a running load generator.
type Load struct {
	cfg Config
	rec *recorder
	// requests is the context of every request; issuing stops the workloads from starting
	// new ones (and stops the informers and streams), and is a child of requests.
	requests, issuing   context.Context
	cancel, stopIssuing context.CancelFunc
	wg                  sync.WaitGroup
	// stopping: the run is ending: a watch that ends now was stopped by the client.
	stopping atomic.Bool
	// abandoned: the requests still pending StopGrace after the load stopped issuing were
	// cancelled: each of them fails as PendingAtStop.
	abandoned atomic.Bool
	// running: the informers have synced and every workload runs (set once Start is done).
	running atomic.Bool
	// closing: every workload has ended; what happens to the connections now is our doing.
	closing atomic.Bool
	// writing: the writers' context (a child of issuing), ended first at Stop so that every
	// watch can be seen to deliver the last writes.
	writing     context.Context
	stopWriting context.CancelFunc
	// del follows every watch against every write (delivery.go).
	del *deliveries
}

// StopGrace is how long Stop waits for the requests in flight to be answered. A request that
// is still pending then fails (PendingAtStop): it could be waiting on a connection that
// will never answer.
const StopGrace = 15 * time.Second

// Start connects the clients, waits until the informers have synced and starts every
// workload. The informers' first sync is not counted as a relist.
func Start(parent context.Context, cfg Config) (*Load, error) {
	base, err := clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", cfg.Kubeconfig, err)
	}
	// No client-side throttling: the load is bounded by its workers and pauses.
	base.QPS, base.Burst = -1, 0
	base.UserAgent = "kube-apiserver-proxy-cluster-load"

	l := newLoad(parent, cfg)
	ctx, writing, cancel := l.issuing, l.writing, l.cancel
	// Every client dials through l.dial (which also keeps client-go from sharing one cached
	// transport between them: each clientset below has its own connection), and every HTTP
	// attempt of every client is counted directly on its transport.
	base.Dial = l.dial
	base.Wrap(func(rt http.RoundTripper) http.RoundTripper { return &attemptTransport{next: rt, l: l} })

	shared, err := kubernetes.NewForConfig(base)
	if err != nil {
		cancel()
		return nil, err
	}
	if err := ensureNamespace(ctx, shared, cfg.Namespace); err != nil {
		cancel()
		return nil, err
	}
	if cfg.LongLists > 0 {
		if err := ensureBulk(ctx, shared, cfg); err != nil {
			cancel()
			return nil, err
		}
	}
	if err := l.startInformers(ctx, base); err != nil {
		cancel()
		return nil, err
	}
	l.rec.begin()
	l.running.Store(true)
	for i := 0; i < cfg.Writers; i++ {
		l.spawn(writing, func(ctx context.Context) { l.writer(ctx, shared, i) })
	}
	for i := 0; i < cfg.Readers; i++ {
		l.spawn(ctx, func(ctx context.Context) { l.reader(ctx, shared) })
	}
	for i := 0; i < cfg.Kubectls; i++ {
		l.spawn(ctx, func(ctx context.Context) { l.kubectl(ctx, base) })
	}
	for i := 0; i < cfg.LongLists; i++ {
		l.spawn(ctx, func(ctx context.Context) { l.longList(ctx, shared) })
	}
	// Each stream on a connection of its own, as separate watching processes have: a
	// connection that hangs hangs one of them.
	for i := 0; i < cfg.Streams; i++ {
		c, err := kubernetes.NewForConfig(l.observed(base, l.streamEnded, nil))
		if err != nil {
			cancel()
			return nil, err
		}
		name := fmt.Sprintf("stream-%d", i)
		l.del.watcher(name, nil)
		l.spawn(ctx, func(ctx context.Context) { l.stream(ctx, c, name) })
	}
	l.spawn(ctx, l.pollDeliveries)
	return l, nil
}

// newLoad is a load of cfg whose requests end with parent; nothing runs yet.
func newLoad(parent context.Context, cfg Config) *Load {
	requests, cancel := context.WithCancel(parent)
	issuing, stopIssuing := context.WithCancel(requests)
	writing, stopWriting := context.WithCancel(issuing)
	return &Load{cfg: cfg, rec: newRecorder(), requests: requests, cancel: cancel, issuing: issuing, stopIssuing: stopIssuing,
		writing: writing, stopWriting: stopWriting, del: newDeliveries(DeliveryBound)}
}

// streamEnded counts how a stream's watch response ended.
func (l *Load) streamEnded(_, how string, _ time.Duration, _ int64) {
	l.rec.withStreams(func(s *StreamCount) {
		switch how {
		case EndedByServer, EndedByServerGoaway:
			s.EndedByServer++
		case StoppedByClient:
		default:
			s.Cut[how]++
		}
	})
}

// pollDeliveries reads the informers' progress for the delivery check every 100 ms until the
// load stops.
func (l *Load) pollDeliveries(ctx context.Context) {
	wait.UntilWithContext(ctx, func(context.Context) { l.del.pollAll(time.Now()) }, 100*time.Millisecond)
}

// awaitDeliveries waits, at most the delivery bound, until every watch has delivered every
// write answered so far (the writers have stopped).
func (l *Load) awaitDeliveries() {
	_ = wait.PollUntilContextTimeout(l.requests, 50*time.Millisecond, l.del.bound, true, func(context.Context) (bool, error) {
		l.del.pollAll(time.Now())
		return l.del.caughtUp(), nil
	})
}

// WatchesResumedSince says whether every watch of the load (each stream, the ConfigMap
// informer) delivered an event after t: after an apiserver it watched through is gone, that
// it runs again, on a new connection.
func (l *Load) WatchesResumedSince(t time.Time) bool {
	l.del.pollAll(time.Now())
	return l.del.deliveredSince(t)
}

// EveryWorkloadWithin bounds how long Stop lets a load run on until each of its workloads has
// completed a request; past it, those that have not are judged as not run.
const EveryWorkloadWithin = 30 * time.Second

// awaitEveryWorkload waits, at most timeout (or until the load's context ends), until each
// workload has completed a request, and says whether each has. A load stopped sooner is
// judged as one that did not run ("workload completed no request"), so a step shorter than
// one round of a writer (create, two updates, delete, with pauses between them) waits here
// rather than fail for being short.
func (l *Load) awaitEveryWorkload(timeout time.Duration) bool {
	return wait.PollUntilContextTimeout(l.issuing, 20*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		return l.rec.completedEach(l.cfg), nil
	}) == nil
}

// Stop ends every workload and returns what was seen. A load stopped before each workload
// completed a request (a step of a tenth of a second) first runs on until each has, at most
// EveryWorkloadWithin. Then no new request is sent, the informers and streams stop, and the
// requests in flight get StopGrace to be answered; those still pending then fail.
func (l *Load) Stop() Report {
	l.awaitEveryWorkload(EveryWorkloadWithin)
	// The writers stop first; their last writes' events get the delivery bound to arrive.
	l.stopWriting()
	l.awaitDeliveries()
	deliveries := l.del.finish(time.Now())
	l.rec.stop()
	l.stopping.Store(true)
	l.stopIssuing()
	done := make(chan struct{})
	go func() {
		l.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(StopGrace):
		l.abandoned.Store(true)
		l.cancel()
		<-done
	}
	l.closing.Store(true)
	l.cancel()
	rep := l.rec.finish()
	rep.Deliveries = deliveries
	return rep
}

func (l *Load) spawn(ctx context.Context, f func(context.Context)) {
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		f(ctx)
	}()
}

// observed is base with a transport that reports requests and how watch bodies ended.
func (l *Load) observed(base *rest.Config, ended watchObserver, request func(string, bool, bool, error)) *rest.Config {
	cfg := rest.CopyConfig(base)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return &observingTransport{next: rt, request: request, ended: ended, closing: &l.stopping}
	})
	return cfg
}

func (l *Load) startInformers(ctx context.Context, base *rest.Config) error {
	cfg := l.observed(base,
		func(resource, how string, open time.Duration, bytes int64) {
			l.rec.withInformer(resource, func(c *InformerCount) {
				c.WatchEnds[how]++
				c.lastEnd, c.lastOpen = how, open
				c.Ends = append(c.Ends, WatchEnd{
					At: time.Since(l.rec.start).Seconds(), How: how, Open: open.Seconds(), Bytes: bytes,
				})
			})
		},
		func(resource string, isWatch, initial bool, err error) {
			l.rec.withInformer(resource, func(c *InformerCount) {
				// (Errors of the path are counted as failed attempts; these are what the
				// informer itself saw, for the report.)
				if err != nil && !l.stopping.Load() {
					c.Errors[Classify(err)]++
				}
				if !isWatch || initial {
					c.Lists++
					switch {
					case c.Lists == 1:
					case c.lastEnd == ErrorEventPrefix+"Expired" || c.lastEnd == ErrorEventPrefix+"Gone":
						c.RelistsExpired++
					case (c.lastEnd == EndedByServer || c.lastEnd == EndedByServerGoaway) && c.lastOpen < time.Second:
						c.RelistsShortWatch++
					default:
						c.Relists++
					}
				} else {
					c.Watches++
				}
			})
		})
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	factory := informers.NewSharedInformerFactory(client, 0)
	handled := map[string]cache.SharedIndexInformer{
		"configmaps":      factory.Core().V1().ConfigMaps().Informer(),
		"namespaces":      factory.Core().V1().Namespaces().Informer(),
		"serviceaccounts": factory.Core().V1().ServiceAccounts().Informer(),
		"endpointslices":  factory.Discovery().V1().EndpointSlices().Informer(),
		"leases":          factory.Coordination().V1().Leases().Informer(),
	}
	for resource, inf := range handled {
		count := func() { l.rec.withInformer(resource, func(c *InformerCount) { c.Events++ }) }
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(any) { count() },
			UpdateFunc: func(any, any) { count() },
			DeleteFunc: func(any) { count() },
		}); err != nil {
			return err
		}
		if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
			if l.stopping.Load() {
				return
			}
			l.rec.withInformer(resource, func(c *InformerCount) { c.Errors["watch-handler-"+Classify(err)]++ })
		}); err != nil {
			return err
		}
	}
	// The ConfigMap informer follows the writers' writes: its reflector's last synced
	// resourceVersion (every event, bookmark and list moves it) is its progress.
	cms := handled["configmaps"]
	l.del.watcher("informer-configmaps", cms.LastSyncResourceVersion)
	factory.Start(ctx.Done())
	l.spawn(ctx, func(ctx context.Context) {
		<-ctx.Done()
		factory.Shutdown()
	})
	syncCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for resource, synced := range factory.WaitForCacheSync(syncCtx.Done()) {
		if !synced {
			return fmt.Errorf("informer for %v did not sync within 2m", resource)
		}
	}
	return nil
}

func ensureNamespace(ctx context.Context, c kubernetes.Interface, name string) error {
	_, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return nil
}

// pause waits between two requests; false when the run is over.
func (l *Load) pause(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(l.cfg.Pause):
		return true
	}
}

// call runs one request on the requests' context and records it: a request the load
// abandoned at its end (no answer within StopGrace) fails as PendingAtStop.
func (l *Load) call(kind string, f func(ctx context.Context) error) error {
	began := time.Now()
	err := f(l.requests)
	l.rec.request(kind, began, err, err != nil && l.abandoned.Load())
	return err
}

// writer creates a ConfigMap, updates it twice and deletes it, again and again.
func (l *Load) writer(ctx context.Context, c kubernetes.Interface, id int) {
	cms := c.CoreV1().ConfigMaps(l.cfg.Namespace)
	for n := 0; ; n++ {
		name := fmt.Sprintf("w%d-%d-%d", id, time.Now().UnixNano(), n)
		var cm *corev1.ConfigMap
		err := l.call("create", func(ctx context.Context) (err error) {
			cm, err = cms.Create(ctx, &corev1.ConfigMap{
				ObjectMeta: metav1.ObjectMeta{Name: name},
				Data:       map[string]string{"n": "0"},
			}, metav1.CreateOptions{})
			if err == nil {
				l.del.wrote(cm.ResourceVersion, time.Now())
			}
			return err
		})
		for u := 1; err == nil && u <= 2; u++ {
			if !l.pause(ctx) {
				return
			}
			cm.Data["n"] = fmt.Sprint(u)
			err = l.call("update", func(ctx context.Context) (err error) {
				cm, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
				if err == nil {
					l.del.wrote(cm.ResourceVersion, time.Now())
				}
				return err
			})
		}
		if err == nil && l.pause(ctx) {
			_ = l.call("delete", func(ctx context.Context) error { return cms.Delete(ctx, name, metav1.DeleteOptions{}) })
		}
		if !l.pause(ctx) {
			return
		}
	}
}

// reader lists the namespace's ConfigMaps and gets a namespace, on the shared connection.
func (l *Load) reader(ctx context.Context, c kubernetes.Interface) {
	for l.pause(ctx) {
		_ = l.call("list", func(ctx context.Context) error {
			_, err := c.CoreV1().ConfigMaps(l.cfg.Namespace).List(ctx, metav1.ListOptions{Limit: 50})
			return err
		})
		_ = l.call("get", func(ctx context.Context) error {
			_, err := c.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
			return err
		})
	}
}

// kubectl makes every request on a connection of its own and then closes it, as one kubectl
// command does when it exits. (http.Client.CloseIdleConnections does not reach through
// client-go's wrapping round trippers, so the connections are closed where they are dialed.)
func (l *Load) kubectl(ctx context.Context, base *rest.Config) {
	for l.pause(ctx) {
		var mu sync.Mutex
		var conns []net.Conn
		// base.Dial is set, so this config gets a transport of its own: a new connection.
		cfg := rest.CopyConfig(base)
		cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := l.dial(ctx, network, addr)
			if err == nil {
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
			}
			return c, err
		}
		c, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			l.rec.request("kubectl", time.Now(), err, false)
			continue
		}
		_ = l.call("kubectl", func(ctx context.Context) error {
			_, err := c.CoreV1().ConfigMaps(l.cfg.Namespace).List(ctx, metav1.ListOptions{Limit: 10})
			return err
		})
		mu.Lock()
		for _, conn := range conns {
			conn.Close()
		}
		mu.Unlock()
	}
}

// stream keeps one watch request open for as long as the apiserver lets it, and resumes from
// the last resourceVersion seen when it ends, as a reflector does.
func (l *Load) stream(ctx context.Context, c kubernetes.Interface, name string) {
	rv := ""
	for ctx.Err() == nil {
		if rv == "" {
			err := l.call("stream", func(ctx context.Context) error {
				list, err := c.CoreV1().ConfigMaps(l.cfg.Namespace).List(ctx, metav1.ListOptions{Limit: 1})
				if err == nil {
					rv = list.ResourceVersion
					l.del.saw(name, rv, time.Now())
				}
				return err
			})
			if err != nil {
				l.pause(ctx)
				continue
			}
		}
		timeout := int64(3600)
		// The watch runs until the load stops issuing (the client then stops it).
		began := time.Now()
		w, err := c.CoreV1().ConfigMaps(l.cfg.Namespace).Watch(ctx, metav1.ListOptions{
			ResourceVersion: rv, TimeoutSeconds: &timeout, AllowWatchBookmarks: true,
		})
		if ctx.Err() != nil {
			if err == nil {
				w.Stop()
			}
			return
		}
		l.rec.request("stream", began, err, false)
		if err != nil {
			l.pause(ctx)
			continue
		}
		l.rec.withStreams(func(s *StreamCount) { s.Opened++ })
		for ev := range w.ResultChan() {
			if ev.Type == watch.Error {
				status := apierrors.FromObject(ev.Object)
				if apierrors.IsResourceExpired(status) || apierrors.IsGone(status) {
					// The new apiserver's watch cache does not reach back to rv: list
					// again, as a reflector does (counted, not a failure of the path).
					rv = ""
					l.rec.withStreams(func(s *StreamCount) { s.Expired++ })
				} else if ctx.Err() == nil {
					l.rec.mu.Lock()
					l.rec.failure("stream", status)
					l.rec.mu.Unlock()
				}
				break
			}
			if m, ok := ev.Object.(metav1.Object); ok {
				rv = m.GetResourceVersion()
				// An event or a bookmark: everything up to rv was delivered.
				l.del.saw(name, rv, time.Now())
			}
			l.rec.withStreams(func(s *StreamCount) { s.Events++ })
		}
		w.Stop()
	}
}

// bulkNamespace holds the objects of the long LIST.
const bulkNamespace = "load-bulk"

// ensureBulk creates the long LIST's objects unless they are there from an earlier run.
func ensureBulk(ctx context.Context, c kubernetes.Interface, cfg Config) error {
	if err := ensureNamespace(ctx, c, bulkNamespace); err != nil {
		return err
	}
	cms := c.CoreV1().ConfigMaps(bulkNamespace)
	have, err := cms.List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list %s: %w", bulkNamespace, err)
	}
	data := strings.Repeat("x", cfg.BulkSize)
	var wg sync.WaitGroup
	errs := make(chan error, cfg.BulkObjects)
	next := make(chan int)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				_, err := cms.Create(ctx, &corev1.ConfigMap{
					ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("bulk-%04d", i)},
					Data:       map[string]string{"data": data},
				}, metav1.CreateOptions{})
				if err != nil && !apierrors.IsAlreadyExists(err) {
					errs <- err
				}
			}
		}()
	}
	for i := len(have.Items); i < cfg.BulkObjects; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return fmt.Errorf("create the long LIST's objects: %w", err)
	}
	return nil
}

// longList lists every object of the bulk namespace, again and again, on the shared
// connection.
func (l *Load) longList(ctx context.Context, c kubernetes.Interface) {
	for l.pause(ctx) {
		_ = l.call("long-list", func(ctx context.Context) error {
			_, err := c.CoreV1().ConfigMaps(bulkNamespace).List(ctx, metav1.ListOptions{})
			return err
		})
	}
}
