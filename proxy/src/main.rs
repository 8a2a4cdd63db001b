//! The `kube-apiserver-proxy` binary: parse, set up logging, run, map errors to exit codes.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 bad input (nothing was bound).

#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use kube_apiserver_proxy::cli::{Cli, Command, LogFormat};
use kube_apiserver_proxy::config::Config;
use kube_apiserver_proxy::{install, launch, probe, server, signal};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    match cli.command {
        Some(Command::Probe(args)) => run_probe(&args),
        Some(Command::Run(args)) => run(*args),
        Some(Command::Install(args)) => match install::install(&args.dest) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(2)
            }
        },
        Some(Command::Launch(args)) => {
            let err = launch::launch(&args);
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
        None => run(cli.run),
    }
}

/// `--help` and `--version` print as usual; any other parse error becomes one line, exit 2.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    let rendered = e.render().to_string();
    let mut line = rendered
        .lines()
        .next()
        .unwrap_or("invalid arguments")
        .to_string();
    if e.kind() == ErrorKind::MissingRequiredArgument {
        if let Some(ContextValue::Strings(args)) = e.get(ContextKind::InvalidArg) {
            line = format!("error: missing required argument: {}", args.join(", "));
        }
    }
    if let Some(ContextValue::Strings(values)) = e.get(ContextKind::ValidValue) {
        line.push_str(&format!(" (possible values: {})", values.join(", ")));
    }
    eprintln!("{line}");
    ExitCode::from(2)
}

fn run(args: kube_apiserver_proxy::cli::RunArgs) -> ExitCode {
    let config = match Config::try_from(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    init_tracing(config.log_format, &config.log_level);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.worker_threads.get())
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(server::run(
        config,
        prometheus::Registry::new(),
        signal::shutdown(),
    )) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{:#}", anyhow::Error::from(e)), "exiting");
            ExitCode::FAILURE
        }
    }
}

fn run_probe(args: &kube_apiserver_proxy::cli::ProbeArgs) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let target = match probe::target(args) {
        Ok(t) => t,
        Err(
            e @ (probe::ProbeError::NoTrust
            | probe::ProbeError::Tls { .. }
            | probe::ProbeError::BadUrl(_)),
        ) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("probe failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(probe::probe(&target, args.timeout)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("probe failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(format: LogFormat, level: &str) {
    let filter = tracing_subscriber::EnvFilter::new(level);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
