//! The soak's results: every connection judged, the counts by kind and verdict, the timeline,
//! the resource growth checks, anomalies; printed as a table and written as JSON.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Serialize;

use super::attribution::{Attempt, Client, Drain, End, Kill, Rules, Verdict};
use super::fleet::{Anomaly, Life};
use super::load::Recorded;
use super::policy::ActionKind;
use super::resources::{Growth, SameAge, Sample};
use super::Action;
use crate::outcome::{FailureCounts, FailureKind};
use crate::report::{print_rows, Machine, Unit};

/// What the soak collected, before judging.
pub struct Raw {
    pub parameters: serde_json::Value,
    pub proxy_bin: Option<PathBuf>,
    pub listen: SocketAddr,
    pub load_start_s: f64,
    pub chaos_end_s: f64,
    pub actions: Vec<Action>,
    pub skipped: u32,
    pub recorded: Recorded,
    pub rules: Rules,
    pub lives: Vec<Life>,
    pub anomalies: Vec<Anomaly>,
    pub quiescent: Vec<(String, Sample)>,
    pub stale_socket_files: usize,
    pub min_lifetime_s: f64,
    pub bucket_s: f64,
}

/// Actions taken, by kind.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ActionCounts {
    pub start: u32,
    pub sigterm: u32,
    pub sigkill: u32,
    /// Turns where nothing was allowed.
    pub skipped: u32,
}

/// Connection figures for one client kind, or all.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Connections {
    pub attempted: u64,
    pub ok: u64,
    /// Streams closed cleanly by a draining instance (not failures).
    pub drained: u64,
    /// Every failure (killed + unexplained), by kind; a stream's clean EOF counts as `closed`.
    pub failed: FailureCounts,
    /// Failures in flight in a SIGKILLed instance (the accepted losses).
    pub killed: FailureCounts,
    /// Failures nothing explains (proxy bugs).
    pub unexplained: FailureCounts,
}

impl Connections {
    fn add(&mut self, attempt: &Attempt, verdict: Verdict) {
        self.attempted += 1;
        let kind = match attempt.end {
            End::Failed(kind) => kind,
            _ => FailureKind::Closed,
        };
        match verdict {
            Verdict::Ok => self.ok += 1,
            Verdict::Drained => self.drained += 1,
            Verdict::Killed => {
                self.failed.add(kind);
                self.killed.add(kind);
            }
            Verdict::Unexplained => {
                self.failed.add(kind);
                self.unexplained.add(kind);
            }
        }
    }
}

/// A connection that did not simply succeed, with its verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Judged {
    #[serde(flatten)]
    pub attempt: Attempt,
    pub verdict: Verdict,
}

/// One timeline bucket.
#[derive(Debug, Clone, Serialize)]
pub struct Bucket {
    pub start_s: f64,
    /// Churn requests begun in the bucket.
    pub requests: u64,
    /// Failures seen in the bucket, by verdict.
    pub killed: u64,
    pub unexplained: u64,
}

/// A reading of a surviving instance after the load stopped.
#[derive(Debug, Clone, Serialize)]
pub struct Quiescent {
    pub instance: String,
    #[serde(flatten)]
    pub sample: Sample,
}

/// Everything the soak measured.
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    pub scenario: &'static str,
    pub parameters: serde_json::Value,
    pub machine: Machine,
    pub listen: String,
    /// When the load started and the chaos ended (seconds since t0).
    pub load_start_s: f64,
    pub chaos_end_s: f64,
    pub action_counts: ActionCounts,
    pub instances_started: usize,
    pub longest_life_s: f64,
    /// All connections, then churn requests and stream connections apart.
    pub connections: Connections,
    pub churn: Connections,
    pub streams: Connections,
    /// Pings answered on the streams.
    pub pings: u64,
    /// The attribution window (seconds).
    pub kill_window_s: f64,
    /// The latest a failure blamed on a SIGKILL was seen after the death (seconds; how much
    /// of the window was needed).
    pub killed_seen_after_death_max_s: Option<f64>,
    pub growth: Vec<Growth>,
    /// Whether any long-lived instance's RSS, descriptors or tasks grew.
    pub growth_seen: bool,
    pub same_age: SameAge,
    pub quiescent: Vec<Quiescent>,
    /// Socket files left in the handoff directory after every instance stopped.
    pub stale_socket_files: usize,
    pub anomalies: Vec<Anomaly>,
    /// Every connection that did not simply succeed (drains included), in time order.
    pub failures: Vec<Judged>,
    pub buckets: Vec<Bucket>,
    pub kills: Vec<Kill>,
    pub drains: Vec<Drain>,
    pub actions: Vec<Action>,
    pub instances: Vec<Life>,
}

/// Every connection judged: the counts, the failures in time order, the timeline buckets.
struct Judgement {
    all: Connections,
    churn: Connections,
    streams: Connections,
    failures: Vec<Judged>,
    killed_seen_after_death_max_s: Option<f64>,
    buckets: Vec<Bucket>,
}

impl Judgement {
    fn of(raw: &Raw) -> Self {
        let rules = &raw.rules;
        let mut all = Connections::default();
        let mut churn = Connections::default();
        let mut streams = Connections::default();
        let mut failures = Vec::new();
        let mut killed_seen_after_death_max_s: Option<f64> = None;
        let bucket_s = raw.bucket_s.max(0.001);
        let end_s = raw
            .recorded
            .attempts
            .iter()
            .map(|a| a.ended_s)
            .fold(raw.chaos_end_s, f64::max);
        let n_buckets = (end_s / bucket_s).ceil() as usize + 1;
        let slot = |t: f64| ((t / bucket_s) as usize).min(n_buckets - 1);
        let mut buckets: Vec<Bucket> = (0..n_buckets)
            .map(|b| Bucket {
                start_s: b as f64 * bucket_s,
                requests: 0,
                killed: 0,
                unexplained: 0,
            })
            .collect();
        for attempt in &raw.recorded.attempts {
            let verdict = rules.judge(attempt);
            all.add(attempt, verdict);
            match attempt.client {
                Client::Churn => {
                    churn.add(attempt, verdict);
                    buckets[slot(attempt.began_s)].requests += 1;
                }
                Client::Stream => streams.add(attempt, verdict),
            }
            if verdict == Verdict::Killed {
                if let Some(after) = rules.after_death(attempt) {
                    let max = killed_seen_after_death_max_s.get_or_insert(after);
                    *max = max.max(after);
                }
            }
            match verdict {
                Verdict::Killed => buckets[slot(attempt.ended_s)].killed += 1,
                Verdict::Unexplained => buckets[slot(attempt.ended_s)].unexplained += 1,
                _ => {}
            }
            if verdict != Verdict::Ok {
                failures.push(Judged {
                    attempt: *attempt,
                    verdict,
                });
            }
        }
        failures.sort_by(|a, b| a.attempt.ended_s.total_cmp(&b.attempt.ended_s));
        Self {
            all,
            churn,
            streams,
            failures,
            killed_seen_after_death_max_s,
            buckets,
        }
    }
}

impl ActionCounts {
    /// The counts of `actions` by kind, and the turns `skipped`.
    fn of(actions: &[Action], skipped: u32) -> Self {
        let mut counts = ActionCounts {
            skipped,
            ..ActionCounts::default()
        };
        for action in actions {
            match action.kind {
                ActionKind::Start => counts.start += 1,
                ActionKind::Sigterm => counts.sigterm += 1,
                ActionKind::Sigkill => counts.sigkill += 1,
            }
        }
        counts
    }
}

impl ChaosReport {
    /// Judges every connection and summarises.
    pub fn build(raw: Raw) -> Self {
        let rules = &raw.rules;
        let judged = Judgement::of(&raw);
        let action_counts = ActionCounts::of(&raw.actions, raw.skipped);
        let growth: Vec<Growth> = raw
            .lives
            .iter()
            .filter_map(|life| Growth::of(&life.name, &life.samples, raw.min_lifetime_s))
            .collect();
        let same_age = SameAge::of(
            raw.lives
                .iter()
                .map(|l| (l.started_s, l.samples.as_slice())),
            raw.chaos_end_s,
        );
        let longest_life_s = raw
            .lives
            .iter()
            .map(|l| l.end_s.unwrap_or(l.started_s) - l.started_s)
            .fold(0.0, f64::max);
        Self {
            scenario: "chaos",
            parameters: raw.parameters,
            machine: Machine::detect(raw.proxy_bin.as_deref(), None, 0),
            listen: raw.listen.to_string(),
            load_start_s: raw.load_start_s,
            chaos_end_s: raw.chaos_end_s,
            action_counts,
            instances_started: raw.lives.len(),
            longest_life_s,
            connections: judged.all,
            churn: judged.churn,
            streams: judged.streams,
            pings: raw.recorded.pings,
            kill_window_s: rules.window_s,
            killed_seen_after_death_max_s: judged.killed_seen_after_death_max_s,
            growth_seen: growth.iter().any(Growth::grows),
            growth,
            same_age,
            quiescent: raw
                .quiescent
                .into_iter()
                .map(|(instance, sample)| Quiescent { instance, sample })
                .collect(),
            stale_socket_files: raw.stale_socket_files,
            anomalies: raw.anomalies,
            failures: judged.failures,
            buckets: judged.buckets,
            kills: rules.kills.clone(),
            drains: rules.drains.clone(),
            actions: raw.actions,
            instances: raw.lives,
        }
    }

    /// Failures nothing explains.
    pub fn unexplained(&self) -> u64 {
        self.connections.unexplained.total()
    }

    /// Prints the summary table.
    pub fn print(&self) {
        let c = &self.action_counts;
        println!();
        println!(
            "== chaos: {:.0}s of random start / SIGTERM / SIGKILL on {} ==",
            self.chaos_end_s - self.load_start_s,
            self.listen
        );
        println!(
            "   actions: {} start, {} SIGTERM, {} SIGKILL ({} turns with nothing allowed); \
             {} instances in all, longest life {:.1}s",
            c.start, c.sigterm, c.sigkill, c.skipped, self.instances_started, self.longest_life_s
        );
        self.print_connections();
        self.print_resources();
        println!();
        println!(
            "chaos: {} connections, {} failed: {} in flight in a SIGKILLed instance, {} not \
             explained; RSS/fds growth: {}; anomalies: {}",
            self.connections.attempted,
            self.connections.failed.total(),
            self.connections.killed.total(),
            self.unexplained(),
            if self.growth.is_empty() {
                "not checked (no long-lived instance)"
            } else if self.growth_seen {
                "YES"
            } else {
                "none"
            },
            self.anomalies.len()
        );
    }

    /// The connections table, and every failure nothing explains.
    fn print_connections(&self) {
        let mut rows = vec![vec![
            "connections".to_owned(),
            "attempted".to_owned(),
            "ok".to_owned(),
            "drained".to_owned(),
            "failed".to_owned(),
            "in flight in a SIGKILLed instance".to_owned(),
            "NOT explained by a SIGKILL".to_owned(),
        ]];
        for (name, figures) in [
            ("churn requests", &self.churn),
            ("stream connections", &self.streams),
            ("all", &self.connections),
        ] {
            rows.push(vec![
                name.to_owned(),
                figures.attempted.to_string(),
                figures.ok.to_string(),
                figures.drained.to_string(),
                figures.failed.to_string(),
                figures.killed.total().to_string(),
                figures.unexplained.to_string(),
            ]);
        }
        print_rows(&rows);
        println!(
            "   ({} stream pings answered; a failure is blamed on a SIGKILL only if it is a \
             reset or early close of a connection established before the death, seen within \
             {:.1}s after it; the latest was seen {} the death was observed)",
            self.pings,
            self.kill_window_s,
            self.killed_seen_after_death_max_s
                .map_or("–".to_owned(), |s| if s >= 0.0 {
                    format!("{:.1} ms after", s * 1e3)
                } else {
                    format!("{:.1} ms before", -s * 1e3)
                })
        );
        for judged in self
            .failures
            .iter()
            .filter(|j| j.verdict == Verdict::Unexplained)
            .take(20)
        {
            let a = &judged.attempt;
            println!(
                "   UNEXPLAINED {:?} {:?} at {:.3}s (began {:.3}s, established {}); actions \
                 nearby: {}",
                a.client,
                a.end,
                a.ended_s,
                a.began_s,
                a.established_s
                    .map_or("never".to_owned(), |t| format!("{t:.3}s")),
                self.actions_near(a.ended_s)
            );
        }
    }

    /// The instances' resources: growth, same-age comparison, after the load, anomalies.
    fn print_resources(&self) {
        let mib = |b: f64| Unit::Bytes.format(b);
        println!();
        println!(
            "   resources of instances living ≥{:.0}s (median of the first third → last third \
             of their samples):",
            self.parameters["min_lifetime_s"].as_f64().unwrap_or(0.0)
        );
        let mut rows = vec![vec![
            "instance".to_owned(),
            "life".to_owned(),
            "samples".to_owned(),
            "RSS".to_owned(),
            "RSS max".to_owned(),
            "fds".to_owned(),
            "fds max".to_owned(),
            "tasks".to_owned(),
            "grows".to_owned(),
        ]];
        for g in &self.growth {
            let opt = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
            rows.push(vec![
                g.instance.clone(),
                format!("{:.1}s", g.lifetime_s),
                g.samples.to_string(),
                format!("{} → {}", mib(g.rss_first_bytes), mib(g.rss_last_bytes)),
                mib(g.rss_max_bytes as f64),
                format!("{:.0} → {:.0}", g.fds_first, g.fds_last),
                g.fds_max.to_string(),
                format!("{} → {}", opt(g.tasks_first), opt(g.tasks_last)),
                if g.grows() { "YES" } else { "no" }.to_owned(),
            ]);
        }
        if self.growth.is_empty() {
            println!("   (no instance lived that long)");
        } else {
            print_rows(&rows);
        }
        let s = &self.same_age;
        let bytes = |v: Option<u64>| v.map_or("–".to_owned(), |v| mib(v as f64));
        let count = |v: Option<u64>| v.map_or("–".to_owned(), |v| v.to_string());
        println!(
            "   same age ({:.0}s): {} instances started in the first third: max RSS {}, max fds \
             {}; {} started in the last third: max RSS {}, max fds {}",
            s.age_s,
            s.early_instances,
            bytes(s.early_rss_max_bytes),
            count(s.early_fds_max),
            s.late_instances,
            bytes(s.late_rss_max_bytes),
            count(s.late_fds_max)
        );
        for q in &self.quiescent {
            println!(
                "   after the load: {} RSS {}, {} fds, {} tasks, {} connections active, {} \
                 listening sockets",
                q.instance,
                mib(q.sample.rss_bytes as f64),
                q.sample.fds,
                count(q.sample.tasks),
                count(q.sample.active),
                count(q.sample.listening)
            );
        }
        println!(
            "   handoff socket files left after the last instance stopped: {}",
            self.stale_socket_files
        );
        for anomaly in &self.anomalies {
            println!(
                "   ANOMALY {} at {:.1}s: {}",
                anomaly.instance, anomaly.at_s, anomaly.what
            );
        }
    }

    /// The actions within 3 s before and 1 s after `t`, for the unexplained failures.
    fn actions_near(&self, t: f64) -> String {
        let near: Vec<String> = self
            .actions
            .iter()
            .filter(|a| a.at_s >= t - 3.0 && a.at_s <= t + 1.0)
            .map(|a| format!("{} {} at {:.3}s", a.kind.name(), a.instance, a.at_s))
            .collect();
        if near.is_empty() {
            "none".to_owned()
        } else {
            near.join(", ")
        }
    }
}
