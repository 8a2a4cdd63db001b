//! `run --user UID[:GID]`: a process started as root switches to the proxy's uid before it
//! does anything else, keeping only the capability `--client-address transparent` needs
//! (`CAP_NET_RAW`), and nothing without it.
//!
//! A pod cannot hand a capability to a process that starts as a non-root user (Kubernetes
//! sets no ambient capabilities), and every proxy instance of a node must run as the same uid
//! (handoff peers check `SO_PEERCRED`, and an `SO_REUSEPORT` group admits one uid). So the
//! transparent sidecar starts as uid 0 with `NET_RAW`, `SETUID` and `SETGID` and ends up as the
//! uid of every other instance with `CAP_NET_RAW` alone, raised in the ambient set so that
//! the successor of an in-place upgrade has it too. Done while the process has one thread:
//! capabilities belong to threads.

use nix::unistd::{getgid, getuid, setgroups, setresgid, setresuid, Gid, Uid};

use crate::sys;

/// Why the switch failed. The message names the kernel's error itself: its causes end here.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("cannot switch to uid {uid}, gid {gid} (needs CAP_SETUID and CAP_SETGID, e.g. a container started as uid 0 with them): {source}")]
    Switch {
        uid: u32,
        gid: u32,
        source: nix::Error,
    },
    #[error("cannot keep CAP_NET_RAW (the process must start with it): {0}")]
    Keep(std::io::Error),
}

/// Switches to `uid`:`gid` (unless already there) with no supplementary groups, keeping
/// `CAP_NET_RAW` if `keep_net_raw`, and drops every other capability.
pub fn switch(uid: u32, gid: u32, keep_net_raw: bool) -> Result<(), PrivilegeError> {
    let keep = if keep_net_raw {
        1u64 << sys::CAP_NET_RAW
    } else {
        0
    };
    let switching = getuid().as_raw() != uid || getgid().as_raw() != gid;
    if switching {
        let fail = |source| PrivilegeError::Switch { uid, gid, source };
        nix::sys::prctl::set_keepcaps(true).map_err(fail)?;
        let g = Gid::from_raw(gid);
        setgroups(&[]).map_err(fail)?;
        setresgid(g, g, g).map_err(fail)?;
        let u = Uid::from_raw(uid);
        setresuid(u, u, u).map_err(fail)?;
        nix::sys::prctl::set_keepcaps(false).map_err(fail)?;
    }
    sys::keep_only_capabilities(keep).map_err(PrivilegeError::Keep)?;
    if switching {
        // The uid change made the process undumpable, which hands its /proc files to root (it
        // could no longer read /proc/self/fd for the open_fds metric). Back to what a process
        // started as this uid has: a process of the same uid still cannot ptrace it while it
        // holds a capability the tracer lacks.
        nix::sys::prctl::set_dumpable(true).map_err(|source| PrivilegeError::Switch {
            uid,
            gid,
            source,
        })?;
    }
    Ok(())
}

/// Parses `UID[:GID]` (numeric).
pub fn parse_user(text: &str) -> Result<(u32, u32), UserError> {
    let (uid, gid) = match text.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (text, None),
    };
    let number = |s: &str| s.parse::<u32>().map_err(|_| UserError(text.to_owned()));
    let uid = number(uid)?;
    let gid = gid.map(number).transpose()?.unwrap_or(uid);
    Ok((uid, gid))
}

/// A `--user` that is not a numeric `UID[:GID]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected a numeric UID[:GID]")]
pub struct UserError(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_is_numeric_with_gid_defaulting_to_uid() {
        assert_eq!(parse_user("65532"), Ok((65532, 65532)));
        assert_eq!(parse_user("65532:1000"), Ok((65532, 1000)));
        assert!(parse_user("nobody").is_err());
        assert!(parse_user("1:x").is_err());
        assert!(parse_user("").is_err());
    }
}
