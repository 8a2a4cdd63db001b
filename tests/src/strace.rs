//! The file system calls of a child process, seen with `strace`: how the node agents write the
//! files the node needs after a reboot (docs/architecture.md, "Node state on disk").
//!
//! [`traced`] wraps a command in `strace -ff -y -qq -e trace=`[`SYSCALLS`]` -o DIR/trace`: one
//! file per thread (a call is never split by another thread's), descriptors printed with their
//! paths. [`Trace::read`] reads them back; [`Trace::ensure_written_durably`] checks the write of
//! one file, power-loss safe: a temporary file in its directory created with the mode, written,
//! fsynced and renamed over it, then the directory fsynced.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context as _, Result};

/// The calls traced.
pub const SYSCALLS: &str = "openat,write,fsync,fdatasync,rename,renameat,renameat2";

/// Whether `strace` can trace here; why not otherwise (missing, or ptrace not allowed).
pub fn usable() -> std::result::Result<(), String> {
    match Command::new("strace")
        .args(["-f", "-qq", "-o", "/dev/null", "true"])
        .output()
    {
        Err(e) => Err(format!("strace not found ({e}); apt-get install strace")),
        Ok(out) if !out.status.success() => Err(format!(
            "strace cannot trace here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(_) => Ok(()),
    }
}

/// `command` (its program, arguments, environment and directory) run under `strace`, the trace
/// written to `dir` (one file per thread).
pub fn traced(command: &Command, dir: &Path) -> Command {
    let mut c = Command::new("strace");
    c.args(["-ff", "-y", "-qq", "-e", &format!("trace={SYSCALLS}"), "-o"])
        .arg(dir.join("trace"))
        .arg("--")
        .arg(command.get_program())
        .args(command.get_args());
    for (key, value) in command.get_envs() {
        match value {
            Some(v) => c.env(key, v),
            None => c.env_remove(key),
        };
    }
    if let Some(d) = command.get_current_dir() {
        c.current_dir(d);
    }
    c
}

/// The pid of the process `strace` (pid `strace`) started.
pub fn tracee(strace: u32) -> Result<i32> {
    let path = format!("/proc/{strace}/task/{strace}/children");
    let children = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    children
        .split_whitespace()
        .next()
        .with_context(|| format!("strace {strace} has no child"))?
        .parse()
        .context("child pid")
}

/// A trace read back: the lines of each thread.
#[derive(Debug)]
pub struct Trace {
    threads: Vec<(PathBuf, Vec<String>)>,
}

/// The quoted strings of a line (paths; strace does not cut them short).
fn quoted(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut s = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => s.extend(chars.next()),
                '"' => break,
                c => s.push(c),
            }
        }
        out.push(s);
    }
    out
}

/// The result of a call, `= N` (strace pads a short call to a column; with `-y`, a
/// descriptor's path follows the number).
fn result(line: &str) -> Option<i64> {
    let (call, r) = line.rsplit_once(" = ")?;
    if !call.trim_end().ends_with(')') {
        return None;
    }
    let digits: String = r
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '-')
        .collect();
    digits.parse().ok()
}

impl Trace {
    /// Reads the files `strace -ff -o DIR/trace` wrote.
    pub fn read(dir: &Path) -> Result<Self> {
        let mut threads = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("trace."))
            {
                let text = std::fs::read_to_string(&path)?;
                threads.push((path, text.lines().map(str::to_owned).collect()));
            }
        }
        ensure!(!threads.is_empty(), "no trace in {}", dir.display());
        Ok(Self { threads })
    }

    /// Checks that every write of `path` was durable (and that there was one): in one thread,
    /// a temporary file in its directory created (`O_CREAT`) with `mode`, written, fsynced (or
    /// fdatasynced), renamed over `path`, and then, before the next rename onto it, the
    /// directory fsynced.
    pub fn ensure_written_durably(&self, path: &Path, mode: u32) -> Result<()> {
        let target = path.display().to_string();
        let renamed = |l: &str| {
            (l.starts_with("rename(") || l.starts_with("renameat(") || l.starts_with("renameat2("))
                && result(l) == Some(0)
                && quoted(l).get(1) == Some(&target)
        };
        let mut writes = 0;
        for (file, lines) in &self.threads {
            let at: Vec<usize> = (0..lines.len()).filter(|&i| renamed(&lines[i])).collect();
            for (n, &i) in at.iter().enumerate() {
                let next = at.get(n + 1).copied().unwrap_or(lines.len());
                check_write(path, mode, &lines[..next], i).with_context(|| {
                    format!("{target} (trace {}):\n{}", file.display(), lines.join("\n"))
                })?;
                writes += 1;
            }
        }
        ensure!(writes > 0, "no rename onto {target} in the trace");
        Ok(())
    }
}

/// Checks the write of `path` renamed into place at `lines[at]`, its directory fsynced after
/// it within `lines`.
fn check_write(path: &Path, mode: u32, lines: &[String], at: usize) -> Result<()> {
    let dir = path.parent().context("no directory")?;
    let real_dir = dir
        .canonicalize()
        .with_context(|| format!("canonicalize {}", dir.display()))?;
    let tmp = PathBuf::from(&quoted(&lines[at])[0]);
    ensure!(
        tmp.parent() == Some(dir),
        "renamed from {}, not from its directory",
        tmp.display()
    );
    let real_tmp = real_dir.join(tmp.file_name().context("temporary file name")?);
    let opened = lines[..at]
        .iter()
        .rposition(|l| {
            l.starts_with("openat(")
                && l.contains("O_CREAT")
                && quoted(l).first().map(PathBuf::from).as_ref() == Some(&tmp)
        })
        .context("the temporary file was not created")?;
    let open = &lines[opened];
    ensure!(
        open.contains(&format!(", 0{mode:o})")),
        "the temporary file was not created with mode 0{mode:o}: {open}"
    );
    let fd = result(open).with_context(|| format!("no descriptor: {open}"))?;
    ensure!(fd >= 0, "not opened: {open}");
    let on_tmp = format!("({fd}<{}>", real_tmp.display());
    let between = &lines[opened + 1..at];
    let wrote = between
        .iter()
        .rposition(|l| l.starts_with(&format!("write{on_tmp}")))
        .context("no write of the temporary file")?;
    ensure!(
        between[wrote + 1..].iter().any(|l| {
            (l.starts_with(&format!("fsync{on_tmp}"))
                || l.starts_with(&format!("fdatasync{on_tmp}")))
                && result(l) == Some(0)
        }),
        "the temporary file was not fsynced between its last write and the rename"
    );
    let dir_fd = format!("<{}>)", real_dir.display());
    ensure!(
        lines[at + 1..]
            .iter()
            .any(|l| l.starts_with("fsync(") && l.contains(&dir_fd) && result(l) == Some(0)),
        "the directory was not fsynced after the rename"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_read_as_strace_prints_them() {
        let l = r#"renameat2(AT_FDCWD, "/t/a \"b\"", AT_FDCWD, "/t/c", 0) = 0"#;
        assert_eq!(quoted(l), ["/t/a \"b\"", "/t/c"]);
        assert_eq!(result(l), Some(0));
        assert_eq!(
            result(r#"openat(AT_FDCWD, "/t/x", O_RDONLY) = 3</t/x>"#),
            Some(3)
        );
        assert_eq!(
            result(r#"openat(AT_FDCWD, "/t/x", O_RDONLY) = -1 ENOENT (No such file)"#),
            Some(-1)
        );
        assert_eq!(result("fsync(9</t/m>)          = 0"), Some(0));
    }
}
