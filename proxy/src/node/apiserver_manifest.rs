//! kubeadm's static apiserver manifest, parsed ([`StaticPod`]): what `render` and `kubeadm-sync`
//! derive the Deployment from, and what `recover` compares a checkpoint's version with.

use std::path::Path;

use serde_json::Value;

use crate::node::manifest::sha256_hex;
use crate::node::object::{self, Container, Pod, Volume};

/// Why kubeadm's manifest cannot be read: the message names the field or the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidManifest(pub String);

/// The apiserver container's name in kubeadm's pod and in the Deployment.
pub const CONTAINER: &str = "kube-apiserver";

/// kubeadm's static apiserver pod, parsed.
#[derive(Debug, Clone)]
pub struct StaticPod {
    /// The pod as read.
    pub pod: Pod,
    /// SHA-256 of the file's bytes, hex.
    pub digest: String,
}

impl StaticPod {
    /// From the manifest's text. A field the Pod type does not have is refused, named by its
    /// path: the Deployment would go without it.
    pub fn parse(text: &str) -> Result<Self, InvalidManifest> {
        let docs = crate::base::yaml::parse_documents(text)
            .map_err(|e| InvalidManifest(format!("not YAML: {e}")))?;
        let [doc] = <[Value; 1]>::try_from(docs)
            .map_err(|d| InvalidManifest(format!("{} documents, one Pod expected", d.len())))?;
        let kind = kind_of(&doc);
        if kind != "Pod" {
            return Err(InvalidManifest(format!("kind {kind}, a Pod expected")));
        }
        let pod = StaticPod {
            pod: object::from_value(doc).map_err(|e| InvalidManifest(e.to_string()))?,
            digest: sha256_hex(text.as_bytes()),
        };
        pod.container()?;
        Ok(pod)
    }

    /// The apiserver container: the one named `kube-apiserver`, else the only one.
    pub fn container(&self) -> Result<&Container, InvalidManifest> {
        let containers = match &self.pod.spec {
            Some(spec) if !spec.containers.is_empty() => &spec.containers,
            _ => return Err(InvalidManifest("no spec.containers".into())),
        };
        let found = containers
            .iter()
            .find(|c| c.name == CONTAINER)
            .or(match containers.as_slice() {
                [only] => Some(only),
                _ => None,
            })
            .ok_or_else(|| InvalidManifest(format!("no container named {CONTAINER}")))?;
        if found.image.is_none() {
            return Err(InvalidManifest(
                "the apiserver container has no image".into(),
            ));
        }
        Ok(found)
    }

    /// The pod's volumes.
    pub fn volumes(&self) -> &[Volume] {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_deref())
            .unwrap_or_default()
    }

    /// The binary (`command[0]`) and the flags (the rest of `command`, then `args`).
    pub fn command(&self) -> Result<(String, Vec<Flag>), InvalidManifest> {
        let c = self.container()?;
        let mut words = c.command.clone().unwrap_or_default();
        words.extend(c.args.iter().flatten().cloned());
        if words.is_empty() {
            return Err(InvalidManifest(
                "the apiserver container has no command".into(),
            ));
        }
        let binary = words.remove(0);
        let flags = words
            .into_iter()
            .map(|w| Flag::parse(&w))
            .collect::<Result<_, _>>()?;
        Ok((binary, flags))
    }

    /// The value of the last `--name` flag.
    pub fn flag(&self, name: &str) -> Option<String> {
        let (_, flags) = self.command().ok()?;
        flags
            .into_iter()
            .rev()
            .find(|f| f.name == name)
            .and_then(|f| f.value)
    }

    /// The image it runs.
    pub fn image(&self) -> String {
        self.container()
            .ok()
            .and_then(|c| c.image.clone())
            .unwrap_or_default()
    }

    /// kubeadm's secure port (6443 when unset).
    pub fn secure_port(&self) -> Result<u16, InvalidManifest> {
        match self.flag("secure-port") {
            None => Ok(6443),
            Some(p) => p
                .parse()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| InvalidManifest(format!("--secure-port={p} is not a port"))),
        }
    }

    /// Paths under `/etc/kubernetes/` that the flags name and that exist as regular files:
    /// what the apiserver reads from kubeadm's directory at start (certificates, keys, the
    /// audit policy, the encryption configuration). Only that directory: the node agent sees
    /// the node's `/etc/kubernetes` and nothing else of it. Not the files these name in turn
    /// (an admission plugin's configuration, a webhook's kubeconfig): a change to one of those
    /// alone rolls nothing (docs/runbooks/upgrade-kubernetes.md).
    pub fn files(&self) -> Vec<String> {
        let Ok((_, flags)) = self.command() else {
            return Vec::new();
        };
        let mut files: Vec<String> = flags
            .into_iter()
            .filter_map(|f| f.value)
            .filter(|v| v.starts_with("/etc/kubernetes/") && Path::new(v).is_file())
            .collect();
        files.sort();
        files.dedup();
        files
    }
}

/// A YAML document's `kind`, as JSON (`"Pod"`, or `null` when it has none): which type to read
/// it as.
pub fn kind_of(doc: &Value) -> Value {
    doc.get("kind").cloned().unwrap_or(Value::Null)
}

/// One `--name[=value]` word of a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag {
    pub name: String,
    pub value: Option<String>,
}

impl Flag {
    pub fn parse(word: &str) -> Result<Self, InvalidManifest> {
        let rest = word.strip_prefix("--").ok_or_else(|| {
            InvalidManifest(format!(
                "argument {word:?} is not a --flag (kubeadm writes every flag as --name=value)"
            ))
        })?;
        Ok(match rest.split_once('=') {
            Some((n, v)) => Flag {
                name: n.to_owned(),
                value: Some(v.to_owned()),
            },
            None => Flag {
                name: rest.to_owned(),
                value: None,
            },
        })
    }

    pub fn word(&self) -> String {
        match &self.value {
            Some(v) => format!("--{}={v}", self.name),
            None => format!("--{}", self.name),
        }
    }
}

/// `(major, minor, patch, pre-release)` of an image's `vX.Y.Z[-pre]` tag.
pub fn image_version(image: &str) -> Option<(u64, u64, u64, Option<String>)> {
    let name = image.split('@').next()?;
    let (_, tag) = name.rsplit_once(':').filter(|(n, _)| !n.ends_with('/'))?;
    if tag.contains('/') {
        return None;
    }
    let tag = tag.strip_prefix('v').unwrap_or(tag);
    let (core, pre) = match tag.split_once(['-', '+']) {
        Some((c, p)) => (c, Some(p.to_owned())),
        None => (tag, None),
    };
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    let v = (parts.next()??, parts.next()??, parts.next()??, pre);
    parts.next().is_none().then_some(v)
}
