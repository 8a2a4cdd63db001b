//! A child process under test: its output captured line by line, its exit observed without
//! blocking, signals, and SIGKILL on drop (the captured stderr is printed then, which libtest
//! shows only for failing tests).

use std::io::{BufRead as _, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Everything a child wrote to one pipe, read by a thread.
pub struct Capture {
    text: Arc<Mutex<String>>,
    done: Arc<AtomicBool>,
}

impl Capture {
    /// Starts reading `pipe` to its end.
    pub fn start(pipe: impl Read + Send + 'static) -> Self {
        let text = Arc::new(Mutex::new(String::new()));
        let done = Arc::new(AtomicBool::new(false));
        let (t, d) = (text.clone(), done.clone());
        std::thread::spawn(move || {
            let mut reader = BufReader::new(pipe);
            let mut line = String::new();
            while matches!(reader.read_line(&mut line), Ok(n) if n > 0) {
                t.lock().unwrap().push_str(&line);
                line.clear();
            }
            d.store(true, Ordering::SeqCst);
        });
        Self { text, done }
    }

    /// Whether the pipe reached its end (the writer closed it).
    pub fn done(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }

    /// What was read so far.
    pub fn get(&self) -> String {
        self.text.lock().unwrap().clone()
    }
}

/// A spawned child with captured stdout and stderr.
pub struct ChildProcess {
    pid: u32,
    child: Mutex<Child>,
    exit: Mutex<Option<ExitStatus>>,
    stdout: Capture,
    stderr: Capture,
    /// What was started (the command line), for messages.
    description: String,
    /// What the child is, for messages ("proxy", "launched").
    label: &'static str,
}

impl ChildProcess {
    /// Spawns `command` with stdin closed and both output pipes captured.
    pub fn spawn(mut command: Command, label: &'static str) -> Result<Self> {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let description = format!("{command:?}");
        let mut child = command
            .spawn()
            .with_context(|| format!("spawn {description}"))?;
        let stdout = Capture::start(child.stdout.take().expect("piped stdout"));
        let stderr = Capture::start(child.stderr.take().expect("piped stderr"));
        Ok(ChildProcess {
            pid: child.id(),
            child: Mutex::new(child),
            exit: Mutex::new(None),
            stdout,
            stderr,
            description,
            label,
        })
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The command line it was started with.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Everything the process wrote to stdout so far.
    pub fn stdout(&self) -> String {
        self.stdout.get()
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.get()
    }

    /// The exit status, if the process has exited.
    pub fn try_exit(&self) -> Result<Option<ExitStatus>> {
        let mut exit = self.exit.lock().unwrap();
        if exit.is_none() {
            *exit = self.child.lock().unwrap().try_wait()?;
        }
        Ok(*exit)
    }

    /// Fails (with its output) if the process has exited, for fail-fast polling.
    pub fn ensure_running(&self) -> Result<()> {
        if let Some(status) = self.try_exit()? {
            bail!(
                "{} exited unexpectedly ({status}); stdout:\n{}stderr:\n{}",
                self.label,
                self.stdout(),
                self.stderr()
            );
        }
        Ok(())
    }

    /// Sends `signal`, unless the process has exited.
    pub fn signal(&self, signal: Signal) -> Result<()> {
        if self.try_exit()?.is_some() {
            bail!("cannot send {signal}: {} already exited", self.label);
        }
        kill(Pid::from_raw(self.pid as i32), signal).with_context(|| format!("kill -{signal}"))
    }

    /// Waits for the exit (at most `deadline`), then for both pipes to be read to their end.
    pub async fn wait_exit(&self, deadline: Duration) -> Result<ExitStatus> {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.try_exit()? {
                break status;
            }
            ensure!(
                start.elapsed() < deadline,
                "{} still running after {deadline:?}; stderr:\n{}",
                self.label,
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let drained = Instant::now();
        while !(self.stderr.done() && self.stdout.done())
            && drained.elapsed() < Duration::from_secs(2)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(status)
    }
}

/// A finished command's stdout, then its stderr, as one text.
pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A finished command's exit code (-1: ended by a signal) and [`output_text`].
pub fn code_and_output(out: &Output) -> (i32, String) {
    (out.status.code().unwrap_or(-1), output_text(out))
}

/// The one line a command refused bad input with — exit code 2 and one line on stderr, the
/// project's rule for a bad flag or file — or an error saying how `out` differs; `what` names
/// the command in it.
pub fn bad_input_line(out: &Output, what: &str) -> Result<String> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(2),
        "{what}: {:?}, not exit 2: {stderr}",
        out.status
    );
    ensure!(
        stderr.trim().lines().count() == 1,
        "{what}: not one line: {stderr}"
    );
    Ok(stderr.trim().to_owned())
}

/// Runs `cmd` with `input` on its stdin (written from a thread of its own, so a command that
/// answers before it has read everything cannot stall it) and waits for its output.
pub fn output_with_input(cmd: &mut Command, input: &str) -> Result<Output> {
    use std::io::Write as _;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {cmd:?}"))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let input = input.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output()?;
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("stdin writer panicked"))??;
    Ok(out)
}

/// The documents of a YAML stream as PyYAML reads them (`python3` with PyYAML), empty ones
/// left out: a reader other than the proxy's own.
pub fn pyyaml_docs(yaml: &str) -> Result<Vec<serde_json::Value>> {
    let out = output_with_input(
        Command::new("python3").args([
            "-c",
            "import sys, json, yaml\n\
             json.dump([d for d in yaml.safe_load_all(sys.stdin) if d is not None], sys.stdout)",
        ]),
        yaml,
    )?;
    ensure!(out.status.success(), "PyYAML: {}", output_text(&out));
    Ok(serde_json::from_slice(&out.stdout)?)
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let mut child = self.child.lock().unwrap();
        if self.exit.lock().unwrap().is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        eprintln!(
            "----- {} pid {} ({}) stderr -----\n{}----- end -----",
            self.label,
            self.pid,
            self.description,
            self.stderr.get()
        );
    }
}
