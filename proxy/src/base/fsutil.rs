//! Small file helpers.

use std::io::{self, Write};
use std::path::Path;

/// Writes `data` to `path` atomically: a temporary file in the same directory, then rename.
///
/// Not fsynced: every file written this way (addresses, registrations) describes processes
/// that are running now and is worthless after a reboot, while an fsync can stall behind a
/// busy disk (etcd's) for seconds.
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
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
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(data)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}
