//! The node commands' options from their flags: each command below the CLI takes its own plain
//! options struct (`probe::Options`, …), not clap's; this root, which sees both layers, converts
//! one into the other (the flags are `cli`'s, a layer below `node`, which must not name them).

use crate::cli;
use crate::node::kubeadm::{render, sync};
use crate::node::migration::{migrate, migrate_back};
use crate::node::pod::{launch, probe};
use crate::node::recovery::recover;

impl From<cli::ProbeArgs> for probe::Options {
    fn from(a: cli::ProbeArgs) -> Self {
        probe::Options {
            url: a.url,
            admin_address_file: a.admin_address_file,
            address_file: a.address_file,
            path: a.path,
            ca_file: a.ca_file,
            server_name: a.server_name,
            insecure_skip_verify: a.insecure_skip_verify,
            client_cert: a.client_cert,
            client_key: a.client_key,
            timeout: a.timeout,
            wait: a.wait,
            pass_when_down: a.pass_when_down,
        }
    }
}

impl From<cli::LaunchArgs> for launch::Options {
    fn from(a: cli::LaunchArgs) -> Self {
        launch::Options {
            address_file: a.address_file,
            port: a.port,
            command: a.command,
        }
    }
}

impl From<cli::MigrateArgs> for migrate::Options {
    fn from(a: cli::MigrateArgs) -> Self {
        migrate::Options {
            listen: a.listen,
            handoff_dir: a.handoff_dir,
            pid: a.pid,
            uid: a.uid,
            gid: a.gid,
            timeout: a.timeout,
            drop: a.drop,
            kubernetes_dir: a.kubernetes_dir,
        }
    }
}

impl From<cli::MigrateBackArgs> for migrate_back::Options {
    fn from(a: cli::MigrateBackArgs) -> Self {
        migrate_back::Options {
            manifest: a.manifest,
            static_pod_dir: a.static_pod_dir,
            handoff_dir: a.handoff_dir,
            uid: a.uid,
            gid: a.gid,
            ca_file: a.ca_file,
            allow_version_change: a.allow_version_change,
            timeout: a.timeout,
            drain_timeout: a.drain_timeout,
        }
    }
}

impl From<cli::RecoverArgs> for recover::Options {
    fn from(a: cli::RecoverArgs) -> Self {
        recover::Options {
            node_address: a.node_address,
            checkpoint_dir: a.checkpoint_dir,
            kubeconfig: a.kubeconfig,
            node_name: a.node_name,
            namespace: a.namespace,
            selector: a.selector,
            checkpoint_after: a.checkpoint_after,
            checkpoint_interval: a.checkpoint_interval,
            static_pod_dir: a.static_pod_dir,
            retire_file: a.retire_file,
            boot_marker: a.boot_marker,
            workload: a.workload,
            allow_host_path: a.allow_host_path,
            allow_image_repository: a.allow_image_repository,
            allow_capability: a.allow_capability,
            kubeadm_manifest: a.kubeadm_manifest,
            allow_version_skew: a.allow_version_skew,
            metrics_listen: a.metrics_listen,
            metrics_tls_cert_file: a.metrics_tls_cert_file,
            metrics_tls_key_file: a.metrics_tls_key_file,
            metrics_client_ca_file: a.metrics_client_ca_file,
            interval: a.interval,
        }
    }
}

impl From<cli::KubeadmSyncArgs> for sync::Options {
    fn from(a: cli::KubeadmSyncArgs) -> Self {
        sync::Options {
            kubeadm_dir: a.kubeadm_dir,
            static_pod_dir: a.static_pod_dir,
            kubeconfig: a.kubeconfig,
            node_name: a.node_name,
            namespace: a.namespace,
            deployment: a.deployment,
            proxy_image: a.proxy_image,
            interval: a.interval,
            settle: a.settle,
            rollout_timeout: a.rollout_timeout,
            etcd_canary_timeout: a.etcd_canary_timeout,
            etcd_canary_port: a.etcd_canary_port,
            once: a.once,
            once_timeout: a.once_timeout,
        }
    }
}

impl From<&cli::RenderArgs> for render::Options {
    fn from(a: &cli::RenderArgs) -> Self {
        render::Options {
            image: a.image.clone(),
            allow_downgrade: a.allow_downgrade,
            proxy_image: a.proxy_image.clone(),
            client_address_transparent: a.client_address == cli::ClientAddress::Transparent,
        }
    }
}
