//! The handoff's metrics: exchanges by direction and result, peers and messages refused, and
//! the kernel's `tcp_migrate_req` as this process found it.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Registry};

use crate::base::metrics::{counter, counter_vec, gauge};

pub const HANDOFFS: &str = "handoffs_total";
pub const HANDOFF_PEERS_REFUSED: &str = "handoff_peers_refused_total";
pub const HANDOFF_MESSAGES_REJECTED: &str = "handoff_messages_rejected_total";
pub const TCP_MIGRATE_REQ: &str = "tcp_migrate_req";

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

/// The handoff's handles.
#[derive(Clone)]
pub struct HandoffMetrics {
    handoffs: IntCounterVec,
    pub peers_refused: IntCounter,
    pub messages_rejected: IntCounter,
    /// `net.ipv4.tcp_migrate_req` (-1: unknown), set once at start.
    pub tcp_migrate_req: IntGauge,
}

impl HandoffMetrics {
    /// Creates the handoff's metrics and registers them on `r`.
    pub fn register(r: &Registry) -> Self {
        let metrics = HandoffMetrics {
            handoffs: counter_vec(
                r,
                HANDOFFS,
                "Listener handoffs, by direction and result.",
                &["direction", "result"],
            ),
            peers_refused: counter(
                r,
                HANDOFF_PEERS_REFUSED,
                "Handoff connections refused: peer uid not allowed.",
            ),
            messages_rejected: counter(
                r,
                HANDOFF_MESSAGES_REJECTED,
                "Malformed or unexpected handoff messages rejected.",
            ),
            tcp_migrate_req: gauge(
                r,
                TCP_MIGRATE_REQ,
                "Value of net.ipv4.tcp_migrate_req (-1: unknown).",
            ),
        };
        // The series a dashboard or alert reads from the start, at 0.
        use {HandoffDirection as D, HandoffOutcome as O};
        for (direction, results) in [
            (D::ShareSent, &[O::Ok, O::Error][..]),
            (D::ShareReceived, &[O::Ok, O::Error][..]),
            (D::AdoptSent, &[O::Ok, O::Error, O::NoPeer][..]),
            (D::AdoptReceived, &[O::Ok, O::Refused][..]),
        ] {
            for result in results {
                metrics
                    .handoffs
                    .with_label_values(&[direction.as_str(), result.as_str()]);
            }
        }
        metrics
    }

    /// Counts a handoff event.
    pub fn handoff(&self, direction: HandoffDirection, result: HandoffOutcome) {
        self.handoffs
            .with_label_values(&[direction.as_str(), result.as_str()])
            .inc();
    }
}
