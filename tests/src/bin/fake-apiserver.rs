//! `fake-apiserver`: the in-process fake kube-apiserver as a separate process.
//!
//! Accepts kube-apiserver's own flags where they overlap (`--bind-address IP --secure-port
//! PORT`, `--tls-cert-file`, `--tls-private-key-file`, `--client-ca-file`) so it can stand in
//! for kube-apiserver under `kube-apiserver-proxy launch`, plus shorter ones:
//!
//! ```text
//! fake-apiserver --listen ADDR --cert F --key F [--client-ca F] [--ready-file F]
//!                [--address-file F] [--mode https|echo|sink] [--watch-interval-ms N]
//!                [--permit-port-sharing[=true]]
//! ```
//!
//! With `--ready-file`, `/readyz` answers 200 only while that file exists, and never after
//! SIGTERM. Prints `listening on ADDR` on stdout once bound; exits 0 on SIGTERM or SIGINT.

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use kube_apiserver_proxy_tests::fake_apiserver::{FakeApiserver, FakeApiserverBuilder};
use rustls::RootCertStore;
use tokio::signal::unix::{signal, SignalKind};

#[derive(Default)]
struct Args {
    listen: Option<SocketAddr>,
    bind_address: Option<IpAddr>,
    secure_port: Option<u16>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
    ready_file: Option<PathBuf>,
    address_file: Option<PathBuf>,
    mode: String,
    watch_interval_ms: Option<u64>,
    /// Like kube-apiserver: after SIGTERM, /readyz fails at once and serving goes on this long.
    shutdown_delay: Duration,
    /// kube-apiserver's `--permit-port-sharing`: bind with SO_REUSEPORT.
    permit_port_sharing: bool,
}

/// Parses `500ms`, `5s`, `1m` (the forms kube-apiserver manifests use).
fn parse_duration(s: &str) -> Result<Duration> {
    let (number, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = number
        .parse()
        .with_context(|| format!("{s:?} is not a duration"))?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "s" | "" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        _ => bail!("{s:?}: unknown unit"),
    })
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        mode: "https".into(),
        ..Args::default()
    };
    let mut raw = std::env::args().skip(1);
    while let Some(arg) = raw.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag.to_owned(), Some(value.to_owned())),
            None => (arg.clone(), None),
        };
        let mut value = || -> Result<String> {
            match inline.clone() {
                Some(value) => Ok(value),
                None => raw.next().with_context(|| format!("{flag}: missing value")),
            }
        };
        match flag.as_str() {
            "--listen" => args.listen = Some(value()?.parse().context("--listen")?),
            "--bind-address" => {
                args.bind_address = Some(value()?.parse().context("--bind-address")?)
            }
            "--secure-port" => args.secure_port = Some(value()?.parse().context("--secure-port")?),
            "--cert" | "--tls-cert-file" => args.cert = Some(value()?.into()),
            "--key" | "--tls-private-key-file" => args.key = Some(value()?.into()),
            "--client-ca" | "--client-ca-file" => args.client_ca = Some(value()?.into()),
            "--ready-file" => args.ready_file = Some(value()?.into()),
            "--address-file" => args.address_file = Some(value()?.into()),
            "--mode" => args.mode = value()?,
            "--permit-port-sharing" => {
                args.permit_port_sharing = inline.as_deref().is_none_or(|v| v == "true")
            }
            "--watch-interval-ms" => {
                args.watch_interval_ms = Some(value()?.parse().context("--watch-interval-ms")?)
            }
            "-h" | "--help" => {
                println!(
                    "fake-apiserver --listen ADDR | --bind-address IP --secure-port PORT\n  \
                     --cert F --key F [--client-ca F] [--ready-file F] [--address-file F]\n  \
                     [--mode https|echo|sink] [--watch-interval-ms N]"
                );
                std::process::exit(0);
            }
            "--shutdown-delay-duration" => {
                args.shutdown_delay =
                    parse_duration(&value()?).context("--shutdown-delay-duration")?
            }
            // Any other kube-apiserver flag (`--etcd-servers=…`, `--authorization-mode=…`) is
            // accepted and ignored, so the exact arguments of a manifest can be rehearsed.
            other if other.starts_with("--") => {
                eprintln!("fake-apiserver: ignoring {arg}");
            }
            other => bail!("unexpected argument {other}"),
        }
    }
    Ok(args)
}

fn read_pem_certs(path: &PathBuf) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    let pem = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parse {}", path.display()))?;
    anyhow::ensure!(!certs.is_empty(), "{}: no certificate", path.display());
    Ok(certs)
}

fn builder(args: &Args) -> Result<FakeApiserverBuilder> {
    let addr = match (args.listen, args.bind_address, args.secure_port) {
        (Some(addr), None, None) => addr,
        (None, ip, port) => SocketAddr::new(
            ip.unwrap_or(IpAddr::from([127, 0, 0, 1])),
            port.unwrap_or(6443),
        ),
        _ => bail!("--listen excludes --bind-address/--secure-port"),
    };
    let mut builder = match args.mode.as_str() {
        "echo" => FakeApiserver::tcp_echo(),
        "sink" => FakeApiserver::tcp_sink(),
        "https" => {
            let cert = args.cert.as_ref().context("--cert is required")?;
            let key_path = args.key.as_ref().context("--key is required")?;
            let key_pem =
                std::fs::read(key_path).with_context(|| format!("read {}", key_path.display()))?;
            let key = rustls_pemfile::private_key(&mut key_pem.as_slice())?
                .with_context(|| format!("{}: no private key", key_path.display()))?;
            let mut builder = FakeApiserver::https_with_identity(read_pem_certs(cert)?, key);
            if let Some(ca) = &args.client_ca {
                let mut roots = RootCertStore::empty();
                for cert in read_pem_certs(ca)? {
                    roots.add(cert)?;
                }
                builder = builder.require_client_cert(roots);
            }
            builder
        }
        other => bail!("--mode {other}: expected https, echo or sink"),
    };
    builder = builder.bind(addr).reuse_port(args.permit_port_sharing);
    if let Some(file) = &args.ready_file {
        builder = builder.ready_file(file);
    }
    if let Some(ms) = args.watch_interval_ms {
        builder = builder.watch_interval(Duration::from_millis(ms));
    }
    Ok(builder)
}

async fn run() -> Result<()> {
    let args = parse_args()?;
    let fake = builder(&args)?.start().await?;
    if let Some(file) = &args.address_file {
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, format!("{}\n", fake.addr()))?;
        std::fs::rename(&tmp, file)?;
    }
    println!("listening on {}", fake.addr());
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    if !args.shutdown_delay.is_zero() {
        fake.set_ready(false);
        eprintln!(
            "fake-apiserver: shutting down in {:?} (not ready)",
            args.shutdown_delay
        );
        tokio::time::sleep(args.shutdown_delay).await;
    }
    fake.vanish().await;
    Ok(())
}

#[tokio::main]
async fn main() {
    if let Err(error) = run().await {
        eprintln!("fake-apiserver: {error:#}");
        std::process::exit(2);
    }
}
