//! Backends: their shared state, and the choice of backend for a new connection.
//!
//! [`order`] is the pure selection rule ([`best`] its first element, found without sorting);
//! [`Backends`] holds the live set that health checks update and the accept path reads. The
//! accept path takes no lock: each thread keeps its own copy of the set's current snapshot,
//! renewed when the set's version changes, and reads each backend's health from an atomic.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backends::check::{self, CheckResult, HealthConfig};
use crate::backends::health::{Health, HealthState, Observation};
use crate::backends::metrics::{BackendFamilies, BackendMetrics};
use crate::backends::pace::Pace;
use crate::base::addr::BackendAddr;
use crate::base::lograte::LogRate;

/// While a check keeps failing for the same cause, the cause is logged this often.
pub const CAUSE_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Where a backend came from; lower tiers are preferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// The apiserver of this pod.
    Own,
    /// Another instance's apiserver on this node.
    Local,
    /// A `--backend` flag.
    Static,
}

/// What the selection rule needs to know of one backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub tier: Tier,
    pub healthy: bool,
    pub active: i64,
}

/// The order in which to try backends for a new connection: healthy ones first, by tier and
/// then fewest active connections; then the others in the same order (fail open: every backend
/// is tried once before the client is turned away). Returns indices into `candidates`.
pub fn order(candidates: &[Candidate]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..candidates.len()).collect();
    idx.sort_by_key(|&i| {
        let c = candidates[i];
        (!c.healthy, c.tier, c.active)
    });
    idx
}

/// The first element of [`order`], found in one pass without allocating: what a new
/// connection tries first.
pub fn best(candidates: impl IntoIterator<Item = Candidate>) -> Option<usize> {
    let mut best: Option<(usize, (bool, Tier, i64))> = None;
    for (i, c) in candidates.into_iter().enumerate() {
        let key = (!c.healthy, c.tier, c.active);
        // Strictly smaller: on a tie the earlier one stays, as in the stable sort of `order`.
        if best.as_ref().is_none_or(|(_, b)| key < *b) {
            best = Some((i, key));
        }
    }
    best.map(|(i, _)| i)
}

/// One backend and its live state.
pub struct Backend {
    pub addr: BackendAddr,
    pub tier: Tier,
    state: Mutex<HealthState>,
    /// Whether `state` is up, readable without its lock (written under it).
    up: AtomicBool,
    /// The last active check's result and failure cause, for `/status`.
    last_check: Mutex<Option<CheckResult>>,
    /// Failure causes are logged when they change (at most once a second), else at most
    /// every [`CAUSE_LOG_EVERY`].
    cause_log: LogRate,
    cause_change_log: LogRate,
    /// Stops this backend's health checks when it is removed.
    checks: CancellationToken,
    pub metrics: BackendMetrics,
    /// The turns of held clients connecting to it (pace.rs).
    pub pace: Pace,
    /// Whether connections to it carry the client's address (`--client-address transparent`,
    /// transparent.rs).
    pub transparent: Arc<crate::backends::transparent::BackendState>,
}

impl Backend {
    fn new(
        addr: BackendAddr,
        tier: Tier,
        health: &HealthConfig,
        metrics: &BackendFamilies,
        checks: CancellationToken,
    ) -> Self {
        Backend {
            addr,
            tier,
            state: Mutex::new(HealthState::new(health.rise, health.fall)),
            up: AtomicBool::new(false),
            last_check: Mutex::new(None),
            cause_log: LogRate::new(CAUSE_LOG_EVERY),
            cause_change_log: LogRate::new(std::time::Duration::from_secs(1)),
            checks,
            metrics: metrics.backend(addr),
            pace: Pace::default(),
            transparent: Default::default(),
        }
    }

    pub fn health(&self) -> Health {
        self.state.lock().expect("health lock").health()
    }

    /// Connections carried to this backend now (the `backend_active_connections` gauge).
    pub fn active(&self) -> i64 {
        self.metrics.active.get()
    }

    fn candidate(&self) -> Candidate {
        Candidate {
            tier: self.tier,
            healthy: self.up.load(Ordering::Acquire),
            active: self.active(),
        }
    }

    /// Counts a connection carried to this backend until the guard drops.
    pub fn track(self: Arc<Self>) -> ActiveGuard {
        self.metrics.active.inc();
        ActiveGuard(self)
    }

    /// Feeds the health state machine under its lock, keeping `up` in step.
    fn update(&self, f: impl FnOnce(&mut HealthState) -> Option<Health>) -> Option<Health> {
        let mut state = self.state.lock().expect("health lock");
        let change = f(&mut state);
        self.up.store(state.health().is_up(), Ordering::Release);
        change
    }

    fn apply(&self, change: Option<Health>) -> Option<Health> {
        let health = change?;
        self.metrics.up.set(i64::from(health.is_up()));
        // Its established connections are left alone whatever the health: a backend that stops
        // listening (kube-apiserver at shutdown) goes on serving the connections it has.
        tracing::info!(backend = %self.addr, health = ?health, connections = self.active(), "backend health changed");
        Some(health)
    }

    /// The last active check, for `/status`: its result and, when it failed, why.
    pub fn last_check(&self) -> Option<CheckResult> {
        self.last_check.lock().expect("last check lock").clone()
    }

    /// Feeds an active check result; a failure's cause is logged when it changes, and at most
    /// every [`CAUSE_LOG_EVERY`] while it stays the same.
    pub fn observe(&self, result: CheckResult) -> Option<Health> {
        let obs = result.obs;
        {
            let mut last = self.last_check.lock().expect("last check lock");
            let changed = last.as_ref().map(|l| &l.cause) != Some(&result.cause);
            if let Some(cause) = &result.cause {
                let allowed = if changed {
                    // Restart the same-cause interval from this line.
                    let _ = self.cause_log.allow();
                    self.cause_change_log.allow()
                } else {
                    self.cause_log.allow()
                };
                if let Some(suppressed) = allowed {
                    tracing::warn!(backend = %self.addr, result = obs.as_str(), cause, suppressed, "health check failed");
                }
            }
            *last = Some(result);
        }
        let m = &self.metrics;
        match obs {
            Observation::Ok => m.checks_ok.inc(),
            Observation::NotReady => m.checks_not_ready.inc(),
            Observation::Failed => m.checks_failed.inc(),
            Observation::Refused => m.checks_refused.inc(),
            Observation::Skipped => m.checks_skipped.inc(),
        }
        let change = self.update(|s| s.observe(obs));
        self.apply(change)
    }

    /// A connect failure on client traffic.
    pub fn suspect(&self) -> Option<Health> {
        self.metrics.connect_failures.inc();
        let change = self.update(HealthState::suspect);
        self.apply(change)
    }
}

/// Decrements the backend's active count on drop.
pub struct ActiveGuard(Arc<Backend>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.metrics.active.dec();
    }
}

/// Numbers the sets, so that a thread's cached snapshot is known to be of this one.
static NEXT_SET: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's copy of the last snapshot it read: (set, version, snapshot).
    static CACHED: RefCell<Option<(usize, u64, Snapshot)>> = const { RefCell::new(None) };
}

type Snapshot = Arc<Vec<Arc<Backend>>>;

/// The live set of backends, each with its own health-check task.
pub struct Backends {
    id: usize,
    list: RwLock<Snapshot>,
    /// Bumped after every change of `list` (threads renew their copy when it moved).
    list_version: AtomicU64,
    /// Bumped on every change of the set or of a backend's health, like `changed`.
    version: AtomicU64,
    /// Bumped on every health change; `wait_healthy` watches it.
    changed: watch::Sender<u64>,
    health: HealthConfig,
    metrics: BackendFamilies,
    /// Parent of every backend's check token.
    stop: CancellationToken,
    checks: TaskTracker,
}

impl Backends {
    /// The set, its health checks stopped when `stop` (a branch of the instance's cancellation
    /// tree) is cancelled.
    pub fn new(
        health: HealthConfig,
        metrics: BackendFamilies,
        stop: CancellationToken,
    ) -> Arc<Self> {
        Arc::new(Backends {
            id: NEXT_SET.fetch_add(1, Ordering::Relaxed),
            list: RwLock::new(Arc::new(Vec::new())),
            list_version: AtomicU64::new(0),
            version: AtomicU64::new(0),
            changed: watch::channel(0).0,
            health,
            metrics,
            stop,
            checks: TaskTracker::new(),
        })
    }

    /// Adds a backend and starts checking it, unless one with that address exists (then its
    /// tier is kept: the first source to name an address wins). Returns whether it was added.
    pub fn add(self: &Arc<Self>, addr: BackendAddr, tier: Tier) -> bool {
        let mut list = self.list.write().expect("backends lock");
        if list.iter().any(|b| b.addr == addr) {
            return false;
        }
        let backend = Arc::new(Backend::new(
            addr,
            tier,
            &self.health,
            &self.metrics,
            self.stop.child_token(),
        ));
        backend.metrics.up.set(0);
        let mut next = Vec::clone(&list);
        next.push(backend.clone());
        *list = Arc::new(next);
        self.list_version.fetch_add(1, Ordering::Release);
        tracing::info!(backend = %addr, tier = ?tier, "backend added");
        self.notify();
        // The check loop reports through this callback and knows nothing of backends.
        let (target, set) = (backend.clone(), Arc::downgrade(self));
        self.checks.spawn(check::run_loop(
            addr.0,
            self.health.clone(),
            move |result| {
                if target.observe(result).is_some() {
                    if let Some(set) = set.upgrade() {
                        set.notify();
                    }
                }
            },
            backend.checks.clone(),
        ));
        true
    }

    /// Removes a backend: its checks stop and its metric series are deleted; its established
    /// connections are left alone.
    pub fn remove(&self, addr: BackendAddr) {
        let mut list = self.list.write().expect("backends lock");
        let Some(backend) = list.iter().find(|b| b.addr == addr).cloned() else {
            return;
        };
        backend.checks.cancel();
        self.metrics.remove(addr);
        *list = Arc::new(list.iter().filter(|b| b.addr != addr).cloned().collect());
        self.list_version.fetch_add(1, Ordering::Release);
        drop(list);
        tracing::info!(backend = %addr, tier = ?backend.tier, "backend removed");
        self.notify();
    }

    /// Addresses of the backends of one tier.
    pub fn of_tier(&self, tier: Tier) -> Vec<BackendAddr> {
        self.snapshot()
            .iter()
            .filter(|b| b.tier == tier)
            .map(|b| b.addr)
            .collect()
    }

    /// Stops every health check and waits for the checks to end.
    pub async fn stop(&self) {
        self.stop.cancel();
        self.checks.close();
        self.checks.wait().await;
    }

    /// A snapshot of the current backends.
    pub fn snapshot(&self) -> Arc<Vec<Arc<Backend>>> {
        self.list.read().expect("backends lock").clone()
    }

    /// Runs `f` on this thread's copy of the current snapshot (no lock unless the set changed
    /// since this thread last looked).
    fn with_local<R>(&self, f: impl FnOnce(&[Arc<Backend>]) -> R) -> R {
        let version = self.list_version.load(Ordering::Acquire);
        CACHED.with(|cached| {
            let mut cached = cached.borrow_mut();
            match &*cached {
                Some((id, v, list)) if *id == self.id && *v == version => f(list),
                _ => {
                    let list = self.snapshot();
                    let result = f(&list);
                    *cached = Some((self.id, version, list));
                    result
                }
            }
        })
    }

    /// The backend to try first for a new connection: the first of [`Self::candidates`].
    pub fn first_choice(&self) -> Option<Arc<Backend>> {
        self.with_local(|list| best(list.iter().map(|b| b.candidate())).map(|i| list[i].clone()))
    }

    /// Backends in the order to try for a new connection.
    pub fn candidates(&self) -> Vec<Arc<Backend>> {
        self.with_local(|list| {
            let cands: Vec<Candidate> = list.iter().map(|b| b.candidate()).collect();
            order(&cands).into_iter().map(|i| list[i].clone()).collect()
        })
    }

    /// True when any backend is up.
    pub fn any_healthy(&self) -> bool {
        self.snapshot().iter().any(|b| b.health().is_up())
    }

    /// A receiver that sees every change of the set or of a backend's health.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Records a health change for waiters.
    pub fn notify(&self) {
        self.version.fetch_add(1, Ordering::AcqRel);
        self.changed.send_modify(|n| *n += 1);
    }

    /// Changes so far (of the set or of a backend's health); read without a lock.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Resolves once any backend is up.
    pub async fn wait_healthy(&self) {
        let mut rx = self.changed.subscribe();
        loop {
            if self.any_healthy() {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(tier: Tier, healthy: bool, active: i64) -> Candidate {
        Candidate {
            tier,
            healthy,
            active,
        }
    }

    #[test]
    fn healthy_first_then_tier_then_fewest_active() {
        let cands = [
            c(Tier::Static, true, 5),
            c(Tier::Static, false, 0),
            c(Tier::Static, true, 2),
            c(Tier::Own, true, 9),
            c(Tier::Local, false, 0),
        ];
        assert_eq!(order(&cands), vec![3, 2, 0, 4, 1]);
    }

    proptest::proptest! {
        #[test]
        fn best_is_the_first_of_the_order(
            cands in proptest::collection::vec((0..3u8, proptest::bool::ANY, 0..4i64), 0..8)
        ) {
            let tiers = [Tier::Own, Tier::Local, Tier::Static];
            let cands: Vec<Candidate> = cands
                .into_iter()
                .map(|(t, healthy, active)| c(tiers[t as usize], healthy, active))
                .collect();
            proptest::prop_assert_eq!(best(cands.iter().copied()), order(&cands).first().copied());
        }
    }

    #[test]
    fn nothing_healthy_tries_everything_once() {
        let cands = [c(Tier::Static, false, 1), c(Tier::Static, false, 0)];
        assert_eq!(order(&cands), vec![1, 0]);
    }
}
