//! A temporary directory removed on drop (config files, logs, handoff sockets).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A directory under the system temp dir, removed with its contents on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `<tmp>/kap-bench-<prefix>-<pid>-<random>` with mode 0700.
    pub fn new(prefix: &str) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let name = format!(
            "kap-bench-{prefix}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        let path = std::env::temp_dir().join(name);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
