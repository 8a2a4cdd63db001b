//! systemd's readiness protocol (`sd_notify`), without libsystemd: one datagram to the socket
//! named by `$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace). Nothing happens
//! when the variable is unset (not under systemd, or `Type=` other than `notify`).
//!
//! - `READY=1` once started (configuration valid, admin endpoint up; not yet Serving, so that
//!   a start does not fail while every apiserver is down).
//! - `MAINPID=<pid>` when an in-place upgrade handed over to a successor: systemd then tracks
//!   the successor as the service's main process, and this one may exit (the unit needs
//!   `NotifyAccess=all`, so that the successor's own messages are accepted too).

use std::io;
use std::os::unix::net::UnixDatagram;

/// Sends `state` (newline-separated `KEY=VALUE` lines) to systemd if it asked for it.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path.to_string_lossy(), state) {
        tracing::warn!(error = %e, state, "cannot notify systemd");
    }
}

fn send(path: &str, state: &str) -> io::Result<()> {
    let socket = UnixDatagram::unbound()?;
    if let Some(name) = path.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        socket.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        socket.send_to(state.as_bytes(), path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_a_path_and_to_an_abstract_name() {
        let dir = std::env::temp_dir().join(format!("kap-notify-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let receiver = UnixDatagram::bind(&path).unwrap();
        send(path.to_str().unwrap(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = receiver.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        std::fs::remove_dir_all(&dir).unwrap();

        use std::os::linux::net::SocketAddrExt;
        let name = format!("kap-notify-{}", rand::random::<u64>());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let receiver = UnixDatagram::bind_addr(&addr).unwrap();
        send(&format!("@{name}"), "MAINPID=42").unwrap();
        let n = receiver.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"MAINPID=42");
    }
}
