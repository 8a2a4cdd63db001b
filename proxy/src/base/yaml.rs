//! YAML in and out, as Kubernetes reads it: the manifests `render` and `kubeadm-sync` read
//! (kubeadm's static pod, the embedded base Deployment) become [`serde_json::Value`]s, and the
//! objects they print become one YAML stream for `kubectl apply -f -`.
//!
//! Parsing uses saphyr's event parser and resolves plain scalars itself, the way Kubernetes'
//! YAML library (go-yaml v2 under sigs.k8s.io/yaml) does, YAML 1.1 style: `yes`/`on` are
//! booleans, `0644` is octal, mapping keys become strings. A quoted scalar is always a
//! string. Emitting quotes every string that either YAML 1.1 or 1.2 would read as something
//! else (saphyr's emitter already does: `"yes"`, `"on"`, `"1.30"`).

use saphyr::{Scalar, ScalarStyle, Yaml, YamlEmitter, YamlLoader};
use serde_json::{Map, Number, Value};

/// Why a YAML text could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct YamlError(pub String);

/// The documents of a YAML stream, empty documents left out.
pub fn parse_documents(text: &str) -> Result<Vec<Value>, YamlError> {
    let mut loader: YamlLoader<'_, Yaml<'_>> = YamlLoader::default();
    loader.early_parse(false);
    let mut parser = saphyr_parser::Parser::new_from_str(text);
    parser
        .load(&mut loader, true)
        .map_err(|e| YamlError(e.to_string()))?;
    if let Some(e) = loader.error() {
        return Err(YamlError(e.to_string()));
    }
    let mut docs = Vec::new();
    for doc in loader.into_documents() {
        match to_json(&doc)? {
            Value::Null => {}
            v => docs.push(v),
        }
    }
    Ok(docs)
}

/// One YAML document (no leading `---`), ending in a newline.
pub fn to_yaml(doc: &Value) -> String {
    let node = from_json(doc);
    let mut out = String::new();
    let mut emitter = YamlEmitter::new(&mut out);
    emitter.multiline(true);
    emitter
        .dump(&node)
        .expect("writing YAML into a String cannot fail");
    // The emitter starts every document with "---".
    let body = out.strip_prefix("---\n").unwrap_or(&out);
    let body = body.strip_prefix("---").unwrap_or(body);
    format!("{}\n", body.trim_end())
}

fn to_json(node: &Yaml<'_>) -> Result<Value, YamlError> {
    Ok(match node {
        Yaml::Representation(text, style, tag) => {
            let tag = tag.as_ref().map(|t| t.suffix.as_str());
            match (style, tag) {
                (_, Some("str")) => Value::String(text.to_string()),
                (ScalarStyle::Plain, _) => resolve_plain(text),
                _ => Value::String(text.to_string()),
            }
        }
        Yaml::Value(scalar) => scalar_to_json(scalar),
        Yaml::Sequence(items) => Value::Array(items.iter().map(to_json).collect::<Result<_, _>>()?),
        Yaml::Mapping(map) => {
            let mut out = Map::new();
            for (k, v) in map {
                let key = match to_json(k)? {
                    Value::String(s) => s,
                    Value::Null => "null".to_owned(),
                    other => other.to_string(),
                };
                out.insert(key, to_json(v)?);
            }
            Value::Object(out)
        }
        Yaml::Tagged(_, inner) => to_json(inner)?,
        Yaml::Alias(_) | Yaml::BadValue => {
            return Err(YamlError("unresolvable node (alias or bad value)".into()))
        }
    })
}

fn scalar_to_json(scalar: &Scalar<'_>) -> Value {
    match scalar {
        Scalar::Null => Value::Null,
        Scalar::Boolean(b) => Value::Bool(*b),
        Scalar::Integer(i) => Value::from(*i),
        Scalar::FloatingPoint(f) => {
            Number::from_f64(f.into_inner()).map_or(Value::Null, Value::Number)
        }
        Scalar::String(s) => Value::String(s.to_string()),
    }
}

/// A plain (unquoted) scalar as go-yaml v2 resolves it.
fn resolve_plain(text: &str) -> Value {
    match text {
        "" | "~" | "null" | "Null" | "NULL" => return Value::Null,
        "y" | "Y" | "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON" => {
            return Value::Bool(true)
        }
        "n" | "N" | "no" | "No" | "NO" | "false" | "False" | "FALSE" | "off" | "Off" | "OFF" => {
            return Value::Bool(false)
        }
        _ => {}
    }
    if let Some(i) = parse_int(text) {
        return Value::from(i);
    }
    if is_float(text) {
        if let Some(n) = text
            .replace('_', "")
            .parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
        {
            return Value::Number(n);
        }
    }
    Value::String(text.to_owned())
}

fn parse_int(text: &str) -> Option<i64> {
    let (neg, digits) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let digits = digits.replace('_', "");
    let value = if let Some(hex) = digits.strip_prefix("0x") {
        i64::from_str_radix(hex, 16).ok()?
    } else if let Some(bin) = digits.strip_prefix("0b") {
        i64::from_str_radix(bin, 2).ok()?
    } else if digits.len() > 1 && digits.starts_with('0') {
        i64::from_str_radix(&digits[1..], 8).ok()?
    } else if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        digits.parse().ok()?
    } else {
        return None;
    };
    Some(if neg { -value } else { value })
}

/// `[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?` (YAML 1.1's float, without `.inf`).
fn is_float(text: &str) -> bool {
    let s = text
        .strip_prefix(['-', '+'])
        .unwrap_or(text)
        .replace('_', "");
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (&s[..], None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (mantissa, None),
    };
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok = match frac {
        Some(f) => digits(int) && digits(f) && !(int.is_empty() && f.is_empty()),
        None => !int.is_empty() && digits(int),
    };
    let exponent_ok = exponent.is_none_or(|e| {
        let e = e.strip_prefix(['-', '+']).unwrap_or(e);
        !e.is_empty() && digits(e)
    });
    mantissa_ok && exponent_ok && (frac.is_some() || exponent.is_some())
}

fn from_json(value: &Value) -> Yaml<'static> {
    match value {
        Value::Null => Yaml::Value(Scalar::Null),
        Value::Bool(b) => Yaml::Value(Scalar::Boolean(*b)),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Yaml::Value(Scalar::Integer(i)),
            (None, Some(f)) => Yaml::Value(Scalar::FloatingPoint(f.into())),
            (None, None) => Yaml::Value(Scalar::String(n.to_string().into())),
        },
        Value::String(s) => Yaml::Value(Scalar::String(s.clone().into())),
        Value::Array(items) => Yaml::Sequence(items.iter().map(from_json).collect()),
        Value::Object(map) => {
            let mut out = saphyr::Mapping::new();
            for (k, v) in map {
                out.insert(Yaml::Value(Scalar::String(k.clone().into())), from_json(v));
            }
            Yaml::Mapping(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_scalars_resolve_as_kubernetes_reads_them() {
        let docs = parse_documents(
            "a: yes\nb: 'yes'\nc: 0644\nd: 10\ne: 1.5\nf: ~\ng: \"10\"\nh: 1.30\ni: v1.37.2\nj: 250m\nk: !!str 10\n",
        )
        .unwrap();
        assert_eq!(
            docs,
            vec![
                json!({"a": true, "b": "yes", "c": 420, "d": 10, "e": 1.5, "f": null,
                        "g": "10", "h": 1.3, "i": "v1.37.2", "j": "250m", "k": "10"})
            ]
        );
    }

    #[test]
    fn streams_split_into_documents_and_round_trip() {
        let text = "---\n# a comment\napiVersion: v1\nkind: Pod\nspec:\n  containers:\n  - command: [a, '--x=on', \"--y=1.30\"]\n---\n---\nkind: B\nlist: []\nmap: {}\nmulti: |\n  line one\n  line two\n";
        let docs = parse_documents(text).unwrap();
        assert_eq!(docs.len(), 2);
        for doc in &docs {
            let again = parse_documents(&to_yaml(doc)).unwrap();
            assert_eq!(&again, &vec![doc.clone()], "{}", to_yaml(doc));
        }
        // Strings that YAML 1.1 or 1.2 would read otherwise come out quoted.
        let tricky =
            json!({"s": ["on", "yes", "1.30", "0644", "", "~", "a: b", "#x", "-1", "true"]});
        assert_eq!(parse_documents(&to_yaml(&tricky)).unwrap(), vec![tricky]);
    }

    #[test]
    fn malformed_yaml_is_an_error() {
        assert!(parse_documents("a: [1, 2\n").is_err());
        assert!(parse_documents("a: 1\na: 2\n").is_err(), "duplicate keys");
    }
}
