//! Long-lived streams through an echo backend that check every byte: each stream sends a
//! counting sequence of u64s (one message every `interval`, of `words` u64s) and reads the echo
//! back on its own task, which checks that the sequence arrives complete, in order and without
//! duplicates. At the end each stream half-closes, reads the rest until EOF and checks that
//! everything sent came back. Any error, early EOF or wrong word is a stream cut; so is a
//! stream that moves nothing for [`STALL`] (a hang: a connection kept open and no longer
//! relayed).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// How long a stream may go without its echo, or with a write blocked, before it counts as
/// hung. Not a timing goal: a relayed connection always moves again, a hung one never does.
/// On the 2-core machine with six busy loops beside the upgrade proof, the bulk streams' writes
/// (64 KiB every 10 ms) were blocked up to 10.1 s, 16 times over 100 upgrades, and each went
/// on; a bound of 10 s failed such runs.
pub const STALL: Duration = Duration::from_secs(60);

/// What the streams saw.
#[derive(Debug, Clone, Default)]
pub struct StreamsReport {
    pub streams: usize,
    /// u64 words echoed back and checked.
    pub words: u64,
    /// One line per stream that failed.
    pub failures: Vec<String>,
    /// The client-side address of each stream that failed.
    pub failed_locals: Vec<SocketAddr>,
}

impl StreamsReport {
    pub fn summary(&self) -> String {
        format!(
            "{} streams, {} words checked, {} cut",
            self.streams,
            self.words,
            self.failures.len()
        )
    }
}

struct Shared {
    stop: AtomicBool,
    words: AtomicU64,
    failures: Mutex<Vec<(SocketAddr, String)>>,
}

/// Running streams; stopped with [`Streams::stop`].
pub struct Streams {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Streams {
    /// Opens `n` streams to `addr` (all connected and echoing once this returns); stream `i`
    /// sends `words(i)` u64s every `interval`.
    pub async fn start(
        addr: SocketAddr,
        n: usize,
        interval: Duration,
        words: impl Fn(usize) -> usize,
    ) -> Result<Streams> {
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            words: AtomicU64::new(0),
            failures: Mutex::new(Vec::new()),
        });
        // Every stream is connected and has echoed once before any starts sending.
        let connects: Vec<_> = (0..n).map(|i| tokio::spawn(open(addr, i))).collect();
        let mut opened = Vec::new();
        for c in connects {
            opened.push(c.await??);
        }
        let mut tasks = Vec::new();
        for (i, stream) in opened.into_iter().enumerate() {
            let shared = shared.clone();
            let per = words(i).max(1);
            let local = stream.local_addr()?;
            tasks.push(tokio::spawn(async move {
                if let Err(e) = run(stream, per, interval, &shared).await {
                    shared
                        .failures
                        .lock()
                        .unwrap()
                        .push((local, format!("stream {i} ({local}): {e:#}")));
                }
            }));
        }
        Ok(Streams { shared, tasks })
    }

    /// Words checked so far.
    pub fn words(&self) -> u64 {
        self.shared.words.load(Ordering::Relaxed)
    }

    /// Streams failed so far.
    pub fn failed(&self) -> usize {
        self.shared.failures.lock().unwrap().len()
    }

    /// The first `n` failures so far, one line each, with their client-side addresses.
    pub fn first_failures(&self, n: usize) -> String {
        let failures = self.shared.failures.lock().unwrap();
        let lines: Vec<String> = failures
            .iter()
            .take(n)
            .map(|(a, f)| format!("{a}: {f}"))
            .collect();
        lines.join("; ")
    }

    /// The client-side addresses of the streams failed so far.
    pub fn failed_locals(&self) -> Vec<SocketAddr> {
        let failures = self.shared.failures.lock().unwrap();
        failures.iter().map(|(a, _)| *a).collect()
    }

    /// Stops sending, waits for every stream to get all of its echo back, and reports.
    pub async fn stop(self) -> StreamsReport {
        self.shared.stop.store(true, Ordering::Relaxed);
        let streams = self.tasks.len();
        for t in self.tasks {
            let _ = t.await;
        }
        let failures = self.shared.failures.lock().unwrap().clone();
        StreamsReport {
            streams,
            words: self.shared.words.load(Ordering::Relaxed),
            failed_locals: failures.iter().map(|(a, _)| *a).collect(),
            failures: failures.into_iter().map(|(_, f)| f).collect(),
        }
    }
}

/// Connects stream `i` and has one word echoed: it is carried end to end.
async fn open(addr: SocketAddr, i: usize) -> Result<TcpStream> {
    let mut stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .context("connect timed out")?
        .with_context(|| format!("stream {i}: connect"))?;
    stream.set_nodelay(true)?;
    stream.write_all(&u64::MAX.to_be_bytes()).await?;
    let mut first = [0u8; 8];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut first))
        .await
        .context("first echo timed out")??;
    ensure!(
        first == u64::MAX.to_be_bytes(),
        "stream {i}: wrong first echo"
    );
    Ok(stream)
}

async fn run(stream: TcpStream, per: usize, interval: Duration, shared: &Shared) -> Result<()> {
    let (mut rd, mut wr) = stream.into_split();
    let sent = Arc::new(AtomicU64::new(0));
    let reader = {
        let sent = sent.clone();
        async move {
            let mut expect = 0u64;
            let mut buf = vec![0u8; 64 * 1024];
            let mut carry: Vec<u8> = Vec::new();
            loop {
                let n = tokio::time::timeout(STALL, rd.read(&mut buf))
                    .await
                    .context("no echo for 60s (hung)")?
                    .context("read")?;
                if n == 0 {
                    let total = sent.load(Ordering::SeqCst);
                    ensure!(
                        expect == total && carry.is_empty(),
                        "EOF after {expect} of {total} words ({} stray bytes)",
                        carry.len()
                    );
                    return Ok(());
                }
                carry.extend_from_slice(&buf[..n]);
                let whole = carry.len() / 8 * 8;
                for w in carry[..whole].chunks_exact(8) {
                    let got = u64::from_be_bytes(w.try_into().unwrap());
                    if got != expect {
                        bail!("word {expect} came back as {got}");
                    }
                    expect += 1;
                }
                shared
                    .words
                    .fetch_add((whole / 8) as u64, Ordering::Relaxed);
                carry.drain(..whole);
            }
        }
    };
    let writer = async {
        let mut next = 0u64;
        let mut ticker = tokio::time::interval(interval);
        while !shared.stop.load(Ordering::Relaxed) {
            ticker.tick().await;
            let msg: Vec<u8> = (next..next + per as u64)
                .flat_map(|w| w.to_be_bytes())
                .collect();
            tokio::time::timeout(STALL, wr.write_all(&msg))
                .await
                .context("write blocked for 60s (hung)")?
                .context("write")?;
            next += per as u64;
            sent.store(next, Ordering::SeqCst);
        }
        wr.shutdown().await.context("shutdown")?;
        Ok::<_, anyhow::Error>(())
    };
    let (r, w) = tokio::join!(reader, writer);
    w?;
    r
}
