//! kube-apiserver-proxy: a health-gated TCP front proxy for kube-apiserver that hands its
//! listening sockets to its successor, so an apiserver rollout refuses, resets and times out
//! no connection — even on a single controller node.
//!
//! TLS passes through untouched. Each instance binds the node address with `SO_REUSEPORT`
//! only once a backend is healthy, forwards to healthy apiservers on loopback addresses, and at
//! shutdown gives its listening sockets to a serving peer over a Unix socket (`SCM_RIGHTS`).
//!
//! # Layout
//!
//! Folders are layers, lowest first; a module names modules of its own layer or of the layers
//! below it, never above (`proxy/tests/module_graph.rs` checks it, and that no two modules name
//! each other in a cycle; docs/architecture.md draws it).
//!
//! - [`sys`]: the only `unsafe`: raw descriptor work (`SCM_RIGHTS`, `pidfd_getfd`, socket
//!   filters, capabilities). Names nothing of the crate.
//! - [`base`]: what every layer shares: [`base::addr`] (listen, backend, client and admin
//!   addresses), [`base::exit`] (a command's error: exit 2 for bad input, 1 otherwise), [`base::lifecycle`] (the lifecycle states on a watch channel),
//!   [`base::metrics`] (the Prometheus toolkit each layer registers its own metrics with),
//!   [`base::shard`] (per-thread counters), [`base::lograte`] (rate limits for log lines
//!   traffic can trigger), [`base::net`] (TCP socket options and binding),
//!   [`base::fsutil`] (atomic and durable file writes), [`base::yaml`] (YAML as Kubernetes
//!   reads it), [`base::http_client`] (one HTTP/1 request with a typed error).
//! - [`backends`]: the backend set and the selection rule ([`backends::backend`]), the pace of
//!   held clients ([`backends::pace`]), health ([`backends::health`], [`backends::check`]),
//!   own and node-local backends ([`backends::discovery`]), readiness
//!   ([`backends::readiness`]: Serving and the own backend up), TLS material
//!   ([`backends::tls`]), and `--client-address transparent` ([`backends::transparent`],
//!   with the node's policy routing, [`backends::routes`]).
//! - [`data`]: the data path: held listening sockets and their accept loops
//!   ([`data::listener`]), one proxied connection ([`data::forward`]), bytes both ways
//!   ([`data::copy`]), every carried connection's cut/park signals ([`data::control`]),
//!   connection handoff at an in-place upgrade ([`data::transfer`]), `--runtime per-thread`
//!   ([`data::workers`]).
//! - [`handoff`]: listener handoff between instances over a Unix socket (codec, wire, the
//!   peer server).
//! - [`instance`]: one process's life around the data path: signals ([`instance::signal`]),
//!   systemd notifications ([`instance::notify`]), `RLIMIT_NOFILE` ([`instance::limits`]),
//!   `--user` ([`instance::privileges`]), in-place upgrade ([`instance::upgrade`]),
//!   `--retire-file` ([`instance::retire`]).
//! - [`cli`]: clap definitions of the subcommands and flags.
//! - [`observe`]: what an operator reads over HTTP: `/metrics`, `/healthz`, `/readyz`,
//!   `/status`, `/peer-ready` ([`observe::admin`]) and the node's one scrape target
//!   ([`observe::scrape`]).
//! - [`node`]: the node commands and agents, a folder per job: [`node::migration`] (`migrate`,
//!   `migrate-back`, the addresses the node serves), [`node::recovery`] (reboot recovery:
//!   `recover`, the checkpoint, its checks and metrics), [`node::kubeadm`] (kubeadm as the
//!   source of truth: `render`, `kubeadm-sync` with `--undo` and `--write-kubeconfig`, the etcd
//!   canary, the lease handover, the `kubernetes` endpoints), [`node::pod`] (`launch`, `probe`,
//!   `install`); shared by them: the one API client ([`node::api`]), Kubernetes' objects as
//!   k8s-openapi's types ([`node::object`]), kubeconfig files ([`node::kubeconfig`]), static pod
//!   files as the agents write them ([`node::manifest`]) and kubeadm's apiserver manifest
//!   ([`node::apiserver_manifest`]). Job folders do not import each other in a cycle (the same
//!   test).
//! - The roots: [`config`] (the typed configuration built from the flags; every input error
//!   is found here), [`commands`] (each node command's options from its flags) and [`server`]
//!   (one instance: start, serve, drain); the binary's `main`.
//! - `fault` (feature `planted-faults` only): faults planted for the real-cluster tier's
//!   self-test.

#![deny(unsafe_code)]

pub mod backends;
pub mod base;
pub mod cli;
pub mod commands;
pub mod config;
pub mod data;
#[cfg(feature = "planted-faults")]
pub mod fault;
pub mod handoff;
pub mod instance;
pub mod node;
pub mod observe;
pub mod server;
#[allow(unsafe_code)]
pub mod sys;
