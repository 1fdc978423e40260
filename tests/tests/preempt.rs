//! Preemption with real processes: SIGTERM to every shard and worker mid-run (as `scancel`
//! or a scheduler's preemption does) makes each shard write a checkpoint at a step boundary
//! that all shards share, and stop; the run started again with `--resume` ends with exactly
//! the weights of a run that was never interrupted, and `metrics.jsonl` holds every step once.

use ps_launch::{LocalCluster, bin_dir};
use ps_tests::{Spec, Start, cluster_weights, run_cluster};
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

#[test]
fn sigterm_checkpoints_at_a_common_step_and_the_resume_is_bit_identical() {
    let straight = ps_tests::uninterrupted_weights(&spec());

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
    let t1 = Instant::now();
    for p in cluster.servers.iter_mut() {
        let st = p.child.wait().unwrap();
        assert_eq!(st.code(), Some(143), "{}: {st:?}", p.name);
    }
    assert!(
        t1.elapsed() < Duration::from_secs(15),
        "bounded: {:?}",
        t1.elapsed()
    );
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
        &straight,
        "preempted, resumed vs straight",
    );
    let m = std::fs::read_to_string(&metrics).unwrap();
    ps_tests::assert_metrics_steps(&m, 400);
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
