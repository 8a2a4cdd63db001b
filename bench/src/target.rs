//! The targets a workload is sent to (`direct`, `haproxy`, `proxy`, `uring` and the
//! `-transparent` variants), where they come from ([`Setup`], the command line's options), and
//! the environment that starts them: the built-in backends, the proxy, HAProxy and io_uring
//! forwarder launchers, and the log directory.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;

use crate::backend::BackendProcess;
use crate::haproxy::{self, HaproxyLauncher, HaproxyOptions};
use crate::instance::Instance;
use crate::procstat::{self, ProcSample};
use crate::proxy::{self, ProxyLauncher, ProxyOptions};
use kube_apiserver_proxy_tests::util::free_random_loopback_addr as free_address;

/// Where the load goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// Straight to the backend: the baseline.
    Direct,
    /// Through HAProxy in TCP mode.
    Haproxy,
    /// Through kube-apiserver-proxy.
    Proxy,
    /// Through the io_uring forwarder (`bench serve-uring`): an upper bound, not a proxy.
    Uring,
    /// Through kube-apiserver-proxy with `--client-address transparent`: the backend
    /// connection carries the client's address (needs `--client-source`, root and the policy
    /// routing of `transparent-routes`; fails rather than measure the fallback).
    ProxyTransparent,
    /// Through HAProxy with `source 0.0.0.0 usesrc clientip` (TPROXY): the same, HAProxy's way.
    HaproxyTransparent,
}

impl Target {
    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Target::Direct => "direct",
            Target::Haproxy => "haproxy",
            Target::Proxy => "proxy",
            Target::Uring => "uring",
            Target::ProxyTransparent => "proxy-transparent",
            Target::HaproxyTransparent => "haproxy-transparent",
        }
    }
}

/// A target that was asked for but cannot run.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    pub target: Target,
    pub reason: String,
}

/// Everything needed to start targets.
#[derive(Debug)]
pub struct Env {
    /// Targets that can run, in the order asked for.
    pub targets: Vec<Target>,
    /// Targets asked for that cannot run.
    pub skipped: Vec<Skipped>,
    /// The built-in backends.
    pub backend: BackendProcess,
    /// Proxy instances, if the proxy is a target.
    pub proxy: Option<ProxyLauncher>,
    /// HAProxy instances, if found and a target.
    pub haproxy: Option<HaproxyLauncher>,
    /// HAProxy's `nbthread`.
    pub nbthread: usize,
    /// HAProxy's version line.
    pub haproxy_version: Option<String>,
    /// Output directory.
    pub out: PathBuf,
    /// Extra arguments of every `uring` instance.
    pub uring_args: Vec<String>,
}

impl Env {
    /// Resolves the targets of `setup`, starts the backends, prepares `out` and `out/logs`.
    pub fn new(setup: &Setup) -> Result<Self> {
        if let Some(ip) = setup.client_source {
            crate::client::set_client_source(ip);
        }
        let out = setup.out.clone().unwrap_or_else(default_out);
        let logs = out.join("logs");
        // Logs and configs of the previous invocation would only confuse.
        let _ = std::fs::remove_dir_all(&logs);
        std::fs::create_dir_all(&logs)
            .with_context(|| format!("cannot create {}", logs.display()))?;
        let mut targets = Vec::new();
        let mut skipped = Vec::new();
        let mut proxy = None;
        let mut haproxy = None;
        let mut haproxy_version = None;
        for &target in &setup.targets {
            if targets.contains(&target) {
                continue;
            }
            match target {
                Target::Direct | Target::Uring => {}
                Target::Proxy | Target::ProxyTransparent => {
                    if proxy.is_none() {
                        let bin = proxy::locate(setup.proxy_bin.as_deref(), setup.no_build)?;
                        proxy = Some(ProxyLauncher::new(
                            bin,
                            logs.clone(),
                            setup.proxy_args.clone(),
                        ));
                    }
                }
                Target::Haproxy | Target::HaproxyTransparent => {
                    match haproxy::locate(setup.haproxy_bin.as_deref()) {
                        Some(bin) => {
                            haproxy_version = haproxy::version(&bin);
                            haproxy = Some(HaproxyLauncher::new(bin, logs.clone()));
                        }
                        None => {
                            skipped.push(Skipped {
                                target,
                                reason: "haproxy not found on PATH (apt-get install haproxy)"
                                    .into(),
                            });
                            continue;
                        }
                    }
                }
            }
            targets.push(target);
        }
        let nbthread = setup.haproxy_nbthread.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        Ok(Self {
            targets,
            skipped,
            backend: BackendProcess::start()?,
            proxy,
            haproxy,
            nbthread,
            haproxy_version,
            out,
            uring_args: setup.uring_args.clone(),
        })
    }

    /// Starts `target` in front of `backend` and waits until it is ready.
    pub async fn start(&mut self, target: Target, backend: SocketAddr) -> Result<Running> {
        self.start_on(target, backend, free_address()?, None).await
    }

    /// Like [`Self::start`], on `listen` (bound with SO_REUSEPORT by both the proxy and
    /// HAProxy, so several processes can share it), with `threads` worker threads (proxy) or
    /// `nbthread` (HAProxy) instead of the default.
    pub async fn start_on(
        &mut self,
        target: Target,
        backend: SocketAddr,
        listen: SocketAddr,
        threads: Option<usize>,
    ) -> Result<Running> {
        let max_connections =
            (procstat::nofile_limit().saturating_sub(200) / 2).clamp(1000, 100_000);
        let instance = match target {
            Target::Direct => {
                return Ok(Running {
                    target,
                    addr: backend,
                    instance: None,
                    peers: Vec::new(),
                })
            }
            Target::Proxy | Target::ProxyTransparent => {
                let launcher = self.proxy.as_mut().expect("proxy target has a launcher");
                launcher.spawn(&ProxyOptions {
                    listen,
                    backend,
                    handoff_dir: None,
                    drain_timeout: Duration::from_secs(1),
                    drain_close_window: Duration::from_millis(100),
                    max_connections,
                    log_level: "warn",
                    worker_threads: threads,
                    transparent: target == Target::ProxyTransparent,
                })?
            }
            Target::Haproxy | Target::HaproxyTransparent => {
                let launcher = self
                    .haproxy
                    .as_mut()
                    .expect("haproxy target has a launcher");
                launcher.spawn(&HaproxyOptions {
                    listen,
                    backend,
                    nbthread: threads.unwrap_or(self.nbthread),
                    maxconn: max_connections,
                    hard_stop_after: None,
                    usesrc_clientip: target == Target::HaproxyTransparent,
                })?
            }
            Target::Uring => {
                let logs = self.out.join("logs");
                crate::uring::spawn(
                    &logs,
                    listen,
                    backend,
                    threads.unwrap_or(self.nbthread),
                    &self.uring_args,
                )?
            }
        };
        let mut instance = instance;
        instance.wait_ready(Duration::from_secs(20)).await?;
        if target == Target::ProxyTransparent {
            proxy::ensure_transparent(&instance, backend).await?;
        }
        Ok(Running {
            target,
            addr: listen,
            instance: Some(instance),
            peers: Vec::new(),
        })
    }
}

/// A started target.
#[derive(Debug)]
pub struct Running {
    pub target: Target,
    /// Where clients connect.
    pub addr: SocketAddr,
    /// The target process (none for `direct`).
    pub instance: Option<Instance>,
    /// More processes of the target sharing `addr` (a target spread over processes).
    pub peers: Vec<Instance>,
}

impl Running {
    /// CPU and RSS of the target process, if there is one (summed over its peers).
    pub fn sample(&self) -> Result<Option<ProcSample>> {
        let Some(first) = self.instance.as_ref().map(Instance::sample).transpose()? else {
            return Ok(None);
        };
        self.peers.iter().try_fold(Some(first), |sum, peer| {
            let (sum, s) = (sum.unwrap_or_default(), peer.sample()?);
            Ok(Some(ProcSample {
                cpu: sum.cpu + s.cpu,
                rss_bytes: sum.rss_bytes + s.rss_bytes,
            }))
        })
    }

    /// The process ids of the target (none for `direct`).
    pub fn pids(&self) -> Vec<u32> {
        self.instance
            .iter()
            .chain(&self.peers)
            .map(Instance::pid)
            .collect()
    }

    /// Stops the target: SIGTERM, then SIGKILL after a short grace.
    pub async fn stop(mut self) -> Result<()> {
        for instance in self.instance.iter_mut().chain(&mut self.peers) {
            instance.signal(nix::sys::signal::Signal::SIGTERM)?;
        }
        for instance in self.instance.iter_mut().chain(&mut self.peers) {
            instance.wait_exit(Duration::from_secs(3)).await?;
        }
        Ok(())
    }
}

/// `<target dir>/bench`, found from this binary's location (`target/<profile>/bench`), else
/// `target/bench` under the current directory.
pub fn default_out() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bench")))
        .unwrap_or_else(|| PathBuf::from("target/bench"))
}

/// Where the targets come from and where results go.
#[derive(Debug, Clone, Args)]
pub struct Setup {
    /// Targets to measure, in the order they run each round (missing HAProxy is skipped).
    #[arg(long, value_delimiter = ',', default_value = "direct,haproxy,proxy")]
    pub targets: Vec<Target>,
    /// Output directory for JSON and SVG files [default: <target dir>/bench].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The kube-apiserver-proxy binary [default: next to this binary, built with cargo].
    #[arg(long)]
    pub proxy_bin: Option<PathBuf>,
    /// Extra argument for every proxy instance (repeatable), e.g. `--proxy-arg=--log-level=debug`.
    #[arg(long = "proxy-arg", allow_hyphen_values = true)]
    pub proxy_args: Vec<String>,
    /// Do not run `cargo build` for the proxy; use the binary next to this one as it is.
    #[arg(long)]
    pub no_build: bool,
    /// The HAProxy binary [default: `haproxy` on PATH].
    #[arg(long)]
    pub haproxy_bin: Option<PathBuf>,
    /// HAProxy `nbthread` [default: available CPUs, like HAProxy itself and the proxy's runtime].
    #[arg(long)]
    pub haproxy_nbthread: Option<usize>,
    /// Extra argument for every `uring` instance (repeatable), e.g. `--uring-arg=--buffers=128`.
    #[arg(long = "uring-arg", allow_hyphen_values = true)]
    pub uring_args: Vec<String>,
    /// The address every client connects from (bound with port 0): one of this host's that is
    /// neither loopback nor a target's, so that the `-transparent` targets take their
    /// transparent path (docs/benchmarks-history.md, "The client address").
    #[arg(long, value_name = "IP")]
    pub client_source: Option<std::net::IpAddr>,
}
