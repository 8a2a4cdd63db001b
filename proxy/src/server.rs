//! `run`: one instance from start to exit, driving the lifecycle.
//!
//! Starting → WaitingForBackend (health checks only; the public address is untouched) →
//! Serving (sockets shared by a peer, else bound fresh) → Draining (listeners handed to a
//! peer or closed; connections finish until the drain deadline, then are closed spread over a
//! window) → Stopped.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::addr::ListenAddr;
use crate::admin::{self, AdminView};
use crate::backend::{Backends, Tier};
use crate::config::Config;
use crate::discovery;
use crate::forward::ForwardContext;
use crate::handoff::{Handoff, HandoffError};
use crate::lifecycle::{Lifecycle, State};
use crate::listener::{HoldError, Listeners};
use crate::metrics::Metrics;
use crate::net;
use crate::readiness::Readiness;
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
}

/// Extra time after the close window for connection tasks to finish closing.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Runs one instance until `shutdown` resolves and the drain is done.
pub async fn run(
    config: Config,
    registry: Registry,
    shutdown: impl Future<Output = &'static str>,
) -> Result<(), RunError> {
    let metrics = Metrics::new(&registry);
    let lifecycle = Lifecycle::new(metrics.clone());
    crate::limits::raise_and_report(config.max_connections.get());
    report_tcp_migrate_req(&metrics);

    // One cancellation tree: every token below is a child of `root`, and every task spawned
    // here or by the modules is tracked (`tasks`, or the backends' and listeners' own
    // trackers, which are waited for too). Any early return cancels the whole tree.
    let root = CancellationToken::new();
    let _cancel_all_on_return = root.clone().drop_guard();
    let tasks = TaskTracker::new();

    let backends = Backends::new(config.health.clone(), metrics.clone(), root.child_token());
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

    let ctx = Arc::new(ForwardContext {
        backends: backends.clone(),
        metrics: metrics.clone(),
        connect_timeout: config.connect_timeout,
        cut: root.child_token(),
        close_window: config.drain_close_window,
        copy_mode: config.copy_mode,
    });
    let listeners = Arc::new(Listeners::new(
        ctx.clone(),
        config.max_connections.get(),
        root.child_token(),
    ));

    let admin_listener = admin::bind(config.admin_listen.0, config.admin_address_file.as_deref())
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
    let handoff = match &config.handoff {
        Some(h) => Some(Handoff::start(
            h.clone(),
            config.listen.clone(),
            listeners.clone(),
            readiness.clone(),
            metrics.clone(),
            root.child_token(),
            tasks.clone(),
        )?),
        None => None,
    };
    let view = Arc::new(AdminView {
        state: lifecycle.subscribe(),
        backends: backends.clone(),
        listeners: listeners.clone(),
        registry,
        metrics: metrics.clone(),
        readiness,
        handoff: handoff.clone(),
    });
    tracing::info!(admin.addr = %admin_listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "admin endpoint listening");
    tasks.spawn(admin::serve(
        admin_listener,
        view,
        root.child_token(),
        tasks.clone(),
    ));

    lifecycle.advance(State::WaitingForBackend);
    tokio::pin!(shutdown);
    let signal = tokio::select! {
        _ = backends.wait_healthy() => None,
        s = &mut shutdown => Some(s),
    };
    if let Some(signal) = signal {
        tracing::info!(signal, "shutdown before serving");
    } else {
        acquire_listeners(&config, &listeners, handoff.as_deref()).await?;
        lifecycle.advance(State::Serving);
        let signal = shutdown.await;
        tracing::info!(signal, drain_timeout = ?config.drain_timeout, "shutdown requested: draining");
        lifecycle.advance(State::Draining);
        let deadline = Instant::now() + config.drain_timeout;
        if let Some(h) = &handoff {
            h.hand_over(deadline, || backends.any_healthy()).await;
        }
        listeners.stop_all().await;
        drain(&listeners, &ctx, deadline).await;
    }
    if let Some(h) = &handoff {
        h.close();
    }
    lifecycle.advance(State::Stopped);
    root.cancel();
    tasks.close();
    backends.stop().await;
    tasks.wait().await;
    Ok(())
}

/// Gets a listening socket for every `--listen` address: from peers first, else bound fresh.
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
    let held = listeners.addresses();
    for addr in &config.listen {
        if held.contains(addr) {
            continue;
        }
        let socket = net::bind_reuseport(addr.0).map_err(|source| RunError::Listen {
            addr: *addr,
            source,
        })?;
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
    Ok(())
}

/// Lets connections finish until `deadline`, then closes the rest spread over the close window.
async fn drain(listeners: &Listeners, ctx: &ForwardContext, deadline: Instant) {
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

fn report_tcp_migrate_req(metrics: &Metrics) {
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
