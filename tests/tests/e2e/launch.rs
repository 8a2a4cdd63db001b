//! `kube-apiserver-proxy launch` (DESIGN §6): picks a random loopback address,
//! writes it atomically to the address file, substitutes every `{{address}}` and `exec`s the
//! command in place (same pid: SIGTERM sent to it reaches the apiserver). Bad input is one
//! line, exit 2, nothing started and no address file.
//!
//! Also home of [`Launched`], the handle on a `launch` process that `pod` uses for the
//! apiserver container of its emulated pods.

use std::ffi::{OsStr, OsString};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::HttpsClient;
use kube_apiserver_proxy_tests::process::ChildProcess;
use kube_apiserver_proxy_tests::proxy::{proxy_bin, run_cli};
use kube_apiserver_proxy_tests::util::{eventually, TempDir};
use nix::sys::signal::Signal;

use crate::DEADLINE;

/// The `fake-apiserver` binary of this package (built by cargo for the integration tests).
pub fn fake_apiserver_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_fake-apiserver"))
}

/// A port that was free on 127.0.0.1 a moment ago; `launch --port` confirms it is free on the
/// random address it picks (by a test bind), so a collision cannot go unnoticed.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Checks that `ip` is what `launch` may pick: 127.0.0.0/8 outside 127.0.0.0/24, neither a
/// network (`.0`) nor a broadcast (`.255`) address.
pub fn ensure_launch_ip(ip: IpAddr) -> Result<Ipv4Addr> {
    let IpAddr::V4(v4) = ip else {
        bail!("{ip} is not IPv4")
    };
    let [a, b, c, d] = v4.octets();
    ensure!(a == 127, "{ip} is not in 127.0.0.0/8");
    ensure!((b, c) != (0, 0), "{ip} is inside 127.0.0.0/24");
    ensure!(d != 0 && d != 255, "{ip} ends in .{d}");
    Ok(v4)
}

/// A `kube-apiserver-proxy launch … -- COMMAND …` process (after the exec: COMMAND itself).
/// Killed with SIGKILL when dropped; its stderr is printed then (shown for failing tests).
pub struct Launched {
    process: ChildProcess,
    address_file: PathBuf,
}

impl Launched {
    /// Starts `kube-apiserver-proxy launch --address-file FILE [--port PORT] -- COMMAND ARGS`.
    pub fn spawn(
        address_file: &Path,
        port: Option<u16>,
        command: impl AsRef<OsStr>,
        args: &[OsString],
    ) -> Result<Self> {
        let mut cmd = Command::new(proxy_bin()?);
        cmd.arg("launch").arg("--address-file").arg(address_file);
        if let Some(port) = port {
            cmd.arg("--port").arg(port.to_string());
        }
        cmd.arg("--").arg(command.as_ref()).args(args);
        Ok(Self {
            process: ChildProcess::spawn(cmd, "launched")?,
            address_file: address_file.to_owned(),
        })
    }

    /// `launch` running the fake apiserver the way a manifest runs kube-apiserver:
    /// `--bind-address={{address}} --secure-port=PORT --tls-cert-file … --tls-private-key-file …`
    /// followed by `extra` flags.
    pub fn fake_apiserver(
        pki: &Pki,
        address_file: &Path,
        port: u16,
        extra: &[&str],
    ) -> Result<Self> {
        let mut args: Vec<OsString> = vec![
            "--bind-address={{address}}".into(),
            format!("--secure-port={port}").into(),
            "--tls-cert-file".into(),
            pki.server_cert_file().into(),
            "--tls-private-key-file".into(),
            pki.server_key_file().into(),
        ];
        args.extend(extra.iter().map(OsString::from));
        Self::spawn(address_file, Some(port), fake_apiserver_bin(), &args)
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn stdout(&self) -> String {
        self.process.stdout()
    }

    pub fn stderr(&self) -> String {
        self.process.stderr()
    }

    /// Fails (with stdout and stderr) if the process has exited.
    pub fn ensure_running(&self) -> Result<()> {
        self.process.ensure_running()
    }

    /// Waits for the address file to hold `ip:port`.
    pub async fn wait_address(&self) -> Result<SocketAddr> {
        eventually(DEADLINE, || async {
            let text = std::fs::read_to_string(&self.address_file)
                .with_context(|| format!("read {}", self.address_file.display()));
            if let Ok(text) = &text {
                if let Ok(addr) = text.trim().parse::<SocketAddr>() {
                    return Ok(addr);
                }
            }
            self.ensure_running()?;
            bail!(
                "no address in {} yet: {text:?}",
                self.address_file.display()
            )
        })
        .await
    }

    /// Waits for the fake apiserver's `listening on ADDR` line (it is bound: the exec happened).
    pub async fn wait_listening(&self) -> Result<SocketAddr> {
        eventually(DEADLINE, || async {
            let out = self.stdout();
            if let Some(addr) = out
                .lines()
                .find_map(|l| l.strip_prefix("listening on "))
                .and_then(|a| a.trim().parse().ok())
            {
                return Ok(addr);
            }
            self.ensure_running()?;
            bail!("no 'listening on' line yet; stdout: {out:?}")
        })
        .await
    }

    pub fn sigterm(&self) -> Result<()> {
        self.process.signal(Signal::SIGTERM)
    }

    /// Waits for the exit (at most `deadline`), then for the pipes to be read to the end.
    pub async fn wait_exit(&self, deadline: Duration) -> Result<ExitStatus> {
        self.process.wait_exit(deadline).await
    }
}

/// The argv of a running process, from `/proc/PID/cmdline`.
fn cmdline(pid: u32) -> Result<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))?;
    Ok(raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect())
}

#[tokio::test]
async fn launch_execs_the_command_in_place_on_the_chosen_address() -> Result<()> {
    let pki = Pki::new()?;
    let dir = TempDir::new("launch")?;
    let file = dir.join("address");
    let port = free_port()?;
    let apiserver = Launched::fake_apiserver(
        &pki,
        &file,
        port,
        &[
            "--mode=https",
            "--shutdown-delay-duration=200ms",
            // Ignored by the fake, but shows in its argv: every placeholder is replaced.
            "--advertise-url=https://{{address}}:1/{{address}}",
        ],
    )?;
    let listening = apiserver.wait_listening().await?;
    let written = apiserver.wait_address().await?;

    // The file holds the address the apiserver listens on, with the requested port.
    ensure!(
        written == listening,
        "address file says {written}, the apiserver listens on {listening}"
    );
    ensure!(written.port() == port, "port {} != {port}", written.port());
    let ip = ensure_launch_ip(written.ip())?;
    let text = std::fs::read_to_string(&file)?;
    ensure!(
        text == format!("{written}\n"),
        "address file content {text:?}"
    );
    // Written atomically: nothing but the file itself is left in the directory.
    let left = kube_apiserver_proxy_tests::util::dir_entries(dir.path())?;
    ensure!(left == ["address"], "files left next to it: {left:?}");

    // Same pid: the process we spawned IS the fake apiserver now, with the substituted argv.
    let pid = apiserver.pid();
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))?;
    ensure!(
        exe == fake_apiserver_bin().canonicalize()?,
        "pid {pid} runs {}, not the fake apiserver",
        exe.display()
    );
    let argv = cmdline(pid)?;
    ensure!(
        argv.iter().all(|a| !a.contains("{{address}}")),
        "placeholder left in argv: {argv:?}"
    );
    ensure!(
        argv.contains(&format!("--bind-address={ip}")),
        "no --bind-address={ip} in argv: {argv:?}"
    );
    ensure!(
        argv.contains(&format!("--advertise-url=https://{ip}:1/{ip}")),
        "not every placeholder replaced: {argv:?}"
    );
    ensure!(
        argv.iter().all(|a| a != "launch" && a != "--address-file"),
        "launch's own arguments leaked into the command: {argv:?}"
    );

    // It serves real TLS on that address.
    let client = HttpsClient::new(pki.client_config(false)?);
    let (code, body) = client.get(listening, "/readyz").await?;
    ensure!(code == 200, "/readyz {code} {body}");

    // SIGTERM to the original pid reaches the apiserver's own handler: it announces its
    // shutdown delay and exits 0 (a signal death would be reported as such).
    apiserver.sigterm()?;
    let status = apiserver.wait_exit(DEADLINE).await?;
    ensure!(
        status.code() == Some(0) && status.signal().is_none(),
        "exit {status}; stderr: {}",
        apiserver.stderr()
    );
    ensure!(
        apiserver.stderr().contains("shutting down in"),
        "the fake apiserver did not handle SIGTERM: {}",
        apiserver.stderr()
    );
    Ok(())
}

#[tokio::test]
async fn launch_defaults_to_port_6443_and_picks_fresh_addresses() -> Result<()> {
    let dir = TempDir::new("launch-default")?;
    let mut seen = std::collections::HashSet::new();
    for i in 0..5 {
        let file = dir.join(&format!("address-{i}"));
        // `echo` is found through PATH like execvp would; it prints its substituted argv.
        let args: Vec<OsString> = ["{{address}}", "x{{address}}x", "{{address}}:{{address}}"]
            .map(OsString::from)
            .to_vec();
        let echo = Launched::spawn(&file, None, "echo", &args)?;
        let status = echo.wait_exit(DEADLINE).await?;
        ensure!(status.success(), "echo: {status}; {}", echo.stderr());
        let addr: SocketAddr = std::fs::read_to_string(&file)?.trim().parse()?;
        ensure!(addr.port() == 6443, "default port: {addr}");
        let ip = ensure_launch_ip(addr.ip())?;
        let out = echo.stdout();
        ensure!(
            out == format!("{ip} x{ip}x {ip}:{ip}\n"),
            "echo printed {out:?} for {ip}"
        );
        seen.insert(ip);
    }
    // Random: five launches with the same port do not all pick one address.
    ensure!(seen.len() > 1, "always the same address: {seen:?}");
    Ok(())
}

/// Runs `kube-apiserver-proxy ARGS`, expecting exit 2 with exactly one non-empty stderr line
/// containing `expect` (case-insensitive); returns that line.
async fn bad_input(args: &[OsString], expect: &str) -> Result<String> {
    bad_input_after(args, expect, false).await
}

/// Like [`bad_input`]; with `exec_attempted`, the line `launch: PROGRAM on ADDR` that `launch`
/// prints just before its `exec` may precede the error line.
async fn bad_input_after(args: &[OsString], expect: &str, exec_attempted: bool) -> Result<String> {
    let output = run_cli(args).await?;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    ensure!(
        output.status.code() == Some(2),
        "{args:?}: exit {:?}, want 2; stderr: {stderr}",
        output.status
    );
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| !(exec_attempted && l.starts_with("launch: ") && l.contains(" on 127.")))
        .collect();
    ensure!(
        lines.len() == 1,
        "{args:?}: want one stderr line, got {stderr:?}"
    );
    ensure!(
        lines[0].to_lowercase().contains(&expect.to_lowercase()),
        "{args:?}: {:?} does not mention {expect:?}",
        lines[0]
    );
    ensure!(
        output.stdout.is_empty(),
        "{args:?}: stdout {:?}",
        String::from_utf8_lossy(&output.stdout)
    );
    Ok(lines[0].to_owned())
}

#[tokio::test]
async fn launch_rejects_bad_input_without_starting_anything() -> Result<()> {
    let dir = TempDir::new("launch-bad")?;
    let file = dir.join("address");
    let marker = dir.join("started");
    let touch_marker = |arg: &str| -> Vec<OsString> {
        vec!["touch".into(), format!("{}{arg}", marker.display()).into()]
    };
    let launch = |file: &Path, command: Vec<OsString>| -> Vec<OsString> {
        let mut args: Vec<OsString> = vec!["launch".into(), "--address-file".into(), file.into()];
        args.push("--".into());
        args.extend(command);
        args
    };
    // A regular file where a directory is expected: no file can be created below it (even
    // for root, unlike a permission check).
    let not_a_dir = dir.join("not-a-dir");
    std::fs::write(&not_a_dir, b"")?;
    let data = dir.join("data.txt");
    std::fs::write(&data, b"not a program")?;
    // Executable, found, but the exec itself fails (its interpreter does not exist).
    let broken = dir.join("broken-interpreter");
    std::fs::write(&broken, b"#!/nonexistent/interpreter\n")?;
    std::fs::set_permissions(&broken, std::fs::Permissions::from_mode(0o755))?;

    let cases: Vec<(&str, Vec<OsString>, &str)> = vec![
        (
            "no placeholder",
            launch(&file, touch_marker("")),
            "{{address}}",
        ),
        ("no command after --", launch(&file, vec![]), "command"),
        (
            "no -- and no command",
            vec![
                "launch".into(),
                "--address-file".into(),
                file.clone().into(),
            ],
            "command",
        ),
        (
            "address file below a regular file",
            launch(&not_a_dir.join("address"), touch_marker("-{{address}}")),
            "address-file",
        ),
        (
            "address file in a missing directory",
            launch(&dir.join("missing/address"), touch_marker("-{{address}}")),
            "address-file",
        ),
        (
            "command not on PATH",
            launch(
                &file,
                vec![
                    "kap-no-such-command".into(),
                    "--bind-address={{address}}".into(),
                ],
            ),
            "kap-no-such-command",
        ),
        (
            "command path does not exist",
            launch(
                &file,
                vec![dir.join("nope").into(), "--bind-address={{address}}".into()],
            ),
            "nope",
        ),
        (
            "command not executable",
            launch(
                &file,
                vec![data.clone().into(), "--bind-address={{address}}".into()],
            ),
            "data.txt",
        ),
        (
            "exec fails",
            launch(
                &file,
                vec![broken.clone().into(), "--bind-address={{address}}".into()],
            ),
            "broken-interpreter",
        ),
    ];
    for (name, args, expect) in cases {
        let line = bad_input_after(&args, expect, name == "exec fails")
            .await
            .with_context(|| format!("case {name:?}"))?;
        println!("{name}: {line}");
        ensure!(
            !file.exists(),
            "{name}: the address file was left behind ({line})"
        );
        let left = kube_apiserver_proxy_tests::util::dir_entries(dir.path())?;
        ensure!(
            left == ["broken-interpreter", "data.txt", "not-a-dir"],
            "{name}: something was started or written: {left:?}"
        );
        ensure!(
            std::fs::read(&not_a_dir)?.is_empty(),
            "{name}: not-a-dir was written"
        );
    }
    Ok(())
}

/// A missing required flag is one line too, and that line names the flag (README: "one line
/// naming the flag").
#[tokio::test]
async fn launch_without_address_file_names_the_flag() -> Result<()> {
    let dir = TempDir::new("launch-no-file")?;
    let marker = dir.join("started-{{address}}");
    let args: Vec<OsString> = vec!["launch".into(), "--".into(), "touch".into(), marker.into()];
    bad_input(&args, "--address-file").await?;
    let left = kube_apiserver_proxy_tests::util::dir_entries(dir.path())?;
    ensure!(left.is_empty(), "something was started: {left:?}");
    Ok(())
}
