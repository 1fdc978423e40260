//! A final evaluation slower than `[server] linger_secs` (issue 41: a large model on a loaded
//! CPU): the workers say they are evaluating, the shards wait for their leaves, and the run
//! whose every step finished ends with exit 0 and the whole test set counted (it ended with
//! rc 1 and a half-counted accuracy: the shards closed after the linger and the workers' leaves
//! found them gone).

use ps_tests::Spec;
use std::time::{Duration, Instant};

/// `worker r: done ... test accuracy on its slice X% (c/n)`: (c, n).
fn slice_of(log: &str) -> (u64, u64) {
    let line = log
        .lines()
        .find(|l| l.contains("test accuracy on its slice"))
        .unwrap_or_else(|| panic!("no slice line in:\n{log}"));
    let figures = line.rsplit('(').next().unwrap().trim_end_matches(')');
    let (c, n) = figures.split_once('/').unwrap();
    (c.parse().unwrap(), n.parse().unwrap())
}

/// The seconds of the log line's timestamp (`2026-11-28T07:16:54.333815Z ...`) in its day.
fn stamp(line: &str) -> f64 {
    let time = line.split('T').nth(1).and_then(|r| r.split('Z').next());
    let parts: Vec<f64> = time
        .map(|t| t.split(':').filter_map(|p| p.parse().ok()).collect())
        .unwrap_or_default();
    assert_eq!(parts.len(), 3, "no timestamp in {line}");
    parts[0] * 3600.0 + parts[1] * 60.0 + parts[2]
}

/// How long shard 0 saw the workers evaluate: from the first "is evaluating" word it logged
/// to its "every rank left" line (the evaluation's length, whenever the shard's closing wait
/// began: it begins after the final weights are written, which takes its own time).
fn evaluating_span(log: &str) -> f64 {
    let line = |needle: &str| {
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no `{needle}` in:\n{log}"))
    };
    stamp(line("shard 0: every rank left ")) - stamp(line("shard 0: rank 0 is evaluating"))
}

#[test]
fn a_final_evaluation_slower_than_the_linger_does_not_fail_the_finished_run() {
    let linger = 1.0;
    // a wide model: each worker's 5000 test images take seconds on one CPU thread (about
    // 2.4 s here unloaded, 0.7 s with 2048 wide, which was too close to the linger)
    let spec = Spec {
        shards: 2,
        workers: 2,
        hidden: vec![4096, 4096],
        global_batch: 32,
        steps: 2,
        config: Spec::base().linger_secs(linger).threads(1).log_every(1),
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let log = dir.path().join("launch");
    let mut launch = ps_tests::spawn_launch(&path, &[], &log);
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = launch.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(300) {
            let _ = launch.kill();
            panic!("ps-launch still running after 300 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = std::fs::read_to_string(log.with_extension("err")).unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    // the scenario: the shards waited longer than the linger for the leaves
    let w = evaluating_span(&err);
    eprintln!("shard 0 saw the workers evaluate for {w:.2} s (linger {linger} s)");
    assert!(
        w > linger,
        "the evaluation took {w} s, not over {linger} s:\n{err}"
    );
    for r in 0..2 {
        assert!(
            err.contains(&format!(
                "rank {r} is evaluating the final weights; waiting for its leave"
            )),
            "{err}"
        );
    }
    assert!(!err.contains("did not leave"), "{err}");
    // the whole test set counted: the sum of the workers' slices, on every shard's record
    let logs = cfg.server.out_dir.join("logs");
    let slices: Vec<(u64, u64)> = (0..2)
        .map(|r| slice_of(&std::fs::read_to_string(logs.join(format!("worker-{r}.log"))).unwrap()))
        .collect();
    let (correct, count) = slices.iter().fold((0, 0), |a, s| (a.0 + s.0, a.1 + s.1));
    assert_eq!(count, 10000, "{slices:?}");
    let metrics = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["final"], true, "{last}");
    assert_eq!(last["test_count"], 10000, "{last}");
    assert_eq!(
        last["test_acc"].as_f64().unwrap(),
        correct as f64 / 10000.0,
        "{last}"
    );
    assert!(
        err.contains(&format!(
            "training finished: 2 steps; final test accuracy {:.2}% ({correct}/10000)",
            correct as f64 / 100.0
        )),
        "{err}"
    );
}
