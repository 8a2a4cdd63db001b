//! The rise/fall health state machine of one backend. Pure: no I/O, no clocks.
//!
//! A backend starts `Unknown` (not used while anything else is healthy). `rise` consecutive
//! passing checks make it `Up`. `fall` consecutive failing checks make an `Up` backend `Down`
//! (not ready: no new connections, existing ones kept). `fall` consecutive *refused* connects
//! make it `Dead` (nothing listens; its established connections are kept all the same: a
//! closed listener is no evidence that they are dead — kube-apiserver closes its listener and
//! then drains the connections it has). A
//! connect failure on client traffic marks an `Up` backend `Down` at once ([`HealthState::suspect`]).

use std::num::NonZeroU32;

/// What one active check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// The check passed (HTTP 200, handshake or connect succeeded).
    Ok,
    /// The backend answered but is not ready (HTTP status other than 200).
    NotReady,
    /// Timeout, handshake or protocol error.
    Failed,
    /// The TCP connect was refused: nothing listens there.
    Refused,
    /// The check could not run here (out of descriptors): says nothing about the backend.
    Skipped,
}

impl Observation {
    pub fn as_str(self) -> &'static str {
        match self {
            Observation::Ok => "ok",
            Observation::NotReady => "not_ready",
            Observation::Failed => "failed",
            Observation::Refused => "refused",
            Observation::Skipped => "skipped",
        }
    }
}

/// Health of a backend as the proxy treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// Not yet passed `rise` checks.
    Unknown,
    /// Healthy: gets new connections.
    Up,
    /// Not ready: no new connections, existing ones kept.
    Down,
    /// Refusing connections (nothing listens): no new connections; existing ones are kept
    /// until the kernel finds them dead.
    Dead,
}

impl Health {
    pub fn is_up(self) -> bool {
        self == Health::Up
    }
}

/// Rise/fall counters of one backend.
#[derive(Debug, Clone)]
pub struct HealthState {
    health: Health,
    passes: u32,
    failures: u32,
    refusals: u32,
    rise: u32,
    fall: u32,
}

impl HealthState {
    pub fn new(rise: NonZeroU32, fall: NonZeroU32) -> Self {
        HealthState {
            health: Health::Unknown,
            passes: 0,
            failures: 0,
            refusals: 0,
            rise: rise.get(),
            fall: fall.get(),
        }
    }

    pub fn health(&self) -> Health {
        self.health
    }

    /// Feeds one check result; returns the new health when it changed.
    pub fn observe(&mut self, obs: Observation) -> Option<Health> {
        let before = self.health;
        match obs {
            Observation::Skipped => {}
            Observation::Ok => {
                self.passes = self.passes.saturating_add(1);
                self.failures = 0;
                self.refusals = 0;
                if self.passes >= self.rise {
                    self.health = Health::Up;
                }
            }
            Observation::NotReady | Observation::Failed | Observation::Refused => {
                self.passes = 0;
                self.failures = self.failures.saturating_add(1);
                if obs == Observation::Refused {
                    self.refusals = self.refusals.saturating_add(1);
                } else {
                    self.refusals = 0;
                }
                if self.refusals >= self.fall {
                    self.health = Health::Dead;
                } else if self.failures >= self.fall && self.health != Health::Dead {
                    self.health = Health::Down;
                }
            }
        }
        (self.health != before).then_some(self.health)
    }

    /// A connect failure on client traffic: an `Up` backend is `Down` at once and must pass
    /// `rise` checks again. Returns the new health when it changed.
    pub fn suspect(&mut self) -> Option<Health> {
        self.passes = 0;
        if self.health == Health::Up {
            self.health = Health::Down;
            return Some(Health::Down);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Observation::*;

    fn state(rise: u32, fall: u32) -> HealthState {
        HealthState::new(
            NonZeroU32::new(rise).unwrap(),
            NonZeroU32::new(fall).unwrap(),
        )
    }

    #[test]
    fn rises_after_rise_passes() {
        let mut s = state(2, 3);
        assert_eq!(s.observe(Ok), None);
        assert_eq!(s.observe(Ok), Some(Health::Up));
        assert_eq!(s.observe(Ok), None);
    }

    #[test]
    fn falls_after_fall_failures_and_a_pass_resets() {
        let mut s = state(1, 3);
        s.observe(Ok);
        assert_eq!(s.observe(NotReady), None);
        assert_eq!(s.observe(Failed), None);
        assert_eq!(s.observe(Ok), None, "a pass resets the failure streak");
        s.observe(NotReady);
        s.observe(NotReady);
        assert_eq!(s.observe(NotReady), Some(Health::Down));
        assert_eq!(s.observe(Ok), Some(Health::Up));
    }

    #[test]
    fn refused_fall_times_is_dead_and_not_ready_is_not() {
        let mut s = state(1, 2);
        s.observe(Ok);
        assert_eq!(s.observe(Refused), None);
        assert_eq!(s.observe(Refused), Some(Health::Dead));
        assert_eq!(s.observe(NotReady), None, "dead stays dead until it passes");
        assert_eq!(s.observe(Ok), Some(Health::Up));
        s.observe(Refused);
        assert_eq!(
            s.observe(NotReady),
            Some(Health::Down),
            "mixed failures: down, not dead"
        );
    }

    #[test]
    fn suspect_takes_an_up_backend_down_at_once() {
        let mut s = state(2, 3);
        assert_eq!(s.suspect(), None);
        s.observe(Ok);
        s.observe(Ok);
        assert_eq!(s.suspect(), Some(Health::Down));
        assert_eq!(s.observe(Ok), None, "needs rise passes again");
        assert_eq!(s.observe(Ok), Some(Health::Up));
    }
}
