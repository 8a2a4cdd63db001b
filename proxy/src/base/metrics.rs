//! All Prometheus metrics, in one struct registered on a passed-in registry.
//!
//! Names are constants here and nowhere else; the hot path holds pre-resolved handles (no label
//! lookups per connection).

use std::sync::{Arc, Mutex, OnceLock};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use crate::base::addr::BackendAddr;
use crate::base::shard;

/// Prefix of every metric name.
pub const PREFIX: &str = "kube_apiserver_proxy";

pub const CONNECTIONS_ACCEPTED: &str = "connections_accepted_total";
pub const CONNECTIONS_ACTIVE: &str = "connections_active";
pub const CONNECTIONS_FAILED: &str = "connections_failed_total";
pub const BYTES: &str = "bytes_total";
pub const BACKEND_UP: &str = "backend_up";
pub const BACKEND_ACTIVE: &str = "backend_active_connections";
pub const BACKEND_CONNECT_FAILURES: &str = "backend_connect_failures_total";
pub const BACKEND_CONNECT_DURATION: &str = "backend_connect_duration_seconds";
pub const BACKEND_CONNECTIONS_CLOSED: &str = "backend_connections_closed_total";
pub const HEALTH_CHECKS: &str = "health_checks_total";
pub const LIFECYCLE_STATE: &str = "lifecycle_state";
pub const BUILD_INFO: &str = "build_info";
pub const HANDOFFS: &str = "handoffs_total";
pub const HANDOFF_PEERS_REFUSED: &str = "handoff_peers_refused_total";
pub const HANDOFF_MESSAGES_REJECTED: &str = "handoff_messages_rejected_total";
pub const LISTENING_SOCKETS: &str = "listening_sockets";
pub const LISTENING_SOCKETS_DROPPED: &str = "listening_sockets_dropped_total";
pub const TCP_MIGRATE_REQ: &str = "tcp_migrate_req";
pub const ADMIN_REQUESTS_REJECTED: &str = "admin_requests_rejected_total";
pub const CONNECTIONS_VIA_SUCCESSOR: &str = "connections_via_successor_total";
pub const RUNTIME_ALIVE_TASKS: &str = "runtime_alive_tasks";
pub const OPEN_FDS: &str = "open_fds";
pub const PIPES_POOLED: &str = "splice_pipes_pooled";
pub const RETIRE_REQUESTS: &str = "retire_requests_total";
pub const CHECKPOINT_ATTEMPTS: &str = "checkpoint_attempts_total";
pub const CHECKPOINT_REFUSED: &str = "checkpoint_refused";
pub const CHECKPOINT_WRITTEN: &str = "checkpoint_written_timestamp_seconds";
pub const CHECKPOINT_VERIFIED: &str = "checkpoint_verified_timestamp_seconds";
pub const CHECKPOINT_ACTIVE: &str = "checkpoint_active";

/// The `result` label values of `checkpoint_attempts_total`.
pub const CHECKPOINT_RESULTS: [&str; 6] = [
    "written",
    "current",
    "kept",
    "no_candidate",
    "refused",
    "error",
];
pub const CLIENT_ADDRESS_CONNECTIONS: &str = "client_address_connections_total";

/// The `result` label values of `health_checks_total`, one series each per backend.
const CHECK_RESULTS: [&str; 5] = ["ok", "not_ready", "failed", "refused", "skipped"];

/// Why a client connection was not carried.
#[derive(Debug, Clone, Copy)]
pub enum FailReason {
    /// Every backend candidate failed to connect.
    NoBackend,
    /// `--max-connections` reached.
    MaxConnections,
    /// `accept()` failed (e.g. out of file descriptors).
    AcceptError,
}

impl FailReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FailReason::NoBackend => "no_backend",
            FailReason::MaxConnections => "max_connections",
            FailReason::AcceptError => "accept_error",
        }
    }
}

/// Which handoff exchange a count is for (the `direction` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoffDirection {
    /// We sent duplicates of our listening sockets to a starting peer.
    ShareSent,
    /// A peer sent us duplicates of its listening sockets.
    ShareReceived,
    /// We offered our listening sockets to a ready peer while draining.
    AdoptSent,
    /// A draining peer offered us its listening sockets.
    AdoptReceived,
    /// We offered established connections to a successor (in-place upgrade).
    ConnectionsSent,
    /// A predecessor offered us established connections.
    ConnectionsReceived,
}

impl HandoffDirection {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            HandoffDirection::ShareSent => "share_sent",
            HandoffDirection::ShareReceived => "share_received",
            HandoffDirection::AdoptSent => "adopt_sent",
            HandoffDirection::AdoptReceived => "adopt_received",
            HandoffDirection::ConnectionsSent => "connections_sent",
            HandoffDirection::ConnectionsReceived => "connections_received",
        }
    }
}

/// How a handoff exchange ended (the `result` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoffOutcome {
    Ok,
    Error,
    /// The peer (or we) declined.
    Refused,
    /// No ready peer was found before the drain deadline.
    NoPeer,
}

impl HandoffOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            HandoffOutcome::Ok => "ok",
            HandoffOutcome::Error => "error",
            HandoffOutcome::Refused => "refused",
            HandoffOutcome::NoPeer => "no_peer",
        }
    }
}

/// Every metric of the process.
#[derive(Clone)]
pub struct Metrics {
    pub connections_accepted: IntCounter,
    pub connections_active: IntGauge,
    connections_failed: IntCounterVec,
    /// Added to per burst, per thread ([`shard::Counter`]); exported at every gathering.
    pub bytes_client_to_backend: Arc<shard::Counter>,
    pub bytes_backend_to_client: Arc<shard::Counter>,
    /// `--client-address transparent`: connections made with the client's address.
    pub client_address_transparent: IntCounter,
    /// `--client-address transparent`: connections that should have carried the client's
    /// address and were made normally (the backend not verified, transparent.rs).
    pub client_address_fallback: IntCounter,
    backend_up: IntGaugeVec,
    backend_active: IntGaugeVec,
    backend_connect_failures: IntCounterVec,
    backend_connect_duration: HistogramVec,
    backend_connections_closed: IntCounterVec,
    health_checks: IntCounterVec,
    lifecycle_state: IntGaugeVec,
    handoffs: IntCounterVec,
    pub handoff_peers_refused: IntCounter,
    pub handoff_messages_rejected: IntCounter,
    pub listening_sockets: IntGauge,
    pub listening_sockets_dropped: IntCounter,
    pub tcp_migrate_req: IntGauge,
    pub admin_requests_rejected: IntCounter,
    pub connections_via_successor: IntCounter,
    runtime_alive_tasks: IntGauge,
    open_fds: IntGauge,
    pipes_pooled: IntGauge,
    /// Where [`Metrics::refresh`] reads `pipes_pooled` ([`Metrics::read_pipes_pooled_from`]).
    pipes_pooled_source: Arc<OnceLock<Gauged>>,
    pub retire_requests: IntCounter,
}

/// A value read by its owner for a gauge.
type Gauged = Box<dyn Fn() -> usize + Send + Sync>;

/// Exports counters that the data path keeps per thread: at each gathering, every series is
/// brought up to the sum of its per-thread counter, then gathered as usual.
struct PerThread {
    exported: IntCounterVec,
    sources: Vec<(IntCounter, Arc<shard::Counter>)>,
    /// Two gatherings at once must not both add the same difference.
    sync: Mutex<()>,
}

impl Collector for PerThread {
    fn desc(&self) -> Vec<&Desc> {
        self.exported.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        {
            let _sync = self.sync.lock().expect("metrics sync lock");
            for (series, source) in &self.sources {
                let (now, shown) = (source.get(), series.get());
                if now > shown {
                    series.inc_by(now - shown);
                }
            }
        }
        self.exported.collect()
    }
}

/// Pre-resolved per-backend handles.
#[derive(Clone)]
pub struct BackendMetrics {
    pub up: IntGauge,
    pub active: IntGauge,
    pub connect_failures: IntCounter,
    pub connect_duration: Histogram,
    /// Created so the series reads 0 per backend; never incremented.
    _connections_closed: IntCounter,
    pub checks_ok: IntCounter,
    pub checks_not_ready: IntCounter,
    pub checks_failed: IntCounter,
    pub checks_refused: IntCounter,
    pub checks_skipped: IntCounter,
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help).namespace(PREFIX)
}

macro_rules! register {
    ($registry:expr, $metric:expr) => {{
        let m = $metric.expect("metric definition is valid");
        $registry
            .register(Box::new(m.clone()))
            .expect("metric registered once");
        m
    }};
}

/// A counter named `name`, registered on `r`.
fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    register!(r, IntCounter::with_opts(opts(name, help)))
}

/// A gauge named `name`, registered on `r`.
fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    register!(r, IntGauge::with_opts(opts(name, help)))
}

/// A counter with `labels`, registered on `r`.
fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register!(r, IntCounterVec::new(opts(name, help), labels))
}

/// A gauge with `labels`, registered on `r`.
fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register!(r, IntGaugeVec::new(opts(name, help), labels))
}

/// The per-backend families, labelled by backend address ([`Metrics::backend`] resolves them).
struct BackendFamilies {
    up: IntGaugeVec,
    active: IntGaugeVec,
    connect_failures: IntCounterVec,
    connect_duration: HistogramVec,
    connections_closed: IntCounterVec,
    health_checks: IntCounterVec,
}

impl BackendFamilies {
    fn register(r: &Registry) -> Self {
        BackendFamilies {
            up: gauge_vec(
                r,
                BACKEND_UP,
                "1 when the backend passes its health check.",
                &["backend"],
            ),
            active: gauge_vec(
                r,
                BACKEND_ACTIVE,
                "Connections carried to the backend.",
                &["backend"],
            ),
            connect_failures: counter_vec(
                r,
                BACKEND_CONNECT_FAILURES,
                "Failed connects to the backend on client traffic.",
                &["backend"],
            ),
            connect_duration: register_connect_duration(r),
            connections_closed: counter_vec(
                r,
                BACKEND_CONNECTIONS_CLOSED,
                "Connections the proxy closed because of their backend's health. Stays 0: a \
                 backend that stops listening keeps its connections (kept for dashboards).",
                &["backend"],
            ),
            health_checks: counter_vec(
                r,
                HEALTH_CHECKS,
                "Active health checks, by result.",
                &["backend", "result"],
            ),
        }
    }
}

/// Gauges of the process, set at start or read at every scrape ([`Metrics::refresh`]).
struct ProcessGauges {
    tcp_migrate_req: IntGauge,
    runtime_alive_tasks: IntGauge,
    pipes_pooled: IntGauge,
    open_fds: IntGauge,
}

impl ProcessGauges {
    fn register(r: &Registry) -> Self {
        ProcessGauges {
            tcp_migrate_req: gauge(
                r,
                TCP_MIGRATE_REQ,
                "Value of net.ipv4.tcp_migrate_req (-1: unknown).",
            ),
            runtime_alive_tasks: gauge(
                r,
                RUNTIME_ALIVE_TASKS,
                "Tasks alive in the async runtime (read at scrape).",
            ),
            pipes_pooled: gauge(
                r,
                PIPES_POOLED,
                "Idle splice pipes kept for reuse (two descriptors each).",
            ),
            open_fds: gauge(
                r,
                OPEN_FDS,
                "Open file descriptors of the process (read at scrape).",
            ),
        }
    }
}

/// `build_info{version}`, set to 1.
fn register_build_info(r: &Registry) {
    gauge_vec(r, BUILD_INFO, "Build information, value 1.", &["version"])
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
}

/// `bytes_total{direction}`, exported from the data path's per-thread counters, which are
/// returned: client to backend, backend to client.
fn register_bytes(r: &Registry) -> (Arc<shard::Counter>, Arc<shard::Counter>) {
    let bytes = IntCounterVec::new(
        opts(BYTES, "Bytes forwarded, by direction."),
        &["direction"],
    )
    .expect("metric definition is valid");
    let client_to_backend = Arc::new(shard::Counter::default());
    let backend_to_client = Arc::new(shard::Counter::default());
    r.register(Box::new(PerThread {
        exported: bytes.clone(),
        sources: vec![
            (
                bytes.with_label_values(&["client_to_backend"]),
                client_to_backend.clone(),
            ),
            (
                bytes.with_label_values(&["backend_to_client"]),
                backend_to_client.clone(),
            ),
        ],
        sync: Mutex::new(()),
    }))
    .expect("metric registered once");
    (client_to_backend, backend_to_client)
}

/// `backend_connect_duration_seconds{backend}`, from 100 µs to 2.5 s.
fn register_connect_duration(r: &Registry) -> HistogramVec {
    register!(
        r,
        HistogramVec::new(
            HistogramOpts::from(opts(
                BACKEND_CONNECT_DURATION,
                "Time to connect to the backend."
            ))
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5
            ]),
            &["backend"]
        )
    )
}

impl Metrics {
    /// Creates every metric and registers it on `registry`.
    pub fn new(registry: &Registry) -> Self {
        let r = registry;
        register_build_info(r);
        let (bytes_client_to_backend, bytes_backend_to_client) = register_bytes(r);
        let backend = BackendFamilies::register(r);
        let process = ProcessGauges::register(r);
        let client_address = counter_vec(
            r,
            CLIENT_ADDRESS_CONNECTIONS,
            "--client-address transparent: connections to a loopback backend from a client off \
             the node, made with the client's address (transparent) or, because that did not \
             work, normally (fallback).",
            &["result"],
        );
        let metrics = Metrics {
            connections_accepted: counter(r, CONNECTIONS_ACCEPTED, "Client connections accepted."),
            connections_active: gauge(r, CONNECTIONS_ACTIVE, "Client connections being carried."),
            connections_failed: counter_vec(
                r,
                CONNECTIONS_FAILED,
                "Client connections not carried, by reason.",
                &["reason"],
            ),
            bytes_client_to_backend,
            bytes_backend_to_client,
            client_address_transparent: client_address.with_label_values(&["transparent"]),
            client_address_fallback: client_address.with_label_values(&["fallback"]),
            backend_up: backend.up,
            backend_active: backend.active,
            backend_connect_failures: backend.connect_failures,
            backend_connect_duration: backend.connect_duration,
            backend_connections_closed: backend.connections_closed,
            health_checks: backend.health_checks,
            lifecycle_state: gauge_vec(
                r,
                LIFECYCLE_STATE,
                "1 for the current lifecycle state.",
                &["state"],
            ),
            handoffs: counter_vec(
                r,
                HANDOFFS,
                "Listener handoffs, by direction and result.",
                &["direction", "result"],
            ),
            handoff_peers_refused: counter(
                r,
                HANDOFF_PEERS_REFUSED,
                "Handoff connections refused: peer uid not allowed.",
            ),
            handoff_messages_rejected: counter(
                r,
                HANDOFF_MESSAGES_REJECTED,
                "Malformed or unexpected handoff messages rejected.",
            ),
            listening_sockets: gauge(r, LISTENING_SOCKETS, "Listening sockets held."),
            listening_sockets_dropped: counter(
                r,
                LISTENING_SOCKETS_DROPPED,
                "Listening sockets dropped because they could no longer accept.",
            ),
            tcp_migrate_req: process.tcp_migrate_req,
            runtime_alive_tasks: process.runtime_alive_tasks,
            pipes_pooled: process.pipes_pooled,
            pipes_pooled_source: Arc::default(),
            open_fds: process.open_fds,
            retire_requests: counter(
                r,
                RETIRE_REQUESTS,
                "Recovery instance: times it asked to be retired (--retire-file written) because a ready instance serves beside it.",
            ),
            admin_requests_rejected: counter(
                r,
                ADMIN_REQUESTS_REJECTED,
                "Admin requests rejected (bad method, path or size).",
            ),
            connections_via_successor: counter(
                r,
                CONNECTIONS_VIA_SUCCESSOR,
                "Clients of a draining instance that no backend took, carried to the successor that adopted the listening socket.",
            ),
        };
        metrics.precreate();
        metrics
    }

    /// Creates the labelled series that should read 0 before anything happened, so dashboards
    /// and alerts see them from the start.
    fn precreate(&self) {
        for reason in [
            FailReason::NoBackend,
            FailReason::MaxConnections,
            FailReason::AcceptError,
        ] {
            self.connections_failed
                .with_label_values(&[reason.as_str()]);
        }
        for (direction, results) in [
            (
                HandoffDirection::ShareSent,
                &[HandoffOutcome::Ok, HandoffOutcome::Error][..],
            ),
            (
                HandoffDirection::ShareReceived,
                &[HandoffOutcome::Ok, HandoffOutcome::Error][..],
            ),
            (
                HandoffDirection::AdoptSent,
                &[
                    HandoffOutcome::Ok,
                    HandoffOutcome::Error,
                    HandoffOutcome::NoPeer,
                ][..],
            ),
            (
                HandoffDirection::AdoptReceived,
                &[HandoffOutcome::Ok, HandoffOutcome::Refused][..],
            ),
        ] {
            for result in results {
                self.handoffs
                    .with_label_values(&[direction.as_str(), result.as_str()]);
            }
        }
    }

    /// Refreshes the gauges that are read rather than counted (call before gathering). The
    /// descriptor count walks `/proc/self/fd`, so it is done on the blocking pool.
    pub async fn refresh(&self) {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            self.runtime_alive_tasks
                .set(handle.metrics().num_alive_tasks() as i64);
        }
        if let Some(pooled) = self.pipes_pooled_source.get() {
            self.pipes_pooled.set(pooled() as i64);
        }
        let count = tokio::task::spawn_blocking(|| {
            // Minus the descriptor of the directory being read.
            std::fs::read_dir("/proc/self/fd").map(|dir| dir.count() as i64 - 1)
        });
        if let Ok(Ok(n)) = count.await {
            self.open_fds.set(n);
        }
    }

    /// Sets `splice_pipes_pooled` from `pooled` at every [`Metrics::refresh`]: the idle pipes
    /// of the copy's pools, which the copy owns. The first source is kept, a later one ignored.
    pub fn read_pipes_pooled_from(&self, pooled: impl Fn() -> usize + Send + Sync + 'static) {
        let _ = self.pipes_pooled_source.set(Box::new(pooled));
    }

    /// Counts a client connection that was not carried.
    pub fn connection_failed(&self, reason: FailReason) {
        self.connections_failed
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    /// Handles for one backend.
    pub fn backend(&self, backend: BackendAddr) -> BackendMetrics {
        let b = backend.to_string();
        let check = |result: &str| self.health_checks.with_label_values(&[&b, result]);
        let [ok, not_ready, failed, refused, skipped] = CHECK_RESULTS;
        BackendMetrics {
            up: self.backend_up.with_label_values(&[&b]),
            active: self.backend_active.with_label_values(&[&b]),
            connect_failures: self.backend_connect_failures.with_label_values(&[&b]),
            connect_duration: self.backend_connect_duration.with_label_values(&[&b]),
            _connections_closed: self.backend_connections_closed.with_label_values(&[&b]),
            checks_ok: check(ok),
            checks_not_ready: check(not_ready),
            checks_failed: check(failed),
            checks_refused: check(refused),
            checks_skipped: check(skipped),
        }
    }

    /// Deletes every series of a backend that is gone (its discovery entry expired, or the
    /// own apiserver moved to a new address): a dashboard or alert must not go on reading a
    /// frozen `backend_up` of an apiserver that no longer exists. Handles still held (a
    /// connection carried to it that is still open) keep working, detached from the registry.
    pub fn remove_backend(&self, backend: BackendAddr) {
        let b = backend.to_string();
        let labels = [b.as_str()];
        let _ = self.backend_up.remove_label_values(&labels);
        let _ = self.backend_active.remove_label_values(&labels);
        let _ = self.backend_connect_failures.remove_label_values(&labels);
        let _ = self.backend_connect_duration.remove_label_values(&labels);
        let _ = self.backend_connections_closed.remove_label_values(&labels);
        for result in CHECK_RESULTS {
            let _ = self.health_checks.remove_label_values(&[&b, result]);
        }
    }

    /// Sets the lifecycle gauge: 1 for `state`, 0 for every other.
    pub fn set_state(&self, state: &str, all: &[&str]) {
        for s in all {
            self.lifecycle_state
                .with_label_values(&[s])
                .set(i64::from(*s == state));
        }
    }

    /// Counts a handoff event.
    pub fn handoff(&self, direction: HandoffDirection, result: HandoffOutcome) {
        self.handoffs
            .with_label_values(&[direction.as_str(), result.as_str()])
            .inc();
    }
}

/// The metrics of the `recover` node agent (its own registry and `--metrics-listen`).
#[derive(Clone)]
pub struct CheckpointMetrics {
    /// Attempts to write the checkpoint, by `result` ([`CHECKPOINT_RESULTS`]).
    pub attempts: IntCounterVec,
    /// 1 while the pod that would be the checkpoint (or the checkpoint kept) fails the rules
    /// of the boot: a reboot now would not bring back the current apiserver.
    pub refused: IntGauge,
    /// When the checkpoint on disk was written (Unix seconds; 0: none).
    pub written: IntGauge,
    /// When the checkpoint was last found to be of the pod the writer would choose now, and to
    /// pass the rules of the boot (Unix seconds; 0: not yet since the agent started).
    pub verified: IntGauge,
    /// 1 while the checkpoint is active in the static pod directory (a recovery instance runs).
    pub active: IntGauge,
}

impl CheckpointMetrics {
    /// Creates the agent's metrics and registers them on `registry`.
    pub fn new(registry: &Registry) -> Self {
        let r = registry;
        let attempts = register!(
            r,
            IntCounterVec::new(
                opts(
                    CHECKPOINT_ATTEMPTS,
                    "Attempts of the recovery agent to write the checkpoint, by result."
                ),
                &["result"]
            )
        );
        for result in CHECKPOINT_RESULTS {
            attempts.with_label_values(&[result]);
        }
        let gauge = |name: &str, help: &str| register!(r, IntGauge::with_opts(opts(name, help)));
        Self {
            attempts,
            refused: gauge(
                CHECKPOINT_REFUSED,
                "1 while the pod that would become the checkpoint, or the checkpoint kept, fails the rules applied at boot.",
            ),
            written: gauge(
                CHECKPOINT_WRITTEN,
                "When the checkpoint on disk was written, Unix seconds (0: no checkpoint).",
            ),
            verified: gauge(
                CHECKPOINT_VERIFIED,
                "When the checkpoint was last found current: of the newest pod ready long enough, passing the rules applied at boot (Unix seconds).",
            ),
            active: gauge(
                CHECKPOINT_ACTIVE,
                "1 while the checkpoint is active in the kubelet's static pod directory.",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `backend` label values of every series in the registry.
    fn backends_seen(registry: &Registry) -> Vec<String> {
        let mut seen: Vec<String> = registry
            .gather()
            .iter()
            .flat_map(|family| family.get_metric().iter())
            .flat_map(|m| m.get_label().iter())
            .filter(|l| l.get_name() == "backend")
            .map(|l| l.get_value().to_owned())
            .collect();
        seen.sort();
        seen.dedup();
        seen
    }

    #[test]
    fn removed_backends_leave_no_series() {
        let registry = Registry::new();
        let metrics = Metrics::new(&registry);
        let (a, b) = (
            BackendAddr("127.1.2.3:6443".parse().unwrap()),
            BackendAddr("127.4.5.6:6443".parse().unwrap()),
        );
        let held = metrics.backend(a);
        held.up.set(1);
        held.checks_ok.inc();
        held.connect_duration.observe(0.001);
        metrics.backend(b).up.set(1);
        assert_eq!(
            backends_seen(&registry),
            ["127.1.2.3:6443", "127.4.5.6:6443"]
        );

        metrics.remove_backend(a);
        assert_eq!(backends_seen(&registry), ["127.4.5.6:6443"]);
        // A handle still held (a connection still open) no longer reaches the registry.
        held.active.inc();
        held.checks_ok.inc();
        assert_eq!(backends_seen(&registry), ["127.4.5.6:6443"]);
        // The same address coming back starts from fresh series.
        let again = metrics.backend(a);
        assert_eq!(again.checks_ok.get(), 0);
        assert_eq!(
            backends_seen(&registry),
            ["127.1.2.3:6443", "127.4.5.6:6443"]
        );
    }
}
