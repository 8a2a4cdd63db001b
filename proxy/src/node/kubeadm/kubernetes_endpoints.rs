//! `kube-apiserver-proxy kubernetes-endpoints --address NODE_IP`: the `default/kubernetes`
//! endpoints of a single controller, printed as YAML for `kubectl apply -f -`.
//!
//! On one controller every kube-apiserver advertises the same node address. With the default
//! `lease` endpoint reconciler the old apiserver's graceful shutdown removes that address
//! (Kubernetes ≥ 1.28 removes even the last one), and so does a starting apiserver until it is
//! ready: each rollout leaves `default/kubernetes` empty for seconds and in-cluster clients are
//! refused. The single-controller overlay therefore runs kube-apiserver with
//! `--endpoint-reconciler-type=none`, which never writes the endpoints, and the operator applies
//! these objects once (docs/operations.md, "The kubernetes Service endpoints"):
//!
//! - `Endpoints default/kubernetes`, marked `endpointslice.kubernetes.io/skip-mirror` as the
//!   apiserver marks it, for the clients that still read the v1 API;
//! - `EndpointSlice default/kubernetes`, the slice the apiserver itself would write;
//! - `EndpointSlice default/kubernetes-kube-apiserver-proxy`, a second slice of the same Service
//!   that no apiserver ever touches (kube-proxy and CoreDNS merge every slice labelled
//!   `kubernetes.io/service-name: kubernetes`): while a `lease` apiserver still runs (kubeadm's
//!   static pod during the migration, or the pod of an older install), its shutdown empties the
//!   first two objects' kube-proxy view, and this one keeps the Service's address in place;
//! - a `ValidatingAdmissionPolicy` and its binding that deny any kube-apiserver
//!   (`system:apiserver`, the loopback client its reconciler writes with) an update leaving the
//!   `default/kubernetes` Endpoints without an address. That is the one write a stopping
//!   `lease` apiserver makes when it is the last: with the policy, its removal fails (it logs
//!   `Unable to remove endpoints from kubernetes service`, and its shutdown goes on), and the v1
//!   Endpoints and the `kubernetes` slice keep the node address, which the next proxy serves.
//!   Updates that leave an address (a controller of several leaving) and every other client's
//!   writes are not affected.
//!
//! No API client: the binary only prints; applying is `kubectl`'s job.

use std::fmt::Write as _;
use std::net::IpAddr;

/// Name of the slice no apiserver writes.
pub const OWN_SLICE: &str = "kubernetes-kube-apiserver-proxy";

/// Name of the admission policy (and its binding) that keeps an apiserver from emptying the
/// Endpoints.
pub const GUARD: &str = "kube-apiserver-proxy-kubernetes-endpoints";

/// Rejects what the API would reject as an endpoint address (or what no client could use).
pub fn check_address(address: IpAddr) -> Result<(), AddressError> {
    let why = if address.is_unspecified() {
        "is unspecified"
    } else if address.is_loopback() {
        "is a loopback address (pods cannot reach it)"
    } else if address.is_multicast() {
        "is a multicast address"
    } else if matches!(address, IpAddr::V4(a) if a.is_link_local())
        || matches!(address, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80)
    {
        "is link-local"
    } else {
        return Ok(());
    };
    Err(AddressError { address, why })
}

/// An `--address` no endpoint can carry, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--address {address} {why}: give the node address the proxy serves on")]
pub struct AddressError {
    pub address: IpAddr,
    pub why: &'static str,
}

impl crate::base::exit::CommandError for AddressError {
    /// An address no endpoint can carry: bad input.
    fn is_bad_input(&self) -> bool {
        true
    }
}

/// The objects, as one multi-document YAML stream.
pub fn render(address: IpAddr, port: u16) -> String {
    let mut out = String::new();
    write_endpoints(&mut out, address, port);
    for (name, managed_by) in [
        ("kubernetes", None),
        (OWN_SLICE, Some("kube-apiserver-proxy")),
    ] {
        write_slice(&mut out, name, managed_by, address, port);
    }
    write_guard(&mut out);
    out
}

/// `Endpoints default/kubernetes` (with the header comment of the stream).
fn write_endpoints(out: &mut String, address: IpAddr, port: u16) {
    let _ = write!(
        out,
        "\
# default/kubernetes for kube-apiserver --endpoint-reconciler-type=none on one controller:
# `kube-apiserver-proxy kubernetes-endpoints --address {address} --port {port} | kubectl apply -f -`
# (docs/operations.md, \"The kubernetes Service endpoints\").
apiVersion: v1
kind: Endpoints
metadata:
  name: kubernetes
  namespace: default
  labels:
    endpointslice.kubernetes.io/skip-mirror: \"true\"
subsets:
  - addresses:
      - ip: \"{address}\"
    ports:
      - name: https
        port: {port}
        protocol: TCP
"
    );
}

/// One `EndpointSlice` of the `kubernetes` Service, named `name`, labelled as managed by
/// `managed_by` if given.
fn write_slice(out: &mut String, name: &str, managed_by: Option<&str>, address: IpAddr, port: u16) {
    let family = match address {
        IpAddr::V4(_) => "IPv4",
        IpAddr::V6(_) => "IPv6",
    };
    let _ = write!(
        out,
        "\
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: default
  labels:
    kubernetes.io/service-name: kubernetes
"
    );
    if let Some(m) = managed_by {
        let _ = writeln!(out, "    endpointslice.kubernetes.io/managed-by: {m}");
    }
    let _ = write!(
        out,
        "\
addressType: {family}
endpoints:
  - addresses:
      - \"{address}\"
    conditions:
      ready: true
ports:
  - name: https
    port: {port}
    protocol: TCP
"
    );
}

/// The `ValidatingAdmissionPolicy` (and its binding) that keeps an apiserver from emptying the
/// Endpoints.
fn write_guard(out: &mut String) {
    let _ = write!(
        out,
        "\
---
# A kube-apiserver may not leave default/kubernetes without an address: the last `lease`
# apiserver to stop (kubeadm's, at the migration) would otherwise empty it.
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata:
  name: {GUARD}
  labels:
    app.kubernetes.io/part-of: kube-apiserver-proxy
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
      - apiGroups: [\"\"]
        apiVersions: [\"v1\"]
        operations: [\"UPDATE\"]
        resources: [\"endpoints\"]
        resourceNames: [\"kubernetes\"]
  matchConditions:
    - name: default-namespace
      expression: request.namespace == \"default\"
    - name: written-by-an-apiserver
      expression: request.userInfo.username == \"system:apiserver\"
  validations:
    - expression: >-
        has(object.subsets) &&
        object.subsets.exists(s, has(s.addresses) && s.addresses.size() > 0)
      message: >-
        kube-apiserver-proxy: an apiserver may not leave default/kubernetes without an
        address (docs/operations.md, \"The kubernetes Service endpoints\")
      reason: Forbidden
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata:
  name: {GUARD}
  labels:
    app.kubernetes.io/part-of: kube-apiserver-proxy
spec:
  policyName: {GUARD}
  validationActions: [Deny]
"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn five_documents_one_address_family() {
        let v4 = render("192.0.2.10".parse().unwrap(), 6443);
        assert_eq!(v4.matches("\n---\n").count(), 4);
        assert_eq!(v4.matches(&format!("name: {GUARD}")).count(), 2);
        assert_eq!(v4.matches("\"192.0.2.10\"").count(), 3);
        assert!(v4.contains("addressType: IPv4"));
        assert!(v4.contains(&format!("name: {OWN_SLICE}")));
        for bad in [
            "0.0.0.0",
            "127.0.0.1",
            "169.254.1.1",
            "fe80::1",
            "::1",
            "224.0.0.1",
        ] {
            assert!(check_address(bad.parse().unwrap()).is_err(), "{bad}");
        }
        assert!(check_address("2001:db8::10".parse().unwrap()).is_ok());
        let v6 = render("2001:db8::10".parse().unwrap(), 443);
        assert_eq!(v6.matches("addressType: IPv6").count(), 2);
        assert_eq!(v6.matches("port: 443").count(), 3);
    }

    /// Every document is the Kubernetes object it says it is, with no field its type lacks
    /// (a misspelt one would be ignored by `kubectl apply`).
    #[test]
    fn the_documents_are_the_objects_kubernetes_knows() {
        use crate::node::object::from_value;
        use k8s_openapi::api::admissionregistration::v1::{
            ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
        };
        use k8s_openapi::api::core::v1::Endpoints;
        use k8s_openapi::api::discovery::v1::EndpointSlice;

        let docs =
            crate::base::yaml::parse_documents(&render("2001:db8::10".parse().unwrap(), 443))
                .unwrap();
        assert_eq!(docs.len(), 5);
        let endpoints: Endpoints = from_value(docs[0].clone()).unwrap();
        let subset = &endpoints.subsets.as_ref().unwrap()[0];
        assert_eq!(subset.addresses.as_ref().unwrap()[0].ip, "2001:db8::10");
        assert_eq!(subset.ports.as_ref().unwrap()[0].port, 443);
        for (doc, name) in [(&docs[1], "kubernetes"), (&docs[2], OWN_SLICE)] {
            let slice: EndpointSlice = from_value(doc.clone()).unwrap();
            assert_eq!(slice.metadata.name.as_deref(), Some(name));
            assert_eq!(slice.address_type, "IPv6");
            assert_eq!(slice.endpoints.unwrap()[0].addresses, ["2001:db8::10"]);
            assert_eq!(
                slice.metadata.labels.unwrap()["kubernetes.io/service-name"],
                "kubernetes"
            );
        }
        let policy: ValidatingAdmissionPolicy = from_value(docs[3].clone()).unwrap();
        assert_eq!(policy.metadata.name.as_deref(), Some(GUARD));
        let binding: ValidatingAdmissionPolicyBinding = from_value(docs[4].clone()).unwrap();
        assert_eq!(binding.spec.policy_name, GUARD);
    }
}
