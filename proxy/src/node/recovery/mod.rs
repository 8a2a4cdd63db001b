//! Reboot recovery: `recover`, the last-known-good checkpoint, its checks and its metrics.

pub mod checkpoint;
pub mod checkpoint_metrics;
pub mod recover;
pub mod staticpod;
