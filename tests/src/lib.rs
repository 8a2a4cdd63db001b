//! End-to-end test support for kube-apiserver-proxy: a library of fakes with builder APIs,
//! used by the one test binary `tests/e2e` (a module per feature).
//!
//! Everything runs on loopback with real sockets, real TLS and real child processes; nothing
//! uses a fixed port, and waiting is done on conditions with deadlines.
//!
//! Layout:
//! - [`util`]: `eventually` polling, random loopback addresses, free ports, temp dirs, and
//!   [`util::skip`], the one way a test skips (never in CI).
//! - [`certs`]: rcgen test PKI (CA, serving cert for `kubernetes`, client certs, PEM files).
//! - [`fake_apiserver`]: the fake kube-apiserver (https or raw TCP echo/sink) and its controls.
//! - [`client`]: HTTP/HTTPS/watch/raw TCP clients with bounded waits.
//! - [`process`]: a child process under test: captured output, exit, signals, kill on drop.
//! - [`proxy`]: spawn and drive the real `kube-apiserver-proxy` binary.
//! - [`netns`]: clients off the node in a second network namespace, and a backend that
//!   reports the address it saw (`--client-address transparent`).
//! - [`load`]: bounded new-connection-per-request load that classifies every failure.
//! - [`streams`]: long-lived echo streams that check every byte of a counting sequence.
//! - [`sockets`]: socket options of another process's TCP connections (the one `unsafe` module).
//! - [`strace`]: a child's file system calls under `strace`: was a file written durably.

#![deny(unsafe_code)]

pub mod certs;
pub mod client;
pub mod fake_apiserver;
pub mod load;
pub mod netns;
pub mod process;
pub mod proxy;
pub mod sockets;
pub mod strace;
pub mod streams;
pub mod util;
