//! How a connection or request failed, and counts of each kind.

use std::io;

use serde::Serialize;

/// The kind of a failed connection or request, as a client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// `connect` was refused (nobody listening).
    Refused,
    /// The connection was reset (RST), or a write hit a closed socket.
    Reset,
    /// No answer within the request timeout.
    Timeout,
    /// The peer closed before the full answer arrived.
    Closed,
    /// Anything else.
    Other,
}

impl FailureKind {
    /// Every kind, in report order.
    pub const ALL: [FailureKind; 5] = [
        FailureKind::Refused,
        FailureKind::Reset,
        FailureKind::Timeout,
        FailureKind::Closed,
        FailureKind::Other,
    ];

    /// Classifies an I/O error.
    pub fn of(err: &io::Error) -> Self {
        match err.kind() {
            io::ErrorKind::ConnectionRefused => FailureKind::Refused,
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => FailureKind::Reset,
            io::ErrorKind::TimedOut => FailureKind::Timeout,
            io::ErrorKind::UnexpectedEof => FailureKind::Closed,
            _ => FailureKind::Other,
        }
    }

    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::Refused => "refused",
            FailureKind::Reset => "reset",
            FailureKind::Timeout => "timeout",
            FailureKind::Closed => "closed",
            FailureKind::Other => "other",
        }
    }
}

/// Failures counted by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FailureCounts {
    pub refused: u64,
    pub reset: u64,
    pub timeout: u64,
    pub closed: u64,
    pub other: u64,
}

impl FailureCounts {
    /// Counts one failure.
    pub fn add(&mut self, kind: FailureKind) {
        *self.slot(kind) += 1;
    }

    /// Adds all counts of `other`.
    pub fn merge(&mut self, other: &FailureCounts) {
        for kind in FailureKind::ALL {
            *self.slot(kind) += other.get(kind);
        }
    }

    /// The count of one kind.
    pub fn get(&self, kind: FailureKind) -> u64 {
        match kind {
            FailureKind::Refused => self.refused,
            FailureKind::Reset => self.reset,
            FailureKind::Timeout => self.timeout,
            FailureKind::Closed => self.closed,
            FailureKind::Other => self.other,
        }
    }

    /// All failures.
    pub fn total(&self) -> u64 {
        FailureKind::ALL.iter().map(|&k| self.get(k)).sum()
    }

    fn slot(&mut self, kind: FailureKind) -> &mut u64 {
        match kind {
            FailureKind::Refused => &mut self.refused,
            FailureKind::Reset => &mut self.reset,
            FailureKind::Timeout => &mut self.timeout,
            FailureKind::Closed => &mut self.closed,
            FailureKind::Other => &mut self.other,
        }
    }
}

impl std::fmt::Display for FailureCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = FailureKind::ALL
            .iter()
            .filter(|&&k| self.get(k) > 0)
            .map(|&k| format!("{} {}", self.get(k), k.name()))
            .collect();
        if parts.is_empty() {
            write!(f, "0")
        } else {
            write!(f, "{} ({})", self.total(), parts.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_io_errors() {
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(FailureKind::of(&refused), FailureKind::Refused);
        let pipe = io::Error::from(io::ErrorKind::BrokenPipe);
        assert_eq!(FailureKind::of(&pipe), FailureKind::Reset);
        let eof = io::Error::from(io::ErrorKind::UnexpectedEof);
        assert_eq!(FailureKind::of(&eof), FailureKind::Closed);
    }

    #[test]
    fn counts_and_displays() {
        let mut counts = FailureCounts::default();
        assert_eq!(counts.to_string(), "0");
        counts.add(FailureKind::Reset);
        counts.add(FailureKind::Reset);
        counts.add(FailureKind::Timeout);
        assert_eq!(counts.total(), 3);
        assert_eq!(counts.to_string(), "3 (2 reset, 1 timeout)");
    }
}
