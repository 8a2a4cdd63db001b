//! `threads`: `rr` once per worker-thread count, with the proxy's `--worker-threads` and
//! HAProxy's `nbthread` set alike, to show how each data path behaves as threads are added —
//! also past the number of cores, where threads that share locks or written cache lines lose
//! most. Each count's `rr` report goes to `OUT/threads-N/`; a summary table goes to stdout and
//! `OUT/threads.json`.

use anyhow::{Context, Result};
use serde::Serialize;

use crate::options::{ThreadsArgs, Timing};
use crate::report::{self, Unit};
use crate::target::{Env, Target};

/// The medians of one thread count.
#[derive(Debug, Clone, Serialize)]
struct Row {
    threads: usize,
    haproxy_requests_per_s: Option<f64>,
    proxy_requests_per_s: Option<f64>,
    proxy_vs_haproxy: Option<f64>,
    haproxy_p99_us: Option<f64>,
    proxy_p99_us: Option<f64>,
    haproxy_cpu_s: Option<f64>,
    proxy_cpu_s: Option<f64>,
}

/// Runs `rr` for every thread count and prints the summary.
pub async fn run(env: &mut Env, timing: &Timing, args: &ThreadsArgs) -> Result<()> {
    let base_out = env.out.clone();
    let base_args = env
        .proxy
        .as_ref()
        .map(|p| p.extra_args().to_vec())
        .unwrap_or_default();
    let mut rows = Vec::new();
    for &n in &args.threads {
        let n = n.max(1);
        env.out = base_out.join(format!("threads-{n}"));
        std::fs::create_dir_all(&env.out)
            .with_context(|| format!("cannot create {}", env.out.display()))?;
        env.nbthread = n;
        if let Some(proxy) = env.proxy.as_mut() {
            let mut extra = base_args.clone();
            extra.push(format!("--worker-threads={n}"));
            proxy.set_extra_args(extra);
        }
        eprintln!("threads: {n} worker thread(s)");
        let report = super::drive(env, timing, &args.rr).await?;
        let median = |key: &str, target: Target| {
            report
                .summary
                .iter()
                .find(|m| m.spec.key == key)
                .and_then(|m| m.targets.get(&target))
                .map(|f| f.summary.median)
        };
        let (h, p) = (
            median("requests_per_s", Target::Haproxy),
            median("requests_per_s", Target::Proxy),
        );
        rows.push(Row {
            threads: n,
            haproxy_requests_per_s: h,
            proxy_requests_per_s: p,
            proxy_vs_haproxy: h.zip(p).map(|(h, p)| p / h),
            haproxy_p99_us: median("p99_us", Target::Haproxy),
            proxy_p99_us: median("p99_us", Target::Proxy),
            haproxy_cpu_s: median("target_cpu_s", Target::Haproxy),
            proxy_cpu_s: median("target_cpu_s", Target::Proxy),
        });
    }
    env.out = base_out;
    print(&rows);
    let json = env.out.join("threads.json");
    report::write_json(
        &json,
        &serde_json::json!({
            "scenario": "threads",
            "rr": args.rr,
            "rounds": timing.rounds,
            "duration_s": timing.duration.as_secs_f64(),
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            "rows": rows,
        }),
    )?;
    println!("   wrote {}", json.display());
    Ok(())
}

fn print(rows: &[Row]) {
    let show = |v: Option<f64>, unit: Unit| v.map_or("–".into(), |v| unit.format(v));
    let mut table = vec![vec![
        "threads".into(),
        "haproxy req/s".into(),
        "proxy req/s".into(),
        "proxy ÷ haproxy".into(),
        "haproxy p99".into(),
        "proxy p99".into(),
        "haproxy CPU".into(),
        "proxy CPU".into(),
    ]];
    for r in rows {
        table.push(vec![
            r.threads.to_string(),
            show(r.haproxy_requests_per_s, Unit::PerSec),
            show(r.proxy_requests_per_s, Unit::PerSec),
            r.proxy_vs_haproxy.map_or("–".into(), |v| format!("{v:.2}")),
            show(r.haproxy_p99_us, Unit::Micros),
            show(r.proxy_p99_us, Unit::Micros),
            show(r.haproxy_cpu_s, Unit::CpuSeconds),
            show(r.proxy_cpu_s, Unit::CpuSeconds),
        ]);
    }
    println!("\nthreads: rr medians per worker-thread count");
    report::print_rows(&table);
}
