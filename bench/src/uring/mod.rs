//! The `uring` target: an io_uring TCP forwarder in a child process (`bench serve-uring`),
//! the upper bound of what an io_uring data path could do on this machine. Thread per core:
//! each thread has its own ring and its own socket of the listen address's `SO_REUSEPORT`
//! group (as the proxy's `--runtime per-thread`), accepts with a multishot accept, connects to
//! the backend and copies both ways through a provided-buffer ring ([`forward`]).
//!
//! It is not a proxy: one backend, no health checks, no choice of backend, no connection
//! handoff, no drain, no limits, no counters, no logs per connection. TLS passes through as
//! bytes, as through the other targets. SIGTERM ends it at once. It is ready when
//! `GET /readyz` on `--ready-listen` answers 200, which it does once every ring is set up
//! (HAProxy's monitor frontend, for the harness).

pub mod forward;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::num::NonZeroUsize;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;

use anyhow::{Context, Result};
use clap::Args;
use socket2::{Domain, Protocol, Socket, Type};

use crate::instance::{Admin, Instance};
use kube_apiserver_proxy_tests::util::free_random_loopback_addr as free_address;

pub use forward::probe;

/// Options of the internal `serve-uring` subcommand.
#[derive(Debug, Clone, Args)]
pub struct ServeUringArgs {
    /// Where clients connect (one `SO_REUSEPORT` socket per thread).
    #[arg(long)]
    pub listen: SocketAddr,
    /// The backend every connection is forwarded to.
    #[arg(long)]
    pub backend: SocketAddr,
    /// Threads, each with its own ring and socket [default: available CPUs].
    #[arg(long)]
    pub threads: Option<NonZeroUsize>,
    /// Where `GET /readyz` answers 200 once every ring is set up.
    #[arg(long)]
    pub ready_listen: Option<SocketAddr>,
    /// Buffers in each thread's provided-buffer ring (a power of two, at most 32768).
    #[arg(long, default_value_t = forward::Pool::default().buffers)]
    pub buffers: u16,
    /// Bytes per buffer.
    #[arg(long, default_value_t = forward::Pool::default().size)]
    pub buffer_size: u32,
}

/// Entry point of `bench serve-uring`: runs until killed, or until a ring fails.
pub fn serve(args: ServeUringArgs) -> Result<()> {
    crate::procstat::raise_nofile_limit();
    let threads = args
        .threads
        .or_else(|| std::thread::available_parallelism().ok())
        .map_or(1, NonZeroUsize::get);
    let pool = forward::Pool {
        buffers: args.buffers,
        size: args.buffer_size,
    };
    let (setup_tx, setup_rx) = mpsc::channel();
    let mut workers = Vec::new();
    for i in 0..threads {
        let listener = listen(args.listen)?;
        let setup = setup_tx.clone();
        let backend = args.backend;
        let thread = std::thread::Builder::new()
            .name(format!("uring-{i}"))
            .spawn(move || -> std::io::Result<()> {
                // Set up on its own thread: the ring's single issuer is the thread that made it.
                let worker = match forward::Worker::new(listener, backend, pool) {
                    Ok(worker) => {
                        let _ = setup.send(Ok(worker.deferred()));
                        worker
                    }
                    Err(err) => {
                        let _ = setup.send(Err(std::io::Error::new(err.kind(), err.to_string())));
                        return Err(err);
                    }
                };
                worker.run()
            })?;
        workers.push(thread);
    }
    drop(setup_tx);
    let mut deferred = true;
    for _ in 0..threads {
        deferred &= setup_rx
            .recv()
            .context("a worker thread ended during setup")?
            .context("io_uring setup failed")?;
    }
    eprintln!(
        "listening on {} ({threads} threads, io_uring{}, {} buffers of {} KiB per thread), forwarding to {}",
        args.listen,
        if deferred {
            " with deferred task work"
        } else {
            ""
        },
        pool.buffers,
        pool.size / 1024,
        args.backend
    );
    if let Some(addr) = args.ready_listen {
        let ready = TcpListener::bind(addr).with_context(|| format!("cannot bind {addr}"))?;
        std::thread::Builder::new()
            .name("ready".into())
            .spawn(move || answer_ready(ready))?;
    }
    for worker in workers {
        worker
            .join()
            .map_err(|_| anyhow::anyhow!("a worker thread panicked"))?
            .context("io_uring worker failed")?;
    }
    Ok(())
}

/// One socket of `addr`'s `SO_REUSEPORT` group, listening.
fn listen(addr: SocketAddr) -> Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("cannot bind {addr}"))?;
    socket.listen(4096)?;
    Ok(socket)
}

/// Answers every request on `listener` with `200 OK` (after reading its head, so that the
/// close is a FIN and not a reset).
fn answer_ready(listener: TcpListener) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(1)));
        let mut head = Vec::new();
        let mut buf = [0u8; 512];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let _ = stream.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n");
    }
}

/// Instances started, for their names and log files.
static STARTED: AtomicU32 = AtomicU32::new(0);

/// Starts `bench serve-uring` from this very binary in front of `backend` with `threads`
/// threads and `extra_args`, its log in `logs/uring-N.log` (not yet ready: call
/// [`Instance::wait_ready`]).
pub fn spawn(
    logs: &Path,
    listen: SocketAddr,
    backend: SocketAddr,
    threads: usize,
    extra_args: &[String],
) -> Result<Instance> {
    let n = STARTED.fetch_add(1, Ordering::Relaxed) + 1;
    let ready = free_address()?;
    let exe = std::env::current_exe().context("cannot find the bench binary")?;
    let mut command = Command::new(exe);
    command
        .arg("serve-uring")
        .arg(format!("--listen={listen}"))
        .arg(format!("--backend={backend}"))
        .arg(format!("--threads={}", threads.max(1)))
        .arg(format!("--ready-listen={ready}"))
        .args(extra_args);
    Instance::spawn(
        format!("uring#{n}"),
        command,
        Admin::Addr(ready),
        &logs.join(format!("uring-{n}.log")),
    )
}
