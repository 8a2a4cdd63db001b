//! Loopback addressing and a minimal HTTP GET for readiness checks and metrics.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A random address in 127.0.0.0/8 outside 127.0.0.0/24, so that concurrent runs (and the
/// tests of other crates) do not collide on ports.
pub fn random_loopback() -> IpAddr {
    let mut rng = rand::thread_rng();
    IpAddr::V4(Ipv4Addr::new(
        127,
        rng.gen_range(1..=254),
        rng.gen(),
        rng.gen_range(1..=254),
    ))
}

/// A random loopback address with a port that was free a moment ago.
pub fn free_address() -> Result<SocketAddr> {
    let ip = random_loopback();
    let listener = TcpListener::bind((ip, 0)).with_context(|| format!("cannot bind {ip}:0"))?;
    Ok(listener.local_addr()?)
}

/// `GET path` over plain HTTP/1.0; returns the status code.
pub async fn http_status(addr: SocketAddr, path: &str, timeout: Duration) -> Result<u16> {
    Ok(http_get(addr, path, timeout).await?.0)
}

/// `GET path` over plain HTTP/1.0; returns the status code and the body.
pub async fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(u16, String)> {
    let request = async {
        let mut stream = TcpStream::connect(addr).await?;
        let head = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        anyhow::Ok(response)
    };
    let response = tokio::time::timeout(timeout, request)
        .await
        .context("timed out")??;
    let status = parse_status(&response)?;
    let body = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(&[][..], |at| &response[at + 4..]);
    Ok((status, String::from_utf8_lossy(body).into_owned()))
}

fn parse_status(response: &[u8]) -> Result<u16> {
    let line = response.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    match (words.next(), words.next()) {
        (Some(version), Some(code)) if version.starts_with("HTTP/") => {
            Ok(code.parse().context("bad status code")?)
        }
        _ => bail!("not an HTTP response: {line:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_loopback_avoids_first_subnet() {
        for _ in 0..1000 {
            let IpAddr::V4(ip) = random_loopback() else {
                panic!("not v4")
            };
            assert_eq!(ip.octets()[0], 127);
            assert_ne!(ip.octets()[1], 0);
        }
    }

    #[test]
    fn parses_status() {
        assert_eq!(
            parse_status(b"HTTP/1.1 503 Service Unavailable\r\n").unwrap(),
            503
        );
        assert_eq!(parse_status(b"HTTP/1.0 200 OK\r\n\r\nok").unwrap(), 200);
        assert!(parse_status(b"garbage").is_err());
    }
}
