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
//! - [`cli`]: clap definitions of the subcommands and flags.
//! - [`config`]: typed configuration built from the flags; every input error is found here.
//! - [`addr`]: newtypes for listen, backend, client and admin addresses.
//! - [`server`]: `run`, driving one instance through its lifecycle.
//! - [`lifecycle`]: the lifecycle states on a watch channel.
//! - [`readiness`]: ready = Serving and the own backend up; `/readyz` and peers read it.
//! - [`signal`]: SIGTERM/SIGINT/SIGUSR2 mapped to intent.
//! - [`upgrade`]: in-place upgrade: start the successor from our path, wait until it is ready.
//! - [`notify`]: systemd readiness and main-pid notifications.
//! - [`listener`]: held listening sockets and their accept loops.
//! - [`forward`]: one proxied connection, from backend choice to the last byte.
//! - [`workers`]: `--runtime per-thread`: a current-thread runtime and a socket per thread.
//! - [`copy`]: moving bytes both ways: splice through pooled pipes, or a transient buffer;
//!   pausable, returning the bytes in flight.
//! - [`control`]: every carried connection and its own cut/park signals (sharded registry).
//! - [`transfer`]: connection handoff at an in-place upgrade: park, send, resume or release.
//! - [`backend`]: the backend set and the selection rule.
//! - [`pace`]: held clients released at the pace their backend answers.
//! - [`health`]: the pure rise/fall health state machine.
//! - [`check`]: active https/tls/tcp health checks.
//! - [`http_client`]: one HTTP/1 request of the proxy's own (checks, probe, scrape, the
//!   checkpoint's API calls): status and body under a size limit, a typed error per step.
//! - [`discovery`]: own backend (address file) and node-local backends (shared directory).
//! - [`net`]: TCP socket options and binding.
//! - [`transparent`]: `--client-address transparent`: the client's address on backend
//!   connections, verified per backend, falling back to a normal connect.
//! - [`routes`]: the node's policy routing for it over rtnetlink (`transparent-routes`).
//! - [`privileges`]: `--user`: switch from root to the proxy's uid keeping `CAP_NET_RAW`.
//! - [`tls`]: PEM loading and the health-check TLS client config.
//! - [`handoff`]: listener handoff between instances (codec, wire, peer server).
//! - [`sys`]: the only `unsafe`: raw descriptor work (`SO_COOKIE`, `SCM_RIGHTS`).
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/status`, `/peer-ready`.
//! - [`scrape`]: `--metrics-listen`, the node's one scrape target: every instance's metrics.
//! - [`metrics`]: every Prometheus metric, in one struct.
//! - [`migrate`]: moving the node address off kubeadm's static apiserver (`migrate`).
//! - [`migrate_back`]: back from the Deployment to kubeadm's static apiserver (`migrate-back`).
//! - [`served`]: the addresses of the node that serve or are used for a port (what `migrate`
//!   must not leave behind).
//! - [`shard`]: per-thread counters for the data path (no cache line shared by threads).
//! - [`limits`]: `RLIMIT_NOFILE` raised to the hard limit at start, checked against `--max-connections`.
//! - [`lograte`]: rate limits for log lines that client traffic can trigger.
//! - [`probe`]: the `probe` subcommand for exec probes.
//! - [`install`]: the `install` subcommand: the binary copies itself (init containers).
//! - [`launch`]: the `launch` subcommand: random loopback address for kube-apiserver.
//! - [`kubernetes_endpoints`]: the `kubernetes-endpoints` subcommand: `default/kubernetes` of a
//!   single controller, for `--endpoint-reconciler-type=none`.
//! - [`kubeadm_sync`]: the `kubeadm-sync` node agent: kubeadm's manifests to the kubelet's
//!   static pods, kube-apiserver's as a rollout of the Deployment.
//! - [`render`]: the `render` subcommand: the Deployment derived from kubeadm's static pod.
//! - [`yaml`]: YAML in and out, resolved as Kubernetes reads it.
//! - [`fsutil`]: atomic file writes.
//! - [`kubeconfig`]: a kubeconfig's current context (server, credentials), read as YAML.
//! - `fault` (feature `planted-faults` only): faults planted for the real-cluster tier's
//!   self-test.
//! - [`checkpoint`]: the last-known-good checkpoint: the newest apiserver pod that stayed ready.
//! - [`staticpod`]: a pod made into a static pod (pure), and the checks before activating one.
//! - [`retire`]: a recovery instance asks to be removed once a ready peer serves beside it.
//! - [`recover`]: the `recover` node agent: writes the checkpoint, activates it at boot,
//!   removes it when asked.

#![deny(unsafe_code)]

pub mod addr;
pub mod admin;
pub mod backend;
pub mod check;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod control;
pub mod copy;
pub mod discovery;
#[cfg(feature = "planted-faults")]
pub mod fault;
pub mod forward;
pub mod fsutil;
pub mod handoff;
pub mod health;
pub mod http_client;
pub mod install;
pub mod kubeadm_sync;
pub mod kubeconfig;
pub mod kubernetes_endpoints;
pub mod launch;
pub mod lifecycle;
pub mod limits;
pub mod listener;
pub mod lograte;
pub mod metrics;
pub mod migrate;
pub mod migrate_back;
pub mod net;
pub mod notify;
pub mod pace;
pub mod privileges;
pub mod probe;
pub mod readiness;
pub mod recover;
pub mod render;
pub mod retire;
pub mod routes;
pub mod scrape;
pub mod served;
pub mod server;
pub mod shard;
pub mod signal;
pub mod staticpod;
#[allow(unsafe_code)]
pub mod sys;
pub mod tls;
pub mod transfer;
pub mod transparent;
pub mod upgrade;
pub mod workers;
pub mod yaml;
