//! Recovery from a lost shard, with real processes under `ps-launch --restart-shards`: a shard
//! killed with SIGKILL mid-run is started again; every shard rolls back to the newest version
//! all have a checkpoint of (version 0 before the first), the workers redo the steps since, and
//! the final weights equal those of a run that never lost a shard, bit for bit. A replacement
//! whose checkpoint directory is gone stops the run, saying why; a corrupted or truncated
//! newest checkpoint is skipped for the version before. A bounded chaos run kills
//! random shards and workers.

use ps_config::Config;
use ps_launch::bin_dir;
use ps_tests::{Spec, assert_bit_identical, cluster_weights};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const STEPS: u64 = 240;

fn spec(checkpoint_every: u64) -> Spec {
    Spec {
        shards: 2,
        workers: 2,
        hidden: vec![48],
        global_batch: 64,
        steps: STEPS,
        config: Spec::base()
            .adam(0.01, 0.0, false)
            .log_every(1)
            .checkpoint(checkpoint_every, 2),
        ..Spec::default()
    }
}

/// The final weights of the run that loses nothing (checkpoints do not change them).
fn straight() -> &'static Vec<f32> {
    static W: OnceLock<Vec<f32>> = OnceLock::new();
    W.get_or_init(|| ps_tests::uninterrupted_weights(&spec(10)))
}

/// `ps-launch` running a config, its stderr (every shard's log) in a file.
struct Launch {
    child: Child,
    stderr: PathBuf,
    cfg: Config,
    _dir: tempfile::TempDir,
}

impl Launch {
    fn start(spec: &Spec, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (path, cfg) = spec.write(dir.path());
        let stderr = dir.path().join("launch.err");
        let child = Command::new(bin_dir().join("ps-launch"))
            .arg("--config")
            .arg(&path)
            .args(["--timeout-secs", "240"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.path().join("launch.out")).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        Self {
            child,
            stderr,
            cfg,
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Steps in `metrics.jsonl` (shard 0 writes one line per step).
    fn steps(&self) -> usize {
        std::fs::read_to_string(self.cfg.server.out_dir.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }

    /// Waits until `metrics.jsonl` holds at least `n` steps.
    fn wait_steps(&mut self, n: usize) {
        let t0 = Instant::now();
        while self.steps() < n {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("ps-launch ended ({st}) before step {n}:\n{}", self.log());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "no step {n} after 120 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The pid of the launcher's child running `bin` with `flag value` (`--shard 1`, `--rank 0`).
    fn pid_of(&self, bin: &str, flag: &str, value: usize) -> i32 {
        let t0 = Instant::now();
        loop {
            if let Some(p) = children(self.child.id() as i32)
                .into_iter()
                .find(|&p| runs(p, bin, flag, value))
            {
                return p;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no {bin} {flag} {value} under ps-launch"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills (SIGKILL) the launcher's child running `bin` with `flag value` once
    /// `metrics.jsonl` holds `n` steps, and returns how many it held right after the kill.
    /// The pid is looked up before the wait, so the kill lands within one poll (5 ms) of step
    /// `n`: looking it up after the wait (a scan of /proc) let a fast run go tens of steps
    /// further on a loaded machine, past a checkpoint a test counted on not existing yet.
    fn kill_after(&mut self, n: usize, bin: &str, flag: &str, value: usize) -> usize {
        let mut pid = self.pid_of(bin, flag, value);
        self.wait_steps(n);
        // the process found may have ended meanwhile (one killed just before, still exiting
        // when looked up): then the one running now
        if !runs(pid, bin, flag, value) {
            pid = self.pid_of(bin, flag, value);
        }
        // SAFETY: kill(2) on a process this test's child started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        self.steps()
    }

    /// Stops shard `shard` (SIGSTOP, waiting until it is stopped: it writes nothing more),
    /// damages its newest checkpoint with `damage`, then kills it (SIGKILL). Returns that
    /// checkpoint's version and file.
    fn damage_newest_checkpoint_and_kill(
        &self,
        shard: usize,
        damage: ps_tests::Damage,
    ) -> (u64, PathBuf) {
        let pid = self.pid_of("ps-server", "--shard", shard);
        // SAFETY: kill(2) on a process this test's child started.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let t0 = Instant::now();
        while !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
        {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "shard {shard} (pid {pid}) not stopped after 30 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let dir = self.cfg.checkpoint_dir();
        let s = self.cfg.num_shards();
        let version = *ps_server::checkpoint::versions(&dir, shard, s)
            .last()
            .unwrap_or_else(|| panic!("shard {shard} wrote no checkpoint:\n{}", self.log()));
        let file = ps_server::checkpoint::file(&dir, shard, s, version);
        damage(&file);
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        (version, file)
    }

    /// Waits for ps-launch to end; its exit status, log, config and directory (removed when
    /// dropped).
    fn finish(mut self) -> (std::process::ExitStatus, String, Config, tempfile::TempDir) {
        let t0 = Instant::now();
        let st = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            if t0.elapsed() > Duration::from_secs(240) {
                let _ = self.child.kill();
                panic!("ps-launch still running after 240 s:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let log = self.log();
        (st, log, self.cfg, self._dir)
    }
}

/// The pids whose parent is `parent`.
fn children(parent: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}

/// Whether `pid` runs `bin` with `flag value`, and is not ps-launch's start-up check
/// (`ps-server --shard 0 --check`, which ends at once).
fn runs(pid: i32, bin: &str, flag: &str, value: usize) -> bool {
    let args = cmdline(pid);
    args.first().is_some_and(|a| a.ends_with(bin))
        && args
            .windows(2)
            .any(|w| w[0] == flag && w[1] == value.to_string())
        && !args.iter().any(|a| a == "--check")
}

fn cmdline(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// The versions the shards' recovery lines say they rolled back to, in order.
fn rolled_back_to(log: &str) -> Vec<u64> {
    log.lines()
        .filter_map(|l| l.split_once("every shard rolls back to version "))
        .map(|(_, rest)| {
            rest.split_whitespace()
                .next()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .collect()
}

fn assert_same_weights(cfg: &Config, what: &str) {
    assert_bit_identical(&cluster_weights(cfg), straight(), what);
}

fn recovered(log: &str, n: usize) {
    assert_eq!(
        log.matches("was lost (signal: 9").count(),
        n,
        "ps-launch restarts {n} lost shard(s):\n{log}"
    );
    assert!(
        log.contains("serving again from version"),
        "a surviving shard serves again from the checkpoint:\n{log}"
    );
}

#[test]
fn a_shard_killed_mid_run_is_recovered_bit_identically() {
    let _ = straight();
    let mut l = Launch::start(&spec(10), &["--restart-shards", "2"]);
    l.kill_after(75, "ps-server", "--shard", 1);
    let killed = Instant::now();
    let (st, log, cfg, _dir) = l.finish();
    assert!(st.success(), "{st}:\n{log}");
    recovered(&log, 1);
    eprintln!(
        "killed shard 1; the run ended {:.2} s later",
        killed.elapsed().as_secs_f64()
    );
    for l in log.lines().filter(|l| l.contains("recovery:")) {
        eprintln!("{l}");
    }
    let v = rolled_back_to(&log);
    assert!(
        v.len() == 1 && v[0] >= 60 && v[0].is_multiple_of(10),
        "rolled back to a checkpoint at or after step 60: {v:?}\n{log}"
    );
    let workers = std::fs::read_to_string(cfg.server.out_dir.join("logs/worker-0.log")).unwrap();
    assert!(
        workers.contains(&format!(
            "recovered: the cluster rolled back to version {}",
            v[0]
        )),
        "{workers}"
    );
    for l in workers.lines().filter(|l| l.contains("recovered:")) {
        eprintln!("{l}");
    }
    assert_same_weights(&cfg, "shard 1 lost once vs straight");
    // every step once in metrics.jsonl: the lines past the version rolled back to are redone
    let m = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl")).unwrap();
    ps_tests::assert_metrics_steps(&m, STEPS);
}

#[test]
fn a_shard_killed_twice_and_shard_zero_are_recovered_bit_identically() {
    let _ = straight();
    let mut l = Launch::start(&spec(10), &["--restart-shards", "2"]);
    let reached = l.kill_after(50, "ps-server", "--shard", 0);
    // the second loss only once the cluster has recovered from the first and gone on: steps
    // past those written at the first kill (shard 0 trims metrics.jsonl to the version it
    // rolls back to, so only steps made after the recovery count)
    l.kill_after((reached + 10).max(110), "ps-server", "--shard", 0);
    let (st, log, cfg, _dir) = l.finish();
    assert!(st.success(), "{st}:\n{log}");
    recovered(&log, 2);
    assert_eq!(rolled_back_to(&log).len(), 2, "{log}");
    assert_same_weights(&cfg, "shard 0 lost twice vs straight");
}

#[test]
fn a_worker_and_a_shard_killed_together_are_recovered_bit_identically() {
    let _ = straight();
    let mut l = Launch::start(
        &spec(10),
        &["--restart-shards", "1", "--restart-workers", "1"],
    );
    let shard = l.pid_of("ps-server", "--shard", 1);
    let worker = l.pid_of("ps-worker", "--rank", 1);
    l.wait_steps(60);
    // SAFETY: kill(2) on processes this test's child started.
    unsafe {
        libc::kill(worker, libc::SIGKILL);
        libc::kill(shard, libc::SIGKILL);
    }
    let (st, log, cfg, _dir) = l.finish();
    assert!(st.success(), "{st}:\n{log}");
    recovered(&log, 1);
    assert!(log.contains("worker 1 failed with signal: 9"), "{log}");
    assert_same_weights(&cfg, "a worker and a shard lost vs straight");
}

#[test]
fn a_shard_killed_before_the_first_checkpoint_restarts_the_run_from_version_0() {
    let _ = straight();
    let mut l = Launch::start(&spec(100), &["--restart-shards", "1"]);
    // killed within a poll of step 20, far from the first checkpoint at 100
    l.kill_after(20, "ps-server", "--shard", 1);
    let (st, log, cfg, _dir) = l.finish();
    assert!(st.success(), "{st}:\n{log}");
    recovered(&log, 1);
    assert_eq!(rolled_back_to(&log), vec![0], "{log}");
    assert_same_weights(&cfg, "lost before the first checkpoint vs straight");
}

#[test]
fn a_replacement_whose_checkpoint_directory_is_gone_stops_the_run_saying_why() {
    let mut l = Launch::start(&spec(10), &["--restart-shards", "2"]);
    l.wait_steps(40);
    let dir = l.cfg.checkpoint_dir();
    let pid = l.pid_of("ps-server", "--shard", 1);
    // a checkpoint being written meanwhile can refill it: try again
    let mut tries = 0;
    while let Err(e) = std::fs::remove_dir_all(&dir) {
        tries += 1;
        assert!(tries < 200, "{}: {e}", dir.display());
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill(2) on a process this test's child started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let t0 = Instant::now();
    let (st, log, cfg, _dir) = l.finish();
    assert!(!st.success(), "the run fails:\n{log}");
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "fails promptly: {:?}",
        t0.elapsed()
    );
    let why = format!(
        "its checkpoint directory {} is gone",
        cfg.checkpoint_dir().display()
    );
    assert!(log.contains(&why), "{why}:\n{log}");
    assert!(
        log.contains("the run stops rather than train from wrong weights"),
        "{log}"
    );
    // the other shard stopped with the reason too, and no final weights were written
    assert!(
        log.contains("shard 1 was lost and the run cannot go on"),
        "{log}"
    );
    assert!(
        !cfg.server.out_dir.join("shard-0.safetensors").exists(),
        "no final weights"
    );
}

/// A replacement verifies the checkpoints' checksums: shard 1's newest checkpoint with a value
/// changed (first loss), then truncated (second loss), is skipped with a WARN naming it, and
/// every shard rolls back to the version before, which all hold intact; the final weights equal
/// those of the run that lost nothing, bit for bit.
#[test]
fn a_corrupted_or_truncated_newest_checkpoint_is_skipped_by_the_recovery() {
    let _ = straight();
    let mut l = Launch::start(&spec(10), &["--restart-shards", "2"]);
    let mut damaged = Vec::new();
    let damages: [(usize, ps_tests::Damage); 2] = [
        (75, ps_tests::corrupt_first_value),
        (150, ps_tests::truncate_file),
    ];
    let mut reached = 0;
    for (at, damage) in damages {
        // the second loss only once the cluster has recovered from the first and gone on:
        // steps past those written at the first kill (see kill_after)
        l.wait_steps(at.max(reached + 10));
        damaged.push(l.damage_newest_checkpoint_and_kill(1, damage));
        reached = l.steps();
    }
    let (st, log, cfg, _dir) = l.finish();
    assert!(st.success(), "{st}:\n{log}");
    recovered(&log, 2);
    let expected: Vec<u64> = damaged.iter().map(|(v, _)| v - 10).collect();
    assert_eq!(rolled_back_to(&log), expected, "{damaged:?}:\n{log}");
    for (v, file) in &damaged {
        let warn = format!(
            "skipping its checkpoint of version {v}, which is not intact: {}",
            file.display()
        );
        assert!(log.contains(&warn), "{warn}:\n{log}");
    }
    assert_same_weights(
        &cfg,
        "newest checkpoint corrupted, then truncated, vs straight",
    );
}

/// Random SIGKILLs of shards and workers (a few, one at a time, each after the run went on
/// past the step it had reached at the previous one), then the weights are compared with the
/// run that lost nothing.
#[test]
fn chaos_random_shard_and_worker_kills_leave_the_weights_unchanged() {
    let _ = straight();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64;
    let mut rng = seed | 1;
    let mut next = move |n: u64| {
        // xorshift64
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut l = Launch::start(
        &spec(10),
        &["--restart-shards", "3", "--restart-workers", "3"],
    );
    let t0 = Instant::now();
    let mut kills = Vec::new();
    let mut at = 20;
    while kills.len() < 3 && t0.elapsed() < Duration::from_secs(90) {
        at += 25 + next(20) as usize;
        if at + 20 >= STEPS as usize {
            break;
        }
        let what = match next(4) {
            0 => ("ps-worker", "--rank", next(2) as usize),
            _ => ("ps-server", "--shard", next(2) as usize),
        };
        let reached = l.kill_after(at, what.0, what.1, what.2);
        // the run may still have gone past `at` before the kill landed (one run was at step
        // 140 when its kill "after step 93" came, before kill_after): the next kill waits for
        // steps beyond those written now, which the cluster only makes once it has recovered
        // from this loss (shard 0 trims metrics.jsonl to the version it rolls back to).
        // Waiting only for `at` killed shard 1 while shard 0's replacement was still asking
        // it where the run was: two shards lost at once, which no recovery can survive.
        kills.push((reached, what));
        at = at.max(reached);
    }
    let (st, log, cfg, _dir) = l.finish();
    assert!(st.success(), "seed {seed}, kills {kills:?}: {st}:\n{log}");
    eprintln!("chaos seed {seed}: kills (after step, process) {kills:?}");
    assert!(!kills.is_empty(), "seed {seed}");
    assert_same_weights(&cfg, &format!("chaos seed {seed}, kills {kills:?}"));
}

/// With `[optimizer] clip_norm` the shards exchange gradient norms through shard 0 every step:
/// losing shard 0 (the hub) mid-run ends shard 1's wait for the norms with the rollback, not a
/// panic (issue 41: shard 1 panicked and the run ended with rc 1), and the run ends
/// bit-identical to the same clipped run that lost nothing.
#[test]
fn shard_zero_killed_with_clipping_is_recovered_bit_identically() {
    let mut clipped = spec(10);
    clipped.config = clipped.config.clip_norm(0.5);
    let want = ps_tests::uninterrupted_weights(&clipped);
    let mut l = Launch::start(&clipped, &["--restart-shards", "2"]);
    l.kill_after(75, "ps-server", "--shard", 0);
    let (st, log, cfg, _dir) = l.finish();
    assert!(st.success(), "{st}:\n{log}");
    assert!(!log.contains("panicked"), "{log}");
    recovered(&log, 1);
    let coefs = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"clip_coef\""))
        .count();
    assert_eq!(coefs as u64, STEPS, "every step logs its clip coefficient");
    assert_bit_identical(
        &cluster_weights(&cfg),
        &want,
        "clipped run, shard 0 lost once vs straight",
    );
    let m = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl")).unwrap();
    ps_tests::assert_metrics_steps(&m, STEPS);
}
