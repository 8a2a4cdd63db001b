//! Typed configuration, built from the parsed command line by `TryFrom`.
//!
//! Everything that can be wrong with the input is found here, before anything is bound: the
//! error names the flag and the problem in one line, and the binary exits with code 2.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::backends::check::{HealthCheck, HealthConfig};
use crate::backends::discovery::DiscoveryConfig;
use crate::backends::tls::{self, TlsError};
use crate::backends::transparent;
use crate::base::addr::{AdminAddr, BackendAddr, ListenAddr};
use crate::cli::{
    parse_socket_addr, ClientAddress, CopyMode, HealthCheckKind, LogFormat, RunArgs, RuntimeShape,
};
use crate::handoff::HandoffConfig;

/// A configuration error: which flag, and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{flag}: {message}")]
    Invalid { flag: &'static str, message: String },
    #[error("{flag} {path}: {source}")]
    File {
        flag: &'static str,
        path: String,
        #[source]
        source: TlsError,
    },
}

impl crate::base::exit::CommandError for ConfigError {
    /// A flag or file `run` refuses: bad input, nothing bound.
    fn is_bad_input(&self) -> bool {
        true
    }
}

fn invalid(flag: &'static str, message: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        flag,
        message: message.to_string(),
    }
}

/// The whole configuration of `run`.
#[derive(Debug, Clone)]
pub struct Config {
    /// Public addresses, shared with peers via SO_REUSEPORT or handoff.
    pub listen: Vec<ListenAddr>,
    /// Static backends.
    pub backends: Vec<BackendAddr>,
    /// Own and node-local backends found at run time.
    pub discovery: DiscoveryConfig,
    /// Admin HTTP address (default 127.0.0.1:0: a free port, so instances coexist).
    pub admin_listen: AdminAddr,
    /// File the bound admin address is written to.
    pub admin_address_file: Option<PathBuf>,
    /// Node-wide scrape address shared by the instances on the node (`None`: not served).
    pub metrics_listen: Option<SocketAddr>,
    /// Labels added to every metric of this instance (`--metrics-label`).
    pub metrics_labels: Vec<(String, String)>,
    /// How long the other instances' metrics are reused between scrapes of `metrics_listen`
    /// (default 10s).
    pub metrics_cache: Duration,
    /// TLS for `metrics_listen`, with client certificates required (`None`: plain HTTP).
    pub metrics_tls: Option<Arc<rustls::ServerConfig>>,
    /// Active health checking.
    pub health: HealthConfig,
    /// Backend connect timeout (default 3s).
    pub connect_timeout: Duration,
    /// How long established connections may go on after SIGTERM (default 30s).
    pub drain_timeout: Duration,
    /// Connections left at the drain deadline are closed over this window (default 2s).
    pub drain_close_window: Duration,
    /// Most connections carried at once (default 10000).
    pub max_connections: NonZeroU32,
    /// Runtime worker threads (default: CPUs available).
    pub worker_threads: std::num::NonZeroUsize,
    /// The scheduling slice the worker threads ask for (`None`: the kernel's default).
    pub worker_slice: Option<std::time::Duration>,
    /// A runtime and a socket per worker thread (default), or one shared multi-threaded
    /// runtime.
    pub runtime: RuntimeShape,
    /// How bytes are moved (default auto: buffered for small bursts, splice for bulk).
    pub copy_mode: crate::data::copy::Mode,
    /// Which address the apiservers see for a client (default `proxy`: the proxy's own).
    pub client_address: ClientAddress,
    /// `--user`: the uid and gid to switch to at start (`None`: stay).
    pub user: Option<(u32, u32)>,
    /// Listener handoff; `None` in plain standalone use.
    pub handoff: Option<HandoffConfig>,
    /// Recovery instance: the file written once a ready peer serves (`--retire-file`).
    pub retire_file: Option<PathBuf>,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter directive.
    pub log_level: String,
    /// A fault planted on purpose (the real-cluster tier's self-test).
    #[cfg(feature = "planted-faults")]
    pub planted_fault: Option<crate::fault::Fault>,
}

fn parse_addrs(flag: &'static str, values: &[String]) -> Result<Vec<SocketAddr>, ConfigError> {
    values
        .iter()
        .map(|v| parse_socket_addr(v).map_err(|m| invalid(flag, m)))
        .collect()
}

fn non_zero(flag: &'static str, n: u32) -> Result<NonZeroU32, ConfigError> {
    NonZeroU32::new(n).ok_or_else(|| invalid(flag, "must be at least 1"))
}

impl TryFrom<RunArgs> for Config {
    type Error = ConfigError;

    /// Checks the flags in the order they are listed here, reporting the first that is wrong.
    fn try_from(args: RunArgs) -> Result<Self, ConfigError> {
        let listen = listen_addrs(&args)?;
        let backends = backend_addrs(&args)?;
        let admin_listen = admin_addr(&args, &listen)?;
        let scrape = NodeScrape::try_from_args(&args, &listen, admin_listen)?;
        let rise = non_zero("--health-rise", args.health_rise)?;
        let fall = non_zero("--health-fall", args.health_fall)?;
        let max_connections = non_zero("--max-connections", args.max_connections)?;
        let health = health_config(&args, rise, fall)?;
        let user = user(&args)?;
        let handoff = handoff(&args, user)?;
        check_log_level(&args.log_level)?;
        Ok(Config {
            listen: listen.into_iter().map(ListenAddr).collect(),
            backends: backends.into_iter().map(BackendAddr).collect(),
            discovery: DiscoveryConfig {
                own_backend_file: args.own_backend_file,
                backend_dir: args.backend_dir,
                expiry: args.backend_expiry,
            },
            admin_listen: AdminAddr(admin_listen),
            admin_address_file: args.admin_address_file,
            metrics_listen: scrape.listen,
            metrics_labels: scrape.labels,
            metrics_cache: args.metrics_cache,
            metrics_tls: scrape.tls,
            health,
            connect_timeout: args.connect_timeout,
            drain_timeout: args.drain_timeout,
            drain_close_window: args.drain_close_window,
            max_connections,
            worker_threads: worker_threads(args.worker_threads)?,
            worker_slice: worker_slice(args.worker_slice)?,
            runtime: args.runtime,
            copy_mode: match args.copy_mode {
                CopyMode::Auto => crate::data::copy::Mode::Auto,
                CopyMode::Splice => crate::data::copy::Mode::Splice,
                CopyMode::Buffered => crate::data::copy::Mode::Buffered,
            },
            client_address: args.client_address,
            user,
            handoff,
            retire_file: args.retire_file,
            log_format: args.log_format,
            log_level: args.log_level,
            #[cfg(feature = "planted-faults")]
            planted_fault: args.planted_fault,
        })
    }
}

/// `--listen` and `--listen-host` (with `--listen-port`): at least one, each once, none on
/// port 0 (peers could not share it).
fn listen_addrs(args: &RunArgs) -> Result<Vec<SocketAddr>, ConfigError> {
    let mut listen = parse_addrs("--listen", &args.listen)?;
    for host in &args.listen_host {
        let ip = host
            .trim()
            .parse::<std::net::IpAddr>()
            .map_err(|_| invalid("--listen-host", format!("{host:?} is not an IP address")))?;
        listen.push(SocketAddr::new(ip, args.listen_port));
    }
    if listen.is_empty() {
        return Err(invalid(
            "--listen",
            "at least one address is required (--listen or --listen-host)",
        ));
    }
    let mut seen = HashSet::new();
    for addr in &listen {
        if !seen.insert(*addr) {
            return Err(invalid("--listen", format!("{addr} is given twice")));
        }
        if addr.port() == 0 {
            return Err(invalid(
                "--listen",
                format!("{addr}: port 0 cannot be shared with peers"),
            ));
        }
    }
    Ok(listen)
}

/// `--backend`: some backend must come from somewhere (or discovery); `--backend-expiry`.
/// With `--client-address transparent`, none in 127.0.0.0/24: the policy routing leaves that
/// range to the host's own traffic, so the mode could never keep a client's address there
/// (and a remote client's transparent connect would wait out `--connect-timeout`).
fn backend_addrs(args: &RunArgs) -> Result<Vec<SocketAddr>, ConfigError> {
    let backends = parse_addrs("--backend", &args.backend)?;
    if args.client_address == ClientAddress::Transparent {
        if let Some(b) = backends.iter().find(|b| transparent::in_host_range(b.ip())) {
            return Err(invalid(
                "--backend",
                format!("{b} is in 127.0.0.0/24, where --client-address transparent cannot keep client addresses (its policy routing leaves that range to the host's own traffic): bind the apiserver outside it, as launch does"),
            ));
        }
    }
    if backends.is_empty() && args.own_backend_file.is_none() && args.backend_dir.is_none() {
        return Err(invalid(
            "--backend",
            "no backend given (need --backend, --own-backend-file or --backend-dir)",
        ));
    }
    if args.backend_expiry.is_zero() {
        return Err(invalid("--backend-expiry", "must be greater than zero"));
    }
    Ok(backends)
}

/// `--admin-listen`, never one of the public addresses.
fn admin_addr(args: &RunArgs, listen: &[SocketAddr]) -> Result<SocketAddr, ConfigError> {
    let admin_listen =
        parse_socket_addr(&args.admin_listen).map_err(|m| invalid("--admin-listen", m))?;
    if listen.contains(&admin_listen) {
        return Err(invalid(
            "--admin-listen",
            format!("{admin_listen} is also a --listen address"),
        ));
    }
    Ok(admin_listen)
}

/// The node's scrape endpoint and the labels of every series.
struct NodeScrape {
    /// `--metrics-label`s.
    labels: Vec<(String, String)>,
    /// `--metrics-listen`.
    listen: Option<SocketAddr>,
    /// `--metrics-tls-*`.
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl NodeScrape {
    /// `--metrics-label`, `--metrics-listen` (a fixed port of its own, with `--handoff-dir`
    /// and a label that tells the instances apart), `--metrics-tls-*`, `--metrics-cache`.
    fn try_from_args(
        args: &RunArgs,
        listen: &[SocketAddr],
        admin_listen: SocketAddr,
    ) -> Result<Self, ConfigError> {
        let labels = args
            .metrics_label
            .iter()
            .map(|l| metrics_label(l).map_err(|m| invalid("--metrics-label", m)))
            .collect::<Result<Vec<_>, _>>()?;
        let metrics_listen = match &args.metrics_listen {
            None => None,
            Some(text) => {
                let addr = parse_socket_addr(text).map_err(|m| invalid("--metrics-listen", m))?;
                if addr.port() == 0 || listen.contains(&addr) || addr == admin_listen {
                    return Err(invalid(
                        "--metrics-listen",
                        format!("{addr}: needs a fixed port of its own (not --listen's or --admin-listen's)"),
                    ));
                }
                if args.handoff_dir.is_none() {
                    return Err(invalid(
                        "--metrics-listen",
                        "needs --handoff-dir (the instances of the node find each other there)",
                    ));
                }
                if labels.is_empty() {
                    return Err(invalid(
                        "--metrics-listen",
                        "needs a --metrics-label that tells the instances apart, e.g. pod=$(POD_NAME)",
                    ));
                }
                Some(addr)
            }
        };
        let tls = metrics_tls(args)?;
        if tls.is_some() && metrics_listen.is_none() {
            return Err(invalid(
                "--metrics-tls-cert-file",
                "needs --metrics-listen (the address it secures)",
            ));
        }
        if args.metrics_cache.is_zero() {
            return Err(invalid("--metrics-cache", "must be greater than zero"));
        }
        Ok(NodeScrape {
            labels,
            listen: metrics_listen,
            tls,
        })
    }
}

/// The health checks (`--health-*`, with `rise` and `fall` checked already), and
/// `--connect-timeout`, checked among them.
fn health_config(
    args: &RunArgs,
    rise: NonZeroU32,
    fall: NonZeroU32,
) -> Result<HealthConfig, ConfigError> {
    if args.health_interval.is_zero() {
        return Err(invalid("--health-interval", "must be greater than zero"));
    }
    if args.health_timeout.is_zero() {
        return Err(invalid("--health-timeout", "must be greater than zero"));
    }
    if args.connect_timeout.is_zero() {
        return Err(invalid("--connect-timeout", "must be greater than zero"));
    }
    if !args.health_path.starts_with('/') {
        return Err(invalid(
            "--health-path",
            format!("{:?} must start with /", args.health_path),
        ));
    }
    Ok(HealthConfig {
        check: health_check(args)?,
        interval: args.health_interval,
        timeout: args.health_timeout,
        rise,
        fall,
    })
}

/// `--user UID[:GID]`: the uid and gid to switch to at start.
fn user(args: &RunArgs) -> Result<Option<(u32, u32)>, ConfigError> {
    args.user
        .as_deref()
        .map(crate::instance::privileges::parse_user)
        .transpose()
        .map_err(|m| invalid("--user", m))
}

/// The listener handoff: `--handoff-dir` (checked now unless `--user` switches first, `user`),
/// `--handoff-allow-uid`, `--retire-file`.
fn handoff(args: &RunArgs, user: Option<(u32, u32)>) -> Result<Option<HandoffConfig>, ConfigError> {
    if args.handoff_dir.is_none() && !args.handoff_allow_uid.is_empty() {
        return Err(invalid("--handoff-allow-uid", "needs --handoff-dir"));
    }
    // With --user the directory is checked after the switch, by the uid that uses it: a
    // root left with only the capabilities it keeps may not even look into it.
    if let (Some(dir), None) = (&args.handoff_dir, user) {
        crate::handoff::check_dir(dir).map_err(|e| {
            invalid(
                "--handoff-dir",
                e.to_string()
                    .trim_start_matches("--handoff-dir ")
                    .to_string(),
            )
        })?;
    }
    if args.retire_file.is_some() && args.handoff_dir.is_none() {
        return Err(invalid(
            "--retire-file",
            "needs --handoff-dir (ready peers are found there)",
        ));
    }
    Ok(args.handoff_dir.clone().map(|dir| HandoffConfig {
        dir,
        allow_uids: args.handoff_allow_uid.clone(),
    }))
}

/// `--log-level` must be a filter the logger takes.
fn check_log_level(level: &str) -> Result<(), ConfigError> {
    if level.parse::<tracing_subscriber::EnvFilter>().is_err() {
        return Err(invalid(
            "--log-level",
            format!("{level:?} is not a log filter"),
        ));
    }
    Ok(())
}

/// `--worker-threads`; by default one per CPU available.
fn worker_threads(n: Option<usize>) -> Result<std::num::NonZeroUsize, ConfigError> {
    match n {
        Some(n) => std::num::NonZeroUsize::new(n)
            .ok_or_else(|| invalid("--worker-threads", "must be at least 1")),
        None => Ok(std::thread::available_parallelism().unwrap_or(std::num::NonZeroUsize::MIN)),
    }
}

/// `--worker-slice`: 0 for the kernel's default, else within what the kernel takes.
fn worker_slice(slice: std::time::Duration) -> Result<Option<std::time::Duration>, ConfigError> {
    use std::time::Duration;
    if slice.is_zero() {
        return Ok(None);
    }
    if !(Duration::from_micros(100)..=Duration::from_millis(100)).contains(&slice) {
        return Err(invalid(
            "--worker-slice",
            format!(
                "{} is outside 100us..100ms (or 0 for the kernel's default)",
                humantime::format_duration(slice)
            ),
        ));
    }
    Ok(Some(slice))
}

/// Label names the metrics use themselves (a second label of the same name would make the
/// exposition invalid).
const RESERVED_LABELS: &[&str] = &[
    "backend",
    "direction",
    "reason",
    "result",
    "state",
    "version",
    "le",
    "quantile",
];

/// Parses `NAME=VALUE` of `--metrics-label`: a Prometheus label name that the metrics do not
/// use themselves.
fn metrics_label(text: &str) -> Result<(String, String), LabelError> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| LabelError::NotNameValue(text.to_owned()))?;
    let valid = name
        .chars()
        .enumerate()
        .all(|(i, c)| c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()));
    if name.is_empty() || !valid || name.starts_with("__") {
        return Err(LabelError::Name(name.to_owned()));
    }
    if RESERVED_LABELS.contains(&name) {
        return Err(LabelError::Reserved(name.to_owned()));
    }
    if value.is_empty() {
        return Err(LabelError::EmptyValue(name.to_owned()));
    }
    Ok((name.to_owned(), value.to_owned()))
}

/// Why a `--metrics-label` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("{0:?}: expected NAME=VALUE")]
    NotNameValue(String),
    #[error("{0:?} is not a label name")]
    Name(String),
    #[error("{0:?} is a label of the metrics themselves")]
    Reserved(String),
    #[error("{0}: empty value")]
    EmptyValue(String),
}

/// `--metrics-tls-cert-file`, `--metrics-tls-key-file` and `--metrics-client-ca-file`: all
/// three or none (TLS on the scrape address always authenticates the scraper).
/// `--metrics-tls-cert-file`, `--metrics-tls-key-file` and `--metrics-client-ca-file`
/// ([`crate::observe::scrape::tls_config`]).
fn metrics_tls(args: &RunArgs) -> Result<Option<Arc<rustls::ServerConfig>>, ConfigError> {
    crate::observe::scrape::tls_config(
        args.metrics_tls_cert_file.as_ref(),
        args.metrics_tls_key_file.as_ref(),
        args.metrics_client_ca_file.as_ref(),
    )
    .map_err(|e| match e {
        crate::observe::scrape::TlsConfigError::Missing { flag, message } => invalid(flag, message),
        crate::observe::scrape::TlsConfigError::File { flag, path, source } => {
            ConfigError::File { flag, path, source }
        }
    })
}

fn health_check(args: &RunArgs) -> Result<HealthCheck, ConfigError> {
    let kind = args.health_check;
    if kind == HealthCheckKind::Tcp {
        return Ok(HealthCheck::Tcp);
    }
    let file_err = |flag: &'static str, path: &PathBuf| {
        let path = path.display().to_string();
        move |source| ConfigError::File { flag, path, source }
    };
    let roots = match (&args.health_ca_file, args.health_insecure_skip_verify) {
        (Some(_), true) => {
            return Err(invalid(
                "--health-ca-file",
                "conflicts with --health-insecure-skip-verify (choose one)",
            ))
        }
        (Some(path), false) => {
            Some(tls::load_roots(path).map_err(file_err("--health-ca-file", path))?)
        }
        (None, true) => None,
        (None, false) => {
            return Err(invalid(
                "--health-check",
                "https and tls checks need --health-ca-file or --health-insecure-skip-verify",
            ))
        }
    };
    let client = match (&args.health_client_cert, &args.health_client_key) {
        (Some(cert), Some(key)) => Some((
            tls::load_certs(cert).map_err(file_err("--health-client-cert", cert))?,
            tls::load_key(key).map_err(file_err("--health-client-key", key))?,
        )),
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid("--health-client-cert", "needs --health-client-key"))
        }
        (None, Some(_)) => {
            return Err(invalid("--health-client-key", "needs --health-client-cert"))
        }
    };
    let tls = tls::client_config(roots, client)
        .map_err(|e| invalid("--health-client-key", e.to_string()))?;
    let server_name = rustls::pki_types::ServerName::try_from(args.health_server_name.clone())
        .map_err(|e| invalid("--health-server-name", e.to_string()))?;
    Ok(match kind {
        HealthCheckKind::Https => HealthCheck::Https {
            tls,
            server_name,
            path: args.health_path.clone(),
        },
        HealthCheckKind::Tls => HealthCheck::Tls { tls, server_name },
        HealthCheckKind::Tcp => HealthCheck::Tcp,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec!["kube-apiserver-proxy", "run"];
        argv.extend_from_slice(args);
        let cli = crate::cli::Cli::try_parse_from(argv).expect("clap accepts");
        match cli.command {
            Some(crate::cli::Command::Run(run)) => Config::try_from(*run),
            _ => unreachable!(),
        }
    }

    #[test]
    fn minimal_tcp_config() {
        let c = parse(&[
            "--listen",
            "127.0.0.1:6443",
            "--backend",
            "127.1.2.3:6443",
            "--health-check",
            "tcp",
        ])
        .unwrap();
        assert_eq!(c.listen.len(), 1);
        assert_eq!(c.health.rise.get(), 2);
        assert_eq!(c.health.interval, Duration::from_secs(2));
    }

    #[test]
    fn node_addresses_of_either_family_and_both() {
        let tcp = ["--backend", "127.1.2.3:6443", "--health-check", "tcp"];
        let listen = |args: &[&str]| -> Vec<String> {
            let mut all = args.to_vec();
            all.extend_from_slice(&tcp);
            let c = parse(&all).unwrap();
            c.listen.iter().map(|l| l.to_string()).collect()
        };
        // One manifest line, `[$(HOST_IP)]:6443`, for an IPv4 and an IPv6 node.
        assert_eq!(
            listen(&["--listen", "[192.0.2.10]:6443"]),
            ["192.0.2.10:6443"]
        );
        assert_eq!(
            listen(&["--listen", "[fd00::10]:6443"]),
            ["[fd00::10]:6443"]
        );
        // `$(HOST_IPS)` (status.hostIPs) on a dual-stack node: both addresses, one port.
        assert_eq!(
            listen(&[
                "--listen-host",
                "192.0.2.10,fd00::10",
                "--listen-port",
                "6443",
                "--listen",
                "127.0.0.1:6443",
            ]),
            ["127.0.0.1:6443", "192.0.2.10:6443", "[fd00::10]:6443"]
        );
        // What `$(HOST_IP):6443` gives on an IPv6 node: rejected, naming the bracketed form.
        let mut args = vec!["--listen", "fd00::10:6443"];
        args.extend_from_slice(&tcp);
        let e = parse(&args).unwrap_err().to_string();
        assert!(
            e.contains("--listen") && e.contains("[$(HOST_IP)]:PORT"),
            "{e}"
        );
        let mut args = vec!["--listen-host", "192.0.2.10:6443"];
        args.extend_from_slice(&tcp);
        let e = parse(&args).unwrap_err().to_string();
        assert!(e.contains("--listen-host"), "{e}");
    }

    #[test]
    fn errors_name_the_flag() {
        let cases: &[(&[&str], &str)] = &[
            (
                &[
                    "--listen",
                    "nope",
                    "--backend",
                    "127.0.0.1:1",
                    "--health-check",
                    "tcp",
                ],
                "--listen",
            ),
            (
                &["--listen", "127.0.0.1:1", "--health-check", "tcp"],
                "--backend",
            ),
            (
                &["--listen", "127.0.0.1:1", "--backend", "127.0.0.1:2"],
                "--health-check",
            ),
            (
                &[
                    "--listen",
                    "127.0.0.1:1",
                    "--backend",
                    "127.0.0.1:2",
                    "--health-ca-file",
                    "/nonexistent/ca.pem",
                ],
                "--health-ca-file",
            ),
        ];
        // A valid command line; the cases below add one flag before or after it.
        let valid = [
            "--listen",
            "127.0.0.1:1",
            "--backend",
            "127.0.0.1:2",
            "--health-check",
            "tcp",
        ];
        let valid_and = |extra: &[&'static str]| [&valid, extra].concat();
        let listen_twice = [&["--listen", "127.0.0.1:1"], &valid[..]].concat();
        let zero_rise = valid_and(&["--health-rise", "0"]);
        let no_dir = valid_and(&[
            "--metrics-listen",
            "127.0.0.1:3",
            "--metrics-label",
            "pod=a",
        ]);
        let no_label = valid_and(&[
            "--metrics-listen",
            "127.0.0.1:3",
            "--handoff-dir",
            "/nonexistent",
        ]);
        let port_zero = valid_and(&["--metrics-listen", "127.0.0.1:0"]);
        let reserved = valid_and(&["--metrics-label", "backend=x"]);
        let bad_name = valid_and(&["--metrics-label", "1pod=x"]);
        let bad_user = valid_and(&["--user", "nobody"]);
        let cases: Vec<(&[&str], &str)> = cases
            .iter()
            .copied()
            .chain([
                (&listen_twice[..], "--listen"),
                (&zero_rise[..], "--health-rise"),
                (&no_dir[..], "--metrics-listen"),
                (&no_label[..], "--metrics-listen"),
                (&port_zero[..], "--metrics-listen"),
                (&reserved[..], "--metrics-label"),
                (&bad_name[..], "--metrics-label"),
                (&bad_user[..], "--user"),
            ])
            .collect();
        for (args, flag) in &cases {
            let err = parse(args).unwrap_err().to_string();
            assert!(err.starts_with(flag), "{args:?}: {err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }

    /// The transparent mode's routing leaves 127.0.0.0/24 to the host: a backend there is
    /// refused with the mode, and only with it; 127.0.1.0 and beyond (launch's) are taken.
    #[test]
    fn transparent_mode_refuses_a_backend_in_the_hosts_range() {
        let with = |backend: &'static str, mode: &'static str| {
            parse(&[
                "--listen",
                "192.0.2.10:6443",
                "--backend",
                "127.1.2.3:6443",
                "--backend",
                backend,
                "--health-check",
                "tcp",
                "--client-address",
                mode,
            ])
        };
        let err = with("127.0.0.77:6443", "transparent")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("--backend: 127.0.0.77:6443 is in 127.0.0.0/24"),
            "{err}"
        );
        assert!(with("127.0.0.77:6443", "proxy").is_ok());
        assert!(with("127.0.1.1:6443", "transparent").is_ok());
        assert!(with("[::1]:6443", "transparent").is_ok());
        assert!(with("192.0.2.20:6443", "transparent").is_ok());
    }
}
