//! Preemption with real processes: SIGTERM to every shard and worker mid-run (as `scancel`
//! or a scheduler's preemption does) makes each shard write a checkpoint at a step boundary
//! that all shards share, and stop; the run started again with `--resume` ends with exactly
//! the weights of a run that was never interrupted, and `metrics.jsonl` holds every step once.
//! Through `ps-launch` too, whichever way the signal comes: to the launcher alone, to its
//! process group, or to each shard and worker; with no periodic checkpoints (`every = 0`),
//! the preemption's are the only ones.

use ps_launch::{LocalCluster, bin_dir};
use ps_tests::{Spec, Start, cluster_weights, run_cluster};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn spec() -> Spec {
    Spec {
        shards: 2,
        workers: 2,
        hidden: vec![64],
        global_batch: 64,
        steps: 400,
        // no periodic checkpoints: the preemption writes the only ones
        config: Spec::base().adam(0.01, 0.0, false).log_every(1),
        ..Spec::default()
    }
}

/// The weights of the uninterrupted run, computed once for every test of this file.
fn straight() -> &'static [f32] {
    static W: OnceLock<Vec<f32>> = OnceLock::new();
    W.get_or_init(|| ps_tests::uninterrupted_weights(&spec()))
}

#[test]
fn sigterm_checkpoints_at_a_common_step_and_the_resume_is_bit_identical() {
    let straight = straight();

    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec().write(dir.path());
    let mut cluster = LocalCluster::new(bin_dir(), path.clone(), Some(dir.path().join("logs")));
    cluster.run_id = Some("preempted".into());
    cluster
        .start_servers(2, &[], Duration::from_secs(60))
        .unwrap();
    for r in 0..2 {
        cluster.start_worker(r, 2, &[]).unwrap();
    }
    // a few steps in, every process gets SIGTERM at once
    let metrics = cfg.server.out_dir.join("metrics.jsonl");
    let t0 = Instant::now();
    loop {
        let lines = std::fs::read_to_string(&metrics)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if lines >= 20 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    for p in cluster.servers.iter().chain(cluster.workers.iter()) {
        // SAFETY: kill(2) on this test's own child.
        unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
    }
    // each shard stops on its own (within PREEMPT_GRACE plus its stop, more on a loaded
    // machine): a bounded wait that names what it waits for, not a speed assertion
    let t1 = Instant::now();
    for p in cluster.servers.iter_mut() {
        let st = loop {
            if let Some(st) = p.child.try_wait().unwrap() {
                break st;
            }
            assert!(
                t1.elapsed() < Duration::from_secs(120),
                "{} has not exited 120 s after SIGTERM",
                p.name
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(st.code(), Some(143), "{}: {st:?}", p.name);
    }
    for p in cluster.workers.iter_mut() {
        let _ = p.child.wait();
    }
    let mut versions = Vec::new();
    let mut logs = String::new();
    for i in 0..2 {
        let log = std::fs::read_to_string(dir.path().join(format!("logs/shard-{i}.log"))).unwrap();
        assert!(
            log.contains("preempted (SIGTERM or SIGUSR1) at version"),
            "{log}"
        );
        let tail: Vec<&str> = log.lines().rev().take(12).collect();
        logs += &format!(
            "--- shard {i}\n{}\n",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
        let v: u64 = log
            .rsplit_once("was preempted: checkpoint of version ")
            .unwrap_or_else(|| panic!("{log}"))
            .1
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        versions.push(v);
    }
    let common = latest_common(&cfg.checkpoint_dir()).expect("a version every shard has");
    // each shard's newest is the common version or one past it (a shard that got the
    // step in flight before the other stopped)
    assert!(
        (20..400).contains(&common)
            && versions.iter().min() == Some(&common)
            && versions.iter().all(|&v| v <= common + 1),
        "common {common}, newest per shard {versions:?}\n{logs}"
    );
    drop(cluster);

    // started again with --resume: from the common version to the end, the same bits
    let resume = Start {
        run_id: Some("preempted".into()),
        server_args: vec!["--resume".into()],
        ..Start::default()
    };
    run_cluster(&path, &cfg, &resume);
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    assert!(
        log.contains(&format!("resuming at version {common}")),
        "{log}"
    );
    ps_tests::assert_bit_identical(
        &cluster_weights(&cfg),
        straight,
        "preempted, resumed vs straight",
    );
    let m = std::fs::read_to_string(&metrics).unwrap();
    ps_tests::assert_metrics_steps(&m, 400);
}

/// Where a launcher's SIGTERM goes.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// `kill -TERM <ps-launch>`.
    Launcher,
    /// `kill -TERM -<pgid>`: the launcher, every shard and every worker at once.
    Group,
    /// Each shard and worker, not the launcher (as Slurm's or the kubelet's signals reach
    /// the tasks).
    EachProcess,
}

/// Runs the spec through `ps-launch`, preempts it `target`'s way after 20 steps, checks that
/// the launcher exits 143 naming a version every shard has and the command to continue, runs
/// that command and compares with the uninterrupted run, bit for bit.
fn preempt_through_the_launcher(target: Target) {
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec().write(dir.path());
    let out = cfg.server.out_dir.clone();
    let log = dir.path().join("launch");
    let mut launch = ps_tests::spawn_launch(&path, &[], &log);
    let (shards, workers) = ps_tests::launch_pids(&out, Duration::from_secs(120));
    ps_tests::wait_for_lines(
        &out.join("metrics.jsonl"),
        20,
        Duration::from_secs(120),
        "progress",
    );
    let pid = launch.id() as i32;
    let targets: Vec<i32> = match target {
        Target::Launcher => vec![pid],
        Target::Group => vec![-pid],
        Target::EachProcess => shards.iter().chain(&workers).copied().collect(),
    };
    for t in targets {
        // SAFETY: kill(2) on this test's own child (or its process group, or its children).
        unsafe { libc::kill(t, libc::SIGTERM) };
    }
    let status = launch.wait().unwrap();
    let stderr = std::fs::read_to_string(log.with_extension("err")).unwrap();
    assert_eq!(status.code(), Some(143), "{target:?}: {status:?}\n{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("ps-launch: preempted: every shard has a checkpoint of version "))
        .unwrap_or_else(|| panic!("{target:?}: no resume line in\n{stderr}"));
    let version: u64 = line
        .split("checkpoint of version ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert_eq!(
        latest_common(&cfg.checkpoint_dir()),
        Some(version),
        "{target:?}: {line}"
    );
    assert!((20..400).contains(&version), "{line}");
    for i in 0..2 {
        assert!(
            stderr.contains(&format!(
                "shard {i}: preempted (SIGTERM or SIGUSR1) at version"
            )),
            "{target:?}, shard {i}:\n{stderr}"
        );
    }
    // the printed command continues the run, to the same bits
    let command = line.split("continue the run with: ").nth(1).unwrap();
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(
        words,
        ["ps-launch", "--config", path.to_str().unwrap(), "--resume"],
        "{line}"
    );
    let resumed = std::process::Command::new(bin_dir().join("ps-launch"))
        .args(&words[1..])
        .output()
        .unwrap();
    let resumed_err = String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success(), "{target:?}: {resumed_err}");
    assert!(
        resumed_err.contains(&format!("resuming at version {version}")),
        "{target:?}: {resumed_err}"
    );
    ps_tests::assert_bit_identical(
        &cluster_weights(&cfg),
        straight(),
        &format!("{target:?}: preempted through ps-launch, resumed vs straight"),
    );
    let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    ps_tests::assert_metrics_steps(&m, 400);
}

#[test]
fn sigterm_to_the_launcher_checkpoints_and_the_printed_resume_is_bit_identical() {
    preempt_through_the_launcher(Target::Launcher);
}

#[test]
fn sigterm_to_the_process_group_checkpoints_and_the_printed_resume_is_bit_identical() {
    preempt_through_the_launcher(Target::Group);
}

#[test]
fn sigterm_to_each_shard_and_worker_checkpoints_and_the_printed_resume_is_bit_identical() {
    preempt_through_the_launcher(Target::EachProcess);
}

/// The newest version of which both shards have a checkpoint file in `dir`.
fn latest_common(dir: &std::path::Path) -> Option<u64> {
    let mut per_shard = [Vec::new(), Vec::new()];
    for e in std::fs::read_dir(dir).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        for (s, list) in per_shard.iter_mut().enumerate() {
            if let Some(v) = name
                .strip_prefix(&format!("shard-{s}-of-2-v"))
                .and_then(|r| r.strip_suffix(".safetensors"))
            {
                list.push(v.parse::<u64>().unwrap());
            }
        }
    }
    per_shard[0]
        .iter()
        .filter(|v| per_shard[1].contains(v))
        .max()
        .copied()
}
