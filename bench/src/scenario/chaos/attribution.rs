//! Which lost connections the chaos soak accepts: the rule that ties a failure to a SIGKILL
//! (or a stream's clean close to a drain), and nothing else.
//!
//! A SIGKILLed instance takes down the connections it was carrying at that instant; the kernel
//! closes their sockets, so the client sees a reset or an early EOF at once. The listening
//! socket itself survives (every instance holds the same shared socket), so connections still
//! queued in the kernel are accepted by a surviving instance and are *not* lost. Hence:
//!
//! **SIGKILL rule.** A failure is attributed to a SIGKILL when all of these hold:
//! 1. its kind is `reset` or `closed` (or a stream's clean EOF) — a kill never causes a
//!    refusal or a timeout;
//! 2. the client's connect had completed (the connection was established) before the killed
//!    process was seen dead (`dead_s`; a process may still accept between `kill()` and its
//!    death, so the signal time alone would be too strict);
//! 3. the client saw the failure no earlier than the signal (`signal_s`) and no later than
//!    `window` after the death.
//!
//! **Drain rule** (streams only). A long-lived stream closed cleanly (EOF, while idle or
//! mid-ping) by an instance that was SIGTERMed is a drain, not a failure: an instance cuts its
//! remaining connections at `--drain-timeout`, and watch clients reconnect. It applies when the
//! stream was established before that instance exited and closed between the signal and
//! `window` after the exit. A churn request (one request per connection, milliseconds long) cut
//! by a drain is a failure. When both rules fit a stream's clean close, the nearer event wins:
//! a kill's closes arrive within milliseconds of the death, a drain's just before the exit.
//!
//! Anything else — refusals, timeouts, resets or early closes with no kill nearby, failed
//! connects — is **unexplained**, and an unexplained failure is a proxy bug.

use serde::Serialize;

use crate::outcome::FailureKind;

/// One SIGKILL: when it was sent and when the process was seen dead (seconds since t0).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Kill {
    pub signal_s: f64,
    pub dead_s: f64,
}

/// One SIGTERM: when it was sent and when the process exited (seconds since t0).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Drain {
    pub signal_s: f64,
    pub exit_s: f64,
}

/// Which client made a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Client {
    /// One request per connection.
    Churn,
    /// A long-lived stream of pings.
    Stream,
}

/// How a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum End {
    /// Answered (churn), or still open when the load stopped (stream).
    Ok,
    /// A stream closed cleanly (EOF) while idle.
    Eof,
    /// Failed; a stream closed mid-ping is `Failed(Closed)`.
    Failed(FailureKind),
}

/// One client connection, times in seconds since t0.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Attempt {
    pub client: Client,
    pub began_s: f64,
    /// When the client's connect completed (`None`: it never did).
    pub established_s: Option<f64>,
    pub ended_s: f64,
    pub end: End,
}

/// What explains how a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// It did not fail.
    Ok,
    /// A stream closed cleanly by a draining (SIGTERMed) instance: not a failure.
    Drained,
    /// In flight in a SIGKILLed instance: an accepted loss.
    Killed,
    /// Nothing explains it: a proxy bug.
    Unexplained,
}

/// The actions the soak took, and the window of the rules.
#[derive(Debug, Clone)]
pub struct Rules {
    pub kills: Vec<Kill>,
    pub drains: Vec<Drain>,
    /// How long after a death (or exit) a failure may still be attributed to it.
    pub window_s: f64,
}

impl Rules {
    /// Seconds from the nearest death that explains `attempt` to its failure (negative: seen
    /// between the signal and the death), for a connection judged [`Verdict::Killed`].
    pub fn after_death(&self, attempt: &Attempt) -> Option<f64> {
        let established = attempt.established_s?;
        let at = attempt.ended_s;
        self.kills
            .iter()
            .filter(|k| {
                established < k.dead_s && k.signal_s <= at && at <= k.dead_s + self.window_s
            })
            .map(|k| at - k.dead_s)
            .min_by(|a, b| a.abs().total_cmp(&b.abs()))
    }

    /// Judges one connection.
    pub fn judge(&self, attempt: &Attempt) -> Verdict {
        let kind = match attempt.end {
            End::Ok => return Verdict::Ok,
            End::Eof => FailureKind::Closed,
            End::Failed(kind) => kind,
        };
        let Some(established) = attempt.established_s else {
            return Verdict::Unexplained;
        };
        if !matches!(kind, FailureKind::Reset | FailureKind::Closed) {
            return Verdict::Unexplained;
        }
        let at = attempt.ended_s;
        // The distance from the failure to the nearest death (or exit) each rule accepts.
        let kill = self.after_death(attempt).map(f64::abs);
        let drain = (attempt.client == Client::Stream && kind == FailureKind::Closed)
            .then(|| {
                self.drains
                    .iter()
                    .filter(|d| {
                        established < d.exit_s && d.signal_s <= at && at <= d.exit_s + self.window_s
                    })
                    .map(|d| (at - d.exit_s).abs())
                    .min_by(f64::total_cmp)
            })
            .flatten();
        match (kill, drain) {
            // Both could explain a stream's clean close: the nearer event wins (a kill's
            // closes arrive within milliseconds of the death, a drain's just before the exit).
            (Some(k), Some(d)) if d < k => Verdict::Drained,
            (Some(_), _) => Verdict::Killed,
            (None, Some(_)) => Verdict::Drained,
            (None, None) => Verdict::Unexplained,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Rules {
        Rules {
            kills: vec![Kill {
                signal_s: 10.0,
                dead_s: 10.01,
            }],
            drains: vec![Drain {
                signal_s: 20.0,
                exit_s: 21.1,
            }],
            window_s: 1.0,
        }
    }

    fn attempt(client: Client, established: Option<f64>, ended: f64, end: End) -> Attempt {
        Attempt {
            client,
            began_s: established.unwrap_or(ended) - 0.001,
            established_s: established,
            ended_s: ended,
            end,
        }
    }

    #[test]
    fn in_flight_at_a_kill_is_killed() {
        let r = rules();
        let reset = End::Failed(FailureKind::Reset);
        let closed = End::Failed(FailureKind::Closed);
        assert_eq!(
            r.judge(&attempt(Client::Churn, Some(9.99), 10.005, reset)),
            Verdict::Killed
        );
        // Established between kill() and death: the dying process may still have accepted it.
        assert_eq!(
            r.judge(&attempt(Client::Churn, Some(10.005), 10.02, closed)),
            Verdict::Killed
        );
        assert_eq!(
            r.judge(&attempt(Client::Stream, Some(3.0), 10.5, End::Eof)),
            Verdict::Killed
        );
    }

    #[test]
    fn outside_the_rule_is_unexplained() {
        let r = rules();
        let reset = End::Failed(FailureKind::Reset);
        // Established after the death.
        assert_eq!(
            r.judge(&attempt(Client::Churn, Some(10.02), 10.03, reset)),
            Verdict::Unexplained
        );
        // Failed too late after the death.
        assert_eq!(
            r.judge(&attempt(Client::Churn, Some(9.0), 11.5, reset)),
            Verdict::Unexplained
        );
        // Failed before the signal.
        assert_eq!(
            r.judge(&attempt(Client::Churn, Some(9.0), 9.5, reset)),
            Verdict::Unexplained
        );
        // A kill never causes a timeout or a refusal, nor a failed connect.
        let timeout = End::Failed(FailureKind::Timeout);
        assert_eq!(
            r.judge(&attempt(Client::Churn, Some(9.0), 10.5, timeout)),
            Verdict::Unexplained
        );
        let refused = End::Failed(FailureKind::Refused);
        assert_eq!(
            r.judge(&attempt(Client::Churn, None, 10.5, refused)),
            Verdict::Unexplained
        );
        assert_eq!(
            r.judge(&attempt(Client::Churn, Some(1.0), 2.0, End::Ok)),
            Verdict::Ok
        );
    }

    #[test]
    fn drains_close_streams_only() {
        let r = rules();
        let closed = End::Failed(FailureKind::Closed);
        assert_eq!(
            r.judge(&attempt(Client::Stream, Some(15.0), 21.0, End::Eof)),
            Verdict::Drained
        );
        assert_eq!(
            r.judge(&attempt(Client::Stream, Some(15.0), 21.0, closed)),
            Verdict::Drained
        );
        // A reset is not a clean drain; a churn request is too short to be cut by one.
        let reset = End::Failed(FailureKind::Reset);
        assert_eq!(
            r.judge(&attempt(Client::Stream, Some(15.0), 21.0, reset)),
            Verdict::Unexplained
        );
        assert_eq!(
            r.judge(&attempt(Client::Churn, Some(20.9), 21.0, closed)),
            Verdict::Unexplained
        );
        // Both fit: the nearer event wins.
        let both = Rules {
            kills: vec![Kill {
                signal_s: 20.5,
                dead_s: 20.51,
            }],
            ..rules()
        };
        assert_eq!(
            both.judge(&attempt(Client::Stream, Some(15.0), 21.05, End::Eof)),
            Verdict::Drained
        );
        assert_eq!(
            both.judge(&attempt(Client::Stream, Some(15.0), 20.511, End::Eof)),
            Verdict::Killed
        );
        // A stream closed with no drain or kill nearby.
        assert_eq!(
            r.judge(&attempt(Client::Stream, Some(1.0), 5.0, End::Eof)),
            Verdict::Unexplained
        );
    }
}
