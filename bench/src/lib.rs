//! Benchmark harness for kube-apiserver-proxy: the same workload sent straight to a backend
//! (`direct`), through the proxy (`proxy`, the real binary as separate processes) and through
//! HAProxy in TCP mode (`haproxy`, when installed), and when asked for through an io_uring
//! forwarder (`uring`, an upper bound, not a proxy), alternately for several rounds, reported as
//! medians, min–max and ratios; plus the `rollout` scenario, the project's demo, which replaces
//! running instances under load and counts every failed connection, and the `chaos` soak,
//! which starts, SIGTERMs and SIGKILLs instances at random for minutes under load and judges
//! every failed connection and the instances' memory and descriptors.
//!
//! The load generator runs on a single-threaded tokio runtime in this process; the built-in
//! backends run in a child process (`bench serve-backend`) on their own single-threaded runtime,
//! so that on a small machine the CPU goes to the thing being measured. (`storm` beyond one
//! process's descriptor limit spreads the load generator, the backend and the target over
//! several processes each.) Each figure comes with
//! the CPU seconds used by the load generator, the backend and the target process.
//!
//! Layout:
//! - [`cli`]: command line (clap derive), one subcommand per scenario.
//! - [`options`]: the scenarios' option groups, which the command line flattens.
//! - [`backend`]: built-in echo / sink / stream / TLS echo servers and the child process that
//!   runs them; the TLS client that trusts them.
//! - [`instance`]: one child process (proxy or HAProxy): readiness, signals, exit, CPU and RSS.
//! - [`proxy`]: locating (or building) the `kube-apiserver-proxy` binary and starting instances.
//! - [`haproxy`]: locating HAProxy, writing its TCP-mode config and starting instances.
//! - [`target`]: the targets (`direct`, `proxy`, `haproxy`, `uring`), the options that choose
//!   them, and starting one for a scenario.
//! - [`uring`]: the `uring` target, an io_uring forwarder (`bench serve-uring`); its
//!   [`uring::forward`] is the crate's one module with `unsafe`, and says why.
//! - [`client`]: the load generator's connection primitives (request, stream, bulk).
//! - [`outcome`]: failure kinds (refused, reset, timeout, closed, other) and their counts.
//! - [`procstat`]: CPU time and resident memory from `/proc` and `getrusage`.
//! - [`stats`]: medians, ranges, percentiles.
//! - [`report`]: result types, the stdout table and the JSON file.
//! - [`chart`]: SVG charts: ratio bars, and the panel frame and legend of the timelines.
//! - From the end-to-end tests' kit (`kube_apiserver_proxy_tests`): temporary directories,
//!   random loopback addresses and free ports, HTTP GET for readiness and metrics, and the
//!   build of the proxy binary.
//! - [`scenario`]: the scenarios themselves; [`run`] dispatches a subcommand to one.
//!
//! The modules import each other without a cycle (`tests/module_graph.rs`): [`options`] names
//! nothing else of the crate, and the command line only assembles option groups.

#![deny(unsafe_code)]

pub mod backend;
pub mod chart;
pub mod cli;
pub mod client;
pub mod haproxy;
pub mod instance;
pub mod options;
pub mod outcome;
pub mod procstat;
pub mod proxy;
pub mod report;
pub mod scenario;
pub mod stats;
pub mod target;
pub mod uring;

use anyhow::Result;

use crate::cli::{Cli, Command};
use crate::options::{defaults, ChurnArgs, IdleArgs, RrArgs, ThroughputArgs, Timing};
use crate::scenario::{chaos, drive, rollout, storm, threads, Scenario};
use crate::target::{Env, Setup, Target};

/// Runs one invocation of the harness.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::ServeBackend(args) => backend::serve(args),
        Command::StormClients(args) => {
            procstat::raise_nofile_limit();
            scenario::storm::remote::serve(args)
        }
        Command::ServeUring(args) => uring::serve(args),
        command => {
            procstat::raise_nofile_limit();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(run_scenario(command))
        }
    }
}

/// Runs a scenario's subcommand (on the current-thread runtime).
async fn run_scenario(command: Command) -> Result<()> {
    match command {
        Command::Throughput {
            setup,
            timing,
            args,
        } => one(&setup, &timing, &args).await,
        Command::Rr {
            setup,
            timing,
            args,
        } => one(&setup, &timing, &args).await,
        Command::Churn {
            setup,
            timing,
            args,
        } => one(&setup, &timing, &args).await,
        Command::Idle {
            setup,
            timing,
            args,
        } => one(&setup, &timing, &args).await,
        Command::Threads {
            setup,
            timing,
            args,
        } => threads::run(&mut Env::new(&setup)?, &timing, &args).await,
        Command::Storm {
            setup,
            timing,
            args,
        } => {
            let mut env = Env::new(&setup)?;
            let storm = storm::Storm::new(args).await?;
            drive(&mut env, &timing, &storm).await.map(drop)
        }
        Command::Rollout { setup, args } => {
            rollout::run(&mut Env::new(&setup)?, &args).await.map(drop)
        }
        Command::Chaos { setup, args } => {
            // The soak drives proxy instances only.
            let setup = Setup {
                targets: vec![Target::Proxy],
                ..setup
            };
            chaos::run(&mut Env::new(&setup)?, &args).await.map(drop)
        }
        Command::All { setup, timing, tls } => {
            let mut env = Env::new(&setup)?;
            drive(&mut env, &timing, &defaults::<ThroughputArgs>()).await?;
            drive(&mut env, &timing, &RrArgs { tls, ..defaults() }).await?;
            drive(&mut env, &timing, &ChurnArgs { tls, ..defaults() }).await?;
            drive(&mut env, &timing, &defaults::<IdleArgs>()).await?;
            rollout::run(&mut env, &defaults()).await.map(drop)
        }
        Command::ServeBackend(_) | Command::StormClients(_) | Command::ServeUring(_) => {
            unreachable!("handled before the runtime starts")
        }
    }
}

/// One scenario driven over every target and round.
async fn one<S: Scenario>(setup: &Setup, timing: &Timing, scenario: &S) -> Result<()> {
    drive(&mut Env::new(setup)?, timing, scenario)
        .await
        .map(drop)
}
