//! No silent hang, no orphan: a barrier missing a rank says which one and then fails the run
//! loudly; Ctrl-C on the launcher stops every server and worker it started.

use ps_config::{BarrierPolicy, Transport};
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
    // bounded by the barrier timeout: the shard's exit code and log below say it ended there
    // (a wall-clock bound would say nothing more, and fail on a loaded machine)
    let err = cluster
        .wait(Duration::from_secs(60), &|| false)
        .unwrap_err()
        .to_string();
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    assert!(
        log.contains("for ranks [1] (1 of 2 in)"),
        "the wait names the missing rank:\n{log}"
    );
    // the barrier is polled, so the failure comes at or just after the timeout (3.1 s once
    // under load): the reported wait is at least the timeout
    let waited: f64 = log
        .split("step 0: no gradient from ranks [1] after ")
        .nth(1)
        .and_then(|rest| rest.split(" s (barrier_timeout_secs = 3)").next())
        .and_then(|secs| secs.parse().ok())
        .unwrap_or_else(|| panic!("the failure names the rank and the wait:\n{log}"));
    assert!(
        waited >= 3.0,
        "failed after {waited} s, before the timeout:\n{log}"
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

/// The config of the two tests below: 1 shard, 2 workers, a 0.5 s barrier timeout, logging
/// every 0.2 s, and `connect_timeout_secs` the workers' patience.
fn unjoined_spec(connect_timeout_secs: f64) -> Spec {
    Spec {
        shards: 1,
        workers: 2,
        hidden: vec![4],
        steps: 3,
        config: Spec::base()
            .barrier_warn_secs(0.2)
            .barrier_timeout_secs(0.5)
            .connect_timeout_secs(connect_timeout_secs),
        ..Spec::default()
    }
}

/// The longest wait for the workers to register that `log` states so far (0 when none).
fn longest_unjoined_wait(log: &str) -> f64 {
    log.lines()
        .filter_map(|l| {
            let rest = l.split("step 0: waiting ").nth(1)?;
            let (secs, tail) = rest.split_once(" s for the workers to register")?;
            tail.starts_with(" (0 of 2 ranks registered)")
                .then(|| secs.parse::<f64>().ok())?
        })
        .fold(0.0, f64::max)
}

/// No worker ever registers with an in-process shard: it waits for the first with the
/// workers' own patience (`[worker] connect_timeout_secs` + `[server] barrier_timeout_secs`,
/// 1 + 0.5 s here), not the barrier timeout alone, saying so, then fails the run naming the
/// wait and the bound, no sooner.
#[test]
fn a_shard_no_worker_joins_fails_after_the_workers_patience_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = unjoined_spec(1.0).write(dir.path());
    let t0 = Instant::now();
    let shards = ps_tests::inproc::Shards::start(&path);
    let log = shards.nodes[0].log.clone();
    let outcome = shards.join(Duration::from_secs(120)).remove(0).unwrap();
    let elapsed = t0.elapsed();
    let log = log.text();
    let ps_server::Outcome::Failed(why) = outcome else {
        panic!("expected a failed run, got {outcome:?}:\n{log}");
    };
    let waited: f64 = why
        .strip_prefix("step 0: no worker registered within ")
        .and_then(|rest| rest.strip_suffix(" s of the shard's start (0 of 2 ranks registered; the bound is [worker] connect_timeout_secs + [server] barrier_timeout_secs = 1 + 0.5 s)"))
        .and_then(|secs| secs.parse().ok())
        .unwrap_or_else(|| panic!("the failure names the wait and the bound: {why}"));
    assert!(
        waited >= 1.5,
        "failed after {waited} s, before the bound: {why}"
    );
    assert!(
        elapsed >= Duration::from_millis(1500),
        "ended after {elapsed:?}, before the bound: {why}"
    );
    assert!(
        log.contains("the run fails if none has registered after 1.5 s ([worker] connect_timeout_secs + [server] barrier_timeout_secs)"),
        "the wait is logged with its bound:\n{log}"
    );
    assert!(
        longest_unjoined_wait(&log) >= 0.5,
        "still waiting past barrier_timeout_secs, and saying so:\n{log}"
    );
    assert!(!log.contains("no gradient from ranks"), "{log}");
}

/// Workers that register only after the shard has been up longer than `barrier_timeout_secs`
/// (a loaded machine loading their data) are waited for: the run finishes, and the barrier
/// clock starts at the first registration.
#[test]
fn workers_registering_after_the_barrier_timeout_are_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = unjoined_spec(10.0).write(dir.path());
    let _ = (ps_tests::mnist_train(), ps_tests::mnist_test()); // loaded before the clock runs
    let shards = ps_tests::inproc::Shards::start(&path);
    let t0 = Instant::now();
    while longest_unjoined_wait(&shards.log(0)) < 0.5 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the shard did not say it waits for the workers:\n{}",
            shards.log(0)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let workers: Vec<_> = (0..2)
        .map(|r| ps_tests::inproc::start_worker(&shards.cfg, r))
        .collect();
    let done = ps_tests::inproc::finish(shards, workers);
    assert!(
        !done.shard_logs[0].contains("no gradient from ranks"),
        "{}",
        done.shard_logs[0]
    );
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
    // the convention for a command stopped by SIGINT: 130, with one line
    assert_eq!(status.code(), Some(130));
    let log = std::fs::read_to_string(dir.path().join("launch.log")).unwrap();
    assert!(
        log.contains("ps-launch: interrupted (Ctrl-C): stopped every shard and worker"),
        "{log}"
    );
    // the launcher waited for its children; /proc may show them a moment longer
    let t2 = Instant::now();
    while !ours().is_empty() && t2.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(ours().is_empty(), "left behind: {:?}", ours());
    // nor their shared-memory boards: shards and workers remove them when stopped
    if let Some(root) = ps_net::shm::shm_root() {
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
    run_cluster(&path, &cfg, &Start::default());
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    // servers exit as soon as every worker has left, not after linger_secs (30 s): said by
    // the log (a wall-clock bound would fail on a loaded machine)
    assert!(!log.contains("did not leave within"), "{log}");
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
    let (straight, dir, cfg, mut cluster) = uninterrupted_then_shards(&spec);
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
    let mut died = RankOneDied::pushing_step_0_to(&[1]);
    died.cluster.start_worker(0, 2, &[]).unwrap();
    let t0 = Instant::now();
    while died.register(1).version < 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "shard 1 never applied step 0"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    died.restart();
    let log = died.finish();
    assert!(
        log.contains("shards are at versions [0, 1]: redoing step 0"),
        "{log}"
    );
}

/// Rank 1 pushed step 0 to every shard and died before rank 0 pushed: the shards count its
/// gradient and wait for rank 0. Its restarted worker must not push step 0 again, since the
/// shards may apply that step at any moment after it registers (once rank 0 pushes), and a
/// worker that then asked for version 0 as the current one failed ("at version 1 but this
/// worker needs version 0"). Registration says the step counts the rank's gradient; the
/// worker pulls exactly version 0, pushes nothing for step 0, and the run ends bit-identical
/// to an uninterrupted one. The shards still answer an exact pull of version 0 once they are
/// at version 1.
#[test]
fn a_worker_restarted_after_pushing_everywhere_does_not_push_again() {
    let mut died = RankOneDied::pushing_step_0_to(&[0, 1]);
    for s in 0..2 {
        let reply = died.register(s);
        assert_eq!(
            (reply.version, reply.counted),
            (0, true),
            "shard {s}: {reply:?}"
        );
    }
    // the restarted worker registers while the shards wait for rank 0
    died.restart();
    let log = died.log_once("starting at step");
    assert!(
        log.contains("shards [0, 1] already count this rank's gradient of step 0"),
        "{log}"
    );
    died.cluster.start_worker(0, 2, &[]).unwrap();
    died.finish();
}

/// The shards an exact pull of version 0 finds at version 1 still hold it (the other half of
/// their double buffer): a restarted worker that joined at version 0 may pull it late.
#[test]
fn an_exact_pull_of_the_previous_version_is_answered() {
    let mut died = RankOneDied::pushing_step_0_to(&[0, 1]);
    died.cluster.start_worker(0, 2, &[]).unwrap();
    let t0 = Instant::now();
    while (0..2).any(|s| died.register(s).version < 1) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the shards never applied step 0"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut again = vec![0f32; died.w0.len()];
    for (s, r) in died.ranges.clone().into_iter().enumerate() {
        died.rt
            .block_on(died.clients[s].pull_into(0, true, None, &mut again[r]))
            .unwrap_or_else(|e| panic!("shard {s}: {e}"));
    }
    ps_tests::assert_bit_identical(&again, &died.w0, "version 0 pulled again");
    died.restart();
    died.finish();
}

/// The final weights of an uninterrupted run of `spec` (2 shards), then its 2 shards started
/// afresh in a new directory (logs in `logs/`), with the config they read.
fn uninterrupted_then_shards(
    spec: &Spec,
) -> (Vec<f32>, tempfile::TempDir, ps_config::Config, LocalCluster) {
    let straight = ps_tests::uninterrupted_weights(spec);
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(2, &[], Duration::from_secs(60))
        .unwrap();
    (straight, dir, cfg, cluster)
}

/// Rank 1 of a 2-shard, 2-worker run over gRPC, played by a test: it registers, computes its
/// step 0 with the worker's own code, pushes it to some shards, and dies (its connections close
/// when [`RankOneDied::restart`] starts its real successor).
struct RankOneDied {
    cluster: LocalCluster,
    cfg: ps_config::Config,
    dir: tempfile::TempDir,
    straight: Vec<f32>,
    rt: tokio::runtime::Runtime,
    clients: Vec<ps_net::client::ShardClient>,
    ranges: Vec<std::ops::Range<usize>>,
    /// Version 0's parameters, as rank 1 pulled them.
    w0: Vec<f32>,
}

impl RankOneDied {
    fn pushing_step_0_to(shards: &[usize]) -> Self {
        use ps_data::order::BatchPlanner;
        use ps_model::layout::shard_ranges;
        use ps_net::auth::ClientSecurity;
        use ps_net::client::ShardClient;
        use ps_proto::pb::PushHeader;
        let spec = Spec {
            shards: 2,
            workers: 2,
            steps: 20,
            transport: Transport::Grpc,
            ..Spec::default()
        };
        let (straight, dir, cfg, cluster) = uninterrupted_then_shards(&spec);
        let layout = cfg.layout();
        let n = layout.num_params();
        let ranges = shard_ranges(n, 2);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let clients = rt.block_on(async {
            let mut cs = Vec::new();
            for (s, addr) in cluster.addrs.iter().enumerate() {
                let c = ShardClient::connect(
                    s,
                    addr,
                    &ClientSecurity::default(),
                    Duration::from_secs(10),
                )
                .await
                .unwrap();
                cs.push(c);
            }
            cs
        });
        let mut died = Self {
            cluster,
            cfg,
            dir,
            straight,
            rt,
            clients,
            ranges,
            w0: vec![0f32; n],
        };
        for s in 0..2 {
            died.register(s);
        }
        // rank 1's step 0, as its worker computes it
        for (c, r) in died.clients.iter_mut().zip(&died.ranges) {
            died.rt
                .block_on(c.pull_into(0, false, None, &mut died.w0[r.clone()]))
                .unwrap();
        }
        let train = ps_tests::mnist_train();
        let mut planner = BatchPlanner::new(died.cfg.data_order(train.len()));
        let (mut x, mut y) = (Vec::new(), Vec::new());
        train.gather(planner.worker_batch(0, 1, 2), &mut x, &mut y);
        let mut backend = ps_worker::cpu::cpu_model(&layout, 1);
        backend.set_weights(&died.w0).unwrap();
        let mut grad = vec![0f32; n];
        let stats = backend
            .forward_backward(&x, &y, died.cfg.train.loss_reduction, &mut grad)
            .unwrap();
        for &s in shards {
            let r = died.ranges[s].clone();
            let header = PushHeader {
                rank: 1,
                step: 0,
                samples: y.len() as u32,
                loss_sum: stats.loss_sum,
                correct: stats.correct,
                len: r.len() as u64,
                ..Default::default()
            };
            let bytes = ps_net::wire::f32_to_bytes(&grad[r]);
            died.rt
                .block_on(died.clients[s].push_retrying(header, &bytes, 1 << 20))
                .unwrap();
        }
        died
    }

    /// Registers rank 1 with shard `s` again, on the same connection.
    fn register(&mut self, s: usize) -> ps_proto::pb::RegisterReply {
        let req = ps_proto::pb::RegisterRequest {
            shard: s as u32,
            num_shards: 2,
            ..ps_tests::register_request(1, 2, self.w0.len())
        };
        self.rt
            .block_on(self.clients[s].register(req))
            .unwrap_or_else(|e| panic!("shard {s}: {e}"))
    }

    /// Rank 1 dies (its connections close) and its real worker starts.
    fn restart(&mut self) {
        self.clients.clear();
        self.cluster.start_worker(1, 2, &[]).unwrap();
    }

    /// The restarted worker's log once it contains `what`.
    fn log_once(&self, what: &str) -> String {
        let path = self.dir.path().join("logs/worker-1.log");
        let t0 = Instant::now();
        loop {
            let log = std::fs::read_to_string(&path).unwrap_or_default();
            if log.contains(what) {
                return log;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {log}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the run to end and checks its weights against the uninterrupted run's;
    /// returns the restarted worker's log.
    fn finish(mut self) -> String {
        self.cluster
            .wait(Duration::from_secs(120), &|| false)
            .unwrap_or_else(|e| panic!("{e}"));
        ps_tests::assert_bit_identical(
            &ps_tests::cluster_weights(&self.cfg),
            &self.straight,
            "weights differ from the uninterrupted run",
        );
        std::fs::read_to_string(self.dir.path().join("logs/worker-1.log")).unwrap()
    }
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
