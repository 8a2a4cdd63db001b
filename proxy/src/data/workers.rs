//! The data-path threads of `--runtime per-thread` (the default): one thread per worker, each
//! running its own current-thread tokio runtime, and one `SO_REUSEPORT` listening socket of the
//! group per thread (HAProxy's and Envoy's model). The kernel spreads new connections over the
//! sockets of the group; a connection is accepted, carried and closed on the thread of its
//! socket, so no task moves between threads and no wake-up crosses them. Connections taken
//! over at an in-place upgrade are dealt round-robin over the threads (listener.rs,
//! `connection_runtime`). The control plane (health checks, admin, handoff) stays on the main
//! runtime.
//!
//! With `--runtime shared` there are no such threads: accept loops and connections run on the
//! one multi-threaded runtime, which steals work between its threads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// Where accept loops (and with them their connections) run.
pub enum Placement {
    /// On the runtime of the caller (the shared multi-threaded runtime).
    Shared,
    /// Round-robin over the worker threads.
    PerThread(Workers),
}

impl Placement {
    /// The runtime for the next accept loop.
    pub fn next(&self) -> Handle {
        match self {
            Placement::Shared => Handle::current(),
            Placement::PerThread(w) => w.next(),
        }
    }

    /// How many sockets to bind fresh per listen address: one per worker thread.
    pub fn sockets_per_address(&self) -> usize {
        match self {
            Placement::Shared => 1,
            Placement::PerThread(w) => w.handles.len(),
        }
    }
}

/// The worker threads; they end when `stop` is cancelled (their runtimes drop what is left).
pub struct Workers {
    handles: Vec<Handle>,
    next: AtomicUsize,
}

/// How often a worker thread's runtime wakes with nothing to do, for a connect timeout of
/// `connect_timeout` (see [`Workers::start`]).
pub fn tick_for(connect_timeout: Duration) -> Duration {
    (connect_timeout / 2).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

impl Workers {
    /// Starts `n` threads, each with its own current-thread runtime.
    ///
    /// Each runtime keeps a timer pending at all times, one that fires every `tick`, shorter
    /// than the connect timeout ([`tick_for`]). Every new connection starts a connect timeout,
    /// and tokio wakes its own driver (a write to its eventfd, and one more turn of the event
    /// loop) whenever a new timer expires before every pending one, or when none is pending:
    /// without the tick, that was most connections. With it, a connect timeout is never the
    /// earliest timer, and the thread wakes once a `tick` instead (docs/benchmarks-history.md,
    /// "System calls per connection").
    ///
    /// Each thread asks for the scheduling slice `slice` first ([`ask_for_slice`]).
    pub fn start(
        n: usize,
        stop: CancellationToken,
        tick: Duration,
        slice: Option<Duration>,
    ) -> std::io::Result<Workers> {
        let mut handles = Vec::with_capacity(n);
        for i in 0..n {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(runtime.handle().clone());
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("worker-{i}"))
                .spawn(move || {
                    ask_for_slice(slice);
                    runtime.block_on(async move {
                        let ticks = async {
                            loop {
                                tokio::time::sleep(tick).await;
                            }
                        };
                        tokio::select! {
                            () = stop.cancelled() => {}
                            () = ticks => {}
                        }
                    })
                })?;
        }
        Ok(Workers {
            handles,
            next: AtomicUsize::new(0),
        })
    }

    fn next(&self) -> Handle {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        self.handles[i].clone()
    }
}

/// Asks the scheduler for `slice` for the calling thread (`--worker-slice`, sys.rs): a worker
/// woken by a socket then runs before a thread that has used the CPU for long, instead of
/// waiting up to a scheduler tick behind it, which is the latency tail when the CPUs are
/// shared with the apiserver (docs/benchmarks.md, "Where the time goes"). Says once per
/// process what came of it. `None` (`--worker-slice 0`): the kernel's default, nothing asked.
pub fn ask_for_slice(slice: Option<Duration>) {
    static SAID: std::sync::Once = std::sync::Once::new();
    let Some(slice) = slice else {
        return;
    };
    let outcome =
        crate::sys::set_thread_slice(slice).and_then(|set| Ok((set, crate::sys::thread_slice()?)));
    SAID.call_once(|| match outcome {
        Ok((true, Some(got))) if got == slice => {
            tracing::debug!(slice = ?slice, "worker threads' scheduling slice set");
        }
        Ok((true, _)) => tracing::info!(
            slice = ?slice,
            "this kernel has no per-thread scheduling slice (Linux 6.12 and later): --worker-slice has no effect"
        ),
        Ok((false, _)) => tracing::info!(
            "worker threads run under another scheduling policy than the normal one: --worker-slice left it alone"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot set the worker threads' scheduling slice"),
    });
}
