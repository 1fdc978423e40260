//! The launcher and its output directory (issue 30): a second launch into a live run's folder
//! is refused before anything in it moves, naming the live run, its pids and how to choose
//! another folder; a launch that fails its start-up checks (a wrong `--data-dir`) moves
//! nothing; Ctrl-C to the launcher's process group exits 130 with one line.

use ps_tests::Spec;
use std::time::Duration;

fn long() -> Spec {
    Spec {
        shards: 2,
        workers: 2,
        steps: 300,
        config: Spec::base().log_every(1),
        ..Spec::default()
    }
}

fn launch(config: &std::path::Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(ps_launch::bin_dir().join("ps-launch"))
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .expect("ps-launch runs")
}

/// The names in `dir`, sorted.
fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn a_second_launch_into_a_live_runs_folder_is_refused_before_anything_moves() {
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = long().write(dir.path());
    let out = cfg.server.out_dir.clone();
    let mut first = ps_tests::spawn_launch(&path, &[], &dir.path().join("first"));
    let (shards, workers) = ps_tests::launch_pids(&out, Duration::from_secs(120));
    ps_tests::wait_for_lines(
        &out.join("metrics.jsonl"),
        3,
        Duration::from_secs(120),
        "first run",
    );
    let run_id = std::fs::read_to_string(out.join("run_id")).unwrap();
    let before = listing(&out);
    let second = launch(&path, &[]);
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{err}");
    let pids = |p: &[i32]| p.iter().map(i32::to_string).collect::<Vec<_>>().join(", ");
    let holder = format!(
        "belongs to a live run (run {}, ps-launch pid {}; shard pids {}; worker pids {})",
        run_id.trim(),
        first.id(),
        pids(&shards),
        pids(&workers)
    );
    assert!(err.contains(&holder), "{holder}\nin\n{err}");
    assert!(err.contains("--out-dir DIR"), "{err}");
    // nothing of the live run moved (it may have added files since), its id unchanged
    let after = listing(&out);
    assert!(
        before.iter().all(|n| after.contains(n))
            && !after.iter().any(|n| n.starts_with("previous-")),
        "before {before:?}, after {after:?}: {err}"
    );
    assert_eq!(std::fs::read_to_string(out.join("run_id")).unwrap(), run_id);
    let status = first.wait().unwrap();
    let first_err = std::fs::read_to_string(dir.path().join("first.err")).unwrap();
    assert!(status.success(), "the live run finished: {first_err}");
    ps_tests::assert_metrics_steps(
        &std::fs::read_to_string(out.join("metrics.jsonl")).unwrap(),
        300,
    );
}

#[test]
fn a_launch_that_cannot_start_moves_nothing_and_reference_check_moves_with_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 2,
        workers: 2,
        steps: 6,
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir.path());
    let out = cfg.server.out_dir.clone();
    let done = launch(&path, &["--check-reference"]);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let before = listing(&out);
    assert!(
        before.contains(&"reference-check".to_string()),
        "{before:?}"
    );
    let missing = dir.path().join("no-such-data");
    for _ in 0..2 {
        let failed = launch(&path, &["--data-dir", missing.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&failed.stderr);
        assert_eq!(failed.status.code(), Some(1), "{err}");
        assert!(
            err.contains("the shards would not start") && err.contains("no-such-data"),
            "{err}"
        );
        assert_eq!(listing(&out), before, "nothing moved: {err}");
    }
    // a run that starts moves every output of the earlier one, reference-check/ too
    let again = launch(&path, &[]);
    assert!(again.status.success());
    let prev = listing(&out)
        .into_iter()
        .find(|n| n.starts_with("previous-"))
        .expect("moved aside");
    assert!(out.join(&prev).join("reference-check").is_dir());
    assert!(!out.join("reference-check").exists());
}

#[test]
fn ctrl_c_to_the_process_group_exits_130_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = long().write(dir.path());
    let out = cfg.server.out_dir.clone();
    let log = dir.path().join("launch");
    let mut launch = ps_tests::spawn_launch(&path, &[], &log);
    ps_tests::launch_pids(&out, Duration::from_secs(120));
    ps_tests::wait_for_lines(
        &out.join("metrics.jsonl"),
        3,
        Duration::from_secs(120),
        "progress",
    );
    // SAFETY: kill(2) on this test's own child's process group, as a terminal's Ctrl-C.
    unsafe { libc::kill(-(launch.id() as i32), libc::SIGINT) };
    let status = launch.wait().unwrap();
    let err = std::fs::read_to_string(log.with_extension("err")).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("ps-launch: interrupted (Ctrl-C): stopped every shard and worker"),
        "{err}"
    );
    assert!(!err.contains("error:"), "{err}");
    assert!(!err.contains("failed with exit status"), "{err}");
}

/// A launch refused by the shards' start-up checks into a folder that did not exist leaves no
/// folder and no `.ps-launch.lock` behind: "nothing in the output directory was touched" is
/// true (issue 41: the lock file stayed).
#[test]
fn a_refused_launch_into_a_new_folder_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = Spec {
        shards: 1,
        workers: 1,
        steps: 2,
        ..Spec::default()
    }
    .write(dir.path());
    let out = cfg.server.out_dir.clone();
    assert!(!out.exists());
    let missing = dir.path().join("no-such-data");
    let failed = launch(&path, &["--data-dir", missing.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(failed.status.code(), Some(1), "{err}");
    assert!(
        err.contains("nothing in the output directory was touched"),
        "{err}"
    );
    assert!(
        !out.exists(),
        "{:?}",
        std::fs::read_dir(&out).map(|d| d.count())
    );
    // into a folder that exists, only what the claim made goes: the folder and its files stay
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let failed = launch(&path, &["--data-dir", missing.to_str().unwrap()]);
    assert_eq!(failed.status.code(), Some(1));
    assert_eq!(listing(&out), vec!["notes.txt".to_string()]);
}

/// A config refused at start exits 2 from all three programs: a missing file, a bad `--set`
/// (the README and the Slurm recipe read 2 as "refused at start"; issue 41: ps-launch and
/// ps-worker said 1).
#[test]
fn a_missing_config_or_a_bad_set_exits_2_from_every_program() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = Spec::default().write(dir.path());
    let missing = dir.path().join("no-such.toml");
    for bin in ["ps-launch", "ps-worker", "ps-server"] {
        let run = |config: &std::path::Path, extra: &[&str]| {
            let mut c = std::process::Command::new(ps_launch::bin_dir().join(bin));
            c.arg("--config").arg(config).args(extra);
            if bin == "ps-worker" {
                c.args(["--rank", "0"]);
            }
            if bin == "ps-server" {
                c.args(["--shard", "0"]);
            }
            let out = c.output().unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        };
        let (code, err) = run(&missing, &[]);
        assert_eq!(code, Some(2), "{bin}, missing config: {err}");
        assert!(err.contains("no-such.toml"), "{bin}: {err}");
        let (code, err) = run(&path, &["--set", "train.no_such_key=1"]);
        assert_eq!(code, Some(2), "{bin}, bad --set: {err}");
        assert!(err.contains("no_such_key"), "{bin}: {err}");
        let (code, err) = run(&path, &["--set", "no-equals-sign"]);
        assert_eq!(code, Some(2), "{bin}, malformed --set: {err}");
    }
}
