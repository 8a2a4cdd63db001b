//! The data path: accepting, forwarding, carrying bytes both ways, handing connections over.

pub mod control;
pub mod copy;
pub mod forward;
pub mod listener;
pub mod metrics;
pub mod transfer;
pub mod workers;
