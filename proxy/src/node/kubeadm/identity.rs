//! `kube-apiserver-proxy kubeadm-sync --write-kubeconfig`: the `kubeadm-sync` agent's own
//! identity, with only what it calls, instead of kubeadm's `admin.conf`.
//!
//! Run once by the operator at the migration (and again before the token expires), with
//! administrator credentials (`--admin-kubeconfig`, kubeadm's `admin.conf`), it:
//!
//! 1. creates or updates the ServiceAccount `kube-system/kube-apiserver-proxy-kubeadm-sync`;
//! 2. creates or updates the RBAC of exactly what the agent calls ([`rules`]): the apiserver
//!    Deployment (get, update: the surge rollouts and rollbacks), the pods of `kube-system`
//!    (get: the mirror pods whose UIDs the copies keep, the stand-in's, etcd's canary's),
//!    etcd's mirror pod on this node (update: its image and config hash after etcd's restart in
//!    place), the controllers' leader leases as their manifests name them (get, update: the
//!    release of a stopped controller's lease), and the control-plane nodes (list: the
//!    single-controller check);
//! 3. requests a token for that ServiceAccount (TokenRequest, `--token-lifetime`, a year by
//!    default), not bound to any object;
//! 4. writes a kubeconfig with that token, the administrator kubeconfig's server and CA, to
//!    `--kubeconfig` (0600, fsynced: the agent's static pod reads it after a reboot), in a
//!    directory of its own (0700).
//!
//! The agent reads its kubeconfig on every pass: writing it again renews the token without a
//! restart. It logs a warning each hour from [`EXPIRY_WARNING`] before the token expires.
//! Deleting the ServiceAccount revokes every token issued for it.

use std::path::Path;
use std::time::{Duration, SystemTime};

use base64::Engine;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use serde_json::{json, Value};

use crate::base::fsutil::write_durable;
use crate::node::api::ApiClient;
use crate::node::kubeadm::leader_handover::{lease_of, LEADERS};
use crate::node::kubeconfig;
use crate::node::object::{self, ObjectMeta, Pod};

/// The agent's ServiceAccount, in `kube-system`.
pub const SERVICE_ACCOUNT: &str = "kube-apiserver-proxy-kubeadm-sync";
/// Where the ServiceAccount, its Roles and the controllers' leases live.
pub const NAMESPACE: &str = "kube-system";
/// The name of the agent's Roles, RoleBindings, ClusterRole and ClusterRoleBinding.
pub const RBAC_NAME: &str = "kube-apiserver-proxy:kubeadm-sync";
/// The agent's user name, as the apiserver authenticates its token (admission policies name it).
pub const USER: &str = "system:serviceaccount:kube-system:kube-apiserver-proxy-kubeadm-sync";
/// How long before the token expires the agent starts warning.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(30 * 24 * 3600);

/// Why the identity could not be written.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("--admin-kubeconfig: {0}")]
    AdminKubeconfig(String),
    #[error("{0}")]
    Api(String),
    #[error("write {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl crate::base::exit::CommandError for IdentityError {
    /// Bad input (exit 2) rather than a runtime failure.
    fn is_bad_input(&self) -> bool {
        matches!(self, IdentityError::AdminKubeconfig(_))
    }
}

/// What the agent's identity needs to know of the node.
pub struct Identity<'a> {
    /// This node's name: etcd's mirror pod is `etcd-<node>`.
    pub node: &'a str,
    /// The apiserver Deployment.
    pub deployment: (&'a str, &'a str),
    /// kubeadm's manifest directory: the controllers' leases are read from their flags.
    pub kubeadm_dir: &'a Path,
}

/// The controllers' leader leases, as their manifests in `kubeadm_dir` name them
/// (`kube-system/<component>` by default); a manifest that cannot be read counts as the default.
pub fn leases(kubeadm_dir: &Path) -> Vec<(String, String)> {
    let mut leases: Vec<(String, String)> = LEADERS
        .iter()
        .filter_map(|file| {
            let default = (
                NAMESPACE.to_owned(),
                file.trim_end_matches(".yaml").to_owned(),
            );
            // Read for its flags only: as far as this build knows pods.
            match std::fs::read_to_string(kubeadm_dir.join(file))
                .ok()
                .and_then(|t| crate::base::yaml::parse_documents(&t).ok())
                .and_then(|docs| docs.into_iter().next())
                .and_then(|doc| serde_json::from_value::<Pod>(doc).ok())
            {
                Some(pod) => lease_of(&pod),
                None => Some(default),
            }
        })
        .collect();
    leases.sort();
    leases.dedup();
    leases
}

/// A rule allowing `verbs` on `resources` of the API group `group`, on the objects named
/// `names` only when there are any.
fn rule(group: &str, resources: &str, names: &[&str], verbs: &[&str]) -> PolicyRule {
    let strings = |l: &[&str]| l.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(vec![group.to_owned()]),
        resources: Some(vec![resources.to_owned()]),
        resource_names: (!names.is_empty()).then(|| strings(names)),
        verbs: strings(verbs),
        ..Default::default()
    }
}

/// The RBAC rules of the agent, by namespace (`""`: the ClusterRole's).
pub fn rules(id: &Identity<'_>, leases: &[(String, String)]) -> Vec<(String, Vec<PolicyRule>)> {
    let mut by_ns: std::collections::BTreeMap<String, Vec<PolicyRule>> = Default::default();
    let (dns, dname) = id.deployment;
    by_ns.entry(dns.to_owned()).or_default().push(rule(
        "apps",
        "deployments",
        &[dname],
        &["get", "update"],
    ));
    let pods = by_ns.entry(NAMESPACE.to_owned()).or_default();
    pods.push(rule("", "pods", &[], &["get"]));
    pods.push(rule(
        "",
        "pods",
        &[&format!("etcd-{}", id.node)],
        &["update"],
    ));
    for (ns, name) in leases {
        by_ns.entry(ns.clone()).or_default().push(rule(
            "coordination.k8s.io",
            "leases",
            &[name],
            &["get", "update"],
        ));
    }
    let mut out: Vec<(String, Vec<PolicyRule>)> = by_ns.into_iter().collect();
    out.push((String::new(), vec![rule("", "nodes", &[], &["list"])]));
    out
}

/// One of the objects of the agent's identity.
#[derive(Debug, Clone, PartialEq)]
pub enum Object {
    ServiceAccount(ServiceAccount),
    Role(Role),
    RoleBinding(RoleBinding),
    ClusterRole(ClusterRole),
    ClusterRoleBinding(ClusterRoleBinding),
}

impl Object {
    /// The object as JSON (its `apiVersion` and `kind` included).
    pub fn to_value(&self) -> Value {
        match self {
            Object::ServiceAccount(o) => object::to_value(o),
            Object::Role(o) => object::to_value(o),
            Object::RoleBinding(o) => object::to_value(o),
            Object::ClusterRole(o) => object::to_value(o),
            Object::ClusterRoleBinding(o) => object::to_value(o),
        }
    }
}

/// The objects to create or update, each with its path (the collection's is its parent).
pub fn objects(id: &Identity<'_>, leases: &[(String, String)]) -> Vec<(String, Object)> {
    let meta = |namespace: Option<&str>, name: &str| ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        labels: Some(
            [(
                "app.kubernetes.io/part-of".to_owned(),
                "kube-apiserver-proxy".to_owned(),
            )]
            .into(),
        ),
        ..Default::default()
    };
    let subjects = Some(vec![Subject {
        kind: "ServiceAccount".to_owned(),
        name: SERVICE_ACCOUNT.to_owned(),
        namespace: Some(NAMESPACE.to_owned()),
        ..Default::default()
    }]);
    let mut out = vec![(
        object::path::<ServiceAccount>(NAMESPACE, SERVICE_ACCOUNT),
        Object::ServiceAccount(ServiceAccount {
            metadata: meta(Some(NAMESPACE), SERVICE_ACCOUNT),
            ..Default::default()
        }),
    )];
    const RBAC: &str = "/apis/rbac.authorization.k8s.io/v1";
    let escaped = RBAC_NAME.replace(':', "%3A");
    for (ns, rules) in rules(id, leases) {
        let role_ref = |kind: &str| RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_owned()),
            kind: kind.to_owned(),
            name: RBAC_NAME.to_owned(),
        };
        if ns.is_empty() {
            out.push((
                format!("{RBAC}/clusterroles/{escaped}"),
                Object::ClusterRole(ClusterRole {
                    metadata: meta(None, RBAC_NAME),
                    rules: Some(rules),
                    ..Default::default()
                }),
            ));
            out.push((
                format!("{RBAC}/clusterrolebindings/{escaped}"),
                Object::ClusterRoleBinding(ClusterRoleBinding {
                    metadata: meta(None, RBAC_NAME),
                    role_ref: role_ref("ClusterRole"),
                    subjects: subjects.clone(),
                }),
            ));
        } else {
            out.push((
                format!("{RBAC}/namespaces/{ns}/roles/{escaped}"),
                Object::Role(Role {
                    metadata: meta(Some(&ns), RBAC_NAME),
                    rules: Some(rules),
                }),
            ));
            out.push((
                format!("{RBAC}/namespaces/{ns}/rolebindings/{escaped}"),
                Object::RoleBinding(RoleBinding {
                    metadata: meta(Some(&ns), RBAC_NAME),
                    role_ref: role_ref("Role"),
                    subjects: subjects.clone(),
                }),
            ));
        }
    }
    out
}

/// A kubeconfig for `server`, verified with the PEM bundle `ca`, as the bearer of `token`.
pub fn kubeconfig_text(server: &str, ca: &[u8], token: &str) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(ca);
    crate::base::yaml::to_yaml(&json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubernetes",
            "cluster": {"server": server, "certificate-authority-data": b64}}],
        "users": [{"name": SERVICE_ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": SERVICE_ACCOUNT,
            "context": {"cluster": "kubernetes", "user": SERVICE_ACCOUNT}}],
        "current-context": SERVICE_ACCOUNT,
    }))
}

/// `PUT` `object` at `path`, or `POST` it to the collection when it does not exist yet. (The
/// answer is not read: a field of a newer Kubernetes in it is no failure.)
async fn apply(api: &ApiClient, path: &str, object: &Object) -> Result<(), IdentityError> {
    let object = &object.to_value();
    match api.send_json("PUT", path, object).await {
        Ok(_) => Ok(()),
        Err(e) if e.status() == Some(hyper::StatusCode::NOT_FOUND) => {
            let collection = &path[..path.rfind('/').expect("a path")];
            api.send_json("POST", collection, object)
                .await
                .map(|_| ())
                .map_err(|e| IdentityError::Api(format!("POST {collection}: {e}")))
        }
        Err(e) => Err(IdentityError::Api(format!("PUT {path}: {e}"))),
    }
}

/// The whole of `--write-kubeconfig` (module documentation); returns the token's expiry.
pub fn write(
    admin: &Path,
    out: &Path,
    id: &Identity<'_>,
    lifetime: Duration,
) -> Result<SystemTime, IdentityError> {
    let bad = |e: &dyn std::fmt::Display| IdentityError::AdminKubeconfig(e.to_string());
    let admin_config = kubeconfig::read(admin).map_err(|e| bad(&e))?;
    let api = ApiClient::from_config(admin_config.clone(), admin).map_err(|e| bad(&e))?;
    let leases = leases(id.kubeadm_dir);
    let token = crate::base::runtime::block_on(async {
        for (path, object) in objects(id, &leases) {
            apply(&api, &path, &object).await?;
            tracing::info!(%path, "kubeadm-sync: applied");
        }
        let path =
            format!("/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{SERVICE_ACCOUNT}/token");
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(i64::try_from(lifetime.as_secs()).unwrap_or(i64::MAX)),
                ..Default::default()
            }),
            ..Default::default()
        };
        let failed = |e: &dyn std::fmt::Display| IdentityError::Api(format!("POST {path}: {e}"));
        let answer = api
            .send_json("POST", &path, &object::to_value(&request))
            .await
            .map_err(|e| failed(&e))?;
        // Only its token is read: as far as this build knows the object.
        let answer: TokenRequest = serde_json::from_value(answer).map_err(|e| failed(&e))?;
        answer
            .status
            .and_then(|s| s.token)
            .ok_or_else(|| failed(&"no status.token in the answer"))
    })?;
    let expiry = kubeconfig::token_expiry(&token)
        .ok_or_else(|| IdentityError::Api("the token carries no expiry (exp)".to_owned()))?;
    // Missing directories made 0700; one that exists (say /etc/kubernetes itself) left as it is.
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| IdentityError::Write {
                path: dir.display().to_string(),
                source,
            })?;
    }
    let text = kubeconfig_text(&admin_config.server, &admin_config.ca, &token);
    write_durable(out, text.as_bytes(), 0o600).map_err(|source| IdentityError::Write {
        path: out.display().to_string(),
        source,
    })?;
    Ok(expiry)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(dir: &Path) -> Identity<'_> {
        Identity {
            node: "cp-1",
            deployment: ("kube-system", "kube-apiserver"),
            kubeadm_dir: dir,
        }
    }

    #[test]
    fn the_rules_name_what_the_agent_calls_and_no_more() {
        let dir = std::env::temp_dir().join(format!("kap-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("kube-scheduler.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: kube-scheduler, namespace: kube-system}\nspec:\n  containers:\n  - name: kube-scheduler\n    image: x\n    command: [kube-scheduler, --leader-elect-resource-name=sched]\n",
        )
        .unwrap();
        let leases = leases(&dir);
        assert_eq!(
            leases,
            vec![
                (
                    "kube-system".to_owned(),
                    "kube-controller-manager".to_owned()
                ),
                ("kube-system".to_owned(), "sched".to_owned()),
            ]
        );
        let rules = rules(&id(&dir), &leases);
        let ns = &rules[0];
        assert_eq!(ns.0, "kube-system");
        let text = serde_json::to_string(&ns.1).unwrap();
        // Updates only on named objects: the Deployment, etcd's mirror pod, the two leases.
        for r in &ns.1 {
            if r.verbs.iter().any(|v| v == "update") {
                assert!(r.resource_names.is_some(), "{r:?}");
            }
            assert!(!r.verbs.iter().any(|v| v == "*"), "{r:?}");
        }
        assert!(text.contains("\"etcd-cp-1\""), "{text}");
        assert!(text.contains("\"sched\""), "{text}");
        assert!(
            !text.contains("create") && !text.contains("delete"),
            "{text}"
        );
        assert_eq!(rules[1].0, "");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_objects_bind_the_service_account_to_its_roles() {
        let dir = Path::new("/nonexistent");
        let objects = objects(&id(dir), &leases(dir));
        let paths: Vec<&str> = objects.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/api/v1/namespaces/kube-system/serviceaccounts/kube-apiserver-proxy-kubeadm-sync",
                "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/roles/kube-apiserver-proxy%3Akubeadm-sync",
                "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/rolebindings/kube-apiserver-proxy%3Akubeadm-sync",
                "/apis/rbac.authorization.k8s.io/v1/clusterroles/kube-apiserver-proxy%3Akubeadm-sync",
                "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/kube-apiserver-proxy%3Akubeadm-sync",
            ]
        );
        let Object::RoleBinding(binding) = &objects[2].1 else {
            panic!("a RoleBinding: {:?}", objects[2].1);
        };
        assert_eq!(binding.subjects.as_ref().unwrap()[0].name, SERVICE_ACCOUNT);
        let Object::ClusterRoleBinding(binding) = &objects[4].1 else {
            panic!("a ClusterRoleBinding: {:?}", objects[4].1);
        };
        assert_eq!(binding.role_ref.kind, "ClusterRole");
        assert_eq!(
            USER,
            format!("system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}")
        );
    }

    #[test]
    fn the_kubeconfig_reads_back_as_the_token_holder() {
        let text = kubeconfig_text("https://192.0.2.10:6443", b"PEM", "t0k3n");
        let k = kubeconfig::parse(&text, Path::new("/")).unwrap();
        assert_eq!(k.server, "https://192.0.2.10:6443");
        assert_eq!(k.ca, b"PEM");
        assert_eq!((k.client, k.token.as_deref()), (None, Some("t0k3n")));
    }
}
