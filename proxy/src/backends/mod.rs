//! Backends: the set and the selection rule, their health and its checks, discovery, how a connection to one is made.

pub mod backend;
pub mod check;
pub mod discovery;
pub mod health;
pub mod metrics;
pub mod pace;
pub mod readiness;
pub mod routes;
pub mod tls;
pub mod transparent;
