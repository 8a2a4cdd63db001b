//! Handoff between two instances in one process, over real Unix and TCP sockets, with fault
//! hooks that pause or fail the receiver at chosen points so races are reproduced exactly.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::Registry;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Handoff;
use super::HandoffConfig;
use crate::backends::readiness::Readiness;
use crate::base::addr::ListenAddr;
use crate::base::lifecycle::State;
use crate::data::forward::ForwardContext;
use crate::data::listener::Listeners;
use crate::handoff::metrics::{HandoffDirection, HandoffMetrics, HandoffOutcome};

/// Fault injection points of the serving side (tests only).
#[derive(Default)]
pub(super) struct Hooks {
    pause: Mutex<Option<Arc<Pause>>>,
    fail_holds: AtomicUsize,
}

/// Holds the receiver of one adoption between its state read and taking the sockets.
#[derive(Default)]
pub(super) struct Pause {
    reached: Notify,
    release: Notify,
}

impl Hooks {
    pub(super) async fn after_state_read(&self) {
        let pause = self.pause.lock().unwrap().take();
        if let Some(pause) = pause {
            pause.reached.notify_one();
            pause.release.notified().await;
        }
    }

    /// True (once per armed failure) when the next adopted socket is to be dropped untaken.
    pub(super) fn fail_hold(&self) -> bool {
        self.fail_holds
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

struct Instance {
    handoff: Arc<Handoff>,
    listeners: Arc<Listeners>,
    state: watch::Sender<State>,
}

impl Instance {
    fn start(dir: &Path, addr: ListenAddr, state: State, backend_ready: bool) -> Instance {
        let registry = Registry::new();
        let stop = CancellationToken::new();
        let ctx = Arc::new(ForwardContext::for_tests(&registry, &stop));
        let listeners = Arc::new(Listeners::new(
            ctx,
            100,
            crate::data::workers::Placement::Shared,
            stop.child_token(),
        ));
        let (state, rx) = watch::channel(state);
        let handoff = Handoff::start(
            HandoffConfig {
                dir: dir.to_path_buf(),
                allow_uids: Vec::new(),
            },
            vec![addr],
            listeners.clone(),
            Readiness::from_fn(rx, move || backend_ready),
            HandoffMetrics::register(&registry),
            stop,
            tokio_util::task::TaskTracker::new(),
        )
        .unwrap();
        Instance {
            handoff,
            listeners,
            state,
        }
    }

    /// Holds `socket` as a listener of `addr` bound by this instance; returns its cookie.
    fn hold(&self, addr: ListenAddr, socket: std::net::TcpListener) -> u64 {
        self.listeners.hold(addr, socket, "bound").unwrap().0.cookie
    }

    fn cookies(&self) -> Vec<u64> {
        let mut c: Vec<u64> = self.listeners.info().iter().map(|l| l.cookie).collect();
        c.sort();
        c
    }
}

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn handoff_dir() -> Dir {
    Dir(std::env::temp_dir().join(format!("kap-handoff-unit-{:016x}", rand::random::<u64>())))
}

/// Two distinct listening sockets on one address (as after a failed share).
fn two_sockets() -> (ListenAddr, std::net::TcpListener, std::net::TcpListener) {
    let first = crate::base::net::bind_reuseport("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = first.local_addr().unwrap();
    let second = crate::base::net::bind_reuseport(addr).unwrap();
    (ListenAddr(addr), first, second)
}

/// A draining sender, in a fresh handoff directory, holding the first of two sockets on one
/// address: the directory, the address, the sender, the cookie of the socket it holds, and the
/// second socket.
fn sender_holding_one() -> (Dir, ListenAddr, Instance, u64, std::net::TcpListener) {
    let dir = handoff_dir();
    let (addr, first, second) = two_sockets();
    let sender = Instance::start(&dir.0, addr, State::Draining, true);
    let c1 = sender.hold(addr, first);
    (dir, addr, sender, c1, second)
}

/// The receiver reads `Serving`, then starts draining (and takes the snapshot it hands on)
/// before it takes the offered socket. The socket must end up either in that snapshot or
/// still with the sender — never acknowledged by the receiver and then closed by both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adoption_racing_the_receivers_drain_is_refused() {
    let (dir, addr, sender, c1, second) = sender_holding_one();
    let receiver = Instance::start(&dir.0, addr, State::Serving, true);
    receiver.hold(addr, second);
    let pause = Arc::new(Pause::default());
    *receiver.handoff.hooks.pause.lock().unwrap() = Some(pause.clone());

    let handoff = sender.handoff.clone();
    let offering = tokio::spawn(async move {
        handoff
            .hand_over(Instant::now() + Duration::from_secs(1), || true)
            .await
    });
    tokio::time::timeout(Duration::from_secs(5), pause.reached.notified())
        .await
        .expect("the receiver never read its state for an adoption");
    // The receiver's drain starts between its state read and the adoption.
    receiver.state.send(State::Draining).unwrap();
    let handed_on: Vec<u64> = receiver
        .listeners
        .freeze()
        .unwrap()
        .iter()
        .map(|s| s.identity.cookie)
        .collect();
    pause.release.notify_one();
    let adopted = offering.await.unwrap();

    let kept = sender.cookies();
    assert!(
        handed_on.contains(&c1) || kept.contains(&c1),
        "socket {c1} acknowledged by the receiver but missing from what it hands on \
         ({handed_on:?}) and released by the sender ({kept:?})"
    );
    assert!(!adopted, "a draining receiver took the sockets");
    assert_eq!(kept, vec![c1], "the sender must keep what was not taken");
}

/// The receiver takes one of two offered sockets for one address. The sender closes only that
/// one, keeps accepting on the other and offers it again until it is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_acknowledged_sockets_are_released() {
    let dir = handoff_dir();
    let (addr, first, second) = two_sockets();
    let sender = Instance::start(&dir.0, addr, State::Draining, true);
    sender.hold(addr, first);
    sender.hold(addr, second);
    let offered = sender.cookies();
    assert_eq!(offered.len(), 2);
    let receiver = Instance::start(&dir.0, addr, State::Serving, true);
    receiver.handoff.hooks.fail_holds.store(1, Ordering::SeqCst);

    let adopted = sender
        .handoff
        .hand_over(Instant::now() + Duration::from_secs(5), || true)
        .await;

    assert_eq!(
        receiver.cookies(),
        offered,
        "a socket the receiver never took was released by the sender"
    );
    assert!(adopted, "the second offer was never made or taken");
    assert!(sender.cookies().is_empty());
}

/// A peer that is Serving but not ready (its own backend not healthy) is not handed sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serving_peer_that_is_not_ready_is_not_handed_sockets() {
    let (dir, addr, sender, c1, _) = sender_holding_one();
    let receiver = Instance::start(&dir.0, addr, State::Serving, false);

    let adopted = sender
        .handoff
        .hand_over(Instant::now() + Duration::from_millis(500), || true)
        .await;

    assert!(!adopted);
    assert!(
        receiver.cookies().is_empty(),
        "an unready peer took sockets"
    );
    assert_eq!(sender.cookies(), vec![c1]);
    let peers = sender.handoff.peers_json().to_string();
    assert!(peers.contains("ready false"), "peer never asked: {peers}");
}

/// The `handoffs_total` label values are the exported ones.
#[test]
fn label_values_are_the_exported_ones() {
    let directions = [
        HandoffDirection::ShareSent,
        HandoffDirection::ShareReceived,
        HandoffDirection::AdoptSent,
        HandoffDirection::AdoptReceived,
        HandoffDirection::ConnectionsSent,
        HandoffDirection::ConnectionsReceived,
    ]
    .map(HandoffDirection::as_str);
    assert_eq!(
        directions,
        [
            "share_sent",
            "share_received",
            "adopt_sent",
            "adopt_received",
            "connections_sent",
            "connections_received"
        ]
    );
    let outcomes = [
        HandoffOutcome::Ok,
        HandoffOutcome::Error,
        HandoffOutcome::Refused,
        HandoffOutcome::NoPeer,
    ]
    .map(HandoffOutcome::as_str);
    assert_eq!(outcomes, ["ok", "error", "refused", "no_peer"]);
}
