//! A handle on the REAL `kube-apiserver-proxy` binary run as a child process.
//!
//! [`ProxyBuilder`] assembles `kube-apiserver-proxy run …`, always adding
//! `--admin-listen 127.0.0.1:0 --admin-address-file <tmp>` so the handle learns the admin
//! address; [`Proxy`] then talks to the admin endpoint (`/status`, `/metrics`), sends signals,
//! waits for the exit and keeps everything the process wrote to stderr. The captured stderr is
//! printed when the handle is dropped, so libtest shows it for failing tests only.
//!
//! The binary is found through env `KUBE_APISERVER_PROXY_BIN`, else next to the test
//! executable (`target/<profile>/kube-apiserver-proxy`), built once per test process with
//! `cargo build -p kube-apiserver-proxy --bin kube-apiserver-proxy` so it is never stale.

use std::ffi::{OsStr, OsString};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure, Context as _, Result};
use nix::sys::signal::Signal;

use crate::client::http_get;
use crate::process::ChildProcess;
use crate::util::{eventually, TempDir};

/// Env var naming the proxy binary explicitly (skips the build).
pub const BIN_ENV: &str = "KUBE_APISERVER_PROXY_BIN";

/// Prefix of every proxy metric name.
pub const METRIC_PREFIX: &str = "kube_apiserver_proxy_";

/// Default deadline of the waiting helpers (start-up, state changes).
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(10);

/// A `cargo` command (the one running the tests) for building from within a test.
///
/// Cargo gives the test process package variables (CARGO_MANIFEST_DIR, CARGO_PKG_*, …). Build
/// scripts such as ring's rerun when they change, so passing them on would make such a build
/// and every ordinary one rebuild ring and rustls in turn: they are removed.
pub fn cargo_command() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut command = Command::new(cargo);
    without_package_env(&mut command);
    command.current_dir(env!("CARGO_MANIFEST_DIR"));
    command
}

/// Removes from `command`'s environment the package variables cargo gives the test process
/// (see [`cargo_command`]).
fn without_package_env(command: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("CARGO_MANIFEST")
            || key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_BIN_")
            || key.starts_with("CARGO_CRATE_")
            || key.starts_with("CARGO_PRIMARY_")
            || key.starts_with("CARGO_TARGET_TMPDIR")
            || key == "OUT_DIR"
        {
            command.env_remove(key.as_ref());
        }
    }
}

/// The proxy binary: see the module docs.
pub fn proxy_bin() -> Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| locate_and_build().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

fn locate_and_build() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os(BIN_ENV) {
        let bin = PathBuf::from(bin);
        ensure!(bin.exists(), "{BIN_ENV}={} does not exist", bin.display());
        return Ok(bin);
    }
    let exe = std::env::current_exe().context("current_exe")?;
    let mut dir = exe.parent().context("test executable has no directory")?;
    if dir.ends_with("deps") {
        dir = dir.parent().context("deps has no parent")?;
    }
    build_proxy(dir, false)
}

/// Builds the proxy binary with `cargo build -p kube-apiserver-proxy` into `profile_dir` (a
/// target directory's `debug`, `release` or other profile's directory: the profile is its
/// name) and returns its path. `announce`: say so on stderr (a first build takes a while);
/// else cargo is quiet. The tests' binary and `bench`'s both come from here.
pub fn build_proxy(profile_dir: &Path, announce: bool) -> Result<PathBuf> {
    let bin = profile_dir.join("kube-apiserver-proxy");
    let profile = profile_dir
        .file_name()
        .and_then(OsStr::to_str)
        .context("profile directory name")?;
    let target_dir = profile_dir
        .parent()
        .context("profile directory has no parent")?;
    let mut build = cargo_command();
    build
        .args(["build", "-p", "kube-apiserver-proxy", "--bin"])
        .arg("kube-apiserver-proxy")
        .env("CARGO_TARGET_DIR", target_dir);
    if announce {
        eprintln!("building kube-apiserver-proxy ({profile}) …");
    } else {
        build.arg("--quiet");
    }
    match profile {
        "debug" => {}
        "release" => {
            build.arg("--release");
        }
        other => {
            build.args(["--profile", other]);
        }
    }
    let status = build.status().context("run cargo build")?;
    ensure!(
        status.success(),
        "cargo build of kube-apiserver-proxy failed: {status}"
    );
    ensure!(bin.exists(), "{} missing after cargo build", bin.display());
    Ok(bin)
}

/// Env var naming a build of the previous release explicitly (skips `tests/previous-release`).
pub const PREVIOUS_BIN_ENV: &str = "KAP_TEST_PREVIOUS_BIN";

/// The previous release's binary (a pinned commit of this repository), built once per clone by
/// `tests/previous-release` and cached under `target/previous/`; or the file env
/// [`PREVIOUS_BIN_ENV`] names. `Ok(None)` when this clone has no history to build it from
/// (the script exits 2: a shallow clone): the caller skips, which fails in CI
/// ([`crate::util::skip`]). A failed build is an error.
pub fn previous_release_bin() -> Result<Option<PathBuf>> {
    if let Some(bin) = std::env::var_os(PREVIOUS_BIN_ENV) {
        let bin = PathBuf::from(bin);
        ensure!(
            bin.exists(),
            "{PREVIOUS_BIN_ENV}={} does not exist",
            bin.display()
        );
        return Ok(Some(bin));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("previous-release");
    let mut command = Command::new(&script);
    // The script builds another workspace with its own target directory.
    without_package_env(&mut command);
    let output = command
        .env_remove("CARGO_TARGET_DIR")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("run {}", script.display()))?;
    match output.status.code() {
        Some(0) => {}
        Some(2) => return Ok(None),
        _ => anyhow::bail!(
            "{} failed ({}): the previous release did not build",
            script.display(),
            output.status
        ),
    }
    let stdout = String::from_utf8(output.stdout).context("script output")?;
    let bin = PathBuf::from(stdout.lines().next().context("no binary path printed")?);
    ensure!(bin.exists(), "{} missing after the build", bin.display());
    Ok(Some(bin))
}

/// Builds the command line of one proxy instance.
#[derive(Debug, Clone, Default)]
pub struct ProxyBuilder {
    bin: Option<PathBuf>,
    subcommand: Option<String>,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    admin_listen: Option<String>,
    default_admin_listen: bool,
    nofile: Option<(u64, u64)>,
    run_as: Option<u32>,
    switch_user: Option<u32>,
}

impl ProxyBuilder {
    /// `kube-apiserver-proxy run` with no flags yet.
    pub fn new() -> Self {
        Self {
            subcommand: Some("run".into()),
            ..Self::default()
        }
    }

    /// `run` on `listen` to `backend`, TCP-checked with [`Self::fast_health`]'s timings: the
    /// plain proxy most tests start from.
    pub fn tcp(listen: SocketAddr, backend: SocketAddr) -> Self {
        Self::new()
            .listen(listen)
            .backend(backend)
            .health_check("tcp")
            .fast_health()
    }

    /// Leaves out the `run` subcommand (it is the default).
    pub fn without_subcommand(mut self) -> Self {
        self.subcommand = None;
        self
    }

    /// `--listen ADDR`.
    pub fn listen(self, addr: SocketAddr) -> Self {
        self.arg("--listen").arg(addr.to_string())
    }

    /// `--backend ADDR`.
    pub fn backend(self, addr: SocketAddr) -> Self {
        self.arg("--backend").arg(addr.to_string())
    }

    /// `--health-check KIND` (`https`, `tls`, `tcp`).
    pub fn health_check(self, kind: &str) -> Self {
        self.arg("--health-check").arg(kind)
    }

    /// `--health-ca-file FILE`.
    pub fn ca_file(self, path: &Path) -> Self {
        self.arg("--health-ca-file").arg(path)
    }

    /// `--health-client-cert CERT --health-client-key KEY`.
    pub fn health_client_cert(self, cert: impl AsRef<OsStr>, key: impl AsRef<OsStr>) -> Self {
        self.arg("--health-client-cert")
            .arg(cert)
            .arg("--health-client-key")
            .arg(key)
    }

    /// Short health timings for tests: interval 100ms, timeout 500ms, rise 1, fall 2.
    pub fn fast_health(self) -> Self {
        self.health_timing(Duration::from_millis(100), 1, 2)
    }

    /// `--health-interval`, `--health-rise`, `--health-fall`, with `--health-timeout 500ms`
    /// (each flag may be given once: use this or [`Self::fast_health`], not both).
    pub fn health_timing(self, interval: Duration, rise: u32, fall: u32) -> Self {
        self.arg("--health-interval")
            .arg(format!("{}ms", interval.as_millis()))
            .args(["--health-timeout", "500ms", "--health-rise"])
            .arg(rise.to_string())
            .arg("--health-fall")
            .arg(fall.to_string())
    }

    /// `--drain-timeout DUR` in milliseconds.
    pub fn drain_timeout(self, timeout: Duration) -> Self {
        self.arg("--drain-timeout")
            .arg(format!("{}ms", timeout.as_millis()))
    }

    /// Overrides the admin address (default `127.0.0.1:0`).
    pub fn admin_listen(mut self, addr: impl Into<String>) -> Self {
        self.admin_listen = Some(addr.into());
        self
    }

    /// Leaves `--admin-listen` out (the binary's default applies); `--admin-address-file` is
    /// still given so the handle learns the address.
    pub fn default_admin_listen(mut self) -> Self {
        self.default_admin_listen = true;
        self
    }

    /// One more argument.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// More arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Runs the child with `RLIMIT_NOFILE` set to `limit` (through `prlimit`, which execs it:
    /// the pid is the proxy's).
    pub fn nofile_limit(mut self, limit: u64) -> Self {
        self.nofile = Some((limit, limit));
        self
    }

    /// Runs the child with a soft `RLIMIT_NOFILE` of `soft` and a hard one of `hard`.
    pub fn nofile_soft_hard(mut self, soft: u64, hard: u64) -> Self {
        self.nofile = Some((soft, hard));
        self
    }

    /// An environment variable for the child.
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Runs the binary at `path` instead of the one built for the tests (a copy that a test
    /// may replace, for in-place upgrades).
    pub fn bin(mut self, path: impl Into<PathBuf>) -> Self {
        self.bin = Some(path.into());
        self
    }

    /// Runs the child as `uid` (and the same gid, no supplementary groups; the test must be
    /// root). Its admin-address directory is given to that uid.
    pub fn run_as(mut self, uid: u32) -> Self {
        self.run_as = Some(uid);
        self
    }

    /// Adds `--user UID` (the proxy starts as root and switches; the test must be root) and
    /// gives the admin-address directory to that uid.
    pub fn switch_user(mut self, uid: u32) -> Self {
        self.args.push(format!("--user={uid}").into());
        self.switch_user = Some(uid);
        self
    }

    /// Starts the process without waiting for anything (for bad-input tests).
    pub fn spawn_raw(self) -> Result<Proxy> {
        let bin = match &self.bin {
            Some(bin) => bin.clone(),
            None => proxy_bin()?,
        };
        let dir = TempDir::new("proxy")?;
        let admin_file = dir.join("admin-address");
        let mut command = match self.nofile {
            Some((soft, hard)) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={soft}:{hard}")).arg("--").arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        if let Some(subcommand) = &self.subcommand {
            command.arg(subcommand);
        }
        command.args(&self.args);
        if !self.default_admin_listen {
            command
                .arg("--admin-listen")
                .arg(self.admin_listen.as_deref().unwrap_or("127.0.0.1:0"));
        }
        if let Some(uid) = self.switch_user {
            let id = Some(nix::unistd::Uid::from_raw(uid));
            nix::unistd::chown(dir.path(), id, Some(nix::unistd::Gid::from_raw(uid)))
                .context("chown the admin-address directory")?;
        }
        if let Some(uid) = self.run_as {
            use std::os::unix::process::CommandExt as _;
            let id = Some(nix::unistd::Uid::from_raw(uid));
            nix::unistd::chown(dir.path(), id, Some(nix::unistd::Gid::from_raw(uid)))
                .context("chown the admin-address directory")?;
            command.uid(uid).gid(uid);
        }
        command
            .arg("--admin-address-file")
            .arg(&admin_file)
            .env_remove("RUST_LOG")
            .envs(self.envs.iter().map(|(k, v)| (k, v)));
        Ok(Proxy {
            process: ChildProcess::spawn(command, "proxy")?,
            admin_file,
            admin_addr: OnceLock::new(),
            _dir: dir,
        })
    }

    /// Starts the process and waits until its admin address is known.
    pub async fn spawn(self) -> Result<Proxy> {
        let proxy = self.spawn_raw()?;
        proxy.wait_admin_addr(DEFAULT_DEADLINE).await?;
        Ok(proxy)
    }
}

/// A running (or exited) proxy process; killed with SIGKILL when dropped.
pub struct Proxy {
    process: ChildProcess,
    admin_file: PathBuf,
    admin_addr: OnceLock<SocketAddr>,
    _dir: TempDir,
}

impl Proxy {
    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.process.stderr()
    }

    /// Waits until the captured stderr contains `text` (the capture lags the process a little).
    pub async fn wait_stderr(&self, text: &str) -> Result<()> {
        eventually(DEFAULT_DEADLINE, || async {
            ensure!(self.stderr().contains(text), "no {text:?} in stderr yet");
            Ok(())
        })
        .await
    }

    /// Everything the process wrote to stdout so far.
    pub fn stdout(&self) -> String {
        self.process.stdout()
    }

    /// The exit status, if the process has exited.
    pub fn try_exit(&self) -> Result<Option<ExitStatus>> {
        self.process.try_exit()
    }

    /// Fails if the process has exited (with its output), for fail-fast polling.
    pub fn ensure_running(&self) -> Result<()> {
        self.process.ensure_running()
    }

    /// The `--admin-address-file` it was given (a successor started by an in-place upgrade
    /// writes the same file).
    pub fn admin_file(&self) -> &Path {
        &self.admin_file
    }

    /// Whether the admin address file exists (it is written once the admin server is bound).
    pub fn admin_file_written(&self) -> bool {
        self.admin_file.exists()
    }

    /// Waits for `--admin-address-file` to name the admin address.
    pub async fn wait_admin_addr(&self, deadline: Duration) -> Result<SocketAddr> {
        if let Some(addr) = self.admin_addr.get() {
            return Ok(*addr);
        }
        let start = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&self.admin_file) {
                if let Ok(addr) = text.trim().parse::<SocketAddr>() {
                    let _ = self.admin_addr.set(addr);
                    return Ok(addr);
                }
            }
            self.ensure_running()?;
            ensure!(
                start.elapsed() < deadline,
                "no admin address in {} after {deadline:?}; stderr:\n{}",
                self.admin_file.display(),
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The admin address (known once [`ProxyBuilder::spawn`] returned).
    pub fn admin_addr(&self) -> SocketAddr {
        *self
            .admin_addr
            .get()
            .expect("admin address not known yet: use ProxyBuilder::spawn or wait_admin_addr")
    }

    /// `GET path` on the admin endpoint: `(status, body)`.
    pub async fn admin_get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.admin_addr(), path).await
    }

    /// `GET /status` as JSON.
    pub async fn status(&self) -> Result<serde_json::Value> {
        let (code, body) = self.admin_get("/status").await?;
        ensure!(code == 200, "/status answered {code}: {body}");
        serde_json::from_str(&body).with_context(|| format!("/status is not JSON: {body}"))
    }

    /// The `state` field of `/status`.
    pub async fn state(&self) -> Result<String> {
        let status = self.status().await?;
        status["state"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("/status has no string state: {status}"))
    }

    /// Polls `/status` until `state` is `wanted` (deadline [`DEFAULT_DEADLINE`]).
    pub async fn wait_state(&self, wanted: &str) -> Result<()> {
        eventually(DEFAULT_DEADLINE, || async {
            self.ensure_running()?;
            let state = self.state().await?;
            ensure!(state == wanted, "state is {state}, waiting for {wanted}");
            Ok(())
        })
        .await
    }

    /// The backend entry of `/status` whose address is `backend`.
    pub async fn backend_status(&self, backend: SocketAddr) -> Result<serde_json::Value> {
        let status = self.status().await?;
        status["backends"]
            .as_array()
            .and_then(|all| {
                all.iter()
                    .find(|b| b["address"].as_str() == Some(&backend.to_string()))
            })
            .cloned()
            .with_context(|| format!("backend {backend} not in /status: {status}"))
    }

    /// Polls `/status` until backend's `health` is `wanted` (`up`, `down`, `dead`, `unknown`).
    pub async fn wait_backend_health(&self, backend: SocketAddr, wanted: &str) -> Result<()> {
        eventually(DEFAULT_DEADLINE, || async {
            self.ensure_running()?;
            let entry = self.backend_status(backend).await?;
            ensure!(
                entry["health"].as_str() == Some(wanted),
                "backend {backend}: {entry}, waiting for health {wanted}"
            );
            Ok(())
        })
        .await
    }

    /// `GET /metrics` text.
    pub async fn metrics(&self) -> Result<String> {
        let (code, body) = self.admin_get("/metrics").await?;
        ensure!(code == 200, "/metrics answered {code}");
        Ok(body)
    }

    /// The sum of the samples of metric `name` (prefix optional) whose labels include
    /// `labels`; `None` if there is no such sample.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<Option<f64>> {
        Ok(parse_metric(&self.metrics().await?, name, labels))
    }

    /// Like [`Self::metric`], absent samples reading as 0.
    pub async fn metric_or_zero(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        Ok(self.metric(name, labels).await?.unwrap_or(0.0))
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) -> Result<()> {
        self.process.signal(Signal::SIGTERM)
    }

    /// Sends SIGINT.
    pub fn sigint(&self) -> Result<()> {
        self.process.signal(Signal::SIGINT)
    }

    /// Sends SIGKILL.
    pub fn sigkill(&self) -> Result<()> {
        self.process.signal(Signal::SIGKILL)
    }

    /// Sends any signal (SIGSTOP freezes the instance: it accepts nothing more).
    pub fn signal(&self, signal: Signal) -> Result<()> {
        self.process.signal(signal)
    }

    /// Waits for the process to exit, at most `deadline`, then for its output to be read.
    pub async fn wait_exit(&self, deadline: Duration) -> Result<ExitStatus> {
        self.process.wait_exit(deadline).await
    }
}

/// Parses Prometheus text: the sum of the samples of `name` (with or without
/// [`METRIC_PREFIX`]) whose labels include all of `labels`; `None` if none matches.
pub fn parse_metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let full = if name.starts_with(METRIC_PREFIX) {
        name.to_owned()
    } else {
        format!("{METRIC_PREFIX}{name}")
    };
    let mut sum = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(full.as_str()) else {
            continue;
        };
        let (sample_labels, value) = if let Some(rest) = rest.strip_prefix('{') {
            let Some(end) = rest.rfind('}') else { continue };
            (parse_labels(&rest[..end]), &rest[end + 1..])
        } else if rest.starts_with(' ') {
            (Vec::new(), rest)
        } else {
            continue;
        };
        let matches = labels
            .iter()
            .all(|(k, v)| sample_labels.iter().any(|(sk, sv)| sk == k && sv == v));
        if !matches {
            continue;
        }
        if let Some(value) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *sum.get_or_insert(0.0) += value;
        }
    }
    sum
}

/// [`parse_metric`], for a metric that must be there: a missing one is an error naming it
/// (a check that read it as 0 would pass without looking).
pub fn require_metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
    parse_metric(text, name, labels).ok_or_else(|| {
        let full = if name.starts_with(METRIC_PREFIX) {
            name.to_owned()
        } else {
            format!("{METRIC_PREFIX}{name}")
        };
        if labels.is_empty() {
            anyhow!("metric {full} missing from /metrics")
        } else {
            anyhow!("metric {full} with labels {labels:?} missing from /metrics")
        }
    })
}

fn parse_labels(text: &str) -> Vec<(String, String)> {
    let mut labels = Vec::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, escaped)) = chars.next() {
                        value.push(if escaped == 'n' { '\n' } else { escaped });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.push((key.trim().trim_start_matches(',').trim().to_owned(), value));
        rest = &after[end..];
    }
    labels
}

/// Runs the proxy binary with `args` to completion (e.g. `probe URL`), bounded by 20s.
pub async fn run_cli<I, S>(args: I) -> Result<std::process::Output>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let bin = proxy_bin()?;
    let output = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::process::Command::new(&bin)
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("proxy cli did not finish within 20s")??;
    Ok(output)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP kube_apiserver_proxy_connections_failed_total x
# TYPE kube_apiserver_proxy_connections_failed_total counter
kube_apiserver_proxy_connections_failed_total{reason="max_connections"} 3
kube_apiserver_proxy_connections_failed_total{reason="no_backend"} 1
kube_apiserver_proxy_connections_accepted_total 7
kube_apiserver_proxy_connections_accepted_total_extra 100
kube_apiserver_proxy_backend_up{backend="127.1.2.3:6443"} 1
kube_apiserver_proxy_backend_up{backend="127.1.2.4:6443",x="a\"b,c"} 0
"#;

    #[test]
    fn parses_samples_by_labels() {
        assert_eq!(
            parse_metric(
                TEXT,
                "connections_failed_total",
                &[("reason", "max_connections")]
            ),
            Some(3.0)
        );
        assert_eq!(
            parse_metric(TEXT, "connections_failed_total", &[]),
            Some(4.0)
        );
        assert_eq!(
            parse_metric(TEXT, "kube_apiserver_proxy_connections_accepted_total", &[]),
            Some(7.0)
        );
        assert_eq!(
            parse_metric(
                TEXT,
                "backend_up",
                &[("backend", "127.1.2.4:6443"), ("x", "a\"b,c")]
            ),
            Some(0.0)
        );
        assert_eq!(
            parse_metric(TEXT, "backend_up", &[("backend", "nope")]),
            None
        );
        assert_eq!(parse_metric(TEXT, "missing", &[]), None);
    }
}
