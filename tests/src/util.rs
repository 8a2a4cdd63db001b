//! Small helpers shared by the fakes and the tests: condition polling with a deadline,
//! loopback address pickers and a self-removing temporary directory.
//!
//! Tests wait on *conditions* (`eventually`), never on bare sleeps, and never use fixed
//! ports: addresses come from binding port 0, optionally on a random `127.a.b.c`.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use rand::Rng as _;

/// How often [`eventually`] re-evaluates its condition.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Polls `f` until it returns `Ok`, at most until `deadline` has elapsed.
///
/// The closure states *why* it is not done yet through its error (`anyhow::ensure!` works well);
/// on timeout the returned error carries the last of these reasons and the time waited, so a
/// failing test says what it was waiting for.
pub async fn eventually<T, F, Fut>(deadline: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let start = Instant::now();
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        match f().await {
            Ok(value) => return Ok(value),
            Err(error) if start.elapsed() >= deadline => {
                return Err(error.context(format!(
                    "condition still false after {:?} ({attempts} attempts)",
                    start.elapsed()
                )));
            }
            Err(_) => tokio::time::sleep(POLL_INTERVAL).await,
        }
    }
}

/// Returns a random loopback address `127.a.b.c` outside `127.0.0.0/24`, checked usable by a
/// test bind (port 0), like `kube-apiserver-proxy launch` picks one for kube-apiserver.
pub fn random_loopback_ip() -> Result<IpAddr> {
    let mut rng = rand::thread_rng();
    for _ in 0..100 {
        let (a, b, c): (u8, u8, u8) = (rng.gen(), rng.gen(), rng.gen_range(1..=254));
        if a == 0 && b == 0 {
            continue;
        }
        let ip = IpAddr::V4(Ipv4Addr::new(127, a, b, c));
        if TcpListener::bind((ip, 0)).is_ok() {
            return Ok(ip);
        }
    }
    bail!("no usable random loopback address found in 100 tries")
}

/// Returns `ip:port` with a port that was free a moment ago (found by binding port 0 and
/// closing it). Prefer handing a bound listener over where the API allows it; this is for
/// addresses another process must bind (the proxy's `--listen`).
pub fn free_addr(ip: IpAddr) -> Result<SocketAddr> {
    let listener = TcpListener::bind((ip, 0)).with_context(|| format!("bind {ip}:0"))?;
    Ok(listener.local_addr()?)
}

/// A free address on a fresh random loopback IP: the least likely to collide with anything
/// else on the machine, including other tests running in parallel.
pub fn free_random_loopback_addr() -> Result<SocketAddr> {
    free_addr(random_loopback_ip()?)
}

/// Whether `[::1]` can be bound on this machine (containers sometimes lack IPv6).
pub fn ipv6_loopback_available() -> bool {
    TcpListener::bind("[::1]:0").is_ok()
}

/// Connects to `addr` once and says whether the connection was refused (nothing listens).
/// Any other outcome (connected, timed out, another error) counts as "not refused".
pub async fn connection_refused(addr: SocketAddr) -> bool {
    match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await {
        Ok(Err(error)) => error.kind() == std::io::ErrorKind::ConnectionRefused,
        _ => false,
    }
}

/// Whether this run is CI (`CI` set to anything but empty, `false` or `0`): there a test that
/// cannot run in its environment fails instead of skipping.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// The one way a test skips: call it where `test` cannot run here because of `reason`, and
/// return what it returns. Outside CI it says `SKIPPED test: reason` on stderr and returns
/// `Ok(())`; in CI it returns an error, so a missing privilege or tool fails the run instead of
/// passing it silently.
pub fn skip(test: &str, reason: &str) -> Result<()> {
    if in_ci() {
        bail!("{test} cannot run here ({reason}) and CI is set: failing instead of skipping");
    }
    eprintln!("SKIPPED {test}: {reason}");
    Ok(())
}

/// A count a proof runs (handoffs, upgrades, streams): `designed`, the count the design asks,
/// unless the environment variable `var` holds another (a longer run, by hand). A count below
/// `designed` shrinks the proof: in CI that panics, since no knob may weaken what CI checks;
/// elsewhere it says loudly on stderr that the proof was shrunk. A value that is not a count
/// panics too (it would otherwise be ignored without a word).
pub fn proof_count(var: &str, designed: usize) -> usize {
    let value = std::env::var(var).ok();
    match count_from(var, value.as_deref(), designed, in_ci()) {
        Ok(Some(shrunk)) => {
            eprintln!(
                "WARNING: {var}={shrunk} shrinks this proof below its designed {designed}: \
                 it proves less than CI does (CI fails on such a value)"
            );
            shrunk
        }
        Ok(None) => value
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(designed),
        Err(e) => panic!("{e}"),
    }
}

/// The decision of [`proof_count`]: `Ok(Some(n))` for a count `n` below `designed` outside CI,
/// `Ok(None)` when the designed count or more runs, an error naming `var` and its value else.
fn count_from(
    var: &str,
    value: Option<&str>,
    designed: usize,
    ci: bool,
) -> Result<Option<usize>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    let n: usize = value
        .trim()
        .parse()
        .map_err(|_| format!("{var}={value:?} is not a count (designed: {designed})"))?;
    if n >= designed {
        return Ok(None);
    }
    if ci {
        return Err(format!(
            "{var}={value} would shrink this proof below its designed {designed}, and CI is \
             set: a knob may not weaken CI (unset {var}, or raise it)"
        ));
    }
    Ok(Some(n))
}

/// Whether this process runs as root (network namespaces, other uids, chroot).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// The names of the entries of `dir`, sorted.
pub fn dir_entries(dir: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    names.sort();
    Ok(names)
}

/// A temporary directory under `std::env::temp_dir()` with a random name, removed on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `$TMPDIR/kap-<prefix>-<pid>-<random>`.
    pub fn new(prefix: &str) -> Result<Self> {
        let suffix: u32 = rand::thread_rng().gen();
        let pid = std::process::id();
        let path = std::env::temp_dir().join(format!("kap-{prefix}-{pid}-{suffix:08x}"));
        std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
        Ok(Self { path })
    }

    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `path/name`.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_knob_may_lengthen_a_proof_and_shrinks_it_only_outside_ci() {
        let v = "KAP_TEST_X";
        assert_eq!(count_from(v, None, 100, true), Ok(None));
        assert_eq!(count_from(v, Some("100"), 100, true), Ok(None));
        assert_eq!(count_from(v, Some("1000"), 100, true), Ok(None));
        assert_eq!(count_from(v, Some("5"), 100, false), Ok(Some(5)));
        let e = count_from(v, Some("5"), 100, true).unwrap_err();
        assert!(e.contains("KAP_TEST_X=5") && e.contains("CI"), "{e}");
        let e = count_from(v, Some("lots"), 100, false).unwrap_err();
        assert!(e.contains("KAP_TEST_X=\"lots\""), "{e}");
    }

    #[tokio::test]
    async fn eventually_returns_first_success() {
        let mut n = 0;
        let value = eventually(Duration::from_secs(2), || {
            n += 1;
            let current = n;
            async move {
                anyhow::ensure!(current >= 3, "only {current} calls");
                Ok(current)
            }
        })
        .await
        .unwrap();
        assert_eq!(value, 3);
    }

    #[tokio::test]
    async fn eventually_reports_last_reason() {
        let error = eventually::<(), _, _>(Duration::from_millis(100), || async {
            anyhow::bail!("never ready")
        })
        .await
        .unwrap_err();
        let text = format!("{error:#}");
        assert!(text.contains("never ready"), "{text}");
        assert!(text.contains("condition still false"), "{text}");
    }

    #[test]
    fn random_loopback_ip_is_outside_first_24() {
        for _ in 0..50 {
            let IpAddr::V4(ip) = random_loopback_ip().unwrap() else {
                panic!("not v4")
            };
            let [a, b, c, d] = ip.octets();
            assert_eq!(a, 127);
            assert!((b, c) != (0, 0), "{ip}");
            assert!(d != 0 && d != 255, "{ip}");
        }
    }

    #[tokio::test]
    async fn refused_when_nothing_listens() {
        let addr = free_random_loopback_addr().unwrap();
        assert!(connection_refused(addr).await);
        let listener = TcpListener::bind(addr).unwrap();
        assert!(!connection_refused(addr).await);
        drop(listener);
    }

    #[test]
    fn skipping_fails_in_ci_only() {
        // The test process's own environment decides; check the branch it takes.
        let result = skip("unit", "reason");
        assert_eq!(result.is_err(), in_ci(), "{result:?}");
    }

    #[test]
    fn temp_dir_is_removed_on_drop() {
        let dir = TempDir::new("unit").unwrap();
        let path = dir.path().to_owned();
        std::fs::write(dir.join("x"), b"x").unwrap();
        drop(dir);
        assert!(!path.exists());
    }
}
