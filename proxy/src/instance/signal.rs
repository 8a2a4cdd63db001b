//! Process signals mapped to intent.
//!
//! - SIGTERM: the kubelet or systemd stops us (pod deletion, rollout, `systemctl stop`): drain.
//! - SIGINT: an operator pressed Ctrl-C in a terminal: drain the same way.
//! - SIGUSR2: `systemctl reload` (or any supervisor, or an operator) asks for an in-place
//!   upgrade: start the binary at our path again (it may have been replaced), hand everything
//!   to it once it is ready, then drain ([`crate::instance::upgrade`]).
//!
//! A second SIGTERM/SIGINT during the drain is ignored on purpose: the drain is already bounded
//! by `--drain-timeout`, and the kubelet follows up with SIGKILL at the grace period anyway.

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

/// What a signal asks of the instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Intent {
    /// Drain and exit; names the signal.
    Shutdown(&'static str),
    /// Start a successor from our binary's path, hand over to it, then drain and exit.
    Upgrade,
}

/// Installs the handlers now (call inside the runtime, before anything else starts, so a signal
/// that arrives early is not fatal: SIGUSR2's default action would kill the process) and
/// returns the stream of intents.
pub fn intents() -> mpsc::Receiver<Intent> {
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler installs");
    let mut usr2 = signal(SignalKind::user_defined2()).expect("SIGUSR2 handler installs");
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        loop {
            let intent = tokio::select! {
                _ = term.recv() => Intent::Shutdown("SIGTERM"),
                _ = int.recv() => Intent::Shutdown("SIGINT"),
                _ = usr2.recv() => Intent::Upgrade,
            };
            if tx.send(intent).await.is_err() {
                return;
            }
        }
    });
    rx
}
