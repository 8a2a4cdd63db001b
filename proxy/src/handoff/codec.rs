//! The handoff message codec. Pure: bytes in, messages out.
//!
//! A frame is `b"KAPH"`, a version byte, a flags byte (0), a big-endian u32 payload length, and
//! a JSON payload of at most [`MAX_PAYLOAD`] bytes. Listening sockets travel beside the frame as
//! `SCM_RIGHTS` descriptors, in the order of the `addrs` list of `Sockets` and `Adopt`.
//! `Connections` carries two descriptors per connection (client, backend) and is followed on
//! the stream by the connections' pending bytes ([`Message::tail_len`]), each direction at most
//! [`MAX_PENDING`] bytes. Anything else — wrong magic, unknown version, oversize, malformed
//! JSON — is an error.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::base::lifecycle::State;

/// Frame magic.
pub const MAGIC: &[u8; 4] = b"KAPH";
/// Protocol version spoken here. Version 2: `Status` says whether the peer is ready, `Ack`
/// names sockets by cookie. Instances of different versions do not exchange sockets.
pub const VERSION: u8 = 2;
/// Header length: magic, version, flags, length.
pub const HEADER_LEN: usize = 10;
/// Largest payload accepted.
pub const MAX_PAYLOAD: usize = 16 * 1024;
/// Most pending bytes one direction of one handed-over connection may carry (the copy holds at
/// most one 64 KiB buffer or pipe per direction).
pub const MAX_PENDING: u32 = 256 * 1024;

/// One connection in a `Connections` message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnEntry {
    /// The client's address (as the old instance saw it), for logs.
    pub client: String,
    /// Bytes read from the client, not yet written to the backend.
    pub up: u32,
    /// Bytes read from the backend, not yet written to the client.
    pub down: u32,
}

/// The state a peer says it is in (`Status`): a proxy instance's lifecycle state, or what the
/// `migrate` and `migrate-back` commands serving a handoff socket call themselves.
///
/// On the wire it is the plain string (`"Serving"`, `"Migrating"`, ...), as it always was. A
/// string this version does not know (a newer peer's state) decodes as [`PeerState::Other`] and
/// encodes back unchanged, so instances of different versions still understand each other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum PeerState {
    /// A proxy instance in this lifecycle state.
    Instance(State),
    /// `migrate`, waiting for a proxy to ask for the sockets (never ready).
    Migrating,
    /// `migrate-back`, ready once the static apiserver is.
    MigratingBack,
    /// A state this version does not know.
    Other(String),
}

impl PeerState {
    /// The wire name.
    pub fn as_str(&self) -> &str {
        match self {
            PeerState::Instance(state) => state.as_str(),
            PeerState::Migrating => "Migrating",
            PeerState::MigratingBack => "MigratingBack",
            PeerState::Other(s) => s,
        }
    }
}

impl From<State> for PeerState {
    fn from(state: State) -> Self {
        PeerState::Instance(state)
    }
}

impl From<String> for PeerState {
    fn from(s: String) -> Self {
        if let Some(state) = State::ALL.into_iter().find(|st| st.as_str() == s) {
            return PeerState::Instance(state);
        }
        match s.as_str() {
            "Migrating" => PeerState::Migrating,
            "MigratingBack" => PeerState::MigratingBack,
            _ => PeerState::Other(s),
        }
    }
}

impl From<PeerState> for String {
    fn from(state: PeerState) -> Self {
        match state {
            PeerState::Other(s) => s,
            known => known.as_str().to_owned(),
        }
    }
}

impl fmt::Display for PeerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Compares by wire name (`state == "Serving"`).
impl PartialEq<&str> for PeerState {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A handoff message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Message {
    /// "What state are you in?"
    StatusRequest,
    /// Answer to `StatusRequest`: the lifecycle state, and whether the instance is ready
    /// (Serving with its own backend healthy; only a ready peer is handed sockets).
    Status {
        pid: u32,
        state: PeerState,
        ready: bool,
    },
    /// A starting instance asks for duplicates of the listening sockets bound to `addrs`.
    ShareRequest { addrs: Vec<String> },
    /// Listening sockets, one descriptor per entry of `addrs`.
    Sockets { addrs: Vec<String> },
    /// A draining instance offers its listening sockets, one descriptor per entry of `addrs`.
    Adopt { addrs: Vec<String> },
    /// The receiver now accepts on the offered sockets with these `SO_COOKIE`s; the sender
    /// closes exactly those and keeps offering the rest.
    Ack { cookies: Vec<u64> },
    /// The request was refused.
    Refuse { reason: String },
    /// An instance upgrading in place hands over established connections: descriptors client,
    /// backend for each entry, in order; the pending bytes follow the frame (up, then down, for
    /// each entry in order). Answered with `Ack` naming the client sockets taken by cookie.
    Connections { conns: Vec<ConnEntry> },
}

impl Message {
    /// How many descriptors travel with this message.
    pub fn fd_count(&self) -> usize {
        match self {
            Message::Sockets { addrs } | Message::Adopt { addrs } => addrs.len(),
            Message::Connections { conns } => 2 * conns.len(),
            _ => 0,
        }
    }

    /// How many raw bytes follow the frame on the stream.
    pub fn tail_len(&self) -> usize {
        match self {
            Message::Connections { conns } => {
                conns.iter().map(|c| c.up as usize + c.down as usize).sum()
            }
            _ => 0,
        }
    }
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("bad magic")]
    BadMagic,
    #[error("unsupported protocol version {0}")]
    Version(u8),
    #[error("unsupported flags {0:#x}")]
    Flags(u8),
    #[error("payload of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("malformed payload: {0}")]
    Payload(String),
}

/// Encodes a message into one frame.
pub fn encode(msg: &Message) -> Vec<u8> {
    let payload = serde_json::to_vec(msg).expect("message serializes");
    assert!(payload.len() <= MAX_PAYLOAD, "message too large to encode");
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(0);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Decodes one frame from the front of `buf`: `Ok(None)` when more bytes are needed, else the
/// message and the bytes it used. Errors are detected as early as the bytes allow.
pub fn decode(buf: &[u8]) -> Result<Option<(Message, usize)>, DecodeError> {
    let magic_len = buf.len().min(MAGIC.len());
    if buf[..magic_len] != MAGIC[..magic_len] {
        return Err(DecodeError::BadMagic);
    }
    if buf.len() > 4 && buf[4] != VERSION {
        return Err(DecodeError::Version(buf[4]));
    }
    if buf.len() > 5 && buf[5] != 0 {
        return Err(DecodeError::Flags(buf[5]));
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[6], buf[7], buf[8], buf[9]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(DecodeError::TooLarge(len));
    }
    if buf.len() < HEADER_LEN + len {
        return Ok(None);
    }
    let msg: Message = serde_json::from_slice(&buf[HEADER_LEN..HEADER_LEN + len])
        .map_err(|e| DecodeError::Payload(e.to_string()))?;
    if msg.fd_count() > crate::sys::MAX_FDS {
        return Err(DecodeError::Payload(format!(
            "{} sockets in one message",
            msg.fd_count()
        )));
    }
    if let Message::Connections { conns } = &msg {
        if conns
            .iter()
            .any(|c| c.up > MAX_PENDING || c.down > MAX_PENDING)
        {
            return Err(DecodeError::Payload(
                "pending bytes of a connection exceed the limit".into(),
            ));
        }
    }
    Ok(Some((msg, HEADER_LEN + len)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn all_messages() -> Vec<Message> {
        vec![
            Message::StatusRequest,
            Message::Status {
                pid: 42,
                state: State::Serving.into(),
                ready: true,
            },
            Message::Status {
                pid: 43,
                state: PeerState::MigratingBack,
                ready: false,
            },
            Message::ShareRequest {
                addrs: vec!["127.0.0.1:6443".into(), "[::1]:6443".into()],
            },
            Message::Sockets {
                addrs: vec!["127.0.0.1:6443".into()],
            },
            Message::Adopt { addrs: vec![] },
            Message::Ack {
                cookies: vec![4096, 1 << 40],
            },
            Message::Refuse {
                reason: "not serving".into(),
            },
            Message::Connections {
                conns: vec![ConnEntry {
                    client: "10.0.0.1:40000".into(),
                    up: 3,
                    down: 65536,
                }],
            },
        ]
    }

    #[test]
    fn round_trip_and_every_prefix_is_incomplete() {
        for msg in all_messages() {
            let frame = encode(&msg);
            assert_eq!(decode(&frame).unwrap(), Some((msg.clone(), frame.len())));
            for cut in 0..frame.len() {
                assert_eq!(decode(&frame[..cut]).unwrap(), None, "{msg:?} cut at {cut}");
            }
            let mut two = frame.clone();
            two.extend_from_slice(&frame);
            assert_eq!(decode(&two).unwrap().unwrap().1, frame.len());
        }
    }

    /// The state travels as the string it always was, both ways, unknown ones included.
    #[test]
    fn status_state_is_the_plain_string_on_the_wire() {
        let cases = [
            (PeerState::from(State::Serving), "Serving"),
            (State::WaitingForBackend.into(), "WaitingForBackend"),
            (PeerState::Migrating, "Migrating"),
            (PeerState::MigratingBack, "MigratingBack"),
            (PeerState::Other("Resting".into()), "Resting"),
        ];
        for (state, name) in cases {
            let msg = Message::Status {
                pid: 7,
                state: state.clone(),
                ready: false,
            };
            let payload = format!(r#"{{"type":"status","pid":7,"state":"{name}","ready":false}}"#);
            assert_eq!(&encode(&msg)[HEADER_LEN..], payload.as_bytes());
            let mut frame = b"KAPH\x02\x00".to_vec();
            frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            frame.extend_from_slice(payload.as_bytes());
            assert_eq!(decode(&frame).unwrap().unwrap().0, msg, "{name}");
            assert_eq!(state.as_str(), name);
        }
    }

    #[test]
    fn rejects_bad_headers_early() {
        assert_eq!(decode(b"GET / HTTP/1.1\r\n"), Err(DecodeError::BadMagic));
        assert_eq!(decode(b"KAPX"), Err(DecodeError::BadMagic));
        assert_eq!(decode(b"KAPH\x01"), Err(DecodeError::Version(1)));
        assert_eq!(decode(b"KAPH\x02\x01"), Err(DecodeError::Flags(1)));
        let mut big = b"KAPH\x02\x00".to_vec();
        big.extend_from_slice(&(MAX_PAYLOAD as u32 + 1).to_be_bytes());
        assert_eq!(decode(&big), Err(DecodeError::TooLarge(MAX_PAYLOAD + 1)));
        big.truncate(6);
        big.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(decode(&big), Err(DecodeError::TooLarge(_))));
    }

    #[test]
    fn rejects_malformed_payloads() {
        for payload in [
            &b"{}"[..],
            b"not json",
            br#"{"type":"nope"}"#,
            br#"{"type":"ack"}"#,
            br#"{"type":"ack","cookies":"x"}"#,
            br#"{"type":"status","pid":1,"state":"Serving"}"#,
        ] {
            let mut frame = b"KAPH\x02\x00".to_vec();
            frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            frame.extend_from_slice(payload);
            assert!(
                matches!(decode(&frame), Err(DecodeError::Payload(_))),
                "{payload:?}"
            );
        }
        let too_much = Message::Connections {
            conns: vec![ConnEntry {
                client: String::new(),
                up: MAX_PENDING + 1,
                down: 0,
            }],
        };
        assert!(matches!(
            decode(&encode(&too_much)),
            Err(DecodeError::Payload(_))
        ));
        let too_many = Message::Connections {
            conns: vec![
                ConnEntry {
                    client: String::new(),
                    up: 0,
                    down: 0
                };
                crate::sys::MAX_FDS / 2 + 1
            ],
        };
        assert!(matches!(
            decode(&encode(&too_many)),
            Err(DecodeError::Payload(_))
        ));
        let many = Message::Adopt {
            addrs: vec!["127.0.0.1:1".into(); crate::sys::MAX_FDS + 1],
        };
        assert!(matches!(
            decode(&encode(&many)),
            Err(DecodeError::Payload(_))
        ));
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x6b6170);
        for i in 0..20_000 {
            let len = rng.gen_range(0..64);
            let mut buf: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            if i % 2 == 0 {
                // Valid header, random payload: exercises the JSON path.
                let mut frame = b"KAPH\x02\x00".to_vec();
                frame.extend_from_slice(&(buf.len() as u32).to_be_bytes());
                frame.append(&mut buf);
                buf = frame;
            }
            let _ = decode(&buf);
        }
        // Mutations of valid frames.
        for msg in all_messages() {
            let frame = encode(&msg);
            for _ in 0..2_000 {
                let mut f = frame.clone();
                let at = rng.gen_range(0..f.len());
                f[at] = rng.gen();
                if let Ok(Some((_, used))) = decode(&f) {
                    assert!(used <= f.len());
                }
            }
        }
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        fn addr() -> impl Strategy<Value = String> {
            prop_oneof![
                (any::<[u8; 4]>(), any::<u16>())
                    .prop_map(|(ip, port)| std::net::SocketAddr::from((ip, port)).to_string()),
                ".{0,40}",
            ]
        }

        fn message() -> impl Strategy<Value = Message> {
            prop_oneof![
                Just(Message::StatusRequest),
                (any::<u32>(), ".{0,20}", any::<bool>()).prop_map(|(pid, state, ready)| {
                    Message::Status {
                        pid,
                        state: PeerState::from(state),
                        ready,
                    }
                }),
                prop::collection::vec(addr(), 0..8)
                    .prop_map(|addrs| Message::ShareRequest { addrs }),
                prop::collection::vec(addr(), 0..8).prop_map(|addrs| Message::Sockets { addrs }),
                prop::collection::vec(addr(), 0..8).prop_map(|addrs| Message::Adopt { addrs }),
                prop::collection::vec(any::<u64>(), 0..8)
                    .prop_map(|cookies| Message::Ack { cookies }),
                ".{0,100}".prop_map(|reason| Message::Refuse { reason }),
                prop::collection::vec((addr(), 0..=MAX_PENDING, 0..=MAX_PENDING), 0..8).prop_map(
                    |c| Message::Connections {
                        conns: c
                            .into_iter()
                            .map(|(client, up, down)| ConnEntry { client, up, down })
                            .collect()
                    }
                ),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4096))]

            /// Any message survives encode/decode, and every strict prefix asks for more.
            #[test]
            fn round_trips(msg in message()) {
                let frame = encode(&msg);
                prop_assert_eq!(decode(&frame).unwrap(), Some((msg, frame.len())));
                let cut = frame.len() / 2;
                prop_assert_eq!(decode(&frame[..cut]).unwrap(), None);
            }

            /// Arbitrary bytes never panic, and a decoded frame never claims more than it was given.
            #[test]
            fn arbitrary_input_is_safe(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
                if let Ok(Some((_, used))) = decode(&bytes) {
                    prop_assert!(used <= bytes.len());
                }
            }

            /// A valid header with an arbitrary payload is either a message or an error, never a panic
            /// or a request for more bytes than announced.
            #[test]
            fn arbitrary_payload_is_safe(payload in prop::collection::vec(any::<u8>(), 0..512)) {
                let mut frame = b"KAPH\x02\x00".to_vec();
                frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
                frame.extend_from_slice(&payload);
                prop_assert!(!matches!(decode(&frame), Ok(None)));
            }

            /// Flipping any byte of a valid frame never panics.
            #[test]
            fn mutated_frames_are_safe(msg in message(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
                let mut frame = encode(&msg);
                let i = at.index(frame.len());
                frame[i] = byte;
                if let Ok(Some((_, used))) = decode(&frame) {
                    prop_assert!(used <= frame.len());
                }
            }
        }
    }
}
