//! The soak's load: churn clients (a new connection per request, paced) and long-lived streams
//! (a ping echoed every interval, reconnecting when closed). Every connection is recorded as
//! an [`Attempt`] with when it began, when its connect completed and when and how it ended,
//! so that failures can be judged against the kills and drains.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use super::attribution::{Attempt, Client, End};
use crate::backend::CLOSE_AFTER_REPLY;
use crate::client::{connect, exchange, paced, ping_stream, Steady, StreamEnd};
use crate::options::LoadArgs;

/// The running load; [`Load::stop`] ends it and returns every attempt.
#[derive(Debug)]
pub struct Load(Steady<Vec<Attempt>, (Vec<Attempt>, u64)>);

/// Everything the load recorded.
#[derive(Debug, Default)]
pub struct Recorded {
    pub attempts: Vec<Attempt>,
    /// Pings answered on the streams.
    pub pings: u64,
}

impl Load {
    /// Starts the clients against `addr`; times are taken relative to `t0`.
    pub fn start(addr: SocketAddr, t0: Instant, load: LoadArgs) -> Self {
        let timeout = load.timeout;
        Self(Steady::start(
            &load,
            Instant::now(),
            |first, period, stop| churn_client(addr, t0, first, period, timeout, stop),
            |stop| stream_client(addr, t0, load.stream_interval, timeout, stop),
        ))
    }

    /// Stops the clients (each finishes its operation in progress, bounded by the timeout).
    pub async fn stop(self) -> Recorded {
        let (churn, streams) = self.0.stop().await;
        let mut recorded = Recorded::default();
        for attempts in churn.into_iter().flatten() {
            recorded.attempts.extend(attempts);
        }
        for (attempts, pings) in streams.into_iter().flatten() {
            recorded.attempts.extend(attempts);
            recorded.pings += pings;
        }
        recorded
            .attempts
            .sort_by(|a, b| a.began_s.total_cmp(&b.began_s));
        recorded
    }
}

fn since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64()
}

/// Begins an attempt of `client` now and connects it: the attempt with its connect time and
/// the stream, or the attempt ended by the failure.
async fn connect_attempt(
    addr: SocketAddr,
    t0: Instant,
    timeout: Duration,
    client: Client,
) -> Result<(Attempt, TcpStream), Attempt> {
    let began_s = since(t0);
    let mut attempt = Attempt {
        client,
        began_s,
        established_s: None,
        ended_s: began_s,
        end: End::Ok,
    };
    match connect(addr, timeout).await {
        Ok(stream) => {
            attempt.established_s = Some(since(t0));
            Ok((attempt, stream))
        }
        Err(kind) => {
            attempt.ended_s = since(t0);
            attempt.end = End::Failed(kind);
            Err(attempt)
        }
    }
}

async fn churn_client(
    addr: SocketAddr,
    t0: Instant,
    first: Instant,
    period: Duration,
    timeout: Duration,
    stop: watch::Receiver<bool>,
) -> Vec<Attempt> {
    paced(first, period, stop, || churn_request(addr, t0, timeout)).await
}

/// One request on a new connection (see [`crate::client::churn_request`]), recording when the
/// connect completed.
async fn churn_request(addr: SocketAddr, t0: Instant, timeout: Duration) -> Attempt {
    let deadline = Instant::now() + timeout;
    let (mut attempt, mut stream) = match connect_attempt(addr, t0, timeout, Client::Churn).await {
        Ok(connected) => connected,
        Err(failed) => return failed,
    };
    let mut request = [0x43u8; 16];
    request[0] = CLOSE_AFTER_REPLY;
    request[1] = request.len() as u8;
    let mut answer = [0u8; 64];
    let left = deadline.saturating_duration_since(Instant::now());
    let result = exchange(&mut stream, &request, &mut answer, left).await;
    attempt.ended_s = since(t0);
    if let Err(kind) = result {
        attempt.end = End::Failed(kind);
        return attempt;
    }
    // The answer is complete; wait for the backend's close so TIME_WAIT lands on its side.
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = tokio::time::timeout(left, stream.read(&mut answer)).await;
    attempt
}

async fn stream_client(
    addr: SocketAddr,
    t0: Instant,
    interval: Duration,
    timeout: Duration,
    mut stop: watch::Receiver<bool>,
) -> (Vec<Attempt>, u64) {
    let mut attempts = Vec::new();
    let mut pings = 0u64;
    while !*stop.borrow() {
        let (mut attempt, mut stream) =
            match connect_attempt(addr, t0, timeout, Client::Stream).await {
                Ok(connected) => connected,
                Err(failed) => {
                    attempts.push(failed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
        attempt.end = match ping_stream(&mut stream, interval, timeout, &mut stop, &mut pings).await
        {
            StreamEnd::Stopped => End::Ok,
            StreamEnd::Eof => End::Eof,
            StreamEnd::Idle(kind) | StreamEnd::Ping(kind) => End::Failed(kind),
        };
        attempt.ended_s = since(t0);
        attempts.push(attempt);
    }
    (attempts, pings)
}
