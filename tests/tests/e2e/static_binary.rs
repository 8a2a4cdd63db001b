//! The static binary (DESIGN §6): built like the release image builds it
//! (`RUSTFLAGS="-C target-feature=+crt-static" cargo build --target x86_64-unknown-linux-gnu`,
//! here the debug profile to save time), it has no ELF interpreter and needs no shared library,
//! and it runs — `--version`, `launch`, and a proxy forwarding traffic — from an otherwise
//! empty root directory (`chroot`, root only: without root that part fails in CI and is skipped elsewhere).
//!
//! The build goes to its own target directory (`<target>/static`) so it does not fight the
//! other builds for the lock; from cold it takes about a minute, then seconds.

#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use std::fs::File;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use kube_apiserver_proxy_tests::client::http_get;
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::proxy::{cargo_command, proxy_bin};
use kube_apiserver_proxy_tests::util::{eventually, TempDir};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::launch::{ensure_launch_ip, free_port};
use crate::{connect_echo, DEADLINE};

const TARGET: &str = "x86_64-unknown-linux-gnu";

/// The statically linked binary, built once per test process.
pub(crate) fn static_bin() -> Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| build_static().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

fn build_static() -> Result<PathBuf> {
    // CARGO_TARGET_TMPDIR is `<target>/tmp`.
    let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .context("CARGO_TARGET_TMPDIR has no parent")?
        .join("static");
    let mut build = cargo_command();
    build
        .args(["build", "-p", "kube-apiserver-proxy", "--bin"])
        .arg("kube-apiserver-proxy")
        .args(["--target", TARGET, "--target-dir"])
        .arg(&target_dir)
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR");
    let started = Instant::now();
    let output = build.output().context("run cargo build")?;
    ensure!(
        output.status.success(),
        "static build failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    println!("static build: {:?}", started.elapsed());
    let bin = target_dir
        .join(TARGET)
        .join("debug")
        .join("kube-apiserver-proxy");
    ensure!(bin.exists(), "{} missing after the build", bin.display());
    Ok(bin)
}

/// What the program headers of an ELF64 little-endian executable say about linking.
#[derive(Debug)]
struct ElfLinking {
    /// `PT_INTERP` present: the kernel would start a dynamic loader (ld-linux) first.
    interpreter: Option<String>,
    /// Number of `DT_NEEDED` entries: shared libraries to load.
    needed: usize,
}

fn read_u16(b: &[u8], at: usize) -> Result<u16> {
    Ok(u16::from_le_bytes(
        b.get(at..at + 2).context("truncated ELF")?.try_into()?,
    ))
}

fn read_u32(b: &[u8], at: usize) -> Result<u32> {
    Ok(u32::from_le_bytes(
        b.get(at..at + 4).context("truncated ELF")?.try_into()?,
    ))
}

fn read_u64(b: &[u8], at: usize) -> Result<u64> {
    Ok(u64::from_le_bytes(
        b.get(at..at + 8).context("truncated ELF")?.try_into()?,
    ))
}

fn elf_linking(path: &Path) -> Result<ElfLinking> {
    const PT_DYNAMIC: u32 = 2;
    const PT_INTERP: u32 = 3;
    const DT_NULL: u64 = 0;
    const DT_NEEDED: u64 = 1;
    let b = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    ensure!(b.starts_with(b"\x7fELF"), "{}: not ELF", path.display());
    ensure!(b[4] == 2 && b[5] == 1, "not ELF64 little-endian");
    let phoff = read_u64(&b, 0x20)? as usize;
    let phentsize = read_u16(&b, 0x36)? as usize;
    let phnum = read_u16(&b, 0x38)? as usize;
    let mut linking = ElfLinking {
        interpreter: None,
        needed: 0,
    };
    for i in 0..phnum {
        let ph = phoff + i * phentsize;
        let p_type = read_u32(&b, ph)?;
        let offset = read_u64(&b, ph + 8)? as usize;
        let size = read_u64(&b, ph + 32)? as usize;
        match p_type {
            PT_INTERP => {
                let raw = b.get(offset..offset + size).context("PT_INTERP")?;
                linking.interpreter = Some(
                    String::from_utf8_lossy(raw)
                        .trim_end_matches('\0')
                        .to_owned(),
                );
            }
            PT_DYNAMIC => {
                for entry in (offset..offset + size).step_by(16) {
                    match read_u64(&b, entry)? {
                        DT_NULL => break,
                        DT_NEEDED => linking.needed += 1,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Ok(linking)
}

#[test]
fn static_build_needs_no_loader_and_no_shared_library() -> Result<()> {
    // The checker sees dynamic linking where it exists: the ordinary build is dynamic.
    let dynamic = elf_linking(&proxy_bin()?)?;
    ensure!(
        dynamic.interpreter.is_some() && dynamic.needed > 0,
        "the ordinary build should be dynamic: {dynamic:?}"
    );

    let bin = static_bin()?;
    let linking = elf_linking(&bin)?;
    ensure!(
        linking.interpreter.is_none(),
        "static build has an interpreter: {linking:?}"
    );
    ensure!(
        linking.needed == 0,
        "static build needs shared libraries: {linking:?}"
    );
    if let Ok(out) = Command::new("file").arg(&bin).output() {
        println!("{}", String::from_utf8_lossy(&out.stdout).trim());
    }
    let out = Command::new(&bin).arg("--version").output()?;
    ensure!(
        out.status.success()
            && String::from_utf8_lossy(&out.stdout).contains("kube-apiserver-proxy"),
        "--version: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// A process run in the chroot; its output goes to files outside it. Killed when dropped.
pub(crate) struct Chrooted {
    child: Child,
    log: PathBuf,
}

impl Chrooted {
    pub(crate) fn spawn(root: &Path, logs: &TempDir, name: &str, args: &[String]) -> Result<Self> {
        let log = logs.join(&format!("{name}.log"));
        let file = File::create(&log)?;
        // Found through our PATH: the child's environment is empty.
        let chroot = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|dir| dir.join("chroot"))
            .find(|p| p.exists())
            .context("chroot not found on PATH")?;
        let child = Command::new(chroot)
            .arg(root)
            .args(args)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .context("spawn chroot")?;
        Ok(Self { child, log })
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("exited {status}; output:\n{}", self.log());
        }
        Ok(())
    }

    pub(crate) async fn wait_exit(
        &mut self,
        deadline: Duration,
    ) -> Result<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            ensure!(
                start.elapsed() < deadline,
                "still running after {deadline:?}; output:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Chrooted {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        eprintln!("----- chroot output -----\n{}----- end -----", self.log());
    }
}

/// In a root holding nothing but the binary (no libc, no loader, no /etc, no /proc, no
/// shell): `--version`, then `launch` picking an address and exec'ing the proxy itself on it,
/// which forwards traffic to a backend outside and exits 0 on SIGTERM.
#[tokio::test]
async fn static_binary_runs_from_an_empty_root() -> Result<()> {
    if !kube_apiserver_proxy_tests::util::is_root() {
        return kube_apiserver_proxy_tests::util::skip(
            "static_binary_runs_from_an_empty_root",
            "chroot needs root",
        );
    }
    let bin = static_bin()?;
    let root = TempDir::new("empty-root")?;
    let logs = TempDir::new("empty-root-logs")?;
    std::fs::copy(&bin, root.join("kube-apiserver-proxy"))?;
    ensure!(
        kube_apiserver_proxy_tests::util::dir_entries(root.path())? == ["kube-apiserver-proxy"],
        "the root is not empty"
    );

    let mut version = Chrooted::spawn(
        root.path(),
        &logs,
        "version",
        &["/kube-apiserver-proxy".into(), "--version".into()],
    )?;
    let status = version.wait_exit(DEADLINE).await?;
    ensure!(
        status.success() && version.log().contains("kube-apiserver-proxy"),
        "--version in the empty root: {status}: {}",
        version.log()
    );

    // launch → exec of the proxy itself on the chosen address, forwarding to an echo backend.
    let backend = FakeApiserver::tcp_echo().random_loopback()?.start().await?;
    let port = free_port()?;
    let args: Vec<String> = [
        "/kube-apiserver-proxy",
        "launch",
        "--address-file",
        "/address",
        "--port",
        &port.to_string(),
        "--",
        "/kube-apiserver-proxy",
        "run",
        "--listen",
        &format!("{{{{address}}}}:{port}"),
        "--backend",
        &backend.addr().to_string(),
        "--health-check",
        "tcp",
        "--health-interval",
        "100ms",
        "--health-rise",
        "1",
        "--admin-listen",
        "127.0.0.1:0",
        "--admin-address-file",
        "/admin",
    ]
    .map(String::from)
    .to_vec();
    let mut proxy = Chrooted::spawn(root.path(), &logs, "launch", &args)?;
    let addr: SocketAddr = eventually(DEADLINE, || {
        let res = (|| -> Result<SocketAddr> {
            proxy.ensure_running()?;
            Ok(std::fs::read_to_string(root.join("address"))?
                .trim()
                .parse()?)
        })();
        async move { res }
    })
    .await?;
    ensure!(addr.port() == port, "{addr}");
    ensure_launch_ip(addr.ip())?;
    let admin: SocketAddr = eventually(DEADLINE, || {
        let res = (|| -> Result<SocketAddr> {
            proxy.ensure_running()?;
            Ok(std::fs::read_to_string(root.join("admin"))?
                .trim()
                .parse()?)
        })();
        async move { res }
    })
    .await?;
    let mut client = connect_echo(addr).await?;
    client.round_trip(b"from outside the empty root").await?;
    drop(client);
    let (code, body) = http_get(admin, "/status").await?;
    ensure!(
        code == 200 && body.contains("Serving"),
        "/status {code}: {body}"
    );

    // The pid chroot started is the proxy now (chroot and launch both exec'd in place).
    let pid = proxy.child.id();
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))?;
    ensure!(
        exe == root.join("kube-apiserver-proxy").canonicalize()?,
        "pid {pid} runs {}",
        exe.display()
    );
    kill(Pid::from_raw(pid as i32), Signal::SIGTERM)?;
    let status = proxy.wait_exit(DEADLINE).await?;
    ensure!(
        status.code() == Some(0) && status.signal().is_none(),
        "exit {status}; output:\n{}",
        proxy.log()
    );
    let left = kube_apiserver_proxy_tests::util::dir_entries(root.path())?;
    ensure!(
        left == ["address", "admin", "kube-apiserver-proxy"],
        "files in the root afterwards: {left:?}"
    );
    Ok(())
}
