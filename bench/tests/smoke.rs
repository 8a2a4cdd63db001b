//! Smoke test: every scenario runs once at tiny size through the real `bench` binary, so the
//! harness cannot rot; `rr` and `churn` also run over TLS. Figures are not asserted (timing
//! belongs in benchmarks; a TLS run must merely answer requests), with three exceptions: the
//! rollout run must lose no connection through the proxy, the chaos soak (a few seconds of
//! it) must see no failure that a SIGKILL does not explain, and every client of the storm must
//! be back after the backend's restart (in one process per role, and spread over two).
//!
//! The proxy binary is found (and built with cargo if needed) by the harness itself, next to
//! the `bench` binary. HAProxy takes part when installed. No fixed ports: every listener is on
//! a random 127.x.y.z address with a kernel-chosen port.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

/// The scenarios share two cores: run them one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A fresh output directory under the target dir.
fn out_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("bench-smoke-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Runs `bench <args> --out <dir>` and returns the JSON it wrote to `<dir>/<file>`.
fn bench(name: &str, args: &[&str], file: &str) -> Value {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let out = out_dir(name);
    let output = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(args)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run bench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "bench {args:?} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let text = std::fs::read_to_string(out.join(file))
        .unwrap_or_else(|e| panic!("no {file}: {e}\nstdout:\n{stdout}\nstderr:\n{stderr}"));
    serde_json::from_str(&text).expect("valid JSON")
}

const TINY: [&str; 6] = ["--rounds", "1", "--duration", "200ms", "--warmup", "50ms"];

/// Every asked-for target either ran without error or was skipped with a reason.
fn assert_ran(report: &Value) {
    let errors = report["errors"].as_array().expect("errors");
    assert!(errors.is_empty(), "runs failed: {errors:#?}");
    let runs = report["runs"].as_array().expect("runs");
    let targets = report["targets"].as_array().expect("targets");
    assert_eq!(runs.len(), targets.len(), "one run per target");
}

#[test]
fn throughput() {
    let args = [&["throughput", "--connections", "2"][..], &TINY].concat();
    assert_ran(&bench("throughput", &args, "throughput.json"));
}

#[test]
fn rr() {
    let args = [&["rr", "--connections", "4"][..], &TINY].concat();
    assert_ran(&bench("rr", &args, "rr.json"));
}

#[test]
fn churn() {
    let args = [&["churn", "--clients", "2"][..], &TINY].concat();
    assert_ran(&bench("churn", &args, "churn.json"));
}

/// The `proxy-sockmap` target runs the proxy with the kernel data path, and fails rather than
/// measure the user-space fallback: loading the BPF program needs root here. Every run moved
/// bytes (requests answered, bytes echoed).
#[test]
fn kernel_path_target() {
    if !nix::unistd::Uid::effective().is_root() {
        assert!(
            std::env::var_os("CI").is_none(),
            "kernel_path_target needs root (CAP_BPF, CAP_NET_ADMIN) and CI is set"
        );
        eprintln!("SKIPPED kernel_path_target: needs root (CAP_BPF, CAP_NET_ADMIN)");
        return;
    }
    for (scenario, extra, figure) in [
        ("rr", ["--connections", "4"], "requests_per_s"),
        ("throughput", ["--connections", "2"], "bytes_per_s"),
    ] {
        let args = [
            &[scenario][..],
            &extra,
            &["--targets", "proxy-sockmap"],
            &TINY,
        ]
        .concat();
        let report = bench(
            &format!("kernel-{scenario}"),
            &args,
            &format!("{scenario}.json"),
        );
        assert_ran(&report);
        for run in report["runs"].as_array().expect("runs") {
            assert_eq!(run["target"], "proxy-sockmap");
            let value = run["metrics"][figure].as_f64().unwrap_or(0.0);
            assert!(
                value > 0.0,
                "{scenario}: no {figure} through the kernel path: {run:#}"
            );
        }
    }
}

/// A TLS run did real work: every run answered at least one request (a broken handshake
/// would fail every request without failing the run). Not a timing figure.
fn assert_tls(report: &Value, headline: &str) {
    assert_ran(report);
    assert_eq!(report["parameters"]["tls"], true, "not a TLS run");
    for run in report["runs"].as_array().expect("runs") {
        let answered = run["metrics"][headline].as_f64().unwrap_or(0.0);
        assert!(answered > 0.0, "no TLS request answered: {run:#}");
    }
}

#[test]
fn rr_tls() {
    let args = [&["rr", "--tls", "--connections", "4"][..], &TINY].concat();
    assert_tls(&bench("rr-tls", &args, "rr-tls.json"), "requests_per_s");
}

#[test]
fn churn_tls() {
    let args = [&["churn", "--tls", "--clients", "2"][..], &TINY].concat();
    assert_tls(
        &bench("churn-tls", &args, "churn-tls.json"),
        "connections_per_s",
    );
}

#[test]
fn idle() {
    let args = [&["idle", "--connections", "50"][..], &TINY].concat();
    assert_ran(&bench("idle", &args, "idle.json"));
}

/// `rr` per worker-thread count: one report per count, and the summary row of each.
#[test]
fn threads() {
    let args = [
        &["threads", "--threads", "1,2", "--connections", "4"][..],
        &TINY,
    ]
    .concat();
    let summary = bench("threads", &args, "threads.json");
    let rows = summary["rows"].as_array().expect("rows");
    let counts: Vec<u64> = rows.iter().filter_map(|r| r["threads"].as_u64()).collect();
    assert_eq!(counts, [1, 2]);
    for row in rows {
        assert!(
            row["proxy_requests_per_s"].as_f64() > Some(0.0),
            "no request answered through the proxy: {row:#}"
        );
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-smoke-threads");
    for n in [1, 2] {
        let text = std::fs::read_to_string(out.join(format!("threads-{n}/rr.json")))
            .unwrap_or_else(|e| panic!("no rr report for {n} threads: {e}"));
        let report: Value = serde_json::from_str(&text).expect("valid JSON");
        assert_ran(&report);
    }
}

/// The reconnection storm: every client of every target is back after the backend restart
/// (not a timing figure: a client not back within the scenario's deadline is lost).
#[test]
fn storm() {
    let args = [
        &["storm", "--connections", "50", "--downtime", "100ms"][..],
        &TINY,
    ]
    .concat();
    let report = bench("storm", &args, "storm.json");
    assert_ran(&report);
    for run in report["runs"].as_array().expect("runs") {
        assert_eq!(
            run["metrics"]["lost"].as_f64(),
            Some(0.0),
            "clients not back: {run:#}"
        );
        assert!(
            run["metrics"]["all_back_us"].as_f64() > Some(0.0),
            "no reconnect measured: {run:#}"
        );
    }
}

/// The storm spread over two processes per role (as N beyond one process's descriptor limit
/// needs): two target processes sharing the listen address, two backends sharing theirs, two
/// client processes reporting to the harness; every client is back.
#[test]
fn storm_spread() {
    let args = [
        &[
            "storm",
            "--connections",
            "60",
            "--processes",
            "2",
            "--downtime",
            "100ms",
        ][..],
        &TINY,
    ]
    .concat();
    let report = bench("storm-spread", &args, "storm.json");
    assert_ran(&report);
    assert_eq!(report["parameters"]["processes"].as_u64(), Some(2));
    for run in report["runs"].as_array().expect("runs") {
        assert_eq!(
            run["metrics"]["lost"].as_f64(),
            Some(0.0),
            "clients not back: {run:#}"
        );
        assert!(
            run["metrics"]["all_back_us"].as_f64() > Some(0.0),
            "no reconnect measured: {run:#}"
        );
        if run["target"] != "direct" {
            assert!(
                run["metrics"]["rss_before_bytes"].as_f64() > Some(0.0),
                "no target memory: {run:#}"
            );
        }
    }
}

#[test]
fn rollout() {
    let args = [
        "rollout",
        "--handoffs",
        "2",
        "--interval",
        "200ms",
        "--clients",
        "2",
        "--rate",
        "200",
        "--streams",
        "2",
        "--drain-timeout",
        "300ms",
    ];
    let report = bench("rollout", &args, "rollout.json");
    let variants = report["variants"].as_array().expect("variants");
    let proxy = variants
        .iter()
        .find(|v| v["variant"] == "proxy")
        .expect("proxy variant ran");
    assert!(
        proxy["error"].is_null(),
        "proxy rollout: {}",
        proxy["error"]
    );
    assert_eq!(proxy["handoffs"].as_array().map(Vec::len), Some(2));
    assert!(
        proxy["requests"].as_u64() > Some(0),
        "no load was generated"
    );

    // THE ONE FIGURE ASSERTED: zero failed connections (refused, reset, timeout, closed) for
    // the proxy across its rollout. This depends on the listener handoff (`--handoff-dir`).
    assert_eq!(
        proxy["failed"].as_u64(),
        Some(0),
        "proxy lost connections during the rollout: requests {} streams {} failures {}",
        proxy["requests_failed"],
        proxy["streams"]["failed"],
        proxy["failures"]
    );
}

#[test]
fn chaos() {
    let args = [
        "chaos",
        "--duration",
        "4s",
        "--interval",
        "300ms",
        "--clients",
        "2",
        "--rate",
        "200",
        "--streams",
        "2",
        "--drain-timeout",
        "300ms",
        "--sample-interval",
        "200ms",
        "--min-lifetime",
        "2s",
    ];
    let report = bench("chaos", &args, "chaos.json");
    let actions = report["actions"].as_array().expect("actions");
    assert!(!actions.is_empty(), "no action was taken");
    let connections = &report["connections"];
    assert!(
        connections["attempted"].as_u64() > Some(0),
        "no load was generated"
    );
    let instances = report["instances"].as_array().expect("instances");
    // Every instance that lived through several sampling intervals of the chaos was sampled
    // (one killed within 200 ms of its start, or started just before the end, may not be).
    let chaos_end = report["chaos_end_s"].as_f64().expect("chaos_end_s");
    let unsampled: Vec<&Value> = instances
        .iter()
        .filter(|i| {
            let end = i["end_s"].as_f64().unwrap_or(0.0).min(chaos_end);
            let life = end - i["started_s"].as_f64().unwrap_or(0.0);
            life > 1.0 && i["samples"].as_array().is_none_or(Vec::is_empty)
        })
        .collect();
    assert!(unsampled.is_empty(), "never sampled: {unsampled:#?}");

    // THE FIGURE ASSERTED: every failure is a connection in flight in a SIGKILLed instance.
    let unexplained: Vec<&Value> = report["failures"]
        .as_array()
        .expect("failures")
        .iter()
        .filter(|f| f["verdict"] == "unexplained")
        .collect();
    assert!(
        unexplained.is_empty(),
        "failures not explained by a SIGKILL: {unexplained:#?}\nactions: {actions:#?}"
    );
    let anomalies = report["anomalies"].as_array().expect("anomalies");
    assert!(anomalies.is_empty(), "instances misbehaved: {anomalies:#?}");
}
