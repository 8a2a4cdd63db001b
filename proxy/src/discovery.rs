//! Dynamic backends: the pod's own apiserver (the address file written by `launch`) and the
//! other instances' apiservers on this node (a shared registration directory).
//!
//! - `--own-backend-file`: polled; when the address appears or changes (the apiserver container
//!   restarted on a new address), the old own backend is replaced by the new one.
//! - `--backend-dir`: each instance keeps one entry `<pid>-<n>.backend` holding its own
//!   backend's `ip:port`, refreshed every third of `--backend-expiry`. Entries not refreshed
//!   for `--backend-expiry` (the instance is gone, or its own backend has been dead that long)
//!   are ignored and removed. The others' entries become `Local` backends.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::addr::BackendAddr;
use crate::backend::{Backends, Tier};
use crate::health::Health;

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
pub async fn run(config: DiscoveryConfig, backends: Arc<Backends>, stop: CancellationToken) {
    let entry = format!(
        "{}-{:08x}.backend",
        std::process::id(),
        rand::random::<u32>()
    );
    let mut own: Option<BackendAddr> = None;
    let mut waiting_logged = false;
    let mut last_refresh: Option<Instant> = None;
    let mut own_dead_since: Option<Instant> = None;
    if let Some(dir) = &config.backend_dir {
        use std::os::unix::fs::DirBuilderExt;
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot create --backend-dir");
        }
    }
    loop {
        if let Some(file) = &config.own_backend_file {
            match std::fs::read_to_string(file)
                .ok()
                .as_deref()
                .and_then(parse_backend)
            {
                Some(addr) if own != Some(addr) => {
                    if let Some(old) = own {
                        tracing::info!(old = %old, new = %addr, "own backend address changed");
                        backends.remove(old);
                    }
                    backends.add(addr, Tier::Own);
                    own = Some(addr);
                    last_refresh = None;
                }
                Some(_) => {}
                None if own.is_none() && !waiting_logged => {
                    tracing::info!(file = %file.display(), "waiting for the own backend address file");
                    waiting_logged = true;
                }
                None => {}
            }
        }
        if let Some(dir) = &config.backend_dir {
            let own_health = own.and_then(|a| {
                backends
                    .snapshot()
                    .iter()
                    .find(|b| b.addr == a)
                    .map(|b| b.health())
            });
            own_dead_since = match own_health {
                Some(Health::Dead) => own_dead_since.or(Some(Instant::now())),
                _ => None,
            };
            let own_dead_too_long = own_dead_since.is_some_and(|t| t.elapsed() > config.expiry);
            if let Some(addr) = own.filter(|_| !own_dead_too_long) {
                if last_refresh.is_none_or(|t| t.elapsed() >= config.expiry / 3) {
                    match crate::fsutil::write_atomic(
                        &dir.join(&entry),
                        format!("{addr}\n").as_bytes(),
                    ) {
                        Ok(()) => last_refresh = Some(Instant::now()),
                        Err(e) => {
                            tracing::warn!(dir = %dir.display(), error = %e, "cannot register own backend")
                        }
                    }
                }
            }
            sync_dir(dir, &entry, config.expiry, &backends);
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(POLL_INTERVAL) => {}
        }
    }
    if let Some(dir) = &config.backend_dir {
        let _ = std::fs::remove_file(dir.join(&entry));
    }
}

fn sync_dir(dir: &Path, own_entry: &str, expiry: Duration, backends: &Arc<Backends>) {
    let Ok(read) = std::fs::read_dir(dir) else {
        return;
    };
    let now = SystemTime::now();
    let entries: Vec<(String, Duration)> = read
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            if !name.ends_with(".backend") {
                return None;
            }
            let age = now
                .duration_since(e.metadata().ok()?.modified().ok()?)
                .unwrap_or_default();
            Some((name, age))
        })
        .collect();
    let (live, stale) = live_entries(&entries, own_entry, expiry);
    for name in stale {
        tracing::info!(entry = name, "removing stale backend registration");
        let _ = std::fs::remove_file(dir.join(name));
    }
    let wanted: HashSet<BackendAddr> = live
        .iter()
        .filter_map(|name| std::fs::read_to_string(dir.join(name)).ok())
        .filter_map(|text| parse_backend(&text))
        .collect();
    for addr in &wanted {
        backends.add(*addr, Tier::Local);
    }
    for addr in backends.of_tier(Tier::Local) {
        if !wanted.contains(&addr) {
            backends.remove(addr);
        }
    }
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
