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
    let frame = encode(msg);
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
    let mut buf = Vec::with_capacity(512);
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some((msg, used)) = decode(&buf)? {
            if used != buf.len() {
                return Err(WireError::Trailing);
            }
            if fds.len() != msg.fd_count() {
                return Err(WireError::Descriptors {
                    expected: msg.fd_count(),
                    got: fds.len(),
                });
            }
            return Ok((msg, fds));
        }
        stream.readable().await?;
        let want = (HEADER_LEN + MAX_PAYLOAD - buf.len()).min(chunk.len());
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
