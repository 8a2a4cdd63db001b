//! No import cycles between the modules of `bench/src`: the proxy crate's module-graph test,
//! which checks the crate it is compiled into, run here on this one.

#[path = "../../proxy/tests/module_graph.rs"]
mod module_graph;
