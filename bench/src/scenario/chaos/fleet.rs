//! The soak's proxy instances: all on one public address with one shared `--handoff-dir`,
//! started, checked for readiness, SIGTERMed or SIGKILLed, reaped and sampled without blocking
//! the load. Every instance's life is kept ([`Life`]), and anything an instance should not do —
//! exit on its own, exit non-zero after SIGTERM, not become ready, not exit after its drain —
//! is recorded as an [`Anomaly`] with the tail of its log.

use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::Signal;
use serde::Serialize;
use tokio::time::Instant;

use super::attribution::{Drain, Kill};
use super::policy::Phase;
use super::resources::{self, Sample};
use crate::instance::Instance;
use crate::proxy::{ProxyLauncher, ProxyOptions};

/// One instance's life, times in seconds since t0.
#[derive(Debug, Clone, Serialize)]
pub struct Life {
    pub name: String,
    pub pid: u32,
    /// Its log file.
    pub log: String,
    pub started_s: f64,
    pub ready_s: Option<f64>,
    /// `SIGTERM` or `SIGKILL` from the chaos (not the final stop).
    pub signal: Option<&'static str>,
    pub signal_s: Option<f64>,
    pub end_s: Option<f64>,
    /// How it ended (`exit status: 0`, `signal: 9 (SIGKILL)`, …).
    pub exit: Option<String>,
    pub samples: Vec<Sample>,
}

/// Something an instance should not have done.
#[derive(Debug, Clone, Serialize)]
pub struct Anomaly {
    pub at_s: f64,
    pub instance: String,
    pub what: String,
    pub log_tail: String,
}

struct Member {
    instance: Instance,
    phase: Phase,
    life: Life,
}

/// The running instances and the record of those gone.
pub struct Fleet<'a> {
    launcher: &'a mut ProxyLauncher,
    options: ProxyOptions,
    t0: Instant,
    members: Vec<Member>,
    gone: Vec<Life>,
    /// Every chaos SIGKILL, with the moment the process was seen dead.
    pub kills: Vec<Kill>,
    /// Every chaos SIGTERM, with the moment the process exited.
    pub drains: Vec<Drain>,
    pub anomalies: Vec<Anomaly>,
}

/// How long an instance may take to become ready.
const READY_LIMIT: Duration = Duration::from_secs(20);

impl<'a> Fleet<'a> {
    /// An empty fleet; instances are started with `options`, times are relative to `t0`.
    pub fn new(launcher: &'a mut ProxyLauncher, options: ProxyOptions, t0: Instant) -> Self {
        Self {
            launcher,
            options,
            t0,
            members: Vec::new(),
            gone: Vec::new(),
            kills: Vec::new(),
            drains: Vec::new(),
            anomalies: Vec::new(),
        }
    }

    fn now_s(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    /// How long a SIGTERMed instance may take to exit: its drain plus a margin.
    fn exit_limit(&self) -> Duration {
        self.options.drain_timeout * 2 + Duration::from_secs(5)
    }

    /// The phase of each running instance, in start order.
    pub fn phases(&self) -> Vec<Phase> {
        self.members.iter().map(|m| m.phase).collect()
    }

    /// The name of running instance `index`.
    pub fn name(&self, index: usize) -> &str {
        &self.members[index].life.name
    }

    /// Spawns a new instance (Starting); returns its name.
    pub fn start(&mut self) -> Result<String> {
        let instance = self.launcher.spawn(&self.options)?;
        let life = Life {
            name: instance.name().to_owned(),
            pid: instance.pid(),
            log: instance.log_path().display().to_string(),
            started_s: self.now_s(),
            ready_s: None,
            signal: None,
            signal_s: None,
            end_s: None,
            exit: None,
            samples: Vec::new(),
        };
        let name = life.name.clone();
        self.members.push(Member {
            instance,
            phase: Phase::Starting,
            life,
        });
        Ok(name)
    }

    /// Starts an instance and waits until it is Serving (the fleet's first instances).
    pub async fn start_ready(&mut self) -> Result<()> {
        let name = self.start()?;
        let deadline = Instant::now() + READY_LIMIT;
        while Instant::now() < deadline {
            self.poll().await;
            match self.members.iter().find(|m| m.life.name == name) {
                Some(m) if m.phase == Phase::Serving => return Ok(()),
                Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                None => break,
            }
        }
        let detail = self
            .anomalies
            .last()
            .map(|a| format!("{}; its log:\n{}", a.what, a.log_tail))
            .unwrap_or_default();
        anyhow::bail!("{name} did not become ready: {detail}")
    }

    /// Checks Starting instances for readiness and every instance for an exit.
    pub async fn poll(&mut self) {
        let now_s = self.now_s();
        let exit_limit = self.exit_limit().as_secs_f64();
        let mut index = 0;
        while index < self.members.len() {
            let member = &mut self.members[index];
            let exited = member.instance.try_exit().unwrap_or_default();
            if let Some(status) = exited {
                let member = self.members.remove(index);
                let expected = member.phase == Phase::Draining;
                let clean = status.success();
                if !expected || !clean {
                    let what = if expected {
                        format!("exited with {status} after SIGTERM")
                    } else {
                        format!("exited on its own ({status}) while {:?}", member.phase)
                    };
                    self.anomaly(&member, what);
                }
                self.retire(member, now_s, status.to_string());
                continue;
            }
            match member.phase {
                Phase::Starting => {
                    let ready = member
                        .instance
                        .check_ready(Duration::from_millis(200))
                        .await
                        .unwrap_or(false);
                    let now_s = self.now_s();
                    let member = &mut self.members[index];
                    if ready {
                        member.phase = Phase::Serving;
                        member.life.ready_s = Some(now_s);
                    } else if now_s - member.life.started_s > READY_LIMIT.as_secs_f64() {
                        let member = self.members.remove(index);
                        self.anomaly(&member, format!("not ready after {READY_LIMIT:?}"));
                        self.force_kill(member).await;
                        continue;
                    }
                }
                Phase::Draining => {
                    let since = now_s - member.life.signal_s.unwrap_or(now_s);
                    if since > exit_limit {
                        let member = self.members.remove(index);
                        self.anomaly(&member, format!("still running {since:.1}s after SIGTERM"));
                        self.force_kill(member).await;
                        continue;
                    }
                }
                Phase::Serving => {}
            }
            index += 1;
        }
    }

    /// SIGTERMs instance `index`: it drains and exits on its own.
    pub fn sigterm(&mut self, index: usize) -> Result<()> {
        let now_s = self.now_s();
        let member = &mut self.members[index];
        member.instance.signal(Signal::SIGTERM)?;
        member.phase = Phase::Draining;
        member.life.signal = Some("SIGTERM");
        member.life.signal_s = Some(now_s);
        Ok(())
    }

    /// SIGKILLs instance `index` and waits until it is dead.
    pub async fn sigkill(&mut self, index: usize) -> Result<Kill> {
        let mut member = self.members.remove(index);
        let signal_s = self.now_s();
        member.instance.signal(Signal::SIGKILL)?;
        let status = member
            .instance
            .wait_exit(Duration::from_secs(5))
            .await?
            .context("a SIGKILLed process did not die")?;
        let dead_s = self.now_s();
        if member.phase == Phase::Draining {
            // Killed mid-drain: the drain ends at the death.
            self.drains.push(Drain {
                signal_s: member.life.signal_s.unwrap_or(signal_s),
                exit_s: dead_s,
            });
        }
        member.life.signal = Some("SIGKILL");
        member.life.signal_s = Some(signal_s);
        let kill = Kill { signal_s, dead_s };
        self.kills.push(kill);
        self.retire(member, dead_s, status.to_string());
        Ok(kill)
    }

    /// Samples every running instance.
    pub async fn sample(&mut self) {
        for member in &mut self.members {
            let now_s = self.t0.elapsed().as_secs_f64();
            let admin = member.instance.admin_addr();
            if let Ok(sample) = resources::sample(member.instance.pid(), admin, now_s).await {
                member.life.samples.push(sample);
            }
        }
    }

    /// One sample of every running instance, not kept in its life (the quiescent reading
    /// after the load has stopped).
    pub async fn snapshot(&self) -> Vec<(String, Sample)> {
        let mut out = Vec::new();
        for member in &self.members {
            let now_s = self.now_s();
            let admin = member.instance.admin_addr();
            if let Ok(sample) = resources::sample(member.instance.pid(), admin, now_s).await {
                out.push((member.life.name.clone(), sample));
            }
        }
        out
    }

    /// Stops every instance (SIGTERM, then waits) and returns every life in start order.
    pub async fn finish(mut self) -> (Vec<Life>, Vec<Kill>, Vec<Drain>, Vec<Anomaly>) {
        let limit = self.exit_limit();
        for member in std::mem::take(&mut self.members) {
            let mut member = member;
            let _ = member.instance.signal(Signal::SIGTERM);
            let status = member.instance.wait_exit(limit).await;
            let now_s = self.now_s();
            let exit = match status {
                Ok(Some(status)) if status.success() => status.to_string(),
                Ok(Some(status)) => {
                    self.anomaly(&member, format!("final stop: exited with {status}"));
                    status.to_string()
                }
                _ => {
                    self.anomaly(&member, format!("final stop: killed after {limit:?}"));
                    "killed".into()
                }
            };
            member.life.end_s = Some(now_s);
            member.life.exit = Some(exit);
            self.gone.push(member.life);
        }
        self.gone
            .sort_by(|a, b| a.started_s.total_cmp(&b.started_s));
        (self.gone, self.kills, self.drains, self.anomalies)
    }

    async fn force_kill(&mut self, mut member: Member) {
        let _ = member.instance.signal(Signal::SIGKILL);
        let status = member.instance.wait_exit(Duration::from_secs(5)).await;
        let now_s = self.now_s();
        let exit = match status {
            Ok(Some(status)) => format!("{status} (killed by the harness)"),
            _ => "killed by the harness".into(),
        };
        if member.phase == Phase::Draining {
            // Its connections were cut by our kill: count it as one for the attribution.
            self.kills.push(Kill {
                signal_s: now_s,
                dead_s: now_s,
            });
        }
        self.retire(member, now_s, exit);
    }

    fn retire(&mut self, mut member: Member, end_s: f64, exit: String) {
        if member.phase == Phase::Draining && member.life.signal == Some("SIGTERM") {
            self.drains.push(Drain {
                signal_s: member.life.signal_s.unwrap_or(end_s),
                exit_s: end_s,
            });
        }
        member.life.end_s = Some(end_s);
        member.life.exit = Some(exit);
        self.gone.push(member.life);
    }

    fn anomaly(&mut self, member: &Member, what: String) {
        self.anomalies.push(Anomaly {
            at_s: self.t0.elapsed().as_secs_f64(),
            instance: member.life.name.clone(),
            what,
            log_tail: member.instance.log_tail(),
        });
    }
}
