//! Whether this instance is ready for traffic: `Serving`, and its own backend up (or, without
//! `--own-backend-file`, any backend). `/readyz` answers it, and the handoff server reports it
//! to a draining peer, which hands its listening sockets only to a ready successor.

use std::sync::Arc;

use tokio::sync::watch;

use crate::backends::backend::{Backends, Tier};
use crate::base::lifecycle::State;

/// Reads the lifecycle state and the backends' health; cheap to clone.
#[derive(Clone)]
pub struct Readiness {
    state: watch::Receiver<State>,
    backend_ready: Arc<dyn Fn() -> bool + Send + Sync>,
}

impl Readiness {
    /// Ready when Serving and the own backend is up (`own_required`: `--own-backend-file`
    /// given), else when Serving and any backend is up.
    pub fn new(state: watch::Receiver<State>, backends: Arc<Backends>, own_required: bool) -> Self {
        Readiness::from_fn(state, move || {
            let list = backends.snapshot();
            let own: Vec<_> = list.iter().filter(|b| b.tier == Tier::Own).collect();
            if own.is_empty() && !own_required {
                list.iter().any(|b| b.health().is_up())
            } else {
                own.iter().any(|b| b.health().is_up())
            }
        })
    }

    /// Readiness from the state and a function saying whether the backend side is ready.
    pub fn from_fn(
        state: watch::Receiver<State>,
        backend_ready: impl Fn() -> bool + Send + Sync + 'static,
    ) -> Self {
        Readiness {
            state,
            backend_ready: Arc::new(backend_ready),
        }
    }

    /// The lifecycle state now.
    pub fn state(&self) -> State {
        *self.state.borrow()
    }

    /// Serving, and the backend side ready.
    pub fn ready(&self) -> bool {
        self.state() == State::Serving && (self.backend_ready)()
    }
}
