//! The last-known-good checkpoint, written by the `recover` node agent: the newest pod of the
//! apiserver Deployment on this node that has been Ready, without a break, for
//! `--checkpoint-after`, as a static pod.
//!
//! "Ready" is the pod's `Ready` condition and its `lastTransitionTime`: both containers ready,
//! i.e. the proxy Serving and this pod's apiserver passing `/readyz`. The pod of a broken
//! rollout never gets there, so it never becomes the checkpoint; a pod that flaps starts its
//! wait again. What is written is that very pod, never the Deployment's template, which during
//! a rollout may already be the broken one.
//!
//! The pods are read with the node's own identity (the kubelet's kubeconfig; the Node
//! authorizer lets it read the pods bound to this node, which root on the node can do anyway),
//! so the apiserver pod itself carries no API credential: a service account token volume would
//! need the API to be mounted, and the pod could then never start while it is the only
//! apiserver.
//!
//! A pod is written only if it is the told workload's (its controller owner references lead
//! there, uids compared through the API) and passes [`staticpod::validate`], the rules `recover`
//! applies again before activating it: a refusal is reported while there is an API, not found
//! at boot. The kubeconfig is read at every attempt (the kubelet rotates its certificate).
//!
//! Files in the checkpoint directory: [`FILE`] (the checkpoint) and [`PREVIOUS`] (the one it
//! replaced, for an operator's manual fallback); nothing else is kept. A checkpoint of a newer
//! pod (by `creationTimestamp`) is never replaced by an older pod's.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http_body_util::{Empty, Full};
use hyper::body::Bytes;
use hyper::StatusCode;
use serde_json::Value;

use crate::base::fsutil::write_durable;
use crate::base::http_client::{self, HttpError};
use crate::node::kubeconfig::{self, KubeconfigError, Problem};
use crate::node::staticpod::{self, Origin};

/// The checkpoint's file name in the checkpoint directory.
pub const FILE: &str = "kube-apiserver.json";
/// The checkpoint it replaced.
pub const PREVIOUS: &str = "kube-apiserver.previous.json";
/// Time one API request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest answer accepted from the API.
const MAX_BODY: usize = 16 << 20;

/// Why an attempt failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Kubeconfig(#[from] KubeconfigError),
    #[error("GET {path}: {source}")]
    Api {
        path: String,
        #[source]
        source: ApiError,
    },
    #[error("pod {pod} is unusable as a checkpoint: {source}")]
    Unusable {
        pod: String,
        #[source]
        source: staticpod::Unusable,
    },
    #[error("{path}: {source}")]
    File {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Why an API request failed: no answer, an answer of another status, or not JSON.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("not JSON: {0}")]
    Json(#[from] serde_json::Error),
}

impl ApiError {
    /// The status of an answer refused for it.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ApiError::Http(HttpError::Status { status, .. }) => Some(*status),
            _ => None,
        }
    }
}

/// Why an anonymous client cannot be made.
#[derive(Debug, thiserror::Error)]
enum AnonymousError {
    #[error("{0}")]
    Tls(#[from] crate::backends::tls::TlsError),
    #[error("server name {name}: {source}")]
    ServerName {
        name: String,
        #[source]
        source: rustls::pki_types::InvalidDnsNameError,
    },
}

/// An apiserver and the credentials to read from it.
#[derive(Clone)]
pub struct ApiClient {
    host: String,
    port: u16,
    server_name: rustls::pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    /// Sent as `Authorization: Bearer`.
    token: Option<String>,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "https://{}", self.authority())
    }
}

impl ApiClient {
    /// From a kubeconfig (as kubeadm writes `kubelet.conf`, or any other): its current
    /// context's server, CA and client certificate and key or token ([`crate::node::kubeconfig`]).
    pub fn from_kubeconfig(path: &Path) -> Result<Self, KubeconfigError> {
        Self::from_config(kubeconfig::read(path)?, path)
    }

    /// From a kubeconfig already read from `path` (named in errors).
    pub fn from_config(k: kubeconfig::Kubeconfig, path: &Path) -> Result<Self, KubeconfigError> {
        Self::from_current_context(k).map_err(|problem| KubeconfigError {
            path: path.display().to_string(),
            problem,
        })
    }

    fn from_current_context(k: kubeconfig::Kubeconfig) -> Result<Self, Problem> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut &k.ca[..]) {
            let cert = cert.map_err(|source| Problem::Pem {
                key: "certificate-authority",
                source,
            })?;
            roots.add(cert).map_err(Problem::Root)?;
        }
        let client = match &k.client {
            Some((cert, key)) => {
                let certs = rustls_pemfile::certs(&mut &cert[..])
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|source| Problem::Pem {
                        key: "client-certificate",
                        source,
                    })?;
                let key = rustls_pemfile::private_key(&mut &key[..])
                    .map_err(|source| Problem::Pem {
                        key: "client-key",
                        source,
                    })?
                    .ok_or(Problem::NoPemKey("client-key"))?;
                Some((certs, key))
            }
            None => None,
        };
        let tls = crate::backends::tls::client_config(Some(roots), client).map_err(Problem::Tls)?;
        let server_name =
            rustls::pki_types::ServerName::try_from(k.host.clone()).map_err(|source| {
                Problem::ServerName {
                    server: k.server.clone(),
                    source,
                }
            })?;
        Ok(ApiClient {
            host: k.host,
            port: k.port,
            server_name,
            tls,
            token: k.token,
        })
    }

    /// A server at `host:port` that asks for a client certificate (etcd's client port, its JSON
    /// gateway): verified against the PEM CA bundle `ca`, as the PEM certificate `cert` with its
    /// key `key`.
    pub fn mutual(
        host: &str,
        port: u16,
        ca: Vec<u8>,
        cert: Vec<u8>,
        key: Vec<u8>,
    ) -> Result<Self, Problem> {
        Self::from_current_context(kubeconfig::Kubeconfig {
            host: host.to_owned(),
            port,
            server: format!("https://{host}:{port}"),
            ca,
            client: Some((cert, key)),
            token: None,
        })
    }

    /// An apiserver at `addr` verified against the CA bundle `ca` under `server_name`, read
    /// anonymously (`/readyz`, `/version`); the error as one line of text.
    pub fn anonymous(addr: SocketAddr, ca: &Path, server_name: &str) -> Result<Self, String> {
        Self::anonymous_typed(addr, ca, server_name).map_err(|e| e.to_string())
    }

    fn anonymous_typed(
        addr: SocketAddr,
        ca: &Path,
        server_name: &str,
    ) -> Result<Self, AnonymousError> {
        let roots = crate::backends::tls::load_roots(ca)?;
        let tls = crate::backends::tls::client_config(Some(roots), None)?;
        Ok(ApiClient {
            host: addr.ip().to_string(),
            port: addr.port(),
            server_name: rustls::pki_types::ServerName::try_from(server_name.to_owned()).map_err(
                |source| AnonymousError::ServerName {
                    name: server_name.to_owned(),
                    source,
                },
            )?,
            tls,
            token: None,
        })
    }

    /// `host:port`, an IPv6 host in brackets.
    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// `GET path` (with query); the JSON body of a 200.
    pub async fn get_json(&self, path: &str) -> Result<Value, ApiError> {
        let body = self.get(path).await?;
        Ok(serde_json::from_slice(&body)?)
    }

    /// `GET path` (with query); the body of a 200.
    pub async fn get(&self, path: &str) -> Result<Bytes, ApiError> {
        let req = hyper::Request::get(path).header(
            hyper::header::USER_AGENT,
            concat!("kube-apiserver-proxy-recover/", env!("CARGO_PKG_VERSION")),
        );
        let answer = self.call(req, Empty::<Bytes>::new()).await?;
        Ok(answer.accept(|s| s == StatusCode::OK, 200)?)
    }

    /// `METHOD path` with a JSON body (`PUT`, `POST`); the JSON answer of a 2xx.
    pub async fn send_json(
        &self,
        method: &str,
        path: &str,
        body: &Value,
    ) -> Result<Value, ApiError> {
        let body = Bytes::from(serde_json::to_vec(body).expect("JSON value serializes"));
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(
                hyper::header::USER_AGENT,
                concat!("kube-apiserver-proxy/", env!("CARGO_PKG_VERSION")),
            );
        let answer = self.call(req, Full::new(body)).await?;
        let body = answer.accept(|s| s.is_success(), 300)?;
        Ok(serde_json::from_slice(&body)?)
    }

    /// Sends `req` with `body` (and `Host`, `Accept`, the token) over a new connection, within
    /// [`REQUEST_TIMEOUT`].
    async fn call<B>(
        &self,
        req: hyper::http::request::Builder,
        body: B,
    ) -> Result<http_client::Answer, HttpError>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut req = req
            .header(hyper::header::HOST, self.authority())
            .header(hyper::header::ACCEPT, "application/json");
        if let Some(token) = &self.token {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let req = req.body(body)?;
        http_client::within(REQUEST_TIMEOUT, async {
            let addr = http_client::resolve(&self.host, self.port).await?;
            let tcp = http_client::connect(addr).await?;
            let tls = http_client::tls(self.tls.clone(), self.server_name.clone(), tcp).await?;
            http_client::request(tls, req, MAX_BODY).await
        })
        .await
    }
}

/// The workload whose pods may become the checkpoint (`recover --workload`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Workload {
    /// Its pods are owned by a ReplicaSet that this Deployment owns.
    Deployment(String),
    /// Its pods are owned by this DaemonSet.
    DaemonSet(String),
}

impl std::str::FromStr for Workload {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('/') {
            Some(("deployment", name)) if !name.is_empty() => Ok(Workload::Deployment(name.into())),
            Some(("daemonset", name)) if !name.is_empty() => Ok(Workload::DaemonSet(name.into())),
            _ => Err(format!("{s:?} is not deployment/NAME or daemonset/NAME")),
        }
    }
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Workload::Deployment(n) => write!(f, "deployment/{n}"),
            Workload::DaemonSet(n) => write!(f, "daemonset/{n}"),
        }
    }
}

/// What the writer reads and where it writes.
#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// The checkpoint directory (persistent, root-only).
    pub dir: PathBuf,
    /// The Deployment's namespace.
    pub namespace: String,
    /// Label selector of the Deployment's pods.
    pub selector: String,
    /// The workload a pod must belong to (through its owner references) to be written.
    pub workload: Workload,
    /// This node's name (pods bound to it).
    pub node: String,
    /// How long a pod must have been Ready without a break.
    pub after: Duration,
    /// Given to the recovery instance's proxy as `--retire-file`.
    pub retire_file: String,
    /// The node's kubeconfig, read again at every attempt: the kubelet rotates the client
    /// certificate it names.
    pub kubeconfig: PathBuf,
    /// What a checkpoint may hold: the rules `recover` applies again at boot.
    pub policy: staticpod::Policy,
}

/// What an attempt came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// This pod is now the checkpoint.
    Written(String),
    /// No pod qualifies yet.
    NoCandidate,
    /// The checkpoint is of this pod already: it is current.
    Current,
    /// The checkpoint is kept as it is (why).
    Kept(&'static str),
    /// The pod that qualifies would be refused at boot, or does not belong to the workload:
    /// not written, the checkpoint kept.
    Refused { pod: String, reason: String },
}

/// Whether a checkpoint of `existing` may be replaced by one of `ours`.
pub fn replaces(existing: Option<&Origin>, ours: &Origin) -> Result<(), &'static str> {
    match existing {
        None => Ok(()),
        Some(e) if e.uid == ours.uid => Err("this pod is already the checkpoint"),
        Some(e) if e.created > ours.created => Err("the checkpoint is of a newer pod"),
        Some(_) => Ok(()),
    }
}

/// Since when `pod` has been Ready, if it is.
pub fn ready_since(pod: &Value) -> Option<SystemTime> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready" && c["status"] == "True")
        .and_then(|c| c["lastTransitionTime"].as_str())
        .and_then(|t| humantime::parse_rfc3339(t).ok())
}

/// The pod to checkpoint among `pods` (a pod list's items) at `now`: not a mirror pod, not
/// being deleted, Ready without a break for `after`; the newest such by `creationTimestamp`.
pub fn choose(pods: &[Value], now: SystemTime, after: Duration) -> Option<&Value> {
    pods.iter()
        .filter(|p| {
            p["metadata"]["annotations"]
                .get("kubernetes.io/config.mirror")
                .is_none()
                && p["metadata"].get("deletionTimestamp").is_none()
                && ready_since(p).is_some_and(|t| now.duration_since(t).is_ok_and(|d| d >= after))
        })
        .max_by(|a, b| {
            let created = |p: &Value| {
                p["metadata"]["creationTimestamp"]
                    .as_str()
                    .map(str::to_owned)
            };
            created(a).cmp(&created(b))
        })
}

/// The controller owner reference of `object` (kind, name, uid), if it has one.
pub fn controller_of(object: &Value) -> Option<(&str, &str, &str)> {
    object["metadata"]["ownerReferences"]
        .as_array()?
        .iter()
        .find(|r| r["controller"] == true)
        .and_then(|r| Some((r["kind"].as_str()?, r["name"].as_str()?, r["uid"].as_str()?)))
}

/// Follows `pod`'s controller owner references up to `workload`, reading each owner from the
/// API and comparing uids: `Ok(Err(why))` when the chain does not lead there.
async fn owned_by(
    api: &ApiClient,
    namespace: &str,
    pod: &Value,
    workload: &Workload,
) -> Result<Result<(), String>, CheckpointError> {
    let get = |path: String| async move {
        match api.get_json(&path).await {
            Ok(v) => Ok(Ok(v)),
            Err(e) if e.status() == Some(StatusCode::NOT_FOUND) => {
                Ok(Err(format!("{path} does not exist")))
            }
            Err(source) => Err(CheckpointError::Api { path, source }),
        }
    };
    let (want_kind, name) = match workload {
        Workload::Deployment(n) => ("ReplicaSet", n),
        Workload::DaemonSet(n) => ("DaemonSet", n),
    };
    let Some((kind, owner, uid)) = controller_of(pod) else {
        return Ok(Err(format!(
            "it has no controller owner reference (not made by {workload})"
        )));
    };
    if kind != want_kind {
        return Ok(Err(format!(
            "its controller is {kind} {owner}, not a {want_kind} of {workload}"
        )));
    }
    let apps = format!("/apis/apps/v1/namespaces/{namespace}");
    let mut path = match workload {
        Workload::Deployment(_) => format!("{apps}/replicasets/{owner}"),
        Workload::DaemonSet(_) => format!("{apps}/daemonsets/{owner}"),
    };
    let (mut owner, mut uid) = (owner.to_owned(), uid.to_owned());
    loop {
        let object = match get(path.clone()).await? {
            Ok(o) => o,
            Err(why) => return Ok(Err(why)),
        };
        if object["metadata"]["uid"].as_str() != Some(uid.as_str()) {
            return Ok(Err(format!(
                "{path} has another uid than the owner reference names ({uid})"
            )));
        }
        if object["kind"] != "ReplicaSet" {
            // The workload itself.
            return Ok(if owner == *name {
                Ok(())
            } else {
                Err(format!("its owner is {owner}, not {workload}"))
            });
        }
        match controller_of(&object) {
            Some(("Deployment", d, u)) if matches!(workload, Workload::Deployment(_)) => {
                if d != name {
                    return Ok(Err(format!(
                        "its ReplicaSet {owner} belongs to deployment/{d}, not {workload}"
                    )));
                }
                path = format!("{apps}/deployments/{d}");
                (owner, uid) = (d.to_owned(), u.to_owned());
            }
            _ => {
                return Ok(Err(format!(
                    "its ReplicaSet {owner} is not controlled by {workload}"
                )))
            }
        }
    }
}

/// One attempt: list the workload's pods on this node, choose, check, compare, write. The
/// node's kubeconfig is read afresh: a rotated client certificate is picked up at once.
pub async fn attempt(config: &WriterConfig, now: SystemTime) -> Result<Outcome, CheckpointError> {
    let api = ApiClient::from_kubeconfig(&config.kubeconfig)?;
    let path = format!(
        "/api/v1/namespaces/{}/pods?labelSelector={}&fieldSelector={}",
        config.namespace,
        encode(&config.selector),
        encode(&format!("spec.nodeName={}", config.node)),
    );
    let list = api
        .get_json(&path)
        .await
        .map_err(|source| CheckpointError::Api {
            path: path.clone(),
            source,
        })?;
    let items = list["items"].as_array().cloned().unwrap_or_default();
    let Some(pod) = choose(&items, now, config.after) else {
        return Ok(Outcome::NoCandidate);
    };
    let ours = Origin::of_pod(pod).map_err(|source| CheckpointError::Unusable {
        pod: "?".into(),
        source,
    })?;
    let file = config.dir.join(FILE);
    let existing = std::fs::read(&file).ok();
    let existing_value = existing
        .as_deref()
        .and_then(|b| serde_json::from_slice::<Value>(b).ok());
    let existing_origin = existing_value
        .as_ref()
        .and_then(|v| Origin::of_checkpoint(v).ok());
    let refused = |reason: String| {
        Ok(Outcome::Refused {
            pod: ours.pod.clone(),
            reason,
        })
    };
    if let Err(why) = replaces(existing_origin.as_ref(), &ours) {
        // Kept: it must still pass the rules of the boot (they may have changed since it was
        // written), or the reboot would find nothing to activate.
        if let Some(Err(e)) = existing_value
            .as_ref()
            .map(|v| staticpod::validate(v, &config.policy))
        {
            return refused(format!(
                "the checkpoint in {} would be refused at boot: {e}",
                config.dir.display()
            ));
        }
        return Ok(if existing_origin.is_some_and(|e| e.uid == ours.uid) {
            Outcome::Current
        } else {
            Outcome::Kept(why)
        });
    }
    if let Err(why) = owned_by(&api, &config.namespace, pod, &config.workload).await? {
        return refused(why);
    }
    let stamp = humantime::format_rfc3339_seconds(now).to_string();
    let checkpoint = match staticpod::from_pod(pod, &config.retire_file, &stamp) {
        Ok(c) => c,
        Err(e) => return refused(e.to_string()),
    };
    // The rules of the activation at boot, now, while there is an API to report to.
    if let Err(e) = staticpod::validate(&checkpoint, &config.policy) {
        return refused(format!("it would be refused at boot: {e}"));
    }
    let mut text = serde_json::to_vec_pretty(&checkpoint).expect("JSON value serializes");
    text.push(b'\n');
    store(&config.dir, existing.as_deref(), &text).map_err(|source| CheckpointError::File {
        path: config.dir.display().to_string(),
        source,
    })?;
    Ok(Outcome::Written(ours.pod))
}

/// When the checkpoint in `dir` was written (its annotation), if there is a readable one.
pub fn written_at(dir: &Path) -> Option<SystemTime> {
    let v: Value = serde_json::from_slice(&std::fs::read(dir.join(FILE)).ok()?).ok()?;
    humantime::parse_rfc3339(v["metadata"]["annotations"][staticpod::AT].as_str()?).ok()
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Writes the checkpoint, the one it replaces kept as [`PREVIOUS`], both durably (the boot
/// reads them); removes temporary files an interrupted write left.
pub fn store(dir: &Path, existing: Option<&[u8]>, text: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".kube-apiserver") && name.ends_with(".tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    if let Some(old) = existing {
        write_durable(&dir.join(PREVIOUS), old, staticpod::MANIFEST_MODE)?;
    }
    write_durable(&dir.join(FILE), text, staticpod::MANIFEST_MODE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;
    use serde_json::json;

    fn origin(uid: &str, created: &str) -> Origin {
        Origin {
            pod: "kube-system/p".into(),
            uid: uid.into(),
            created: created.into(),
        }
    }

    #[test]
    fn an_older_pod_never_replaces_a_newer_checkpoint() {
        let old = origin("a", "2025-01-01T00:00:00Z");
        let new = origin("b", "2025-01-01T00:05:00Z");
        assert_eq!(replaces(None, &old), Ok(()));
        assert_eq!(replaces(Some(&old), &new), Ok(()));
        assert!(replaces(Some(&new), &old).is_err());
        assert!(replaces(Some(&new), &new).is_err());
    }

    fn pod(name: &str, created: &str, ready: Option<&str>) -> Value {
        let conditions = match ready {
            Some(t) => json!([{"type": "Ready", "status": "True", "lastTransitionTime": t}]),
            None => json!([{"type": "Ready", "status": "False", "lastTransitionTime": created}]),
        };
        json!({"metadata": {"name": name, "creationTimestamp": created},
               "status": {"conditions": conditions}})
    }

    #[test]
    fn the_newest_pod_ready_long_enough_is_chosen() {
        let now = humantime::parse_rfc3339("2025-01-01T01:00:00Z").unwrap();
        let after = Duration::from_secs(60);
        let good = pod("good", "2025-01-01T00:00:00Z", Some("2025-01-01T00:01:00Z"));
        // A broken rollout's pod: newer, never ready.
        let broken = pod("broken", "2025-01-01T00:50:00Z", None);
        // A new pod ready for 30 s only.
        let young = pod(
            "young",
            "2025-01-01T00:58:00Z",
            Some("2025-01-01T00:59:30Z"),
        );
        let pods = [good.clone(), broken.clone(), young.clone()];
        assert_eq!(
            choose(&pods, now, after).unwrap()["metadata"]["name"],
            "good"
        );
        // Once it has been ready for the wait, the new one is chosen.
        let later = now + Duration::from_secs(31);
        assert_eq!(
            choose(&pods, later, after).unwrap()["metadata"]["name"],
            "young"
        );
        // Mirror pods (kubeadm's static apiserver, the recovery instance) and pods being
        // deleted are never chosen.
        let mut mirror = pod(
            "mirror",
            "2025-01-01T00:59:00Z",
            Some("2025-01-01T00:00:00Z"),
        );
        mirror["metadata"]["annotations"] = json!({"kubernetes.io/config.mirror": "x"});
        let mut going = pod(
            "going",
            "2025-01-01T00:59:00Z",
            Some("2025-01-01T00:00:00Z"),
        );
        going["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:59:59Z");
        assert_eq!(
            choose(&[good, mirror, going, broken], now, after).unwrap()["metadata"]["name"],
            "good"
        );
        assert!(choose(&[pod("b", "2025-01-01T00:00:00Z", None)], now, after).is_none());
    }

    #[test]
    fn kubeconfig_inline_and_file_material() {
        let dir = std::env::temp_dir().join(format!("kap-kubeconfig-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = rcgen_free_pem();
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let inline = format!(
            "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority-data: {}\n    server: https://192.0.2.10:6443\n  name: c\nusers:\n- name: u\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n",
            b64(&ca.0), b64(&ca.0), b64(&ca.1)
        );
        std::fs::write(dir.join("inline.conf"), inline).unwrap();
        let c = ApiClient::from_kubeconfig(&dir.join("inline.conf")).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("192.0.2.10", 6443));
        std::fs::write(dir.join("ca.crt"), &ca.0).unwrap();
        std::fs::write(dir.join("client.pem"), format!("{}{}", ca.0, ca.1)).unwrap();
        let files = "clusters:\n- cluster:\n    certificate-authority: ca.crt\n    server: \"https://cp.example:7443\"\nusers:\n- user:\n    client-certificate: client.pem\n    client-key: client.pem\n";
        std::fs::write(dir.join("files.conf"), files).unwrap();
        let c = ApiClient::from_kubeconfig(&dir.join("files.conf")).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("cp.example", 7443));
        std::fs::write(dir.join("bad.conf"), "clusters: []\n").unwrap();
        let e = ApiClient::from_kubeconfig(&dir.join("bad.conf")).unwrap_err();
        assert!(e.to_string().contains("no server"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn kubeconfig_current_context_with_a_token_user() {
        let dir = std::env::temp_dir().join(format!("kap-kubeconfig-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = rcgen_free_pem();
        std::fs::write(dir.join("ca.crt"), &cert).unwrap();
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let text = format!(
            "clusters:\n- name: old\n  cluster:\n    server: https://192.0.2.1:6443\n    certificate-authority: missing.crt\n- name: new\n  cluster:\n    server: https://[2001:db8::5]:8443\n    certificate-authority: ca.crt\ncontexts:\n- name: old\n  context: {{cluster: old, user: cert}}\n- name: new\n  context: {{cluster: new, user: token}}\ncurrent-context: new\nusers:\n- name: cert\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n- name: token\n  user:\n    token: abc\n",
            b64(&cert),
            b64(&key)
        );
        std::fs::write(dir.join("k.conf"), &text).unwrap();
        let c = ApiClient::from_kubeconfig(&dir.join("k.conf")).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("2001:db8::5", 8443));
        assert_eq!(c.authority(), "[2001:db8::5]:8443");
        assert_eq!(c.token.as_deref(), Some("abc"));
        // The other context's CA file is missing: it is named when that context is current.
        std::fs::write(
            dir.join("k.conf"),
            text.replace("current-context: new", "current-context: old"),
        )
        .unwrap();
        let e = ApiClient::from_kubeconfig(&dir.join("k.conf"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("k.conf: certificate-authority missing.crt: "),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A self-signed certificate and its key, PEM (a fixed test vector).
    fn rcgen_free_pem() -> (String, String) {
        (TEST_CERT.to_owned(), TEST_KEY.to_owned())
    }

    const TEST_CERT: &str = include_str!("../testdata/cert.pem");
    const TEST_KEY: &str = include_str!("../testdata/key.pem");

    #[test]
    fn selectors_are_encoded() {
        assert_eq!(
            encode("component=kube-apiserver,tier=control-plane"),
            "component%3Dkube-apiserver%2Ctier%3Dcontrol-plane"
        );
    }

    #[test]
    fn store_keeps_the_previous_one_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("kap-store-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(".kube-apiserver.json.1.tmp"), b"stale").unwrap();
        store(&dir, None, b"one").unwrap();
        store(&dir, Some(b"one"), b"two").unwrap();
        assert_eq!(std::fs::read(dir.join(FILE)).unwrap(), b"two");
        assert_eq!(std::fs::read(dir.join(PREVIOUS)).unwrap(), b"one");
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [FILE, PREVIOUS]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
