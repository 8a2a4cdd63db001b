//! `bench`: the benchmark harness and rollout demo of kube-apiserver-proxy.
//!
//! Run `cargo run --release -p kube-apiserver-proxy-bench -- rollout` for the demo, or
//! `-- --help` for the scenarios. Everything lives in the library; this file only parses the
//! command line and maps errors to an exit code.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use kube_apiserver_proxy_bench::{cli::Cli, run};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
