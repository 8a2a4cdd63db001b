//! Frames with descriptors over a tokio Unix stream: one request, one answer, bounded.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use tokio::io::Interest;
use tokio::net::UnixStream;

use super::codec::{decode, encode, DecodeError, Message, HEADER_LEN, MAX_PAYLOAD};
use crate::sys;

/// Why an exchange on the handoff socket failed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Decode(#[from] DecodeError),
    #[error("peer closed the connection mid-message")]
    Closed,
    #[error("{got} descriptors arrived where {expected} were announced")]
    Descriptors { expected: usize, got: usize },
    #[error("trailing bytes after the message")]
    Trailing,
    #[error("timed out")]
    Timeout,
}

/// Sends one message; `fds` travel with its first byte.
pub async fn send(
    stream: &UnixStream,
    msg: &Message,
    fds: &[BorrowedFd<'_>],
) -> Result<(), WireError> {
    send_with_tail(stream, msg, fds, &[]).await
}

/// Sends one message followed by `tail` (its [`Message::tail_len`] raw bytes).
pub async fn send_with_tail(
    stream: &UnixStream,
    msg: &Message,
    fds: &[BorrowedFd<'_>],
    tail: &[u8],
) -> Result<(), WireError> {
    debug_assert_eq!(tail.len(), msg.tail_len());
    let mut frame = encode(msg);
    frame.extend_from_slice(tail);
    let mut sent = 0;
    while sent < frame.len() {
        stream.writable().await?;
        let attach: &[BorrowedFd<'_>] = if sent == 0 { fds } else { &[] };
        match stream.try_io(Interest::WRITABLE, || {
            sys::send_with_fds(stream.as_fd(), &frame[sent..], attach)
        }) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Receives exactly one message and the descriptors it announces. Descriptors of a rejected
/// message are closed (they are owned from the moment they arrive).
pub async fn recv(stream: &UnixStream) -> Result<(Message, Vec<OwnedFd>), WireError> {
    let (msg, fds, _) = recv_with_tail(stream).await?;
    Ok((msg, fds))
}

/// [`recv`], and the raw bytes that follow the frame ([`Message::tail_len`] of them; anything
/// beyond is an error).
pub async fn recv_with_tail(
    stream: &UnixStream,
) -> Result<(Message, Vec<OwnedFd>, Vec<u8>), WireError> {
    let mut buf = Vec::with_capacity(512);
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    // The decoded message and where its frame ends, once complete.
    let mut decoded: Option<(Message, usize)> = None;
    loop {
        if decoded.is_none() {
            decoded = decode(&buf)?;
        }
        let want = match &decoded {
            Some((msg, used)) => {
                let total = used + msg.tail_len();
                if buf.len() > total {
                    return Err(WireError::Trailing);
                }
                if buf.len() == total {
                    let (msg, used) = decoded.take().expect("decoded");
                    if fds.len() != msg.fd_count() {
                        return Err(WireError::Descriptors {
                            expected: msg.fd_count(),
                            got: fds.len(),
                        });
                    }
                    let tail = buf.split_off(used);
                    return Ok((msg, fds, tail));
                }
                total - buf.len()
            }
            None => HEADER_LEN + MAX_PAYLOAD - buf.len(),
        };
        stream.readable().await?;
        let want = want.min(chunk.len());
        match stream.try_io(Interest::READABLE, || {
            sys::recv_with_fds(stream.as_fd(), &mut chunk[..want])
        }) {
            Ok((0, _)) => return Err(WireError::Closed),
            Ok((n, received)) => {
                buf.extend_from_slice(&chunk[..n]);
                fds.extend(received);
                if fds.len() > sys::MAX_FDS {
                    return Err(WireError::Descriptors {
                        expected: sys::MAX_FDS,
                        got: fds.len(),
                    });
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.into()),
        }
    }
}
