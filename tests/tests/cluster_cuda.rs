//! A distributed run whose workers compute on CUDA equals the single-process (CPU) reference,
//! for the MLP and for the CNN. Needs a GPU, or the project's GPU-less CUDA harness
//! (`scripts/cuda-harness.sh test` runs these): ignored by default, run with `--ignored`;
//! without a GPU it fails instead of passing silently.

use ps_config::{Aggregation, Config};
use ps_tests::{Spec, Start, cluster_weights, reference_weights, rel_diff, run_cluster};

/// CUDA and CPU gradients agree to ~1e-6 relative per step; after 20 steps the weights differ
/// by more float rounding than two CPU runs, so the tolerance is 1e-4 here (1e-5 on CPU).
const CUDA_TOL: f64 = 1e-4;

/// The CNN's cluster runs few steps (the emulation is slow), so the CPU tolerance holds.
const CNN_TOL: f64 = 1e-5;

/// Runs `spec`'s cluster with every worker on `--device=cuda`, checks from worker 0's log that
/// it computed on CUDA, and returns its configuration, worker 0's log and the largest relative
/// difference of its final weights from the single-process CPU reference's.
fn cuda_cluster(spec: &Spec) -> (Config, String, f64) {
    let n =
        ps_worker::cuda::device_count().unwrap_or_else(|e| panic!("this test needs a GPU: {e}"));
    assert!(n > 0, "this test needs a GPU: no CUDA device");
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let start = Start {
        worker_args: vec!["--device=cuda".into()],
        ..Start::default()
    };
    run_cluster(&path, &cfg, &start);
    let log = std::fs::read_to_string(dir.path().join("logs/worker-0.log")).unwrap();
    assert!(
        log.contains("device cuda: using cuda:"),
        "workers ran on the GPU:\n{log}"
    );
    // under the GPU-less harness each process says so at exit (kernel launches, sgemm calls)
    if let Some(l) = log
        .lines()
        .find(|l| l.contains("CUDA-HARNESS: CPU emulation"))
    {
        eprintln!("worker 0: {l}");
    }
    // over shared memory the worker's GPU reads and writes the boards directly (registered)
    if log.contains("tensors via [\"shared memory\"") {
        assert!(
            log.contains("shared-memory boards registered for the device's DMA"),
            "worker 0 registered the boards:\n{log}"
        );
        // and its steps copied nothing on the host, either way
        assert!(
            log.contains("host bytes copied per step: pull 0, push 0"),
            "worker 0's steps copied no host bytes:\n{log}"
        );
        // the harness counts the copies that ran on registered memory
        if let Some(l) = log
            .lines()
            .find(|l| l.contains("copies by DMA on registered"))
        {
            let n: u64 = l
                .split(" copies by DMA")
                .next()
                .and_then(|h| h.rsplit(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            assert!(n > 0, "no copy ran on registered memory: {l}");
        }
    }
    let d = rel_diff(&cfg, &cluster_weights(&cfg), &reference_weights(&cfg));
    (cfg, log, d)
}

#[test]
#[ignore = "needs a CUDA GPU or the CUDA harness: run with --ignored (scripts/cuda-harness.sh test)"]
fn cuda_workers_equal_one_process() {
    for aggregation in [Aggregation::Mean, Aggregation::Weighted] {
        let spec = Spec {
            global_batch: 30,
            aggregation,
            hidden: vec![100, 37],
            ..Spec::default()
        };
        let (_, _, d) = cuda_cluster(&spec);
        eprintln!("cuda workers, {aggregation}: largest relative weight difference {d:.3e}");
        if aggregation == Aggregation::Weighted {
            assert!(d < CUDA_TOL, "relative difference {d:.3e} >= {CUDA_TOL:e}");
        } else {
            assert!(d > CUDA_TOL, "mean of uneven batches must differ: {d:.3e}");
        }
    }
}

/// The CNN (convolutions, max-pooling, the linear head: every CNN kernel and cuBLAS call) on
/// CUDA workers, 2 shards and 2 workers, equals the CPU single process after 6 steps.
#[test]
#[ignore = "needs a CUDA GPU or the CUDA harness: run with --ignored (scripts/cuda-harness.sh test)"]
fn cuda_cnn_workers_equal_one_process() {
    let spec = Spec {
        shards: 2,
        workers: 2,
        hidden: vec![16],
        global_batch: 16,
        steps: 6,
        // each worker's final evaluation (its half of the 10,000 test images through the CNN on
        // the emulation) can outlast the default 30 s the shards wait for the leaves under load
        config: Spec::base().sgd(0.02, 0.9).cnn(&[4, 8]).linger_secs(300.0),
        ..Spec::default()
    };
    let (cfg, log, d) = cuda_cluster(&spec);
    assert!(cfg.model.cnn.is_some(), "the run trains the CNN");
    if log.contains("CUDA-HARNESS: CPU emulation") {
        // the harness lists the kernels each process launched: the CNN's ran on the "GPU"
        for k in [
            "im2col_f32",
            "col2im_f32",
            "maxpool2_f32",
            "maxpool2_backward_f32",
        ] {
            assert!(
                log.contains(&format!("CUDA-HARNESS:   {k} x")),
                "worker 0 launched {k}:\n{log}"
            );
        }
    }
    let want = reference_weights(&cfg);
    let init = cfg.layout().init_range(cfg.train.seed, 0..want.len());
    let moved = rel_diff(&cfg, &init, &want);
    assert!(moved > 1e-3, "training moved the weights: {moved:.3e}");
    eprintln!("cuda cnn workers, mean/mean: largest relative weight difference {d:.3e}");
    assert!(d < CNN_TOL, "relative difference {d:.3e} >= {CNN_TOL:e}");
}
