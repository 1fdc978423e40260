//! Global gradient-norm clipping (`[optimizer] clip_norm`) and gradient accumulation (`[train]
//! micro_batches`) on clusters in this process (shards and Rust workers as tasks on 127.0.0.1:0), against the single-process
//! reference, which clips its whole gradient as `torch.nn.utils.clip_grad_norm_` does.
//!
//! Clipping: 2 shards (a tensor of the model spans both, so the global norm needs both shards'
//! sums) and 3 workers, with a max norm that clips most steps (counted in shard 0's
//! `metrics.jsonl`), equal the reference within 1e-5 after 20 steps and differ from a run
//! without clipping by far more. Accumulation: 4 micro-batches per worker equal one process
//! with the whole global batch, for mean and sum aggregation. Bad settings are refused when
//! the config is read, before any step, naming the key and the sizes.

use ps_config::{Aggregation, Config, LossReduction, TestConfig};
use ps_tests::{Spec, cluster_weights, reference_weights, rel_diff};
use std::path::Path;

/// Float rounding only, after 20 steps.
const TOL: f64 = 1e-5;

/// Runs `spec` and returns the largest relative difference from the reference and the config.
fn run(spec: &Spec, dir: &Path) -> (f64, Config) {
    let (path, cfg) = spec.write(dir);
    ps_tests::inproc::run_in_process(&path);
    let got = cluster_weights(&cfg);
    let want = reference_weights(&cfg);
    let d = rel_diff(&cfg, &got, &want);
    eprintln!(
        "{}: largest relative weight difference from one process {d:.3e}",
        cfg.equivalence()
    );
    (d, cfg)
}

/// The clipping coefficient of each step in shard 0's metrics file.
fn clip_coefs(cfg: &Config) -> Vec<f64> {
    let text = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("clip_coef").and_then(serde_json::Value::as_f64))
        .collect()
}

fn clip_spec(config: TestConfig) -> Spec {
    Spec {
        shards: 2,
        workers: 3,
        hidden: vec![32],
        global_batch: 48,
        steps: 20,
        config: config.log_every(1),
        ..Spec::default()
    }
}

/// The run clips, equals the reference that clips, and differs from the one that does not.
fn check_clipped(config: TestConfig, max_norm: f64) {
    let dir = tempfile::tempdir().unwrap();
    let spec = clip_spec(config.clone().clip_norm(max_norm));
    let (d, cfg) = run(&spec, dir.path());
    let coefs = clip_coefs(&cfg);
    assert_eq!(coefs.len(), 20, "one clip coefficient per step: {coefs:?}");
    let clipped = coefs.iter().filter(|&&c| c < 1.0).count();
    eprintln!("max_norm {max_norm}: {clipped} of 20 steps clipped, coefficients {coefs:?}");
    assert!(clipped >= 15, "most steps clip: {clipped} of 20");
    assert!(d < TOL, "relative difference {d:.3e} >= {TOL:e}");
    let plain = Spec {
        config: config.log_every(1),
        ..spec.clone()
    };
    let unclipped = reference_weights(&plain.write(tempfile::tempdir().unwrap().path()).1);
    let off = rel_diff(&cfg, &cluster_weights(&cfg), &unclipped);
    eprintln!("the same run without clipping is {off:.3e} away");
    assert!(off > 1e-2, "clipping changed the run: {off:.3e}");
}

#[test]
fn clipped_sgd_with_momentum_equals_one_process_that_clips() {
    check_clipped(Spec::base().sgd(0.1, 0.9), 0.5);
}

#[test]
fn clipped_adam_equals_one_process_that_clips() {
    check_clipped(Spec::base().adam(0.002, 0.0, false), 0.5);
}

#[test]
fn micro_batches_equal_one_process_with_the_global_batch() {
    for (loss, aggregation, lr) in [
        (LossReduction::Mean, Aggregation::Mean, 0.1),
        (LossReduction::Sum, Aggregation::Sum, 0.005),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let spec = Spec {
            shards: 2,
            workers: 2,
            global_batch: 32,
            loss,
            aggregation,
            config: Spec::base().sgd(lr, 0.9).micro_batches(4),
            ..Spec::default()
        };
        let (d, cfg) = run(&spec, dir.path());
        assert_eq!(cfg.train.micro_batches, 4);
        let said = cfg.equivalence().to_string();
        assert!(
            said.contains("computes its batch in 4 micro-batches"),
            "{said}"
        );
        assert!(
            d < TOL,
            "{loss}/{aggregation}: relative difference {d:.3e} >= {TOL:e}"
        );
    }
}

fn refused(config: TestConfig, words: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    let spec = Spec {
        workers: 2,
        global_batch: 32,
        config,
        ..Spec::default()
    };
    std::fs::write(&path, spec.toml(&dir.path().join("out"))).unwrap();
    let e = Config::load(&path).expect_err(words).to_string();
    assert!(e.contains(words), "{e}\nexpected: {words}");
    // a shard refuses it before listening, let alone stepping
    let out = std::process::Command::new(ps_launch::bin_dir().join("ps-server"))
        .args(["--config", path.to_str().unwrap(), "--shard", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(words), "{stderr}");
}

#[test]
fn bad_clip_norms_and_micro_batches_are_refused_before_any_step() {
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e39] {
        refused(Spec::base().clip_norm(bad), "[optimizer] clip_norm = ");
        refused(
            Spec::base().clip_norm(bad),
            "expected a positive, finite number",
        );
    }
    refused(
        Spec::base().micro_batches(3),
        "[train] micro_batches = 3 does not divide the per-worker batch 16 (global batch 32 over 2 workers: [16, 16])",
    );
    refused(
        Spec::base().micro_batches(0),
        "[train] micro_batches = 0: expected 1",
    );
}
