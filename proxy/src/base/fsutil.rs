//! Small file helpers: files replaced whole, by a temporary file in the same directory renamed
//! over them, so that a reader sees the old content or the new, never a part.
//!
//! Two kinds, and every caller says which of them its file is:
//!
//! - [`write_durable`]: files the node needs after a reboot, written so that a power loss
//!   leaves them whole (file and directory fsync): the kubelet's static pods that
//!   `kubeadm-sync` writes (the copies of kubeadm's manifests, etcd's included, the stand-in,
//!   and its list of the copies it made), kubeadm's apiserver manifest that `migrate-back` puts
//!   into the kubelet's directory, the checkpoint and the one it replaced (`recover`), and the
//!   checkpoint `recover` activates in the kubelet's directory at boot, and the `kubeadm-sync`
//!   agent's own kubeconfig (`--write-kubeconfig`, 0600).
//! - [`write_atomic`]: files that describe processes running now and are worthless after a
//!   reboot (`launch`'s address file, the admin and peer-metrics addresses, discovery's
//!   registrations, the recovery instance's retire request, `recover`'s boot marker in `/run`).
//!   Not fsynced: an fsync can stall behind a busy disk (etcd's) for seconds.
//!
//! Either leaves no temporary file behind when it fails (a full disk, say) and then leaves the
//! file as it was. A process killed between creating the temporary file and renaming it leaves
//! it: `.NAME.PID.tmp` beside the file, a dot file, which the kubelet's static pod source and
//! `kubeadm-sync` ignore, and which is replaced at the next write by a process with that pid
//! (in a container, every start of the agent has the same one); `checkpoint::store` removes
//! those of its directory.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Writes `data` to `path` atomically: a temporary file in the same directory, then rename.
/// Created with mode 0666 less the umask, as `File::create`.
///
/// Not fsynced: for files that describe processes running now and are worthless after a
/// reboot (see the module's list); an fsync can stall behind a busy disk (etcd's) for seconds.
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    replace(path, data, 0o666, false)
}

/// Writes `data` to `path` so that it survives a power loss whole: a temporary file in the same
/// directory created with `mode` (less the umask), written, fsynced, renamed over `path`; then
/// the directory is fsynced, so that the rename itself is on disk once this returns.
///
/// On an error before the rename, `path` is untouched and the temporary file removed. An error
/// of the directory's fsync comes after the rename: `path` holds the new content, which a power
/// loss may still undo.
pub fn write_durable(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    replace(path, data, mode, true)
}

/// The directory of `path` and the temporary file's path in it.
fn temporary(path: &Path) -> io::Result<(&Path, PathBuf)> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    Ok((dir, tmp))
}

fn replace(path: &Path, data: &[u8], mode: u32, durable: bool) -> io::Result<()> {
    let (dir, tmp) = temporary(path)?;
    // One a killed process with our pid left: created anew, so that it gets `mode`.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        file.write_all(data)?;
        if durable {
            file.sync_all()?;
        }
        drop(file);
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if durable {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::process::Command;

    /// A fresh empty directory for one test.
    fn fresh_dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kap-fsutil-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    /// A test that cannot run its real subject here: in CI (env `CI` set to anything but empty,
    /// `false` or `0`) that fails it; elsewhere it says it is skipped.
    fn skip(test: &str, reason: &str) {
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
        assert!(
            !ci,
            "{test} cannot run here ({reason}) and CI is set: failing instead of skipping"
        );
        eprintln!("SKIPPED {test}: {reason}");
    }

    #[test]
    fn a_durable_write_replaces_the_file_with_its_mode() {
        let dir = fresh_dir("durable");
        let file = dir.join("etcd.yaml");
        std::fs::write(&file, "old").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_durable(&file, b"new", 0o600).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        assert_eq!(mode(&file), 0o600);
        assert_eq!(names(&dir), ["etcd.yaml"]);

        // A temporary file a killed process with our pid left, 0644: replaced, not reused.
        let (_, tmp) = temporary(&file).unwrap();
        std::fs::write(&tmp, "left by a crash").unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_durable(&file, b"newer", 0o600).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"newer");
        assert_eq!(mode(&file), 0o600);
        assert_eq!(names(&dir), ["etcd.yaml"]);

        // A path without a file name is refused.
        assert!(write_durable(Path::new("/"), b"x", 0o600).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_rename_leaves_the_target_and_no_temporary_file() {
        let dir = fresh_dir("rename");
        // The target is a directory that is not empty: the rename fails after the write.
        let target = dir.join("kube-apiserver.json");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("inside"), "kept").unwrap();
        assert!(write_atomic(&target, b"new").is_err());
        assert!(write_durable(&target, b"new", 0o600).is_err());
        assert_eq!(names(&dir), ["kube-apiserver.json"]);
        assert_eq!(std::fs::read(target.join("inside")).unwrap(), b"kept");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A real full disk: a 64 KiB tmpfs, mounted in a mount namespace of a thread of this test
    /// alone (as root; gone with the thread).
    #[test]
    fn a_full_disk_leaves_the_old_file_and_no_temporary_file() {
        const TEST: &str = "a_full_disk_leaves_the_old_file_and_no_temporary_file";
        if !nix::unistd::geteuid().is_root() {
            return skip(
                TEST,
                "needs root to mount a small tmpfs in a mount namespace",
            );
        }
        let dir = fresh_dir("full");
        let outcome = std::thread::spawn({
            let dir = dir.clone();
            move || -> anyhow::Result<()> {
                use anyhow::Context as _;
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
                    .context("unshare(CLONE_NEWNS)")?;
                for args in [
                    &["--make-rprivate", "/"][..],
                    &["-t", "tmpfs", "-o", "size=64k,mode=0700", "kap-full"],
                ] {
                    let mut mount = Command::new("mount");
                    mount.args(args);
                    if args[0] == "-t" {
                        mount.arg(&dir);
                    }
                    let out = mount.output().context("run mount")?;
                    if !out.status.success() {
                        anyhow::bail!(
                            "mount {args:?}: {}",
                            String::from_utf8_lossy(&out.stderr).trim()
                        );
                    }
                }
                full_disk(&dir);
                Ok(())
            }
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(reason) = outcome {
            skip(TEST, &format!("{reason:#}"));
        }
    }

    /// On a 64 KiB file system: a write that does not fit fails with ENOSPC and leaves the old
    /// file and nothing else; one that fits is written.
    fn full_disk(dir: &Path) {
        let file = dir.join("kube-apiserver.json");
        std::fs::write(&file, "old").unwrap();
        let big = vec![b'x'; 128 << 10];
        let e = write_atomic(&file, &big).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
        assert_eq!(names(dir), ["kube-apiserver.json"], "write_atomic");
        let e = write_durable(&file, &big, 0o600).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
        assert_eq!(names(dir), ["kube-apiserver.json"], "write_durable");
        assert_eq!(std::fs::read(&file).unwrap(), b"old");
        write_durable(&file, &big[..1024], 0o600).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), &big[..1024]);
        assert_eq!(names(dir), ["kube-apiserver.json"]);
    }
}
