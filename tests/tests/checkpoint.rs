//! Checkpoints and resume, with clusters in this process (`ps_tests::inproc`) and, where the
//! exit code or the launcher is the subject, real processes: a run stopped and resumed from its checkpoints
//! ends with bit-identical weights to a run that was never interrupted; the shards agree on
//! the newest version they all have; a resume without checkpoints, or from another model's,
//! is refused with a message that says what was expected; a corrupted or truncated newest
//! checkpoint is skipped for the newest version every shard holds intact; `ps-launch --export` merges the
//! shards into one PyTorch-named `model.safetensors` and draws `curves.svg`.

use ps_config::TestConfig;
use ps_launch::{LocalCluster, bin_dir};
use ps_tests::inproc::{resume, run_in_process, run_in_process_with};
use ps_tests::{Spec, cluster_weights};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// `[checkpoint] every = 5, keep = 2` over `Spec::base()`.
fn checkpoints() -> TestConfig {
    Spec::base().checkpoint(5, 2)
}

fn spec(steps: u64) -> Spec {
    Spec {
        shards: 2,
        workers: 2,
        global_batch: 32,
        steps,
        config: checkpoints().adam(0.01, 0.0, false),
        ..Spec::default()
    }
}

#[test]
fn a_resumed_run_equals_an_uninterrupted_one_bit_for_bit() {
    let straight = ps_tests::uninterrupted_weights(&spec(20));

    // the same run, stopped after 12 steps (checkpoints at versions 5 and 10), then resumed
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec(12).write(dir.path());
    run_in_process(&path);
    let ck = cfg.checkpoint_dir();
    let mut names: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "shard-0-of-2-v00000005.safetensors",
            "shard-0-of-2-v00000010.safetensors",
            "shard-1-of-2-v00000005.safetensors",
            "shard-1-of-2-v00000010.safetensors",
        ],
        "every 5 steps, the 2 newest kept"
    );
    let backup = dir.path().join("checkpoints-at-12");
    copy_dir(&ck, &backup);
    let (path, cfg) = spec(20).write(dir.path());
    let run = run_in_process_with(&path, resume);
    let log = &run.shard_logs[0];
    assert!(log.contains("resuming at version 10"), "{log}");
    let worker = &run.worker_logs[0];
    assert!(worker.contains("starting at step 10 of 20"), "{worker}");
    ps_tests::assert_bit_identical(
        &cluster_weights(&cfg),
        &straight,
        "resumed at 10 (Adam state restored) vs straight",
    );
    // the metrics file goes on: steps 1..10 of the first part (11 and 12, past its
    // checkpoint, are redone), then 11..20: every step once, each with its wall-clock time
    let metrics = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl")).unwrap();
    ps_tests::assert_metrics_steps(&metrics, 20);
    // and the closing line of the run: shard 0's final evaluation (the first part's is gone)
    assert_eq!(metrics.lines().count(), 21, "{metrics}");

    // back to the checkpoints after 12 steps, but shard 1 lost its newest one: both shards
    // resume from 5, the newest version they share
    std::fs::remove_dir_all(&ck).unwrap();
    copy_dir(&backup, &ck);
    std::fs::remove_file(ck.join("shard-1-of-2-v00000010.safetensors")).unwrap();
    let log = run_in_process_with(&path, resume).shard_logs.remove(1);
    assert!(log.contains("resuming at version 5"), "{log}");
    ps_tests::assert_bit_identical(&cluster_weights(&cfg), &straight, "resumed at 5");

    // ps-launch --export: one file with PyTorch names, the same numbers
    let out = Command::new(bin_dir().join("ps-launch"))
        .arg("--config")
        .arg(&path)
        .arg("--export")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let model =
        ps_model::weights::read_model(&cfg.server.out_dir.join("model.safetensors"), &cfg.layout())
            .unwrap();
    ps_tests::assert_bit_identical(&model, &straight, "model.safetensors");
    let svg = std::fs::read_to_string(cfg.server.out_dir.join("curves.svg")).unwrap();
    assert_eq!(
        svg.matches("<polyline").count(),
        2,
        "loss and accuracy curves"
    );
}

/// A resume verifies the checkpoints' checksums: shard 1's newest file with a value changed,
/// or truncated, makes both shards resume from the newest version all hold intact (the one
/// before), naming the file skipped; the final weights equal an uninterrupted run's bit for
/// bit. With no version intact on every shard, the shard refuses to start, naming the files.
#[test]
fn a_resume_skips_a_corrupted_or_truncated_checkpoint_for_the_newest_intact_common_version() {
    let straight = ps_tests::uninterrupted_weights(&spec(20));
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec(12).write(dir.path());
    run_in_process(&path);
    let ck = cfg.checkpoint_dir();
    let backup = dir.path().join("checkpoints-at-12");
    copy_dir(&ck, &backup);
    let (path, cfg) = spec(20).write(dir.path());
    let newest = "shard-1-of-2-v00000010.safetensors";
    let damages: [(&str, ps_tests::Damage); 2] = [
        ("a value changed", ps_tests::corrupt_first_value),
        ("truncated", ps_tests::truncate_file),
    ];
    for (how, damage) in damages {
        std::fs::remove_dir_all(&ck).unwrap();
        copy_dir(&backup, &ck);
        damage(&ck.join(newest));
        let run = run_in_process_with(&path, resume);
        for log in &run.shard_logs {
            assert!(log.contains("resuming at version 5"), "{how}: {log}");
            let skipped = log
                .lines()
                .find(|l| l.contains("WARN") && l.contains("version 10 skipped: "))
                .unwrap_or_else(|| panic!("{how}: no WARN naming version 10: {log}"));
            assert!(skipped.contains(newest), "{how}: {skipped}");
        }
        ps_tests::assert_bit_identical(
            &cluster_weights(&cfg),
            &straight,
            &format!("resumed at 5, newest checkpoint {how}"),
        );
    }
    // shard 0's version 5 broken too: no version intact on both shards
    std::fs::remove_dir_all(&ck).unwrap();
    copy_dir(&backup, &ck);
    ps_tests::corrupt_first_value(&ck.join(newest));
    ps_tests::truncate_file(&ck.join("shard-0-of-2-v00000005.safetensors"));
    let (code, log) = failed_resume(&path, dir.path());
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("no version that all 2 shards have an intact checkpoint of")
            && log.contains(&format!(
                "version 10 skipped: {}",
                ck.join(newest).display()
            ))
            && log.contains("checksum mismatch")
            && log.contains("version 5 skipped: ")
            && log.contains("shard-0-of-2-v00000005.safetensors"),
        "{log}"
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Starts shard 0 of `path` with `--resume` and returns its exit code and log.
fn failed_resume(path: &Path, dir: &Path) -> (Option<i32>, String) {
    let mut cluster = LocalCluster::new(bin_dir(), path.to_path_buf(), Some(dir.join("logs")));
    let e = cluster
        .start_servers(1, &["--resume".into()], Duration::from_secs(60))
        .expect_err("the shard refuses to start");
    let code = cluster.servers[0].status.and_then(|s| s.code());
    (code, e.to_string())
}

#[test]
fn a_resume_without_usable_checkpoints_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let one_shard = |hidden: Vec<usize>, momentum: f32| Spec {
        shards: 1,
        workers: 1,
        steps: 5,
        hidden,
        config: checkpoints().sgd(0.1, momentum),
        ..Spec::default()
    };
    let (path, _) = one_shard(vec![8], 0.0).write(dir.path());
    let (code, log) = failed_resume(&path, dir.path());
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("no version that all 1 shards have a checkpoint of"),
        "{log}"
    );

    // a checkpoint written by a run with momentum: its state does not fit plain SGD
    let (path, _) = one_shard(vec![8], 0.9).write(dir.path());
    run_in_process(&path);
    let (path, _) = one_shard(vec![8], 0.0).write(dir.path());
    let (code, log) = failed_resume(&path, dir.path());
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("metadata optimizer = \"sgd(momentum 0.9)\": expected \"sgd\""),
        "{log}"
    );
    // another model (its range no longer matches)
    let (path, _) = one_shard(vec![9], 0.9).write(dir.path());
    let (code, log) = failed_resume(&path, dir.path());
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("metadata end"), "{log}");
}

/// A checkpoint directory that breaks during the run (here: replaced by a file once the shards
/// listen): each failed checkpoint is retried once, leaves no temporary file, and after
/// `[checkpoint] max_failures` consecutive failures the run fails loudly (the shards exit
/// non-zero, the launcher says why) instead of training on without checkpoints.
#[test]
fn a_run_whose_checkpoints_keep_failing_fails_loudly() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let spec = Spec {
        shards: 2,
        workers: 2,
        steps: 20,
        config: Spec::base()
            .checkpoint(1, 1)
            .checkpoint_max_failures(3)
            .checkpoint_dir(&ck),
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir.path());
    let mut cluster = LocalCluster::new(bin_dir(), path.clone(), Some(dir.path().join("logs")));
    cluster
        .start_servers(2, &[], Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    // the shards checked the directory at start; now it breaks
    std::fs::remove_dir_all(&ck).unwrap();
    std::fs::write(&ck, b"not a directory any more").unwrap();
    for r in 0..2 {
        cluster.start_worker(r, 2, &[]).unwrap();
    }
    let e = cluster
        .wait(Duration::from_secs(120), &|| false)
        .expect_err("the run fails");
    let e = e.to_string();
    assert!(e.contains("failed with exit status: 1"), "{e}");
    // the shard that reached its third failure first failed the run; the launcher then
    // stopped the other one, maybe before its own third failure: read both logs
    let logs: Vec<String> = (0..2)
        .map(|s| std::fs::read_to_string(dir.path().join(format!("logs/shard-{s}.log"))).unwrap())
        .collect();
    let log = logs.join("\n");
    assert!(log.contains("retrying once"), "{log}");
    assert!(
        logs.iter()
            .any(|l| l.contains("3 consecutive checkpoints failed (the last, of version 3")),
        "{log}"
    );
    assert!(
        !log.contains("version 4 not written"),
        "the run stopped at the third failure: {log}"
    );
    assert!(
        !cfg.server.out_dir.join("shard-0.safetensors").exists(),
        "no final weights of a failed run"
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// An output or checkpoint directory that cannot be written is refused before the shard
/// listens, naming the key and the directory (not after the last step).
#[test]
fn unwritable_output_directories_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    for (config, key) in [
        (
            Spec::base()
                .checkpoint(5, 2)
                .checkpoint_dir(file.join("ck")),
            "[checkpoint] dir",
        ),
        (Spec::base(), "[server] out_dir"),
    ] {
        let spec = Spec {
            shards: 1,
            workers: 1,
            steps: 5,
            config,
            ..Spec::default()
        };
        let (path, _) = spec.write(dir.path());
        if key == "[server] out_dir" {
            // out_dir is <dir>/out: make it a file
            let _ = std::fs::remove_dir_all(dir.path().join("out"));
            std::fs::write(dir.path().join("out"), b"x").unwrap();
        }
        let mut cluster =
            LocalCluster::new(bin_dir(), path.to_path_buf(), Some(dir.path().join("logs")));
        let e = cluster
            .start_servers(1, &[], Duration::from_secs(60))
            .expect_err("refused");
        let code = cluster.servers[0].status.and_then(|s| s.code());
        assert_eq!(code, Some(2), "{e}");
        let e = e.to_string();
        assert!(
            e.contains(&format!("{key} ")) && e.contains("is not writable"),
            "{e}"
        );
    }
}
