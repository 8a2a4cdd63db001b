//! The metrics of the `recover` node agent, on its own registry (`--metrics-listen`): the
//! checkpoint's writes by result, whether it would be refused at boot, when it was written and
//! last found current, and whether it is active.

use prometheus::{IntCounterVec, IntGauge, Registry};

use crate::base::metrics::{counter_vec, gauge};

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
        let attempts = counter_vec(
            r,
            CHECKPOINT_ATTEMPTS,
            "Attempts of the recovery agent to write the checkpoint, by result.",
            &["result"],
        );
        for result in CHECKPOINT_RESULTS {
            attempts.with_label_values(&[result]);
        }
        Self {
            attempts,
            refused: gauge(
                r,
                CHECKPOINT_REFUSED,
                "1 while the pod that would become the checkpoint, or the checkpoint kept, fails the rules applied at boot.",
            ),
            written: gauge(
                r,
                CHECKPOINT_WRITTEN,
                "When the checkpoint on disk was written, Unix seconds (0: no checkpoint).",
            ),
            verified: gauge(
                r,
                CHECKPOINT_VERIFIED,
                "When the checkpoint was last found current: of the newest pod ready long enough, passing the rules applied at boot (Unix seconds).",
            ),
            active: gauge(
                r,
                CHECKPOINT_ACTIVE,
                "1 while the checkpoint is active in the kubelet's static pod directory.",
            ),
        }
    }
}
