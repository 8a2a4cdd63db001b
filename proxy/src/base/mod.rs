//! What every layer shares: addresses, exit codes, lifecycle states, metrics, socket options, files, YAML, HTTP GETs.

pub mod addr;
pub mod exit;
pub mod fsutil;
pub mod http_client;
pub mod lifecycle;
pub mod lograte;
pub mod metrics;
pub mod net;
pub mod runtime;
pub mod shard;
pub mod yaml;
