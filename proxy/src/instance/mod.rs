//! One process's life around the data path: signals, service-manager notifications, limits, privileges, in-place upgrade, a recovery instance's request to be retired.

pub mod limits;
pub mod notify;
pub mod privileges;
pub mod retire;
pub mod signal;
pub mod upgrade;
