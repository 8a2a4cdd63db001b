//! What an operator reads over HTTP: the admin endpoints and the node's one scrape target.

pub mod admin;
pub mod scrape;
