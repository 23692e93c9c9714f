//! The workspace's crates as layers: no crate's modules import each other in a circle,
//! and no file of the gateway crate outgrows one job.
//!
//! Reads every `crates/*/src` file with `syn` and draws an arrow from a module to each
//! module of the same crate it names (`use crate::a::b`, `super::x`, a path such as
//! `crate::a::f()` in the code, a child module's name in a `use`), skipping code under
//! `#[cfg(test)]`. A module and its own submodules are one unit (a parent declares its
//! children, and they may use what it defines), so arrows between them do not count.
//! Circles are looked for between files and between top-level modules (a folder
//! folded into one node), so a folder cannot hold two layers with a third between.
//! Paths inside macro invocations are not seen.
//!
//! Run alone: `cargo test -p kvgate --test module_layers`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// Longest file of the gateway crate, its test module aside.
const GATEWAY_MAX_LINES: usize = 600;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

/// A crate's modules: module path (`a::b`; `""` for the crate root) → file.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path
                .strip_prefix(src)
                .expect("under src")
                .with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
                parts.clear();
            }
            if parts.first().is_some_and(|p| p == "bin") {
                continue; // binaries are crates of their own
            }
            out.insert(parts.join("::"), path);
        }
    }
    out
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

/// Every path a file names, as segments, test code aside.
#[derive(Default)]
struct Paths(Vec<Vec<String>>);

impl Paths {
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let mut full = prefix.clone();
                if n.ident != "self" {
                    full.push(n.ident.to_string());
                }
                self.0.push(full);
            }
            syn::UseTree::Rename(r) => {
                let mut full = prefix.clone();
                if r.ident != "self" {
                    full.push(r.ident.to_string());
                }
                self.0.push(full);
            }
            syn::UseTree::Glob(_) => self.0.push(prefix.clone()),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Use(u) => &u.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Struct(s) => &s.attrs,
            syn::Item::Enum(e) => &e.attrs,
            syn::Item::Const(c) => &c.attrs,
            syn::Item::Static(s) => &s.attrs,
            syn::Item::Trait(t) => &t.attrs,
            _ => return syn::visit::visit_item(self, item),
        };
        if !is_cfg_test(attrs) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &u.tree);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.0
            .push(p.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, p);
    }
}

/// Whether `a` is `b` or inside it (module paths).
fn within(a: &str, b: &str) -> bool {
    b.is_empty() || a == b || a.starts_with(&format!("{b}::"))
}

/// The module of this crate a path from module `from` names, if any.
fn resolve(from: &str, segments: &[String], mods: &BTreeMap<String, PathBuf>) -> Option<String> {
    let mut base: Vec<&str> = if from.is_empty() {
        Vec::new()
    } else {
        from.split("::").collect()
    };
    let mut rest = segments;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        Some("self") => rest = &rest[1..],
        Some(first) => {
            // A child module named without `self::` (edition 2018 paths).
            let child = [base.as_slice(), &[first]].concat().join("::");
            if !mods.contains_key(&child) {
                return None;
            }
        }
        None => return None,
    }
    let mut best = None;
    let mut path: Vec<&str> = base;
    for s in rest {
        path.push(s);
        let m = path.join("::");
        if mods.contains_key(&m) {
            best = Some(m);
        }
    }
    best
}

/// Module → modules it imports (same crate; itself, its ancestors and descendants aside).
fn import_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules(src);
    let mut graph = BTreeMap::new();
    for (m, file) in &mods {
        let text = std::fs::read_to_string(file).expect("read source");
        let ast = syn::parse_file(&text)
            .unwrap_or_else(|e| panic!("{}: cannot parse: {e}", file.display()));
        let mut paths = Paths::default();
        paths.visit_file(&ast);
        let targets: BTreeSet<String> = paths
            .0
            .iter()
            .filter_map(|p| resolve(m, p, &mods))
            .filter(|t| !within(t, m) && !within(m, t))
            .collect();
        graph.insert(m.clone(), targets);
    }
    graph
}

/// The circles (strongly connected components of more than one module).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let reach = |from: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(m) = todo.pop() {
            for t in graph.get(&m).into_iter().flatten() {
                if seen.insert(t.clone()) {
                    todo.push(t.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<BTreeSet<String>> = Vec::new();
    for (m, r) in &reaches {
        if !r.contains(*m) || out.iter().any(|c| c.contains(*m)) {
            continue;
        }
        let circle: BTreeSet<String> = r
            .iter()
            .filter(|t| reaches.get(t).is_some_and(|back| back.contains(*m)))
            .cloned()
            .collect();
        out.push(circle);
    }
    out
}

/// The graph with every module folded into its top-level module (a folder such as
/// `peers/` is one node): the layers a reader sees in the file tree.
fn top_level(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeMap<String, BTreeSet<String>> {
    let top = |m: &str| m.split("::").next().unwrap_or_default().to_owned();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, targets) in graph {
        let from = top(m);
        let entry = out.entry(from.clone()).or_default();
        entry.extend(targets.iter().map(|t| top(t)).filter(|t| *t != from));
    }
    out
}

#[test]
fn no_crate_imports_its_own_modules_in_a_circle() {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(workspace().join("crates")).expect("crates dir") {
        let src = entry.expect("dir entry").path().join("src");
        if !src.join("lib.rs").exists() && !src.join("main.rs").exists() {
            continue;
        }
        let files = import_graph(&src);
        // Between files, and between top-level modules (folders folded).
        for graph in [top_level(&files), files] {
            for circle in circles(&graph) {
                let arrows: Vec<String> = circle
                    .iter()
                    .flat_map(|m| {
                        graph[m]
                            .iter()
                            .filter(|t| circle.contains(*t))
                            .map(move |t| format!("{m} -> {t}"))
                    })
                    .collect();
                found.push(format!("{}: {}", src.display(), arrows.join(", ")));
            }
        }
    }
    assert!(
        found.is_empty(),
        "modules that import each other in a circle (a lower layer must not import a higher one):\n{}",
        found.join("\n")
    );
}

/// The checker itself sees a circle, through `crate::`, `super::` and grouped imports,
/// and not one between a module and its own submodule.
#[test]
fn the_checker_sees_a_circle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path();
    std::fs::create_dir_all(src.join("p")).expect("mkdir");
    for (file, text) in [
        ("lib.rs", "mod a; mod b; mod p;"),
        ("a.rs", "use crate::{b::{B}, p};"),
        ("b.rs", "fn f() { crate::a::g(); }"),
        ("p/mod.rs", "mod q; use q::Q; pub struct P;"),
        ("p/q.rs", "use super::P; pub struct Q;"),
    ] {
        std::fs::write(src.join(file), text).expect("write");
    }
    let graph = import_graph(src);
    assert_eq!(graph["a"], BTreeSet::from(["b".into(), "p".into()]));
    assert_eq!(graph["b"], BTreeSet::from(["a".to_owned()]));
    assert!(graph["p"].is_empty() && graph["p::q"].is_empty());
    assert_eq!(
        circles(&graph),
        vec![BTreeSet::from(["a".to_owned(), "b".into()])]
    );
}

#[test]
fn no_gateway_file_is_over_its_length() {
    let src = workspace().join("crates/kvgate-gateway/src");
    let mut long = Vec::new();
    for (m, file) in modules(&src) {
        let text = std::fs::read_to_string(&file).expect("read source");
        let lines: Vec<&str> = text.lines().collect();
        // The unit tests at the end of a file do not count.
        let end = lines
            .windows(2)
            .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].starts_with("mod tests"))
            .unwrap_or(lines.len());
        if end > GATEWAY_MAX_LINES {
            long.push(format!("{m} ({}): {end} lines", file.display()));
        }
    }
    assert!(
        long.is_empty(),
        "gateway files over {GATEWAY_MAX_LINES} lines (split by job):\n{}",
        long.join("\n")
    );
}
