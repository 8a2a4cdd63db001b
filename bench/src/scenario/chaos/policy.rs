//! What the soak does next: start an instance, SIGTERM one or SIGKILL one, chosen at random
//! but never leaving the address without a Serving instance.
//!
//! - **Start** is likelier when fewer than the target number of instances are live (Starting
//!   or Serving) and impossible at target + 2: with target 3, the fleet hovers around three.
//! - **SIGTERM** takes a Starting or Serving instance; **SIGKILL** any instance, Draining
//!   ones included (a pod killed at the end of its grace period). Either only when another
//!   instance is Serving afterwards.
//! - The victim is uniform among the eligible, except that the oldest Serving instance is
//!   spared unless a `oldest_victim` coin says otherwise: some instances then live for tens of
//!   seconds, through many handoffs, which is where a leak would show.

use rand::Rng;
use serde::Serialize;

/// One kind of action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    Start,
    Sigterm,
    Sigkill,
}

impl ActionKind {
    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            ActionKind::Start => "start",
            ActionKind::Sigterm => "SIGTERM",
            ActionKind::Sigkill => "SIGKILL",
        }
    }
}

/// Where an instance is in its life, as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Spawned, `/readyz` not yet 200.
    Starting,
    /// Ready and not signalled.
    Serving,
    /// SIGTERMed, not yet exited.
    Draining,
}

/// The policy's parameters.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Instances the fleet hovers around.
    pub target: usize,
    /// Chance that the oldest Serving instance may be picked as a victim.
    pub oldest_victim: f64,
}

impl Policy {
    /// Picks the next action and its victim (an index into `phases`, which is in start order);
    /// `None` if nothing may be done now.
    pub fn choose(&self, phases: &[Phase], rng: &mut impl Rng) -> Option<(ActionKind, usize)> {
        let live = phases.iter().filter(|&&p| p != Phase::Draining).count();
        let p_start = if live >= self.target + 2 {
            0.0
        } else if live < self.target {
            0.7
        } else if live == self.target {
            0.34
        } else {
            0.15
        };
        let roll: f64 = rng.gen();
        let wanted = if roll < p_start {
            ActionKind::Start
        } else if roll < p_start + (1.0 - p_start) / 2.0 {
            ActionKind::Sigterm
        } else {
            ActionKind::Sigkill
        };
        let start = (p_start > 0.0).then_some((ActionKind::Start, phases.len()));
        if wanted == ActionKind::Start {
            return start;
        }
        self.victim(wanted, phases, rng)
            .map(|victim| (wanted, victim))
            .or(start)
    }

    fn victim(&self, kind: ActionKind, phases: &[Phase], rng: &mut impl Rng) -> Option<usize> {
        let serving = phases.iter().filter(|&&p| p == Phase::Serving).count();
        let oldest_serving = phases.iter().position(|&p| p == Phase::Serving);
        let spare_oldest = !rng.gen_bool(self.oldest_victim.clamp(0.0, 1.0));
        let eligible: Vec<usize> = phases
            .iter()
            .enumerate()
            .filter(|&(_, &phase)| !(kind == ActionKind::Sigterm && phase == Phase::Draining))
            // Another instance must be Serving afterwards.
            .filter(|&(_, &phase)| serving - usize::from(phase == Phase::Serving) >= 1)
            .map(|(i, _)| i)
            .collect();
        let spared: Vec<usize> = eligible
            .iter()
            .copied()
            .filter(|&i| !(spare_oldest && Some(i) == oldest_serving))
            .collect();
        let pool = if spared.is_empty() { eligible } else { spared };
        (!pool.is_empty()).then(|| pool[rng.gen_range(0..pool.len())])
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;
    use Phase::*;

    const POLICY: Policy = Policy {
        target: 3,
        oldest_victim: 0.1,
    };

    #[test]
    fn never_leaves_the_address_without_a_serving_instance() {
        let mut rng = StdRng::seed_from_u64(1);
        let fleets: [&[Phase]; 5] = [
            &[Serving],
            &[Serving, Starting],
            &[Serving, Draining, Starting],
            &[Serving, Serving, Draining],
            &[Draining, Serving, Serving, Serving, Starting],
        ];
        for phases in fleets {
            for _ in 0..1000 {
                let Some((kind, victim)) = POLICY.choose(phases, &mut rng) else {
                    continue;
                };
                if kind == ActionKind::Start {
                    assert_eq!(victim, phases.len());
                    continue;
                }
                let mut after = phases.to_vec();
                after[victim] = Draining;
                assert!(after.contains(&Serving), "{kind:?} {victim} of {phases:?}");
                if kind == ActionKind::Sigterm {
                    assert_ne!(phases[victim], Draining);
                }
            }
        }
    }

    #[test]
    fn hovers_around_the_target() {
        let mut rng = StdRng::seed_from_u64(2);
        let full = [Serving; 5];
        for _ in 0..100 {
            let (kind, _) = POLICY.choose(&full, &mut rng).expect("an action");
            assert_ne!(kind, ActionKind::Start);
        }
        let alone = [Serving];
        for _ in 0..100 {
            assert_eq!(
                POLICY.choose(&alone, &mut rng).map(|a| a.0),
                Some(ActionKind::Start)
            );
        }
    }

    #[test]
    fn spares_the_oldest_mostly() {
        let mut rng = StdRng::seed_from_u64(3);
        let phases = [Serving, Serving, Serving];
        let mut oldest = 0u32;
        let mut removals = 0u32;
        for _ in 0..10_000 {
            if let Some((kind, victim)) = POLICY.choose(&phases, &mut rng) {
                if kind != ActionKind::Start {
                    removals += 1;
                    oldest += u32::from(victim == 0);
                }
            }
        }
        let share = f64::from(oldest) / f64::from(removals);
        assert!(share < 0.1, "oldest picked {share}");
        assert!(oldest > 0);
    }
}
