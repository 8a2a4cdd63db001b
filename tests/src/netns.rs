//! Clients off the node, for `--client-address transparent`: a second network namespace joined
//! to the test's by a veth pair, whose addresses are not the node's (the backend's answers to
//! them must be routed back by the proxy's policy routing), and a backend that tells each
//! connection the address it saw.
//!
//! The test itself must already run in a private network namespace as root (see the e2e
//! module `transparent`): the veth pair and the addresses are made there, with `ip`. The
//! addresses are of the documentation ranges (RFC 5737, RFC 3849), inside those namespaces
//! only.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use tokio::io::AsyncWriteExt;

/// The node's end of the veth pair: its address.
pub const NODE_V4: &str = "198.51.100.1";
/// The clients' addresses in the other namespace.
pub const CLIENT_V4: [&str; 2] = ["198.51.100.2", "198.51.100.3"];
/// The node's IPv6 address on the veth.
pub const NODE_V6: &str = "2001:db8:1::1";
/// A client's IPv6 address.
pub const CLIENT_V6: &str = "2001:db8:1::2";

/// The clients' network namespace, held by a sleeping child process (killed on drop).
pub struct ClientNet {
    holder: Child,
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip")?;
    ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

impl ClientNet {
    /// Creates the namespace and the veth pair `kapn0` (here: [`NODE_V4`], [`NODE_V6`]) /
    /// `kapc0` (there: [`CLIENT_V4`], [`CLIENT_V6`]).
    pub fn new() -> Result<Self> {
        let holder = Command::new("unshare")
            .args(["--net", "--", "sleep", "600"])
            .stdin(Stdio::null())
            .spawn()
            .context("unshare --net sleep")?;
        let net = ClientNet { holder };
        // unshare has exec'd sleep once the namespace differs from ours.
        let ours = std::fs::read_link("/proc/self/ns/net")?;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::fs::read_link(net.ns_path()).ok().as_ref() == Some(&ours) {
            ensure!(
                std::time::Instant::now() < deadline,
                "the client namespace was not created"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let pid = net.holder.id().to_string();
        ip(&[
            "link", "add", "kapn0", "type", "veth", "peer", "name", "kapc0", "netns", &pid,
        ])?;
        ip(&["addr", "add", &format!("{NODE_V4}/24"), "dev", "kapn0"])?;
        ip(&[
            "-6",
            "addr",
            "add",
            &format!("{NODE_V6}/64"),
            "dev",
            "kapn0",
            "nodad",
        ])?;
        ip(&["link", "set", "kapn0", "up"])?;
        let mut script = String::from("set -e; ip link set lo up; ");
        for a in CLIENT_V4 {
            script += &format!("ip addr add {a}/24 dev kapc0; ");
        }
        script += &format!("ip -6 addr add {CLIENT_V6}/64 dev kapc0 nodad; ip link set kapc0 up");
        let out = Command::new("nsenter")
            .args(["-t", &pid, "-n", "sh", "-c", &script])
            .output()
            .context("nsenter")?;
        ensure!(
            out.status.success(),
            "configure the client namespace: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(net)
    }

    fn ns_path(&self) -> String {
        format!("/proc/{}/ns/net", self.holder.id())
    }

    /// Connects to `target` from `source` (one of the namespace's addresses), in the clients'
    /// namespace: the socket is made by a thread that entered it.
    pub fn connect(&self, source: &str, target: SocketAddr) -> Result<TcpStream> {
        let ns = File::open(self.ns_path())?;
        let source: IpAddr = source.parse()?;
        std::thread::spawn(move || -> Result<TcpStream> {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .context("setns into the client namespace")?;
            let socket = socket2::Socket::new(
                socket2::Domain::for_address(target),
                socket2::Type::STREAM,
                None,
            )?;
            socket.bind(&SocketAddr::new(source, 0).into())?;
            socket
                .connect_timeout(&target.into(), Duration::from_secs(10))
                .with_context(|| format!("connect {source} -> {target}"))?;
            let stream: TcpStream = socket.into();
            stream.set_read_timeout(Some(Duration::from_secs(15)))?;
            Ok(stream)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("client thread panicked"))?
    }

    /// Connects from `source` and returns the address the backend saw (see [`WhoAmI`]) with
    /// the connection, left open.
    pub fn seen_as(&self, source: &str, target: SocketAddr) -> Result<(IpAddr, Conn)> {
        Conn::open(self.connect(source, target)?)
    }
}

impl Drop for ClientNet {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// A connection through the proxy to a [`WhoAmI`] backend: its first line said who the
/// backend saw; after it, bytes are echoed.
pub struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    /// Reads the first line: the client address the backend saw.
    pub fn open(stream: TcpStream) -> Result<(IpAddr, Conn)> {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader
            .read_line(&mut line)
            .context("read the backend's line")?;
        let seen = line
            .trim()
            .parse()
            .with_context(|| format!("backend said {line:?}"))?;
        Ok((seen, Conn { reader }))
    }

    /// One echo round trip of `bytes`.
    pub fn round_trip(&mut self, bytes: &[u8]) -> Result<()> {
        self.reader.get_mut().write_all(bytes)?;
        let mut back = vec![0; bytes.len()];
        self.reader.read_exact(&mut back)?;
        if back != bytes {
            bail!("echo differs");
        }
        Ok(())
    }
}

/// Connects from this namespace (a client on the node itself) and returns what the backend saw.
pub fn seen_from_node(target: SocketAddr) -> Result<(IpAddr, Conn)> {
    let stream = TcpStream::connect_timeout(&target, Duration::from_secs(10))?;
    stream.set_read_timeout(Some(Duration::from_secs(15)))?;
    Conn::open(stream)
}

/// A backend that writes each connection's peer IP on a line of its own, then echoes.
pub struct WhoAmI {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl WhoAmI {
    /// Listens on `addr` (port 0 for a free one).
    pub async fn start(addr: SocketAddr) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            while let Ok((mut s, peer)) = listener.accept().await {
                tokio::spawn(async move {
                    if s.write_all(format!("{}\n", peer.ip()).as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        Ok(WhoAmI { addr, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for WhoAmI {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `ip route get TO from FROM` says the route is of type local.
pub fn route_is_local(from: &str, to: &str) -> Result<bool> {
    let out = Command::new("ip")
        .args(["route", "get", to, "from", from])
        .output()?;
    Ok(out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with("local "))
}
