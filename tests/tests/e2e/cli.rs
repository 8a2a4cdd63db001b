//! Command line: bad input exits 2 with one line naming the flag and binds nothing; `--help`;
//! configuration from environment variables; `run` is the default subcommand.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::proxy::{run_cli, ProxyBuilder};
use kube_apiserver_proxy_tests::util::{connection_refused, TempDir};

use crate::{connect_echo, echo_backend, listen_addr};

/// A builder that is valid except for what the test adds: listen address, a live echo
/// backend, tcp checks. Returns it with its listen address.
async fn valid_base() -> Result<(
    ProxyBuilder,
    SocketAddr,
    kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver,
)> {
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    Ok((ProxyBuilder::new().listen(listen), listen, backend))
}

/// Runs `builder`; expects exit code 2, exactly one non-empty stderr line containing `flag`,
/// no admin server bound and nothing accepting on `listen`.
async fn expect_bad_input(builder: ProxyBuilder, listen: SocketAddr, flag: &str) -> Result<()> {
    let proxy = builder.spawn_raw()?;
    let status = proxy.wait_exit(Duration::from_secs(5)).await?;
    let stderr = proxy.stderr();
    ensure!(
        status.code() == Some(2),
        "expected exit code 2, got {status}; stderr:\n{stderr}"
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    ensure!(
        lines.len() == 1,
        "expected ONE stderr line, got {}:\n{stderr}",
        lines.len()
    );
    ensure!(
        lines[0].contains(flag),
        "stderr line does not name {flag}: {}",
        lines[0]
    );
    ensure!(
        !proxy.admin_file_written(),
        "the admin server was bound (admin address file written) despite bad input"
    );
    ensure!(
        connection_refused(listen).await,
        "{listen} accepts connections"
    );
    Ok(())
}

/// A valid tcp-checked instance with one live backend, plus `args`: expects bad input naming
/// `flag` (see [`expect_bad_input`]).
async fn expect_bad_args<S: AsRef<std::ffi::OsStr>>(args: &[S], flag: &str) -> Result<()> {
    let (builder, listen, backend) = valid_base().await?;
    let builder = builder
        .backend(backend.addr())
        .health_check("tcp")
        .args(args);
    expect_bad_input(builder, listen, flag).await
}

/// A valid instance with https checks against the CA file `ca`, configured further by `more`:
/// expects bad input naming `flag` (see [`expect_bad_input`]).
async fn expect_bad_https(
    ca: &Path,
    more: impl FnOnce(ProxyBuilder) -> ProxyBuilder,
    flag: &str,
) -> Result<()> {
    let (builder, listen, backend) = valid_base().await?;
    let builder = builder
        .backend(backend.addr())
        .health_check("https")
        .ca_file(ca);
    expect_bad_input(more(builder), listen, flag).await
}

#[tokio::test]
async fn bad_input_unparsable_listen_address() -> Result<()> {
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let builder = ProxyBuilder::new()
        .arg("--listen")
        .arg(format!("{}:notaport", listen.ip()))
        .backend(backend.addr())
        .health_check("tcp");
    expect_bad_input(builder, listen, "--listen").await
}

#[tokio::test]
async fn bad_input_unparsable_backend_address() -> Result<()> {
    let (builder, listen, _backend) = valid_base().await?;
    let builder = builder
        .args(["--backend", "kubernetes"])
        .health_check("tcp");
    expect_bad_input(builder, listen, "--backend").await
}

#[tokio::test]
async fn bad_input_unparsable_duration() -> Result<()> {
    expect_bad_args(&["--health-interval", "soon"], "--health-interval").await
}

#[tokio::test]
async fn bad_input_unknown_health_check_kind() -> Result<()> {
    let (builder, listen, backend) = valid_base().await?;
    let builder = builder.backend(backend.addr()).health_check("udp");
    expect_bad_input(builder, listen, "--health-check").await
}

#[tokio::test]
async fn bad_input_https_check_without_ca_or_skip_verify() -> Result<()> {
    let (builder, listen, backend) = valid_base().await?;
    // https is the default check kind.
    let builder = builder.backend(backend.addr());
    let proxy = builder.spawn_raw()?;
    let status = proxy.wait_exit(Duration::from_secs(5)).await?;
    let stderr = proxy.stderr();
    ensure!(status.code() == Some(2), "exit {status}; stderr:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    ensure!(lines.len() == 1, "expected ONE stderr line:\n{stderr}");
    ensure!(
        lines[0].contains("--health-ca-file") || lines[0].contains("--health-insecure-skip-verify"),
        "line names neither --health-ca-file nor --health-insecure-skip-verify: {}",
        lines[0]
    );
    ensure!(!proxy.admin_file_written(), "admin server bound");
    ensure!(connection_refused(listen).await, "{listen} accepts");
    Ok(())
}

#[tokio::test]
async fn bad_input_missing_ca_file() -> Result<()> {
    let dir = TempDir::new("cli")?;
    expect_bad_https(&dir.join("missing-ca.crt"), |b| b, "--health-ca-file").await
}

#[tokio::test]
async fn bad_input_garbage_ca_file() -> Result<()> {
    let dir = TempDir::new("cli")?;
    let ca = dir.join("garbage-ca.crt");
    std::fs::write(&ca, "this is not a PEM certificate\n")?;
    expect_bad_https(&ca, |b| b, "--health-ca-file").await
}

#[tokio::test]
async fn bad_input_missing_client_key() -> Result<()> {
    let pki = Pki::new()?;
    let missing = pki.dir().join("missing.key");
    let pair = |b: ProxyBuilder| b.health_client_cert(pki.client_cert_file(), missing);
    expect_bad_https(&pki.ca_file(), pair, "--health-client-key").await
}

#[tokio::test]
async fn bad_input_missing_client_cert() -> Result<()> {
    let pki = Pki::new()?;
    let missing = pki.dir().join("missing.crt");
    let pair = |b: ProxyBuilder| b.health_client_cert(missing, pki.client_key_file());
    expect_bad_https(&pki.ca_file(), pair, "--health-client-cert").await
}

#[tokio::test]
async fn bad_input_duplicate_listen_address() -> Result<()> {
    let (builder, listen, backend) = valid_base().await?;
    let builder = builder
        .listen(listen)
        .backend(backend.addr())
        .health_check("tcp");
    expect_bad_input(builder, listen, "--listen").await
}

#[tokio::test]
async fn bad_input_no_backend() -> Result<()> {
    let (builder, listen, _backend) = valid_base().await?;
    expect_bad_input(builder.health_check("tcp"), listen, "--backend").await
}

#[tokio::test]
async fn bad_input_zero_rise() -> Result<()> {
    expect_bad_args(&["--health-rise", "0"], "--health-rise").await
}

#[tokio::test]
async fn bad_input_zero_fall() -> Result<()> {
    expect_bad_args(&["--health-fall", "0"], "--health-fall").await
}

#[tokio::test]
async fn bad_input_zero_max_connections() -> Result<()> {
    expect_bad_args(&["--max-connections", "0"], "--max-connections").await
}

#[tokio::test]
async fn bad_input_worker_slice_out_of_range() -> Result<()> {
    expect_bad_args(&["--worker-slice", "50us"], "--worker-slice").await?;
    expect_bad_args(&["--worker-slice", "1s"], "--worker-slice").await
}

/// The slices of a running instance's threads, by thread name (`se.slice` of
/// `/proc/PID/task/TID/sched`, nanoseconds); `None` when the kernel shows none.
fn thread_slices(pid: u32) -> Result<Option<Vec<(String, u64)>>> {
    let mut slices = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?.path();
        let name = std::fs::read_to_string(task.join("comm"))?
            .trim()
            .to_owned();
        let sched = std::fs::read_to_string(task.join("sched"))?;
        let Some(slice) = sched
            .lines()
            .find_map(|l| l.strip_prefix("se.slice"))
            .and_then(|rest| rest.trim_start_matches([' ', ':']).trim().parse().ok())
        else {
            return Ok(None);
        };
        slices.push((name, slice));
    }
    Ok(Some(slices))
}

/// `--worker-slice`: every worker thread runs with the slice asked for (the default, and one
/// given), the control thread with the kernel's own; `0` leaves the workers at the kernel's.
#[tokio::test]
async fn worker_threads_run_with_the_slice_asked_for() -> Result<()> {
    for (args, wanted) in [
        (&[][..], Some(100_000)),
        (&["--worker-slice", "250us"][..], Some(250_000)),
        (&["--worker-slice", "0"][..], None),
    ] {
        let (builder, _listen, backend) = valid_base().await?;
        let proxy = builder
            .backend(backend.addr())
            .health_check("tcp")
            .args(["--worker-threads", "2"])
            .args(args)
            .spawn()
            .await?;
        let Some(slices) = thread_slices(proxy.pid())? else {
            return kube_apiserver_proxy_tests::util::skip(
                "worker_threads_run_with_the_slice_asked_for",
                "this kernel shows no se.slice in /proc/PID/task/TID/sched",
            );
        };
        let main = slices
            .iter()
            .find(|(name, _)| !name.starts_with("worker-"))
            .map(|(_, slice)| *slice);
        let workers: Vec<u64> = slices
            .iter()
            .filter(|(name, _)| name.starts_with("worker-"))
            .map(|(_, slice)| *slice)
            .collect();
        ensure!(workers.len() == 2, "{args:?}: threads {slices:?}");
        let expected = wanted.or(main).expect("a control thread");
        ensure!(
            workers.iter().all(|&s| s == expected),
            "{args:?}: worker slices {workers:?}, expected {expected} (control thread {main:?})"
        );
        ensure!(
            main != Some(expected) || wanted.is_none(),
            "{args:?}: the control thread has the workers' slice too: {slices:?}"
        );
    }
    Ok(())
}

/// With `--client-address transparent`, a `--backend` in 127.0.0.0/24: its policy routing
/// leaves that range to the host, so no client's address could be kept there (each client off
/// the node would wait out the connect timeout, then be connected normally).
#[tokio::test]
async fn bad_input_transparent_backend_in_the_hosts_range() -> Result<()> {
    expect_bad_args(
        &[
            "--backend",
            "127.0.0.77:6443",
            "--client-address",
            "transparent",
        ],
        "--backend: 127.0.0.77:6443 is in 127.0.0.0/24",
    )
    .await
}

#[tokio::test]
async fn help_explains_every_flag() -> Result<()> {
    let output = run_cli(["run", "--help"]).await?;
    let text = String::from_utf8_lossy(&output.stdout);
    ensure!(output.status.success(), "run --help: {}", output.status);
    for flag in [
        "--listen",
        "--backend",
        "--admin-listen",
        "--admin-address-file",
        "--health-check",
        "--health-path",
        "--health-interval",
        "--health-timeout",
        "--health-rise",
        "--health-fall",
        "--health-ca-file",
        "--health-server-name",
        "--health-insecure-skip-verify",
        "--health-client-cert",
        "--health-client-key",
        "--connect-timeout",
        "--drain-timeout",
        "--drain-close-window",
        "--max-connections",
        "--log-format",
        "--log-level",
    ] {
        ensure!(
            text.contains(flag),
            "run --help does not mention {flag}:\n{text}"
        );
    }
    ensure!(
        text.contains("KUBE_APISERVER_PROXY_LISTEN"),
        "run --help does not name the env vars:\n{text}"
    );
    Ok(())
}

#[tokio::test]
async fn flags_from_environment_variables() -> Result<()> {
    let first = echo_backend().await?;
    let second = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = ProxyBuilder::new()
        .env("KUBE_APISERVER_PROXY_LISTEN", listen.to_string())
        .env(
            "KUBE_APISERVER_PROXY_BACKEND",
            format!("{},{}", first.addr(), second.addr()),
        )
        .env("KUBE_APISERVER_PROXY_HEALTH_CHECK", "tcp")
        .env("KUBE_APISERVER_PROXY_HEALTH_INTERVAL", "100ms")
        .env("KUBE_APISERVER_PROXY_HEALTH_RISE", "1")
        .spawn()
        .await?;
    proxy.wait_state("Serving").await?;
    let status = proxy.status().await?;
    let backends = status["backends"].as_array().cloned().unwrap_or_default();
    ensure!(
        backends.len() == 2,
        "expected 2 backends from env: {status}"
    );
    let mut client = connect_echo(listen).await?;
    client.round_trip(b"configured by env").await?;
    Ok(())
}

#[tokio::test]
async fn run_is_the_default_subcommand() -> Result<()> {
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = ProxyBuilder::tcp(listen, backend.addr())
        .without_subcommand()
        .spawn()
        .await?;
    proxy.wait_state("Serving").await?;
    connect_echo(listen).await?;
    Ok(())
}

/// A valid instance given `dir` as its handoff directory: expects bad input naming
/// `--handoff-dir`.
async fn expect_bad_handoff_dir(dir: &Path) -> Result<()> {
    expect_bad_args(
        &["--handoff-dir".as_ref(), dir.as_os_str()],
        "--handoff-dir",
    )
    .await
}

/// A handoff directory others could write to (replace our socket, plant an impostor) is bad
/// input: refused before anything is bound.
#[tokio::test]
async fn bad_input_world_writable_handoff_dir() -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = TempDir::new("cli-handoff")?;
    let handoff = dir.join("handoff");
    std::fs::create_dir(&handoff)?;
    std::fs::set_permissions(&handoff, std::fs::Permissions::from_mode(0o777))?;
    expect_bad_handoff_dir(&handoff).await?;
    ensure!(
        std::fs::read_dir(&handoff)?.next().is_none(),
        "a socket was created in the refused directory"
    );
    Ok(())
}

/// A symbolic link as handoff directory is refused too (it could point anywhere).
#[tokio::test]
async fn bad_input_symlinked_handoff_dir() -> Result<()> {
    let dir = TempDir::new("cli-handoff-link")?;
    let real = dir.join("real");
    std::fs::create_dir(&real)?;
    let link = dir.join("link");
    std::os::unix::fs::symlink(&real, &link)?;
    expect_bad_handoff_dir(&link).await
}

/// The README's flag table names exactly the flags `run --help` documents: the docs cannot
/// drift from the binary.
#[tokio::test]
async fn readme_flag_table_matches_run_help() -> Result<()> {
    use std::collections::BTreeSet;
    let flag_names = |text: &str, line_start: &str| -> BTreeSet<String> {
        text.lines()
            .filter_map(|l| l.trim_start().strip_prefix(line_start))
            .filter_map(|rest| {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '-')
                    .collect();
                (!name.is_empty()).then_some(name)
            })
            .collect()
    };
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))?;
    let mut documented = flag_names(&readme, "| `--");
    // Rows that name two flags: "| `--health-client-cert FILE` / `--health-client-key FILE` |".
    for line in readme.lines().filter(|l| l.starts_with("| `--")) {
        for part in line.split("` / `--").skip(1) {
            documented.insert(
                part.chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '-')
                    .collect(),
            );
        }
    }
    let help = kube_apiserver_proxy_tests::proxy::run_cli(["run", "--help"]).await?;
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let mut offered = flag_names(&help, "--");
    offered.remove("help");
    ensure!(
        documented == offered,
        "README flags differ from `run --help`:\n only in README: {:?}\n only in --help: {:?}",
        documented.difference(&offered).collect::<Vec<_>>(),
        offered.difference(&documented).collect::<Vec<_>>()
    );
    Ok(())
}
