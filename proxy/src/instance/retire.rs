//! `--retire-file`: the recovery instance (the checkpoint run as a static pod after a reboot)
//! asks to be removed once an instance of the Deployment serves beside it.
//!
//! While Serving, it asks its handoff peers for their status every [`TICK`]; when some peer has
//! been ready (Serving, its own apiserver healthy: exactly what a draining instance hands its
//! sockets to) at [`CONFIRMATIONS`] checks in a row, it writes the file. `recover` on the node
//! then removes the static pod's manifest; the kubelet stops this pod, and its drain hands the
//! listening socket to that ready peer, as at the end of a rollout. The file is written again
//! (at most every [`REWRITE`]) while it is missing and the condition holds.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::backends::readiness::Readiness;
use crate::base::lifecycle::State;
use crate::handoff::Handoff;
use prometheus::{IntCounter, Registry};

/// How often peers are asked.
pub const TICK: Duration = Duration::from_secs(1);
/// Consecutive checks that must find a ready peer.
pub const CONFIRMATIONS: u32 = 2;
/// Least time between two writes.
pub const REWRITE: Duration = Duration::from_secs(10);

pub const RETIRE_REQUESTS: &str = "retire_requests_total";

/// `retire_requests_total`, registered on `r`: what [`run`] counts.
pub fn requests_counter(r: &Registry) -> IntCounter {
    crate::base::metrics::counter(
        r,
        RETIRE_REQUESTS,
        "Recovery instance: times it asked to be retired (--retire-file written) because a ready instance serves beside it.",
    )
}

/// Runs until `stop`; counts each request in `requests`.
pub async fn run(
    file: PathBuf,
    handoff: Arc<Handoff>,
    readiness: Readiness,
    requests: IntCounter,
    stop: CancellationToken,
) {
    tracing::info!(file = %file.display(), "recovery instance: will ask to be retired once an instance of the Deployment is ready beside it");
    let mut seen = 0u32;
    let mut last_write: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(TICK) => {}
        }
        if readiness.state() != State::Serving {
            seen = 0;
            continue;
        }
        let ready = handoff.ready_peers().await;
        seen = if ready > 0 { seen + 1 } else { 0 };
        if seen < CONFIRMATIONS || last_write.is_some_and(|t| t.elapsed() < REWRITE) {
            continue;
        }
        let path = file.clone();
        let exists = tokio::task::spawn_blocking(move || path.exists())
            .await
            .unwrap_or(false);
        if exists {
            continue;
        }
        let text = format!(
            "{{\"pid\":{},\"ready_peers\":{ready},\"at\":\"{}\"}}\n",
            std::process::id(),
            humantime::format_rfc3339_seconds(SystemTime::now())
        );
        let path = file.clone();
        // Not durable: a request to the agent running now (the boot removes one left over).
        match tokio::task::spawn_blocking(move || {
            crate::base::fsutil::write_atomic(&path, text.as_bytes())
        })
        .await
        {
            Ok(Ok(())) => {
                requests.inc();
                last_write = Some(Instant::now());
                tracing::info!(file = %file.display(), ready_peers = ready, "recovery instance: a ready instance serves beside us; retirement requested");
            }
            Ok(Err(e)) => {
                tracing::warn!(file = %file.display(), error = %e, "recovery instance: cannot write the retire file");
                last_write = Some(Instant::now());
            }
            Err(_) => {}
        }
    }
}
