//! Elastic means elastic (`barrier_policy = "continue"`): a worker paused (SIGSTOP) past the
//! barrier timeout for many steps comes back (SIGCONT), registers again at the shards' step and
//! trains on to the end; one that comes back after the last step evaluates and leaves; one
//! that comes back after the shards are gone fails alone, and the launcher does not end the run
//! because of it. Every run ends with the final weights and `model.safetensors`.

use ps_config::{BarrierPolicy, Config};
use ps_launch::{LocalCluster, bin_dir};
use ps_tests::Spec;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const STEPS: u64 = 3000;

fn spec(linger_secs: f64) -> Spec {
    Spec {
        shards: 2,
        workers: 2,
        hidden: vec![64],
        steps: STEPS,
        config: Spec::base()
            .log_every(1000)
            // long enough for the workers' start (loading the data) under load: step 0
            // waits from the shard's start, and with nobody in it the run fails after twice this
            .barrier_warn_secs(1.0)
            .barrier_timeout_secs(4.0)
            .linger_secs(linger_secs)
            .barrier_policy(BarrierPolicy::Continue),
        ..Spec::default()
    }
}

fn start(dir: &Path, spec: &Spec) -> (LocalCluster, Config) {
    let (path, cfg) = spec.write(dir);
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.join("logs")));
    cluster.elastic = true;
    cluster
        .start_servers(2, &[], Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    for r in 0..2 {
        cluster.start_worker(r, 2, &[]).unwrap();
    }
    (cluster, cfg)
}

fn signal(cluster: &LocalCluster, rank: usize, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(cluster.workers[rank].child.id() as i32, sig) };
    assert_eq!(rc, 0, "kill({sig})");
}

/// Steps shard 0 has logged to its metrics file so far.
fn steps_done(cfg: &Config) -> usize {
    std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl"))
        .map(|t| t.lines().filter(|l| !l.contains("\"final\"")).count())
        .unwrap_or(0)
}

fn wait_until(dir: &Path, what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        if t0.elapsed() > limit {
            let logs: Vec<String> = ["shard-0", "shard-1", "worker-0", "worker-1"]
                .iter()
                .map(|n| {
                    let text = read(dir.join(format!("logs/{n}.log")));
                    let lines: Vec<&str> = text.lines().collect();
                    format!(
                        "--- {n} ---\n{}",
                        lines[lines.len().saturating_sub(15)..].join("\n")
                    )
                })
                .collect();
            panic!("waited {limit:?} for {what}\n{}", logs.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn read(p: impl AsRef<Path>) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// The run is complete: every shard at the last version, and `ps-launch --export` makes
/// `model.safetensors` of it.
fn assert_complete(dir: &Path, cfg: &Config) {
    let (_, version) = ps_model::weights::read_shards(
        &cfg.server.out_dir,
        cfg.num_shards(),
        cfg.layout().num_params(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(version, STEPS);
    let out = Command::new(bin_dir().join("ps-launch"))
        .arg("--config")
        .arg(dir.join("config.toml"))
        .arg("--export")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(cfg.server.out_dir.join("model.safetensors").exists());
}

#[test]
fn a_worker_paused_for_many_steps_rejoins_at_the_current_step() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cluster, cfg) = start(dir.path(), &spec(30.0));
    wait_until(
        dir.path(),
        "the first steps",
        Duration::from_secs(120),
        || steps_done(&cfg) >= 10,
    );
    signal(&cluster, 1, libc::SIGSTOP);
    let shard_log = dir.path().join("logs/shard-0.log");
    wait_until(
        dir.path(),
        "the barrier to go on without rank 1",
        Duration::from_secs(30),
        || read(&shard_log).contains("no gradient from ranks [1] after"),
    );
    let dropped_at = steps_done(&cfg);
    // many steps without it, then it comes back before the end
    wait_until(
        dir.path(),
        "steps without rank 1",
        Duration::from_secs(60),
        || steps_done(&cfg) >= dropped_at + 300,
    );
    signal(&cluster, 1, libc::SIGCONT);
    cluster
        .wait(Duration::from_secs(300), &|| false)
        .unwrap_or_else(|e| panic!("{e}"));
    let w1 = cluster.workers[1].status.expect("reaped");
    let log = read(dir.path().join("logs/worker-1.log"));
    assert!(w1.success(), "worker 1 exited with {w1}:\n{log}");
    let (left, back) = rejoin_steps(&log);
    assert!(back >= left + 300, "left at {left}, back at {back}:\n{log}");
    assert!(back < STEPS, "came back before the end: {back}\n{log}");
    // the steps after its return have both workers in again
    let workers: Vec<u64> = read(cfg.server.out_dir.join("metrics.jsonl"))
        .lines()
        .filter(|l| !l.contains("\"final\""))
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["workers"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(workers.len() as u64, STEPS);
    assert_eq!(workers[dropped_at + 100], 1, "rank 1 was left out");
    assert_eq!(workers[STEPS as usize - 1], 2, "rank 1 took part again");
    assert_complete(dir.path(), &cfg);
}

/// `(t, s)` of worker 1's "left behind at step t ...; rejoining at step s of N" line.
fn rejoin_steps(log: &str) -> (u64, u64) {
    let line = log
        .lines()
        .find(|l| l.contains("left behind at step"))
        .unwrap_or_else(|| panic!("no rejoin:\n{log}"));
    let num_after = |key: &str| -> u64 {
        let rest = &line[line.find(key).unwrap() + key.len()..];
        rest.split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (
        num_after("left behind at step "),
        num_after("rejoining at step "),
    )
}

#[test]
fn a_worker_back_after_the_end_leaves_and_one_back_too_late_does_not_end_the_run() {
    // back while the shards wait for it to leave: it evaluates and leaves, exit 0
    let dir = tempfile::tempdir().unwrap();
    let (mut cluster, cfg) = start(dir.path(), &spec(60.0));
    wait_until(
        dir.path(),
        "the first steps",
        Duration::from_secs(120),
        || steps_done(&cfg) >= 10,
    );
    signal(&cluster, 1, libc::SIGSTOP);
    let shard_log = dir.path().join("logs/shard-1.log");
    wait_until(
        dir.path(),
        "the last step",
        Duration::from_secs(120),
        || read(&shard_log).contains(&format!("final weights (version {STEPS}) written")),
    );
    signal(&cluster, 1, libc::SIGCONT);
    cluster
        .wait(Duration::from_secs(120), &|| false)
        .unwrap_or_else(|e| panic!("{e}"));
    let log = read(dir.path().join("logs/worker-1.log"));
    assert!(cluster.workers[1].status.unwrap().success(), "{log}");
    let (_, back) = rejoin_steps(&log);
    assert_eq!(back, STEPS, "{log}");
    assert!(
        log.contains("test accuracy on its slice"),
        "it evaluated: {log}"
    );
    let log0 = read(dir.path().join("logs/shard-0.log"));
    assert!(!log0.contains("did not leave within"), "it left: {log0}");
    assert_complete(dir.path(), &cfg);

    // back after the shards are gone (linger 0.5 s): it fails alone; the run is complete
    let dir = tempfile::tempdir().unwrap();
    let mut late = spec(0.5);
    late.config = late.config.connect_timeout_secs(3.0);
    let (mut cluster, cfg) = start(dir.path(), &late);
    wait_until(
        dir.path(),
        "the first steps",
        Duration::from_secs(120),
        || steps_done(&cfg) >= 10,
    );
    signal(&cluster, 1, libc::SIGSTOP);
    wait_until(
        dir.path(),
        "the shards to exit",
        Duration::from_secs(120),
        || {
            cluster
                .servers
                .iter_mut()
                .all(|p| p.child.try_wait().ok().flatten().is_some())
        },
    );
    signal(&cluster, 1, libc::SIGCONT);
    let outcome = cluster.wait(Duration::from_secs(120), &|| false);
    assert!(outcome.is_ok(), "{outcome:?}");
    assert!(
        cluster
            .servers
            .iter()
            .all(|p| p.status.is_some_and(|s| s.success())),
        "{:?}",
        cluster.servers
    );
    assert_complete(dir.path(), &cfg);
}
