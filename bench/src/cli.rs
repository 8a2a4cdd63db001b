//! Command line: one subcommand per scenario, each with small defaults that finish in seconds.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, FromArgMatches, Parser, Subcommand};

use crate::backend::ServeBackendArgs;
use crate::scenario::{
    chaos::ChaosArgs,
    churn::ChurnArgs,
    idle::IdleArgs,
    rollout::RolloutArgs,
    rr::RrArgs,
    storm::{remote::StormClientsArgs, StormArgs},
    threads::ThreadsArgs,
    throughput::ThroughputArgs,
};
use crate::target::Target;
use crate::uring::ServeUringArgs;

/// Benchmarks kube-apiserver-proxy against the direct path and HAProxy, and demonstrates a
/// rollout under load.
#[derive(Debug, Parser)]
#[command(name = "bench", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// A scenario to run.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Bulk bytes both ways over a few connections: bytes/s, target CPU per GiB.
    Throughput {
        #[command(flatten)]
        setup: Setup,
        #[command(flatten)]
        timing: Timing,
        #[command(flatten)]
        args: ThroughputArgs,
    },
    /// Small requests over many persistent connections: requests/s and latency percentiles.
    Rr {
        #[command(flatten)]
        setup: Setup,
        #[command(flatten)]
        timing: Timing,
        #[command(flatten)]
        args: RrArgs,
    },
    /// A new connection per request: connections/s and connect+first-byte latency.
    Churn {
        #[command(flatten)]
        setup: Setup,
        #[command(flatten)]
        timing: Timing,
        #[command(flatten)]
        args: ChurnArgs,
    },
    /// Many idle proxied connections: resident memory of the target per connection.
    Idle {
        #[command(flatten)]
        setup: Setup,
        #[command(flatten)]
        timing: Timing,
        #[command(flatten)]
        args: IdleArgs,
    },
    /// `rr` once per worker-thread count (proxy `--worker-threads`, HAProxy `nbthread`).
    Threads {
        #[command(flatten)]
        setup: Setup,
        #[command(flatten)]
        timing: Timing,
        #[command(flatten)]
        args: ThreadsArgs,
    },
    /// Long-lived connections reconnecting at once after a backend restart: time until all are
    /// back, failed attempts, target memory.
    Storm {
        #[command(flatten)]
        setup: Setup,
        #[command(flatten)]
        timing: Timing,
        #[command(flatten)]
        args: StormArgs,
    },
    /// The demo: churn and long-lived streams while instances are replaced; failures by kind.
    Rollout {
        #[command(flatten)]
        setup: Setup,
        #[command(flatten)]
        args: RolloutArgs,
    },
    /// The soak (minutes): random start / SIGTERM / SIGKILL of proxy instances under load;
    /// failures judged, RSS and descriptors over time.
    Chaos {
        #[command(flatten)]
        setup: Setup,
        #[command(flatten)]
        args: ChaosArgs,
    },
    /// Every scenario with its defaults, then the rollout (not the chaos soak).
    All {
        #[command(flatten)]
        setup: Setup,
        #[command(flatten)]
        timing: Timing,
        /// Run `rr` and `churn` over TLS (as their `--tls`); the others stay plain TCP.
        #[arg(long)]
        tls: bool,
    },
    /// Internal: runs the built-in backends (started by the harness itself).
    #[command(hide = true)]
    ServeBackend(ServeBackendArgs),
    /// Internal: runs storm clients for the harness (`storm` spread over processes).
    #[command(hide = true)]
    StormClients(StormClientsArgs),
    /// Internal: runs the io_uring forwarder of the `uring` target (started by the harness).
    #[command(hide = true)]
    ServeUring(ServeUringArgs),
}

/// Where the targets come from and where results go.
#[derive(Debug, Clone, Args)]
pub struct Setup {
    /// Targets to measure, in the order they run each round (missing HAProxy is skipped).
    #[arg(long, value_delimiter = ',', default_value = "direct,haproxy,proxy")]
    pub targets: Vec<Target>,
    /// Output directory for JSON and SVG files [default: <target dir>/bench].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The kube-apiserver-proxy binary [default: next to this binary, built with cargo].
    #[arg(long)]
    pub proxy_bin: Option<PathBuf>,
    /// Extra argument for every proxy instance (repeatable), e.g. `--proxy-arg=--log-level=debug`.
    #[arg(long = "proxy-arg", allow_hyphen_values = true)]
    pub proxy_args: Vec<String>,
    /// Do not run `cargo build` for the proxy; use the binary next to this one as it is.
    #[arg(long)]
    pub no_build: bool,
    /// The HAProxy binary [default: `haproxy` on PATH].
    #[arg(long)]
    pub haproxy_bin: Option<PathBuf>,
    /// HAProxy `nbthread` [default: available CPUs, like HAProxy itself and the proxy's runtime].
    #[arg(long)]
    pub haproxy_nbthread: Option<usize>,
    /// Extra argument for every `uring` instance (repeatable), e.g. `--uring-arg=--buffers=128`.
    #[arg(long = "uring-arg", allow_hyphen_values = true)]
    pub uring_args: Vec<String>,
    /// The address every client connects from (bound with port 0): one of this host's that is
    /// neither loopback nor a target's, so that the `-transparent` targets take their
    /// transparent path (docs/benchmarks-history.md, "The client address").
    #[arg(long, value_name = "IP")]
    pub client_source: Option<std::net::IpAddr>,
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults_parse() {
        let timing: Timing = defaults();
        assert_eq!(timing.rounds, 3);
        let _: RolloutArgs = defaults();
        let chaos: ChaosArgs = defaults();
        assert_eq!(chaos.duration, Duration::from_secs(180));
    }
}
