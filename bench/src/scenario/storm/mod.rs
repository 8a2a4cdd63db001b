//! `storm`: a reconnection storm. N long-lived connections (a large cluster's kubelets and
//! watches) go through the target to an echo backend; the backend is restarted (SIGKILL, then
//! started again on the same address after `--downtime`), and every client reconnects at once:
//! each tries again at once when its connection ends, then backs off (from `--retry`, doubling
//! up to 1 s, with jitter) until one exchange is answered on a new connection, which it keeps.
//!
//! Reports the time from the backend's death until every client has a working connection again,
//! the per-client reconnect time (p50, p99), the failed attempts on the way, the clients still
//! not back at `--deadline`, and the target's resident memory with all connected before the
//! restart and its peak during the storm (sampled every 10 ms). Before the restart every
//! connection is held idle for the round's duration, and the target's CPU meanwhile reported.
//!
//! The restartable backend is a process of its own (`bench serve-backend --echo-at ADDR`, one
//! thread like the shared backends), started before the first target and restarted in every
//! run.
//!
//! Descriptors bound N per process: each connection is one descriptor in the load generator and
//! in the backend, and two in the target. Beyond what one process's limit holds, every role is
//! spread over K processes (`--processes`, by default the smallest K that fits, see
//! [`limits::processes_for`]): K target processes sharing the listen address with SO_REUSEPORT
//! (the threads of one divided among them, `scenario::start_spread`), K echo backends sharing
//! theirs the same way (SIGKILLed together, started again together), and K client processes
//! ([`remote`]) whose clients' comebacks the harness merges. With K = 1 everything runs as
//! before: the clients in the harness itself ([`clients`]), one backend, one target process.
//!
//! Layout:
//! - [`clients`]: the clients and the fleet that runs them on one runtime.
//! - [`limits`]: descriptors and ports: how many processes N needs.
//! - [`remote`]: client processes (`bench storm-clients`) and their line protocol.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use super::Scenario;
use crate::backend::{BackendAddrs, BackendProcess};
use crate::options::{StormArgs, Timing};
use crate::procstat;
use crate::report::{MetricSpec, Metrics, Unit};
use crate::target::Running;
use clients::{ClientOptions, Comeback, Fleet};
use limits::{choose_processes, ephemeral_ports, SPARE_DESCRIPTORS};
use remote::Remote;

pub mod clients;
pub mod limits;
pub mod remote;

/// The scenario: its options and its own restartable backends.
pub struct Storm {
    args: StormArgs,
    /// Processes per role.
    processes: usize,
    addr: SocketAddr,
    backends: RefCell<Vec<Child>>,
}

impl Storm {
    /// Chooses the processes per role and starts the scenario's backends on a free loopback
    /// address.
    pub async fn new(args: StormArgs) -> Result<Self> {
        let n = args.connections.max(1);
        let processes = choose_processes(n, args.processes, procstat::nofile_limit())?;
        // Every client connects from 127.0.0.1 to one address, and every target process to
        // one backend address: a port each, from the same range.
        if let Some(ports) = ephemeral_ports() {
            ensure!(
                n as u64 + SPARE_DESCRIPTORS < ports,
                "{n} connections to one address need as many ephemeral ports, \
                 over what net.ipv4.ip_local_port_range gives ({ports})"
            );
            // connect() takes ports of one parity first and searches all of them before it
            // takes one of the other: beyond half of the range each connect costs far more.
            if n as u64 > ports / 2 {
                eprintln!(
                    "storm: warning: {n} connections to one address are over half of \
                     net.ipv4.ip_local_port_range ({ports} ports): each connect() then searches \
                     thousands of ports; widen the range (bench/scripts/netns.sh)"
                );
            }
        }
        let addr = kube_apiserver_proxy_tests::util::free_random_loopback_addr()?;
        let backends = start_backends(addr, processes).await?;
        Ok(Self {
            args,
            processes,
            addr,
            backends: RefCell::new(backends),
        })
    }

    /// SIGKILLs the backends, waits `downtime`, starts them again on the same address.
    async fn restart_backend(&self) -> Result<()> {
        let old = std::mem::take(&mut *self.backends.borrow_mut());
        for mut old in old {
            old.start_kill().context("kill the storm backend")?;
            old.wait().await?;
        }
        tokio::time::sleep(self.args.downtime).await;
        let new = start_backends(self.addr, self.processes).await?;
        *self.backends.borrow_mut() = new;
        Ok(())
    }
}

/// `processes` times `bench serve-backend --echo-at ADDR`, all started before any is waited
/// for, once all listen.
async fn start_backends(addr: SocketAddr, processes: usize) -> Result<Vec<Child>> {
    let exe = std::env::current_exe().context("cannot find the bench binary")?;
    let mut children = Vec::with_capacity(processes);
    for _ in 0..processes {
        let child = Command::new(&exe)
            .arg("serve-backend")
            .arg(format!("--echo-at={addr}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start the storm backend")?;
        children.push(child);
    }
    for child in &mut children {
        let stdout = child.stdout.take().context("no stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).await?;
        ensure!(
            line.trim() == "listening",
            "storm backend said {line:?} instead of listening"
        );
    }
    Ok(children)
}

/// The load generator of one run: in this process, or spread over client processes.
enum Clients {
    Here(Fleet),
    Spread(Remote),
}

impl Clients {
    async fn up(&mut self) -> Result<()> {
        match self {
            Clients::Here(fleet) => fleet.up().await,
            Clients::Spread(remote) => remote.up().await,
        }
    }

    async fn restart(&mut self) -> Result<()> {
        match self {
            Clients::Here(fleet) => {
                fleet.restart(Instant::now());
                Ok(())
            }
            Clients::Spread(remote) => remote.restart().await,
        }
    }

    /// The comebacks, and the CPU seconds of the client processes (none here).
    async fn collect(&mut self, timeout: Duration) -> Result<(Vec<Comeback>, f64)> {
        match self {
            Clients::Here(fleet) => Ok((fleet.collect().await?, 0.0)),
            Clients::Spread(remote) => remote.collect(timeout).await,
        }
    }

    async fn release(self) -> Result<()> {
        match self {
            Clients::Here(fleet) => {
                drop(fleet);
                Ok(())
            }
            Clients::Spread(remote) => remote.release().await,
        }
    }
}

/// The figures of the comebacks: time until all back, p50, p99, failed attempts (also by
/// kind, as `failed_KIND`) and lost clients.
fn summarise(comebacks: &[Comeback]) -> Metrics {
    let mut back: Vec<u64> = comebacks.iter().filter_map(|c| c.after_us).collect();
    back.sort_unstable();
    let mut metrics = Metrics::new();
    let quantile = |q: f64| {
        let i = ((back.len() as f64 * q).ceil() as usize).clamp(1, back.len()) - 1;
        back[i] as f64
    };
    if !back.is_empty() {
        metrics.insert("all_back_us".into(), quantile(1.0));
        metrics.insert("back_p50_us".into(), quantile(0.5));
        metrics.insert("back_p99_us".into(), quantile(0.99));
    }
    let failed: u64 = comebacks.iter().map(|c| c.failed).sum();
    metrics.insert("failed".into(), failed as f64);
    // By kind (refused, reset, closed, timeout, other): in the JSON file only.
    for comeback in comebacks {
        for (kind, count) in &comeback.kinds {
            *metrics.entry(format!("failed_{kind}")).or_insert(0.0) += *count as f64;
        }
    }
    let lost = comebacks.iter().filter(|c| c.after_us.is_none()).count();
    metrics.insert("lost".into(), lost as f64);
    metrics
}

impl Scenario for Storm {
    const NAME: &'static str = "storm";

    fn description(&self) -> String {
        let spread = if self.processes > 1 {
            format!(", {} processes per role", self.processes)
        } else {
            String::new()
        };
        format!(
            "{} long-lived connections reconnecting at once after a backend restart ({} down){spread}",
            self.args.connections,
            humantime::format_duration(self.args.downtime)
        )
    }

    fn parameters(&self) -> serde_json::Value {
        json!({
            "connections": self.args.connections,
            "processes": self.processes,
            "ramp": self.args.ramp,
            "downtime_s": self.args.downtime.as_secs_f64(),
            "retry_s": self.args.retry.as_secs_f64(),
            "deadline_s": self.args.deadline.as_secs_f64(),
            "nofile_limit": procstat::nofile_limit(),
            "ephemeral_ports": ephemeral_ports(),
        })
    }

    fn backend(&self, _addrs: &BackendAddrs) -> SocketAddr {
        self.addr
    }

    fn processes(&self) -> usize {
        self.processes
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::new("all_back_us", "time until all reconnected", Unit::Micros).charted(),
            MetricSpec::new("back_p50_us", "reconnect p50", Unit::Micros),
            MetricSpec::new("back_p99_us", "reconnect p99", Unit::Micros),
            MetricSpec::new("failed", "failed attempts", Unit::Count),
            MetricSpec::new("lost", "clients not back", Unit::Count),
            MetricSpec::new("rss_before_bytes", "target RSS, all connected", Unit::Bytes),
            MetricSpec::new(
                "idle_cpu_s",
                "target CPU, all connected and idle",
                Unit::CpuSeconds,
            ),
            MetricSpec::new(
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
        // Up: N connections, each after one answered exchange.
        let options = ClientOptions {
            addr: target.addr,
            connections: self.args.connections.max(1),
            ramp: self.args.ramp,
            retry: self.args.retry,
            deadline: self.args.deadline,
        };
        let mut clients = if self.processes > 1 {
            Clients::Spread(Remote::start(&options, self.processes)?)
        } else {
            Clients::Here(Fleet::start(options))
        };
        clients.up().await?;
        tokio::time::sleep(timing.warmup).await;
        // All held idle for the round's duration first: what N watches cost while nothing is
        // sent.
        let connected = target.sample()?;
        tokio::time::sleep(timing.duration).await;
        let before = target.sample()?;
        let loadgen_cpu = procstat::self_cpu();

        // The storm, with the target's memory (all its processes together) sampled meanwhile.
        let peak = Arc::new(AtomicU64::new(before.map_or(0, |s| s.rss_bytes)));
        let pids = target.pids();
        let sampler = (!pids.is_empty()).then(|| {
            let peak = peak.clone();
            tokio::spawn(async move {
                loop {
                    let rss: Result<u64> = pids
                        .iter()
                        .map(|&pid| procstat::sample(pid).map(|s| s.rss_bytes))
                        .sum();
                    if let Ok(rss) = rss {
                        peak.fetch_max(rss, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        });
        clients.restart().await?;
        self.restart_backend().await?;
        // A client gives up at the deadline, after its last attempt (5 s at most).
        let (comebacks, children_cpu) = clients
            .collect(self.args.deadline + Duration::from_secs(30))
            .await?;
        if let Some(sampler) = sampler {
            sampler.abort();
        }
        let after = target.sample()?;

        let mut metrics = summarise(&comebacks);
        metrics.insert(
            "loadgen_cpu_s".into(),
            procstat::self_cpu()
                .saturating_sub(loadgen_cpu)
                .as_secs_f64()
                + children_cpu,
        );
        if let (Some(connected), Some(before)) = (connected, before) {
            metrics.insert(
                "idle_cpu_s".into(),
                before.cpu.saturating_sub(connected.cpu).as_secs_f64(),
            );
        }
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
        clients.release().await?;
        Ok(metrics)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comebacks_are_merged() {
        let back = |us, failed, kind: &str| Comeback {
            after_us: us,
            failed,
            kinds: [(kind.to_owned(), failed)].into(),
        };
        let comebacks: Vec<Comeback> = (1..=100)
            .map(|i| back(Some(i * 1000), 1, "refused"))
            .chain([back(None, 3, "timeout")])
            .collect();
        let metrics = summarise(&comebacks);
        assert_eq!(metrics["all_back_us"], 100_000.0);
        assert_eq!(metrics["back_p50_us"], 50_000.0);
        assert_eq!(metrics["back_p99_us"], 99_000.0);
        assert_eq!(metrics["failed"], 103.0);
        assert_eq!(metrics["failed_refused"], 100.0);
        assert_eq!(metrics["failed_timeout"], 3.0);
        assert_eq!(metrics["lost"], 1.0);
    }
}
