//! The documents say what is true and print what runs. PERFORMANCE.md is a dated benchmark
//! record (each figure's table with its date, code, command and load; the older records under
//! `bench/results/`, dated and linked), and the README's figures taken from a record or one
//! long run say so where they stand; the README's figures that a command re-measures are
//! checked by that command (`scripts/deploy-checks.sh`, check 6) or asserted by a test. In the
//! six documents (README.md, python/README.md, ps-common/ARCHITECTURE.md,
//! ps-common/config/README.md, deploy/README.md, bench/PERFORMANCE.md) every path and link
//! (with its anchor) exists, every flag given to a binary is in its `--help` and every flag
//! given to a Python script is one it declares, `cargo -p`/`--test` name real targets, every
//! Rust path names a real module, the README's test command is `.ci/run`'s, and the Python
//! recipe's config loads.
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn read(name: &str) -> String {
    let p = repo().join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Single spaces: the documents wrap their lines anywhere.
fn flat(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The sections of PERFORMANCE.md that hold no measured figure of their own.
const NO_FIGURES: &[&str] = &[
    "How to reproduce",
    "Machine and load",
    "Not measured",
    "Records",
];

#[test]
fn performance_figures_are_labelled_as_a_dated_benchmark_record() {
    let text = read("bench/PERFORMANCE.md");
    let head = &text[..text.find("\n## ").expect("a section")];
    assert!(
        flat(head).contains(
            "A benchmark record, not a standing claim: no test checks any figure in this file."
        ),
        "PERFORMANCE.md opens with the label:\n{head}"
    );
    // the table of records in the label: section | measured | code | command | load
    let rows: Vec<Vec<String>> = head
        .lines()
        .filter_map(|l| l.strip_prefix("> |"))
        .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
        .filter(|c: &Vec<String>| c.len() >= 5 && c[0] != "section" && !c[0].starts_with("---"))
        .collect();
    assert!(!rows.is_empty(), "no table of records:\n{head}");
    let is_date = |s: &str| {
        let b = s.as_bytes();
        s.len() >= 10 && b[4] == b'-' && b[7] == b'-' && s[..4].parse::<u32>().is_ok()
    };
    let has_commit = |s: &str| {
        s.split('`')
            .skip(1)
            .step_by(2)
            .any(|c| (7..=40).contains(&c.len()) && c.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    for r in &rows {
        assert!(is_date(&r[1]), "a date in {r:?}");
        assert!(has_commit(&r[2]), "a commit in {r:?}");
        assert!(
            !r[3].is_empty() && !r[4].is_empty(),
            "a command and a load in {r:?}"
        );
    }
    // every section with figures has a row: its heading starts with a name the row lists
    let names: Vec<&str> = rows
        .iter()
        .flat_map(|r| r[0].split([',', ';']).map(str::trim))
        .collect();
    for heading in text.lines().filter_map(|l| l.strip_prefix("## ")) {
        if NO_FIGURES.iter().any(|n| heading.starts_with(n)) {
            continue;
        }
        assert!(
            names
                .iter()
                .any(|n| !n.is_empty() && heading.starts_with(n)),
            "PERFORMANCE.md section {heading:?} has no row (date, code, command, load) in the label's table: {names:?}"
        );
    }
    // the records: every file under bench/results/ that is a document carries its date in its
    // name and is linked from PERFORMANCE.md, and each link leads to one
    let results = repo().join("bench/results");
    let mut records = 0;
    for entry in std::fs::read_dir(&results).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.ends_with(".md") {
            continue;
        }
        records += 1;
        assert!(
            name.split('-').collect::<Vec<_>>().windows(3).any(|w| {
                w[0].len() == 4
                    && w[0].parse::<u32>().is_ok()
                    && w[1].len() == 2
                    && w[2].get(..2).is_some_and(|d| d.parse::<u32>().is_ok())
            }),
            "bench/results/{name}: no date (YYYY-MM-DD) in the name"
        );
        assert!(
            text.contains(&format!("(results/{name})")),
            "bench/results/{name} is not linked from PERFORMANCE.md's records"
        );
    }
    assert!(records >= 10, "{records} records under bench/results/");
}

/// The README's figures that come from a benchmark record or one long run, which no test
/// re-measures, say so in the sentence that gives them.
#[test]
fn the_readmes_unchecked_figures_say_they_are_records() {
    let readme = flat(&read("README.md"));
    for (figure, label) in [
        (
            "final test accuracy **88.32%**",
            "not re-measured by any test",
        ),
        ("the timings (`17.0 s`, `4.5 ms`)", "are not checked"),
        (
            "steps in 37–41 ms",
            "a dated benchmark record that no test checks",
        ),
    ] {
        let at = readme
            .find(figure)
            .unwrap_or_else(|| panic!("README.md no longer says {figure:?}: update this test"));
        // the label stands within the figure's paragraph, at most 400 characters before it
        let from = readme[..at]
            .char_indices()
            .rev()
            .nth(400)
            .map_or(0, |(i, _)| i);
        let window = &readme[from..(at + figure.len() + 200).min(readme.len())];
        assert!(
            window.contains(label),
            "README.md gives {figure:?} without saying it is {label:?}:\n{window}"
        );
    }
}

/// The documents whose commands and paths are checked below.
const DOCUMENTS: &[&str] = &[
    "README.md",
    "python/README.md",
    "ps-common/ARCHITECTURE.md",
    "ps-common/config/README.md",
    "deploy/README.md",
    "bench/PERFORMANCE.md",
];

/// The first names of the repository's own paths (a code span starting with one of these is
/// a path in the repository, from its root).
const TOP: &[&str] = &[
    "README.md",
    "Cargo.toml",
    ".ci/",
    "bench/",
    "data/",
    "deploy/",
    "proto/",
    "ps-common/",
    "ps-server/",
    "ps-worker/",
    "python/",
    "scripts/",
    "tests/",
];

/// Paths a document names that are not in this checkout, each with why.
const NOT_HERE: &[(&str, &str)] = &[];

/// The code of a document: the lines of its fenced blocks and its inline code spans.
fn code_of(text: &str) -> Vec<String> {
    let mut code = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            code.push(line.trim_start_matches("$ ").to_string());
        } else {
            code.extend(line.split('`').skip(1).step_by(2).map(str::to_string));
        }
    }
    // spans wrapped over two lines: also join the prose and take its spans
    code.extend(
        flat(&text.replace("```", "\n"))
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string),
    );
    code
}

/// The markdown links of a document that point into the repository: (path, anchor); an
/// empty path is the document itself.
fn links_of(text: &str) -> Vec<(String, Option<String>)> {
    text.split("](")
        .skip(1)
        .filter_map(|s| s.split(')').next())
        .filter(|l| !l.starts_with("http"))
        .map(|l| match l.split_once('#') {
            Some((path, anchor)) => (path.to_string(), Some(anchor.to_string())),
            None => (l.to_string(), None),
        })
        .collect()
}

/// The anchors GitHub gives a markdown document's headings: lower case, punctuation dropped,
/// spaces as hyphens.
fn anchors_of(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            l.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect()
}

/// Every path a document names (in a code span or block, from the repository's root, or as a
/// link, from the document's folder) exists.
#[test]
fn the_documents_name_only_paths_that_exist() {
    let mut missing = Vec::new();
    for doc in DOCUMENTS {
        let text = read(doc);
        let dir = repo().join(doc).parent().unwrap().to_path_buf();
        for (link, anchor) in links_of(&text) {
            let target = if link.is_empty() {
                repo().join(doc)
            } else {
                dir.join(&link)
            };
            if !target.exists() {
                missing.push(format!("{doc}: link {link}"));
            } else if let Some(anchor) = anchor {
                let heads = anchors_of(&std::fs::read_to_string(&target).unwrap_or_default());
                if !heads.contains(&anchor) {
                    missing.push(format!("{doc}: link {link}#{anchor}: no such heading"));
                }
            }
        }
        for code in code_of(&text) {
            for word in code.split_whitespace() {
                let word = word.trim_matches(|c: char| "\"',;:()[]".contains(c));
                let path = word.trim_end_matches('.');
                let is_path = TOP.iter().any(|t| path.starts_with(t))
                    && !path.contains(['*', '<', '{', '$', '…', '='])
                    && !path.contains("...")
                    && !path.contains("/../");
                if is_path
                    && !repo().join(path).exists()
                    && !NOT_HERE.iter().any(|(p, _)| *p == path)
                {
                    missing.push(format!("{doc}: {path}"));
                }
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "paths the documents name that do not exist:\n{}",
        missing.join("\n")
    );
    // what the pending path stands for is real
    for (_, why) in NOT_HERE {
        assert!(why.contains("python/README.md"), "{why}");
    }
}

/// The long flags `bin --help` lists.
fn help_flags(bin: &str) -> Vec<String> {
    let exe = ps_launch::bin_dir().join(bin);
    let out = std::process::Command::new(&exe)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (cargo build --release --bins)", exe.display()));
    assert!(out.status.success(), "{bin} --help: {:?}", out.status);
    let flags: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect();
    assert!(flags.iter().any(|f| f == "--help"), "{bin}: {flags:?}");
    flags
}

/// The commands of a piece of code: for each program word (its last path component), the
/// `--flags` after it up to the end of the command (`&&`, `|`, `;`, `&`, a comment).
fn commands_in(code: &str) -> Vec<(String, Vec<String>)> {
    let mut commands: Vec<(String, Vec<String>)> = Vec::new();
    let mut open = false;
    for word in code.split_whitespace() {
        if ["&&", "||", "|", ";", "&", "#"].contains(&word) || word.starts_with('#') {
            open = false;
            continue;
        }
        let name = word.rsplit('/').next().unwrap_or(word);
        let after_value_flag = open
            && commands
                .last()
                .and_then(|c| c.1.last())
                .is_some_and(|f| f == "-p" || f == "--test");
        if after_value_flag {
            // the value of -p / --test, checked below
            let value =
                word.trim_matches(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'));
            commands.last_mut().unwrap().1.push(format!("={value}"));
        } else if name.starts_with("ps-") || name.ends_with(".py") || word == "cargo" {
            commands.push((word.to_string(), Vec::new()));
            open = true;
        } else if open && (word.starts_with("--") || word == "-p") {
            let flag = word.split('=').next().unwrap_or(word);
            let flag = flag.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
            commands.last_mut().unwrap().1.push(flag.to_string());
        }
    }
    commands
}

/// The workspace's packages: (name, folder).
fn packages() -> Vec<(String, PathBuf)> {
    let mut names = Vec::new();
    let mut dirs = vec![repo()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let n = e.file_name().to_string_lossy().to_string();
            if p.is_dir()
                && !n.starts_with('.')
                && !["target", "data", "runs"].contains(&n.as_str())
            {
                dirs.push(p);
            } else if n == "Cargo.toml" {
                let text = std::fs::read_to_string(&p).unwrap();
                let package = text.split("[package]").nth(1);
                let name = package.and_then(|p| p.lines().find(|l| l.starts_with("name = ")));
                if let Some(line) = name {
                    names.push((
                        line.trim_start_matches("name = ")
                            .trim_matches('"')
                            .to_string(),
                        d.clone(),
                    ));
                }
            }
        }
    }
    names
}

/// Every command the documents print runs as printed as far as its words go: the flags given
/// to `ps-server`, `ps-worker`, `ps-launch` and `ps-plan` are in that binary's `--help`; those
/// given to a Python script are among its `add_argument`s; `cargo -p P` names a workspace
/// package and `--test T` a test target.
#[test]
fn the_documents_commands_use_flags_their_programs_have() {
    let bins = ["ps-server", "ps-worker", "ps-launch", "ps-plan", "ps-bench"];
    let helps: Vec<(&str, Vec<String>)> = bins.iter().map(|b| (*b, help_flags(b))).collect();
    let packages = packages();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for doc in DOCUMENTS {
        let text = read(doc);
        let dir = repo().join(doc).parent().unwrap().to_path_buf();
        for code in code_of(&text) {
            for (program, flags) in commands_in(&code) {
                let name = program.rsplit('/').next().unwrap();
                if let Some((_, known)) = helps.iter().find(|(b, _)| *b == name) {
                    for f in flags.iter().filter(|f| f.starts_with("--")) {
                        checked += 1;
                        if !known.contains(f) {
                            wrong.push(format!("{doc}: {name} has no {f} (in `{code}`)"));
                        }
                    }
                } else if name.ends_with(".py") {
                    let script = [repo().join(&program), dir.join(&program)]
                        .into_iter()
                        .find(|p| p.exists());
                    let Some(script) = script else {
                        wrong.push(format!("{doc}: no script {program} (in `{code}`)"));
                        continue;
                    };
                    let source = std::fs::read_to_string(script).unwrap();
                    for f in flags.iter().filter(|f| f.starts_with("--")) {
                        checked += 1;
                        if !source.contains(&format!("\"{f}\"")) {
                            wrong.push(format!("{doc}: {program} has no {f} (in `{code}`)"));
                        }
                    }
                } else if program == "cargo" {
                    for pair in flags.windows(2) {
                        let value = pair[1].trim_start_matches('=');
                        if pair[0] == "-p" && pair[1].starts_with('=') {
                            checked += 1;
                            if !packages.iter().any(|(p, _)| p == value) {
                                wrong.push(format!("{doc}: no package {value} (in `{code}`)"));
                            }
                        }
                        if pair[0] == "--test" && pair[1].starts_with('=') {
                            checked += 1;
                            // a test target is `tests/NAME.rs` or `tests/NAME/main.rs`
                            let here = ["tests/tests", "ps-worker/tests"].iter().any(|d| {
                                repo().join(format!("{d}/{value}.rs")).exists()
                                    || repo().join(format!("{d}/{value}/main.rs")).exists()
                            });
                            if !here {
                                wrong.push(format!("{doc}: no test {value} (in `{code}`)"));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    println!("{checked} flags, packages and test targets checked");
    assert!(
        checked > 50,
        "only {checked} flags found: is the extraction still working?"
    );
}

/// The README's test command is what CI runs (`.ci/run`), word for word.
#[test]
fn the_readmes_test_command_is_what_ci_runs() {
    let ci = read(".ci/run");
    let command = ci
        .lines()
        .find(|l| l.starts_with("cargo test"))
        .expect(".ci/run runs cargo test");
    let readme = read("README.md");
    let block = &readme[readme.find("## The two commands").expect("the section")..];
    let block = &block[..block.find("\n## ").unwrap_or(block.len())];
    assert!(
        block.lines().any(|l| l == command),
        "README.md's test command differs from .ci/run's `{command}`"
    );
}

/// python/README.md's recipe config (its ```toml block, python/examples/run.toml) loads with
/// the config parser as that file, with an init file of the example's model, and equals the
/// file where the file is in the checkout.
#[test]
fn the_python_recipes_config_loads_with_its_init_file() {
    let readme = read("python/README.md");
    let at = readme
        .find("`python/examples/run.toml`")
        .expect("python/README.md names python/examples/run.toml");
    let block = &readme[at..];
    let start = block.find("```toml\n").expect("the config's block") + "```toml\n".len();
    let block = &block[start..];
    let block = &block[..block.find("```").unwrap()];
    if let Ok(file) = std::fs::read_to_string(repo().join("python/examples/run.toml")) {
        assert_eq!(
            file, block,
            "python/examples/run.toml and python/README.md's block"
        );
    }
    // the same relative paths from a temporary python/examples/, with the repository's data
    let tmp = tempfile::tempdir().unwrap();
    let examples = tmp.path().join("python/examples");
    std::fs::create_dir_all(&examples).unwrap();
    std::os::unix::fs::symlink(repo().join("data"), tmp.path().join("data")).unwrap();
    // the example's SmallCNN (python/examples/train_cnn.py), as ps.save_init writes it
    let tensors: &[(&str, &[usize])] = &[
        ("conv1.weight", &[8, 1, 3, 3]),
        ("conv1.bias", &[8]),
        ("conv2.weight", &[16, 8, 3, 3]),
        ("conv2.bias", &[16]),
        ("fc1.weight", &[48, 400]),
        ("fc1.bias", &[48]),
        ("fc2.weight", &[10, 48]),
        ("fc2.bias", &[10]),
    ];
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, shape) in tensors {
        let bytes = 4 * shape.iter().product::<usize>();
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let order: Vec<&str> = tensors.iter().map(|(n, _)| *n).collect();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({"parameter_order": serde_json::to_string(&order).unwrap()}),
    );
    let mut head = serde_json::to_vec(&header).unwrap();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut file = (head.len() as u64).to_le_bytes().to_vec();
    file.extend(head);
    file.resize(file.len() + offset, 0);
    let init = examples.join("init.safetensors");
    assert!(block.contains("init = \"init.safetensors\""), "{block}");
    std::fs::write(&init, file).unwrap();
    let path = examples.join("run.toml");
    std::fs::write(&path, block).unwrap();
    let cfg = ps_config::Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((cfg.num_shards(), cfg.cluster.workers), (2, 2));
    assert_eq!(cfg.train.global_batch, 64);
    let said = cfg.equivalence().to_string();
    assert!(
        said.starts_with("equivalent to one process with batch 64, mean loss, "),
        "{said}"
    );
    assert!(readme.contains("`equivalent to one process with batch 64,"));
}

/// Every Rust path the documents name (`ps_net::throttle`, `ps_shard::bucket::Mode`) is there:
/// the crate is a workspace package, each module a file or folder of its `src/`, and an item
/// (a capitalised last segment) is declared in that module.
#[test]
fn the_documents_rust_paths_exist() {
    let packages = packages();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for doc in DOCUMENTS {
        for code in code_of(&read(doc)) {
            for word in code.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')) {
                let segments: Vec<&str> = word.split("::").filter(|s| !s.is_empty()).collect();
                if segments.len() < 2 || !segments[0].starts_with("ps_") {
                    continue;
                }
                checked += 1;
                let crate_name = segments[0].replace('_', "-");
                let Some((_, dir)) = packages.iter().find(|(n, _)| *n == crate_name) else {
                    wrong.push(format!("{doc}: {word}: no package {crate_name}"));
                    continue;
                };
                let mut module = dir.join("src");
                let mut file = module.join("lib.rs");
                for seg in &segments[1..] {
                    if seg.starts_with(|c: char| c.is_uppercase()) {
                        let text = std::fs::read_to_string(&file).unwrap_or_default();
                        let declared = ["struct", "enum", "trait", "type", "const", "fn"]
                            .iter()
                            .any(|k| text.contains(&format!("{k} {seg}")));
                        if !declared {
                            wrong.push(format!("{doc}: {word}: {seg} not in {}", file.display()));
                        }
                        break;
                    }
                    let as_file = module.join(format!("{seg}.rs"));
                    let as_dir = module.join(seg);
                    if as_file.exists() {
                        file = as_file;
                    } else if as_dir.join("mod.rs").exists() {
                        file = as_dir.join("mod.rs");
                    } else {
                        wrong.push(format!(
                            "{doc}: {word}: no module {seg} in {}",
                            module.display()
                        ));
                        break;
                    }
                    module = as_dir;
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(
        checked > 0,
        "no Rust path found: is the extraction still working?"
    );
}
