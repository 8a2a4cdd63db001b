//! `run`: one instance from start to exit, driving the lifecycle, in three steps that a test
//! can drive in-process: [`Instance::start`] builds, binds and spawns everything;
//! [`Instance::serve`] waits for a backend, takes the public address and serves until an
//! intent ends it ([`Stop`]); [`Instance::drain`] hands over, drains and stops every task.
//!
//! Starting → WaitingForBackend (health checks only; the public address is untouched) →
//! Serving (sockets shared by a peer, else bound fresh) → Draining (listeners handed to a
//! peer or closed; connections finish until the drain deadline, then are closed spread over a
//! window) → Stopped.
//!
//! SIGUSR2 while Serving is an in-place upgrade ([`crate::instance::upgrade`]): once the successor is
//! ready, this instance hands it the listening sockets and the established connections while
//! still Serving (it answers the admin socket until then), then drains what is left as on
//! SIGTERM; if the successor fails, it goes on serving.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backends::backend::{Backends, Tier};
use crate::backends::discovery;
use crate::backends::metrics::BackendFamilies;
use crate::backends::readiness::Readiness;
use crate::base::addr::ListenAddr;
use crate::base::lifecycle::{Lifecycle, State};
use crate::base::metrics::ProcessGauges;
use crate::base::net;
use crate::cli::{ClientAddress, RuntimeShape};
use crate::config::Config;
use crate::data::forward::ForwardContext;
use crate::data::listener::{HoldError, Listeners};
use crate::data::metrics::DataMetrics;
use crate::data::workers::{Placement, Workers};
use crate::handoff::metrics::HandoffMetrics;
use crate::handoff::{Handoff, HandoffError};
use crate::instance::signal::Intent;
use crate::instance::upgrade::{self, StartCommand};
use crate::observe::admin::{self, AdminView};
use crate::sys;

/// Why the instance could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot bind admin address {addr}")]
    AdminBind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot listen on {addr}")]
    Listen {
        addr: ListenAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("handoff")]
    Handoff(#[from] HandoffError),
    #[error("cannot start the worker threads")]
    Workers(#[source] std::io::Error),
}

/// Extra time after the close window for connection tasks to finish closing.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Runs one instance until a shutdown intent arrives (or an upgrade succeeds) and the drain is
/// done: [`Instance::start`], [`Instance::serve`], [`Instance::drain`]. `intents` is the one
/// shutdown mechanism: the binary feeds it from the signal handlers ([`crate::instance::signal`]), a test
/// from its own channel.
pub async fn run(
    config: Config,
    registry: Registry,
    mut intents: mpsc::Receiver<Intent>,
) -> Result<(), RunError> {
    let instance = Instance::start(config, registry).await?;
    let stop = instance.serve(&mut intents).await?;
    instance.drain(stop).await;
    Ok(())
}

/// One instance, started: everything built, bound (but the public address) and spawned, in
/// `WaitingForBackend`. Dropping it cancels every task it spawned.
pub struct Instance {
    config: Config,
    lifecycle: Lifecycle,
    backends: Arc<Backends>,
    ctx: Arc<ForwardContext>,
    listeners: Arc<Listeners>,
    handoff: Option<Arc<Handoff>>,
    admin: AdminParts,
    start_command: std::io::Result<StartCommand>,
    /// Every token of the instance is a child of `root`, and every task spawned here or by the
    /// modules is tracked (`tasks`, or the backends' and listeners' own trackers, which are
    /// waited for too).
    root: CancellationToken,
    tasks: TaskTracker,
    /// Any early return (an error, a dropped instance) cancels the whole tree.
    _cancel_all_on_drop: tokio_util::sync::DropGuard,
}

/// What the drain needs of the admin endpoint.
struct AdminParts {
    view: Arc<AdminView>,
    /// The admin socket, kept for a successor to inherit (in-place upgrade).
    fd: Option<std::os::fd::OwnedFd>,
    /// Stops answering on the admin socket (the successor answers there after an upgrade).
    stop: CancellationToken,
    addr: Option<std::net::SocketAddr>,
}

/// Why serving ended, and so what the drain does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A shutdown intent (naming its signal) before any backend was healthy: the public
    /// address was never taken, nothing to hand over or drain.
    BeforeServing(&'static str),
    /// A shutdown intent (naming its signal) while serving: hand the listeners to a peer or
    /// close them, then let connections finish.
    Shutdown(&'static str),
    /// An in-place upgrade found its successor (this pid) ready: hand it everything, then
    /// drain what is left.
    Upgraded(u32),
}

/// What a test or a supervisor in the same process may watch of a running instance.
#[derive(Clone)]
pub struct Observer {
    state: watch::Receiver<State>,
    listeners: Arc<Listeners>,
    listen: Vec<ListenAddr>,
    admin: Option<std::net::SocketAddr>,
}

impl Observer {
    /// The lifecycle state, as it changes.
    pub fn state(&self) -> watch::Receiver<State> {
        self.state.clone()
    }

    /// The addresses the public listening sockets are bound to (a `--listen` port 0 resolved),
    /// in the order of `--listen`; empty until Serving, and again once they are closed.
    pub fn listening(&self) -> Vec<std::net::SocketAddr> {
        self.listen
            .iter()
            .filter_map(|a| self.listeners.bound_address(*a))
            .collect()
    }

    /// The admin endpoint's address.
    pub fn admin(&self) -> Option<std::net::SocketAddr> {
        self.admin
    }
}

impl Instance {
    /// Builds everything and spawns its tasks (as linkerd2-proxy builds, then spawns): metrics,
    /// backends and their checks, discovery, the data path's context and worker threads, the
    /// admin endpoint, the handoff server, the node's scrape endpoint. Ends in
    /// `WaitingForBackend`, having told systemd it started; the public address is not touched.
    pub async fn start(config: Config, registry: Registry) -> Result<Instance, RunError> {
        let start_command = StartCommand::current();
        #[cfg(feature = "planted-faults")]
        crate::fault::plant(config.planted_fault);
        // Each layer registers its own metrics.
        let process = ProcessGauges::register(&registry);
        let data = DataMetrics::register(&registry);
        let lifecycle = Lifecycle::new(&registry);
        crate::instance::limits::raise_and_report(config.max_connections.get());
        let handoff_metrics = HandoffMetrics::register(&registry);
        report_tcp_migrate_req(&handoff_metrics);

        let root = CancellationToken::new();
        let cancel_all_on_drop = root.clone().drop_guard();
        let tasks = TaskTracker::new();
        let backends = start_backends(&config, BackendFamilies::register(&registry), &root, &tasks);
        let ctx = forward_context(&config, &backends, &data, &root, &tasks);
        let listeners = Arc::new(Listeners::new(
            ctx.clone(),
            config.max_connections.get(),
            placement(&config, &root)?,
            root.child_token(),
        ));
        let admin_socket = admin::bind(config.admin_listen.0, config.admin_address_file.as_deref())
            .await
            .map_err(|source| RunError::AdminBind {
                addr: config.admin_listen.to_string(),
                source,
            })?;
        let readiness = Readiness::new(
            lifecycle.subscribe(),
            backends.clone(),
            config.discovery.own_backend_file.is_some(),
        );
        let retire_requests = crate::instance::retire::requests_counter(&registry);
        let handoff = start_handoff(
            &config,
            &listeners,
            &readiness,
            (handoff_metrics, retire_requests),
            &root,
            &tasks,
        )?;
        let view = Arc::new(AdminView {
            state: lifecycle.subscribe(),
            backends: backends.clone(),
            listeners: listeners.clone(),
            process,
            rejected: admin::rejected_counter(&registry),
            registry,
            data,
            readiness,
            handoff: handoff.clone(),
            client_address: config.client_address,
            handed_to_successor: std::sync::atomic::AtomicU32::new(0),
        });
        let admin = start_admin(&config, admin_socket, view, &handoff, &root, &tasks).await;

        lifecycle.advance(State::WaitingForBackend);
        // Started (configuration valid, admin endpoint up): what systemd's `Type=notify` waits
        // for. Not Serving: a start must not fail because every apiserver is down at that moment.
        crate::instance::notify::notify("READY=1");
        Ok(Instance {
            config,
            lifecycle,
            backends,
            ctx,
            listeners,
            handoff,
            admin,
            start_command,
            root,
            tasks,
            _cancel_all_on_drop: cancel_all_on_drop,
        })
    }

    /// What may be watched of this instance while it serves and drains.
    pub fn observer(&self) -> Observer {
        Observer {
            state: self.lifecycle.subscribe(),
            listeners: self.listeners.clone(),
            listen: self.config.listen.clone(),
            admin: self.admin.addr,
        }
    }

    /// Waits for a healthy backend, takes the public address (sockets shared by a peer, else
    /// bound fresh) and serves until a shutdown intent, or an upgrade intent whose successor
    /// became ready. An upgrade intent before Serving is ignored; one that fails goes on
    /// serving.
    pub async fn serve(&self, intents: &mut mpsc::Receiver<Intent>) -> Result<Stop, RunError> {
        loop {
            tokio::select! {
                _ = self.backends.wait_healthy() => break,
                i = next_intent(intents) => match i {
                    Intent::Shutdown(s) => return Ok(Stop::BeforeServing(s)),
                    Intent::Upgrade => tracing::info!("SIGUSR2 before serving: nothing to upgrade; ignored"),
                },
            }
        }
        acquire_listeners(&self.config, &self.listeners, self.handoff.as_deref()).await?;
        self.lifecycle.advance(State::Serving);
        loop {
            match next_intent(intents).await {
                Intent::Shutdown(s) => return Ok(Stop::Shutdown(s)),
                Intent::Upgrade => {
                    let upgraded = upgrade_in_place(
                        &self.start_command,
                        self.admin.fd.as_ref(),
                        self.handoff.as_deref(),
                        intents,
                    )
                    .await;
                    match upgraded {
                        Upgraded::Yes(pid) => return Ok(Stop::Upgraded(pid)),
                        Upgraded::No => {}
                        Upgraded::Interrupted(s) => return Ok(Stop::Shutdown(s)),
                    }
                }
            }
        }
    }

    /// Hands over and drains as `stop` says, then stops every task and waits for them:
    /// Draining → Stopped. Intents that arrive meanwhile are not read (a second SIGTERM during
    /// the drain is ignored, [`crate::instance::signal`]).
    pub async fn drain(self, stop: Stop) {
        match stop {
            Stop::BeforeServing(signal) => tracing::info!(signal, "shutdown before serving"),
            Stop::Shutdown(signal) => self.hand_over_and_drain(signal, None).await,
            Stop::Upgraded(pid) => self.hand_over_and_drain("SIGUSR2", Some(pid)).await,
        }
        if let Some(h) = &self.handoff {
            h.close();
        }
        self.lifecycle.advance(State::Stopped);
        self.root.cancel();
        self.tasks.close();
        self.backends.stop().await;
        self.tasks.wait().await;
    }

    /// Draining: the listening sockets go to the successor (`successor`, an in-place upgrade)
    /// or a peer, else are closed; the established connections go to the successor, if any;
    /// the rest finish until the drain deadline.
    async fn hand_over_and_drain(&self, signal: &'static str, successor: Option<u32>) {
        let (config, ctx, listeners) = (&self.config, &self.ctx, &self.listeners);
        let deadline = Instant::now() + config.drain_timeout;
        #[cfg(feature = "planted-faults")]
        crate::fault::at_drain(
            &ctx.cut,
            || Ok(listeners.duplicates()?.into_iter().map(|s| s.fd).collect()),
            deadline,
        );
        match (successor, &self.handoff) {
            (Some(pid), Some(h)) => {
                // In-place upgrade: still Serving (and ready, answering the pod's probes on the
                // admin socket) while everything is handed to the ready successor; then the
                // successor answers there, and this instance drains what it could not hand.
                let handed = h.hand_over(deadline, || self.backends.any_healthy()).await;
                if handed {
                    successor_serves(ctx);
                }
                hand_over_connections(h, ctx, pid).await;
                if handed {
                    self.admin
                        .view
                        .handed_to_successor
                        .store(pid.max(1), std::sync::atomic::Ordering::Release);
                }
                self.admin.stop.cancel();
                tracing::info!(signal, successor.pid = pid, drain_timeout = ?config.drain_timeout, "in-place upgrade: handed over; the successor answers on the admin socket; draining");
                self.lifecycle.advance(State::Draining);
                crate::instance::notify::notify(&format!("MAINPID={pid}"));
            }
            _ => {
                tracing::info!(signal, drain_timeout = ?config.drain_timeout, "shutdown requested: draining");
                self.lifecycle.advance(State::Draining);
                if let Some(h) = &self.handoff {
                    if h.hand_over(deadline, || self.backends.any_healthy()).await {
                        successor_serves(ctx);
                    }
                }
            }
        }
        listeners.stop_all().await;
        let_connections_finish(listeners, ctx, deadline).await;
    }
}

/// The backends of `--backend`, health-checked from now on, and discovery of the others
/// (`--own-backend-file`, `--backend-dir`).
fn start_backends(
    config: &Config,
    metrics: BackendFamilies,
    root: &CancellationToken,
    tasks: &TaskTracker,
) -> Arc<Backends> {
    let backends = Backends::new(config.health.clone(), metrics, root.child_token());
    for addr in &config.backends {
        backends.add(*addr, Tier::Static);
    }
    let d = &config.discovery;
    if d.own_backend_file.is_some() || d.backend_dir.is_some() {
        tasks.spawn(discovery::run(
            d.clone(),
            backends.clone(),
            root.child_token(),
        ));
    }
    backends
}

/// What every connection shares, with the tasks that serve it: the transparent mode's
/// verification of each backend, and the drain deadline's cut.
fn forward_context(
    config: &Config,
    backends: &Arc<Backends>,
    metrics: &DataMetrics,
    root: &CancellationToken,
    tasks: &TaskTracker,
) -> Arc<ForwardContext> {
    let ctx = Arc::new(ForwardContext {
        backends: backends.clone(),
        metrics: metrics.clone(),
        connect_timeout: config.connect_timeout,
        cut: root.child_token(),
        close_window: config.drain_close_window,
        copy_mode: config.copy_mode,
        carried: Arc::default(),
        successor_serves: Default::default(),
        transparent: config.client_address == ClientAddress::Transparent,
    });
    if ctx.transparent {
        let list = backends.clone();
        tasks.spawn(crate::backends::transparent::run(
            move || {
                let now = list.snapshot();
                now.iter()
                    .map(|b| (b.addr.0, b.transparent.clone()))
                    .collect()
            },
            backends.subscribe(),
            root.child_token(),
        ));
    }
    tasks.spawn(crate::data::forward::cut_on_cancel(ctx.clone()));
    ctx
}

/// Where connections run: the shared runtime, or the worker threads of `--runtime
/// per-thread`, started now.
fn placement(config: &Config, root: &CancellationToken) -> Result<Placement, RunError> {
    Ok(match config.runtime {
        RuntimeShape::Shared => Placement::Shared,
        RuntimeShape::PerThread => Placement::PerThread(
            Workers::start(
                config.worker_threads.get(),
                root.child_token(),
                crate::data::workers::tick_for(config.connect_timeout),
                config.worker_slice,
            )
            .map_err(RunError::Workers)?,
        ),
    })
}

/// The handoff server (`--handoff-dir`), and a recovery instance's retirement
/// (`--retire-file`: it asks to be removed once a ready peer serves), with their metrics.
fn start_handoff(
    config: &Config,
    listeners: &Arc<Listeners>,
    readiness: &Readiness,
    (metrics, retire_requests): (HandoffMetrics, prometheus::IntCounter),
    root: &CancellationToken,
    tasks: &TaskTracker,
) -> Result<Option<Arc<Handoff>>, RunError> {
    let Some(h) = &config.handoff else {
        return Ok(None);
    };
    let handoff = Handoff::start(
        h.clone(),
        config.listen.clone(),
        listeners.clone(),
        readiness.clone(),
        metrics,
        root.child_token(),
        tasks.clone(),
    )?;
    if let Some(file) = &config.retire_file {
        tasks.spawn(crate::instance::retire::run(
            file.clone(),
            handoff.clone(),
            readiness.clone(),
            retire_requests,
            root.child_token(),
        ));
    }
    Ok(Some(handoff))
}

/// Serves the admin endpoint (once it is our turn: after an in-place upgrade's predecessor
/// handed everything over, and once ready) and the node's scrape endpoint.
async fn start_admin(
    config: &Config,
    socket: admin::AdminSocket,
    view: Arc<AdminView>,
    handoff: &Option<Arc<Handoff>>,
    root: &CancellationToken,
    tasks: &TaskTracker,
) -> AdminParts {
    let admin::AdminSocket {
        listener,
        predecessor,
    } = socket;
    let addr = listener.local_addr().ok();
    tracing::info!(admin.addr = %addr.map(|a| a.to_string()).unwrap_or_default(), "admin endpoint listening");
    if let (Some(metrics_addr), Some(h), Some(admin_addr)) =
        (config.metrics_listen, &config.handoff, addr)
    {
        serve_node_metrics(config, metrics_addr, admin_addr, &h.dir, &view, root, tasks).await;
    }
    let fd = listener.as_fd().try_clone_to_owned().ok();
    let stop = root.child_token();
    {
        // Started by an in-place upgrade: the predecessor answers on the admin socket until it
        // has handed everything over; we take over only then, and only once ready.
        let (stop, tasks_for_admin, view) = (stop.clone(), tasks.clone(), view.clone());
        let (readiness, handoff) = (view.readiness.clone(), handoff.clone());
        tasks.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = upgrade::wait_admin_turn(predecessor, || readiness.ready(), handoff.as_deref()) => {}
            }
            admin::serve(listener, view, stop, tasks_for_admin).await;
        });
    }
    AdminParts {
        view,
        fd,
        stop,
        addr,
    }
}

/// `--metrics-listen`: the node's one scrape target, with every instance's metrics. The other
/// instances fetch ours from a peer-metrics listener beside the admin address, never from the
/// admin endpoint (whose connections the probes need).
async fn serve_node_metrics(
    config: &Config,
    addr: std::net::SocketAddr,
    admin_addr: std::net::SocketAddr,
    handoff_dir: &std::path::Path,
    view: &Arc<AdminView>,
    root: &CancellationToken,
    tasks: &TaskTracker,
) {
    let peer_listener = match tokio::net::TcpListener::bind((admin_addr.ip(), 0)).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "cannot bind the peer-metrics listener: --metrics-listen not served");
            return;
        }
    };
    let peers = crate::observe::scrape::Peers::new(handoff_dir.to_path_buf());
    if let Ok(peer_addr) = peer_listener.local_addr() {
        tasks.spawn(crate::observe::scrape::publish(
            peers.clone(),
            peer_addr,
            root.child_token(),
        ));
    }
    tasks.spawn(crate::observe::scrape::serve_peer(
        peer_listener,
        view.clone(),
        root.child_token(),
        tasks.clone(),
    ));
    tasks.spawn(crate::observe::scrape::serve(
        crate::observe::scrape::NodeScrape {
            addr,
            peers,
            cache_for: config.metrics_cache,
            tls: config.metrics_tls.clone(),
        },
        view.clone(),
        root.child_token(),
        tasks.clone(),
    ));
}

/// The next intent; none ever comes once the signal handlers are gone.
async fn next_intent(intents: &mut mpsc::Receiver<Intent>) -> Intent {
    match intents.recv().await {
        Some(i) => i,
        None => std::future::pending().await,
    }
}

/// What an upgrade request came to.
enum Upgraded {
    /// A successor (this pid) is ready: drain now.
    Yes(u32),
    /// Abandoned; go on serving.
    No,
    /// A shutdown signal arrived meanwhile (the successor, if it becomes ready, adopts our
    /// listeners in the drain as any peer would).
    Interrupted(&'static str),
}

/// SIGUSR2: starts the successor and waits until it is ready.
async fn upgrade_in_place(
    start: &std::io::Result<StartCommand>,
    admin_fd: Option<&std::os::fd::OwnedFd>,
    handoff: Option<&Handoff>,
    intents: &mut mpsc::Receiver<Intent>,
) -> Upgraded {
    let (start, admin_fd, handoff) = match (start, admin_fd, handoff) {
        (Ok(s), Some(a), Some(h)) => (s, a, h),
        (Err(e), _, _) => {
            tracing::warn!(error = %e, "SIGUSR2: in-place upgrade impossible: own command line unknown; still serving");
            return Upgraded::No;
        }
        (_, None, _) => {
            tracing::warn!(
                "SIGUSR2: in-place upgrade impossible: no admin socket to pass on; still serving"
            );
            return Upgraded::No;
        }
        (_, _, None) => {
            let e = upgrade::UpgradeError::NoHandoff;
            tracing::warn!(error = %e, "SIGUSR2: in-place upgrade impossible; still serving");
            return Upgraded::No;
        }
    };
    tracing::info!(path = %start.exe.display(), "SIGUSR2: in-place upgrade: starting the successor");
    let attempt =
        upgrade::start_successor(start, admin_fd.as_fd(), handoff, upgrade::READY_TIMEOUT);
    tokio::pin!(attempt);
    loop {
        tokio::select! {
            r = &mut attempt => return match r {
                Ok(pid) => {
                    tracing::info!(successor.pid = pid, "in-place upgrade: successor ready; handing over and draining");
                    Upgraded::Yes(pid)
                }
                Err(e) => {
                    tracing::warn!(error = format!("{:#}", anyhow::Error::from(e)), "in-place upgrade failed; still serving");
                    Upgraded::No
                }
            },
            i = next_intent(intents) => match i {
                Intent::Shutdown(s) => return Upgraded::Interrupted(s),
                Intent::Upgrade => tracing::info!("SIGUSR2: an in-place upgrade is already in progress; ignored"),
            },
        }
    }
}

/// In-place upgrade, after the listeners: hands the established connections to the successor
/// (those it does not take stay and drain).
async fn hand_over_connections(handoff: &Handoff, ctx: &ForwardContext, pid: u32) {
    let carried = ctx.carried.len();
    if carried == 0 {
        return;
    }
    let started = Instant::now();
    let summary = crate::data::transfer::hand_over(&ctx.carried, |parked| {
        handoff.send_connections(pid, parked)
    })
    .await;
    tracing::info!(
        successor.pid = pid,
        carried,
        offered = summary.offered,
        taken = summary.taken,
        pause_p50_ms = summary.pause_quantile(0.5).as_secs_f64() * 1e3,
        pause_p99_ms = summary.pause_quantile(0.99).as_secs_f64() * 1e3,
        pause_max_ms = summary.pause_quantile(1.0).as_secs_f64() * 1e3,
        took_ms = started.elapsed().as_secs_f64() * 1e3,
        "in-place upgrade: established connections handed over"
    );
}

/// Gets the listening sockets for every `--listen` address: from peers first, else bound
/// fresh. With `--runtime per-thread` each address gets one socket of its reuseport group per
/// worker thread: a group shared by a peer with fewer members (a peer with fewer threads, or
/// one with a shared runtime) is topped up with fresh members, which are handed over at drain
/// with the others. Topping up is best effort: the group may belong to another uid (a socket
/// handed over by `migrate`), which the kernel does not let us join; then the threads without
/// a socket of their own stay idle.
async fn acquire_listeners(
    config: &Config,
    listeners: &Arc<Listeners>,
    handoff: Option<&Handoff>,
) -> Result<(), RunError> {
    if let Some(h) = handoff {
        for (addr, socket) in h.share_from_peers().await {
            if let Err(e) = listeners.hold(addr, socket, "shared") {
                // Only a socket we cannot use lands here; the address is bound fresh below.
                tracing::warn!(listen.addr = %addr, error = %e, "cannot use shared socket");
            }
        }
    }
    // One socket per worker thread, but never more than one handoff message can carry for
    // all the addresses together: a successor must be able to take every one of them.
    let wanted = listeners
        .sockets_per_address()
        .min(crate::sys::MAX_FDS / config.listen.len().max(1))
        .max(1);
    for addr in &config.listen {
        let held = listeners.count(*addr);
        // Port 0: the members after the first join the port it got.
        let mut bind_to = listeners.bound_address(*addr).unwrap_or(addr.0);
        for _ in held..wanted {
            let socket = match net::bind_reuseport(bind_to) {
                Ok(socket) => socket,
                Err(e) if held > 0 => {
                    tracing::warn!(listen.addr = %addr, sockets = held, threads = wanted, error = %e, "cannot add a socket to the group shared by the peer: accepting on the ones it gave");
                    break;
                }
                Err(source) => {
                    return Err(RunError::Listen {
                        addr: *addr,
                        source,
                    })
                }
            };
            if let Ok(bound) = socket.local_addr() {
                bind_to = bound;
            }
            listeners
                .hold(*addr, socket, "bound")
                .map_err(|e| RunError::Listen {
                    addr: *addr,
                    source: match e {
                        HoldError::Io(e) => e,
                        other => std::io::Error::other(other.to_string()),
                    },
                })?;
        }
    }
    Ok(())
}

/// Every listening socket was adopted by a peer: clients held for want of a backend may be
/// carried to it (forward::connect_any); the held ones try again now.
fn successor_serves(ctx: &ForwardContext) {
    ctx.successor_serves
        .store(true, std::sync::atomic::Ordering::Release);
    ctx.backends.notify();
}

/// Lets connections finish until `deadline`, then closes the rest spread over the close window.
async fn let_connections_finish(listeners: &Listeners, ctx: &ForwardContext, deadline: Instant) {
    listeners.connections.close();
    let remaining = ctx.metrics.connections_active.get();
    if remaining > 0 {
        tracing::info!(connections = remaining, "waiting for connections to finish");
    }
    tokio::select! {
        _ = listeners.connections.wait() => return,
        _ = tokio::time::sleep_until(deadline) => {}
    }
    let remaining = ctx.metrics.connections_active.get();
    tracing::info!(connections = remaining, window = ?ctx.close_window, "drain deadline: closing remaining connections");
    ctx.cut.cancel();
    let _ =
        tokio::time::timeout(ctx.close_window + CLOSE_GRACE, listeners.connections.wait()).await;
}

fn report_tcp_migrate_req(metrics: &HandoffMetrics) {
    match sys::tcp_migrate_req() {
        Some(v) => {
            metrics.tcp_migrate_req.set(v);
            tracing::info!(
                tcp_migrate_req = v,
                "net.ipv4.tcp_migrate_req (handoff loses nothing either way; with 1 even fresh-bound sockets migrate their queue on close)"
            );
        }
        None => {
            metrics.tcp_migrate_req.set(-1);
            tracing::info!("net.ipv4.tcp_migrate_req not available on this kernel");
        }
    }
}
