//! Every carried connection and the two signals it obeys once established: **cut** (the drain
//! deadline: close, after a random delay within the close window) and **park** (connection
//! handoff at an in-place upgrade, [`crate::data::transfer`]: pause and offer yourself).
//!
//! Built so that the data path touches nothing another connection writes to:
//!
//! - each connection has its own [`Control`]: its signal flags (one atomic load per check) and
//!   its task's waker, registered once per wake-up ([`Control::register`]). A connection checks
//!   its flags at every wake-up; raising a flag wakes it. (A shared cancellation token costs a
//!   lock of the token's shared `Notify` per poll.)
//! - the [`Registry`] through which the drain and the handoff reach every connection is
//!   sharded by thread: registering and deregistering (once per connection) lock one shard,
//!   which is mostly used by the connection's own worker thread alone.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;

use crate::base::shard::thread_index;

/// A signal flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signal(u8);

impl Signal {
    /// Close at the drain deadline.
    pub const CUT: Signal = Signal(1);
    /// Pause and offer yourself to the successor.
    pub const PARK: Signal = Signal(2);
    /// The connection ended (set under the park lock; no request is taken any more).
    const GONE: Signal = Signal(4);
}

/// One connection's signals. `P` is the park request, whose type is the parker's (the handoff's
/// [`crate::data::transfer::Park`]): the control only keeps it until the connection takes it.
pub struct Control<P> {
    /// Identity for the passes of a handoff (never reused within a process).
    id: u64,
    flags: AtomicU8,
    waker: AtomicWaker,
    /// The park request, set before [`Signal::PARK`] is raised.
    park: Mutex<Option<P>>,
    /// Position in its registry shard (changed under the shard's lock only).
    slot: AtomicUsize,
}

impl<P> Control<P> {
    fn new(id: u64) -> Self {
        Control {
            id,
            flags: AtomicU8::new(0),
            waker: AtomicWaker::new(),
            park: Mutex::new(None),
            slot: AtomicUsize::new(0),
        }
    }

    /// Raises `signal` and wakes the connection.
    pub fn raise(&self, signal: Signal) {
        self.flags.fetch_or(signal.0, Ordering::AcqRel);
        self.waker.wake();
    }

    /// Lowers `signal` (a park that ended with the connection staying here).
    pub fn lower(&self, signal: Signal) {
        self.flags.fetch_and(!signal.0, Ordering::AcqRel);
    }

    pub fn is_raised(&self, signal: Signal) -> bool {
        self.flags.load(Ordering::Acquire) & signal.0 != 0
    }

    /// Registers the task to be woken when any signal is raised, and returns whether `signal`
    /// is raised (read after the registration, so that none is missed).
    pub fn register(&self, cx: &mut Context<'_>, signal: Signal) -> bool {
        self.waker.register(cx.waker());
        self.is_raised(signal)
    }

    /// Ready once `signal` is raised; else the task is woken when a signal is raised.
    pub fn poll_raised(&self, cx: &mut Context<'_>, signal: Signal) -> Poll<()> {
        if self.is_raised(signal) {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        // Raised between the check and the registration: its wake-up may have been missed.
        if self.is_raised(signal) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Resolves once `signal` is raised.
    pub async fn raised(&self, signal: Signal) {
        std::future::poll_fn(|cx| self.poll_raised(cx, signal)).await
    }

    /// The park request that came with [`Signal::PARK`], if any.
    pub fn take_park(&self) -> Option<P> {
        self.park.lock().expect("park lock").take()
    }

    /// Asks the connection to park; false when a request is already pending.
    pub(crate) fn request_park(&self, park: P) -> bool {
        {
            let mut slot = self.park.lock().expect("park lock");
            if slot.is_some() || self.is_raised(Signal::GONE) {
                return false;
            }
            *slot = Some(park);
        }
        self.raise(Signal::PARK);
        true
    }
}

/// Shards of the registry; more than worker threads, so threads rarely share one.
const SHARDS: usize = 32;

#[repr(align(128))]
struct Shard<P>(Mutex<Vec<Arc<Control<P>>>>);

impl<P> Default for Shard<P> {
    fn default() -> Self {
        Shard(Mutex::default())
    }
}

/// The connections this instance carries (`P`: their park request, see [`Control`]).
pub struct Registry<P> {
    shards: Box<[Shard<P>]>,
    /// Set once the drain deadline passed: connections registering later are cut at once.
    cut: AtomicBool,
}

impl<P> Default for Registry<P> {
    fn default() -> Self {
        Registry {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            cut: AtomicBool::new(false),
        }
    }
}

thread_local! {
    /// Connection ids handed out by this thread (the thread's index is in the top bits).
    static NEXT_ID: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A connection id unique in the process, without a shared counter.
fn next_id() -> u64 {
    let n = NEXT_ID.with(|c| {
        let n = c.get();
        c.set(n + 1);
        n
    });
    ((thread_index() as u64) << 40) | n
}

/// Keeps a connection in the registry until dropped.
pub struct Registration<'a, P> {
    registry: &'a Registry<P>,
    shard: usize,
    control: Arc<Control<P>>,
}

impl<P> Registration<'_, P> {
    pub fn control(&self) -> &Control<P> {
        &self.control
    }
}

impl<P> Drop for Registration<'_, P> {
    fn drop(&mut self) {
        // A park request that came too late is answered by dropping it (its sender fails);
        // none is taken from now on.
        {
            let mut park = self.control.park.lock().expect("park lock");
            park.take();
            self.control
                .flags
                .fetch_or(Signal::GONE.0, Ordering::AcqRel);
        }
        let mut list = self.registry.shards[self.shard]
            .0
            .lock()
            .expect("shard lock");
        let slot = self.control.slot.load(Ordering::Relaxed);
        debug_assert!(Arc::ptr_eq(&list[slot], &self.control));
        list.swap_remove(slot);
        if let Some(moved) = list.get(slot) {
            moved.slot.store(slot, Ordering::Relaxed);
        }
    }
}

impl<P> Registry<P> {
    /// Registers a connection (in the calling thread's shard).
    pub fn register(&self) -> Registration<'_, P> {
        let shard = thread_index() % self.shards.len();
        let control = Arc::new(Control::new(next_id()));
        {
            let mut list = self.shards[shard].0.lock().expect("shard lock");
            control.slot.store(list.len(), Ordering::Relaxed);
            list.push(control.clone());
        }
        // After the insertion: either `cut_all` sees this connection, or this sees its flag.
        if self.cut.load(Ordering::SeqCst) {
            control.raise(Signal::CUT);
        }
        Registration {
            registry: self,
            shard,
            control,
        }
    }

    /// Every connection carried now.
    fn snapshot(&self) -> Vec<Arc<Control<P>>> {
        self.shards
            .iter()
            .flat_map(|s| s.0.lock().expect("shard lock").clone())
            .collect()
    }

    /// Raises [`Signal::CUT`] on every connection, now and registering from now on.
    pub fn cut_all(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for shard in self.shards.iter() {
            for control in shard.0.lock().expect("shard lock").iter() {
                control.raise(Signal::CUT);
            }
        }
    }

    /// Every connection carried now that is not in `seen` (they are added to it).
    pub(crate) fn fresh(&self, seen: &mut std::collections::HashSet<u64>) -> Vec<Arc<Control<P>>> {
        let mut all = self.snapshot();
        all.retain(|c| seen.insert(c.id));
        all
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.0.lock().expect("shard lock").len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cut_reaches_connections_registered_before_and_after() {
        let registry = Arc::new(Registry::<()>::default());
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let waiting = {
            let registry = registry.clone();
            tokio::spawn(async move {
                let r = registry.register();
                tx.send(()).await.unwrap();
                r.control().raised(Signal::CUT).await;
                assert!(!r.control().is_raised(Signal::PARK));
            })
        };
        rx.recv().await.unwrap();
        assert_eq!(registry.len(), 1);
        registry.cut_all();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("cut did not wake the connection")
            .unwrap();
        assert_eq!(registry.len(), 0, "deregistered on drop");
        let late = registry.register();
        assert!(late.control().is_raised(Signal::CUT), "late one not cut");
    }

    #[test]
    fn slots_stay_right_when_connections_leave_in_any_order() {
        let registry = Registry::<()>::default();
        let mut held: Vec<_> = (0..50).map(|_| registry.register()).collect();
        let ids: Vec<u64> = held.iter().map(|r| r.control().id).collect();
        let unique: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(unique.len(), 50, "ids repeat");
        // Leave from the middle, the front and the back.
        for i in [25, 0, 40, 3, 3, 10] {
            held.remove(i);
        }
        assert_eq!(registry.len(), 44);
        let mut seen = std::collections::HashSet::new();
        let fresh = registry.fresh(&mut seen);
        assert_eq!(fresh.len(), 44);
        for c in &fresh {
            assert!(c.request_park(()), "first request refused");
            assert!(!c.request_park(()), "second request taken");
        }
        assert!(held.iter().all(|r| r.control().is_raised(Signal::PARK)));
        assert!(
            registry.fresh(&mut seen).is_empty(),
            "offered twice in one handoff"
        );
        let gone = fresh[0].clone();
        drop(fresh);
        held.clear();
        assert!(gone.take_park().is_none(), "request kept after the end");
        assert!(!gone.request_park(()), "ended connection asked");
        assert!(registry.is_empty());
    }
}
