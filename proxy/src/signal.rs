//! Process signals mapped to intent.
//!
//! - SIGTERM: the kubelet or systemd stops us (pod deletion, rollout, `systemctl stop`): drain.
//! - SIGINT: an operator pressed Ctrl-C in a terminal: drain the same way.
//!
//! A second signal during the drain is ignored on purpose: the drain is already bounded by
//! `--drain-timeout`, and the kubelet follows up with SIGKILL at the grace period anyway.

use tokio::signal::unix::{signal, SignalKind};

/// Resolves when the process is asked to shut down; names the signal.
pub async fn shutdown() -> &'static str {
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler installs");
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
