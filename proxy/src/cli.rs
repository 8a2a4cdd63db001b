//! Command-line interface: the clap definitions, nothing else.
//!
//! Every `run` flag can also come from `KUBE_APISERVER_PROXY_<FLAG>`; repeatable flags take a
//! comma-separated list there. Values are parsed into typed [`crate::config::Config`] by
//! `TryFrom`, which is where cross-flag checks live.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Health-gated TCP front proxy for kube-apiserver with zero-loss listener handoff.
#[derive(Debug, Parser)]
#[command(
    name = "kube-apiserver-proxy",
    version,
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Flags of `run`, the default subcommand.
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy (the default when no subcommand is given).
    Run(Box<RunArgs>),
    /// Probe an admin endpoint: exit 0 when it answers 200, 1 otherwise (for exec probes).
    Probe(ProbeArgs),
    /// Pick a free random loopback address, write it to a file, substitute {{address}} (and
    /// {{port}}) in the arguments and exec the command (kube-apiserver) in place.
    Launch(LaunchArgs),
    /// Copy this binary to DEST (mode 0755, atomically): for init containers without `cp`.
    Install(InstallArgs),
    /// Print the `default/kubernetes` Endpoints and EndpointSlices of a single controller for
    /// `kubectl apply -f -` (with kube-apiserver --endpoint-reconciler-type=none).
    KubernetesEndpoints(KubernetesEndpointsArgs),
    /// As root, once, on a kubeadm controller: move the --listen addresses from the static
    /// kube-apiserver's wildcard socket (0.0.0.0:6443) to the Deployment's proxy without
    /// refusing a connection (docs/runbooks/migrate-from-kubeadm.md).
    Migrate(MigrateArgs),
    /// As root, on the controller: back from the Deployment to kubeadm's static kube-apiserver
    /// without refusing a connection (docs/runbooks/going-back.md).
    MigrateBack(MigrateBackArgs),
    /// Print the apiserver Deployment derived from kubeadm's static manifest (and what goes
    /// with it: the `default/kubernetes` endpoints and the disruption budget) for
    /// `kubectl apply -f -`.
    #[command(after_help = RENDER_AFTER_HELP)]
    Render(RenderArgs),
    /// Node agent (the static pod `kube-apiserver` of a migrated controller): keep the
    /// kubelet's static pods in step with kubeadm's manifests, kube-apiserver's as a surge
    /// rollout of the Deployment, so that `kubeadm upgrade` and `kubeadm certs renew` work.
    KubeadmSync(KubeadmSyncArgs),
    /// As root (CAP_NET_ADMIN), once per boot: install the node's policy routing that
    /// `run --client-address transparent` needs (the backends' answers to a client's address
    /// are delivered locally); prints each rule and route, added or present; exit 0 when all
    /// are in place.
    TransparentRoutes(TransparentRoutesArgs),
    /// Node agent (a static pod): keep the last-known-good checkpoint of the apiserver
    /// Deployment's pod; after a reboot, put it into the kubelet's static pod directory when
    /// nothing serves the node address; remove it once the recovery instance asks to be retired.
    Recover(Box<RecoverArgs>),
}

#[derive(Debug, Clone, Args)]
pub struct KubernetesEndpointsArgs {
    /// The node address the proxy serves on (kube-apiserver's --advertise-address).
    #[arg(long, value_name = "IP")]
    pub address: std::net::IpAddr,

    /// The port the proxy serves on.
    #[arg(long, value_name = "PORT", default_value = "6443", value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
}

/// What `render --help` ends with: the Kubernetes the node agents' object types are of
/// (`node::object::KNOWN`, which a test holds this to).
pub const RENDER_AFTER_HELP: &str = "Kubernetes objects are read and written as the types of \
Kubernetes v1.37 (as are kubeadm-sync's, recover's and migrate-back's): a manifest with a field \
v1.37 does not have is refused, naming the field, never rendered without it.";

#[derive(Debug, Clone, Args)]
pub struct RenderArgs {
    /// kubeadm's static apiserver manifest (/etc/kubernetes/manifests/kube-apiserver.yaml).
    #[arg(long, value_name = "FILE")]
    pub static_pod: PathBuf,

    /// The apiserver image (default: the manifest's); an older one is refused.
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,

    /// Render an apiserver image older than the manifest's.
    #[arg(long)]
    pub allow_downgrade: bool,

    /// The proxy image, for the sidecar and the init container (default: the base's).
    #[arg(long, value_name = "IMAGE")]
    pub proxy_image: Option<String>,

    /// What kube-apiserver sees as the client's address: `proxy` (127.0.0.1) or
    /// `transparent` (the client's own: the pod of manifests/client-address-transparent, with
    /// its init container and capability; kubeadm-sync keeps the mode of the live Deployment).
    #[arg(long, value_enum, default_value = "proxy")]
    pub client_address: ClientAddress,
}

#[derive(Debug, Clone, Args)]
pub struct KubeadmSyncArgs {
    /// kubeadm's static pod directory (a constant of kubeadm's).
    #[arg(long, value_name = "DIR", default_value = "/etc/kubernetes/manifests")]
    pub kubeadm_dir: PathBuf,

    /// The directory the kubelet runs (its --pod-manifest-path on a migrated controller).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/etc/kubernetes/kubelet-manifests"
    )]
    pub static_pod_dir: PathBuf,

    /// The agent's own credentials, read again on every pass: the kubeconfig
    /// --write-kubeconfig writes (a ServiceAccount's token with only what the agent calls).
    /// Any kubeconfig whose user may do the same works (kubeadm's admin.conf did, with every
    /// right of the cluster).
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/etc/kubernetes/kube-apiserver-proxy/kubeadm-sync.conf"
    )]
    pub kubeconfig: PathBuf,

    /// Gives the agent its own identity and exits: with --admin-kubeconfig, creates or
    /// updates the ServiceAccount kube-system/kube-apiserver-proxy-kubeadm-sync and the RBAC of
    /// what the agent calls, requests a token for --token-lifetime and writes a kubeconfig
    /// with it to --kubeconfig (0600). Run it before --once, and again before the token
    /// expires (the agent warns 30 days ahead; it reads the file again on every pass).
    #[arg(long, conflicts_with_all = ["once", "undo"])]
    pub write_kubeconfig: bool,

    /// With --write-kubeconfig: administrator credentials that may create the agent's
    /// ServiceAccount, its RBAC and a token for it.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/etc/kubernetes/admin.conf"
    )]
    pub admin_kubeconfig: PathBuf,

    /// With --write-kubeconfig: how long the agent's token is valid.
    #[arg(long, value_name = "DURATION", default_value = "8760h", value_parser = parse_duration)]
    pub token_lifetime: Duration,

    /// This node's name (the mirror pods are <name>-<node>).
    #[arg(long, value_name = "NAME", required_unless_present = "undo")]
    pub node_name: Option<String>,

    /// Namespace of the apiserver Deployment.
    #[arg(long, value_name = "NAMESPACE", default_value = "kube-system")]
    pub namespace: String,

    /// Name of the apiserver Deployment.
    #[arg(long, value_name = "NAME", default_value = "kube-apiserver")]
    pub deployment: String,

    /// The proxy image: this agent's own (its init container), and the Deployment's sidecar
    /// when the live Deployment has none.
    #[arg(long, value_name = "IMAGE", required_unless_present_any = ["undo", "write_kubeconfig"])]
    pub proxy_image: Option<String>,

    /// How often the directories are compared.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    pub interval: Duration,

    /// How long kubeadm's apiserver inputs must stay unchanged before a rollout (kubeadm renews
    /// certificates, then writes the manifest).
    #[arg(long, value_name = "DURATION", default_value = "3s", value_parser = parse_duration)]
    pub settle: Duration,

    /// How long a rollout to kubeadm's manifest may take before it is reported failed (so is
    /// one whose Deployment reports ProgressDeadlineExceeded). Below kubeadm's own wait (5m,
    /// UpgradeConfiguration timeouts.upgradeManifests), which then fails and puts the old
    /// manifest back, which the agent rolls the Deployment back to. `--once` waits this long.
    #[arg(long, value_name = "DURATION", default_value = "4m", value_parser = parse_duration)]
    pub rollout_timeout: Duration,

    /// How long the canary of a change to etcd's manifest may take to serve: kubeadm's new
    /// etcd pod, run first as a learner member beside the running etcd (its own ports, its data
    /// in an emptyDir), must apply the cluster's data before etcd's copy is changed; failed or
    /// past this, etcd is left as it runs and kubeadm's wait fails (it puts its manifest
    /// back). Below kubeadm's wait (5m), with room for etcd's restart. 0s: no canary.
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = parse_duration)]
    pub etcd_canary_timeout: Duration,

    /// The canary's client port on 127.0.0.1; its peer port is the next, its metrics port the
    /// one after (2479, 2480, 2481: beside etcd's 2379, 2380, 2381).
    #[arg(long, value_name = "PORT", default_value = "2479", value_parser = clap::value_parser!(u16).range(1..=65533))]
    pub etcd_canary_port: u16,

    /// One pass, at the migration: copy the manifests (each keeps the running pod's UID, so
    /// nothing restarts when the kubelet moves to --static-pod-dir), write the stand-in, set
    /// kubeadm's apiserver manifest aside until the agent runs, wait for kubeadm's apiserver to
    /// exit; then restart the kubelet on --static-pod-dir.
    #[arg(long)]
    pub once: bool,

    /// With --once: how long kubeadm's static apiserver may take to exit once its manifest is
    /// set aside (the kubelet's look at the directory, then the pod's grace period, 30s).
    /// Still running then: the manifest is put back and --once fails (exit 1), so that the
    /// kubelet is not restarted under it.
    #[arg(long, value_name = "DURATION", default_value = "120s", value_parser = parse_duration)]
    pub once_timeout: Duration,

    /// Going back to kubeadm's layout (docs/runbooks/going-back.md), once migrate-back has put
    /// kubeadm's apiserver into --static-pod-dir and the Deployment is gone: writes each pod
    /// the kubelet runs from --static-pod-dir into --kubeadm-dir as it runs, with its UID, so
    /// that the kubelet, restarted on kubeadm's directory, restarts none of them. Refuses
    /// (exit 2, nothing written) what is not one of kubeadm's pods as kubeadm has it. Needs no
    /// API access.
    #[arg(long, conflicts_with = "once")]
    pub undo: bool,
}

#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// An address the proxy serves (repeatable, the proxy's own --listen list: the node
    /// address and 127.0.0.1, same port as the apiserver's wildcard socket).
    #[arg(long = "listen", value_name = "ADDR", required = true, value_parser = parse_socket_addr)]
    pub listen: Vec<SocketAddr>,

    /// The proxies' handoff directory (owned by --uid, mode 0700).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/run/kube-apiserver-proxy/handoff"
    )]
    pub handoff_dir: PathBuf,

    /// The process holding the wildcard listener (default: found through /proc).
    #[arg(long, value_name = "PID")]
    pub pid: Option<u32>,

    /// The proxy's uid: this command drops to it before it serves the handoff socket (peers
    /// authenticate each other by uid).
    #[arg(long, value_name = "UID", default_value = "59443")]
    pub uid: u32,

    /// The proxy's gid (default: --uid).
    #[arg(long, value_name = "GID")]
    pub gid: Option<u32>,

    /// How long to wait for the Deployment's proxy to ask for the sockets.
    #[arg(long, value_name = "DURATION", default_value = "15m", value_parser = parse_duration)]
    pub timeout: Duration,

    /// An address of this node that serves the port now and may stop being served (repeatable):
    /// before acting, migrate looks for every address in use (established connections,
    /// servers of the kubeconfigs in --kubernetes-dir and of kube-public/cluster-info) and
    /// refuses while one is neither a --listen address nor dropped here.
    #[arg(long = "drop", value_name = "IP", value_parser = parse_ip)]
    pub drop: Vec<std::net::IpAddr>,

    /// kubeadm's directory: its *.conf kubeconfigs name the servers clients use; admin.conf
    /// reads kube-public/cluster-info.
    #[arg(long, value_name = "DIR", default_value = "/etc/kubernetes")]
    pub kubernetes_dir: PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct MigrateBackArgs {
    /// kubeadm's kube-apiserver manifest for the version that runs now, with
    /// --permit-port-sharing=true (docs/runbooks/going-back.md says how kubeadm renders it);
    /// put into --static-pod-dir as kube-apiserver.yaml.
    #[arg(long, value_name = "FILE")]
    pub manifest: PathBuf,

    /// The kubelet's static pod directory.
    #[arg(long, value_name = "DIR", default_value = "/etc/kubernetes/manifests")]
    pub static_pod_dir: PathBuf,

    /// The proxies' handoff directory (owned by --uid, mode 0700): the Deployment's proxy hands
    /// its listening sockets over here as it drains.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/run/kube-apiserver-proxy/handoff"
    )]
    pub handoff_dir: PathBuf,

    /// The proxies' uid (peers authenticate each other by uid).
    #[arg(long, value_name = "UID", default_value = "59443")]
    pub uid: u32,

    /// The proxies' gid (default: --uid).
    #[arg(long, value_name = "GID")]
    pub gid: Option<u32>,

    /// The cluster CA: the apiservers' /version and /readyz are read verified against it, under
    /// the name `kubernetes`.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/etc/kubernetes/pki/ca.crt"
    )]
    pub ca_file: PathBuf,

    /// Go ahead even though the manifest's image tag is not the version the apiserver serving
    /// now reports.
    #[arg(long)]
    pub allow_version_change: bool,

    /// How long to wait for the static apiserver and then for the Deployment's proxies to hand
    /// their sockets over (delete the Deployment meanwhile).
    #[arg(long, value_name = "DURATION", default_value = "15m", value_parser = parse_duration)]
    pub timeout: Duration,

    /// How long connections still queued on a taken socket, forwarded to the static apiserver,
    /// may go on before they are closed.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct RecoverArgs {
    /// The node address the apiserver serves (NODE_IP:6443): the checkpoint is activated only
    /// when nothing accepts connections there.
    #[arg(long, value_name = "ADDR")]
    pub node_address: String,

    /// The checkpoint directory (persistent, root-only): `kube-apiserver.json`, the
    /// checkpoint, and `kube-apiserver.previous.json`, the one it replaced.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kube-apiserver-proxy/checkpoint"
    )]
    pub checkpoint_dir: PathBuf,

    /// The node's kubeconfig (the kubelet's: /etc/kubernetes/kubelet.conf): the identity the
    /// apiserver pods bound to this node are read with, to write the checkpoint. Without it
    /// no checkpoint is written (activation and retirement only).
    #[arg(long, value_name = "FILE", requires = "node_name")]
    pub kubeconfig: Option<PathBuf>,

    /// This node's name (the pods bound to it are read).
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,

    /// Namespace of the apiserver Deployment.
    #[arg(long, value_name = "NAMESPACE", default_value = "kube-system")]
    pub namespace: String,

    /// Label selector of the apiserver workload's pods (mirror pods are left out).
    #[arg(
        long,
        value_name = "SELECTOR",
        default_value = "app.kubernetes.io/name=kube-apiserver,app.kubernetes.io/part-of=kube-apiserver-proxy"
    )]
    pub selector: String,

    /// How long a pod must have been Ready, without a break, before it becomes the checkpoint.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub checkpoint_after: Duration,

    /// How often the pods are read.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub checkpoint_interval: Duration,

    /// The kubelet's static pod directory (`staticPodPath`).
    #[arg(long, value_name = "DIR", default_value = "/etc/kubernetes/manifests")]
    pub static_pod_dir: PathBuf,

    /// Written by the recovery instance's proxy (`run --retire-file`) when it may go.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/run/kube-apiserver-proxy/checkpoint-retire"
    )]
    pub retire_file: PathBuf,

    /// Marks that this boot's decision was made; must be on a tmpfs (/run) so that a reboot
    /// clears it.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/run/kube-apiserver-proxy/recover-boot"
    )]
    pub boot_marker: PathBuf,

    /// The workload whose pods may become the checkpoint: deployment/NAME or daemonset/NAME in
    /// --namespace. A pod is written only if its controller owner references lead there (read
    /// from the API: the node's identity needs `get` on them, manifests/recovery).
    #[arg(
        long,
        value_name = "KIND/NAME",
        default_value = "deployment/kube-apiserver"
    )]
    pub workload: String,

    /// A further host path a checkpoint may mount, ADDED to the defaults (repeatable): kubeadm's
    /// certificate directories (/etc/kubernetes/pki, /etc/ssl/certs, /etc/ca-certificates,
    /// /etc/pki, /usr/share/ca-certificates, /usr/local/share/ca-certificates) and
    /// /run/kube-apiserver-proxy. Never allowed, whatever is given here: the checkpoint
    /// directory, the static pod directory, kubeadm's /etc/kubernetes/manifests, and any
    /// directory above one.
    #[arg(long = "allow-host-path", value_name = "PATH")]
    pub allow_host_path: Vec<String>,

    /// A further image repository a checkpoint's containers may run (repeatable, without tag),
    /// ADDED to the default registry.k8s.io/kube-apiserver: give the proxy's repository, and
    /// your mirror's. An entry ending in / allows every repository below it.
    #[arg(long = "allow-image-repository", value_name = "REPOSITORY")]
    pub allow_image_repository: Vec<String>,

    /// A capability a checkpoint's container may add (repeatable; none by default: a pod that
    /// adds any is refused). Only for a Deployment that needs one, e.g. transparent client
    /// addresses (NET_RAW, SETUID, SETGID for its sidecar).
    #[arg(long = "allow-capability", value_name = "CAP")]
    pub allow_capability: Vec<String>,

    /// kubeadm's apiserver manifest: at boot a checkpoint more than one minor version behind
    /// its image is not activated (the apiserver would meet data and clients of a newer one).
    /// Absent or unreadable: no such check (logged).
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/etc/kubernetes/manifests/kube-apiserver.yaml"
    )]
    pub kubeadm_manifest: PathBuf,

    /// Activate a checkpoint whatever its version is behind --kubeadm-manifest's.
    #[arg(long)]
    pub allow_version_skew: bool,

    /// Serve the agent's metrics (checkpoint age and refusals) on ADDR at /metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,

    /// Serve --metrics-listen over TLS with this certificate (PEM); needs --metrics-tls-key-file and --metrics-client-ca-file (as `run`'s).
    #[arg(long, value_name = "FILE")]
    pub metrics_tls_cert_file: Option<PathBuf>,

    /// The private key of --metrics-tls-cert-file (PEM).
    #[arg(long, value_name = "FILE")]
    pub metrics_tls_key_file: Option<PathBuf>,

    /// With TLS on --metrics-listen: only scrapers presenting a client certificate issued by a CA of this PEM file are answered.
    #[arg(long, value_name = "FILE")]
    pub metrics_client_ca_file: Option<PathBuf>,

    /// How often the retire file is looked for.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    pub interval: Duration,

    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Args)]
pub struct TransparentRoutesArgs {
    /// The routing table of the local routes (not 253-255: default, main and local, where a
    /// local default route would take every packet of the node).
    #[arg(long, value_name = "ID", default_value_t = crate::backends::routes::DEFAULT_TABLE, value_parser = parse_table)]
    pub table: u32,

    /// The priority of the rule for loopback sources (the 127.0.0.0/24 exception takes the one
    /// before it).
    #[arg(long, value_name = "N", default_value_t = crate::backends::routes::DEFAULT_PRIORITY, value_parser = clap::value_parser!(u32).range(2..32766))]
    pub priority: u32,

    /// Remove them instead.
    #[arg(long)]
    pub remove: bool,
}

#[derive(Debug, Clone, Args)]
pub struct InstallArgs {
    /// Where to put the binary, e.g. /proxy-bin/kube-apiserver-proxy.
    #[arg(value_name = "DEST")]
    pub dest: PathBuf,
}

/// How the active health check talks to a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HealthCheckKind {
    /// TLS handshake, then `GET --health-path`; ready only on HTTP 200.
    Https,
    /// TLS handshake only.
    Tls,
    /// TCP connect only.
    Tcp,
}

/// How bytes are moved between client and backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CopyMode {
    /// Buffered while bursts are small, splice(2) once a burst is bulk.
    Auto,
    /// Always splice(2) through a pooled pipe (zero-copy).
    Splice,
    /// Always through a per-thread buffer.
    Buffered,
}

/// Where bytes are moved between paired sockets: only ever by the proxy's threads. The flag
/// stays so that a unit or manifest that names the default keeps working; the kernel path it
/// once also chose was removed ([`parse_data_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPath {
    /// The proxy's threads copy (`--copy-mode`).
    User,
}

/// Parses `--data-path`: `user`; `sockmap`, the removed kernel path, is refused with what to use
/// instead.
pub fn parse_data_path(s: &str) -> Result<DataPath, ParseError> {
    match s {
        "user" => Ok(DataPath::User),
        "sockmap" => Err(ParseError::SockmapRemoved),
        _ => Err(ParseError::DataPath),
    }
}

/// Why a flag's value does not parse (the `parse_*` value parsers); clap puts it after the
/// flag's name.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParseError {
    #[error(
        "the kernel data path (sockmap) was removed: bytes are copied in user space; \
         drop the flag or use --data-path=user"
    )]
    SockmapRemoved,
    #[error("expected user")]
    DataPath,
    #[error("{0} is reserved (0 unspecified, 253 default, 254 main, 255 local)")]
    ReservedTable(u32),
    #[error("{0:?} is not a table number")]
    Table(String),
    #[error("{0} (expected e.g. 500ms, 2s, 1m)")]
    Duration(humantime::DurationError),
    #[error("{0:?} is not an IP address")]
    Ip(String),
    #[error("{0:?} is not an ip:port address (an IPv6 address goes in brackets: [IPv6]:port; in a manifest write [$(HOST_IP)]:PORT)")]
    UnbracketedIpv6(String),
    #[error("{0:?} is not an ip:port address")]
    SocketAddr(String),
}

/// How the data path uses threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RuntimeShape {
    /// One current-thread runtime per worker thread, each with its own `SO_REUSEPORT` socket.
    PerThread,
    /// One multi-threaded runtime (work stealing) for everything, one socket per address.
    Shared,
}

/// Which client address kube-apiserver sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ClientAddress {
    /// The proxy's own loopback address (no privilege needed).
    Proxy,
    /// The client's: connections to loopback backends are bound to it (IP_TRANSPARENT: needs
    /// CAP_NET_RAW and the policy routing of `transparent-routes`; falls back to `proxy`).
    Transparent,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Public address to serve, bound with SO_REUSEPORT (repeatable; IPv4 or [IPv6]:port).
    #[arg(
        long = "listen",
        value_name = "ADDR",
        env = "KUBE_APISERVER_PROXY_LISTEN",
        value_delimiter = ','
    )]
    pub listen: Vec<String>,

    /// A public IP address to serve on --listen-port, bound like --listen (repeatable, comma-separated: e.g. $(HOST_IPS) from the downward API's status.hostIPs, so that a dual-stack node is served on both its addresses).
    #[arg(
        long = "listen-host",
        value_name = "IP",
        env = "KUBE_APISERVER_PROXY_LISTEN_HOST",
        value_delimiter = ','
    )]
    pub listen_host: Vec<String>,

    /// The port every --listen-host is served on.
    #[arg(
        long,
        value_name = "PORT",
        env = "KUBE_APISERVER_PROXY_LISTEN_PORT",
        default_value = "6443",
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub listen_port: u16,

    /// Static backend address ip:port (repeatable).
    #[arg(
        long = "backend",
        value_name = "ADDR",
        env = "KUBE_APISERVER_PROXY_BACKEND",
        value_delimiter = ','
    )]
    pub backend: Vec<String>,

    /// This pod's apiserver: a file holding its ip:port (written by `launch`); followed when it changes.
    #[arg(
        long,
        value_name = "FILE",
        env = "KUBE_APISERVER_PROXY_OWN_BACKEND_FILE"
    )]
    pub own_backend_file: Option<PathBuf>,

    /// Directory shared by the instances on a node: each registers its own backend there and
    /// uses the others' as further backends.
    #[arg(long, value_name = "DIR", env = "KUBE_APISERVER_PROXY_BACKEND_DIR")]
    pub backend_dir: Option<PathBuf>,

    /// A --backend-dir entry not refreshed for this long is stale (instance gone or its backend dead).
    #[arg(long, value_name = "DURATION", env = "KUBE_APISERVER_PROXY_BACKEND_EXPIRY", default_value = "30s", value_parser = parse_duration)]
    pub backend_expiry: Duration,

    /// Admin HTTP address (/metrics, /healthz, /readyz, /status); port 0 (the default) picks a free port, so instances on one host coexist: the address is logged and written to --admin-address-file.
    #[arg(
        long,
        value_name = "ADDR",
        env = "KUBE_APISERVER_PROXY_ADMIN_LISTEN",
        default_value = "127.0.0.1:0"
    )]
    pub admin_listen: String,

    /// Write the bound admin address to this file once listening (read by `probe --admin-address-file`).
    #[arg(
        long,
        value_name = "FILE",
        env = "KUBE_APISERVER_PROXY_ADMIN_ADDRESS_FILE"
    )]
    pub admin_address_file: Option<PathBuf>,

    /// Node-wide scrape address (e.g. NODE_IP:9444), bound with SO_REUSEPORT and shared by every instance on the node: GET /metrics there answers with the metrics of all of them, so one scrape target per node stays valid across rollouts. Needs --handoff-dir (where instances find each other) and --metrics-label.
    #[arg(long, value_name = "ADDR", env = "KUBE_APISERVER_PROXY_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,

    /// How long the other instances' metrics, fetched for a scrape of --metrics-listen, are reused for further scrapes: a scrape storm costs the other instances one fetch per period. Keep it below the scrape interval.
    #[arg(long, value_name = "DURATION", env = "KUBE_APISERVER_PROXY_METRICS_CACHE", default_value = "10s", value_parser = parse_duration)]
    pub metrics_cache: Duration,

    /// Serve --metrics-listen over TLS with this certificate (PEM); needs --metrics-tls-key-file and --metrics-client-ca-file.
    #[arg(
        long,
        value_name = "FILE",
        env = "KUBE_APISERVER_PROXY_METRICS_TLS_CERT_FILE"
    )]
    pub metrics_tls_cert_file: Option<PathBuf>,

    /// The private key of --metrics-tls-cert-file (PEM).
    #[arg(
        long,
        value_name = "FILE",
        env = "KUBE_APISERVER_PROXY_METRICS_TLS_KEY_FILE"
    )]
    pub metrics_tls_key_file: Option<PathBuf>,

    /// With TLS on --metrics-listen: only scrapers presenting a client certificate issued by a CA of this PEM file are answered.
    #[arg(
        long,
        value_name = "FILE",
        env = "KUBE_APISERVER_PROXY_METRICS_CLIENT_CA_FILE"
    )]
    pub metrics_client_ca_file: Option<PathBuf>,

    /// Label NAME=VALUE added to every metric of this instance, e.g. pod=$(POD_NAME), so that the instances of one node tell apart on --metrics-listen (repeatable).
    #[arg(
        long = "metrics-label",
        value_name = "NAME=VALUE",
        env = "KUBE_APISERVER_PROXY_METRICS_LABEL",
        value_delimiter = ','
    )]
    pub metrics_label: Vec<String>,

    /// Active health check kind.
    #[arg(
        long,
        value_enum,
        env = "KUBE_APISERVER_PROXY_HEALTH_CHECK",
        default_value = "https"
    )]
    pub health_check: HealthCheckKind,

    /// HTTP path of the https check; only HTTP 200 counts as ready.
    #[arg(
        long,
        value_name = "PATH",
        env = "KUBE_APISERVER_PROXY_HEALTH_PATH",
        default_value = "/readyz"
    )]
    pub health_path: String,

    /// Time between health checks of one backend (jittered by up to 10%).
    #[arg(long, value_name = "DURATION", env = "KUBE_APISERVER_PROXY_HEALTH_INTERVAL", default_value = "2s", value_parser = parse_duration)]
    pub health_interval: Duration,

    /// Time one health check may take.
    #[arg(long, value_name = "DURATION", env = "KUBE_APISERVER_PROXY_HEALTH_TIMEOUT", default_value = "1s", value_parser = parse_duration)]
    pub health_timeout: Duration,

    /// Consecutive passing checks before a backend counts as healthy.
    #[arg(
        long,
        value_name = "N",
        env = "KUBE_APISERVER_PROXY_HEALTH_RISE",
        default_value = "2"
    )]
    pub health_rise: u32,

    /// Consecutive failing checks before a backend counts as unhealthy (refused this often: dead; its connections are kept).
    #[arg(
        long,
        value_name = "N",
        env = "KUBE_APISERVER_PROXY_HEALTH_FALL",
        default_value = "3"
    )]
    pub health_fall: u32,

    /// PEM bundle of CAs that verify backend serving certificates (https and tls checks).
    #[arg(long, value_name = "FILE", env = "KUBE_APISERVER_PROXY_HEALTH_CA_FILE")]
    pub health_ca_file: Option<PathBuf>,

    /// Server name sent (SNI) and verified in the backend certificate.
    #[arg(
        long,
        value_name = "NAME",
        env = "KUBE_APISERVER_PROXY_HEALTH_SERVER_NAME",
        default_value = "kubernetes"
    )]
    pub health_server_name: String,

    /// Do not verify backend certificates in health checks.
    #[arg(long, env = "KUBE_APISERVER_PROXY_HEALTH_INSECURE_SKIP_VERIFY")]
    pub health_insecure_skip_verify: bool,

    /// PEM client certificate presented by health checks (needs --health-client-key).
    #[arg(
        long,
        value_name = "FILE",
        env = "KUBE_APISERVER_PROXY_HEALTH_CLIENT_CERT"
    )]
    pub health_client_cert: Option<PathBuf>,

    /// PEM private key of --health-client-cert.
    #[arg(
        long,
        value_name = "FILE",
        env = "KUBE_APISERVER_PROXY_HEALTH_CLIENT_KEY"
    )]
    pub health_client_key: Option<PathBuf>,

    /// Time a backend connect may take before the next backend is tried; with none reachable, how long a new client is held while every backend is tried again.
    #[arg(long, value_name = "DURATION", env = "KUBE_APISERVER_PROXY_CONNECT_TIMEOUT", default_value = "3s", value_parser = parse_duration)]
    pub connect_timeout: Duration,

    /// After SIGTERM, how long established connections may go on before they are closed.
    #[arg(long, value_name = "DURATION", env = "KUBE_APISERVER_PROXY_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,

    /// Connections still open at the drain deadline are closed spread over this window.
    #[arg(long, value_name = "DURATION", env = "KUBE_APISERVER_PROXY_DRAIN_CLOSE_WINDOW", default_value = "2s", value_parser = parse_duration)]
    pub drain_close_window: Duration,

    /// Most client connections carried at once; further clients are closed at once and counted.
    #[arg(
        long,
        value_name = "N",
        env = "KUBE_APISERVER_PROXY_MAX_CONNECTIONS",
        default_value = "10000"
    )]
    pub max_connections: u32,

    /// How bytes are moved: auto (buffered for small bursts, splice(2) for bulk), splice, buffered.
    #[arg(
        long,
        value_enum,
        env = "KUBE_APISERVER_PROXY_COPY_MODE",
        default_value = "auto"
    )]
    pub copy_mode: CopyMode,

    /// Where bytes move once a connection is paired: `user`, the proxy's threads copy (the only
    /// value; accepted so that units naming it keep working).
    #[arg(
        long,
        value_name = "PATH",
        env = "KUBE_APISERVER_PROXY_DATA_PATH",
        default_value = "user",
        value_parser = parse_data_path
    )]
    pub data_path: DataPath,

    /// Which address kube-apiserver sees for a client (its audit log's sourceIPs): `proxy`, the
    /// proxy's loopback address, or `transparent`, the client's own (needs CAP_NET_RAW and
    /// `transparent-routes`; connects normally, counted and logged, where it cannot).
    #[arg(
        long,
        value_enum,
        env = "KUBE_APISERVER_PROXY_CLIENT_ADDRESS",
        default_value = "proxy"
    )]
    pub client_address: ClientAddress,

    /// Started as root, switch to UID[:GID] (numeric; GID defaults to UID) before anything
    /// else, keeping only CAP_NET_RAW with --client-address transparent, nothing otherwise (a
    /// pod cannot give a capability to a process that starts unprivileged).
    #[arg(long, value_name = "UID[:GID]", env = "KUBE_APISERVER_PROXY_USER")]
    pub user: Option<String>,

    /// Threads of the async runtime that carries connections (default: CPUs available).
    #[arg(long, value_name = "N", env = "KUBE_APISERVER_PROXY_WORKER_THREADS")]
    pub worker_threads: Option<usize>,

    /// Scheduling slice the worker threads ask the kernel for (Linux 6.12 and later; earlier
    /// kernels ignore it): a woken worker runs before a thread that has used the CPU for long,
    /// which cuts the latency tail when the CPUs are shared. 0 keeps the kernel's default.
    #[arg(long, value_name = "DURATION", env = "KUBE_APISERVER_PROXY_WORKER_SLICE", default_value = "100us", value_parser = parse_duration)]
    pub worker_slice: Duration,

    /// How the data path uses its threads: `per-thread` (a current-thread runtime and a
    /// listening socket per worker thread) or `shared` (one multi-threaded runtime).
    #[arg(
        long,
        value_enum,
        env = "KUBE_APISERVER_PROXY_RUNTIME",
        default_value = "per-thread"
    )]
    pub runtime: RuntimeShape,

    /// Directory of the handoff Unix sockets shared by all instances on the node.
    #[arg(long, value_name = "DIR", env = "KUBE_APISERVER_PROXY_HANDOFF_DIR")]
    pub handoff_dir: Option<PathBuf>,

    /// Further uid allowed to talk on the handoff socket besides our own (repeatable).
    #[arg(
        long = "handoff-allow-uid",
        value_name = "UID",
        env = "KUBE_APISERVER_PROXY_HANDOFF_ALLOW_UID",
        value_delimiter = ','
    )]
    pub handoff_allow_uid: Vec<u32>,

    /// This instance is a recovery instance (the checkpoint run as a static pod): once a handoff
    /// peer is ready beside it, write FILE, so that `recover` removes its static pod.
    #[arg(long, value_name = "FILE", env = "KUBE_APISERVER_PROXY_RETIRE_FILE")]
    pub retire_file: Option<PathBuf>,

    /// Log format on stderr.
    #[arg(
        long,
        value_enum,
        env = "KUBE_APISERVER_PROXY_LOG_FORMAT",
        default_value = "text"
    )]
    pub log_format: LogFormat,

    /// Log filter, e.g. `info` or `kube_apiserver_proxy=debug`.
    #[arg(
        long,
        value_name = "LEVEL",
        env = "KUBE_APISERVER_PROXY_LOG_LEVEL",
        default_value = "info"
    )]
    pub log_level: String,

    /// A fault to plant (builds with the `planted-faults` feature only: the real-cluster tier's
    /// self-test).
    #[cfg(feature = "planted-faults")]
    #[arg(long, value_enum, hide = true)]
    pub planted_fault: Option<crate::fault::Fault>,
}

#[derive(Debug, Clone, Args)]
pub struct ProbeArgs {
    /// URL to GET: http://IP:PORT/PATH, or https://IP:PORT/PATH (with --ca-file or
    /// --insecure-skip-verify).
    #[arg(value_name = "URL", required_unless_present_any = ["admin_address_file", "address_file"])]
    pub url: Option<String>,

    /// Read the admin address from this file (written by `run --admin-address-file`); plain HTTP.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["url", "address_file"])]
    pub admin_address_file: Option<PathBuf>,

    /// Read an apiserver address from this file (written by `launch --address-file`); HTTPS.
    #[arg(long, value_name = "FILE", conflicts_with = "url")]
    pub address_file: Option<PathBuf>,

    /// Path to probe when the address comes from a file.
    #[arg(long, value_name = "PATH", default_value = "/readyz")]
    pub path: String,

    /// HTTPS: PEM CA bundle that verifies the server certificate.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,

    /// HTTPS: server name sent (SNI) and verified.
    #[arg(long, value_name = "NAME", default_value = "kubernetes")]
    pub server_name: String,

    /// HTTPS: do not verify the server certificate.
    #[arg(long)]
    pub insecure_skip_verify: bool,

    /// HTTPS: client certificate (PEM), with --client-key.
    #[arg(long, value_name = "FILE", requires = "client_key")]
    pub client_cert: Option<PathBuf>,

    /// HTTPS: private key of --client-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "client_cert")]
    pub client_key: Option<PathBuf>,

    /// Time the probe may take.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    pub timeout: Duration,

    /// Try again every second until the probe passes or this much time has passed (0, the default: once). For preStop hooks that wait for a condition.
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_duration)]
    pub wait: Duration,

    /// Pass at once when nothing listens at the address: its file is missing or the connection
    /// is refused. For the preStop hooks that keep this pod serving until a peer is ready: when
    /// this pod's proxy does not run, there is nothing to keep serving (a proxy that cannot
    /// start must not hold its pod's deletion for the whole wait).
    #[arg(long)]
    pub pass_when_down: bool,
}

#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// File that receives the chosen `ip:port` (written atomically), read by the sidecar's
    /// --own-backend-file.
    #[arg(long, value_name = "FILE")]
    pub address_file: PathBuf,

    /// Port the command will listen on; the address is checked free for it. While a wildcard
    /// listener holds it (kubeadm's static apiserver), another free port is used if the
    /// arguments contain {{port}}.
    #[arg(long, value_name = "PORT", default_value = "6443")]
    pub port: u16,

    /// The command and its arguments; every {{address}} becomes the chosen IP, every {{port}}
    /// the chosen port.
    #[arg(last = true, value_name = "COMMAND", num_args = 0..)]
    pub command: Vec<std::ffi::OsString>,
}

/// The one line printed for a command-line error other than `--help`/`--version`: clap's first
/// line, with the missing flag or the possible values folded in (clap puts those on later lines).
pub fn usage_line(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
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
    line
}

/// Whether a parse "error" is really `--help` or `--version` output (printed as clap does).
pub fn is_display(e: &clap::Error) -> bool {
    use clap::error::ErrorKind;
    matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    )
}

/// Parses a routing table id of `transparent-routes --table`: 1-252 or 256 and above.
pub fn parse_table(s: &str) -> Result<u32, ParseError> {
    match s.trim().parse::<u32>() {
        Ok(id @ (1..=252 | 256..)) => Ok(id),
        Ok(id) => Err(ParseError::ReservedTable(id)),
        Err(_) => Err(ParseError::Table(s.to_owned())),
    }
}

/// Parses `500ms`, `2s`, `1m`, `1h30m`.
pub fn parse_duration(s: &str) -> Result<Duration, ParseError> {
    humantime::parse_duration(s).map_err(ParseError::Duration)
}

/// Parses an IP (`192.0.2.10`, `::1`, `[::1]`) or the IP of an `ip:port`.
pub fn parse_ip(s: &str) -> Result<std::net::IpAddr, ParseError> {
    let t = s.trim();
    t.parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| t.trim_start_matches('[').trim_end_matches(']').parse())
        .map_err(|_| ParseError::Ip(s.to_owned()))
}

/// Parses an address, accepting only literal `ip:port` (no DNS: the proxy must not depend on it):
/// `IPv4:port`, `[IPv6]:port`, and also `[IPv4]:port`, so that one manifest line
/// (`[$(HOST_IP)]:6443`) gives a valid address whichever family the node's address has. An
/// unbracketed IPv6 address with a port (`fd00::10:6443`, what `$(HOST_IP):6443` gives on an
/// IPv6 node) is ambiguous and rejected, naming the bracketed form.
pub fn parse_socket_addr(s: &str) -> Result<SocketAddr, ParseError> {
    let text = s.trim();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let bracketed = text
        .strip_prefix('[')
        .and_then(|rest| rest.split_once("]:"))
        .and_then(|(ip, port)| {
            let ip = ip.parse::<std::net::Ipv4Addr>().ok()?;
            Some(SocketAddr::from((ip, port.parse::<u16>().ok()?)))
        });
    if let Some(addr) = bracketed {
        return Ok(addr);
    }
    if text.parse::<std::net::Ipv6Addr>().is_ok() || text.matches(':').count() > 1 {
        return Err(ParseError::UnbracketedIpv6(s.to_owned()));
    }
    Err(ParseError::SocketAddr(s.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(args: &[&str]) -> clap::Error {
        let mut argv = vec!["kube-apiserver-proxy"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).expect_err("parse error")
    }

    #[test]
    fn usage_errors_fit_one_line_and_name_the_flag() {
        for (args, expect) in [
            (
                &["--health-check", "udp"][..],
                "possible values: https, tls, tcp",
            ),
            (&["--health-interval", "soon"][..], "--health-interval"),
            (
                &["launch", "--", "true"][..],
                "missing required argument: --address-file",
            ),
            (&["--bogus"][..], "--bogus"),
            (&["transparent-routes", "--table", "254"][..], "reserved"),
        ] {
            let line = usage_line(&error(args));
            assert!(line.contains(expect), "{args:?}: {line}");
            assert!(!line.contains('\n'), "{args:?}: {line}");
        }
        assert!(is_display(&error(&["--help"])));
        assert!(!is_display(&error(&["--bogus"])));
    }

    /// `--data-path=user` (the default, which units may name) still runs; `sockmap`, the
    /// removed kernel path, is one line that says so and what to use.
    #[test]
    fn data_path_accepts_user_and_says_sockmap_was_removed() {
        let args = ["kube-apiserver-proxy", "--listen", "127.0.0.1:6443"];
        let cli = Cli::try_parse_from(args.iter().chain(&["--data-path=user"])).expect("user");
        assert_eq!(cli.run.data_path, DataPath::User);
        let cli = Cli::try_parse_from(args).expect("default");
        assert_eq!(cli.run.data_path, DataPath::User);
        let line = usage_line(&error(&[
            "--listen",
            "127.0.0.1:6443",
            "--data-path=sockmap",
        ]));
        assert!(line.contains("--data-path"), "{line}");
        assert!(
            line.contains("kernel data path (sockmap) was removed"),
            "{line}"
        );
        assert!(line.contains("--data-path=user"), "{line}");
        assert!(!line.contains('\n'), "{line}");
    }
}
