//! `kube-apiserver-proxy install DEST`: copy this binary to DEST.
//!
//! The init container of the kube-apiserver pod puts the proxy binary into a shared emptyDir so
//! the apiserver container (whose image has no shell and no `cp`) can run `launch`. Neither
//! image has `cp`, so the binary copies itself: to `DEST.tmp`, mode 0755, then renamed.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Why `install` failed.
#[derive(Debug, thiserror::Error)]
#[error("install: {dest}: {source}")]
pub struct InstallError {
    dest: String,
    #[source]
    source: std::io::Error,
}

impl crate::base::exit::CommandError for InstallError {
    /// A destination `install` cannot write: bad input.
    fn is_bad_input(&self) -> bool {
        true
    }
}

/// Copies the running executable to `dest` atomically.
pub fn install(dest: &Path) -> Result<(), InstallError> {
    let err = |source| InstallError {
        dest: dest.display().to_string(),
        source,
    };
    let name = dest.file_name().ok_or_else(|| {
        err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a file path",
        ))
    })?;
    let tmp = dest.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::copy("/proc/self/exe", &tmp).map_err(err)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).map_err(err)?;
    std::fs::rename(&tmp, dest).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        err(e)
    })
}
