//! No silent hang, no orphan: a barrier missing a rank says which one and then fails the run
//! loudly; Ctrl-C on the launcher stops every server and worker it started.

use ps_common::config::{BarrierPolicy, Transport};
use ps_launch::{LocalCluster, bin_dir};
use ps_tests::{Spec, Start, run_cluster};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn a_missing_rank_is_named_then_the_barrier_times_out() {
    let spec = Spec {
        shards: 1,
        workers: 2,
        steps: 5,
        config: Spec::base()
            .barrier_warn_secs(1.0)
            .barrier_timeout_secs(3.0),
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap();
    cluster.start_worker(0, cfg.cluster.workers, &[]).unwrap();
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

/// A worker killed (SIGKILL) at four points of a run and restarted each time, wherever the
/// kill lands (between steps, during its pulls, between its pushes to the two shards, which
/// leaves one shard a version ahead), rejoins at the shards' step and the run ends with the
/// same weights, bit for bit, as a run that was never interrupted.
#[test]
fn a_worker_killed_and_restarted_mid_run_changes_nothing() {
    let spec = Spec {
        shards: 2,
        workers: 2,
        hidden: vec![256],
        global_batch: 64,
        steps: 400,
        ..Spec::default()
    };
    let straight = ps_tests::uninterrupted_weights(&spec);

    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(2, &[], Duration::from_secs(60))
        .unwrap();
    cluster.start_worker(0, 2, &[]).unwrap();
    cluster.start_worker(1, 2, &[]).unwrap();
    let metrics = cfg.server.out_dir.join("metrics.jsonl");
    let steps_done = || std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count());
    let mut redone = 0;
    for (k, at) in [40, 120, 200, 280].into_iter().enumerate() {
        let t0 = Instant::now();
        while steps_done() < at {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "stuck before step {at}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        // stagger the kill inside a step differently each time
        std::thread::sleep(Duration::from_micros(700 * k as u64));
        let mut dead = cluster.workers.remove(1);
        dead.child.kill().unwrap();
        dead.child.wait().unwrap();
        cluster.start_worker(1, 2, &[]).unwrap();
        // the restarted worker says where it starts (and whether shards were a version apart)
        let log_path = dir.path().join("logs/worker-1.log");
        let t1 = Instant::now();
        let log = loop {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            if log.contains("starting at step") {
                break log;
            }
            assert!(t1.elapsed() < Duration::from_secs(60), "restart {k}: {log}");
            std::thread::sleep(Duration::from_millis(10));
        };
        redone += usize::from(log.contains("redoing step"));
    }
    cluster
        .wait(Duration::from_secs(120), &|| false)
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("restarts that found the shards a version apart: {redone} of 4");
    ps_tests::assert_bit_identical(
        &ps_tests::cluster_weights(&cfg),
        &straight,
        "weights differ after the restarts",
    );
}

/// What the random kills above rarely hit, made on purpose: rank 1 pushed step 0 to shard 1
/// and died before pushing to shard 0 (this test plays that rank, computing the gradient with
/// the worker's own code), so shard 1 applies step 0 as soon as rank 0 pushes, and shard 0
/// waits. The restarted rank 1 finds the shards at versions 0 and 1, redoes step 0 from version
/// 0 (which shard 1 still holds), pushes only to shard 0, and the run ends bit-identical to an
/// uninterrupted one.
#[test]
fn a_worker_that_died_between_its_pushes_redoes_the_step() {
    use ps_common::auth::ClientSecurity;
    use ps_common::client::ShardClient;
    use ps_common::layout::shard_ranges;
    use ps_common::order::BatchPlanner;
    use ps_common::pb::{PushHeader, RegisterRequest};
    use ps_worker::backend::Backend;
    let spec = Spec {
        shards: 2,
        workers: 2,
        steps: 20,
        transport: Transport::Grpc,
        ..Spec::default()
    };
    let straight = ps_tests::uninterrupted_weights(&spec);
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(2, &[], Duration::from_secs(60))
        .unwrap();
    let layout = cfg.layout();
    let n = layout.num_params();
    let ranges = shard_ranges(n, 2);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let as_rank_1 = |shard: u32| RegisterRequest {
        protocol_version: ps_common::PROTOCOL_VERSION,
        rank: 1,
        world_size: 2,
        num_params: n as u64,
        shard,
        num_shards: 2,
        ..Default::default()
    };
    let mut clients = rt.block_on(async {
        let mut cs = Vec::new();
        for (s, addr) in cluster.addrs.iter().enumerate() {
            let mut c =
                ShardClient::connect(s, addr, &ClientSecurity::default(), Duration::from_secs(10))
                    .await
                    .unwrap();
            c.register(as_rank_1(s as u32)).await.unwrap();
            cs.push(c);
        }
        cs
    });
    // rank 1's step 0, as its worker computes it
    let mut w = vec![0f32; n];
    for (c, r) in clients.iter_mut().zip(&ranges) {
        rt.block_on(c.pull_into(0, false, None, &mut w[r.clone()]))
            .unwrap();
    }
    let train = ps_tests::mnist_train();
    let mut planner = BatchPlanner::new(cfg.data_order(train.len()));
    let (mut x, mut y) = (Vec::new(), Vec::new());
    train.gather(planner.worker_batch(0, 1, 2), &mut x, &mut y);
    let mut backend = ps_worker::cpu::CpuBackend::new(layout.clone(), 1);
    backend.set_weights(&w).unwrap();
    let mut grad = vec![0f32; n];
    let stats = backend
        .forward_backward(&x, &y, cfg.train.loss_reduction, &mut grad)
        .unwrap();
    let header = PushHeader {
        rank: 1,
        step: 0,
        samples: y.len() as u32,
        loss_sum: stats.loss_sum,
        correct: stats.correct,
        len: ranges[1].len() as u64,
        ..Default::default()
    };
    let bytes = ps_common::wire::f32_to_bytes(&grad[ranges[1].clone()]);
    rt.block_on(clients[1].push_retrying(header, &bytes, 1 << 20))
        .unwrap();
    // ... and dies. Rank 0 runs; shard 1 completes step 0 and waits at 1, shard 0 waits at 0
    cluster.start_worker(0, 2, &[]).unwrap();
    let t0 = Instant::now();
    while rt
        .block_on(clients[1].register(as_rank_1(1)))
        .unwrap()
        .version
        < 1
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "shard 1 never applied step 0"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(clients);
    cluster.start_worker(1, 2, &[]).unwrap();
    cluster
        .wait(Duration::from_secs(120), &|| false)
        .unwrap_or_else(|e| panic!("{e}"));
    let log = std::fs::read_to_string(dir.path().join("logs/worker-1.log")).unwrap();
    assert!(
        log.contains("shards are at versions [0, 1]: redoing step 0"),
        "{log}"
    );
    ps_tests::assert_bit_identical(
        &ps_tests::cluster_weights(&cfg),
        &straight,
        "weights differ from the uninterrupted run",
    );
}

/// `ps-launch --restart-workers 1`: a worker killed mid-run is started again by the launcher,
/// and the run ends with the weights of an uninterrupted one.
#[test]
fn the_launcher_restarts_a_failed_worker() {
    let spec = Spec {
        shards: 2,
        workers: 2,
        hidden: vec![256],
        global_batch: 64,
        steps: 300,
        ..Spec::default()
    };
    let straight = ps_tests::uninterrupted_weights(&spec);
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let err_log = std::fs::File::create(dir.path().join("launch.log")).unwrap();
    let mut launcher = Command::new(bin_dir().join("ps-launch"))
        .arg("--config")
        .arg(&path)
        .args(["--restart-workers", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err_log)
        .spawn()
        .unwrap();
    let metrics = cfg.server.out_dir.join("metrics.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 100 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "training did not start"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let needle = path.display().to_string();
    let worker1 = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            (cmd.contains("ps-worker") && cmd.contains(&needle) && cmd.contains("--rank 1 "))
                .then_some(pid)
        })
        .next()
        .expect("worker 1 runs");
    // SAFETY: kill(2) on a process this test's launcher started.
    unsafe { libc::kill(worker1, libc::SIGKILL) };
    let status = launcher.wait().unwrap();
    let log = std::fs::read_to_string(dir.path().join("launch.log")).unwrap();
    assert!(status.success(), "{log}");
    assert!(
        log.contains(
            "worker 1 failed with signal: 9 (SIGKILL); starting it again (0 restart(s) left)"
        ),
        "{log}"
    );
    ps_tests::assert_bit_identical(
        &ps_tests::cluster_weights(&cfg),
        &straight,
        "weights differ after the restart",
    );
}

/// `barrier_policy = "continue"`: with rank 1 absent, step 0 goes on with rank 0 alone after
/// the timeout (said in the log), the following steps do not wait for rank 1, and once it
/// starts it takes part again until the end.
#[test]
fn barrier_policy_continue_goes_on_without_a_missing_rank_until_it_comes_back() {
    let spec = Spec {
        shards: 1,
        workers: 2,
        hidden: vec![256],
        steps: 1500,
        config: Spec::base()
            .barrier_warn_secs(0.5)
            .barrier_timeout_secs(1.5)
            .barrier_policy(BarrierPolicy::Continue),
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap();
    cluster.start_worker(0, 2, &[]).unwrap();
    let shard_log = dir.path().join("logs/shard-0.log");
    let t0 = Instant::now();
    loop {
        let log = std::fs::read_to_string(&shard_log).unwrap_or_default();
        if log.contains("step 0: no gradient from ranks [1] after") {
            assert!(log.contains("going on with the 1 that pushed"), "{log}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no continue:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.start_worker(1, 2, &[]).unwrap();
    cluster
        .wait(Duration::from_secs(120), &|| false)
        .unwrap_or_else(|e| panic!("{e}"));
    let log = std::fs::read_to_string(&shard_log).unwrap();
    assert!(log.contains("training finished: 1500 steps"), "{log}");
    let workers: Vec<u64> = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.contains("\"final\"")) // shard 0's closing final-evaluation line
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["workers"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(workers.len(), 1500);
    assert_eq!(workers[0], 1, "step 0 went on with rank 0 alone");
    assert_eq!(workers[1499], 2, "rank 1 took part again: {workers:?}");
}
