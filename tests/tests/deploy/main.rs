//! `deploy/` validated offline: the Kubernetes manifests and every config are checked against
//! the config parser and the real binaries' `--help`, and the Slurm batch script is run on this
//! machine: its config generation with made-up node names, and a whole job (2 shards, 2
//! workers, a few steps on MNIST) with a stand-in `srun` that runs the tasks here. No Slurm,
//! Kubernetes or Docker is needed.
//!
//! The modules: [`k8s`] (the manifests), [`slurm`] (the batch script's jobs), [`readme`]
//! (deploy/README.md's examples and numbers), [`yaml`] (reading the manifests); the helpers
//! for files and the binaries' flags are here.
#![allow(clippy::too_many_lines)] // a scenario test reads top to bottom in one function

use ps_config::Config;
use ps_launch::bin_dir;
use ps_tests::slurm::{
    Group, fake_job_env, free_port_pair, repo, run_sbatch, sbatch, small_template, write_exe,
};
use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use yaml::{find, k8s_config, yaml_docs};

mod k8s;
mod readme;
mod slurm;
mod yaml;

fn deploy() -> PathBuf {
    repo().join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file under `dir`, recursively, sorted; the crates beside the deployment files
/// (`deploy/launch`, `deploy/plan`: a folder with a `Cargo.toml`) are not deployment files.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.unwrap().path();
            if p.is_dir() && p.join("Cargo.toml").is_file() {
                continue;
            }
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn rel(p: &Path) -> String {
    p.strip_prefix(deploy()).unwrap_or(p).display().to_string()
}

// ---------------------------------------------------------------------------------------------
// the binaries' flags

/// The long flags `BIN --help` lists (`--config`, `--shard`, ...).
fn help_flags(bin: &str) -> BTreeSet<String> {
    let exe = bin_dir().join(bin);
    let out = Command::new(&exe)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (build the binaries first: cargo build --release --bins, or cargo test --workspace)",
                exe.display()
            )
        });
    assert!(out.status.success(), "{bin} --help: {:?}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let flags: BTreeSet<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect();
    assert!(
        flags.contains("--config") && flags.contains("--help"),
        "{bin} --help lists {flags:?}"
    );
    flags
}

/// The `--flag` names in a command line (`--x=y` counts as `--x`).
fn flags_of(args: &[String]) -> Vec<String> {
    args.iter()
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap().to_string())
        .collect()
}

/// The value after `flag` in `args`.
fn flag_value<'a>(args: &'a [String], flag: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("{flag} missing from {args:?}"));
    args.get(i + 1)
        .unwrap_or_else(|| panic!("{flag} has no value in {args:?}"))
}

fn assert_flags_exist(what: &str, bin: &str, args: &[String]) {
    let known = help_flags(bin);
    for f in flags_of(args) {
        assert!(
            known.contains(&f),
            "{what}: {bin} has no flag {f} (its --help lists {known:?}); command {args:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// tests

#[test]
fn every_shell_script_parses() {
    let scripts: Vec<PathBuf> = files_under(&deploy())
        .into_iter()
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("sh" | "sbatch" | "bash")
            ) || read(p)
                .lines()
                .next()
                .is_some_and(|l| l.starts_with("#!") && (l.contains("bash") || l.ends_with("/sh")))
        })
        .collect();
    assert!(
        scripts.contains(&sbatch()),
        "found {:?}",
        scripts.iter().map(|p| rel(p)).collect::<Vec<_>>()
    );
    for s in &scripts {
        let out = Command::new("bash").arg("-n").arg(s).output().unwrap();
        assert!(
            out.status.success(),
            "bash -n {}: {}",
            rel(s),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // the batch script: strict, bounded, and its ps-server/ps-worker flags exist
    let body = read(&sbatch());
    assert!(body.contains("\nset -euo pipefail\n"));
    let directives: Vec<&str> = body.lines().filter(|l| l.starts_with("#SBATCH ")).collect();
    assert!(
        directives.iter().any(|l| l.starts_with("#SBATCH --time=")),
        "bounded: {directives:?}"
    );
    // GPUs are opt-in (a cluster without GPUs rejects any GPU request), the defaults fit a
    // 2-CPU node, and the job is told before its end to checkpoint (SIGUSR1)
    assert!(
        !directives
            .iter()
            .any(|l| l.contains("gpu") || l.contains("gres")),
        "no GPU request by default: {directives:?}"
    );
    assert!(
        directives.contains(&"#SBATCH --cpus-per-task=1"),
        "{directives:?}"
    );
    assert!(
        directives.contains(&"#SBATCH --signal=B:USR1@120"),
        "{directives:?}"
    );
    let mut launches = 0;
    for (bin, needed) in [
        ("ps-server", &["--config", "--shard", "--listen"][..]),
        ("ps-worker", &["--config", "--device"][..]),
    ] {
        let marker = format!("\"$bin/{bin}\"");
        let line = body
            .lines()
            .find(|l| l.contains(&marker))
            .unwrap_or_else(|| panic!("the batch script starts no {bin}"));
        let args: Vec<String> = line
            .split_once(&marker)
            .unwrap()
            .1
            .split_whitespace()
            .map(str::to_string)
            .collect();
        assert_flags_exist("ps-cluster.sbatch", bin, &args);
        for f in needed {
            assert!(flags_of(&args).iter().any(|a| a == f), "{bin} {f}: {line}");
        }
        launches += 1;
    }
    assert_eq!(launches, 2);
}

#[test]
fn every_toml_config_under_deploy_parses() {
    let tomls: Vec<PathBuf> = files_under(&deploy())
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    let names: Vec<String> = tomls.iter().map(|p| rel(p)).collect();
    for expected in ["mnist.toml", "slurm/template.toml"] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} in {names:?}"
        );
    }
    for p in &tomls {
        let cfg = Config::load(p).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            cfg.num_shards() >= 1 && cfg.cluster.workers >= 1,
            "{}",
            rel(p)
        );
    }
    let mnist_data = repo().join("data/mnist").canonicalize().unwrap();
    let local = Config::load(&deploy().join("mnist.toml")).unwrap();
    assert_eq!(
        local.cluster.servers,
        ["127.0.0.1:50051", "127.0.0.1:50052"]
    );
    assert_eq!(local.cluster.workers, 2);
    assert_eq!(local.data.dir.canonicalize().unwrap(), mnist_data);
    let slurm = Config::load(&deploy().join("slurm/template.toml")).unwrap();
    assert_eq!(slurm.data.dir.canonicalize().unwrap(), mnist_data);
    assert!(
        slurm.train.global_batch >= slurm.cluster.workers,
        "the template runs as is"
    );
    // the Kubernetes config (embedded in the ConfigMap) parses too; checked in detail below
    let docs = yaml_docs(&deploy().join("k8s/ps-cluster.yaml"));
    let cm = find(&docs, "ConfigMap", "ps-config");
    let secrets = tempfile::tempdir().unwrap();
    let cfg = k8s_config(cm, secrets.path());
    assert_eq!((cfg.num_shards(), cfg.cluster.workers), (2, 4));
}

fn read_opt(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}
