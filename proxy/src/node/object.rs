//! Kubernetes objects as the node agents read and write them: k8s-openapi's types, built for the
//! newest Kubernetes this binary knows ([`KNOWN`]).
//!
//! A typed object keeps only the fields its type has, so an object read from a newer Kubernetes
//! could lose a field on its way through (a checkpoint written without it, a Deployment rendered
//! without a flag's volume). [`from_value`] refuses such an object instead, naming the first field
//! it would lose: the agents never write back less than they read. An object only looked at (a
//! mirror pod's status, a Lease's holder, a list of pods) is read with [`inspect`]: a newer
//! Kubernetes' fields it does not know are nothing to it, and must not stop the agent.

use std::fmt::Write as _;

use k8s_openapi::Resource;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

pub use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
pub use k8s_openapi::api::coordination::v1::Lease;
pub use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec, Probe, Volume, VolumeMount};
pub use k8s_openapi::api::policy::v1::PodDisruptionBudget;
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The Kubernetes release whose API the types are of.
pub const KNOWN: &str = "v1.37";

/// The kubelet's annotation on a mirror pod: the UID of the static pod it mirrors.
pub const MIRROR_OF: &str = "kubernetes.io/config.mirror";

/// The annotation `key` of an object's metadata.
pub fn annotation<'a>(meta: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    meta.annotations.as_ref()?.get(key).map(String::as_str)
}

/// Why a JSON or YAML document is not the object it should be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ObjectError {
    /// Not of the type's shape (a wrong `kind`, a string where a list belongs, …).
    #[error("not a {kind}: {message}")]
    Shape { kind: &'static str, message: String },
    /// A field the type does not have: reading it would lose it.
    #[error(
        "{kind} has a field this build does not know ({path}; it knows Kubernetes {KNOWN}): \
         it would be lost"
    )]
    Unknown { kind: &'static str, path: String },
}

/// `value` as a `T`, refused when any of its fields (other than a null) would not survive the
/// way back to JSON.
pub fn from_value<T>(value: Value) -> Result<T, ObjectError>
where
    T: Resource + DeserializeOwned + Serialize,
{
    typed(value, T::KIND)
}

/// `value` as a `T` that is only looked at, never written back: fields `T` does not have are
/// left out.
pub fn inspect<T: DeserializeOwned>(value: Value, kind: &'static str) -> Result<T, ObjectError> {
    serde_json::from_value(value).map_err(|e| ObjectError::Shape {
        kind,
        message: e.to_string(),
    })
}

/// [`from_value`] for a part of an object (a container, a pod spec), named `kind` in errors.
pub fn typed<T>(value: Value, kind: &'static str) -> Result<T, ObjectError>
where
    T: DeserializeOwned + Serialize,
{
    let object = T::deserialize(&value).map_err(|e| ObjectError::Shape {
        kind,
        message: e.to_string(),
    })?;
    let back = to_value(&object);
    if let Some(path) = lost(&value, &back, &mut String::new()) {
        return Err(ObjectError::Unknown { kind, path });
    }
    Ok(object)
}

/// An object as JSON (its `apiVersion` and `kind` included for a top-level object).
pub fn to_value<T: Serialize>(object: &T) -> Value {
    serde_json::to_value(object).expect("a Kubernetes object serializes")
}

/// The API path of the collection of `K` in `namespace` (`/api/v1/namespaces/ns/pods`,
/// `/apis/apps/v1/namespaces/ns/deployments`).
pub fn collection<K: Resource>(namespace: &str) -> String {
    let mut path = if K::GROUP.is_empty() {
        format!("/api/{}", K::VERSION)
    } else {
        format!("/apis/{}/{}", K::GROUP, K::VERSION)
    };
    let _ = write!(path, "/namespaces/{namespace}/{}", K::URL_PATH_SEGMENT);
    path
}

/// The API path of the `K` named `name` in `namespace`.
pub fn path<K: Resource>(namespace: &str, name: &str) -> String {
    format!("{}/{name}", collection::<K>(namespace))
}

/// The first path (`spec.containers[1].stdin`) that has a value other than null in `read` and
/// none in `back`.
fn lost(read: &Value, back: &Value, at: &mut String) -> Option<String> {
    match (read, back) {
        (Value::Object(r), Value::Object(b)) => {
            for (key, value) in r {
                if value.is_null() {
                    continue;
                }
                let len = at.len();
                if !at.is_empty() {
                    at.push('.');
                }
                at.push_str(key);
                let found = match b.get(key) {
                    None | Some(Value::Null) => Some(at.clone()),
                    Some(b) => lost(value, b, at),
                };
                if found.is_some() {
                    return found;
                }
                at.truncate(len);
            }
            None
        }
        (Value::Array(r), Value::Array(b)) => {
            for (i, value) in r.iter().enumerate() {
                let len = at.len();
                let _ = write!(at, "[{i}]");
                let found = match b.get(i) {
                    None => Some(at.clone()),
                    Some(b) => lost(value, b, at),
                };
                if found.is_some() {
                    return found;
                }
                at.truncate(len);
            }
            None
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "kube-apiserver", "namespace": "kube-system",
                         "creationTimestamp": null, "labels": {"tier": "control-plane"}},
            "spec": {"containers": [{"name": "kube-apiserver", "image": "k:1",
                                     "resources": {"requests": {"cpu": "250m"}},
                                     "livenessProbe": {"httpGet": {"path": "/livez", "port": 6443,
                                                                   "scheme": "HTTPS"}}}],
                     "hostNetwork": true, "volumes": []},
            "status": {}
        })
    }

    #[test]
    fn a_pod_survives_the_way_back_but_its_nulls() {
        let p: Pod = from_value(pod()).unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("kube-apiserver"));
        let mut expect = pod();
        expect["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("creationTimestamp");
        assert_eq!(to_value(&p), expect);
    }

    #[test]
    fn a_field_this_build_does_not_know_is_refused_with_its_path() {
        let mut v = pod();
        v["spec"]["containers"][0]["livenessProbe"]["httpGet"]["future"] = json!(1);
        let e = from_value::<Pod>(v).unwrap_err();
        assert_eq!(
            e,
            ObjectError::Unknown {
                kind: "Pod",
                path: "spec.containers[0].livenessProbe.httpGet.future".into()
            }
        );
        assert!(e.to_string().contains("Kubernetes v1.37"), "{e}");
        let mut v = pod();
        v["apiVersion"] = json!("v2");
        assert!(matches!(
            from_value::<Pod>(v),
            Err(ObjectError::Shape { kind: "Pod", .. })
        ));
        let c = typed::<Container>(json!({"name": "c", "nope": {}}), "container").unwrap_err();
        assert!(c.to_string().contains("(nope;"), "{c}");
    }

    #[test]
    fn render_help_names_the_kubernetes_the_types_are_of() {
        assert!(
            crate::cli::RENDER_AFTER_HELP.contains(&format!("Kubernetes {KNOWN} ")),
            "{}",
            crate::cli::RENDER_AFTER_HELP
        );
    }

    #[test]
    fn api_paths() {
        assert_eq!(
            path::<Pod>("kube-system", "p"),
            "/api/v1/namespaces/kube-system/pods/p"
        );
        assert_eq!(
            collection::<Deployment>("ns"),
            "/apis/apps/v1/namespaces/ns/deployments"
        );
        assert_eq!(
            path::<Lease>("kube-system", "kube-scheduler"),
            "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kube-scheduler"
        );
    }
}
