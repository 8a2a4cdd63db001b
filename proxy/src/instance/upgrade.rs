//! In-place upgrade (SIGUSR2; `systemctl reload`): the running instance starts its successor
//! from the path it was itself started from — read from disk again, so a binary replaced there
//! is what runs — with the same arguments and environment, and waits until the successor is
//! Serving and ready (asked over the handoff socket). The successor took duplicates of the
//! listening sockets at its start (share); this instance then drains as on SIGTERM, handing its
//! sockets to the successor (adopt).
//!
//! The admin listening socket is inherited by the successor (its descriptor number in
//! [`ADMIN_FD_ENV`], our pid in [`PREDECESSOR_ENV`]): one kernel queue, so the admin address
//! never refuses. It is answered by one of the two at a time: this instance until it has
//! handed over its listening sockets and its established connections (it stays `Serving`, and
//! ready, until then), the successor from then on — it starts answering only once it is ready
//! itself and this instance has left `Serving`. So the pod's readiness probe never sees a
//! successor that is not ready yet, and `/status` shows the new pid only when the upgrade is
//! done.
//!
//! If the successor exits before it is ready (a broken binary, bad flags: exit 2), or is not
//! ready within [`READY_TIMEOUT`], the upgrade is abandoned and this instance goes on serving.

use std::ffi::OsString;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use crate::handoff::Handoff;
use crate::sys;

/// Names, in the successor's environment, the descriptor of the inherited admin socket.
pub const ADMIN_FD_ENV: &str = "KAP_UPGRADE_ADMIN_FD";
/// Names, in the successor's environment, the pid of the instance that started it.
pub const PREDECESSOR_ENV: &str = "KAP_UPGRADE_PREDECESSOR_PID";
/// How long a successor may take to become ready (its health checks must pass first).
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Pause between checks of the successor.
const POLL: Duration = Duration::from_millis(50);

/// Why an in-place upgrade was abandoned (the instance goes on serving).
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error("in-place upgrade needs --handoff-dir")]
    NoHandoff,
    #[error("cannot start {path}")]
    Spawn {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("successor exited before it was ready ({0})")]
    Exited(ExitStatus),
    #[error("successor not ready within {0:?}; stopped it")]
    Timeout(Duration),
    #[error("cannot watch the successor")]
    Wait(#[source] io::Error),
}

/// How this process was started, to start its successor the same way.
#[derive(Debug, Clone)]
pub struct StartCommand {
    /// The binary's path as started (`argv[0]` made absolute, else `/proc/self/exe` at start).
    pub exe: PathBuf,
    pub args: Vec<OsString>,
}

impl StartCommand {
    /// The command line of this process; call at start (a relative `argv[0]` is resolved
    /// against the working directory of that moment).
    pub fn current() -> io::Result<Self> {
        let mut argv = std::env::args_os();
        let exe = match argv.next().map(PathBuf::from) {
            Some(p) if p.is_absolute() => p,
            Some(p) if p.components().count() > 1 => std::env::current_dir()?.join(p),
            // Found through $PATH: the kernel's record of the binary.
            _ => std::env::current_exe()?,
        };
        Ok(StartCommand {
            exe,
            args: argv.collect(),
        })
    }
}

/// Starts the successor with `admin` inherited, and waits until it is Serving and ready.
/// Returns its pid.
pub async fn start_successor(
    start: &StartCommand,
    admin: BorrowedFd<'_>,
    handoff: &Handoff,
    timeout: Duration,
) -> Result<u32, UpgradeError> {
    let mut command = std::process::Command::new(&start.exe);
    command
        .args(&start.args)
        .env(ADMIN_FD_ENV, admin.as_raw_fd().to_string())
        .env(PREDECESSOR_ENV, std::process::id().to_string())
        .stdin(Stdio::null());
    sys::keep_across_exec(&mut command, admin);
    let mut child = command.spawn().map_err(|source| UpgradeError::Spawn {
        path: start.exe.display().to_string(),
        source,
    })?;
    let pid = child.id();
    tracing::info!(successor.pid = pid, path = %start.exe.display(), "in-place upgrade: successor started");
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().map_err(UpgradeError::Wait)? {
            return Err(UpgradeError::Exited(status));
        }
        if let Some((state, true)) = handoff.peer_status(pid).await {
            if state == crate::base::lifecycle::State::Serving.as_str() {
                return Ok(pid);
            }
        }
        if Instant::now() >= deadline {
            // Let it drain like any instance: whatever it took (a shared socket) comes back.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            std::thread::spawn(move || child.wait());
            return Err(UpgradeError::Timeout(timeout));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The admin listening socket inherited from the predecessor, and the predecessor's pid, if we
/// were started by an in-place upgrade and the socket is bound where `--admin-listen` says
/// (port 0: any port on that IP).
pub fn inherited_admin(want: SocketAddr) -> Option<(std::net::TcpListener, u32)> {
    let raw: i32 = std::env::var(ADMIN_FD_ENV).ok()?.parse().ok()?;
    let predecessor: u32 = std::env::var(PREDECESSOR_ENV)
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    match sys::take_inherited_listener(raw) {
        Ok((fd, addr))
            if addr.ip() == want.ip() && (want.port() == 0 || want.port() == addr.port()) =>
        {
            Some((std::net::TcpListener::from(fd), predecessor))
        }
        Ok((_, addr)) => {
            tracing::warn!(inherited = %addr, admin.listen = %want, "inherited admin socket is not bound to --admin-listen; closed");
            None
        }
        Err(e) => {
            tracing::warn!(fd = raw, error = %e, "no usable inherited admin socket");
            None
        }
    }
}

/// Waits until this successor may answer on the inherited admin socket: it is ready, and its
/// predecessor has left `Serving` (it has handed everything over and stopped answering there)
/// or is gone. Returns at once for an instance that inherited nothing.
pub async fn wait_admin_turn(
    predecessor: Option<u32>,
    ready: impl Fn() -> bool,
    handoff: Option<&Handoff>,
) {
    let Some(pid) = predecessor else { return };
    loop {
        if ready() {
            let serving = match handoff {
                Some(h) if pid != 0 => matches!(
                    h.peer_status(pid).await,
                    Some((state, _)) if state == crate::base::lifecycle::State::Serving.as_str()
                ),
                _ => false,
            };
            if !serving {
                tracing::info!(predecessor.pid = pid, "in-place upgrade: the predecessor has handed over; answering on the admin socket");
                return;
            }
        }
        tokio::time::sleep(POLL).await;
    }
}
