//! `kube-apiserver-proxy launch`: give kube-apiserver a free random loopback address.
//!
//! The kube-apiserver image has no shell, so this binary (copied in by an init container) picks
//! an address in 127.0.0.0/8 outside 127.0.0.0/24, confirms it is free for the port by a test
//! bind, writes `ip:port` atomically to the address file (the sidecar's own backend), replaces
//! every `{{address}}` (and `{{port}}`) in the arguments and `exec`s the command in place: same
//! pid, so the kubelet's signals reach the apiserver directly.
//!
//! While a wildcard listener holds the port (kubeadm's static kube-apiserver on `0.0.0.0:6443`,
//! during `migrate`), no address of the node can bind it. Then, if the arguments have a
//! `{{port}}` placeholder, the command gets another free port on its random address instead;
//! the sidecar reads the port from the address file like the address. The next start, once the
//! wildcard listener is gone, is back on `--port`.

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use rand::Rng;

/// The placeholder replaced by the chosen address.
pub const PLACEHOLDER: &str = "{{address}}";
/// The placeholder replaced by the chosen port (`--port`, unless a wildcard listener holds it).
pub const PORT_PLACEHOLDER: &str = "{{port}}";
/// Random addresses tried before giving up.
const ATTEMPTS: usize = 64;

/// Why `launch` could not start the command.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("launch: no command given after --")]
    NoCommand,
    #[error("launch: no argument contains {PLACEHOLDER} (e.g. --bind-address={PLACEHOLDER})")]
    NoPlaceholder,
    #[error("launch: command {0:?} not found or not executable")]
    NotExecutable(String),
    #[error("launch: no free loopback address for port {0} after {ATTEMPTS} tries")]
    NoFreeAddress(u16),
    #[error("launch: port {0} is held on every address by a wildcard listener (kubeadm's static kube-apiserver on 0.0.0.0:{0}?), and no argument contains {PORT_PLACEHOLDER} to move to another port (e.g. --secure-port={PORT_PLACEHOLDER})")]
    WildcardHeld(u16),
    #[error("launch: --address-file {path}: {source}")]
    AddressFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("launch: cannot exec {command:?}: {source}")]
    Exec {
        command: String,
        #[source]
        source: std::io::Error,
    },
}

impl crate::base::exit::CommandError for LaunchError {
    /// A command `launch` cannot start: bad input (the pod's command line).
    fn is_bad_input(&self) -> bool {
        true
    }
}

/// A random address in 127.0.0.0/8, outside 127.0.0.0/24 and not the broadcast address.
pub fn random_loopback(rng: &mut impl Rng) -> Ipv4Addr {
    loop {
        let [a, b, c]: [u8; 3] = rng.gen();
        let ip = Ipv4Addr::new(127, a, b, c);
        let excluded =
            (a == 0 && b == 0) || ip == Ipv4Addr::new(127, 255, 255, 255) || c == 0 || c == 255;
        if !excluded {
            return ip;
        }
    }
}

/// Picks a random loopback address on which `port` is free (checked by binding it). When a
/// wildcard listener holds `port` and `may_move` is set, picks a free port on a random address
/// instead.
pub fn pick_address(port: u16, may_move: bool) -> Result<SocketAddr, LaunchError> {
    let mut rng = rand::thread_rng();
    for _ in 0..ATTEMPTS {
        let addr = SocketAddr::V4(SocketAddrV4::new(random_loopback(&mut rng), port));
        match TcpListener::bind(addr) {
            Ok(_) => return Ok(addr),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                if !crate::node::migration::migrate::wildcard_listeners(port).is_empty() {
                    return moved(port, may_move, &mut rng);
                }
            }
            Err(_) => {}
        }
    }
    Err(LaunchError::NoFreeAddress(port))
}

/// A random loopback address with a free port the kernel picks, when allowed.
fn moved(port: u16, may_move: bool, rng: &mut impl Rng) -> Result<SocketAddr, LaunchError> {
    if !may_move {
        return Err(LaunchError::WildcardHeld(port));
    }
    for _ in 0..ATTEMPTS {
        let ip = random_loopback(rng);
        if let Ok(l) = TcpListener::bind(SocketAddr::V4(SocketAddrV4::new(ip, 0))) {
            if let Ok(addr) = l.local_addr() {
                eprintln!("launch: port {port} is held by a wildcard listener; using port {} on {ip} until it is gone", addr.port());
                return Ok(addr);
            }
        }
    }
    Err(LaunchError::NoFreeAddress(port))
}

/// Whether any argument has the `{{port}}` placeholder.
pub fn has_port_placeholder(args: &[OsString]) -> bool {
    args.iter()
        .any(|a| a.to_str().is_some_and(|s| s.contains(PORT_PLACEHOLDER)))
}

/// Replaces every placeholder (`{{address}}` by the address, `{{port}}` by the port); errors
/// when there is no `{{address}}`.
pub fn substitute(
    args: &[OsString],
    address: &str,
    port: u16,
) -> Result<Vec<OsString>, LaunchError> {
    let mut found = false;
    let out = args
        .iter()
        .map(|a| match a.to_str() {
            Some(s) if s.contains(PLACEHOLDER) || s.contains(PORT_PLACEHOLDER) => {
                found |= s.contains(PLACEHOLDER);
                OsString::from(
                    s.replace(PLACEHOLDER, address)
                        .replace(PORT_PLACEHOLDER, &port.to_string()),
                )
            }
            _ => a.clone(),
        })
        .collect();
    if found {
        Ok(out)
    } else {
        Err(LaunchError::NoPlaceholder)
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Resolves a command like `execvp` would.
fn resolve(command: &OsString) -> Option<PathBuf> {
    let path = Path::new(command);
    if path.components().count() > 1 {
        return is_executable(path).then(|| path.to_path_buf());
    }
    let search = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&search)
        .map(|dir| dir.join(path))
        .find(|p| is_executable(p))
}

/// What `launch` is asked for (its flags, `cli::LaunchArgs`).
#[derive(Debug, Clone)]
pub struct Options {
    /// File that receives the chosen `ip:port` (written atomically), read by the sidecar's
    /// --own-backend-file.
    pub address_file: PathBuf,

    /// Port the command will listen on; the address is checked free for it. While a wildcard
    /// listener holds it (kubeadm's static apiserver), another free port is used if the
    /// arguments contain {{port}}.
    pub port: u16,

    /// The command and its arguments; every {{address}} becomes the chosen IP, every {{port}}
    /// the chosen port.
    pub command: Vec<std::ffi::OsString>,
}

/// Validates, picks the address, writes the file and execs. Returns only on error.
pub fn launch(args: &Options) -> LaunchError {
    let Some((command, rest)) = args.command.split_first() else {
        return LaunchError::NoCommand;
    };
    // Check everything that can be checked before touching the address file.
    if let Err(e) = substitute(rest, "0.0.0.0", args.port) {
        return e;
    }
    let Some(program) = resolve(command) else {
        return LaunchError::NotExecutable(command.to_string_lossy().into_owned());
    };
    let addr = match pick_address(args.port, has_port_placeholder(rest)) {
        Ok(a) => a,
        Err(e) => return e,
    };
    let file_err = |source| LaunchError::AddressFile {
        path: args.address_file.display().to_string(),
        source,
    };
    if let Err(e) =
        crate::base::fsutil::write_atomic(&args.address_file, format!("{addr}\n").as_bytes())
    {
        return file_err(e);
    }
    let argv = substitute(rest, &addr.ip().to_string(), addr.port()).expect("checked above");
    eprintln!("launch: {} on {addr}", program.display());
    let err = std::process::Command::new(&program).args(argv).exec();
    let _ = std::fs::remove_file(&args.address_file);
    LaunchError::Exec {
        command: program.display().to_string(),
        source: err,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn random_addresses_avoid_the_first_subnet_and_edges() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..100_000 {
            let o = random_loopback(&mut rng).octets();
            assert_eq!(o[0], 127);
            assert!(!(o[1] == 0 && o[2] == 0), "{o:?}");
            assert!(o[3] != 0 && o[3] != 255, "{o:?}");
        }
    }

    #[test]
    fn substitution_replaces_every_placeholder_and_needs_one() {
        let args: Vec<OsString> = ["--bind-address={{address}}", "--x", "{{address}}:1"]
            .map(OsString::from)
            .to_vec();
        let out = substitute(&args, "127.1.2.3", 6443).unwrap();
        assert_eq!(
            out,
            ["--bind-address=127.1.2.3", "--x", "127.1.2.3:1"]
                .map(OsString::from)
                .to_vec()
        );
        assert!(matches!(
            substitute(&args[1..2], "x", 6443),
            Err(LaunchError::NoPlaceholder)
        ));
        // {{port}} alone is not enough: the address must be substituted somewhere.
        let port_only = [OsString::from("--secure-port={{port}}")];
        assert!(matches!(
            substitute(&port_only, "x", 1),
            Err(LaunchError::NoPlaceholder)
        ));
        let both = ["--bind-address={{address}}", "--secure-port={{port}}"].map(OsString::from);
        assert_eq!(
            substitute(&both, "127.1.2.3", 40001).unwrap(),
            ["--bind-address=127.1.2.3", "--secure-port=40001"].map(OsString::from)
        );
        assert!(has_port_placeholder(&both));
        assert!(!has_port_placeholder(&args));
    }

    #[test]
    fn picked_address_is_free() {
        let addr = pick_address(6443, true).unwrap();
        TcpListener::bind(addr).unwrap();
    }

    /// A wildcard listener on the port (kubeadm's apiserver during `migrate`): another port on
    /// a random address when `{{port}}` allows it, a clear error otherwise.
    #[test]
    fn a_wildcard_listener_moves_the_port_or_fails_clearly() {
        let wildcard = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = wildcard.local_addr().unwrap().port();
        let addr = pick_address(port, true).unwrap();
        assert_ne!(addr.port(), port);
        let ip = addr.ip().to_string();
        assert!(
            ip.starts_with("127.") && !ip.starts_with("127.0.0."),
            "{addr}"
        );
        TcpListener::bind(addr).unwrap();
        assert!(matches!(
            pick_address(port, false),
            Err(LaunchError::WildcardHeld(p)) if p == port
        ));
        drop(wildcard);
        assert_eq!(pick_address(port, true).unwrap().port(), port);
    }
}
