//! One process's life around the data path: signals, service-manager notifications, limits, privileges, in-place upgrade.

pub mod limits;
pub mod notify;
pub mod privileges;
pub mod signal;
pub mod upgrade;
