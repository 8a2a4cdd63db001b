//! The `kube-apiserver-proxy` binary as a benchmark target: finding it (or building it with
//! cargo, next to this binary) and starting instances with a TCP health check against the
//! built-in backend.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::instance::{Admin, Instance};

/// The binary's file name.
const BINARY: &str = "kube-apiserver-proxy";

/// Finds the proxy binary: `explicit` if given, else the one next to this binary, which is
/// (re)built first with `cargo build -p kube-apiserver-proxy` in the same profile and target
/// directory unless `no_build` is set.
pub fn locate(explicit: Option<&Path>, no_build: bool) -> Result<PathBuf> {
    if let Some(path) = explicit {
        if !path.is_file() {
            bail!("--proxy-bin {}: no such file", path.display());
        }
        return Ok(path.to_owned());
    }
    let exe = std::env::current_exe().context("cannot find the bench binary")?;
    let profile_dir = exe.parent().context("bench binary has no directory")?;
    let candidate = profile_dir.join(BINARY);
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    if !no_build && manifest.is_file() {
        kube_apiserver_proxy_tests::proxy::build_proxy(profile_dir, !candidate.is_file())?;
    }
    if !candidate.is_file() {
        bail!(
            "{} not found; build it with `cargo build --release -p {BINARY}` or pass --proxy-bin",
            candidate.display()
        );
    }
    Ok(candidate)
}

/// How to run one proxy instance.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// The public address (shared by all instances of a rollout).
    pub listen: SocketAddr,
    /// The built-in backend the instance forwards to.
    pub backend: SocketAddr,
    /// Shared handoff directory (rollout only).
    pub handoff_dir: Option<PathBuf>,
    /// `--drain-timeout`.
    pub drain_timeout: Duration,
    /// `--drain-close-window`.
    pub drain_close_window: Duration,
    /// `--max-connections`.
    pub max_connections: u64,
    /// `--log-level`.
    pub log_level: &'static str,
    /// `--worker-threads` (unset: the proxy's default, the CPUs available).
    pub worker_threads: Option<usize>,
    /// `--client-address transparent`.
    pub transparent: bool,
}

/// Starts proxy instances and names their logs.
#[derive(Debug)]
pub struct ProxyLauncher {
    bin: PathBuf,
    logs: PathBuf,
    extra_args: Vec<String>,
    started: u32,
}

impl ProxyLauncher {
    /// A launcher for `bin`, writing logs to `logs/proxy-N.log` and the admin address files
    /// next to them.
    pub fn new(bin: PathBuf, logs: PathBuf, extra_args: Vec<String>) -> Self {
        Self {
            bin,
            logs,
            extra_args,
            started: 0,
        }
    }

    /// The binary.
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// The extra arguments of every instance.
    pub fn extra_args(&self) -> &[String] {
        &self.extra_args
    }

    /// Replaces the extra arguments of instances started from now on.
    pub fn set_extra_args(&mut self, args: Vec<String>) {
        self.extra_args = args;
    }

    /// Whether the extra arguments give `flag` themselves.
    fn explicit(&self, flag: &str) -> bool {
        self.extra_args.iter().any(|a| a.starts_with(flag))
    }

    /// Starts an instance (not yet ready: call [`Instance::wait_ready`]).
    pub fn spawn(&mut self, options: &ProxyOptions) -> Result<Instance> {
        self.started += 1;
        let name = format!("proxy#{}", self.started);
        let log = self.logs.join(format!("proxy-{}.log", self.started));
        let admin_file = self.logs.join(format!("proxy-{}.admin", self.started));
        let _ = std::fs::remove_file(&admin_file);
        let mut command = Command::new(&self.bin);
        command
            .arg("run")
            .arg(format!("--listen={}", options.listen))
            .arg(format!("--backend={}", options.backend))
            .args(["--health-check=tcp", "--health-interval=100ms"])
            .args(["--health-timeout=500ms", "--health-rise=1"])
            .arg("--admin-listen=127.0.0.1:0")
            .arg(format!("--max-connections={}", options.max_connections))
            .arg(format!(
                "--drain-timeout={}",
                humantime::format_duration(options.drain_timeout)
            ))
            .arg(format!(
                "--drain-close-window={}",
                humantime::format_duration(options.drain_close_window)
            ))
            .arg(format!("--admin-address-file={}", admin_file.display()));
        // An explicit `--proxy-arg=--log-level=…` or `--proxy-arg=--worker-threads=N` wins
        // (each flag may be given once).
        if !self.explicit("--log-level") {
            command.arg(format!("--log-level={}", options.log_level));
        }
        if let Some(threads) = options
            .worker_threads
            .filter(|_| !self.explicit("--worker-threads"))
        {
            command.arg(format!("--worker-threads={threads}"));
        }
        if let Some(dir) = &options.handoff_dir {
            command.arg(format!("--handoff-dir={}", dir.display()));
        }
        if options.transparent {
            command.arg("--client-address=transparent");
        }
        command.args(&self.extra_args);
        // Flags also read KUBE_APISERVER_PROXY_* from the environment: do not inherit any.
        for (key, _) in std::env::vars_os() {
            if key
                .to_str()
                .is_some_and(|k| k.starts_with("KUBE_APISERVER_PROXY_"))
            {
                command.env_remove(key);
            }
        }
        Instance::spawn(name, command, Admin::File(admin_file), &log)
    }
}

/// Waits until `instance` (started with `--client-address transparent`) has verified its
/// connections to `backend` with the client's address; fails after 15 s (a fallback would
/// measure the plain connect twice).
pub async fn ensure_transparent(instance: &Instance, backend: SocketAddr) -> Result<()> {
    let addr = instance
        .admin_addr()
        .context("the proxy has no admin address")?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let (_, body) = kube_apiserver_proxy_tests::client::http_get_within(
            addr,
            "/status",
            Duration::from_secs(2),
        )
        .await?;
        let status: serde_json::Value = serde_json::from_str(&body)?;
        let seen = status["backends"]
            .as_array()
            .and_then(|all| {
                all.iter()
                    .find(|b| b["address"].as_str() == Some(&backend.to_string()))
            })
            .and_then(|b| b["client_address"].as_str())
            .unwrap_or("")
            .to_owned();
        if seen == "transparent: works" {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "{}: --client-address transparent did not verify ({seen}): run the bench as root with the policy routing (`kube-apiserver-proxy transparent-routes`) and --client-source (docs/benchmarks-history.md, \"The client address\")",
                instance.name()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
