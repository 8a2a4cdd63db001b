//! Reading a kubeconfig, as YAML: the current context's server and credentials (the API
//! clients of `recover`, `kubeadm-sync` and `migrate`), and every server it names (`served`).
//!
//! `current-context` names a context; the context names a cluster (`server`,
//! `certificate-authority[-data]`) and a user (`client-certificate[-data]`,
//! `client-key[-data]`, `token`). Material is inline (`…-data`, base64) or a file path,
//! relative to the kubeconfig's directory. A kubeconfig without `current-context` is read
//! only if it has one cluster and at most one user (the layout kubeadm writes).

use std::path::Path;

use base64::Engine as _;
use serde::Deserialize;

/// Why a kubeconfig cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("kubeconfig {path}: {problem}")]
pub struct KubeconfigError {
    pub path: String,
    #[source]
    pub problem: Problem,
}

/// What is wrong with a kubeconfig.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("cannot read: {0}")]
    Read(#[source] std::io::Error),
    #[error("not YAML: {0}")]
    Yaml(#[source] crate::base::yaml::YamlError),
    /// YAML, but not a kubeconfig's shape (a list where a string belongs, …).
    #[error("not a kubeconfig: {0}")]
    Shape(#[source] serde_json::Error),
    /// A key, or an entry a name refers to, is not there.
    #[error("no {0}")]
    Missing(String),
    #[error("server {0} is not https://HOST[:PORT]")]
    Server(String),
    #[error("{key}: {source}")]
    Base64 {
        key: String,
        #[source]
        source: base64::DecodeError,
    },
    #[error("{key} {file}: {source}")]
    File {
        key: String,
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{key}: {source}")]
    Pem {
        key: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}: no PEM key")]
    NoPemKey(&'static str),
    #[error("certificate-authority: {0}")]
    Root(#[source] rustls::Error),
    #[error("server {server}: {source}")]
    ServerName {
        server: String,
        #[source]
        source: rustls::pki_types::InvalidDnsNameError,
    },
    #[error("{0}")]
    Tls(#[source] crate::backends::tls::TlsError),
}

/// The server and credentials of a kubeconfig's current context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kubeconfig {
    /// `server`'s host (an IPv6 address without brackets) and port (443 when not given).
    pub host: String,
    pub port: u16,
    /// `server` as written.
    pub server: String,
    /// The CA bundle (PEM).
    pub ca: Vec<u8>,
    /// The client certificate and key (PEM), if the user has them.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
    /// The user's bearer token, if it has one.
    pub token: Option<String>,
}

/// Reads the kubeconfig at `path`.
pub fn read(path: &Path) -> Result<Kubeconfig, KubeconfigError> {
    let err = |problem| KubeconfigError {
        path: path.display().to_string(),
        problem,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(Problem::Read(e)))?;
    parse(&text, path.parent().unwrap_or(Path::new("/"))).map_err(err)
}

/// The current context of the kubeconfig `text`; relative file paths are below `base`.
pub fn parse(text: &str, base: &Path) -> Result<Kubeconfig, Problem> {
    let doc = document(text)?;
    let (cluster, user) = current(&doc)?;
    let server = nonempty(&cluster.cluster.server)
        .ok_or_else(|| Problem::Missing(format!("server in {}", cluster.describe())))?;
    let (host, port) = host_port(server).ok_or_else(|| Problem::Server(server.to_owned()))?;
    let c = &cluster.cluster;
    let ca = material(
        "certificate-authority",
        &c.certificate_authority,
        &c.certificate_authority_data,
        base,
    )?
    .ok_or_else(|| {
        Problem::Missing(format!(
            "certificate-authority[-data] in {}",
            cluster.describe()
        ))
    })?;
    let none = User::default();
    let u = user.map_or(&none, |u| &u.user);
    let cert = material(
        "client-certificate",
        &u.client_certificate,
        &u.client_certificate_data,
        base,
    )?;
    let key = material("client-key", &u.client_key, &u.client_key_data, base)?;
    let token = nonempty(&u.token).map(str::to_owned);
    let client = match (cert, key) {
        (Some(c), Some(k)) => Some((c, k)),
        (Some(_), None) => {
            return Err(Problem::Missing(format!(
                "client-key[-data] beside client-certificate in {}",
                user_name(user)
            )))
        }
        (None, Some(_)) => {
            return Err(Problem::Missing(format!(
                "client-certificate[-data] beside client-key in {}",
                user_name(user)
            )))
        }
        (None, None) if token.is_none() => {
            return Err(Problem::Missing(format!(
                "client-certificate[-data] and client-key[-data], or token, in {}",
                user_name(user)
            )))
        }
        (None, None) => None,
    };
    Ok(Kubeconfig {
        host,
        port,
        server: server.to_owned(),
        ca,
        client,
        token,
    })
}

/// When the bearer `token` expires, if it is a JWT with an `exp` claim (a ServiceAccount's
/// token is): its payload read, not verified (the apiserver verifies it).
pub fn token_expiry(token: &str) -> Option<std::time::SystemTime> {
    #[derive(Deserialize)]
    struct Claims {
        exp: Option<u64>,
    }
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: Claims = serde_json::from_slice(&bytes).ok()?;
    Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(claims.exp?))
}

/// The `https://HOST[:PORT]` servers of every cluster of the kubeconfig `text`, as (host,
/// port); other schemes are left out.
pub fn servers(text: &str) -> Result<Vec<(String, u16)>, Problem> {
    Ok(document(text)?
        .clusters
        .iter()
        .filter_map(|c| host_port(c.cluster.server.as_deref()?))
        .collect())
}

/// `https://HOST[:PORT][/…]` as (host, port): an IPv6 host without its brackets, 443 when no
/// port is given.
pub fn host_port(server: &str) -> Option<(String, u16)> {
    let hostport = server.strip_prefix("https://")?.split('/').next()?;
    let (host, port) = if let Some(rest) = hostport.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        match after {
            "" => (host, 443),
            p => (host, p.strip_prefix(':')?.parse().ok()?),
        }
    } else {
        match hostport.split_once(':') {
            Some((h, p)) => (h, p.parse().ok()?),
            None => (hostport, 443),
        }
    };
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

/// A kubeconfig (client-go's `clientcmd/api/v1.Config`): the fields read.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Config {
    #[serde(default)]
    clusters: Vec<NamedCluster>,
    #[serde(default)]
    contexts: Vec<NamedContext>,
    #[serde(default)]
    users: Vec<NamedUser>,
    current_context: Option<String>,
}

#[derive(Debug, Deserialize)]
struct NamedCluster {
    name: Option<String>,
    #[serde(default)]
    cluster: Cluster,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Cluster {
    server: Option<String>,
    certificate_authority: Option<String>,
    certificate_authority_data: Option<String>,
}

#[derive(Debug, Deserialize)]
struct NamedContext {
    name: Option<String>,
    #[serde(default)]
    context: Context,
}

#[derive(Debug, Default, Deserialize)]
struct Context {
    cluster: Option<String>,
    user: Option<String>,
}

#[derive(Debug, Deserialize)]
struct NamedUser {
    name: Option<String>,
    #[serde(default)]
    user: User,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct User {
    client_certificate: Option<String>,
    client_certificate_data: Option<String>,
    client_key: Option<String>,
    client_key_data: Option<String>,
    token: Option<String>,
}

impl NamedCluster {
    fn describe(&self) -> String {
        describe(&self.name, "cluster")
    }
}

fn document(text: &str) -> Result<Config, Problem> {
    let mut docs = crate::base::yaml::parse_documents(text).map_err(Problem::Yaml)?;
    if docs.is_empty() {
        return Ok(Config::default());
    }
    serde_json::from_value(docs.swap_remove(0)).map_err(Problem::Shape)
}

/// The named cluster and user of the current context (the user may be absent: a cluster that
/// takes anonymous requests has none).
fn current(doc: &Config) -> Result<(&NamedCluster, Option<&NamedUser>), Problem> {
    let Some(name) = nonempty(&doc.current_context) else {
        return only(doc);
    };
    let context = named(&doc.contexts, |c| &c.name, name)
        .ok_or_else(|| Problem::Missing(format!("context {name:?} (the current-context)")))?;
    let cluster_name = nonempty(&context.context.cluster)
        .ok_or_else(|| Problem::Missing(format!("cluster in context {name:?}")))?;
    let cluster = named(&doc.clusters, |c| &c.name, cluster_name).ok_or_else(|| {
        Problem::Missing(format!("cluster {cluster_name:?} (of context {name:?})"))
    })?;
    let user = match nonempty(&context.context.user) {
        Some(u) => Some(
            named(&doc.users, |c| &c.name, u)
                .ok_or_else(|| Problem::Missing(format!("user {u:?} (of context {name:?})")))?,
        ),
        None => None,
    };
    Ok((cluster, user))
}

/// Without `current-context`: the one cluster and the one user, if there are.
fn only(doc: &Config) -> Result<(&NamedCluster, Option<&NamedUser>), Problem> {
    match (doc.clusters.as_slice(), doc.users.as_slice()) {
        ([cluster], []) => Ok((cluster, None)),
        ([cluster], [user]) => Ok((cluster, Some(user))),
        (clusters, users) => Err(Problem::Missing(format!(
            "server: no current-context, and {} clusters and {} users (without it, one of each)",
            clusters.len(),
            users.len()
        ))),
    }
}

/// The entry of `list` whose name is `name`.
fn named<'a, T>(list: &'a [T], name_of: fn(&T) -> &Option<String>, name: &str) -> Option<&'a T> {
    list.iter().find(|e| name_of(e).as_deref() == Some(name))
}

/// A string that is there and not empty.
fn nonempty(v: &Option<String>) -> Option<&str> {
    v.as_deref().filter(|s| !s.is_empty())
}

fn describe(name: &Option<String>, kind: &str) -> String {
    match name {
        Some(n) => format!("{kind} {n:?}"),
        None => format!("the {kind}"),
    }
}

fn user_name(user: Option<&NamedUser>) -> String {
    user.map_or_else(
        || "the context (no user)".to_owned(),
        |u| describe(&u.name, "user"),
    )
}

/// `key-data` (base64) or the file `key` names, if either is there.
fn material(
    key: &str,
    file: &Option<String>,
    data: &Option<String>,
    base: &Path,
) -> Result<Option<Vec<u8>>, Problem> {
    if let Some(data) = nonempty(data) {
        return base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map(Some)
            .map_err(|source| Problem::Base64 {
                key: format!("{key}-data"),
                source,
            });
    }
    let Some(file) = nonempty(file) else {
        return Ok(None);
    };
    std::fs::read(base.join(file))
        .map(Some)
        .map_err(|source| Problem::File {
            key: key.to_owned(),
            file: file.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three contexts; the current one is the second, whose cluster and user come last.
    const MANY: &str = r#"
apiVersion: v1
kind: Config
clusters:
- name: first
  cluster:
    server: https://192.0.2.1:6443
    certificate-authority-data: Rmlyc3Q=
- name: other
  cluster:
    server: "https://[2001:db8::1]:7443/"
    certificate-authority: ca.crt
- name: target
  cluster:
    server: https://cp.example
    certificate-authority-data: Q0E=
contexts:
- name: a
  context: {cluster: first, user: alice}
- name: b
  context:
    cluster: target
    user: bob
- name: c
  context: {cluster: other, user: carol}
current-context: b
users:
- name: alice
  user: {token: alice-token}
- name: carol
  user:
    client-certificate: client.crt
    client-key: client.key
- name: bob
  user:
    client-certificate-data: Q0VSVA==
    client-key-data: S0VZ
    token: bob-token
"#;

    fn dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kap-kubeconfig-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_current_context_is_followed_to_its_cluster_and_user() {
        let k = parse(MANY, Path::new("/nonexistent")).unwrap();
        assert_eq!((k.host.as_str(), k.port), ("cp.example", 443));
        assert_eq!(k.ca, b"CA");
        assert_eq!(k.client, Some((b"CERT".to_vec(), b"KEY".to_vec())));
        assert_eq!(k.token.as_deref(), Some("bob-token"));
    }

    #[test]
    fn material_from_files_is_read_relative_to_the_kubeconfig() {
        let dir = dir();
        std::fs::write(dir.join("ca.crt"), "CA FILE").unwrap();
        std::fs::write(dir.join("client.crt"), "CERT FILE").unwrap();
        std::fs::write(dir.join("client.key"), "KEY FILE").unwrap();
        let text = MANY.replace("current-context: b", "current-context: c");
        std::fs::write(dir.join("c.conf"), &text).unwrap();
        let k = read(&dir.join("c.conf")).unwrap();
        assert_eq!((k.host.as_str(), k.port), ("2001:db8::1", 7443));
        assert_eq!(k.ca, b"CA FILE");
        assert_eq!(
            k.client,
            Some((b"CERT FILE".to_vec(), b"KEY FILE".to_vec()))
        );
        assert_eq!(k.token, None);
        // A token alone is a user too.
        let text = MANY.replace("current-context: b", "current-context: a");
        let k = parse(&text, &dir).unwrap();
        assert_eq!((k.client, k.token.as_deref()), (None, Some("alice-token")));
        // A file that is not there names the key, the file and the kubeconfig.
        std::fs::remove_file(dir.join("client.key")).unwrap();
        let e = read(&dir.join("c.conf")).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "kubeconfig {}: client-key client.key: ",
                dir.join("c.conf").display()
            )),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn what_is_missing_is_named() {
        let base = Path::new("/");
        let cases = [
            (
                "current-context: b",
                "current-context: z",
                "no context \"z\" (the current-context)",
            ),
            (
                "cluster: target",
                "cluster: gone",
                "no cluster \"gone\" (of context \"b\")",
            ),
            (
                "    user: bob",
                "    user: nobody",
                "no user \"nobody\" (of context \"b\")",
            ),
            (
                "    server: https://cp.example\n",
                "",
                "no server in cluster \"target\"",
            ),
            (
                "    server: https://cp.example",
                "    server: http://cp.example",
                "server http://cp.example is not https://HOST[:PORT]",
            ),
            (
                "    client-key-data: S0VZ\n",
                "",
                "no client-key[-data] beside client-certificate in user \"bob\"",
            ),
            (
                "    certificate-authority-data: Q0E=\n",
                "",
                "no certificate-authority[-data] in cluster \"target\"",
            ),
            (
                "    client-key-data: S0VZ",
                "    client-key-data: '*'",
                "client-key-data: ",
            ),
        ];
        for (from, to, want) in cases {
            let text = MANY.replacen(from, to, 1);
            assert_ne!(text, MANY, "{from}");
            let e = parse(&text, base).unwrap_err().to_string();
            assert!(e.starts_with(want), "{from} -> {to}: {e}");
        }
        let e = parse("clusters: []\n", base).unwrap_err().to_string();
        assert!(e.contains("no server"), "{e}");
        assert!(matches!(parse("a: [1\n", base), Err(Problem::Yaml(_))));
        // YAML of another shape: said so, with where.
        let e = parse("clusters:\n- cluster: [1]\n", base)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("not a kubeconfig: "), "{e}");
        assert!(servers("users: 5\n").is_err());
    }

    #[test]
    fn servers_of_every_cluster() {
        assert_eq!(
            servers(MANY).unwrap(),
            [
                ("192.0.2.1".to_owned(), 6443),
                ("2001:db8::1".to_owned(), 7443),
                ("cp.example".to_owned(), 443)
            ]
        );
        assert_eq!(host_port("https://[::1]"), Some(("::1".to_owned(), 443)));
        assert_eq!(host_port("https://h:x"), None);
        assert_eq!(host_port("https://2001:db8::1:6443"), None);
    }

    #[test]
    fn a_tokens_expiry_is_its_exp_claim() {
        use base64::Engine;
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let jwt = format!(
            "{}.{}.sig",
            b64(r#"{"alg":"RS256"}"#),
            b64(r#"{"exp":1900000000,"sub":"x"}"#)
        );
        assert_eq!(
            token_expiry(&jwt),
            Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_900_000_000))
        );
        assert_eq!(token_expiry("opaque-token"), None);
        assert_eq!(token_expiry(&format!("a.{}.c", b64("{}"))), None);
    }
}
