//! The lifecycle of one instance, published on a `watch` channel.
//!
//! `Starting → WaitingForBackend → Serving → Draining → Stopped`. Readiness, metrics, the
//! handoff server and logs all read the current state from here.

use std::fmt;

use tokio::sync::watch;

use prometheus::{IntGaugeVec, Registry};

use crate::base::metrics::gauge_vec;

pub const LIFECYCLE_STATE: &str = "lifecycle_state";

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
    /// `lifecycle_state{state}`: 1 for the current state.
    gauge: IntGaugeVec,
}

impl Lifecycle {
    /// Starts in `Starting`; the state's gauge is registered on `registry`.
    pub fn new(registry: &Registry) -> Self {
        let (tx, _) = watch::channel(State::Starting);
        let gauge = gauge_vec(
            registry,
            LIFECYCLE_STATE,
            "1 for the current lifecycle state.",
            &["state"],
        );
        let lc = Lifecycle { tx, gauge };
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
        for s in State::ALL {
            self.gauge
                .with_label_values(&[s.as_str()])
                .set(i64::from(s == state));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_moves_forward() {
        let lc = Lifecycle::new(&Registry::new());
        lc.advance(State::Serving);
        lc.advance(State::WaitingForBackend);
        assert_eq!(lc.get(), State::Serving);
        lc.advance(State::Stopped);
        assert_eq!(lc.get(), State::Stopped);
    }
}
