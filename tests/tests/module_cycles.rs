//! No module cycles in any crate of the workspace: within a crate, the modules that name each
//! other through `crate::` / `super::` / `self::` paths (in code, not comments) form an acyclic
//! graph. An edge is drawn between the two sibling modules under the paths' common parent (a
//! reference from `service::push` to `crate::service::pull::X` is the edge push -> pull; from
//! `report` to `crate::tensorboard::X` the edge report -> tensorboard); a module naming its own
//! ancestors or descendants draws none (that is Rust's nesting, not a cycle). Items under
//! `#[cfg(test)]` are left out: a unit-test module exercises its crate from the outside. That
//! holds for one kept in its own file too: `#[cfg(test)] mod tests;` in `model.rs` leaves out
//! `model/tests.rs` and every module under it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path inside one crate (`["service", "push"]`); the crate root is `[]`.
type ModPath = Vec<String>;

/// A crate's module graph: sibling edges, each with one place that draws it.
#[derive(Debug, Default)]
struct Graph {
    edges: BTreeMap<ModPath, BTreeMap<ModPath, String>>,
}

/// The members listed in the workspace's Cargo.toml.
fn members(root: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(root.join("Cargo.toml")).expect("the workspace Cargo.toml");
    let start = text.find("members = [").expect("a members list") + "members = [".len();
    let end = start + text[start..].find(']').expect("the members list's end");
    text[start..end]
        .split(',')
        .map(|s| s.trim().trim_matches('"'))
        .filter(|s| !s.is_empty())
        .map(|s| root.join(s))
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module a file under `src` holds; None for a crate root (`lib.rs`, `main.rs`, `bin/*`,
/// or a file that no module declares: a `[[bin]]` root such as `gpu-bench.rs`).
fn module_of(src: &Path, file: &Path) -> Option<ModPath> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let last = parts.pop()?;
    let stem = last.trim_end_matches(".rs");
    if parts.is_empty() && (stem == "lib" || stem == "main") {
        return None;
    }
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    if stem.contains('-') {
        return None;
    }
    Some(parts)
}

/// `text` without comments, string literals and char literals (each replaced by spaces, so
/// line numbers stay).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if b[i] == b'r' && (b[i..].starts_with(b"r\"") || b[i..].starts_with(b"r#")) {
            // a raw string: r"..." or r#"..."#
            let mut j = i + 1;
            let mut hashes = 0;
            while j < b.len() && b[j] == b'#' {
                hashes += 1;
                j += 1;
            }
            if j < b.len() && b[j] == b'"' {
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                let end = b[j + 1..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |p| j + 1 + p + close.len());
                for &c in &b[i..end] {
                    blank(&mut out, c);
                }
                i = end;
            } else {
                out.push(b[i]);
                i += 1;
            }
        } else if b[i] == b'"' {
            blank(&mut out, b[i]);
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                blank(&mut out, b[i]);
                i += 1;
            }
            if i < b.len() {
                out.push(b' ');
                i += 1;
            }
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            out.extend_from_slice(b"   ");
            i += 3;
        } else if b[i] == b'\'' && b.get(i + 1) == Some(&b'\\') {
            let end = b[(i + 3).min(b.len())..]
                .iter()
                .position(|&c| c == b'\'')
                .map_or(b.len(), |p| i + 4 + p);
            for &c in &b[i..end] {
                blank(&mut out, c);
            }
            i = end;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `code` with every item under `#[cfg(test)]` blanked (to its matching `}` or its `;`).
fn without_tests(code: &str) -> String {
    let mut b = code.as_bytes().to_vec();
    let mut from = 0;
    while let Some(p) = code[from..].find("#[cfg(test)]") {
        let start = from + p;
        let mut i = start;
        let mut depth = 0usize;
        while i < b.len() {
            match b[i] {
                b'{' => depth += 1,
                b'}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        break;
                    }
                }
                b';' if depth == 0 => break,
                _ => {}
            }
            i += 1;
        }
        let end = (i + 1).min(b.len());
        for c in &mut b[start..end] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
        from = end;
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// `s` past the bracketed group it opens with (`#[..]`, `(..)`), or `s` when it opens none.
fn past_group(s: &str, open: char, close: char) -> &str {
    let mut depth = 0usize;
    for (k, c) in s.char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth = depth.saturating_sub(1);
            if depth == 0 {
                return &s[k + 1..];
            }
        } else if depth == 0 {
            break;
        }
    }
    s
}

/// The modules that `code` (the code of module `at`, comments and strings blanked) declares
/// under `#[cfg(test)]` and keeps in their own files: `#[cfg(test)] mod tests;`, also with
/// other attributes or a visibility between, in `at` is the module `at::tests`.
fn test_file_modules(code: &str, at: &ModPath) -> Vec<ModPath> {
    let mut out = Vec::new();
    for (p, attr) in code.match_indices("#[cfg(test)]") {
        let mut rest = code[p + attr.len()..].trim_start();
        while rest.starts_with("#[") {
            rest = past_group(&rest[1..], '[', ']').trim_start();
        }
        if let Some(r) = rest.strip_prefix("pub") {
            rest = past_group(r.trim_start(), '(', ')').trim_start();
        }
        let Some(r) = rest.strip_prefix("mod") else {
            continue;
        };
        let r = r.trim_start();
        if let Some(name) = ident_at(r)
            && r[name.len()..].trim_start().starts_with(';')
        {
            let mut m = at.clone();
            m.push(name.to_string());
            out.push(m);
        }
    }
    out
}

fn ident_at(s: &str) -> Option<&str> {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    (end > 0).then(|| &s[..end])
}

/// The first segments of the paths that follow `prefix::` at byte `at` of `code`: one, or
/// each first-level entry of a `{...}` group.
fn first_segments(code: &str, at: usize) -> Vec<String> {
    let rest = code[at..].trim_start();
    if let Some(group) = rest.strip_prefix('{') {
        let mut depth = 0;
        let mut out = Vec::new();
        let mut start = true;
        for (k, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => start = true,
                c if start && !c.is_whitespace() => {
                    start = false;
                    if depth == 0
                        && let Some(id) = ident_at(&group[k..])
                    {
                        out.push(id.to_string());
                    }
                }
                _ => {}
            }
        }
        out
    } else {
        ident_at(rest)
            .map(|s| vec![s.to_string()])
            .unwrap_or_default()
    }
}

/// The module paths `code` (the code of module `at`) names, each with the line it is on.
fn references(code: &str, at: &ModPath) -> Vec<(ModPath, usize)> {
    let mut out = Vec::new();
    for (base_kw, base) in [
        ("crate::", Vec::new()),
        ("super::", at[..at.len().saturating_sub(1)].to_vec()),
        ("self::", at.clone()),
    ] {
        let mut from = 0;
        while let Some(p) = code[from..].find(base_kw) {
            let pos = from + p;
            from = pos + base_kw.len();
            let before = code[..pos].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let line = code[..pos].matches('\n').count() + 1;
            // `super::super::x`, `crate::a::b::c`: follow plain segments
            let mut path = base.clone();
            let mut rest = &code[from..];
            if base_kw == "super::" {
                while let Some(r) = rest.strip_prefix("super::") {
                    path.pop();
                    rest = r;
                }
            }
            let mut tail = Vec::new();
            while let Some(id) = ident_at(rest) {
                let after = &rest[id.len()..];
                if let Some(r) = after.strip_prefix("::") {
                    tail.push(id.to_string());
                    rest = r;
                } else {
                    tail.push(id.to_string());
                    break;
                }
            }
            if tail.is_empty() {
                let off = code.len() - rest.len();
                for seg in first_segments(code, off) {
                    let mut p = path.clone();
                    p.push(seg);
                    out.push((p, line));
                }
            } else {
                let mut p = path.clone();
                p.extend(tail);
                out.push((p, line));
            }
        }
    }
    out
}

/// The module graph of the crate whose sources are under `src`.
fn graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let code: BTreeMap<&PathBuf, String> = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).expect("a source file");
            (f, code_only(&text))
        })
        .collect();
    // a crate root (`lib.rs`, `main.rs`, a `[[bin]]` root beside them) declares the modules
    // at the top of `src`
    let declared_in = |f: &Path| match module_of(src, f) {
        Some(m) => Some(m),
        None => (f.parent() == Some(src)).then(Vec::new),
    };
    let test_modules: Vec<ModPath> = files
        .iter()
        .filter_map(|f| declared_in(f).map(|m| test_file_modules(&code[f], &m)))
        .flatten()
        .collect();
    let modules: BTreeMap<ModPath, PathBuf> = files
        .iter()
        .filter_map(|f| module_of(src, f).map(|m| (m, f.clone())))
        .filter(|(m, _)| !test_modules.iter().any(|t| m.starts_with(t)))
        .collect();
    let mut g = Graph::default();
    for (m, file) in &modules {
        let code = without_tests(&code[file]);
        for (target, line) in references(&code, m) {
            let common = m.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common >= m.len() || common >= target.len() {
                continue; // an ancestor or a descendant
            }
            let from: ModPath = m[..=common].to_vec();
            let to: ModPath = target[..=common].to_vec();
            if from != to && modules.contains_key(&to) {
                g.edges
                    .entry(from)
                    .or_default()
                    .entry(to)
                    .or_insert_with(|| format!("{}:{line}", file.display()));
            }
        }
    }
    g
}

/// The cycles of `g`: each strongly connected component of more than one module, with the
/// places that draw its edges.
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&ModPath> = g
        .edges
        .iter()
        .flat_map(|(a, bs)| std::iter::once(a).chain(bs.keys()))
        .collect();
    let reach = |from: &ModPath| -> BTreeSet<ModPath> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(n) = stack.pop() {
            for next in g.edges.get(&n).into_iter().flat_map(|m| m.keys()) {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&ModPath, BTreeSet<ModPath>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for n in &nodes {
        if done.contains(*n) || !reaches[n].contains(*n) {
            continue;
        }
        let scc: Vec<&ModPath> = nodes
            .iter()
            .filter(|m| reaches[n].contains(**m) && reaches[*m].contains(*n))
            .copied()
            .collect();
        let mut lines = Vec::new();
        for a in &scc {
            done.insert((*a).clone());
            for (b, at) in g.edges.get(*a).into_iter().flatten() {
                if scc.contains(&b) {
                    lines.push(format!("{} -> {} ({at})", a.join("::"), b.join("::")));
                }
            }
        }
        out.push(lines);
    }
    out
}

/// Writes `text` to `path` under a fixture's `src`, with the folders it needs.
fn write_source(src: &Path, path: &str, text: &str) {
    let p = src.join(path);
    std::fs::create_dir_all(p.parent().expect("a file in a folder")).unwrap();
    std::fs::write(p, text).unwrap();
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

#[test]
fn no_module_cycles_in_any_crate() {
    let root = workspace_root();
    let mut found = Vec::new();
    let mut crates = 0;
    for m in members(&root) {
        let src = m.join("src");
        assert!(src.is_dir(), "{} has no src/", m.display());
        crates += 1;
        for c in cycles(&graph(&src)) {
            found.push(format!("{}:\n  {}", m.display(), c.join("\n  ")));
        }
    }
    assert!(crates >= 15, "only {crates} workspace members read");
    assert!(found.is_empty(), "module cycles:\n{}", found.join("\n"));
}

/// The check finds a cycle drawn through a grouped `use crate::{..}`, a `super::` path and a
/// nested module, ignores the same names in comments and strings, and a child naming its
/// parent.
#[test]
fn the_check_finds_cycles_and_ignores_comments() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let write = |p: &str, s: &str| write_source(src, p, s);
    write("lib.rs", "pub mod a; pub mod b; pub mod c; pub mod svc;");
    write("a.rs", "use crate::{b::B, c};\npub struct A;");
    write(
        "b.rs",
        "// crate::c::C in a comment\npub fn f() { let _ = \"crate::c\"; }\npub struct B(super::a::A);",
    );
    write(
        "c.rs",
        "/// [`crate::a::A`]\npub struct C;\nfn g() -> crate::svc::S { todo!() }\n#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}",
    );
    write("svc.rs", "pub mod x; pub mod y; pub struct S;");
    write("svc/x.rs", "use super::y::Y; use crate::svc::S;");
    write("svc/y.rs", "pub struct Y(crate::svc::x::X);");
    let found = cycles(&graph(src));
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(
        found[0],
        vec![
            format!("a -> b ({}:1)", src.join("a.rs").display()),
            format!("b -> a ({}:3)", src.join("b.rs").display()),
        ]
    );
    assert_eq!(
        found[1],
        vec![
            format!("svc::x -> svc::y ({}:1)", src.join("svc/x.rs").display()),
            format!("svc::y -> svc::x ({}:1)", src.join("svc/y.rs").display()),
        ]
    );
    // without b's reference to a there is none
    write("b.rs", "pub struct B;");
    write("svc/y.rs", "pub struct Y;");
    assert!(cycles(&graph(src)).is_empty());
}

/// A test module kept in its own file (`#[cfg(test)] mod tests;` in `model.rs`, its body in
/// `model/tests.rs`) is left out with everything under it: `cpu` uses `model`, and
/// `model/tests.rs` (and `model/tests/helpers.rs` under it) using `cpu` is no cycle; nor with
/// an attribute and a visibility between, nor in the crate root.
#[test]
fn a_test_module_in_its_own_file_draws_no_edge() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let write = |p: &str, s: &str| write_source(src, p, s);
    write(
        "lib.rs",
        "pub mod cpu; pub mod model;\n#[cfg(test)]\nmod tests;",
    );
    write("cpu.rs", "use crate::model::Model;\npub struct Cpu(Model);");
    write(
        "model.rs",
        "pub struct Model;\n#[cfg(test)]\n#[allow(clippy::unwrap_used)]\npub(crate) mod tests;",
    );
    write("model/tests.rs", "use crate::cpu::Cpu;\nmod helpers;");
    write("model/tests/helpers.rs", "pub fn h(_: crate::cpu::Cpu) {}");
    write("tests.rs", "use crate::{cpu::Cpu, model::Model};");
    let g = graph(src);
    assert_eq!(
        g.edges.keys().collect::<Vec<_>>(),
        vec![&vec!["cpu".to_string()]],
        "{g:?}"
    );
    assert!(cycles(&g).is_empty(), "{:?}", cycles(&g));
}

/// The same two modules with a real cycle: `model` naming `cpu` in its own code, and in a file
/// module that is not under `#[cfg(test)]` (`mod real;`); each is found, with its place.
#[test]
fn a_real_cycle_beside_a_test_file_module_is_still_found() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let write = |p: &str, s: &str| write_source(src, p, s);
    write("lib.rs", "pub mod cpu; pub mod model;");
    write("cpu.rs", "use crate::model::Model;\npub struct Cpu(Model);");
    write("model/tests.rs", "use crate::cpu::Cpu;");
    write(
        "model.rs",
        "pub struct Model;\npub fn f(_: crate::cpu::Cpu) {}\n#[cfg(test)]\nmod tests;",
    );
    let expect = |model_line: String| {
        vec![vec![
            format!("cpu -> model ({}:1)", src.join("cpu.rs").display()),
            format!("model -> cpu ({model_line})"),
        ]]
    };
    assert_eq!(
        cycles(&graph(src)),
        expect(format!("{}:2", src.join("model.rs").display()))
    );
    // the reference moved into a file module that is no test module
    write("model/real.rs", "use crate::cpu::Cpu;");
    write(
        "model.rs",
        "pub struct Model;\nmod real;\n#[cfg(test)]\nmod tests;",
    );
    assert_eq!(
        cycles(&graph(src)),
        expect(format!("{}:1", src.join("model/real.rs").display()))
    );
}
