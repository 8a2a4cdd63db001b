//! Built-in backends, run in a child process (`bench serve-backend`) on a single-threaded tokio
//! runtime so that they neither compete with the load generator's runtime nor hide their CPU:
//!
//! - **echo**: writes back whatever it reads (requests, streams, bulk both ways); a connection
//!   whose first byte is [`CLOSE_AFTER_REPLY`] carries one request (second byte: its total
//!   length), gets it echoed and is then closed by the backend, so that TIME_WAIT lands on the
//!   server side and the load generator does not run out of ephemeral ports under churn;
//! - **sink**: reads and discards;
//! - **stream**: writes zeros as fast as the peer reads.
//!
//! All three listen on one random loopback address; the child prints their addresses as one
//! JSON line on stdout and serves until killed (or until its stdin closes).

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::net::random_loopback;
use crate::procstat::{self, ProcSample};

/// First byte of a one-request connection (see the module docs).
pub const CLOSE_AFTER_REPLY: u8 = b'C';

/// Buffer size of every backend connection.
const BUFFER: usize = 64 * 1024;

/// Options of the internal `serve-backend` subcommand.
#[derive(Debug, Clone, Args)]
pub struct ServeBackendArgs {
    /// Address to listen on [default: a random 127.x.y.z].
    #[arg(long)]
    pub ip: Option<IpAddr>,
}

/// The addresses of the built-in backends.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct BackendAddrs {
    pub echo: SocketAddr,
    pub sink: SocketAddr,
    pub stream: SocketAddr,
}

/// Entry point of `bench serve-backend`.
pub fn serve(args: ServeBackendArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let ip = args.ip.unwrap_or_else(random_loopback);
        let echo = TcpListener::bind((ip, 0)).await?;
        let sink = TcpListener::bind((ip, 0)).await?;
        let stream = TcpListener::bind((ip, 0)).await?;
        let addrs = BackendAddrs {
            echo: echo.local_addr()?,
            sink: sink.local_addr()?,
            stream: stream.local_addr()?,
        };
        println!("{}", serde_json::to_string(&addrs)?);
        tokio::spawn(accept_loop(echo, Kind::Echo));
        tokio::spawn(accept_loop(sink, Kind::Sink));
        tokio::spawn(accept_loop(stream, Kind::Stream));
        // Exit when the parent goes away (its end of our stdin closes).
        let mut stdin = tokio::io::stdin();
        let mut byte = [0u8; 1];
        while stdin.read(&mut byte).await.unwrap_or(0) > 0 {}
        anyhow::Ok(())
    })
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Echo,
    Sink,
    Stream,
}

async fn accept_loop(listener: TcpListener, kind: Kind) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // EMFILE and friends: back off briefly rather than spin.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = match kind {
                Kind::Echo => echo(stream).await,
                Kind::Sink => sink(stream).await,
                Kind::Stream => produce(stream).await,
            };
        });
    }
}

async fn echo(mut stream: TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; BUFFER];
    let mut n = stream.read(&mut buf).await?;
    if n >= 2 && buf[0] == CLOSE_AFTER_REPLY {
        let want = usize::from(buf[1]).max(2);
        while n < want {
            match stream.read(&mut buf[n..want]).await? {
                0 => return Ok(()),
                more => n += more,
            }
        }
        stream.write_all(&buf[..want]).await?;
        return stream.shutdown().await;
    }
    loop {
        if n == 0 {
            return stream.shutdown().await;
        }
        stream.write_all(&buf[..n]).await?;
        n = stream.read(&mut buf).await?;
    }
}

async fn sink(mut stream: TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; BUFFER];
    while stream.read(&mut buf).await? > 0 {}
    Ok(())
}

async fn produce(mut stream: TcpStream) -> std::io::Result<()> {
    let buf = vec![0u8; BUFFER];
    loop {
        stream.write_all(&buf).await?;
    }
}

/// The backend child process, killed on drop.
#[derive(Debug)]
pub struct BackendProcess {
    child: Child,
    addrs: BackendAddrs,
}

impl BackendProcess {
    /// Starts `serve-backend` from this very binary and waits for its addresses.
    pub fn start() -> Result<Self> {
        let exe = std::env::current_exe().context("cannot find the bench binary")?;
        let mut child = Command::new(&exe)
            .arg("serve-backend")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {} serve-backend", exe.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("cannot read backend addresses")?;
        let addrs = serde_json::from_str(&line)
            .with_context(|| format!("backend printed {line:?} instead of its addresses"))?;
        Ok(Self { child, addrs })
    }

    /// Where the backends listen.
    pub fn addrs(&self) -> BackendAddrs {
        self.addrs
    }

    /// CPU and memory of the backend process.
    pub fn sample(&self) -> Result<ProcSample> {
        procstat::sample(self.child.id())
    }
}

impl Drop for BackendProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
