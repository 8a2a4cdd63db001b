//! HAProxy as a benchmark target: found on PATH, run in the foreground (`-db`, one process)
//! with a TCP-mode config the harness writes itself, ready when its monitor frontend answers
//! `GET /readyz` with 200.
//!
//! Fairness: `nbthread` defaults to the available CPUs (HAProxy's own default, and what the
//! proxy's multi-threaded runtime uses); timeouts are those of a long-lived-connection TCP
//! proxy (`timeout client/server 1h`, `timeout connect 5s`); no logging, no health checks.
//! Binds use SO_REUSEPORT (HAProxy's default on Linux), so two instances can share the public
//! address during a rollout.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::instance::{Admin, Instance};
use kube_apiserver_proxy_tests::util::free_random_loopback_addr as free_address;

/// Finds `haproxy`: `explicit`, or the first on PATH. `None` if there is none.
pub fn locate(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(path) = explicit {
        return path.is_file().then(|| path.to_owned());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|dir| dir.join("haproxy"))
        .find(|candidate| candidate.is_file())
}

/// The first line of `haproxy -v`.
pub fn version(bin: &Path) -> Option<String> {
    let output = Command::new(bin).arg("-v").output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines().next().map(str::to_owned)
}

/// How to run one HAProxy instance.
#[derive(Debug, Clone)]
pub struct HaproxyOptions {
    /// The public address (shared by all instances of a rollout).
    pub listen: SocketAddr,
    /// The built-in backend.
    pub backend: SocketAddr,
    /// `global nbthread`.
    pub nbthread: usize,
    /// `global maxconn` (and the frontend's).
    pub maxconn: u64,
    /// `global hard-stop-after`: how long a soft-stopped (SIGUSR1) instance keeps connections.
    pub hard_stop_after: Option<Duration>,
    /// `source 0.0.0.0 usesrc clientip`: connect to the backend from the client's address.
    pub usesrc_clientip: bool,
}

/// The configuration file for `options`, with the monitor frontend on `monitor`.
pub fn config(options: &HaproxyOptions, monitor: SocketAddr) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "global");
    let _ = writeln!(text, "    nbthread {}", options.nbthread);
    let _ = writeln!(text, "    maxconn {}", options.maxconn);
    if let Some(after) = options.hard_stop_after {
        let _ = writeln!(text, "    hard-stop-after {}ms", after.as_millis().max(1));
    }
    let _ = writeln!(text);
    let _ = writeln!(text, "defaults");
    let _ = writeln!(text, "    mode tcp");
    let _ = writeln!(text, "    maxconn {}", options.maxconn);
    let _ = writeln!(text, "    timeout connect 5s");
    let _ = writeln!(text, "    timeout client 1h");
    let _ = writeln!(text, "    timeout server 1h");
    let _ = writeln!(text);
    let _ = writeln!(text, "frontend public");
    let _ = writeln!(text, "    bind {}", options.listen);
    let _ = writeln!(text, "    default_backend apiserver");
    let _ = writeln!(text);
    let _ = writeln!(text, "frontend monitor");
    let _ = writeln!(text, "    mode http");
    let _ = writeln!(text, "    bind {monitor}");
    let _ = writeln!(text, "    timeout client 5s");
    let _ = writeln!(text, "    monitor-uri /readyz");
    let _ = writeln!(text);
    let _ = writeln!(text, "backend apiserver");
    if options.usesrc_clientip {
        let _ = writeln!(text, "    source 0.0.0.0 usesrc clientip");
    }
    let _ = writeln!(text, "    server backend {}", options.backend);
    text
}

/// Starts HAProxy instances and names their configs and logs.
#[derive(Debug)]
pub struct HaproxyLauncher {
    bin: PathBuf,
    logs: PathBuf,
    started: u32,
}

impl HaproxyLauncher {
    /// A launcher for `bin`, writing `haproxy-N.cfg` and `haproxy-N.log` to `logs`.
    pub fn new(bin: PathBuf, logs: PathBuf) -> Self {
        Self {
            bin,
            logs,
            started: 0,
        }
    }

    /// The binary.
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// Starts an instance (not yet ready: call [`Instance::wait_ready`]).
    pub fn spawn(&mut self, options: &HaproxyOptions) -> Result<Instance> {
        self.started += 1;
        let name = format!("haproxy#{}", self.started);
        let monitor = free_address()?;
        let cfg = self.logs.join(format!("haproxy-{}.cfg", self.started));
        let log = self.logs.join(format!("haproxy-{}.log", self.started));
        std::fs::write(&cfg, config(options, monitor))
            .with_context(|| format!("cannot write {}", cfg.display()))?;
        let mut command = Command::new(&self.bin);
        command.arg("-db").arg("-f").arg(&cfg);
        Instance::spawn(name, command, Admin::Addr(monitor), &log)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_tcp_mode_with_monitor() {
        let options = HaproxyOptions {
            listen: "127.1.2.3:6443".parse().unwrap(),
            backend: "127.4.5.6:7000".parse().unwrap(),
            nbthread: 2,
            maxconn: 1000,
            hard_stop_after: Some(Duration::from_secs(1)),
            usesrc_clientip: false,
        };
        let text = config(&options, "127.7.8.9:8404".parse().unwrap());
        assert!(text.contains("    mode tcp\n"));
        assert!(text.contains("    bind 127.1.2.3:6443\n"));
        assert!(text.contains("    server backend 127.4.5.6:7000\n"));
        assert!(text.contains("    monitor-uri /readyz\n"));
        assert!(text.contains("    hard-stop-after 1000ms\n"));
    }
}
