//! No import cycles between the modules of `src/`, and the layers named in order.
//!
//! The file checks the crate it is compiled into (`CARGO_MANIFEST_DIR`): the proxy's test
//! target, and the bench crate's `tests/module_graph.rs`, which includes this file with
//! `#[path]`; [`this_crate`] holds what differs between them.
//!
//! Every `.rs` file under `src/` belongs to a module: `foo.rs` and `foo/mod.rs` are `foo`, and
//! `foo/bar.rs` is `foo::bar` and counts as `foo` — unless `foo/` is a folder of modules (its
//! `mod.rs` declares modules and nothing else): then `foo/bar.rs` and everything below it is the
//! module `foo::bar`, and so on down: a folder of modules inside one (`node/kubeadm/`) holds
//! modules of its own (`node::kubeadm::sync`). A module depends on another when its code names it: `crate::name` (or
//! `crate::folder::name`), an entry of a `use crate::{a, b::c}` group, a `super::` chain that
//! climbs out of it, and in `main.rs` (the binary, a crate root of its own that sees the library
//! by its name, e.g. `kube_apiserver_proxy`) `library::name`. Test code does not count: items
//! under `#[cfg(test)]` (the `mod tests { … }` at the bottom of a file) and files declared by a
//! `#[cfg(test)] mod name;` are left out. Comments (doc links included), string and character
//! literals are blanked before the scan.
//!
//! The graph of those dependencies must have no cycle; the test names every strongly connected
//! component of more than one module, with one reference (file:line) for each edge inside it.
//! Nor may the entries of a folder that holds folders (the proxy's `node/`, a folder per job),
//! each folder taken whole, form a cycle between them.
//! The crate's self-contained modules (the proxy's `sys`, the `unsafe` module) must name no
//! other module at all. And where the crate has layers (the proxy's [`LAYERS`]), every module
//! belongs to one and names nothing in a layer above its own.
//!
//! The scan is deliberately small: it reads tokens, not Rust. Inline modules other than
//! `#[cfg(test)]` ones are not tracked (a `super::` inside one is read as if it were at the
//! file's level), and neither are `#[path]` attributes or macros that build paths.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What the test expects of one crate that runs it.
struct Crate {
    /// How `main.rs` names the library's crate root.
    library: &'static str,
    /// Fewer modules than this means the scan read the wrong directory.
    min_modules: usize,
    /// Modules that must name no other module of the crate.
    self_contained: &'static [&'static str],
    /// The crate's layers, lowest first (none: no layer rule).
    layers: &'static [&'static [&'static str]],
}

/// The crate this file is compiled into, by its package name.
fn this_crate() -> Crate {
    match env!("CARGO_PKG_NAME") {
        "kube-apiserver-proxy" => Crate {
            library: "kube_apiserver_proxy",
            min_modules: 21,
            self_contained: &["sys"],
            layers: LAYERS,
        },
        "kube-apiserver-proxy-bench" => Crate {
            library: "kube_apiserver_proxy_bench",
            min_modules: 15,
            self_contained: &["options"],
            layers: &[],
        },
        other => panic!("module_graph.rs does not know the crate {other}: add it to this_crate"),
    }
}

/// One place where a module names another.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reference {
    /// The top-level module named.
    to: String,
    /// 1-based line in the file.
    line: usize,
}

/// `from` → `to` → the first reference found (file relative to the crate, line).
type Graph = BTreeMap<String, BTreeMap<String, (String, usize)>>;

#[test]
fn modules_import_each_other_without_cycles() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let krate = this_crate();
    let graph = graph_of(crate_dir, &crate_dir.join("src"), krate.library);
    assert!(
        graph.len() >= krate.min_modules,
        "the scan found only {} modules under src/: is it reading the right directory?",
        graph.len()
    );
    let cycles = cycles(&graph);
    assert!(cycles.is_empty(), "{}", report(crate_dir, &graph, &cycles));
}

/// A folder of modules that holds folders of modules (the proxy's `node`, a folder per job)
/// has no cycle between its entries either, each folder taken whole: jobs may share what is
/// beside them, never lean on each other both ways, even through modules that do not name
/// each other.
#[test]
fn folders_import_each_other_without_cycles() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let krate = this_crate();
    let graph = graph_of(crate_dir, &crate_dir.join("src"), krate.library);
    let mut text = String::new();
    for (folder, entries, cycles) in folder_cycles(&graph) {
        if !cycles.is_empty() {
            let _ = writeln!(text, "in {folder}/, its folders taken whole:");
            text.push_str(&report(crate_dir, &entries, &cycles));
        }
    }
    assert!(text.is_empty(), "{text}");
}

#[test]
fn folder_cycles_name_a_planted_cycle_between_folders() {
    let mut graph = Graph::new();
    for (from, to) in [
        ("node::kubeadm::sync", "node::api"),
        ("node::recovery::recover", "node::api"),
        ("node::pod::launch", "node::migration::migrate"),
        ("node::kubeadm::sync", "node::recovery::checkpoint"),
        ("node::api", "base::fsutil"),
    ] {
        add_edge(&mut graph, from, to, "src/planted.rs", 1);
    }
    let found = |graph: &Graph| -> Vec<(String, Vec<Vec<String>>)> {
        folder_cycles(graph)
            .into_iter()
            .map(|(folder, _, cycles)| (folder, cycles))
            .collect()
    };
    assert_eq!(found(&graph), [("node".to_string(), vec![])]);

    // No two modules name each other: only the folders do.
    add_edge(
        &mut graph,
        "node::recovery::staticpod",
        "node::kubeadm::render",
        "src/planted.rs",
        2,
    );
    assert!(cycles(&graph).is_empty());
    let (folder, entries, cycles) = folder_cycles(&graph).remove(0);
    assert_eq!(folder, "node");
    assert_eq!(cycles, [vec!["node::kubeadm", "node::recovery"]]);
    let text = report(Path::new("/x/proxy"), &entries, &cycles);
    assert!(
        text.contains("node::kubeadm -> node::recovery (src/planted.rs:1)"),
        "{text}"
    );
    assert!(
        text.contains("node::recovery -> node::kubeadm (src/planted.rs:2)"),
        "{text}"
    );
}

/// For each folder of modules that holds folders of modules (`node`, a key with a name below
/// its entry's), the graph between its entries, each folder of them taken whole
/// (`node::kubeadm::sync` is `node::kubeadm`), and that graph's cycles.
fn folder_cycles(graph: &Graph) -> Vec<(String, Graph, Vec<Vec<String>>)> {
    let mut folders = BTreeSet::new();
    for module in graph.keys() {
        let names: Vec<&str> = module.split("::").collect();
        for depth in 1..names.len().saturating_sub(1) {
            folders.insert(names[..depth].join("::"));
        }
    }
    let entry_of = |folder: &str, module: &str| -> Option<String> {
        let rest = module.strip_prefix(folder)?.strip_prefix("::")?;
        let first = rest.split("::").next()?;
        Some(format!("{folder}::{first}"))
    };
    let mut found = Vec::new();
    for folder in folders {
        let mut entries = Graph::new();
        for (from, edges) in graph {
            let Some(from) = entry_of(&folder, from) else {
                continue;
            };
            entries.entry(from.clone()).or_default();
            for (to, (file, line)) in edges {
                match entry_of(&folder, to) {
                    Some(to) if to != from => add_edge(&mut entries, &from, &to, file, *line),
                    _ => {}
                }
            }
        }
        let cycles = cycles(&entries);
        found.push((folder, entries, cycles));
    }
    found
}

/// The self-contained modules name nothing else of the crate: the proxy's `sys`, the one
/// module with `unsafe`, owns what it needs (the kernel's value layouts, `Plain`).
#[test]
fn self_contained_modules_depend_on_nothing_of_the_crate() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let krate = this_crate();
    let graph = graph_of(crate_dir, &crate_dir.join("src"), krate.library);
    for module in krate.self_contained {
        let edges = graph
            .get(*module)
            .unwrap_or_else(|| panic!("no module {module} under src/"));
        let named: Vec<String> = edges
            .iter()
            .map(|(to, (file, line))| format!("{module} -> {to} ({file}:{line})"))
            .collect();
        assert!(
            named.is_empty(),
            "{module} names other modules:\n{}",
            named.join("\n")
        );
    }
}

/// The layers, lowest first: a module names modules of its own layer or of layers below it,
/// never above. A module is placed by its top folder (`data::copy` is in `data`,
/// `node::kubeadm::sync` in `node`) or, at the top level, by its name. docs/architecture.md
/// draws the same order.
const LAYERS: &[&[&str]] = &[
    // The only `unsafe`: raw descriptor work.
    &["sys"],
    // What every layer shares; faults planted for the tier's self-test (feature only).
    &["base", "fault"],
    // Backends, their health, how a connection to one is made.
    &["backends"],
    // Accepting, forwarding, carrying bytes, handing connections over.
    &["data"],
    // Listener handoff between instances.
    &["handoff"],
    // One process's life: signals, notifications, limits, privileges, in-place upgrade.
    &["instance"],
    // The flags (clap): the admin endpoints read the client address mode; the node commands
    // take options of their own, converted by the root `commands`.
    &["cli"],
    // The admin endpoints and the node's scrape target.
    &["observe"],
    // The node commands and agents.
    &["node"],
    // The roots: typed configuration, the node commands' options, one instance's
    // start/serve/drain, the binary.
    &["config", "commands", "server", "main"],
];

#[test]
fn layers_name_only_layers_below_them() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let krate = this_crate();
    if krate.layers.is_empty() {
        return; // a crate without layers (the bench) has only the cycle rule
    }
    let graph = graph_of(crate_dir, &crate_dir.join("src"), krate.library);
    let problems = layering_problems(&graph, krate.layers);
    assert!(
        problems.is_empty(),
        "modules of src/ name a layer above their own (the order: LAYERS, \
         docs/architecture.md):\n{}",
        problems.join("\n")
    );
}

#[test]
fn layering_names_a_planted_upward_reference() {
    let mut graph = Graph::new();
    add_edge(&mut graph, "high::a", "low::b", "src/high/a.rs", 3);
    add_edge(&mut graph, "low::b", "low::c", "src/low/b.rs", 4);
    add_edge(&mut graph, "root", "high::a", "src/root.rs", 5);
    let layers: &[&[&str]] = &[&["low"], &["high"], &["root"]];
    assert!(layering_problems(&graph, layers).is_empty());

    add_edge(&mut graph, "low::c", "high::a", "src/low/c.rs", 7);
    add_edge(&mut graph, "stray", "low::b", "src/stray.rs", 1);
    assert_eq!(
        layering_problems(&graph, layers),
        [
            "low::c (layer low) names high::a (layer high): src/low/c.rs:7",
            "stray is in no layer: add it to LAYERS",
        ]
    );
}

/// Every reference from a module to one in a higher layer, and every module in no layer.
fn layering_problems(graph: &Graph, layers: &[&[&str]]) -> Vec<String> {
    let layer_of = |module: &str| {
        let head = module.split("::").next().unwrap_or(module);
        layers.iter().position(|layer| layer.contains(&head))
    };
    let mut problems = Vec::new();
    for (from, edges) in graph {
        let Some(own) = layer_of(from) else {
            problems.push(format!("{from} is in no layer: add it to LAYERS"));
            continue;
        };
        for (to, (file, line)) in edges {
            match layer_of(to) {
                Some(theirs) if theirs > own => problems.push(format!(
                    "{from} (layer {}) names {to} (layer {}): {file}:{line}",
                    layers[own][0], layers[theirs][0]
                )),
                _ => {}
            }
        }
    }
    problems
}

#[test]
fn cycle_finder_names_a_planted_cycle() {
    let mut graph = Graph::new();
    for (from, to) in [
        ("a", "b"),
        ("b", "c"),
        ("c", "a"),
        ("c", "d"),
        ("d", "e"),
        ("e", "d"),
        ("f", "a"),
        ("g", "g"),
    ] {
        add_edge(&mut graph, from, to, "src/planted.rs", 1);
    }
    let found = cycles(&graph);
    assert_eq!(found, [vec!["a", "b", "c"], vec!["d", "e"]]);
    let text = report(Path::new("/x/proxy"), &graph, &found);
    assert!(text.contains("cycle 1: a, b, c"), "{text}");
    assert!(text.contains("c -> a (src/planted.rs:1)"), "{text}");
    assert!(
        !text.contains("c -> d"),
        "an edge out of the cycle is not part of it: {text}"
    );
    assert!(
        !text.contains("g -> g"),
        "a module naming itself is no cycle: {text}"
    );

    add_edge(&mut graph, "e", "f", "src/planted.rs", 2);
    assert_eq!(cycles(&graph), [vec!["a", "b", "c", "d", "e", "f"]]);

    let mut acyclic = Graph::new();
    add_edge(&mut acyclic, "a", "b", "src/planted.rs", 1);
    add_edge(&mut acyclic, "b", "c", "src/planted.rs", 1);
    add_edge(&mut acyclic, "a", "c", "src/planted.rs", 1);
    assert!(cycles(&acyclic).is_empty());
}

#[test]
fn scan_reads_code_only() {
    let source = r####"//! See [`crate::comment`].
use crate::first;
use crate::{
    second, third::Thing,
    fourth::{a, b},
    self,
};
/* crate::block /* nested */ crate::block */
fn f<'a>(x: &'a str) -> char {
    let _ = "crate::string \" crate::escaped";
    let _ = r#"crate::raw "quoted""#;
    let _ = b'{';
    let _ = '\'';
    crate::fifth::call();
    let _ = pub_crate_is_not_a_path;
    '"'
}
pub(crate) fn g() {}
#[cfg(test)]
mod tests {
    use crate::in_tests;
    fn h() { let _ = crate::in_tests::more(); }
}
#[cfg(test)]
use crate::test_import;
#[cfg(test)]
mod test_file;
#[cfg(feature = "x")]
use crate::sixth;
"####;
    let planted = scan(source, "crate", &[], &BTreeSet::new());
    let named: Vec<(&str, usize)> = planted
        .references
        .iter()
        .map(|r| (r.to.as_str(), r.line))
        .collect();
    assert_eq!(
        named,
        [
            ("first", 2),
            ("second", 4),
            ("third", 4),
            ("fourth", 5),
            ("fifth", 14),
            ("sixth", 29)
        ]
    );
    assert_eq!(planted.test_modules, ["test_file"]);
    assert!(!planted.test_only);

    let climbing = scan(
        "use super::super::up; use super::near;",
        "crate",
        &["a", "b"],
        &BTreeSet::new(),
    );
    let named: Vec<&str> = climbing.references.iter().map(|r| r.to.as_str()).collect();
    assert_eq!(named, ["up"]);

    assert!(
        scan(
            "#![cfg(test)]\nuse crate::x;",
            "crate",
            &[],
            &BTreeSet::new()
        )
        .test_only
    );
}

#[test]
fn scan_follows_folders_of_modules() {
    let groups: BTreeSet<String> = ["data", "base"].map(String::from).into();
    let source = "use crate::data::{copy, control::Control};\n\
                  use crate::{base::addr, sys};\n\
                  fn f() { crate::base::metrics::get(); }\n\
                  use crate::data;\n\
                  use super::sibling;\n";
    let scanned = scan(source, "crate", &["data", "forward"], &groups);
    let named: Vec<&str> = scanned.references.iter().map(|r| r.to.as_str()).collect();
    assert_eq!(
        named,
        [
            "data::copy",
            "data::control",
            "base::addr",
            "sys",
            "base::metrics",
            "data",
            "data::sibling"
        ]
    );
    assert!(only_declares_modules(
        "//! Doc.\n#[cfg(feature = \"x\")]\npub mod a;\nmod b;\n"
    ));
    assert!(!only_declares_modules("pub mod a;\npub fn f() {}\n"));

    let nested: BTreeSet<String> = ["node", "node::kubeadm", "data"].map(String::from).into();
    let source = "use crate::node::kubeadm::{sync, render::StaticPod};\n\
                  use crate::node::{api::ApiClient, kubeadm::undo};\n\
                  use super::super::manifest;\n\
                  use super::sync::run;\n\
                  fn f() { crate::node::kubeadm::etcd_canary::check(); }\n";
    let scanned = scan(source, "crate", &["node", "kubeadm", "identity"], &nested);
    let named: Vec<&str> = scanned.references.iter().map(|r| r.to.as_str()).collect();
    assert_eq!(
        named,
        [
            "node::kubeadm::sync",
            "node::kubeadm::render",
            "node::api",
            "node::kubeadm::undo",
            "node::manifest",
            "node::kubeadm::sync",
            "node::kubeadm::etcd_canary"
        ]
    );
    let module = |path: &[&str]| {
        let path: Vec<String> = path.iter().map(|n| n.to_string()).collect();
        module_of(&path, &nested)
    };
    assert_eq!(module(&["node", "kubeadm", "sync"]), "node::kubeadm::sync");
    assert_eq!(module(&["node", "api"]), "node::api");
    assert_eq!(module(&["handoff", "wire"]), "handoff");
    assert_eq!(module(&["data", "copy", "part"]), "data::copy");
}

/// The dependency graph of the modules under `src`, every module a key: a top-level module
/// (`foo.rs`, `foo/mod.rs` and everything below it), or a module of a folder of modules
/// (`data/copy.rs` and everything below it is `data::copy`; `node/kubeadm/sync.rs` is
/// `node::kubeadm::sync` when `node/kubeadm/` is a folder of modules too; see [`groups_of`]).
/// `library` is how `main.rs` names the library's crate root.
fn graph_of(crate_dir: &Path, src: &Path, library: &str) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let groups = groups_of(src);

    // Module path of each file, and the files whose code is read.
    let mut modules: Vec<(PathBuf, Vec<String>)> = Vec::new();
    for file in files {
        let relative = file.strip_prefix(src).expect("under src");
        let mut path: Vec<String> = relative
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        let last = path.pop().expect("a file name");
        let stem = last.strip_suffix(".rs").expect("a .rs file");
        if stem != "mod" {
            path.push(stem.to_string());
        }
        // lib.rs is the crate root and a folder's mod.rs only declares its modules: neither is
        // a module of its own.
        if path == ["lib"] || groups.contains(&path.join("::")) {
            continue;
        }
        modules.push((file, path));
    }
    let key = |path: &[String]| module_of(path, &groups);
    let known: BTreeSet<String> = modules.iter().map(|(_, path)| key(path)).collect();

    let mut graph = Graph::new();
    let mut test_paths: Vec<Vec<String>> = Vec::new();
    let mut scans = Vec::new();
    for (file, path) in &modules {
        let text = std::fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        let root = if path == &["main"] { library } else { "crate" };
        let path_refs: Vec<&str> = path.iter().map(String::as_str).collect();
        let scan = scan(&text, root, &path_refs, &groups);
        for name in &scan.test_modules {
            let mut test_path = path.clone();
            test_path.push(name.clone());
            test_paths.push(test_path);
        }
        scans.push((file, path, scan));
    }
    for (file, path, scan) in scans {
        let from = key(path);
        graph.entry(from.clone()).or_default();
        let test_only = scan.test_only || test_paths.iter().any(|t| path.starts_with(t));
        if test_only {
            continue;
        }
        let shown = file
            .strip_prefix(crate_dir)
            .unwrap_or(file)
            .display()
            .to_string();
        for reference in scan.references {
            if reference.to != from && known.contains(&reference.to) {
                add_edge(&mut graph, &from, &reference.to, &shown, reference.line);
            }
        }
    }
    graph
}

/// The folders of modules under `src`, by module path (`data`, `node::kubeadm`): a folder whose
/// `mod.rs` declares modules and holds nothing else (comments and attributes aside), at the top
/// or inside another folder of modules. Its modules are modules of their own in the graph; a
/// folder with code in its `mod.rs` (`handoff/`) is one module with its parts, whatever folders
/// it holds.
fn groups_of(src: &Path) -> BTreeSet<String> {
    let mut groups = BTreeSet::new();
    add_groups(src, "", &mut groups);
    groups
}

/// The folders of modules in `dir` (module path `prefix`, empty at `src`) and below them.
fn add_groups(dir: &Path, prefix: &str, groups: &mut BTreeSet<String>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let sub = entry.expect("directory entry").path();
        let Ok(text) = std::fs::read_to_string(sub.join("mod.rs")) else {
            continue;
        };
        if only_declares_modules(&text) {
            let name = sub.file_name().expect("a name").to_string_lossy();
            let path = if prefix.is_empty() {
                name.into_owned()
            } else {
                format!("{prefix}::{name}")
            };
            add_groups(&sub, &path, groups);
            groups.insert(path);
        }
    }
}

/// The module a file's module path belongs to: down the folders of modules, then one name
/// (`[node, kubeadm, sync]` is `node::kubeadm::sync`, `[handoff, wire]` is `handoff`).
fn module_of(path: &[String], groups: &BTreeSet<String>) -> String {
    let mut module = path[0].clone();
    for name in &path[1..] {
        if !groups.contains(&module) {
            break;
        }
        module = format!("{module}::{name}");
    }
    module
}

/// The text's code is nothing but `[pub] mod name;` items, each with its attributes.
fn only_declares_modules(text: &str) -> bool {
    let tokens = tokens(&blank(text));
    let mut i = 0;
    while i < tokens.len() {
        let end = item_end(&tokens, i);
        let item: Vec<&str> = tokens[i..end].iter().map(|t| t.text.as_str()).collect();
        let mut rest = item.as_slice();
        while let ["#", "[", ..] = rest {
            let close = rest
                .iter()
                .position(|t| *t == "]")
                .expect("an attribute's end");
            rest = &rest[close + 1..];
        }
        if !matches!(rest, ["pub", "mod", _, ";"] | ["mod", _, ";"]) {
            return false;
        }
        i = end;
    }
    true
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn add_edge(graph: &mut Graph, from: &str, to: &str, file: &str, line: usize) {
    graph.entry(to.to_string()).or_default();
    graph
        .entry(from.to_string())
        .or_default()
        .entry(to.to_string())
        .or_insert_with(|| (file.to_string(), line));
}

/// What one file's code names.
#[derive(Debug)]
struct Scan {
    /// Top-level names reached from the crate root, in order (not yet checked to be modules).
    references: Vec<Reference>,
    /// Submodules declared by `#[cfg(test)] mod name;`: their files are test code.
    test_modules: Vec<String>,
    /// The file opens with `#![cfg(test)]`.
    test_only: bool,
}

/// Scans one file's text. `root` is how the crate root is spelled (`crate`, or the library's
/// name in `main.rs`); `path` is the file's module path, for `super::` chains.
fn scan(text: &str, root: &str, path: &[&str], groups: &BTreeSet<String>) -> Scan {
    let tokens = tokens(&blank(text));
    let mut references = Vec::new();
    let mut test_modules = Vec::new();
    let mut test_only = false;
    let mut i = 0;
    while i < tokens.len() {
        if let Some(after) = cfg_test(&tokens, i) {
            if tokens[i + 1].text == "!" {
                test_only = true;
                i = after;
                continue;
            }
            let end = item_end(&tokens, after);
            if let Some(name) = declared_module(&tokens[after..end]) {
                test_modules.push(name);
            }
            i = end;
            continue;
        }
        let token = &tokens[i];
        if token.text == root && next_is(&tokens, i, "::") {
            i = read_path_tail(&tokens, i + 2, "", groups, &mut references);
            continue;
        }
        if token.text == "super" && next_is(&tokens, i, "::") {
            let mut climbed = 0;
            let mut j = i;
            while tokens.get(j).is_some_and(|t| t.text == "super") && next_is(&tokens, j, "::") {
                climbed += 1;
                j += 2;
            }
            // A chain that climbs to the crate root names a top-level module next; one that
            // climbs to a folder of modules names a module of that folder.
            let reached = path[..path.len().saturating_sub(climbed)].join("::");
            if !path.is_empty() && reached.is_empty() {
                i = read_path_tail(&tokens, j, "", groups, &mut references);
            } else if groups.contains(&reached) {
                i = read_path_tail(&tokens, j, &reached, groups, &mut references);
            } else {
                i = j;
            }
            continue;
        }
        i += 1;
    }
    Scan {
        references,
        test_modules,
        test_only,
    }
}

/// After `crate::` (or after the folder of modules `prefix`, reached by `super::`): one module,
/// or the modules of a `{…}` group's entries. A name that is a folder of modules (one of
/// `groups`) is read with the module after it (`data::copy`, each of `data::{copy, control}`,
/// `node::kubeadm::sync`). Returns the index after.
fn read_path_tail(
    tokens: &[Token],
    start: usize,
    prefix: &str,
    groups: &BTreeSet<String>,
    out: &mut Vec<Reference>,
) -> usize {
    if tokens.get(start).is_some_and(|t| t.text == "{") {
        let (heads, after) = braced_heads(tokens, start);
        for head in heads {
            read_name(tokens, head, prefix, groups, out);
        }
        return after;
    }
    read_name(tokens, start, prefix, groups, out)
}

/// The name at `i` (inside the folder `prefix`, empty at the crate root); a folder of modules
/// is followed into its module, or each module of a `{…}`, folder by folder. Returns the index
/// after what was read.
fn read_name(
    tokens: &[Token],
    i: usize,
    prefix: &str,
    groups: &BTreeSet<String>,
    out: &mut Vec<Reference>,
) -> usize {
    let Some(token) = tokens.get(i) else {
        return i;
    };
    if !is_ident(&token.text) {
        return i + 1;
    }
    let name = if prefix.is_empty() {
        token.text.clone()
    } else {
        format!("{prefix}::{}", token.text)
    };
    if !groups.contains(&name) || !next_is(tokens, i, "::") {
        out.push(Reference {
            to: name,
            line: token.line,
        });
        return i + 1;
    }
    read_path_tail(tokens, i + 2, &name, groups, out)
}

/// The `{…}` starting at `start`: the index of each entry's first token, and the index after
/// the closing brace.
fn braced_heads(tokens: &[Token], start: usize) -> (Vec<usize>, usize) {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut expect_head = false;
    let mut i = start;
    while let Some(token) = tokens.get(i) {
        match token.text.as_str() {
            "{" => {
                depth += 1;
                expect_head = depth == 1;
            }
            "}" => {
                depth -= 1;
                if depth == 0 {
                    return (heads, i + 1);
                }
            }
            "," if depth == 1 => expect_head = true,
            text if expect_head => {
                if is_ident(text) {
                    heads.push(i);
                }
                expect_head = false;
            }
            _ => {}
        }
        i += 1;
    }
    (heads, i)
}

/// `#[cfg(test)]` or `#![cfg(test)]` at `i`: the index after it.
fn cfg_test(tokens: &[Token], i: usize) -> Option<usize> {
    let texts = |from: usize, pattern: &[&str]| {
        pattern
            .iter()
            .enumerate()
            .all(|(k, p)| tokens.get(from + k).is_some_and(|t| t.text == *p))
    };
    const ATTR: [&str; 6] = ["[", "cfg", "(", "test", ")", "]"];
    if tokens[i].text != "#" {
        return None;
    }
    if texts(i + 1, &ATTR) {
        return Some(i + 1 + ATTR.len());
    }
    if texts(i + 1, &["!"]) && texts(i + 2, &ATTR) {
        return Some(i + 2 + ATTR.len());
    }
    None
}

/// The end (exclusive) of the item starting at `start`: its `;` or its closing `}`.
fn item_end(tokens: &[Token], start: usize) -> usize {
    let mut depth = 0usize;
    let mut i = start;
    while let Some(token) = tokens.get(i) {
        match token.text.as_str() {
            "(" | "[" => depth += 1,
            ")" | "]" => depth = depth.saturating_sub(1),
            ";" if depth == 0 => return i + 1,
            "{" if depth == 0 => {
                let mut braces = 0usize;
                while let Some(token) = tokens.get(i) {
                    match token.text.as_str() {
                        "{" => braces += 1,
                        "}" => {
                            braces -= 1;
                            if braces == 0 {
                                return i + 1;
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
                return i;
            }
            _ => {}
        }
        i += 1;
    }
    i
}

/// `[pub[(…)]] mod name;`: the name.
fn declared_module(item: &[Token]) -> Option<String> {
    let texts: Vec<&str> = item.iter().map(|t| t.text.as_str()).collect();
    let at = texts.iter().position(|t| *t == "mod")?;
    match texts[at..] {
        ["mod", name, ";"] if is_ident(name) => Some(name.to_string()),
        _ => None,
    }
}

fn next_is(tokens: &[Token], i: usize, text: &str) -> bool {
    tokens.get(i + 1).is_some_and(|t| t.text == text)
}

/// An identifier that can name a module (not `self`, a group's own path).
fn is_ident(text: &str) -> bool {
    text != "self" && text.starts_with(|c: char| c.is_alphabetic() || c == '_')
}

#[derive(Debug)]
struct Token {
    text: String,
    line: usize,
}

/// Identifiers (and numbers), `::`, and every other character on its own.
fn tokens(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Token {
                text: chars[start..i].iter().collect(),
                line,
            });
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push(Token {
                text: "::".into(),
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                text: c.to_string(),
                line,
            });
            i += 1;
        }
    }
    out
}

/// The text with comments, string and character literals replaced by spaces (lines kept).
fn blank(text: &str) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < chars.len() {
        let at = |k: usize| chars.get(k).copied();
        let end = if at(i) == Some('/') && at(i + 1) == Some('/') {
            let mut j = i;
            while j < chars.len() && chars[j] != '\n' {
                j += 1;
            }
            j
        } else if at(i) == Some('/') && at(i + 1) == Some('*') {
            let mut depth = 0;
            let mut j = i;
            while j < chars.len() {
                if at(j) == Some('/') && at(j + 1) == Some('*') {
                    depth += 1;
                    j += 2;
                } else if at(j) == Some('*') && at(j + 1) == Some('/') {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            j
        } else if at(i) == Some('"') {
            let mut j = i + 1;
            while j < chars.len() && chars[j] != '"' {
                j += if chars[j] == '\\' { 2 } else { 1 };
            }
            j + 1
        } else if at(i) == Some('r')
            && (i == 0
                || !ident(chars[i - 1])
                || (chars[i - 1] == 'b' && (i < 2 || !ident(chars[i - 2]))))
            && matches!(at(i + 1), Some('"' | '#'))
        {
            // A raw string: r"…", r#"…"#, br#"…"#.
            let mut hashes = 0;
            while at(i + 1 + hashes) == Some('#') {
                hashes += 1;
            }
            if at(i + 1 + hashes) == Some('"') {
                let mut j = i + 2 + hashes;
                loop {
                    if j >= chars.len() {
                        break j;
                    }
                    if chars[j] == '"' && (1..=hashes).all(|k| at(j + k) == Some('#')) {
                        break j + 1 + hashes;
                    }
                    j += 1;
                }
            } else {
                i
            }
        } else if at(i) == Some('\'') {
            // A character literal; a lifetime ('a, with no closing quote) stays.
            if at(i + 1) == Some('\\') {
                let mut j = i + 3;
                while j < chars.len() && chars[j] != '\'' {
                    j += 1;
                }
                j + 1
            } else if at(i + 2) == Some('\'') {
                i + 3
            } else {
                i
            }
        } else {
            i
        };
        if end > i {
            let end = end.min(chars.len());
            for c in &mut chars[i..end] {
                if *c != '\n' {
                    *c = ' ';
                }
            }
            i = end;
        } else {
            i += 1;
        }
    }
    chars.into_iter().collect()
}

/// The strongly connected components of more than one module (Tarjan), each sorted, in the
/// order of their first module.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Tarjan<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        found: Vec<Vec<String>>,
    }
    impl<'g> Tarjan<'g> {
        fn visit(&mut self, node: &'g str) {
            let n = self.index.len();
            self.index.insert(node, n);
            self.low.insert(node, n);
            self.stack.push(node);
            self.on_stack.insert(node);
            let graph = self.graph;
            for next in graph.get(node).into_iter().flat_map(|edges| edges.keys()) {
                let next = next.as_str();
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                loop {
                    let member = self.stack.pop().expect("on the stack");
                    self.on_stack.remove(member);
                    component.push(member.to_string());
                    if member == node {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut tarjan = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !tarjan.index.contains_key(node.as_str()) {
            tarjan.visit(node);
        }
    }
    let mut found = tarjan.found;
    found.sort();
    found
}

/// Every cycle with the edges inside it, one reference each; `crate_dir` names the crate.
fn report(crate_dir: &Path, graph: &Graph, cycles: &[Vec<String>]) -> String {
    let name = crate_dir.file_name().unwrap_or_default().to_string_lossy();
    let mut text = format!(
        "{} import cycle(s) between the modules of {name}/src; each group below reaches itself \
         through the others (test code not counted):\n",
        cycles.len()
    );
    for (n, component) in cycles.iter().enumerate() {
        let _ = writeln!(text, "\ncycle {}: {}", n + 1, component.join(", "));
        for from in component {
            for (to, (file, line)) in &graph[from] {
                if component.contains(to) {
                    let _ = writeln!(text, "  {from} -> {to} ({file}:{line})");
                }
            }
        }
    }
    text
}
