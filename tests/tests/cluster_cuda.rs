//! A distributed run whose workers compute on CUDA equals the single-process (CPU) reference.
//! Needs a GPU: ignored by default, run with `--ignored` on a GPU machine (scripts/gpu-check.sh);
//! without a GPU it fails instead of passing silently.

use ps_common::config::Aggregation;
use ps_tests::{Spec, Start, cluster_weights, reference_weights, rel_diff, run_cluster};

/// CUDA and CPU gradients agree to ~1e-6 relative per step; after 20 steps the weights differ
/// by more float rounding than two CPU runs, so the tolerance is 1e-4 here (1e-5 on CPU).
const CUDA_TOL: f64 = 1e-4;

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn cuda_workers_equal_one_process() {
    let n =
        ps_worker::cuda::device_count().unwrap_or_else(|e| panic!("this test needs a GPU: {e}"));
    assert!(n > 0, "this test needs a GPU: no CUDA device");
    for aggregation in [Aggregation::Mean, Aggregation::Weighted] {
        let spec = Spec {
            global_batch: 30,
            aggregation,
            hidden: vec![100, 37],
            ..Spec::default()
        };
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
        let d = rel_diff(&cfg, &cluster_weights(&cfg), &reference_weights(&cfg));
        eprintln!("cuda workers, {aggregation}: largest relative weight difference {d:.3e}");
        if aggregation == Aggregation::Weighted {
            assert!(d < CUDA_TOL, "relative difference {d:.3e} >= {CUDA_TOL:e}");
        } else {
            assert!(d > CUDA_TOL, "mean of uneven batches must differ: {d:.3e}");
        }
    }
}
