//! The lifecycle of one instance, published on a `watch` channel.
//!
//! `Starting → WaitingForBackend → Serving → Draining → Stopped`. Readiness, metrics, the
//! handoff server and logs all read the current state from here.

use std::fmt;

use tokio::sync::watch;

use crate::base::metrics::Metrics;

/// Lifecycle phase of the instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum State {
    /// Configuration parsed; admin server and health checks starting.
    Starting,
    /// No backend has passed its health check yet; the public address is not touched.
    WaitingForBackend,
    /// Accepting and forwarding.
    Serving,
    /// SIGTERM/SIGINT received: handing over listeners, letting connections finish.
    Draining,
    /// Done; the process exits.
    Stopped,
}

impl State {
    pub const ALL: [State; 5] = [
        State::Starting,
        State::WaitingForBackend,
        State::Serving,
        State::Draining,
        State::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Starting => "Starting",
            State::WaitingForBackend => "WaitingForBackend",
            State::Serving => "Serving",
            State::Draining => "Draining",
            State::Stopped => "Stopped",
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Owner side of the lifecycle: moves the state forward, logs and exports each change once.
pub struct Lifecycle {
    tx: watch::Sender<State>,
    metrics: Metrics,
}

impl Lifecycle {
    pub fn new(metrics: Metrics) -> Self {
        let (tx, _) = watch::channel(State::Starting);
        let lc = Lifecycle { tx, metrics };
        lc.export(State::Starting);
        tracing::info!(state = %State::Starting, "lifecycle");
        lc
    }

    /// A receiver of state changes.
    pub fn subscribe(&self) -> watch::Receiver<State> {
        self.tx.subscribe()
    }

    /// The current state.
    pub fn get(&self) -> State {
        *self.tx.borrow()
    }

    /// Moves to `next` if it is later than the current state; logs once per change.
    pub fn advance(&self, next: State) {
        let changed = self.tx.send_if_modified(|s| {
            if next > *s {
                *s = next;
                true
            } else {
                false
            }
        });
        if changed {
            self.export(next);
            tracing::info!(state = %next, "lifecycle");
        }
    }

    fn export(&self, state: State) {
        let all: Vec<&str> = State::ALL.iter().map(|s| s.as_str()).collect();
        self.metrics.set_state(state.as_str(), &all);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_moves_forward() {
        let lc = Lifecycle::new(Metrics::new(&prometheus::Registry::new()));
        lc.advance(State::Serving);
        lc.advance(State::WaitingForBackend);
        assert_eq!(lc.get(), State::Serving);
        lc.advance(State::Stopped);
        assert_eq!(lc.get(), State::Stopped);
    }
}
