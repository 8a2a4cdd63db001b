//! Commands of the runbooks (docs/runbooks/), run as written against files like the node's.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, ensure, Context as _, Result};
use kube_apiserver_proxy_tests::util::TempDir;

/// The fenced `sh` block of `runbook` whose first line is `marker`, without its indentation.
fn snippet(runbook: &str, marker: &str) -> Result<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/runbooks")
        .join(runbook);
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        if l.trim() == marker {
            let indent = l.len() - l.trim_start().len();
            let mut out = String::new();
            for l in lines.by_ref() {
                if l.trim() == "```" {
                    return Ok(out);
                }
                out.push_str(l.get(indent..).unwrap_or(l.trim_start()));
                out.push('\n');
            }
        }
    }
    bail!("{runbook}: no block starting with {marker:?}")
}

/// What the kubelet gets from an environment file (the `EnvironmentFile=` of kubeadm's
/// systemd drop-in): KUBELET_EXTRA_ARGS as systemd reads it — the last assignment wins, the
/// value is the rest of the line, trimmed, one pair of surrounding quotes removed.
fn extra_args(file: &Path) -> Result<String> {
    let text = std::fs::read_to_string(file)?;
    let mut value = String::new();
    for line in text.lines() {
        if let Some(v) = line.trim_start().strip_prefix("KUBELET_EXTRA_ARGS=") {
            let v = v.trim();
            value = match (v.chars().next(), v.chars().last()) {
                (Some(a @ ('"' | '\'')), Some(b)) if a == b && v.len() >= 2 => {
                    v[1..v.len() - 1].to_owned()
                }
                _ => v.to_owned(),
            };
        }
    }
    Ok(value)
}

/// Step 6 of migrate-from-kubeadm.md adds `--pod-manifest-path` to the kubelet's extra flags
/// and keeps the flags there (a second `KUBELET_EXTRA_ARGS=` line would win and drop them:
/// commonly `--node-ip`), quoted or not, empty or absent, and run twice changes nothing more.
#[test]
fn the_kubelet_flag_of_the_migration_keeps_the_flags_already_there() -> Result<()> {
    let block = snippet(
        "migrate-from-kubeadm.md",
        "# kubelet: --pod-manifest-path into KUBELET_EXTRA_ARGS",
    )?;
    // Up to the kubelet's restart: what edits the file.
    let edit = block
        .split("systemctl restart kubelet")
        .next()
        .context("no restart in the block")?;
    ensure!(
        edit.contains("f=/etc/default/kubelet"),
        "the block does not name /etc/default/kubelet: {edit}"
    );
    let flag = "--pod-manifest-path=/etc/kubernetes/kubelet-manifests";
    let dir = TempDir::new("runbook")?;
    let cases: &[(&str, Option<&str>, String)] = &[
        ("absent", None, flag.to_owned()),
        ("other lines only", Some("OTHER=1\n"), flag.to_owned()),
        ("empty", Some("KUBELET_EXTRA_ARGS=\n"), flag.to_owned()),
        ("empty, quoted", Some("KUBELET_EXTRA_ARGS=\"\"\n"), flag.to_owned()),
        (
            "a flag",
            Some("KUBELET_EXTRA_ARGS=--node-ip=192.0.2.10\n"),
            format!("--node-ip=192.0.2.10 {flag}"),
        ),
        (
            "flags, double-quoted",
            Some("# kubeadm\nKUBELET_EXTRA_ARGS=\"--node-ip=192.0.2.10 --v=2\"\n"),
            format!("--node-ip=192.0.2.10 --v=2 {flag}"),
        ),
        (
            "flags, single-quoted",
            Some("KUBELET_EXTRA_ARGS='--node-ip=192.0.2.10 --v=2'\n"),
            format!("--node-ip=192.0.2.10 --v=2 {flag}"),
        ),
        (
            "the flag there already",
            Some("KUBELET_EXTRA_ARGS=\"--node-ip=192.0.2.10 --pod-manifest-path=/etc/kubernetes/kubelet-manifests\"\n"),
            format!("--node-ip=192.0.2.10 {flag}"),
        ),
    ];
    for (i, (name, before, want)) in cases.iter().enumerate() {
        let file = dir.join(&format!("kubelet-{i}"));
        if let Some(before) = before {
            std::fs::write(&file, before)?;
        }
        let script = edit.replace("f=/etc/default/kubelet", &format!("f='{}'", file.display()));
        for run in 1..=2 {
            let out = Command::new("sh").args(["-eu", "-c", &script]).output()?;
            ensure!(
                out.status.success(),
                "{name}, run {run}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let got = extra_args(&file)?;
            ensure!(
                &got == want,
                "{name}, run {run}: KUBELET_EXTRA_ARGS is {got:?}, want {want:?}; the file:\n{}",
                std::fs::read_to_string(&file)?
            );
        }
        if let Some(before) = before.filter(|b| b.starts_with("OTHER") || b.starts_with('#')) {
            let first = before.lines().next().unwrap_or_default();
            ensure!(
                std::fs::read_to_string(&file)?.contains(first),
                "{name}: {first} lost"
            );
        }
    }
    Ok(())
}
