//! The lifecycle driven in-process: an instance of the library (`server::Instance`) started on
//! `127.0.0.1:0` in front of a fake backend, shut down by an intent sent on its own channel
//! (what the signal handlers send in the binary), its drain watched from inside: the states in
//! order, the listening socket closed while an established connection goes on to its end, the
//! drain over once that connection is, well before the drain deadline.
//!
//! Nothing here runs the binary: a step of the lifecycle can be watched and timed without a
//! process, a log or an admin request in between.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Parser;
use kube_apiserver_proxy::base::addr::ListenAddr;
use kube_apiserver_proxy::base::lifecycle::State;
use kube_apiserver_proxy::cli::Cli;
use kube_apiserver_proxy::config::Config;
use kube_apiserver_proxy::instance::signal::Intent;
use kube_apiserver_proxy::server::{Instance, Observer, Stop};
use kube_apiserver_proxy_tests::client::TcpClient;
use kube_apiserver_proxy_tests::util::{connection_refused, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

use crate::{echo_backend, DEADLINE};

/// Far longer than any test here runs: a drain that ends is one whose connections ended.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);

/// A configuration as `run` would parse it, tcp checks every 100 ms against `backend` and a
/// long drain deadline (a connection cut closes at once), listening on `127.0.0.1:0`: the flag refuses port 0 (peers could not
/// share it), which a lone instance in a test has no need of; the listeners bind it as they
/// bind any address.
fn config(backend: SocketAddr) -> Result<Config> {
    let drain = format!("{}s", DRAIN_TIMEOUT.as_secs());
    let backend = backend.to_string();
    let cli = Cli::try_parse_from([
        "kube-apiserver-proxy",
        "--listen",
        "127.0.0.1:6443",
        "--backend",
        &backend,
        "--health-check",
        "tcp",
        "--health-interval",
        "100ms",
        "--health-rise",
        "1",
        "--drain-timeout",
        &drain,
        // A connection cut by the drain closes at once, not at a random point of a window.
        "--drain-close-window",
        "0s",
        "--worker-threads",
        "2",
    ])?;
    let mut config = Config::try_from(cli.run)?;
    config.listen = vec![ListenAddr(SocketAddr::from(([127, 0, 0, 1], 0)))];
    Ok(config)
}

/// Waits until the instance is in `state`; fails if it passes it by (the states only move
/// forward) or does not get there within `DEADLINE`.
async fn reach(states: &mut watch::Receiver<State>, state: State) -> Result<()> {
    let seen = *tokio::time::timeout(DEADLINE, states.wait_for(|s| *s >= state))
        .await
        .with_context(|| format!("not {state} within {DEADLINE:?}"))??;
    ensure!(
        seen == state,
        "expected {state}, the instance went on to {seen}"
    );
    Ok(())
}

/// The one public listening address, once Serving.
fn listening(observer: &Observer) -> Result<SocketAddr> {
    let addrs = observer.listening();
    ensure!(
        addrs.len() == 1,
        "listening on {addrs:?}, expected one address"
    );
    ensure!(addrs[0].port() != 0, "port 0 not resolved: {}", addrs[0]);
    Ok(addrs[0])
}

/// Start → serve → a shutdown intent → drain: the states come in order; the listening socket
/// is closed at once while the connection established before goes on, carries a megabyte each
/// way after the shutdown, and ends with the client's half-close; the drain ends with it, long
/// before the deadline.
#[tokio::test]
async fn shutdown_intent_drains_in_flight_connection_then_stops() -> Result<()> {
    let backend = echo_backend().await?;
    let instance = Instance::start(config(backend.addr())?, prometheus::Registry::new()).await?;
    let observer = instance.observer();
    let mut states = observer.state();
    ensure!(
        *states.borrow_and_update() == State::WaitingForBackend,
        "started in {}",
        *states.borrow()
    );
    ensure!(
        observer.listening().is_empty(),
        "the public address was taken before serving: {:?}",
        observer.listening()
    );

    let (intents, mut received) = mpsc::channel(1);
    let lifecycle = tokio::spawn(async move {
        let stop = instance.serve(&mut received).await?;
        instance.drain(stop).await;
        anyhow::Ok(stop)
    });
    reach(&mut states, State::Serving).await?;
    let listen = listening(&observer)?;
    let mut client = TcpClient::connect(listen).await?;
    client.round_trip(b"before the shutdown").await?;
    let mut in_flight = tokio::net::TcpStream::connect(listen).await?;
    in_flight.write_all(b"x").await?;
    in_flight.read_exact(&mut [0u8; 1]).await?;
    client.round_trip(b"still before").await?;

    let shutdown_at = Instant::now();
    intents.send(Intent::Shutdown("SIGTERM")).await?;
    reach(&mut states, State::Draining).await?;
    eventually(DEADLINE, || async {
        ensure!(
            observer.listening().is_empty(),
            "listening sockets still held"
        );
        ensure!(connection_refused(listen).await, "{listen} still accepts");
        Ok(())
    })
    .await?;
    client.round_trip(b"during the drain").await?;
    drop(client);
    ensure!(
        !lifecycle.is_finished() && *states.borrow() == State::Draining,
        "the drain ended while a connection was still open"
    );

    // The in-flight connection carries a megabyte each way after the shutdown, then ends with
    // the client's half-close: every byte back, then EOF.
    let payload: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let (mut read, mut write) = in_flight.into_split();
    let sent = payload.clone();
    let writer = tokio::spawn(async move {
        write.write_all(&sent).await?;
        write.shutdown().await?;
        anyhow::Ok(write)
    });
    let mut back = Vec::new();
    tokio::time::timeout(DEADLINE, read.read_to_end(&mut back))
        .await
        .context("in-flight connection: no EOF")??;
    ensure!(
        back == payload,
        "in-flight connection: {} of {} bytes back, or different bytes",
        back.len(),
        payload.len()
    );
    drop((read, writer.await??));

    let stop = tokio::time::timeout(DEADLINE, lifecycle)
        .await
        .context("the drain did not end once its connections had")???;
    ensure!(stop == Stop::Shutdown("SIGTERM"), "stopped for {stop:?}");
    reach(&mut states, State::Stopped).await?;
    ensure!(
        shutdown_at.elapsed() < DRAIN_TIMEOUT / 2,
        "the drain waited for its deadline: {:?}",
        shutdown_at.elapsed()
    );
    ensure!(
        backend.bytes_received() >= payload.len() as u64,
        "the backend received {} bytes",
        backend.bytes_received()
    );
    Ok(())
}

/// A shutdown intent while no backend is healthy: the public address is never taken, nothing
/// drains, the instance stops at once.
#[tokio::test]
async fn shutdown_before_serving_takes_nothing() -> Result<()> {
    // A port nothing listens on: the backend never becomes healthy.
    let refused = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let instance = Instance::start(config(refused)?, prometheus::Registry::new()).await?;
    let observer = instance.observer();
    let mut states = observer.state();
    let (intents, mut received) = mpsc::channel(1);
    intents.send(Intent::Shutdown("SIGINT")).await?;
    let stop = tokio::time::timeout(DEADLINE, instance.serve(&mut received))
        .await
        .context("serve did not return on the shutdown intent")??;
    ensure!(
        stop == Stop::BeforeServing("SIGINT"),
        "stopped for {stop:?}"
    );
    ensure!(
        observer.listening().is_empty(),
        "{:?}",
        observer.listening()
    );
    tokio::time::timeout(DEADLINE, instance.drain(stop))
        .await
        .context("drain")?;
    reach(&mut states, State::Stopped).await?;
    Ok(())
}
