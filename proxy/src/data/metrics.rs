//! The data path's metrics: client connections (accepted, carried, not carried and why), the
//! bytes forwarded, the listening sockets held, the client-address mode's connections, the
//! clients carried to a successor, and the splice pipes pooled.

use std::sync::Arc;

use prometheus::{IntCounter, IntCounterVec, IntGauge, Registry};

use crate::base::metrics::{counter, counter_vec, gauge, PerThread, ReadGauge};
use crate::base::shard;

pub const CONNECTIONS_ACCEPTED: &str = "connections_accepted_total";
pub const CONNECTIONS_ACTIVE: &str = "connections_active";
pub const CONNECTIONS_FAILED: &str = "connections_failed_total";
pub const BYTES: &str = "bytes_total";
pub const LISTENING_SOCKETS: &str = "listening_sockets";
pub const LISTENING_SOCKETS_DROPPED: &str = "listening_sockets_dropped_total";
pub const CONNECTIONS_VIA_SUCCESSOR: &str = "connections_via_successor_total";
pub const PIPES_POOLED: &str = "splice_pipes_pooled";
pub const CLIENT_ADDRESS_CONNECTIONS: &str = "client_address_connections_total";

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

/// The data path's handles.
#[derive(Clone)]
pub struct DataMetrics {
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
    pub listening_sockets: IntGauge,
    pub listening_sockets_dropped: IntCounter,
    pub connections_via_successor: IntCounter,
}

impl DataMetrics {
    /// Creates the data path's metrics and registers them on `r`; `splice_pipes_pooled` is
    /// read from the copy's pools ([`crate::data::copy::pooled_pipes`]) at every gathering.
    pub fn register(r: &Registry) -> Self {
        let bytes = PerThread::register(
            r,
            BYTES,
            "Bytes forwarded, by direction.",
            "direction",
            &["client_to_backend", "backend_to_client"],
        );
        ReadGauge::register(
            r,
            PIPES_POOLED,
            "Idle splice pipes kept for reuse (two descriptors each).",
            crate::data::copy::pooled_pipes,
        );
        let client_address = counter_vec(
            r,
            CLIENT_ADDRESS_CONNECTIONS,
            "--client-address transparent: connections to a loopback backend from a client off \
             the node, made with the client's address (transparent) or, because that did not \
             work, normally (fallback).",
            &["result"],
        );
        let metrics = DataMetrics {
            connections_accepted: counter(r, CONNECTIONS_ACCEPTED, "Client connections accepted."),
            connections_active: gauge(r, CONNECTIONS_ACTIVE, "Client connections being carried."),
            connections_failed: counter_vec(
                r,
                CONNECTIONS_FAILED,
                "Client connections not carried, by reason.",
                &["reason"],
            ),
            bytes_client_to_backend: bytes[0].clone(),
            bytes_backend_to_client: bytes[1].clone(),
            client_address_transparent: client_address.with_label_values(&["transparent"]),
            client_address_fallback: client_address.with_label_values(&["fallback"]),
            listening_sockets: gauge(r, LISTENING_SOCKETS, "Listening sockets held."),
            listening_sockets_dropped: counter(
                r,
                LISTENING_SOCKETS_DROPPED,
                "Listening sockets dropped because they could no longer accept.",
            ),
            connections_via_successor: counter(
                r,
                CONNECTIONS_VIA_SUCCESSOR,
                "Clients of a draining instance that no backend took, carried to the successor that adopted the listening socket.",
            ),
        };
        // Read 0 before anything happened, so dashboards and alerts see them from the start.
        for reason in [
            FailReason::NoBackend,
            FailReason::MaxConnections,
            FailReason::AcceptError,
        ] {
            metrics
                .connections_failed
                .with_label_values(&[reason.as_str()]);
        }
        metrics
    }

    /// Counts a client connection that was not carried.
    pub fn connection_failed(&self, reason: FailReason) {
        self.connections_failed
            .with_label_values(&[reason.as_str()])
            .inc();
    }
}
