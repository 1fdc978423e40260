//! No silent hang, no orphan: a barrier missing a rank says which one and then fails the run
//! loudly; Ctrl-C on the launcher stops every server and worker it started.

use ps_common::launch::{LocalCluster, bin_dir};
use ps_tests::{Spec, Start, run_cluster};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn a_missing_rank_is_named_then_the_barrier_times_out() {
    let spec = Spec {
        shards: 1,
        workers: 2,
        steps: 5,
        server_extra: "barrier_warn_secs = 1\nbarrier_timeout_secs = 3".into(),
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap();
    cluster.start_worker(0, cfg.workers, &[]).unwrap();
    let started = Instant::now();
    let err = cluster
        .wait(Duration::from_secs(60), &|| false)
        .unwrap_err()
        .to_string();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "bounded: {:?}",
        started.elapsed()
    );
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    assert!(
        log.contains("for ranks [1] (1 of 2 in)"),
        "the wait names the missing rank:\n{log}"
    );
    assert!(
        log.contains("step 0: no gradient from ranks [1] after 3.0 s"),
        "{log}"
    );
    assert!(err.contains("failed"), "{err}");
    let worker = std::fs::read_to_string(dir.path().join("logs/worker-0.log")).unwrap();
    assert!(
        worker.contains("failed: step 0: no gradient from ranks [1]"),
        "the worker is told why:\n{worker}"
    );
    let shard_code = cluster.servers[0].status.and_then(|s| s.code());
    assert_eq!(shard_code, Some(1), "the shard fails loudly: {err}");
}

#[test]
fn ctrl_c_on_the_launcher_leaves_no_process_behind() {
    let spec = Spec {
        shards: 2,
        workers: 2,
        steps: 1_000_000,
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let err_log = std::fs::File::create(dir.path().join("launch.log")).unwrap();
    let mut launcher = Command::new(bin_dir().join("ps-launch"))
        .arg("--config")
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err_log)
        .spawn()
        .unwrap();
    // wait until training runs (shard 0 has logged steps)
    let metrics = cfg.server.out_dir.join("metrics.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 5 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "training did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let ours_with_pids = || -> Vec<(String, String)> {
        let needle = path.display().to_string();
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| {
                let e = e.ok()?;
                let c = std::fs::read(e.path().join("cmdline")).ok()?;
                Some((e.file_name().to_string_lossy().into_owned(), c))
            })
            .map(|(pid, c)| (pid, String::from_utf8_lossy(&c).replace('\0', " ")))
            .filter(|(_, c)| c.contains(&needle))
            .collect()
    };
    let ours = || -> Vec<String> { ours_with_pids().into_iter().map(|(_, c)| c).collect() };
    let pids: Vec<String> = ours_with_pids().into_iter().map(|(p, _)| p).collect();
    assert_eq!(
        ours().len(),
        5,
        "launcher, 2 shards, 2 workers: {:?}",
        ours()
    );
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(launcher.id() as i32, libc::SIGINT) };
    let t1 = Instant::now();
    let status = loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            break s;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(20),
            "launcher did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(1));
    let log = std::fs::read_to_string(dir.path().join("launch.log")).unwrap();
    assert!(
        log.contains("interrupted: stopped every server and worker"),
        "{log}"
    );
    std::thread::sleep(Duration::from_millis(200));
    assert!(ours().is_empty(), "left behind: {:?}", ours());
    // nor their shared-memory boards: shards and workers remove them when stopped
    if let Some(root) = ps_common::shm::shm_root() {
        let left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| pids.iter().any(|p| n.contains(&format!("-pid{p}-"))))
            .collect();
        assert!(
            left.is_empty(),
            "boards left in {}: {left:?}",
            root.display()
        );
    }
}

#[test]
fn a_short_run_finishes_cleanly_with_workers_leaving() {
    let spec = Spec {
        shards: 2,
        workers: 2,
        steps: 3,
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let t0 = Instant::now();
    run_cluster(&path, &cfg, &Start::default());
    // servers exit as soon as every worker has left, not after linger_secs (30 s)
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    assert!(
        log.contains("training finished: 3 steps; final test accuracy"),
        "{log}"
    );
    assert!(!log.contains("did not leave"), "{log}");
}
