//! Dynamic backends: the pod's own apiserver (the address file written by `launch`) and the
//! other instances' apiservers on this node (a shared registration directory).
//!
//! - `--own-backend-file`: polled; when the address appears or changes (the apiserver container
//!   restarted on a new address), the old own backend is replaced by the new one.
//! - `--backend-dir`: each instance keeps one entry `<pid>-<n>.backend` holding its own
//!   backend's `ip:port`, refreshed every third of `--backend-expiry`. Entries not refreshed
//!   for `--backend-expiry` (the instance is gone, or its own backend has been dead that long)
//!   are ignored and removed. The others' entries become `Local` backends. Only loopback
//!   addresses are taken from there: every instance's apiserver listens on a random
//!   `127.a.b.c`, and an entry naming any other address was not written by one (the directory
//!   trusts its writers by uid alone); it is refused with a log line and never connected to.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::backends::backend::{Backends, Tier};
use crate::backends::health::Health;
use crate::base::addr::BackendAddr;

/// How often the own-backend file and the directory are read.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Port assumed when the own-backend file holds a bare IP.
pub const DEFAULT_PORT: u16 = 6443;

/// Where dynamic backends come from.
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    /// Address file written by `launch`.
    pub own_backend_file: Option<PathBuf>,
    /// Registration directory shared by the instances on the node.
    pub backend_dir: Option<PathBuf>,
    /// Age after which an entry is stale (default 30s).
    pub expiry: Duration,
}

/// Parses `ip:port`, or a bare IP with the default port.
pub fn parse_backend(text: &str) -> Option<BackendAddr> {
    let t = text.trim();
    t.parse::<SocketAddr>()
        .ok()
        .or_else(|| {
            t.parse::<IpAddr>()
                .ok()
                .map(|ip| SocketAddr::new(ip, DEFAULT_PORT))
        })
        .map(BackendAddr)
}

/// A `--backend-dir` entry's backend: [`parse_backend`], and a loopback address. Pure.
pub fn parse_peer_backend(text: &str) -> Result<BackendAddr, PeerBackendError> {
    let addr = parse_backend(text).ok_or(PeerBackendError::NotAnAddress)?;
    if addr.0.ip().is_loopback() {
        Ok(addr)
    } else {
        Err(PeerBackendError::NotLoopback(addr))
    }
}

/// Why a `--backend-dir` entry is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerBackendError {
    #[error("not an ip:port address")]
    NotAnAddress,
    #[error("{0} is not a loopback address (instances register their apiserver's 127.a.b.c)")]
    NotLoopback(BackendAddr),
}

/// Refused `--backend-dir` entries are logged at most once a minute (the directory is read
/// every [`POLL_INTERVAL`]).
static REFUSED_LOG: crate::base::lograte::LogRate =
    crate::base::lograte::LogRate::new(Duration::from_secs(60));

/// Which entries of a directory listing are live, given their ages. Pure.
pub fn live_entries(
    entries: &[(String, Duration)],
    own: &str,
    expiry: Duration,
) -> (Vec<String>, Vec<String>) {
    let mut live = Vec::new();
    let mut stale = Vec::new();
    for (name, age) in entries {
        if name == own {
            continue;
        }
        if *age > expiry {
            stale.push(name.clone());
        } else {
            live.push(name.clone());
        }
    }
    (live, stale)
}

/// Keeps the own and local backends in step with the file and the directory until `stop`.
///
/// Every file-system call runs on the blocking pool (`spawn_blocking`), never on a runtime
/// worker: a read or write stuck behind a slow disk, a hung mount or a FIFO must not stall the
/// connections carried by that worker.
pub async fn run(config: DiscoveryConfig, backends: Arc<Backends>, stop: CancellationToken) {
    let mut discovery = Discovery {
        entry: format!(
            "{}-{:08x}.backend",
            std::process::id(),
            rand::random::<u32>()
        ),
        config,
        backends,
        stop,
        own: None,
        waiting_logged: false,
        last_refresh: None,
        own_dead_since: None,
    };
    if discovery.create_dir().await.is_none() {
        return;
    }
    loop {
        if discovery.read_own_file().await.is_none() || discovery.sync_dir().await.is_none() {
            break;
        }
        tokio::select! {
            _ = discovery.stop.cancelled() => break,
            _ = tokio::time::sleep(POLL_INTERVAL) => {}
        }
    }
    discovery.remove_entry().await;
}

/// The state of [`run`] between two polls. Each step returns `None` once `stop` fired.
struct Discovery {
    config: DiscoveryConfig,
    backends: Arc<Backends>,
    stop: CancellationToken,
    /// Our entry's name in `--backend-dir`.
    entry: String,
    /// The own backend, once the file named it.
    own: Option<BackendAddr>,
    /// "waiting for the own backend address file" was logged.
    waiting_logged: bool,
    /// When our entry was last written.
    last_refresh: Option<Instant>,
    /// Since when the own backend has been dead (its entry is then left to expire).
    own_dead_since: Option<Instant>,
}

impl Discovery {
    /// Creates `--backend-dir` (0700) if missing; failing that is logged, not fatal.
    async fn create_dir(&self) -> Option<()> {
        let Some(dir) = self.config.backend_dir.clone() else {
            return Some(());
        };
        let created = blocking(&self.stop, move || {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
        })
        .await?;
        if let Err(e) = created {
            tracing::warn!(dir = %self.config.backend_dir.as_ref().map(|d| d.display().to_string()).unwrap_or_default(), error = %e, "cannot create --backend-dir")
        }
        Some(())
    }

    /// `--own-backend-file`: the own backend appears, or is replaced when the address changed.
    async fn read_own_file(&mut self) -> Option<()> {
        let Some(file) = self.config.own_backend_file.clone() else {
            return Some(());
        };
        let read = blocking(&self.stop, move || std::fs::read_to_string(file)).await?;
        match read.ok().as_deref().and_then(parse_backend) {
            Some(addr) if self.own != Some(addr) => {
                if let Some(old) = self.own {
                    tracing::info!(old = %old, new = %addr, "own backend address changed");
                    self.backends.remove(old);
                }
                self.backends.add(addr, Tier::Own);
                self.own = Some(addr);
                self.last_refresh = None;
            }
            Some(_) => {}
            None if self.own.is_none() && !self.waiting_logged => {
                if let Some(file) = &self.config.own_backend_file {
                    tracing::info!(file = %file.display(), "waiting for the own backend address file");
                }
                self.waiting_logged = true;
            }
            None => {}
        }
        Some(())
    }

    /// `--backend-dir`: refreshes our entry (unless the own backend has been dead longer than
    /// the expiry), and makes the live entries of the others the `Local` backends.
    async fn sync_dir(&mut self) -> Option<()> {
        let Some(dir) = self.config.backend_dir.clone() else {
            return Some(());
        };
        let own_health = self.own.and_then(|a| {
            self.backends
                .snapshot()
                .iter()
                .find(|b| b.addr == a)
                .map(|b| b.health())
        });
        self.own_dead_since = match own_health {
            Some(Health::Dead) => self.own_dead_since.or(Some(Instant::now())),
            _ => None,
        };
        let expiry = self.config.expiry;
        let own_dead_too_long = self.own_dead_since.is_some_and(|t| t.elapsed() > expiry);
        let last_refresh = self.last_refresh;
        let register = self
            .own
            .filter(|_| !own_dead_too_long)
            .filter(|_| last_refresh.is_none_or(|t| t.elapsed() >= expiry / 3));
        let entry_name = self.entry.clone();
        let (registered, wanted) = blocking(&self.stop, move || {
            let registered = register.map(|addr| {
                crate::base::fsutil::write_atomic(
                    &dir.join(&entry_name),
                    format!("{addr}\n").as_bytes(),
                )
                .map_err(|e| (dir.display().to_string(), e))
            });
            (registered, scan_dir(&dir, &entry_name, expiry))
        })
        .await?;
        match registered {
            Some(Ok(())) => self.last_refresh = Some(Instant::now()),
            Some(Err((dir, e))) => {
                tracing::warn!(dir, error = %e, "cannot register own backend")
            }
            None => {}
        }
        if let Some(wanted) = wanted {
            for addr in &wanted {
                self.backends.add(*addr, Tier::Local);
            }
            for addr in self.backends.of_tier(Tier::Local) {
                if !wanted.contains(&addr) {
                    self.backends.remove(addr);
                }
            }
        }
        Some(())
    }

    /// Removes our entry from `--backend-dir` (at most a second's wait: a hung mount must not
    /// hold the exit).
    async fn remove_entry(&self) {
        if let Some(dir) = &self.config.backend_dir {
            let path = dir.join(&self.entry);
            let remove = tokio::task::spawn_blocking(move || std::fs::remove_file(path));
            let _ = tokio::time::timeout(Duration::from_secs(1), remove).await;
        }
    }
}

/// Runs `work` on the blocking pool; `None` when `stop` fires first (the work is left to
/// finish on its own thread).
async fn blocking<T: Send + 'static>(
    stop: &CancellationToken,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let task = tokio::task::spawn_blocking(work);
    tokio::select! {
        _ = stop.cancelled() => None,
        r = task => r.ok(),
    }
}

/// Reads the directory: removes stale entries and returns the live entries' backends (`None`
/// when the directory cannot be read). Blocking.
fn scan_dir(dir: &Path, own_entry: &str, expiry: Duration) -> Option<HashSet<BackendAddr>> {
    let read = std::fs::read_dir(dir).ok()?;
    let now = SystemTime::now();
    let entries: Vec<(String, Duration)> = read
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            if !name.ends_with(".backend") {
                return None;
            }
            let meta = e.metadata().ok()?;
            // Only regular files: a FIFO or device would block the read.
            if !meta.is_file() {
                return None;
            }
            let age = now
                .duration_since(meta.modified().ok()?)
                .unwrap_or_default();
            Some((name, age))
        })
        .collect();
    let (live, stale) = live_entries(&entries, own_entry, expiry);
    for name in stale {
        tracing::info!(entry = name, "removing stale backend registration");
        let _ = std::fs::remove_file(dir.join(name));
    }
    let mut found = HashSet::new();
    for name in live {
        let Ok(text) = std::fs::read_to_string(dir.join(&name)) else {
            continue;
        };
        match parse_peer_backend(&text) {
            Ok(addr) => {
                found.insert(addr);
            }
            Err(reason) => {
                if let Some(suppressed) = REFUSED_LOG.allow() {
                    tracing::warn!(entry = name, dir = %dir.display(), reason = %reason, suppressed, "backend registration refused");
                }
            }
        }
    }
    Some(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_address_with_or_without_port() {
        assert_eq!(
            parse_backend("127.1.2.3:7443\n").unwrap().to_string(),
            "127.1.2.3:7443"
        );
        assert_eq!(
            parse_backend("127.1.2.3").unwrap().to_string(),
            "127.1.2.3:6443"
        );
        assert!(parse_backend("").is_none());
        assert!(parse_backend("garbage").is_none());
    }

    #[test]
    fn peer_entries_must_be_loopback() {
        assert!(parse_peer_backend("127.1.2.3:6443").is_ok());
        assert!(parse_peer_backend("[::1]:6443").is_ok());
        assert!(parse_peer_backend("192.0.2.1:6443").is_err());
        assert!(parse_peer_backend("0.0.0.0:6443").is_err());
        assert!(parse_peer_backend("[fd00::1]:6443").is_err());
        assert!(parse_peer_backend("garbage").is_err());
    }

    #[test]
    fn stale_entries_are_separated_and_own_is_skipped() {
        let e = |n: &str, s: u64| (n.to_string(), Duration::from_secs(s));
        let (live, stale) = live_entries(
            &[e("a", 1), e("b", 31), e("me", 99)],
            "me",
            Duration::from_secs(30),
        );
        assert_eq!(live, vec!["a"]);
        assert_eq!(stale, vec!["b"]);
    }
}
