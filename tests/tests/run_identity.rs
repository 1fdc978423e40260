//! Run identity with real processes: a second cluster on the same host, given the same ports
//! or the same output folder, fails at once and cleanly, its worker is refused by the first
//! cluster's shards with a message naming both runs, and the first run ends exactly as if the
//! second had never existed. `--resume` refuses another run's checkpoints unless told
//! `--resume-from RUN`.

use ps_config::TestConfig;
use ps_launch::{LocalCluster, bin_dir};
use ps_tests::{Spec, Start, cluster_weights, run_cluster};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn spec(steps: u64, config: TestConfig) -> Spec {
    Spec {
        shards: 2,
        workers: 2,
        global_batch: 32,
        steps,
        config,
        ..Spec::default()
    }
}

/// Runs `bin` with `args` to its end (at most 60 s) and returns its output and run time.
fn run_to_end(bin: &str, args: &[&str]) -> (Output, Duration) {
    let t0 = Instant::now();
    let mut child = Command::new(bin_dir().join(bin))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{bin} {args:?} still running after 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (child.wait_with_output().unwrap(), t0.elapsed())
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_second_cluster_on_the_same_ports_and_folder_fails_cleanly_and_never_mixes() {
    let spec = spec(20, Spec::base());
    let straight = ps_tests::uninterrupted_weights(&spec);

    // cluster A: its shards listen, its workers are not started yet
    let dir_a = tempfile::tempdir().unwrap();
    let (path_a, cfg_a) = spec.write(dir_a.path());
    let mut a = LocalCluster::new(bin_dir(), path_a.clone(), Some(dir_a.path().join("logs")));
    a.run_id = Some("job-7".into());
    a.start_servers(2, &[], Duration::from_secs(60)).unwrap();
    let addrs = a.addrs.clone();

    // cluster B: its own folder and config, the same ports
    let dir_b = tempfile::tempdir().unwrap();
    let (path_b, _) = spec.write(dir_b.path());
    let cfg_b = path_b.to_str().unwrap();
    let (o, took) = run_to_end(
        "ps-server",
        &[
            "--config", cfg_b, "--shard", "0", "--listen", &addrs[0], "--run-id", "job-6",
        ],
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains(&format!("cannot listen on {}", addrs[0])) && e.contains("in use"),
        "{e}"
    );
    assert!(took < Duration::from_secs(30), "failed fast: {took:?}");

    // B's worker, pointed at the ports it was told (A's shards), is refused naming both runs
    let servers = addrs.join(",");
    let (o, took) = run_to_end(
        "ps-worker",
        &[
            "--config",
            cfg_b,
            "--rank",
            "0",
            "--servers",
            &servers,
            "--run-id",
            "job-6",
        ],
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("shard 0 belongs to run job-7") && e.contains("comes from run job-6"),
        "{e}"
    );
    assert!(took < Duration::from_secs(30), "failed fast: {took:?}");

    // a shard of B given A's folder (another free port) fails before listening
    let (o, _) = run_to_end(
        "ps-server",
        &[
            "--config",
            path_a.to_str().unwrap(),
            "--shard",
            "1",
            "--listen",
            "127.0.0.1:0",
            "--run-id",
            "job-6",
        ],
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("is in use by shard 1 of another live cluster (run job-7, pid"),
        "{e}"
    );

    // A runs to the end, untouched: the same bits as a run that never met B
    for r in 0..2 {
        a.start_worker(r, 2, &[]).unwrap();
    }
    a.wait(Duration::from_secs(300), &|| false).unwrap();
    ps_tests::assert_bit_identical(
        &cluster_weights(&cfg_a),
        &straight,
        "run A after B's attempts",
    );
    let log = std::fs::read_to_string(dir_a.path().join("logs/shard-0.log")).unwrap();
    assert!(
        log.contains("of run job-6 (this shard belongs to run job-7)"),
        "{log}"
    );
    let worker = std::fs::read_to_string(dir_a.path().join("logs/worker-0.log")).unwrap();
    assert!(
        worker.contains("run job-7 (run id from --run-id)"),
        "{worker}"
    );
    // nothing of B's in A's folder, and B's folder got nothing
    assert!(!dir_b.path().join("out/metrics.jsonl").exists());
}

#[test]
fn resume_refuses_another_runs_checkpoints_unless_told_resume_from() {
    let config = || Spec::base().checkpoint(5, 2).adam(0.01, 0.0, false);
    let straight = ps_tests::uninterrupted_weights(&spec(20, config()));
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec(12, config()).write(dir.path());
    let first = Start {
        run_id: Some("first".into()),
        ..Start::default()
    };
    run_cluster(&path, &cfg, &first);
    let meta = checkpoint_run_id(
        &cfg.checkpoint_dir()
            .join("shard-0-of-2-v00000010.safetensors"),
    );
    assert_eq!(meta, "first", "checkpoints carry the run id");

    // run "second" with --resume: refused, naming both runs and the way out
    let (path, cfg) = spec(20, config()).write(dir.path());
    let (o, _) = run_to_end(
        "ps-server",
        &[
            "--config",
            path.to_str().unwrap(),
            "--shard",
            "0",
            "--listen",
            "127.0.0.1:0",
            "--resume",
            "--run-id",
            "second",
        ],
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("a checkpoint of run first, but this is run second")
            && e.contains("--resume-from first"),
        "{e}"
    );
    // told so, it starts from them, and ends where the uninterrupted run does
    let from = Start {
        run_id: Some("second".into()),
        server_args: vec!["--resume-from".into(), "first".into()],
        ..Start::default()
    };
    run_cluster(&path, &cfg, &from);
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    assert!(log.contains("resuming at version 10"), "{log}");
    ps_tests::assert_bit_identical(
        &cluster_weights(&cfg),
        &straight,
        "resumed from another run's checkpoint",
    );
}

/// The `run_id` metadata of a checkpoint file.
fn checkpoint_run_id(path: &Path) -> String {
    let (_, meta) = ps_model::weights::read_safetensors(path).unwrap();
    meta.get("run_id").cloned().unwrap_or_default()
}
