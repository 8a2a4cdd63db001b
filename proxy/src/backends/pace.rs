//! Pacing of held clients: when a backend comes back, the clients held while none could be
//! reached are released at the pace the backend answers, not all in the same instant.
//!
//! A connect completes when the backend's kernel has put the connection in the backend's
//! accept queue, whether or not the backend process has taken it yet. A burst larger than that
//! queue (kube-apiserver's is `net.core.somaxconn`, 4096 by default; Rust's and many others'
//! 128) is dropped by the backend's kernel, and each dropped handshake is retried by ours only
//! after 1 s, then 3 s: a reconnection storm released at once ends in those tails. So a held
//! client takes a turn from its backend's [`Pace`] before each connect and keeps it until the
//! backend has answered on the new connection (its first byte, or its close: the backend
//! process took the connection and served it) — at most [`WINDOW`] such connections are opening
//! at once, and each next one starts as an earlier one is answered.
//!
//! Only held clients take turns: a client whose first connect succeeds (every client while a
//! backend is up) never waits and touches nothing shared. A held client that cannot get a turn
//! within [`TURN_WAIT`] goes anyway, so connections that never get an answer (a client that
//! sends nothing) cannot hold the others back for longer.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Connections of held clients opening to one backend at once: below the smallest accept
/// queue in common use (128).
pub const WINDOW: usize = 64;
/// How long a held client waits for a turn before it connects without one.
pub const TURN_WAIT: Duration = Duration::from_millis(250);

/// The turns of one backend.
pub struct Pace {
    turns: Arc<Semaphore>,
}

impl Default for Pace {
    fn default() -> Self {
        Self::new(WINDOW)
    }
}

impl Pace {
    pub fn new(window: usize) -> Self {
        Pace {
            turns: Arc::new(Semaphore::new(window)),
        }
    }

    /// Waits for a turn, at most `wait`; `None`: none came in time (go without one).
    pub async fn turn(&self, wait: Duration) -> Option<Turn> {
        let turns = self.turns.clone();
        match tokio::time::timeout(wait, turns.acquire_owned()).await {
            Ok(Ok(permit)) => Some(Turn { _permit: permit }),
            _ => None,
        }
    }

    /// Turns free now.
    pub fn free(&self) -> usize {
        self.turns.available_permits()
    }
}

/// A held client's turn: given back when dropped (the backend answered, or the attempt
/// failed).
#[derive(Debug)]
pub struct Turn {
    _permit: OwnedSemaphorePermit,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn turns_are_bounded_and_come_back() {
        let wait = Duration::from_millis(20);
        let pace = Pace::new(2);
        let a = pace.turn(wait).await.expect("a turn");
        let b = pace.turn(wait).await.expect("a turn");
        assert_eq!(pace.free(), 0);
        // The third waits, and goes without one after the wait.
        assert!(pace.turn(wait).await.is_none());
        drop(a);
        assert!(pace.turn(wait).await.is_some());
        drop(b);
        assert_eq!(pace.free(), 2);
    }
}
