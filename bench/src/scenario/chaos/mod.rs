//! `chaos`, the soak: proxy instances sharing one public address and one `--handoff-dir`
//! (TCP health check against the built-in echo backend) under load — churn clients opening a
//! new connection per request, plus a few long-lived streams — while a random action hits the
//! fleet every second or so: start an instance, SIGTERM one, or SIGKILL one, never leaving the
//! address without a Serving instance ([`policy`]).
//!
//! Every connection is judged ([`attribution`]): the only acceptable losses are connections in
//! flight in a SIGKILLed instance; a failure nothing explains is a proxy bug. Every instance's
//! RSS and descriptor count are sampled from `/proc` throughout and checked for growth
//! ([`resources`]). Output: a table on stdout, `OUT/chaos.json` and `OUT/chaos.svg`.
//!
//! Minutes long by default; not run in CI except as a seconds-long smoke test.

pub mod attribution;
pub mod chart;
pub mod fleet;
pub mod load;
pub mod policy;
pub mod report;
pub mod resources;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

use self::attribution::Rules;
use self::fleet::Fleet;
use self::load::Load;
use self::policy::{ActionKind, Policy};
use self::report::{ChaosReport, Raw};
use crate::options::ChaosArgs;
use crate::procstat;
use crate::proxy::ProxyOptions;
use crate::target::Env;
use kube_apiserver_proxy_tests::util::free_random_loopback_addr as free_address;
use kube_apiserver_proxy_tests::util::TempDir;

impl ChaosArgs {
    fn parameters(&self, seed: u64) -> serde_json::Value {
        let mut parameters = json!({
            "duration_s": self.duration.as_secs_f64(),
            "instances": self.instances,
            "interval_s": self.interval.as_secs_f64(),
            "oldest_victim": self.oldest_victim,
            "seed": seed,
            "drain_timeout_s": self.drain_timeout.as_secs_f64(),
            "kill_window_s": self.kill_window.as_secs_f64(),
            "sample_interval_s": self.sample_interval.as_secs_f64(),
            "min_lifetime_s": self.min_lifetime.as_secs_f64(),
            "bucket_s": self.bucket.as_secs_f64(),
        });
        let own = parameters.as_object_mut().expect("a JSON object");
        own.extend(self.load.parameters());
        parameters
    }
}

/// One action of the chaos.
#[derive(Debug, Clone, Serialize)]
pub struct Action {
    /// Seconds since t0.
    pub at_s: f64,
    pub kind: ActionKind,
    pub instance: String,
    /// Instances Starting or Serving, and Serving, just before.
    pub live_before: usize,
    pub serving_before: usize,
}

/// Runs the soak; prints the table, writes JSON and the chart.
pub async fn run(env: &mut Env, args: &ChaosArgs) -> Result<ChaosReport> {
    let backend = env.backend.addrs().echo;
    let out = env.out.clone();
    let proxy_bin = env.proxy.as_ref().map(|p| p.bin().to_owned());
    let launcher = env.proxy.as_mut().context("chaos needs the proxy binary")?;
    let listen = free_address()?;
    let handoff_dir = TempDir::new("bench-chaos-handoff")?;
    let options = ProxyOptions {
        listen,
        backend,
        handoff_dir: Some(handoff_dir.path().to_owned()),
        drain_timeout: args.drain_timeout,
        drain_close_window: args.drain_timeout / 4,
        max_connections: (procstat::nofile_limit().saturating_sub(200) / 4).clamp(1000, 100_000),
        log_level: "info",
        worker_threads: None,
        transparent: false,
    };
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    let policy = Policy {
        target: args.instances.max(1),
        oldest_victim: args.oldest_victim,
    };
    eprintln!(
        "chaos: {} instances on {listen}, an action every ~{:?} for {:?} (seed {seed}) …",
        policy.target, args.interval, args.duration
    );

    let t0 = Instant::now();
    let mut fleet = Fleet::new(launcher, options, t0);
    for _ in 0..policy.target {
        fleet.start_ready().await?;
    }
    let load_start_s = t0.elapsed().as_secs_f64();
    let load = Load::start(listen, t0, args.load);
    let gap = |rng: &mut StdRng| args.interval.mul_f64(rng.gen_range(0.5..1.5));
    let end = Instant::now() + args.duration;
    let mut next_action = Instant::now() + gap(&mut rng);
    let mut next_sample = Instant::now();
    let mut actions = Vec::new();
    let mut skipped = 0u32;
    while Instant::now() < end {
        fleet.poll().await;
        if Instant::now() >= next_sample {
            fleet.sample().await;
            next_sample = (next_sample + args.sample_interval).max(Instant::now());
        }
        if Instant::now() >= next_action {
            match act(&mut fleet, &policy, &mut rng, t0).await? {
                Some(action) => actions.push(action),
                None => skipped += 1,
            }
            next_action = Instant::now() + gap(&mut rng);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let chaos_end_s = t0.elapsed().as_secs_f64();
    eprintln!("chaos: {} actions done; stopping the load …", actions.len());
    let recorded = load.stop().await;

    // Let the drains finish, then read the survivors once more with no load at all.
    let settle = Instant::now() + args.drain_timeout * 2;
    while Instant::now() < settle {
        fleet.poll().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let quiescent = fleet.snapshot().await;
    let (lives, kills, drains, anomalies) = fleet.finish().await;
    let stale_socket_files = std::fs::read_dir(handoff_dir.path()).map_or(0, |dir| dir.count());

    let rules = Rules {
        kills,
        drains,
        window_s: args.kill_window.as_secs_f64(),
    };
    let report = ChaosReport::build(Raw {
        parameters: args.parameters(seed),
        proxy_bin,
        listen,
        load_start_s,
        chaos_end_s,
        actions,
        skipped,
        recorded,
        rules,
        lives,
        anomalies,
        quiescent,
        stale_socket_files,
        min_lifetime_s: args.min_lifetime.as_secs_f64(),
        bucket_s: args.bucket.as_secs_f64(),
    });
    write(&report, &out)?;
    Ok(report)
}

/// Prints the report's tables and writes `out/chaos.json` and `out/chaos.svg`.
fn write(report: &ChaosReport, out: &Path) -> Result<()> {
    report.print();
    let json = out.join("chaos.json");
    crate::report::write_json(&json, report)?;
    let svg = out.join("chaos.svg");
    chart::timeline(&svg, report)?;
    println!("   wrote {} and {}", json.display(), svg.display());
    Ok(())
}

/// Takes the action `policy` chooses now, if any: the action, or `None` when it skips.
async fn act(
    fleet: &mut Fleet<'_>,
    policy: &Policy,
    rng: &mut StdRng,
    t0: Instant,
) -> Result<Option<Action>> {
    let phases = fleet.phases();
    let live_before = phases
        .iter()
        .filter(|&&p| p != policy::Phase::Draining)
        .count();
    let serving_before = phases
        .iter()
        .filter(|&&p| p == policy::Phase::Serving)
        .count();
    let at_s = t0.elapsed().as_secs_f64();
    let (kind, instance) = match policy.choose(&phases, rng) {
        None => return Ok(None),
        Some((ActionKind::Start, _)) => (ActionKind::Start, fleet.start()?),
        Some((kind, victim)) => {
            let name = fleet.name(victim).to_owned();
            if kind == ActionKind::Sigterm {
                fleet.sigterm(victim)?;
            } else {
                fleet.sigkill(victim).await?;
            }
            (kind, name)
        }
    };
    Ok(Some(Action {
        at_s,
        kind,
        instance,
        live_before,
        serving_before,
    }))
}
