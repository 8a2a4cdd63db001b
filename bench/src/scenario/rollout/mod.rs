//! `rollout`, the project's demo: continuous churn (a new connection per request, paced, from
//! several clients) plus a few long-lived streams, while the running instance is replaced K
//! times: start a new one on the same public address, wait until it is ready, signal the old
//! one, wait until it has exited. Every failed request and stream is counted by kind and placed
//! on a timeline with each replacement marked.
//!
//! Variants: `proxy` (shared `--handoff-dir`, SIGTERM: the listening socket is handed over),
//! `haproxy-sigterm` (two HAProxy instances sharing the port with SO_REUSEPORT, old one hard
//! stopped) and `haproxy-sigusr1` (the same with a soft stop, bounded by `hard-stop-after` =
//! the proxy's drain timeout).
//!
//! A stream closed cleanly (FIN) by a stopping instance is expected (the instance drains and
//! cuts long-lived connections at its deadline, clients reconnect) and counted as `drained`,
//! not as a failure, also when a ping was in flight (`drained_mid_ping`). A churn request cut
//! before its answer, and any reset, refusal or timeout, is a failure.

pub mod chart;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::Signal;
use serde::Serialize;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::backend::BackendProcess;
use crate::client::{churn_request, connect, paced, ping_stream, Steady, StreamEnd};
use crate::haproxy::HaproxyOptions;
use crate::instance::Instance;
use crate::options::{HaproxyStop, LoadArgs, RolloutArgs};
use crate::outcome::{FailureCounts, FailureKind};
use crate::procstat;
use crate::proxy::ProxyOptions;
use crate::report::{self, print_rows, Machine, Unit};
use crate::target::{Env, Skipped, Target};
use kube_apiserver_proxy_tests::util::free_random_loopback_addr as free_address;
use kube_apiserver_proxy_tests::util::TempDir;

impl RolloutArgs {
    fn parameters(&self) -> serde_json::Value {
        let mut parameters = json!({
            "handoffs": self.handoffs,
            "interval_s": self.interval.as_secs_f64(),
            "drain_timeout_s": self.drain_timeout.as_secs_f64(),
            "bucket_s": self.bucket.as_secs_f64(),
            "haproxy_stop": self.haproxy_stop,
            "own_backends": self.own_backends,
        });
        let own = parameters.as_object_mut().expect("a JSON object");
        own.extend(self.load.parameters());
        parameters
    }
}

/// One replacement.
#[derive(Debug, Clone, Serialize)]
pub struct Handoff {
    pub index: u32,
    /// Seconds since the load started: new instance spawned, ready, old signalled, old gone.
    pub spawn_s: f64,
    pub ready_s: f64,
    pub signal_s: f64,
    pub exit_s: f64,
    /// How the old instance ended (`exit status: 0`, or `killed after …`).
    pub old_exit: String,
}

/// One timeline bucket.
#[derive(Debug, Clone, Serialize)]
pub struct Bucket {
    pub start_s: f64,
    pub requests: u64,
    pub failed: u64,
    pub p50_us: Option<u64>,
    pub p99_us: Option<u64>,
    pub max_us: Option<u64>,
}

/// Stream figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StreamFigures {
    /// Pings answered.
    pub pings: u64,
    /// Streams closed cleanly (FIN) by a stopping instance, at its drain deadline or hard stop
    /// (reconnected; not failures: cutting long-lived connections is how a drain ends).
    pub drained: u64,
    /// Of `drained`, those cut while a ping was in flight (its answer lost with the stream).
    pub drained_mid_ping: u64,
    pub failed: FailureCounts,
}

/// Everything one variant measured.
#[derive(Debug, Clone, Serialize)]
pub struct VariantReport {
    pub variant: String,
    pub target: Target,
    pub error: Option<String>,
    pub handoffs: Vec<Handoff>,
    pub requests: u64,
    pub requests_failed: FailureCounts,
    pub streams: StreamFigures,
    /// Requests failed plus streams failed.
    pub failed: u64,
    pub duration_s: f64,
    pub latency_p50_us: Option<u64>,
    pub latency_p99_us: Option<u64>,
    pub latency_max_us: Option<u64>,
    pub buckets: Vec<Bucket>,
    /// Failures in time order: seconds since start and kind (`stream:` prefix for streams).
    pub failures: Vec<(f64, String)>,
}

#[derive(Serialize)]
struct RolloutReport<'a> {
    scenario: &'static str,
    parameters: serde_json::Value,
    machine: Machine,
    skipped: &'a [Skipped],
    variants: &'a [VariantReport],
}

#[derive(Debug, Clone, Copy)]
struct Variant {
    name: &'static str,
    target: Target,
    signal: Signal,
}

/// Runs every variant the environment supports; prints the summary, writes JSON and charts.
pub async fn run(env: &mut Env, args: &RolloutArgs) -> Result<Vec<VariantReport>> {
    let mut variants = Vec::new();
    if env.proxy.is_some() {
        variants.push(Variant {
            name: "proxy",
            target: Target::Proxy,
            signal: Signal::SIGTERM,
        });
    }
    if env.haproxy.is_some() {
        for stop in &args.haproxy_stop {
            variants.push(match stop {
                HaproxyStop::Sigterm => Variant {
                    name: "haproxy-sigterm",
                    target: Target::Haproxy,
                    signal: Signal::SIGTERM,
                },
                HaproxyStop::Sigusr1 => Variant {
                    name: "haproxy-sigusr1",
                    target: Target::Haproxy,
                    signal: Signal::SIGUSR1,
                },
            });
        }
    }
    let mut reports = Vec::new();
    for variant in variants {
        eprintln!(
            "rollout {}: {} replacements under load …",
            variant.name, args.handoffs
        );
        let report = match run_variant(env, args, variant).await {
            Ok(report) => report,
            Err(err) => {
                eprintln!("rollout {} failed: {err:#}", variant.name);
                VariantReport::failed(variant, format!("{err:#}"))
            }
        };
        reports.push(report);
    }
    print_summary(env, args, &reports);
    let json = env.out.join("rollout.json");
    report::write_json(
        &json,
        &RolloutReport {
            scenario: "rollout",
            parameters: args.parameters(),
            machine: Machine::detect(
                env.proxy.as_ref().map(|p| p.bin()),
                env.haproxy_version.clone(),
                env.nbthread,
            ),
            skipped: &env.skipped,
            variants: &reports,
        },
    )?;
    let mut written = vec![json.display().to_string()];
    for report in reports.iter().filter(|r| r.error.is_none()) {
        let svg = env.out.join(format!("rollout-{}.svg", report.variant));
        chart::timeline(&svg, report)?;
        written.push(svg.display().to_string());
    }
    println!("   wrote {}", written.join(", "));
    Ok(reports)
}

/// Starts instances of one variant, all on `listen`.
struct Launch<'a> {
    env: &'a mut Env,
    variant: Variant,
    listen: SocketAddr,
    backend: SocketAddr,
    handoff_dir: TempDir,
    drain_timeout: Duration,
}

impl Launch<'_> {
    /// An instance in front of a backend of its own (`--own-backends`): both are returned.
    async fn start_with_own_backend(&mut self) -> Result<(Instance, BackendProcess)> {
        let own = BackendProcess::start()?;
        self.backend = own.addrs().echo;
        Ok((self.start().await?, own))
    }

    async fn start(&mut self) -> Result<Instance> {
        let max_connections =
            (procstat::nofile_limit().saturating_sub(200) / 2).clamp(1000, 100_000);
        let mut instance = match self.variant.target {
            Target::Proxy | Target::ProxyTransparent => self
                .env
                .proxy
                .as_mut()
                .context("no proxy")?
                .spawn(&ProxyOptions {
                    listen: self.listen,
                    backend: self.backend,
                    handoff_dir: Some(self.handoff_dir.path().to_owned()),
                    drain_timeout: self.drain_timeout,
                    drain_close_window: self.drain_timeout / 4,
                    max_connections,
                    log_level: "info",
                    worker_threads: None,
                    transparent: self.variant.target == Target::ProxyTransparent,
                })?,
            Target::Haproxy | Target::HaproxyTransparent => {
                let nbthread = self.env.nbthread;
                self.env
                    .haproxy
                    .as_mut()
                    .context("no haproxy")?
                    .spawn(&HaproxyOptions {
                        listen: self.listen,
                        backend: self.backend,
                        nbthread,
                        maxconn: max_connections,
                        hard_stop_after: Some(self.drain_timeout),
                        usesrc_clientip: self.variant.target == Target::HaproxyTransparent,
                    })?
            }
            Target::Direct | Target::Uring => {
                anyhow::bail!("{} cannot be rolled out", self.variant.target.name())
            }
        };
        instance.wait_ready(Duration::from_secs(20)).await?;
        Ok(instance)
    }
}

impl Launch<'_> {
    /// The next instance, with its own backend when `own_backends` is set.
    async fn next(&mut self, own_backends: bool) -> Result<(Instance, Option<BackendProcess>)> {
        if own_backends {
            let (instance, own) = self.start_with_own_backend().await?;
            Ok((instance, Some(own)))
        } else {
            Ok((self.start().await?, None))
        }
    }
}

async fn run_variant(env: &mut Env, args: &RolloutArgs, variant: Variant) -> Result<VariantReport> {
    let backend = env.backend.addrs().echo;
    let mut launch = Launch {
        env,
        variant,
        listen: free_address()?,
        backend,
        handoff_dir: TempDir::new("bench-handoff")?,
        drain_timeout: args.drain_timeout,
    };
    let (mut current, mut current_backend) = launch.next(args.own_backends).await?;
    let t0 = Instant::now();
    let load = RolloutLoad::start(launch.listen, t0, &args.load);
    tokio::time::sleep(args.interval).await;
    let mut handoffs = Vec::new();
    let mut error = None;
    let exit_limit = args.drain_timeout * 2 + Duration::from_secs(5);
    for index in 1..=args.handoffs {
        let spawn_s = t0.elapsed().as_secs_f64();
        let (next, next_backend) = match launch.next(args.own_backends).await {
            Ok(next) => next,
            Err(err) => {
                error = Some(format!("replacement {index}: {err:#}"));
                break;
            }
        };
        let ready_s = t0.elapsed().as_secs_f64();
        // The old pod's apiserver stops with it (its listener closes at once).
        drop(std::mem::replace(&mut current_backend, next_backend));
        current.signal(variant.signal)?;
        let signal_s = t0.elapsed().as_secs_f64();
        let old_exit = match current.wait_exit(exit_limit).await? {
            Some(status) => status.to_string(),
            None => format!("killed after {exit_limit:?}"),
        };
        handoffs.push(Handoff {
            index,
            spawn_s,
            ready_s,
            signal_s,
            exit_s: t0.elapsed().as_secs_f64(),
            old_exit,
        });
        current = next;
        tokio::time::sleep(args.interval).await;
    }
    let duration_s = t0.elapsed().as_secs_f64();
    let (samples, stream_figures, stream_failures) = load.stop().await?;
    current.signal(Signal::SIGTERM)?;
    current.wait_exit(exit_limit).await?;
    let mut report = VariantReport::from_samples(
        variant,
        &samples,
        &stream_failures,
        stream_figures,
        args.bucket,
        duration_s,
    );
    report.handoffs = handoffs;
    report.error = error;
    Ok(report)
}

/// Stream failures: when (since t0) and of which kind.
type StreamFailures = Vec<(Duration, FailureKind)>;

/// The load of one variant: paced churn clients and pinged streams against the public address.
struct RolloutLoad(Steady<Vec<Sample>, (StreamFigures, StreamFailures)>);

impl RolloutLoad {
    /// Starts the clients against `addr`; times are taken relative to `t0`.
    fn start(addr: SocketAddr, t0: Instant, load: &LoadArgs) -> Self {
        let timeout = load.timeout;
        Self(Steady::start(
            load,
            t0,
            |first, period, stop| churn_client(addr, first, period, timeout, stop),
            |stop| stream_client(addr, t0, load.stream_interval, timeout, stop),
        ))
    }

    /// Stops the clients; returns the churn samples, the stream figures and the stream
    /// failures.
    async fn stop(self) -> Result<(Vec<Sample>, StreamFigures, StreamFailures)> {
        let (churn, streams) = self.0.stop().await;
        let mut samples = Vec::new();
        for task in churn {
            samples.extend(task?);
        }
        let mut figures = StreamFigures::default();
        let mut failures = Vec::new();
        for task in streams {
            let (one, its_failures) = task?;
            figures.pings += one.pings;
            figures.drained += one.drained;
            figures.drained_mid_ping += one.drained_mid_ping;
            figures.failed.merge(&one.failed);
            failures.extend(its_failures);
        }
        Ok((samples, figures, failures))
    }
}

/// One churn request's result: start (since t0), latency, failure.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Duration,
    latency: Duration,
    failure: Option<FailureKind>,
}

async fn churn_client(
    addr: SocketAddr,
    start: Instant,
    period: Duration,
    timeout: Duration,
    stop: watch::Receiver<bool>,
) -> Vec<Sample> {
    let t0 = start;
    paced(start, period, stop, || async move {
        let began = Instant::now();
        let result = churn_request(addr, 16, timeout, None).await;
        Sample {
            at: began.saturating_duration_since(t0),
            latency: began.elapsed(),
            failure: result.err(),
        }
    })
    .await
}

async fn stream_client(
    addr: SocketAddr,
    t0: Instant,
    interval: Duration,
    timeout: Duration,
    mut stop: watch::Receiver<bool>,
) -> (StreamFigures, StreamFailures) {
    let mut figures = StreamFigures::default();
    let mut failures = Vec::new();
    let mut fail = |kind: FailureKind, figures: &mut StreamFigures| {
        figures.failed.add(kind);
        failures.push((t0.elapsed(), kind));
    };
    while !*stop.borrow() {
        let mut stream = match connect(addr, timeout).await {
            Ok(stream) => stream,
            Err(kind) => {
                fail(kind, &mut figures);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let mut pings = 0;
        let end = ping_stream(&mut stream, interval, timeout, &mut stop, &mut pings).await;
        figures.pings += pings;
        match end {
            StreamEnd::Stopped => break,
            StreamEnd::Eof => figures.drained += 1,
            StreamEnd::Ping(FailureKind::Closed) => {
                figures.drained += 1;
                figures.drained_mid_ping += 1;
            }
            StreamEnd::Idle(kind) | StreamEnd::Ping(kind) => fail(kind, &mut figures),
        }
    }
    (figures, failures)
}

impl VariantReport {
    fn failed(variant: Variant, error: String) -> Self {
        Self {
            variant: variant.name.into(),
            target: variant.target,
            error: Some(error),
            handoffs: Vec::new(),
            requests: 0,
            requests_failed: FailureCounts::default(),
            streams: StreamFigures::default(),
            failed: 0,
            duration_s: 0.0,
            latency_p50_us: None,
            latency_p99_us: None,
            latency_max_us: None,
            buckets: Vec::new(),
            failures: Vec::new(),
        }
    }

    fn from_samples(
        variant: Variant,
        samples: &[Sample],
        stream_failures: &[(Duration, FailureKind)],
        streams: StreamFigures,
        bucket: Duration,
        duration_s: f64,
    ) -> Self {
        let bucket_s = bucket.as_secs_f64().max(0.001);
        let n_buckets = (duration_s / bucket_s).ceil() as usize + 1;
        let mut latencies: Vec<Vec<u64>> = vec![Vec::new(); n_buckets];
        let mut failed_per_bucket = vec![0u64; n_buckets];
        let mut requests_per_bucket = vec![0u64; n_buckets];
        let mut requests_failed = FailureCounts::default();
        let mut failures = Vec::new();
        let mut all = Vec::new();
        let slot = |at: Duration| ((at.as_secs_f64() / bucket_s) as usize).min(n_buckets - 1);
        for sample in samples {
            let b = slot(sample.at);
            requests_per_bucket[b] += 1;
            match sample.failure {
                None => {
                    let us = sample.latency.as_micros() as u64;
                    latencies[b].push(us);
                    all.push(us);
                }
                Some(kind) => {
                    requests_failed.add(kind);
                    failed_per_bucket[b] += 1;
                    failures.push((sample.at.as_secs_f64(), kind.name().to_owned()));
                }
            }
        }
        for &(at, kind) in stream_failures {
            failed_per_bucket[slot(at)] += 1;
            failures.push((at.as_secs_f64(), format!("stream:{}", kind.name())));
        }
        failures.sort_by(|a, b| a.0.total_cmp(&b.0));
        let buckets = (0..n_buckets)
            .map(|b| {
                let mut values = std::mem::take(&mut latencies[b]);
                values.sort_unstable();
                Bucket {
                    start_s: b as f64 * bucket_s,
                    requests: requests_per_bucket[b],
                    failed: failed_per_bucket[b],
                    p50_us: quantile(&values, 0.5),
                    p99_us: quantile(&values, 0.99),
                    max_us: values.last().copied(),
                }
            })
            .collect();
        all.sort_unstable();
        Self {
            variant: variant.name.into(),
            target: variant.target,
            error: None,
            handoffs: Vec::new(),
            requests: samples.len() as u64,
            failed: requests_failed.total() + streams.failed.total(),
            requests_failed,
            streams,
            duration_s,
            latency_p50_us: quantile(&all, 0.5),
            latency_p99_us: quantile(&all, 0.99),
            latency_max_us: all.last().copied(),
            buckets,
            failures,
        }
    }
}

/// The `q` quantile of sorted `values` (nearest rank).
fn quantile(values: &[u64], q: f64) -> Option<u64> {
    if values.is_empty() {
        return None;
    }
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    Some(values[rank - 1])
}

fn print_summary(env: &Env, args: &RolloutArgs, reports: &[VariantReport]) {
    println!();
    println!(
        "== rollout: {} replacements under load ({} churn clients at {} req/s total, {} streams) ==",
        args.handoffs, args.load.clients, args.load.rate, args.load.streams
    );
    for skipped in &env.skipped {
        println!("   ({} skipped: {})", skipped.target.name(), skipped.reason);
    }
    let mut rows = vec![vec![
        "variant".to_owned(),
        "replaced".to_owned(),
        "requests".to_owned(),
        "failed requests".to_owned(),
        "streams failed".to_owned(),
        "drained".to_owned(),
        "p99".to_owned(),
        "max".to_owned(),
    ]];
    let micros = |v: Option<u64>| v.map_or("–".to_owned(), |v| Unit::Micros.format(v as f64));
    for r in reports {
        rows.push(vec![
            r.variant.clone(),
            format!("{}/{}", r.handoffs.len(), args.handoffs),
            r.requests.to_string(),
            r.requests_failed.to_string(),
            r.streams.failed.to_string(),
            if r.streams.drained_mid_ping > 0 {
                format!(
                    "{} ({} mid-ping)",
                    r.streams.drained, r.streams.drained_mid_ping
                )
            } else {
                r.streams.drained.to_string()
            },
            micros(r.latency_p99_us),
            micros(r.latency_max_us),
        ]);
    }
    print_rows(&rows);
    for r in reports {
        if let Some(error) = &r.error {
            println!(
                "   {} stopped early: {}",
                r.variant,
                error.lines().next().unwrap_or_default()
            );
        }
    }
    println!();
    for r in reports {
        let what = if r.target == Target::Proxy {
            "handoffs"
        } else {
            "restarts"
        };
        println!(
            "{}: {} {what}, {} requests + {} stream pings, {} failed",
            r.variant,
            r.handoffs.len(),
            r.requests,
            r.streams.pings,
            r.failed
        );
    }
    if env.haproxy.is_none() {
        println!("haproxy: not installed, not compared");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles() {
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(quantile(&[1, 2, 3, 4], 0.5), Some(2));
        assert_eq!(quantile(&[1, 2, 3, 4], 0.99), Some(4));
    }

    #[test]
    fn buckets_failures() {
        let variant = Variant {
            name: "x",
            target: Target::Proxy,
            signal: Signal::SIGTERM,
        };
        let samples = [
            Sample {
                at: Duration::from_millis(50),
                latency: Duration::from_micros(100),
                failure: None,
            },
            Sample {
                at: Duration::from_millis(150),
                latency: Duration::from_micros(100),
                failure: Some(FailureKind::Reset),
            },
        ];
        let report = VariantReport::from_samples(
            variant,
            &samples,
            &[(Duration::from_millis(160), FailureKind::Timeout)],
            StreamFigures::default(),
            Duration::from_millis(100),
            0.2,
        );
        assert_eq!(report.requests, 2);
        assert_eq!(report.failed, 1);
        assert_eq!(report.buckets[0].p50_us, Some(100));
        assert_eq!(report.buckets[1].failed, 2);
        assert_eq!(report.failures.len(), 2);
    }
}
