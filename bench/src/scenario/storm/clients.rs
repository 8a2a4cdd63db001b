//! The storm's clients. Each opens one long-lived connection (after one answered exchange),
//! idle until the backend's restart ends it; then it tries again at once and backs off (from
//! `retry`, doubling up to 1 s, with jitter) until one exchange is answered on a new
//! connection, which it keeps until every client of its fleet is back.
//!
//! A [`Fleet`] runs the clients on the current runtime: in the bench process itself, or in one
//! of its client processes (`remote`), which sends each client's [`Comeback`] to the harness.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{bail, Result};
use rand::Rng;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::client::{connect, exchange};
use crate::outcome::FailureKind;

/// A client's pause after failures is at most this long.
const RETRY_MAX: Duration = Duration::from_secs(1);
/// One exchange of a client (bytes).
const PING: [u8; 16] = [0x53; 16];

/// What the clients of one fleet do.
#[derive(Debug, Clone, Copy)]
pub struct ClientOptions {
    /// Where they connect (the target).
    pub addr: SocketAddr,
    /// How many clients.
    pub connections: usize,
    /// Connections being opened at once before the restart.
    pub ramp: usize,
    /// A client's first pause after a failed attempt.
    pub retry: Duration,
    /// A client not back this long after the restart gives up (is lost).
    pub deadline: Duration,
}

/// What one client saw of the storm.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Comeback {
    /// From the restart until its new connection answered, in µs (`None`: lost).
    pub after_us: Option<u64>,
    /// Failed attempts.
    pub failed: u64,
    /// Failed attempts by kind (refused, reset, closed, timeout, other).
    pub kinds: BTreeMap<String, u64>,
}

/// The clients of one process, up or coming back.
pub struct Fleet {
    connections: usize,
    restart_at: Arc<OnceLock<Instant>>,
    clients: JoinSet<Option<(Comeback, Option<TcpStream>)>>,
    up: mpsc::Receiver<Result<(), FailureKind>>,
    /// The new connections, held until the fleet is dropped.
    held: Vec<TcpStream>,
}

impl Fleet {
    /// Starts the clients: each opens its connection (at most `ramp` at once), then waits for
    /// it to end.
    pub fn start(options: ClientOptions) -> Self {
        let n = options.connections;
        let restart_at: Arc<OnceLock<Instant>> = Arc::default();
        let mut clients = JoinSet::new();
        let (up_tx, up) = mpsc::channel(n.max(1));
        let ramp = Arc::new(Semaphore::new(options.ramp.max(1)));
        for _ in 0..n {
            let (up, ramp, restart_at) = (up_tx.clone(), ramp.clone(), restart_at.clone());
            clients.spawn(async move {
                let permit = ramp.acquire().await.expect("semaphore open");
                let mut stream = match open(options.addr).await {
                    Ok(s) => s,
                    Err(kind) => {
                        let _ = up.send(Err(kind)).await;
                        return None;
                    }
                };
                drop(permit);
                let _ = up.send(Ok(())).await;
                // Long-lived and idle until the backend's restart ends it.
                let _ = stream.read(&mut [0u8; 1]).await;
                drop(stream);
                Some(come_back(options, &restart_at).await)
            });
        }
        Self {
            connections: n,
            restart_at,
            clients,
            up,
            held: Vec::new(),
        }
    }

    /// Waits until every client's connection is up; fails on the first that could not open.
    pub async fn up(&mut self) -> Result<()> {
        let n = self.connections;
        for i in 0..n {
            match self.up.recv().await {
                Some(Ok(())) => {}
                Some(Err(kind)) => bail!("connection {} of {n} failed: {}", i + 1, kind.name()),
                None => bail!("clients ended early"),
            }
        }
        Ok(())
    }

    /// Sets the instant of the backend's restart, from which comebacks are timed (a client
    /// whose connection ends before it is set counts from its own end).
    pub fn restart(&self, at: Instant) {
        let _ = self.restart_at.set(at);
    }

    /// Waits for every client to be back or lost; keeps the new connections.
    pub async fn collect(&mut self) -> Result<Vec<Comeback>> {
        let mut comebacks = Vec::with_capacity(self.connections);
        while let Some(joined) = self.clients.join_next().await {
            let Some((comeback, stream)) = joined? else {
                continue;
            };
            comebacks.push(comeback);
            self.held.extend(stream);
        }
        Ok(comebacks)
    }
}

/// Connects and makes one exchange.
async fn open(addr: SocketAddr) -> Result<TcpStream, FailureKind> {
    let timeout = Duration::from_secs(5);
    let mut stream = connect(addr, timeout).await?;
    let mut answer = [0u8; PING.len()];
    exchange(&mut stream, &PING, &mut answer, timeout).await?;
    Ok(stream)
}

/// Reconnects until an exchange is answered (returning that connection, to be held) or the
/// deadline passes.
async fn come_back(
    options: ClientOptions,
    restart_at: &OnceLock<Instant>,
) -> (Comeback, Option<TcpStream>) {
    let started = restart_at.get().copied().unwrap_or_else(Instant::now);
    let give_up = started + options.deadline;
    let mut pause = options.retry;
    let mut comeback = Comeback::default();
    loop {
        match open(options.addr).await {
            Ok(stream) => {
                let after = Instant::now().saturating_duration_since(started);
                comeback.after_us = Some(after.as_micros() as u64);
                return (comeback, Some(stream));
            }
            Err(kind) => *comeback.kinds.entry(kind.name().to_owned()).or_insert(0) += 1,
        }
        comeback.failed += 1;
        if Instant::now() >= give_up {
            return (comeback, None);
        }
        let jittered = pause.mul_f64(rand::thread_rng().gen_range(0.5..1.5));
        tokio::time::sleep(jittered).await;
        pause = (pause * 2).min(RETRY_MAX);
    }
}
