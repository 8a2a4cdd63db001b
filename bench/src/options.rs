//! The option groups of the scenarios (clap `Args`): [`Timing`], shared by the scenarios that
//! measure every target in rounds, and one struct per scenario. The command line ([`crate::cli`])
//! flattens them into its subcommands; `all` builds them from their [`defaults`]. The module
//! names nothing else of the crate, so that the scenarios and the command line can both use it.

use std::time::Duration;

use clap::{Args, FromArgMatches, ValueEnum};
use serde::Serialize;

/// How long and how often each target is measured.
#[derive(Debug, Clone, Args)]
pub struct Timing {
    /// Rounds; each round runs every target once, alternately.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Measured time per run.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Load before the measured window starts (discarded).
    #[arg(long, default_value = "300ms", value_parser = humantime::parse_duration)]
    pub warmup: Duration,
}

/// The defaults of an argument group, as if given on the command line with no flags.
pub fn defaults<T: Args + FromArgMatches>() -> T {
    let command = T::augment_args(clap::Command::new("defaults"));
    let matches = command
        .try_get_matches_from(["defaults"])
        .expect("defaults parse");
    T::from_arg_matches(&matches).expect("defaults are valid")
}

/// Options of `throughput`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct ThroughputArgs {
    /// Concurrent connections.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Bytes per write.
    #[arg(long, default_value_t = 64 * 1024)]
    pub chunk: usize,
}

/// Options of `rr`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct RrArgs {
    /// Persistent connections, each with one request in flight.
    #[arg(long, default_value_t = 50)]
    pub connections: usize,
    /// Request (and response) size in bytes.
    #[arg(long, default_value_t = 64)]
    pub size: usize,
    /// Speak TLS end to end (through the target) to the TLS echo backend.
    #[arg(long)]
    pub tls: bool,
}

/// Options of `churn`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct ChurnArgs {
    /// Concurrent clients, each with one connection at a time.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Request (and response) size in bytes, 2 to 255.
    #[arg(long, default_value_t = 16)]
    pub size: usize,
    /// Speak TLS end to end (through the target) to the TLS echo backend: one full handshake
    /// per connection.
    #[arg(long)]
    pub tls: bool,
}

/// Options of `idle`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct IdleArgs {
    /// Idle connections to hold.
    #[arg(long, default_value_t = 1000)]
    pub connections: usize,
    /// Connections being opened at once.
    #[arg(long, default_value_t = 32)]
    pub ramp: usize,
}

/// Options of `threads`.
#[derive(Debug, Clone, Args)]
pub struct ThreadsArgs {
    /// Worker-thread counts, one `rr` run set each.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub threads: Vec<usize>,
    #[command(flatten)]
    pub rr: RrArgs,
}

/// Options of `storm`.
#[derive(Debug, Clone, Args)]
pub struct StormArgs {
    /// Long-lived connections. Each is one descriptor in the load generator and the backend and
    /// two in the target; beyond one process's descriptor limit every role is spread over
    /// several processes (`--processes`).
    #[arg(long, default_value_t = 1000)]
    pub connections: usize,
    /// Processes per role (target, backend, load generator) [default: the fewest whose
    /// descriptor limit holds the connections, 1 up to about 9,900 at a limit of 20,000].
    #[arg(long)]
    pub processes: Option<usize>,
    /// Connections being opened at once before the restart (in all processes together).
    #[arg(long, default_value_t = 64)]
    pub ramp: usize,
    /// Time between the backend's death and its new start.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub downtime: Duration,
    /// A client's first pause after a failed attempt; doubles up to 1 s, with jitter.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    pub retry: Duration,
    /// A client not back this long after the restart is counted as lost.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub deadline: Duration,
}

/// How an old HAProxy instance is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HaproxyStop {
    /// Hard stop: listeners and connections closed at once.
    Sigterm,
    /// Soft stop: listeners closed, connections kept until they end or `hard-stop-after`.
    Sigusr1,
}

/// Options of `rollout`.
#[derive(Debug, Clone, Args)]
pub struct RolloutArgs {
    /// Replacements per variant.
    #[arg(long, default_value_t = 10)]
    pub handoffs: u32,
    /// Steady load before the first and after each replacement.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub interval: Duration,
    #[command(flatten)]
    pub load: LoadArgs,
    /// Proxy `--drain-timeout` and HAProxy `hard-stop-after`.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Timeline bucket width.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    pub bucket: Duration,
    /// How old HAProxy instances are stopped; one run per value.
    #[arg(long, value_delimiter = ',', default_value = "sigterm,sigusr1")]
    pub haproxy_stop: Vec<HaproxyStop>,
    /// A pod rollout as a hand-made configuration runs it: each instance gets a backend of its
    /// own (its pod's apiserver) and knows no other, and the old instance's backend is stopped
    /// (process killed: listener and connections closed) as the old instance is signalled,
    /// as kube-apiserver with --shutdown-delay-duration=0 closes its listener at SIGTERM.
    #[arg(long)]
    pub own_backends: bool,
}

/// Options of `chaos`.
#[derive(Debug, Clone, Args)]
pub struct ChaosArgs {
    /// How long the chaos lasts (after the first instances are ready).
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Instances the fleet hovers around (started before the chaos begins).
    #[arg(long, default_value_t = 3)]
    pub instances: usize,
    /// Mean time between actions (each gap is uniform in 0.5×–1.5× this).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub interval: Duration,
    /// Chance that the oldest Serving instance may be a victim (others always may).
    #[arg(long, default_value_t = 0.1)]
    pub oldest_victim: f64,
    /// Random seed of the actions [default: random, printed].
    #[arg(long)]
    pub seed: Option<u64>,
    #[command(flatten)]
    pub load: LoadArgs,
    /// Proxy `--drain-timeout` (`--drain-close-window` is a quarter of it).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// A reset or early close is blamed on a SIGKILL only if seen within this long after the
    /// death (and the connection was established before it).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub kill_window: Duration,
    /// RSS and descriptor sampling interval.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub sample_interval: Duration,
    /// Instances living at least this long are checked for growth.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub min_lifetime: Duration,
    /// Timeline bucket width.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub bucket: Duration,
}

/// The steady load of `rollout` and `chaos`: churn clients (a new connection per request,
/// paced) and long-lived streams (a ping echoed every interval, reconnecting when closed).
#[derive(Debug, Clone, Copy, Args)]
pub struct LoadArgs {
    /// Churn clients (each a new connection per request).
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Churn requests per second, over all clients.
    #[arg(long, default_value_t = 1000)]
    pub rate: u32,
    /// Long-lived streams (each sends a ping and waits for the echo every --stream-interval).
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
    /// Ping interval on each stream.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    pub stream_interval: Duration,
    /// A connect, request or ping without an answer after this long is a timeout.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl LoadArgs {
    /// The load's entries of a scenario's JSON `parameters`.
    pub fn parameters(&self) -> serde_json::Map<String, serde_json::Value> {
        [
            ("clients", self.clients.into()),
            ("rate", self.rate.into()),
            ("streams", self.streams.into()),
            (
                "stream_interval_s",
                self.stream_interval.as_secs_f64().into(),
            ),
            ("timeout_s", self.timeout.as_secs_f64().into()),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value))
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse() {
        let timing: Timing = defaults();
        assert_eq!(timing.rounds, 3);
        let _: RolloutArgs = defaults();
        let chaos: ChaosArgs = defaults();
        assert_eq!(chaos.duration, Duration::from_secs(180));
    }
}
