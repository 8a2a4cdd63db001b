//! Newtypes for the roles an address plays, so a backend address cannot be passed where a
//! listen address is meant.

use std::fmt;
use std::net::SocketAddr;

macro_rules! addr_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub SocketAddr);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl From<SocketAddr> for $name {
            fn from(addr: SocketAddr) -> Self {
                Self(addr)
            }
        }
    };
}

addr_newtype!(
    /// A public address the proxy serves (the node address, shared with peers).
    ListenAddr
);
addr_newtype!(
    /// A kube-apiserver address the proxy forwards to.
    BackendAddr
);
addr_newtype!(
    /// The peer address of an accepted client connection.
    ClientAddr
);
addr_newtype!(
    /// The admin HTTP endpoint address.
    AdminAddr
);
