//! Command line: one subcommand per scenario, each with small defaults that finish in seconds.
//! The option groups it flattens are declared where their users read them: [`Setup`] with the
//! targets, [`Timing`] and each scenario's options in [`crate::options`].

use clap::{Parser, Subcommand};

use crate::backend::ServeBackendArgs;
use crate::options::{
    ChaosArgs, ChurnArgs, IdleArgs, RolloutArgs, RrArgs, StormArgs, ThreadsArgs, ThroughputArgs,
    Timing,
};
use crate::scenario::storm::remote::StormClientsArgs;
use crate::target::Setup;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
