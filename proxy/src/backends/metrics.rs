//! The backends' metrics, labelled by backend address: up, connections carried, connect
//! failures and times, and the health checks by result. [`BackendFamilies::backend`] resolves
//! one backend's handles once; [`BackendFamilies::remove`] deletes a gone backend's series.

use prometheus::{
    Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry,
};

use crate::base::addr::BackendAddr;
use crate::base::metrics::{counter_vec, gauge_vec, histogram_vec};

pub const BACKEND_UP: &str = "backend_up";
pub const BACKEND_ACTIVE: &str = "backend_active_connections";
pub const BACKEND_CONNECT_FAILURES: &str = "backend_connect_failures_total";
pub const BACKEND_CONNECT_DURATION: &str = "backend_connect_duration_seconds";
pub const BACKEND_CONNECTIONS_CLOSED: &str = "backend_connections_closed_total";
pub const HEALTH_CHECKS: &str = "health_checks_total";

/// The `result` label values of `health_checks_total`, one series each per backend.
const CHECK_RESULTS: [&str; 5] = ["ok", "not_ready", "failed", "refused", "skipped"];

/// Pre-resolved per-backend handles.
#[derive(Clone)]
pub struct BackendMetrics {
    pub up: IntGauge,
    pub active: IntGauge,
    pub connect_failures: IntCounter,
    pub connect_duration: Histogram,
    /// Created so the series exists at 0 (see [`BACKEND_CONNECTIONS_CLOSED`]).
    _connections_closed: IntCounter,
    pub checks_ok: IntCounter,
    pub checks_not_ready: IntCounter,
    pub checks_failed: IntCounter,
    pub checks_refused: IntCounter,
    pub checks_skipped: IntCounter,
}

/// The per-backend families ([`BackendFamilies::backend`] resolves them).
#[derive(Clone)]
pub struct BackendFamilies {
    up: IntGaugeVec,
    active: IntGaugeVec,
    connect_failures: IntCounterVec,
    connect_duration: HistogramVec,
    connections_closed: IntCounterVec,
    health_checks: IntCounterVec,
}

impl BackendFamilies {
    /// Creates the families and registers them on `r`.
    pub fn register(r: &Registry) -> Self {
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
            // From 100 µs to 2.5 s.
            connect_duration: histogram_vec(
                r,
                BACKEND_CONNECT_DURATION,
                "Time to connect to the backend.",
                vec![
                    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0, 2.5,
                ],
                &["backend"],
            ),
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

    /// Handles for one backend.
    pub fn backend(&self, backend: BackendAddr) -> BackendMetrics {
        let b = backend.to_string();
        let check = |result: &str| self.health_checks.with_label_values(&[&b, result]);
        let [ok, not_ready, failed, refused, skipped] = CHECK_RESULTS;
        BackendMetrics {
            up: self.up.with_label_values(&[&b]),
            active: self.active.with_label_values(&[&b]),
            connect_failures: self.connect_failures.with_label_values(&[&b]),
            connect_duration: self.connect_duration.with_label_values(&[&b]),
            _connections_closed: self.connections_closed.with_label_values(&[&b]),
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
    pub fn remove(&self, backend: BackendAddr) {
        let b = backend.to_string();
        let labels = [b.as_str()];
        let _ = self.up.remove_label_values(&labels);
        let _ = self.active.remove_label_values(&labels);
        let _ = self.connect_failures.remove_label_values(&labels);
        let _ = self.connect_duration.remove_label_values(&labels);
        let _ = self.connections_closed.remove_label_values(&labels);
        for result in CHECK_RESULTS {
            let _ = self.health_checks.remove_label_values(&[&b, result]);
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
        let metrics = BackendFamilies::register(&registry);
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

        metrics.remove(a);
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
