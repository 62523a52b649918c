//! No import cycles between the modules of any crate of the workspace: a
//! module's `crate::`, `super::` and `self::` paths (and paths through the
//! children it declares) name the modules it depends on, and that graph
//! must be acyclic. A submodule may use its ancestors' items (it is their
//! implementation), and an ancestor's private use of its submodules is no
//! edge either; but a parent that re-exports (`pub use child::…`) stands for
//! that child, so `a -> parent -(pub use)-> child -> a` is a cycle. The crate
//! root (a facade of re-exports) and test modules are left out.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: &[&str] =
    &["protocol/src", "keyspace/src", "gateway/src", "node/src", "node/engine/src", "netsim/src"];

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "bin") {
                files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `a/b/mod.rs` and `a/b.rs` are `a::b`; `lib.rs` is the root ("").
fn module_of(root: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(root).unwrap().with_extension("");
    let mut parts: Vec<String> =
        rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|l| l == "mod" || l == "lib") {
        parts.pop();
    }
    parts.join("::")
}

fn is_test_module(file: &Path) -> bool {
    let stem = file.file_stem().unwrap().to_string_lossy();
    stem == "tests" || stem.ends_with("_tests")
}

/// Source without comments and without `#[cfg(test)] mod … { … }` blocks.
fn code(src: &str) -> String {
    let mut out = String::new();
    let mut lines = src.lines().peekable();
    while let Some(l) = lines.next() {
        let t = l.trim_start();
        if t.starts_with("#[cfg(test)]") {
            // Skip the item that follows: to its closing brace at depth 0.
            let mut depth = 0i32;
            let mut opened = false;
            for l in lines.by_ref() {
                depth += l.matches('{').count() as i32 - l.matches('}').count() as i32;
                opened |= l.contains('{');
                if (opened && depth <= 0) || (!opened && l.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        let l = l.split("//").next().unwrap_or("");
        out.push_str(l);
        out.push('\n');
    }
    out
}

fn ident(b: &[u8], mut i: usize) -> (String, usize) {
    let s = i;
    while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
        i += 1;
    }
    (String::from_utf8_lossy(&b[s..i]).into_owned(), i)
}

/// Every path that starts at byte `i` (after a `prefix::`), with `{a, b::c}`
/// groups expanded.
fn paths_at(b: &[u8], i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix;
    let mut i = i;
    loop {
        if i < b.len() && b[i] == b'{' {
            i += 1;
            loop {
                while i < b.len() && (b[i] == b' ' || b[i] == b'\n' || b[i] == b',') {
                    i += 1;
                }
                if i >= b.len() || b[i] == b'}' {
                    return i + 1;
                }
                i = paths_at(b, i, path.clone(), out);
            }
        }
        let (id, j) = ident(b, i);
        if id.is_empty() {
            out.push(path);
            return j.max(i + 1);
        }
        path.push(id);
        i = j;
        if b[i..].starts_with(b"::") {
            i += 2;
        } else {
            out.push(path);
            return i;
        }
    }
}

fn deps(module: &str, src: &str, children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let b = src.as_bytes();
    let here: Vec<String> =
        if module.is_empty() { vec![] } else { module.split("::").map(String::from).collect() };
    let mut out = vec![];
    let mut i = 0;
    while i < b.len() {
        let boundary = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':');
        if !boundary {
            i += 1;
            continue;
        }
        let (id, j) = ident(b, i);
        if id.is_empty() || !b[j..].starts_with(b"::") {
            i = j.max(i + 1);
            continue;
        }
        let base = match id.as_str() {
            "crate" => Some(vec![]),
            "super" => Some(here[..here.len().saturating_sub(1)].to_vec()),
            "self" => Some(here.clone()),
            c if children.contains(c) => Some([here.clone(), vec![c.to_string()]].concat()),
            _ => None,
        };
        match base {
            Some(base) => {
                let start = if id == "crate" || id == "super" || id == "self" { j + 2 } else { i };
                i = paths_at(b, start, base, &mut out);
            }
            None => i = j,
        }
    }
    out
}

fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m.as_str()) {
                Some(1) => {
                    let at = stack.iter().position(|x| x == m).unwrap();
                    return Some([&stack[at..], &[m.clone()]].concat());
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if !state.contains_key(n.as_str()) {
            if let Some(c) = visit(n, graph, &mut state, &mut vec![]) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn no_module_depends_on_itself_through_others() {
    let ws = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut found = vec![];
    for krate in CRATES {
        let root = ws.join(krate);
        let mut fs = vec![];
        files(&root, &mut fs);
        fs.retain(|f| !is_test_module(f) && f.file_name().is_some_and(|n| n != "main.rs"));
        let modules: BTreeMap<String, String> =
            fs.iter().map(|f| (module_of(&root, f), std::fs::read_to_string(f).unwrap())).collect();
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (m, src) in &modules {
            if m.is_empty() {
                continue;
            }
            let src = code(src);
            let children: BTreeSet<String> = src
                .lines()
                .filter_map(|l| {
                    let l = l.trim().trim_start_matches("pub(crate) ").trim_start_matches("pub ");
                    l.strip_prefix("mod ").map(|r| r.trim_end_matches(';').trim().to_string())
                })
                .collect();
            // What this module re-exports from its own children.
            for l in src.lines() {
                let l = l.trim();
                if let Some(rest) = l.strip_prefix("pub use ") {
                    let (c, _) = ident(rest.as_bytes(), 0);
                    if children.contains(&c) {
                        graph.entry(m.clone()).or_default().insert(format!("{m}::{c}"));
                    }
                }
            }
            for p in deps(m, &src, &children) {
                // The longest prefix of the path that is a module.
                let target = (1..=p.len())
                    .rev()
                    .map(|k| p[..k].join("::"))
                    .find(|c| modules.contains_key(c));
                let related = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}::"));
                if let Some(t) = target.filter(|t| !related(t, m) && !related(m, t)) {
                    graph.entry(m.clone()).or_default().insert(t);
                }
            }
        }
        // Every cycle, one at a time: report it, cut its last edge.
        while let Some(c) = cycle(&graph) {
            found.push(format!("{krate}: {}", c.join(" -> ")));
            let (a, b) = (&c[c.len() - 2], &c[c.len() - 1]);
            graph.get_mut(a).unwrap().remove(b);
        }
    }
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}
