//! The small commands an apiserver pod runs: `launch`, `probe`, `install`.

pub mod install;
pub mod launch;
pub mod probe;
