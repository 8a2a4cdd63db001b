//! Label values of the `handoffs_total` counter: which exchange, and how it ended.

/// Which handoff exchange a count is for (the `direction` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// We sent duplicates of our listening sockets to a starting peer.
    ShareSent,
    /// A peer sent us duplicates of its listening sockets.
    ShareReceived,
    /// We offered our listening sockets to a ready peer while draining.
    AdoptSent,
    /// A draining peer offered us its listening sockets.
    AdoptReceived,
    /// We offered established connections to a successor (in-place upgrade).
    ConnectionsSent,
    /// A predecessor offered us established connections.
    ConnectionsReceived,
}

impl Direction {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::ShareSent => "share_sent",
            Direction::ShareReceived => "share_received",
            Direction::AdoptSent => "adopt_sent",
            Direction::AdoptReceived => "adopt_received",
            Direction::ConnectionsSent => "connections_sent",
            Direction::ConnectionsReceived => "connections_received",
        }
    }
}

/// How a handoff exchange ended (the `result` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Error,
    /// The peer (or we) declined.
    Refused,
    /// No ready peer was found before the drain deadline.
    NoPeer,
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Refused => "refused",
            Outcome::NoPeer => "no_peer",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_the_exported_ones() {
        let directions = [
            Direction::ShareSent,
            Direction::ShareReceived,
            Direction::AdoptSent,
            Direction::AdoptReceived,
            Direction::ConnectionsSent,
            Direction::ConnectionsReceived,
        ]
        .map(Direction::as_str);
        assert_eq!(
            directions,
            [
                "share_sent",
                "share_received",
                "adopt_sent",
                "adopt_received",
                "connections_sent",
                "connections_received"
            ]
        );
        let outcomes = [
            Outcome::Ok,
            Outcome::Error,
            Outcome::Refused,
            Outcome::NoPeer,
        ]
        .map(Outcome::as_str);
        assert_eq!(outcomes, ["ok", "error", "refused", "no_peer"]);
    }
}
