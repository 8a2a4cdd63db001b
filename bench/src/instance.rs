//! One target process (a proxy or HAProxy instance): started with its stderr in a log file,
//! ready when its admin endpoint answers `GET /readyz` with 200, stopped with a signal, sampled
//! for CPU and memory, and killed on drop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::procstat::{self, ProcSample};
use kube_apiserver_proxy_tests::client::http_get_within;

/// Where an instance's readiness endpoint is.
#[derive(Debug, Clone)]
pub enum Admin {
    /// A fixed address (HAProxy's monitor frontend).
    Addr(SocketAddr),
    /// A file the instance writes its address to (`--admin-address-file`).
    File(PathBuf),
}

/// A running target process.
#[derive(Debug)]
pub struct Instance {
    name: String,
    child: Child,
    admin: Admin,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

impl Instance {
    /// Spawns `command` with stdout and stderr appended to `log`.
    pub fn spawn(name: String, mut command: Command, admin: Admin, log: &Path) -> Result<Self> {
        let file = std::fs::File::create(log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("cannot start {name}: {command:?}"))?;
        Ok(Self {
            name,
            child,
            admin,
            log: log.to_owned(),
            exited: None,
        })
    }

    /// The instance's name, e.g. `proxy#2`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until `GET /readyz` answers 200; fails if the process exits or `timeout` passes.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no answer yet");
        loop {
            if let Some(status) = self.child.try_wait()? {
                self.exited = Some(status);
                bail!(
                    "{} exited with {status} before it was ready; its log:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            if let Some(addr) = self.admin_addr() {
                match http_get_within(addr, "/readyz", Duration::from_millis(500))
                    .await
                    .map(|(status, _)| status)
                {
                    Ok(200) => return Ok(()),
                    Ok(code) => last = format!("/readyz answered {code}"),
                    Err(err) => last = format!("/readyz: {err:#}"),
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "{} not ready after {timeout:?} ({last}); its log:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One readiness check: `true` if `GET /readyz` answers 200 now; an error if the process
    /// has exited.
    pub async fn check_ready(&mut self, timeout: Duration) -> Result<bool> {
        if let Some(status) = self.try_exit()? {
            bail!("{} exited with {status} before it was ready", self.name);
        }
        let Some(addr) = self.admin_addr() else {
            return Ok(false);
        };
        Ok(matches!(
            http_get_within(addr, "/readyz", timeout)
                .await
                .map(|(status, _)| status),
            Ok(200)
        ))
    }

    /// The exit status if the process has exited (reaping it), without waiting.
    pub fn try_exit(&mut self) -> Result<Option<ExitStatus>> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait()?;
        }
        Ok(self.exited)
    }

    /// The admin endpoint's address, once known.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        match &self.admin {
            Admin::Addr(addr) => Some(*addr),
            Admin::File(path) => std::fs::read_to_string(path).ok()?.trim().parse().ok(),
        }
    }

    /// Sends `signal` (SIGTERM to stop, SIGUSR1 for HAProxy's soft stop).
    pub fn signal(&self, signal: Signal) -> Result<()> {
        kill(Pid::from_raw(self.pid() as i32), signal)
            .with_context(|| format!("cannot signal {}", self.name))
    }

    /// Waits for the process to exit; after `timeout` it is killed and `None` returned.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                self.exited = Some(status);
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                self.exited = Some(self.child.wait()?);
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// CPU time and RSS of the process.
    pub fn sample(&self) -> Result<ProcSample> {
        procstat::sample(self.pid())
    }

    /// The instance's log file (stdout and stderr).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last lines of the instance's log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
