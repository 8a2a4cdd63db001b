//! The `kube-apiserver-proxy` binary: parse, set up logging, run, map errors to exit codes.
//!
//! Exit codes: 0 success, 1 runtime failure (or a probe that failed), 2 bad input (nothing
//! was bound or started).

#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use kube_apiserver_proxy::base::exit::CommandError;
use kube_apiserver_proxy::cli::{self, Cli, Command, LogFormat, RunArgs, RuntimeShape};
use kube_apiserver_proxy::config::Config;
use kube_apiserver_proxy::node::kubeadm::{identity, kubernetes_endpoints, render, sync, undo};
use kube_apiserver_proxy::node::migration::{migrate, migrate_back};
use kube_apiserver_proxy::node::pod::{install, launch, probe};
use kube_apiserver_proxy::node::recovery::recover;
use kube_apiserver_proxy::{backends::routes, instance::privileges, instance::signal, server};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if cli::is_display(&e) => e.exit(),
        Err(e) => return bad_input(cli::usage_line(&e)),
    };
    match cli.command {
        None => run(cli.run),
        Some(Command::Run(args)) => run(*args),
        // A failed probe is what the kubelet reports: "probe failed: …".
        Some(Command::Probe(args)) => match probe::run(&args.into()) {
            Err(e) if !e.is_bad_input() => exit("probe failed: ", Err(e)),
            result => exit("error: ", result),
        },
        Some(Command::Install(args)) => exit("error: ", install::install(&args.dest)),
        Some(Command::KubernetesEndpoints(args)) => {
            match kubernetes_endpoints::check_address(args.address) {
                Ok(()) => stdout(&kubernetes_endpoints::render(args.address, args.port)),
                Err(e) => exit("error: ", Err(e)),
            }
        }
        Some(Command::Render(args)) => match render::print(&args.static_pod, &(&args).into()) {
            Ok(yaml) => stdout(&yaml),
            Err(e) => exit("error: ", Err(e)),
        },
        Some(Command::Migrate(args)) => {
            init_tracing(LogFormat::Text, "info");
            exit("error: ", migrate::run(&args.into()).map(|_| ()))
        }
        Some(Command::MigrateBack(args)) => {
            init_tracing(LogFormat::Text, "info");
            exit("error: ", migrate_back::run(&args.into()).map(|_| ()))
        }
        Some(Command::KubeadmSync(args)) => {
            init_tracing(LogFormat::Text, "info");
            if args.write_kubeconfig {
                return write_kubeconfig(&args);
            }
            let result = if args.undo {
                undo::undo(&args.kubeadm_dir, &args.static_pod_dir).map(|_| ())
            } else {
                sync::run(&args.into())
            };
            exit("error: kubeadm-sync: ", result)
        }
        Some(Command::TransparentRoutes(args)) => transparent_routes(&args),
        Some(Command::Recover(args)) => {
            init_tracing(args.log_format, "info");
            exit("error: recover: ", recover::run(&(*args).into()))
        }
        // Returns only when it could not exec.
        Some(Command::Launch(args)) => exit("error: ", Err(launch::launch(&args.into()))),
    }
}

/// Ends a command: nothing on success; otherwise `prefix` and the error's line on stderr, and
/// its exit code (2 bad input, 1 a failure: [`CommandError`]).
fn exit<E: CommandError>(prefix: &str, result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{prefix}{}", e.line());
            ExitCode::from(e.exit_code())
        }
    }
}

/// Prints what a command renders; exit 1 when stdout cannot take it.
fn stdout(text: &str) -> ExitCode {
    match std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: writing to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `transparent-routes`: one line per rule and route, as `ip` shows it; exit 1 when one could
/// not be read or added.
fn transparent_routes(args: &cli::TransparentRoutesArgs) -> ExitCode {
    let items = routes::items(args.table, args.priority);
    let done = if args.remove {
        routes::remove(&items)
    } else {
        routes::install(&items)
    };
    match done {
        Ok(done) => {
            for (item, outcome) in done {
                println!("{outcome}: {item}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => exit("error: transparent-routes: ", Err(e)),
    }
}

/// `kubeadm-sync --write-kubeconfig` (`node::kubeadm::identity`).
fn write_kubeconfig(args: &cli::KubeadmSyncArgs) -> ExitCode {
    let id = identity::Identity {
        node: args.node_name.as_deref().unwrap_or_default(),
        deployment: (&args.namespace, &args.deployment),
        kubeadm_dir: &args.kubeadm_dir,
    };
    match identity::write(
        &args.admin_kubeconfig,
        &args.kubeconfig,
        &id,
        args.token_lifetime,
    ) {
        Ok(expiry) => {
            tracing::info!(
                kubeconfig = %args.kubeconfig.display(),
                user = identity::USER,
                expires = %humantime::format_rfc3339_seconds(expiry),
                "kubeadm-sync: the agent's kubeconfig written; write it again before it expires"
            );
            ExitCode::SUCCESS
        }
        Err(e) if e.is_bad_input() => exit("error: kubeadm-sync: ", Err(e)),
        Err(e) => exit("error: kubeadm-sync --write-kubeconfig: ", Err(e)),
    }
}

fn bad_input(line: String) -> ExitCode {
    eprintln!("{line}");
    ExitCode::from(2)
}

fn run(args: RunArgs) -> ExitCode {
    let config = match Config::try_from(args) {
        Ok(c) => c,
        Err(e) => return exit("error: ", Err(e)),
    };
    init_tracing(config.log_format, &config.log_level);
    // Before any thread exists: capabilities belong to threads.
    if let Some((uid, gid)) = config.user {
        let transparent = config.client_address == cli::ClientAddress::Transparent;
        if let Err(e) = privileges::switch(uid, gid, transparent) {
            return bad_input(format!("error: --user: {e}"));
        }
        tracing::info!(uid, gid, cap_net_raw = transparent, "switched user");
        // Checked here rather than with the other flags: as the uid that uses it.
        if let Some(h) = &config.handoff {
            if let Err(e) = kube_apiserver_proxy::handoff::check_dir(&h.dir) {
                let e = e.to_string();
                return bad_input(format!(
                    "error: --handoff-dir: {}",
                    e.trim_start_matches("--handoff-dir ")
                ));
            }
        }
    }
    // With a runtime per worker thread (workers.rs) the main runtime carries only the control
    // plane.
    let runtime = match config.runtime {
        RuntimeShape::Shared => {
            let slice = config.worker_slice;
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(config.worker_threads.get())
                .on_thread_start(move || kube_apiserver_proxy::data::workers::ask_for_slice(slice))
                .enable_all()
                .build()
        }
        RuntimeShape::PerThread => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
    }
    .expect("tokio runtime");
    let intents = {
        let _runtime = runtime.enter();
        signal::intents()
    };
    // `--metrics-label`s go on every series (checked to be valid label names by `Config`).
    let labels = config.metrics_labels.iter().cloned().collect();
    let registry = prometheus::Registry::new_custom(None, Some(labels)).expect("valid labels");
    let result = runtime.block_on(server::run(config, registry, intents));
    // A file-system call stuck on the blocking pool (a hung mount) must not keep us from exiting.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{:#}", anyhow::Error::from(e)), "exiting");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(format: LogFormat, level: &str) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(level))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
