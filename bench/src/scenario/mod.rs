//! The scenarios and the driver that runs one: every target once per round, alternately (the
//! starting target rotates each round), each run on a freshly started target process; then the
//! summary table, the JSON file and the chart. `rollout` and `chaos` drive their own runs.

pub mod chaos;
pub mod churn;
pub mod closed_loop;
pub mod idle;
pub mod rollout;
pub mod rr;
pub mod storm;
pub mod threads;
pub mod throughput;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use serde::Serialize;

use crate::backend::{BackendAddrs, BackendProcess};
use crate::chart;
use crate::client::Window;
use crate::options::Timing;
use crate::procstat;
use crate::report::{self, Machine, MetricSpec, Metrics, RunRecord, ScenarioReport, CPU_METRICS};
use crate::target::{Env, Running, Target};

/// One benchmark scenario: a workload and the figures it produces.
// Only driven on the current-thread runtime: the futures need not be `Send`.
#[allow(async_fn_in_trait)]
pub trait Scenario {
    /// Subcommand name.
    const NAME: &'static str;
    /// One line describing the workload with its parameters.
    fn description(&self) -> String;
    /// Stem of the output files and name in the progress lines: [`Self::NAME`], with `-tls`
    /// for a TLS variant (so that it does not overwrite the plain run's files).
    fn stem(&self) -> String {
        Self::NAME.to_owned()
    }
    /// The parameters, for the JSON file.
    fn parameters(&self) -> serde_json::Value;
    /// Which built-in backend the workload needs: the echo backend unless said otherwise.
    fn backend(&self, addrs: &BackendAddrs) -> SocketAddr {
        addrs.echo
    }
    /// The figures, first one the headline.
    fn metrics(&self) -> Vec<MetricSpec>;
    /// Processes each target runs as, sharing its listen address (see [`start_spread`]).
    fn processes(&self) -> usize {
        1
    }
    /// Runs the workload once against `target`.
    async fn measure(
        &self,
        target: &Running,
        backend: &BackendProcess,
        timing: &Timing,
    ) -> Result<Metrics>;
}

/// A run that failed, kept in the report instead of aborting the others.
#[derive(Debug, Clone, Serialize)]
struct RunError {
    target: Target,
    round: u32,
    error: String,
}

#[derive(Serialize)]
struct Output<'a> {
    #[serde(flatten)]
    report: &'a ScenarioReport,
    errors: &'a [RunError],
}

/// Runs `scenario` for every target and round; prints, writes JSON and SVG.
pub async fn drive<S: Scenario>(
    env: &mut Env,
    timing: &Timing,
    scenario: &S,
) -> Result<ScenarioReport> {
    let backend_addr = scenario.backend(&env.backend.addrs());
    let stem = scenario.stem();
    let specs: Vec<MetricSpec> = scenario.metrics().into_iter().chain(CPU_METRICS).collect();
    let headline = specs[0];
    let targets = env.targets.clone();
    let mut runs = Vec::new();
    let mut errors = Vec::new();
    for round in 0..timing.rounds {
        for i in 0..targets.len() {
            let target = targets[(i + round as usize) % targets.len()];
            let result = async {
                let running = start_spread(env, target, backend_addr, scenario.processes()).await?;
                let metrics = scenario.measure(&running, &env.backend, timing).await;
                running.stop().await?;
                metrics
            }
            .await;
            match result {
                Ok(metrics) => {
                    let shown = metrics
                        .get(headline.key)
                        .map_or("–".into(), |&v| headline.unit.format(v));
                    eprintln!(
                        "{} round {}/{} {:<8} {}: {shown}",
                        stem,
                        round + 1,
                        timing.rounds,
                        target.name(),
                        headline.label
                    );
                    runs.push(RunRecord {
                        target,
                        round,
                        metrics,
                    });
                }
                Err(err) => {
                    eprintln!(
                        "{} round {}/{} {:<8} failed: {err:#}",
                        stem,
                        round + 1,
                        timing.rounds,
                        target.name()
                    );
                    errors.push(RunError {
                        target,
                        round,
                        error: format!("{err:#}"),
                    });
                }
            }
        }
    }
    let report = ScenarioReport {
        scenario: S::NAME,
        description: scenario.description(),
        parameters: scenario.parameters(),
        rounds: timing.rounds,
        duration_s: timing.duration.as_secs_f64(),
        warmup_s: timing.warmup.as_secs_f64(),
        targets,
        skipped: env.skipped.clone(),
        machine: Machine::detect(
            env.proxy.as_ref().map(|p| p.bin()),
            env.haproxy_version.clone(),
            env.nbthread,
        ),
        summary: report::summarise(&specs, &runs),
        runs,
    };
    report::print_table(&report);
    for error in &errors {
        println!(
            "   run failed: {} round {}: {}",
            error.target.name(),
            error.round + 1,
            error.error.lines().next().unwrap_or_default()
        );
    }
    let json = env.out.join(format!("{stem}.json"));
    report::write_json(
        &json,
        &Output {
            report: &report,
            errors: &errors,
        },
    )?;
    let svg = env.out.join(format!("{stem}.svg"));
    chart::ratio_bars(&svg, &report)?;
    println!("   wrote {} and {}", json.display(), svg.display());
    Ok(report)
}

/// Starts `target` as `processes` processes sharing one listen address (SO_REUSEPORT), the
/// threads of one (proxy `--worker-threads`, HAProxy `nbthread`: the CPUs by default) divided
/// among them, at least one each, alike for both. One process is started as [`Env::start`]
/// does, with the default threads.
pub async fn start_spread(
    env: &mut Env,
    target: Target,
    backend: SocketAddr,
    processes: usize,
) -> Result<Running> {
    if processes <= 1 {
        return env.start(target, backend).await;
    }
    let threads = (env.nbthread / processes).max(1);
    let listen = kube_apiserver_proxy_tests::util::free_random_loopback_addr()?;
    let mut running = env.start_on(target, backend, listen, Some(threads)).await?;
    for _ in 1..processes {
        let peer = env.start_on(target, backend, listen, Some(threads)).await?;
        running.peers.extend(peer.instance);
    }
    Ok(running)
}

/// CPU time of the three processes at one instant.
#[derive(Debug, Clone, Copy)]
struct CpuSnapshot {
    loadgen: Duration,
    backend: Duration,
    target: Option<Duration>,
}

fn cpu_snapshot(target: &Running, backend: &BackendProcess) -> Result<CpuSnapshot> {
    Ok(CpuSnapshot {
        loadgen: procstat::self_cpu(),
        backend: backend.sample()?.cpu,
        target: target.sample()?.map(|s| s.cpu),
    })
}

/// Samples CPU at the start and end of `window` (sleeping until each) and returns the CPU
/// seconds each process used in between, as [`CPU_METRICS`].
pub async fn cpu_over(
    window: &Window,
    target: &Running,
    backend: &BackendProcess,
) -> Result<Metrics> {
    tokio::time::sleep_until(window.start).await;
    let before = cpu_snapshot(target, backend)?;
    tokio::time::sleep_until(window.end).await;
    let after = cpu_snapshot(target, backend)?;
    let mut metrics = Metrics::new();
    let secs = |a: Duration, b: Duration| a.saturating_sub(b).as_secs_f64();
    metrics.insert("loadgen_cpu_s".into(), secs(after.loadgen, before.loadgen));
    metrics.insert("backend_cpu_s".into(), secs(after.backend, before.backend));
    if let (Some(a), Some(b)) = (after.target, before.target) {
        metrics.insert("target_cpu_s".into(), secs(a, b));
    }
    Ok(metrics)
}
