//! The documents' figures that no test re-measures are labelled as what they are: PERFORMANCE.md
//! is a dated benchmark record (each section with its date, code, command and load), and the
//! README's figures taken from it or from one long run say so where they stand. The README's
//! figures that a command re-measures are checked by that command (`scripts/deploy-checks.sh`,
//! check 6) or asserted by a test, which the README names beside them.

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
const NO_FIGURES: &[&str] = &["How to reproduce", "Machine and load", "Not measured"];

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
