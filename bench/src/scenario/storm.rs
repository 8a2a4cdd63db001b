//! `storm`: a reconnection storm. N long-lived connections (a large cluster's kubelets and
//! watches) go through the target to an echo backend; the backend is restarted (SIGKILL, then
//! started again on the same address after `--downtime`), and every client reconnects at once:
//! each tries again at once when its connection ends, then backs off (from `--retry`, doubling
//! up to 1 s, with jitter) until one exchange is answered on a new connection, which it keeps.
//!
//! Reports the time from the backend's death until every client has a working connection again,
//! the per-client reconnect time (p50, p99), the failed attempts on the way, the clients still
//! not back at `--deadline`, and the target's resident memory with all connected before the
//! restart and its peak during the storm (sampled every 10 ms).
//!
//! The restartable backend is a process of its own (`bench serve-backend --echo-at ADDR`, one
//! thread like the shared backends), started before the first target and restarted in every
//! run. Descriptors bound N: each connection is one descriptor in the load generator and in the
//! backend, and two in the target (see docs/benchmarks.md for the largest N on a machine).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use clap::Args;
use rand::Rng;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Scenario;
use crate::backend::{BackendAddrs, BackendProcess};
use crate::cli::Timing;
use crate::client::{connect, exchange};
use crate::procstat;
use crate::report::{MetricSpec, Metrics, Unit};
use crate::target::Running;

/// Options of `storm`.
#[derive(Debug, Clone, Args)]
pub struct StormArgs {
    /// Long-lived connections. Each is one descriptor in the load generator and the backend and
    /// two in the target, so the descriptor limit bounds it (20,000 for a large cluster needs a
    /// limit above 40,000).
    #[arg(long, default_value_t = 1000)]
    pub connections: usize,
    /// Connections being opened at once before the restart.
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

/// The scenario: its options and its own restartable backend.
pub struct Storm {
    args: StormArgs,
    addr: SocketAddr,
    backend: RefCell<Option<Child>>,
}

/// A client's pause after failures is at most this long.
const RETRY_MAX: Duration = Duration::from_secs(1);
/// One exchange of a client (bytes).
const PING: [u8; 16] = [0x53; 16];

impl Storm {
    /// Starts the scenario's backend on a free loopback address.
    pub async fn new(args: StormArgs) -> Result<Self> {
        let addr = crate::net::free_address()?;
        let backend = start_backend(addr).await?;
        Ok(Self {
            args,
            addr,
            backend: RefCell::new(Some(backend)),
        })
    }

    /// SIGKILLs the backend, waits `downtime`, starts it again on the same address.
    async fn restart_backend(&self) -> Result<()> {
        let old = self.backend.borrow_mut().take();
        if let Some(mut old) = old {
            old.start_kill().context("kill the storm backend")?;
            old.wait().await?;
        }
        tokio::time::sleep(self.args.downtime).await;
        let new = start_backend(self.addr).await?;
        *self.backend.borrow_mut() = Some(new);
        Ok(())
    }
}

/// `bench serve-backend --echo-at ADDR`, once it listens.
async fn start_backend(addr: SocketAddr) -> Result<Child> {
    let exe = std::env::current_exe().context("cannot find the bench binary")?;
    let mut child = Command::new(exe)
        .arg("serve-backend")
        .arg(format!("--echo-at={addr}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("cannot start the storm backend")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).await?;
    ensure!(
        line.trim() == "listening",
        "storm backend said {line:?} instead of listening"
    );
    Ok(child)
}

/// What one client saw of the storm.
struct Comeback {
    /// From the restart until its new connection answered (`None`: lost).
    after: Option<Duration>,
    failed: u64,
    /// Failed attempts by kind.
    kinds: std::collections::BTreeMap<&'static str, u64>,
    /// The new connection, held until every client is back.
    held: Option<tokio::net::TcpStream>,
}

fn spec(key: &'static str, label: &'static str, unit: Unit) -> MetricSpec {
    MetricSpec {
        key,
        label,
        unit,
        higher_is_better: false,
        chart: false,
    }
}

impl Scenario for Storm {
    const NAME: &'static str = "storm";

    fn description(&self) -> String {
        format!(
            "{} long-lived connections reconnecting at once after a backend restart ({} down)",
            self.args.connections,
            humantime::format_duration(self.args.downtime)
        )
    }

    fn parameters(&self) -> serde_json::Value {
        json!({
            "connections": self.args.connections,
            "ramp": self.args.ramp,
            "downtime_s": self.args.downtime.as_secs_f64(),
            "retry_s": self.args.retry.as_secs_f64(),
            "deadline_s": self.args.deadline.as_secs_f64(),
            "nofile_limit": procstat::nofile_limit(),
        })
    }

    fn backend(&self, _addrs: &BackendAddrs) -> SocketAddr {
        self.addr
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec {
                chart: true,
                ..spec("all_back_us", "time until all reconnected", Unit::Micros)
            },
            spec("back_p50_us", "reconnect p50", Unit::Micros),
            spec("back_p99_us", "reconnect p99", Unit::Micros),
            spec("failed", "failed attempts", Unit::Count),
            spec("lost", "clients not back", Unit::Count),
            spec("rss_before_bytes", "target RSS, all connected", Unit::Bytes),
            spec(
                "rss_peak_bytes",
                "target RSS peak in the storm",
                Unit::Bytes,
            ),
        ]
    }

    async fn measure(
        &self,
        target: &Running,
        _backend: &BackendProcess,
        timing: &Timing,
    ) -> Result<Metrics> {
        let n = self.args.connections.max(1);
        let limit = procstat::nofile_limit() as usize;
        ensure!(
            2 * n + 200 < limit,
            "{n} connections need {} descriptors in the target, over the limit ({limit})",
            2 * n + 200
        );
        // Up: N connections, each after one answered exchange.
        let restart_at: Arc<OnceLock<Instant>> = Arc::default();
        let mut clients = JoinSet::new();
        let (up_tx, mut up_rx) = tokio::sync::mpsc::channel::<Result<(), String>>(n);
        let ramp = Arc::new(tokio::sync::Semaphore::new(self.args.ramp.max(1)));
        for _ in 0..n {
            let (up, ramp, restart_at) = (up_tx.clone(), ramp.clone(), restart_at.clone());
            let (addr, retry, deadline) = (target.addr, self.args.retry, self.args.deadline);
            clients.spawn(async move {
                let permit = ramp.acquire().await.expect("semaphore open");
                let mut stream = match open(addr).await {
                    Ok(s) => s,
                    Err(kind) => {
                        let _ = up.send(Err(kind.name().to_owned())).await;
                        return None;
                    }
                };
                drop(permit);
                let _ = up.send(Ok(())).await;
                // Long-lived and idle until the backend's restart ends it.
                let _ = stream.read(&mut [0u8; 1]).await;
                drop(stream);
                Some(come_back(addr, retry, deadline, &restart_at).await)
            });
        }
        drop(up_tx);
        for i in 0..n {
            match up_rx.recv().await {
                Some(Ok(())) => {}
                Some(Err(kind)) => anyhow::bail!("connection {} of {n} failed: {kind}", i + 1),
                None => anyhow::bail!("clients ended early"),
            }
        }
        tokio::time::sleep(timing.warmup).await;
        let before = target.sample()?;
        let loadgen_cpu = procstat::self_cpu();

        // The storm, with the target's memory sampled meanwhile.
        let peak = Arc::new(AtomicU64::new(before.map_or(0, |s| s.rss_bytes)));
        let sampling = target.instance.as_ref().map(|i| i.pid());
        let sampler = sampling.map(|pid| {
            let peak = peak.clone();
            tokio::spawn(async move {
                loop {
                    if let Ok(s) = procstat::sample(pid) {
                        peak.fetch_max(s.rss_bytes, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        });
        let _ = restart_at.set(Instant::now());
        self.restart_backend().await?;
        let mut back = Vec::with_capacity(n);
        let mut held = Vec::with_capacity(n);
        let (mut failed, mut lost) = (0u64, 0u64);
        let mut kinds = Metrics::new();
        while let Some(joined) = clients.join_next().await {
            let Some(comeback) = joined? else {
                continue;
            };
            failed += comeback.failed;
            for (kind, count) in comeback.kinds {
                *kinds.entry(format!("failed_{kind}")).or_insert(0.0) += count as f64;
            }
            match comeback.after {
                Some(after) => back.push(after),
                None => lost += 1,
            }
            held.push(comeback.held);
        }
        if let Some(sampler) = sampler {
            sampler.abort();
        }
        let after = target.sample()?;

        let mut metrics = Metrics::new();
        back.sort();
        let quantile = |q: f64| {
            let i = ((back.len() as f64 * q).ceil() as usize).clamp(1, back.len()) - 1;
            back[i].as_micros() as f64
        };
        if !back.is_empty() {
            metrics.insert("all_back_us".into(), quantile(1.0));
            metrics.insert("back_p50_us".into(), quantile(0.5));
            metrics.insert("back_p99_us".into(), quantile(0.99));
        }
        metrics.insert("failed".into(), failed as f64);
        // By kind (refused, reset, closed, timeout, other): in the JSON file only.
        metrics.extend(kinds);
        metrics.insert("lost".into(), lost as f64);
        metrics.insert(
            "loadgen_cpu_s".into(),
            procstat::self_cpu()
                .saturating_sub(loadgen_cpu)
                .as_secs_f64(),
        );
        if let (Some(before), Some(after)) = (before, after) {
            metrics.insert("rss_before_bytes".into(), before.rss_bytes as f64);
            metrics.insert(
                "rss_peak_bytes".into(),
                peak.load(Ordering::Relaxed).max(after.rss_bytes) as f64,
            );
            metrics.insert(
                "target_cpu_s".into(),
                after.cpu.saturating_sub(before.cpu).as_secs_f64(),
            );
        }
        drop(held);
        Ok(metrics)
    }
}

/// Connects and makes one exchange.
async fn open(addr: SocketAddr) -> Result<tokio::net::TcpStream, crate::outcome::FailureKind> {
    let timeout = Duration::from_secs(5);
    let mut stream = connect(addr, timeout).await?;
    let mut answer = [0u8; PING.len()];
    exchange(&mut stream, &PING, &mut answer, timeout).await?;
    Ok(stream)
}

/// Reconnects until an exchange is answered (then holds that connection until every client is
/// back: it is returned only to be dropped with the others) or the deadline passes.
async fn come_back(
    addr: SocketAddr,
    retry: Duration,
    deadline: Duration,
    restart_at: &OnceLock<Instant>,
) -> Comeback {
    let started = restart_at.get().copied().unwrap_or_else(Instant::now);
    let give_up = started + deadline;
    let mut pause = retry;
    let mut failed = 0;
    let mut kinds = std::collections::BTreeMap::new();
    loop {
        match open(addr).await {
            Ok(stream) => {
                return Comeback {
                    after: Some(Instant::now().saturating_duration_since(started)),
                    failed,
                    kinds,
                    held: Some(stream),
                }
            }
            Err(kind) => *kinds.entry(kind.name()).or_insert(0) += 1,
        }
        failed += 1;
        if Instant::now() >= give_up {
            return Comeback {
                after: None,
                failed,
                kinds,
                held: None,
            };
        }
        let jittered = pause.mul_f64(rand::thread_rng().gen_range(0.5..1.5));
        tokio::time::sleep(jittered).await;
        pause = (pause * 2).min(RETRY_MAX);
    }
}
