//! Process signals mapped to intent.
//!
//! - SIGTERM: the kubelet or systemd stops us (pod deletion, rollout, `systemctl stop`): drain.
//! - SIGINT: an operator pressed Ctrl-C in a terminal: drain the same way.
//!
//! A second signal during the drain is ignored on purpose: the drain is already bounded by
//! `--drain-timeout`, and the kubelet follows up with SIGKILL at the grace period anyway.

use std::future::Future;

use tokio::signal::unix::{signal, SignalKind};

/// Installs the handlers now (call inside the runtime, before anything else starts, so a signal
/// that arrives early is not fatal) and returns a future that resolves when the process is
/// asked to shut down, naming the signal.
pub fn shutdown() -> impl Future<Output = &'static str> {
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler installs");
    async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    }
}
