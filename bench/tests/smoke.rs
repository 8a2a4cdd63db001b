//! Smoke test: every scenario runs once at tiny size through the real `bench` binary, so the
//! harness cannot rot; `rr` and `churn` also run over TLS. Figures are not asserted (timing
//! belongs in benchmarks; a TLS run must merely answer requests), with three exceptions: the
//! rollout run must lose no connection through the proxy, the chaos soak (a few seconds of
//! it) must see no failure that a SIGKILL does not explain, and every client of the storm must
//! be back after the backend's restart (in one process per role, and spread over two). The
//! `uring` target (the io_uring forwarder) also runs `rr` and `throughput` without a failure,
//! and must carry bytes exactly and forward half-closes; where io_uring is unavailable those
//! tests skip loudly, and fail in CI.
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

/// [`bench`] at tiny size: `args`, then [`TINY`].
fn bench_tiny(name: &str, args: &[&str], file: &str) -> Value {
    bench(name, &[args, &TINY].concat(), file)
}

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
    assert_ran(&bench_tiny(
        "throughput",
        &["throughput", "--connections", "2"],
        "throughput.json",
    ));
}

#[test]
fn rr() {
    assert_ran(&bench_tiny("rr", &["rr", "--connections", "4"], "rr.json"));
}

#[test]
fn churn() {
    assert_ran(&bench_tiny(
        "churn",
        &["churn", "--clients", "2"],
        "churn.json",
    ));
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
    assert_tls(
        &bench_tiny(
            "rr-tls",
            &["rr", "--tls", "--connections", "4"],
            "rr-tls.json",
        ),
        "requests_per_s",
    );
}

#[test]
fn churn_tls() {
    assert_tls(
        &bench_tiny(
            "churn-tls",
            &["churn", "--tls", "--clients", "2"],
            "churn-tls.json",
        ),
        "connections_per_s",
    );
}

#[test]
fn idle() {
    let report = bench_tiny("idle", &["idle", "--connections", "50"], "idle.json");
    assert_ran(&report);
    for run in report["runs"].as_array().expect("runs") {
        if run["target"] != "direct" {
            assert!(
                run["metrics"]["idle_cpu_seconds"].as_f64() >= Some(0.0),
                "no CPU while idle measured: {run:#}"
            );
        }
    }
}

/// `rr` per worker-thread count: one report per count, and the summary row of each.
#[test]
fn threads() {
    let summary = bench_tiny(
        "threads",
        &["threads", "--threads", "1,2", "--connections", "4"],
        "threads.json",
    );
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
    let report = bench_tiny(
        "storm",
        &["storm", "--connections", "50", "--downtime", "100ms"],
        "storm.json",
    );
    assert_ran(&report);
    assert_all_back(&report);
}

/// Every storm client is back after the restart, and the reconnection was measured.
fn assert_all_back(report: &Value) {
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
    let report = bench_tiny(
        "storm-spread",
        &[
            "storm",
            "--connections",
            "60",
            "--processes",
            "2",
            "--downtime",
            "100ms",
        ],
        "storm.json",
    );
    assert_ran(&report);
    assert_eq!(report["parameters"]["processes"].as_u64(), Some(2));
    assert_all_back(&report);
    for run in report["runs"].as_array().expect("runs") {
        if run["target"] != "direct" {
            assert!(
                run["metrics"]["rss_before_bytes"].as_f64() > Some(0.0),
                "no target memory: {run:#}"
            );
            assert!(
                run["metrics"]["idle_cpu_s"].as_f64() >= Some(0.0),
                "no CPU while all idle measured: {run:#}"
            );
        }
    }
}

/// The small load of the rollout and chaos runs: clients, their rate, streams, and the
/// instances' drain timeout.
const LOAD: [&str; 8] = [
    "--clients",
    "2",
    "--rate",
    "200",
    "--streams",
    "2",
    "--drain-timeout",
    "300ms",
];

#[test]
fn rollout() {
    let args = [
        &["rollout", "--handoffs", "2", "--interval", "200ms"][..],
        &LOAD,
    ]
    .concat();
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
        &["chaos", "--duration", "4s", "--interval", "300ms"][..],
        &LOAD,
        &["--sample-interval", "200ms", "--min-lifetime", "2s"],
    ]
    .concat();
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

/// Whether this run is CI (`CI` set to anything but empty, `false` or `0`).
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Whether the `uring` target can run here. Where io_uring is unavailable (no kernel support,
/// or disabled: `ENOSYS`, `EPERM`) the test skips loudly by hand and fails in CI.
fn uring_available(test: &str) -> bool {
    match kube_apiserver_proxy_bench::uring::probe() {
        Ok(()) => true,
        Err(err) if matches!(err.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => {
            assert!(
                !in_ci(),
                "{test}: io_uring is unavailable ({err}) and CI is set: failing instead of skipping"
            );
            eprintln!("SKIPPED {test}: io_uring is unavailable here ({err})");
            false
        }
        Err(err) => panic!("{test}: io_uring setup failed: {err}"),
    }
}

/// `rr` and `throughput` through the `uring` target: every request answered, no failure.
#[test]
fn uring_rr_and_throughput() {
    if !uring_available("uring_rr_and_throughput") {
        return;
    }
    let rr = bench_tiny(
        "uring-rr",
        &["rr", "--targets", "direct,uring", "--connections", "4"],
        "rr.json",
    );
    assert_ran(&rr);
    let throughput = bench_tiny(
        "uring-throughput",
        &["throughput", "--targets", "uring", "--connections", "2"],
        "throughput.json",
    );
    assert_ran(&throughput);
    for (report, headline) in [(&rr, "requests_per_s"), (&throughput, "bytes_per_s")] {
        for run in report["runs"].as_array().expect("runs") {
            assert!(
                run["metrics"][headline].as_f64() > Some(0.0),
                "nothing forwarded: {run:#}"
            );
            assert_eq!(run["metrics"]["failed"].as_f64(), Some(0.0), "{run:#}");
        }
    }
}

/// The io_uring forwarder carries every byte exactly, both ways and on several connections at
/// once, and forwards each half-close: the backend echoes until it sees the client's end of
/// stream, then closes its side, and the client reads everything and then the end of stream.
/// Once with the default buffer pool, once with one buffer per thread, so that directions wait
/// for a buffer (`ENOBUFS`) all the time.
#[test]
fn uring_forwards_bytes_exactly_and_half_closes() {
    if !uring_available("uring_forwards_bytes_exactly_and_half_closes") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    forward_exactly(&[]);
    forward_exactly(&["--buffers", "1"]);
}

/// [`uring_forwards_bytes_exactly_and_half_closes`] with `extra` flags for `serve-uring`.
fn forward_exactly(extra: &[&str]) {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    let ip = kube_apiserver_proxy_tests::util::random_loopback_ip().unwrap();
    let backend = TcpListener::bind((ip, 0)).expect("bind the echo backend");
    let backend_addr = backend.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in backend.incoming() {
            let mut stream = stream.expect("accept");
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match stream.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => stream.write_all(&buf[..n]).expect("echo"),
                        Err(err) => panic!("backend read: {err}"),
                    }
                }
                // The client's end of stream arrived: end ours.
                stream.shutdown(Shutdown::Write).expect("backend shutdown");
            });
        }
    });

    let listen = kube_apiserver_proxy_tests::util::free_random_loopback_addr().unwrap();
    let ready = kube_apiserver_proxy_tests::util::free_random_loopback_addr().unwrap();
    struct Child(std::process::Child);
    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Child(
        Command::new(env!("CARGO_BIN_EXE_bench"))
            .arg("serve-uring")
            .arg(format!("--listen={listen}"))
            .arg(format!("--backend={backend_addr}"))
            .args(["--threads", "2"])
            .arg(format!("--ready-listen={ready}"))
            .args(extra)
            .spawn()
            .expect("start serve-uring"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(ready).is_err() {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("serve-uring exited with {status} before it was ready");
        }
        assert!(Instant::now() < deadline, "serve-uring not ready in 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }

    // Eight connections at once, each with its own pattern, larger than the forwarder's
    // buffers and than the sockets' buffers, so that sends are partial and flow control acts.
    let clients: Vec<_> = (0..8u8)
        .map(|i| {
            let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
            std::thread::spawn(move || {
                let sent: Vec<u8> = (0..3 * 1024 * 1024 + 123)
                    .map(|n: usize| (n as u8).wrapping_mul(31).wrapping_add(i))
                    .collect();
                let stream = TcpStream::connect(listen).expect("connect through uring");
                stream
                    .set_read_timeout(Some(Duration::from_secs(20)))
                    .unwrap();
                let mut writer = stream.try_clone().unwrap();
                let data = sent.clone();
                let write = std::thread::spawn(move || {
                    writer.write_all(&data).expect("write");
                    writer.shutdown(Shutdown::Write).expect("client shutdown");
                });
                let mut received = Vec::new();
                (&stream)
                    .read_to_end(&mut received)
                    .expect("read until the forwarded end of stream");
                write.join().unwrap();
                assert_eq!(
                    received.len(),
                    sent.len(),
                    "{extra:?} connection {i}: byte count"
                );
                assert!(received == sent, "{extra:?} connection {i}: bytes differ");
            })
        })
        .collect();
    for client in clients {
        client.join().expect("client");
    }
    assert!(child.0.try_wait().unwrap().is_none(), "serve-uring exited");
}
