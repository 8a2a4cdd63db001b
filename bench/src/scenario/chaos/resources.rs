//! Resources of each proxy instance over the soak, and whether they grow.
//!
//! A sample is read from outside the process — `VmRSS` of `/proc/PID/status` and the entries of
//! `/proc/PID/fd` — plus, best effort, a few gauges from its `/metrics` (alive runtime tasks,
//! active connections, pooled splice pipes, listening sockets held).
//!
//! **Growth.** For every instance that lived at least `min_lifetime` (default 20 s), the median
//! of the first third of its samples is compared with the median of the last third. RSS grows
//! when the last third is more than max(2 MiB, 20 %) above the first; the descriptor count and
//! the task count grow when the last third is more than [`COUNT_SLACK`] above the first (each
//! proxied connection holds a few descriptors and tasks, and long-lived streams wander between
//! instances). Second, instances of the same age are compared across the soak: the largest RSS
//! and descriptor count at [`AGE_S`] seconds of age among instances started in the first third
//! of the soak against those started in the last third — what a leak into shared state (the
//! handoff directory, say) would change.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use serde::Serialize;

use crate::procstat;
use kube_apiserver_proxy_tests::client::http_get_within;

/// How much a descriptor or task count may rise between the first and last thirds before it
/// counts as growth.
pub const COUNT_SLACK: f64 = 16.0;

/// The age at which instances are compared across the soak.
pub const AGE_S: f64 = 3.0;

/// One sample of one instance.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Seconds since t0.
    pub t_s: f64,
    pub rss_bytes: u64,
    pub fds: u64,
    /// `kube_apiserver_proxy_runtime_alive_tasks`.
    pub tasks: Option<u64>,
    /// `kube_apiserver_proxy_connections_active`.
    pub active: Option<u64>,
    /// `kube_apiserver_proxy_splice_pipes_pooled`.
    pub pipes_pooled: Option<u64>,
    /// `kube_apiserver_proxy_listening_sockets`.
    pub listening: Option<u64>,
}

/// Samples process `pid`; `admin` is its admin endpoint, if known.
pub async fn sample(pid: u32, admin: Option<SocketAddr>, t_s: f64) -> Result<Sample> {
    let proc = procstat::sample(pid)?;
    let fds = procstat::open_fds(pid)?;
    let metrics = match admin {
        Some(addr) => match http_get_within(addr, "/metrics", Duration::from_millis(300)).await {
            Ok((200, body)) => body,
            _ => String::new(),
        },
        None => String::new(),
    };
    let gauge = |name: &str| gauge(&metrics, &format!("kube_apiserver_proxy_{name}"));
    Ok(Sample {
        t_s,
        rss_bytes: proc.rss_bytes,
        fds,
        tasks: gauge("runtime_alive_tasks"),
        active: gauge("connections_active"),
        pipes_pooled: gauge("splice_pipes_pooled"),
        listening: gauge("listening_sockets"),
    })
}

/// The sum of every series of metric `name` in Prometheus text, if there is one.
fn gauge(text: &str, name: &str) -> Option<u64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        let Some(Ok(value)) = rest.rsplit(' ').next().map(str::parse::<f64>) else {
            continue;
        };
        *found.get_or_insert(0) += value.max(0.0) as u64;
    }
    found
}

/// First-third versus last-third medians of one long-lived instance.
#[derive(Debug, Clone, Serialize)]
pub struct Growth {
    pub instance: String,
    pub lifetime_s: f64,
    pub samples: usize,
    pub rss_first_bytes: f64,
    pub rss_last_bytes: f64,
    pub rss_max_bytes: u64,
    pub fds_first: f64,
    pub fds_last: f64,
    pub fds_max: u64,
    pub tasks_first: Option<f64>,
    pub tasks_last: Option<f64>,
    pub rss_grows: bool,
    pub fds_grows: bool,
    pub tasks_grows: bool,
}

impl Growth {
    /// Compares the thirds of `samples` (in time order); `None` if the instance lived shorter
    /// than `min_lifetime_s` or has fewer than six samples.
    pub fn of(instance: &str, samples: &[Sample], min_lifetime_s: f64) -> Option<Self> {
        let (first, last) = (samples.first()?, samples.last()?);
        let lifetime_s = last.t_s - first.t_s;
        if lifetime_s < min_lifetime_s || samples.len() < 6 {
            return None;
        }
        let third = samples.len() / 3;
        let (head, tail) = (&samples[..third], &samples[samples.len() - third..]);
        let median_of = |part: &[Sample], get: fn(&Sample) -> Option<u64>| {
            let values: Vec<f64> = part.iter().filter_map(get).map(|v| v as f64).collect();
            median(&values)
        };
        let rss_first = median_of(head, |s| Some(s.rss_bytes))?;
        let rss_last = median_of(tail, |s| Some(s.rss_bytes))?;
        let fds_first = median_of(head, |s| Some(s.fds))?;
        let fds_last = median_of(tail, |s| Some(s.fds))?;
        let tasks_first = median_of(head, |s| s.tasks);
        let tasks_last = median_of(tail, |s| s.tasks);
        const MIB: f64 = 1024.0 * 1024.0;
        Some(Self {
            instance: instance.to_owned(),
            lifetime_s,
            samples: samples.len(),
            rss_first_bytes: rss_first,
            rss_last_bytes: rss_last,
            rss_max_bytes: samples.iter().map(|s| s.rss_bytes).max().unwrap_or(0),
            fds_first,
            fds_last,
            fds_max: samples.iter().map(|s| s.fds).max().unwrap_or(0),
            tasks_first,
            tasks_last,
            rss_grows: rss_last > rss_first + (2.0 * MIB).max(0.2 * rss_first),
            fds_grows: fds_last > fds_first + COUNT_SLACK,
            tasks_grows: matches!((tasks_first, tasks_last), (Some(a), Some(b)) if b > a + COUNT_SLACK),
        })
    }

    /// Whether anything grew.
    pub fn grows(&self) -> bool {
        self.rss_grows || self.fds_grows || self.tasks_grows
    }
}

/// Instances of the same age, early in the soak against late in it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SameAge {
    pub age_s: f64,
    /// Instances started in the first third of the soak that reached the age.
    pub early_instances: usize,
    pub early_rss_max_bytes: Option<u64>,
    pub early_fds_max: Option<u64>,
    /// Instances started in the last third.
    pub late_instances: usize,
    pub late_rss_max_bytes: Option<u64>,
    pub late_fds_max: Option<u64>,
}

impl SameAge {
    /// `lives` holds each instance's start (seconds since t0) and samples; the soak lasted
    /// `duration_s`.
    pub fn of<'a>(lives: impl Iterator<Item = (f64, &'a [Sample])>, duration_s: f64) -> Self {
        let mut out = SameAge {
            age_s: AGE_S,
            ..SameAge::default()
        };
        for (started_s, samples) in lives {
            let Some(at_age) = samples.iter().find(|s| s.t_s - started_s >= AGE_S) else {
                continue;
            };
            let max = |slot: &mut Option<u64>, v: u64| *slot = Some(slot.map_or(v, |m| m.max(v)));
            if started_s < duration_s / 3.0 {
                out.early_instances += 1;
                max(&mut out.early_rss_max_bytes, at_age.rss_bytes);
                max(&mut out.early_fds_max, at_age.fds);
            } else if started_s >= duration_s * 2.0 / 3.0 {
                out.late_instances += 1;
                max(&mut out.late_rss_max_bytes, at_age.rss_bytes);
                max(&mut out.late_fds_max, at_age.fds);
            }
        }
        out
    }
}

fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    Some((sorted[(n - 1) / 2] + sorted[n / 2]) / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(rss: impl Fn(usize) -> u64, fds: impl Fn(usize) -> u64) -> Vec<Sample> {
        (0..60)
            .map(|i| Sample {
                t_s: i as f64 * 0.5,
                rss_bytes: rss(i),
                fds: fds(i),
                tasks: Some(10),
                active: None,
                pipes_pooled: None,
                listening: Some(1),
            })
            .collect()
    }

    #[test]
    fn flat_does_not_grow() {
        let flat = samples(|i| 8 << 20 | (i as u64 % 3) << 12, |i| 20 + i as u64 % 5);
        let growth = Growth::of("p", &flat, 20.0).expect("long-lived");
        assert!(!growth.grows(), "{growth:?}");
        assert!(Growth::of("p", &flat, 60.0).is_none());
    }

    #[test]
    fn leaks_grow() {
        let leaky_rss = samples(|i| (8 << 20) + (i as u64) * (200 << 10), |_| 20);
        assert!(Growth::of("p", &leaky_rss, 20.0).unwrap().rss_grows);
        let leaky_fds = samples(|_| 8 << 20, |i| 20 + i as u64);
        let growth = Growth::of("p", &leaky_fds, 20.0).unwrap();
        assert!(growth.fds_grows && !growth.rss_grows);
    }

    #[test]
    fn same_age_splits_by_start() {
        let a = samples(|_| 5 << 20, |_| 20);
        let b = samples(|_| 7 << 20, |_| 30);
        let out = SameAge::of([(0.0, &a[..]), (0.0, &b[..])].into_iter(), 90.0);
        assert_eq!(out.early_instances, 2);
        assert_eq!(out.early_rss_max_bytes, Some(7 << 20));
        assert_eq!(out.late_instances, 0);
    }

    #[test]
    fn parses_gauges() {
        let text = "# HELP x\nkube_apiserver_proxy_open_fds 12\n\
                    kube_apiserver_proxy_open_fds_other 5\n\
                    kube_apiserver_proxy_conn{a=\"b\"} 3\nkube_apiserver_proxy_conn{a=\"c\"} 4\n";
        assert_eq!(gauge(text, "kube_apiserver_proxy_open_fds"), Some(12));
        assert_eq!(gauge(text, "kube_apiserver_proxy_conn"), Some(7));
        assert_eq!(gauge(text, "kube_apiserver_proxy_missing"), None);
    }
}
