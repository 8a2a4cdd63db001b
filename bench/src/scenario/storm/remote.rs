//! Storm clients in child processes of the harness (`bench storm-clients`, internal), for N
//! beyond what one process's descriptor limit holds: each child runs a [`Fleet`] on its own
//! single-threaded runtime and talks to the harness in lines.
//!
//! The protocol, one JSON [`Line`] per line on the child's stdout, plain words on its stdin:
//!
//! 1. the child opens its connections and prints `up` (or `failed` with the reason, and exits);
//! 2. the harness writes `restart NS`: the instant of the backend's restart on the monotonic
//!    clock (`CLOCK_MONOTONIC`, the clock of tokio's `Instant`, shared by every process), from
//!    which the child times its clients' comebacks, as the harness does for its own;
//! 3. the child prints one `client` line per client once all are back or lost, then `done`
//!    with the CPU it used since the restart;
//! 4. it holds its new connections until its stdin closes, then exits.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use nix::time::{clock_gettime, ClockId};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::clients::{ClientOptions, Comeback, Fleet};
use crate::procstat;

/// Options of the internal `storm-clients` subcommand.
#[derive(Debug, Clone, Args)]
pub struct StormClientsArgs {
    /// The target's address.
    #[arg(long)]
    pub addr: SocketAddr,
    /// Clients in this process.
    #[arg(long)]
    pub connections: usize,
    /// Connections being opened at once before the restart.
    #[arg(long)]
    pub ramp: usize,
    /// A client's first pause after a failed attempt.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub retry: Duration,
    /// A client not back this long after the restart is lost.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub deadline: Duration,
}

/// One line of a client process.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Line {
    /// Every connection is up.
    Up,
    /// A connection could not be opened.
    Failed { error: String },
    /// One client's comeback.
    Client(Comeback),
    /// Every client is back or lost; the CPU seconds used since the restart.
    Done { cpu_s: f64 },
}

/// Nanoseconds on the monotonic clock.
fn monotonic_ns() -> Result<u64> {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC).context("clock_gettime")?;
    Ok(now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64)
}

/// The tokio `Instant` of `ns` on the monotonic clock (in the past).
fn instant_of(ns: u64) -> Result<Instant> {
    let (now, now_ns) = (Instant::now(), monotonic_ns()?);
    let ago = Duration::from_nanos(now_ns.saturating_sub(ns));
    Ok(now.checked_sub(ago).unwrap_or(now))
}

/// Entry point of `bench storm-clients`.
pub fn serve(args: StormClientsArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut out = tokio::io::BufWriter::new(tokio::io::stdout());
        let mut stdin = BufReader::new(tokio::io::stdin()).lines();
        let mut fleet = Fleet::start(ClientOptions {
            addr: args.addr,
            connections: args.connections,
            ramp: args.ramp,
            retry: args.retry,
            deadline: args.deadline,
        });
        if let Err(err) = fleet.up().await {
            write(
                &mut out,
                &Line::Failed {
                    error: format!("{err:#}"),
                },
            )
            .await?;
            return Ok(());
        }
        write(&mut out, &Line::Up).await?;
        let Some(line) = stdin.next_line().await? else {
            return Ok(());
        };
        let at = line
            .strip_prefix("restart ")
            .and_then(|ns| ns.trim().parse().ok())
            .with_context(|| format!("expected `restart NS`, got {line:?}"))?;
        fleet.restart(instant_of(at)?);
        let cpu = procstat::self_cpu();
        for comeback in fleet.collect().await? {
            write(&mut out, &Line::Client(comeback)).await?;
        }
        let cpu_s = procstat::self_cpu().saturating_sub(cpu).as_secs_f64();
        write(&mut out, &Line::Done { cpu_s }).await?;
        // Hold the new connections until the harness has measured.
        while stdin.next_line().await?.is_some() {}
        drop(fleet);
        anyhow::Ok(())
    })
}

async fn write(out: &mut (impl AsyncWriteExt + Unpin), line: &Line) -> Result<()> {
    let mut text = serde_json::to_string(line)?;
    text.push('\n');
    out.write_all(text.as_bytes()).await?;
    out.flush().await?;
    Ok(())
}

/// One client process, seen from the harness.
struct Member {
    child: Child,
    stdin: ChildStdin,
    lines: Option<Lines<BufReader<ChildStdout>>>,
}

/// The client processes of one run; killed when dropped.
pub struct Remote {
    members: Vec<Member>,
}

impl Remote {
    /// Starts `processes` client processes with `options.connections` spread evenly over
    /// them, and `options.ramp` too (at least one each).
    pub fn start(options: &ClientOptions, processes: usize) -> Result<Self> {
        let exe = std::env::current_exe().context("cannot find the bench binary")?;
        let ramp = options.ramp.div_ceil(processes).max(1);
        let mut members = Vec::with_capacity(processes);
        for i in 0..processes {
            // The first `connections % processes` members take one more.
            let connections =
                options.connections / processes + usize::from(i < options.connections % processes);
            let mut child = Command::new(&exe)
                .arg("storm-clients")
                .arg(format!("--addr={}", options.addr))
                .arg(format!("--connections={connections}"))
                .arg(format!("--ramp={ramp}"))
                .arg(format!(
                    "--retry={}",
                    humantime::format_duration(options.retry)
                ))
                .arg(format!(
                    "--deadline={}",
                    humantime::format_duration(options.deadline)
                ))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .context("cannot start a storm client process")?;
            let stdin = child.stdin.take().context("no stdin")?;
            let stdout = child.stdout.take().context("no stdout")?;
            members.push(Member {
                child,
                stdin,
                lines: Some(BufReader::new(stdout).lines()),
            });
        }
        Ok(Self { members })
    }

    /// Waits until every process has its connections up.
    pub async fn up(&mut self) -> Result<()> {
        let count = self.members.len();
        for (i, member) in self.members.iter_mut().enumerate() {
            let lines = member.lines.as_mut().context("already collected")?;
            match read(lines).await? {
                Some(Line::Up) => {}
                Some(Line::Failed { error }) => {
                    bail!("storm client process {} of {count}: {error}", i + 1)
                }
                other => bail!(
                    "storm client process {} of {count} said {other:?} instead of up ({})",
                    i + 1,
                    exit_of(&mut member.child)
                ),
            }
        }
        Ok(())
    }

    /// Tells every process that the backend restarts now.
    pub async fn restart(&mut self) -> Result<()> {
        let line = format!("restart {}\n", monotonic_ns()?);
        for member in &mut self.members {
            member.stdin.write_all(line.as_bytes()).await?;
            member.stdin.flush().await?;
        }
        Ok(())
    }

    /// Every client's comeback and the CPU seconds the processes used since the restart;
    /// fails if a process has not reported within `timeout`.
    pub async fn collect(&mut self, timeout: Duration) -> Result<(Vec<Comeback>, f64)> {
        let mut readers = JoinSet::new();
        for (i, member) in self.members.iter_mut().enumerate() {
            let mut lines = member.lines.take().context("already collected")?;
            readers.spawn(async move {
                let mut comebacks = Vec::new();
                loop {
                    match read(&mut lines).await? {
                        Some(Line::Client(comeback)) => comebacks.push(comeback),
                        Some(Line::Done { cpu_s }) => return anyhow::Ok((comebacks, cpu_s)),
                        other => bail!("storm client process {} said {other:?}", i + 1),
                    }
                }
            });
        }
        let (mut all, mut cpu) = (Vec::new(), 0.0);
        let deadline = Instant::now() + timeout;
        while let Some(joined) = tokio::time::timeout_at(deadline, readers.join_next())
            .await
            .context("storm client processes did not report in time")?
        {
            let (comebacks, cpu_s) = joined??;
            all.extend(comebacks);
            cpu += cpu_s;
        }
        Ok((all, cpu))
    }

    /// Closes every process's stdin (they drop their connections and exit) and waits for them.
    pub async fn release(self) -> Result<()> {
        for mut member in self.members {
            drop(member.stdin);
            let status = member.child.wait().await?;
            ensure!(
                status.success(),
                "a storm client process exited with {status}"
            );
        }
        Ok(())
    }
}

/// The next line, `None` at the end of the output.
async fn read(lines: &mut Lines<BufReader<ChildStdout>>) -> Result<Option<Line>> {
    let Some(text) = lines.next_line().await? else {
        return Ok(None);
    };
    let line = serde_json::from_str(&text)
        .with_context(|| format!("a storm client process printed {text:?}"))?;
    Ok(Some(line))
}

/// How a process that stopped talking ended, for error messages.
fn exit_of(child: &mut Child) -> String {
    match child.try_wait() {
        Ok(Some(status)) => format!("exited with {status}"),
        _ => "still running".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let comeback = Comeback {
            after_us: Some(1500),
            failed: 2,
            kinds: [("refused".to_owned(), 2)].into(),
        };
        let text = serde_json::to_string(&Line::Client(comeback.clone())).unwrap();
        match serde_json::from_str(&text).unwrap() {
            Line::Client(back) => assert_eq!(back, comeback),
            other => panic!("{other:?}"),
        }
        assert_eq!(serde_json::to_string(&Line::Up).unwrap(), r#""up""#);
    }

    #[test]
    fn monotonic_clock_is_tokio_instant() {
        let before = Instant::now();
        let at = instant_of(monotonic_ns().unwrap()).unwrap();
        let after = Instant::now();
        assert!(at <= after, "{at:?} after {after:?}");
        assert!(
            before.saturating_duration_since(at) < Duration::from_millis(50),
            "{at:?} long before {before:?}"
        );
    }
}
