//! Bounded load generators for handoff and rollout tests: clients that open a new connection
//! per request through the shared address and record every failure ([`Load`]: raw TCP echo,
//! failures classified; [`HttpsLoad`]: TLS `GET /version`).
//!
//! Each request connects, sends 8 bytes, reads the 8-byte echo and closes. A failure is
//! `refused` (connect refused), `reset` (reset or closed before the answer), `timeout`, or
//! `other`, and is recorded with when its connect started, so a test can tell failures of
//! connections that existed before some instant from those started after it.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// Time one connect or one answer may take before it counts as a timeout.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    Refused,
    Reset,
    Timeout,
    Other,
}

/// One failed request.
#[derive(Debug, Clone)]
pub struct Failure {
    pub kind: FailureKind,
    /// When its connect started.
    pub started: Instant,
    /// Whether the TCP connect had succeeded.
    pub connected: bool,
    /// The client's own address, once connected: the proxy instance that accepted the
    /// connection sees it as its peer address.
    pub local: Option<SocketAddr>,
    pub error: String,
}

/// What a load run saw.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    pub ok: u64,
    pub failures: Vec<Failure>,
}

impl LoadReport {
    pub fn count(&self, kind: FailureKind) -> usize {
        self.failures.iter().filter(|f| f.kind == kind).count()
    }

    /// One line: requests and failures by kind.
    pub fn summary(&self) -> String {
        format!(
            "{} requests ok, {} failed (refused {}, reset {}, timeout {}, other {})",
            self.ok,
            self.failures.len(),
            self.count(FailureKind::Refused),
            self.count(FailureKind::Reset),
            self.count(FailureKind::Timeout),
            self.count(FailureKind::Other),
        )
    }
}

struct Shared {
    stop: AtomicBool,
    ok: AtomicU64,
    failures: Mutex<Vec<Failure>>,
}

/// Running clients; stopped with [`Load::stop`].
pub struct Load {
    shared: Arc<Shared>,
    clients: Vec<JoinHandle<()>>,
}

fn classify(e: &io::Error) -> FailureKind {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => FailureKind::Refused,
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::UnexpectedEof => FailureKind::Reset,
        io::ErrorKind::TimedOut => FailureKind::Timeout,
        _ => FailureKind::Other,
    }
}

async fn one_request(addr: SocketAddr, n: u64) -> Result<(), (Option<SocketAddr>, io::Error)> {
    let timeout = |what: &str| io::Error::new(io::ErrorKind::TimedOut, what.to_string());
    let mut stream = match tokio::time::timeout(REQUEST_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err((None, e)),
        Err(_) => return Err((None, timeout("connect timed out"))),
    };
    let local = stream.local_addr().ok();
    let request = n.to_be_bytes();
    let work = async {
        stream.write_all(&request).await?;
        let mut answer = [0u8; 8];
        stream.read_exact(&mut answer).await?;
        if answer != request {
            return Err(io::Error::other("wrong echo"));
        }
        Ok(())
    };
    match tokio::time::timeout(REQUEST_TIMEOUT, work).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err((local, e)),
        Err(_) => Err((local, timeout("answer timed out"))),
    }
}

impl Load {
    /// Starts `clients` clients against `addr`.
    pub fn start(addr: SocketAddr, clients: usize) -> Load {
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            ok: AtomicU64::new(0),
            failures: Mutex::new(Vec::new()),
        });
        let clients = (0..clients)
            .map(|c| {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let mut n = (c as u64) << 32;
                    while !shared.stop.load(Ordering::Relaxed) {
                        n += 1;
                        let started = Instant::now();
                        match one_request(addr, n).await {
                            Ok(()) => {
                                shared.ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Err((local, e)) => {
                                shared.failures.lock().unwrap().push(Failure {
                                    kind: classify(&e),
                                    started,
                                    connected: local.is_some(),
                                    local,
                                    error: e.to_string(),
                                });
                            }
                        }
                    }
                })
            })
            .collect();
        Load { shared, clients }
    }

    /// Requests completed so far.
    pub fn ok(&self) -> u64 {
        self.shared.ok.load(Ordering::Relaxed)
    }

    /// Failures so far.
    pub fn failed(&self) -> usize {
        self.shared.failures.lock().unwrap().len()
    }

    /// Stops the clients (each finishes its request in flight) and reports.
    pub async fn stop(self) -> LoadReport {
        self.shared.stop.store(true, Ordering::Relaxed);
        for c in self.clients {
            let _ = c.await;
        }
        LoadReport {
            ok: self.shared.ok.load(Ordering::Relaxed),
            failures: self.shared.failures.lock().unwrap().clone(),
        }
    }
}

/// Clients opening a new TLS connection per request (`GET /version`, answer checked) through
/// one address, as kubectl and controllers would; every failure is recorded as text.
pub struct HttpsLoad {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    clients: Vec<JoinHandle<()>>,
}

impl HttpsLoad {
    /// Starts `clients` clients against `addr`.
    pub fn start(addr: SocketAddr, client: crate::client::HttpsClient, clients: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let clients = (0..clients)
            .map(|_| {
                let (stop, ok, failures, client) =
                    (stop.clone(), ok.clone(), failures.clone(), client.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match client.get(addr, "/version").await {
                            Ok((200, body)) if body.contains("gitVersion") => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok((code, body)) => failures
                                .lock()
                                .unwrap()
                                .push(format!("HTTP {code}: {body}")),
                            Err(e) => failures.lock().unwrap().push(format!("{e:#}")),
                        }
                    }
                })
            })
            .collect();
        HttpsLoad {
            stop,
            ok,
            failures,
            clients,
        }
    }

    /// Requests that succeeded so far.
    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    /// Waits until `more` further requests have succeeded (at most 30 s).
    pub async fn wait_progress(&self, more: u64) -> anyhow::Result<()> {
        let target = self.ok() + more;
        crate::util::eventually(Duration::from_secs(30), || async {
            anyhow::ensure!(
                self.ok() >= target,
                "load at {} ok, waiting for {target}",
                self.ok()
            );
            Ok(())
        })
        .await
    }

    /// Stops the clients (each finishes its request in flight): successes and failures.
    pub async fn stop(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for client in self.clients {
            let _ = client.await;
        }
        let failures = self.failures.lock().unwrap().clone();
        (self.ok.load(Ordering::Relaxed), failures)
    }
}
