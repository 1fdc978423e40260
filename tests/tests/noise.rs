//! The live gradient noise scale, end to end: clusters in this process (`ps_tests::inproc`); the per-rank squared gradient norms shard 0 writes to `metrics.jsonl` (summed
//! over the shards) are checked against the gradients recomputed offline for step 1, as are
//! the aggregate's norm and the first noise estimate; B_noise must be finite, positive and
//! plausible, logged with its advice; with one worker the log says once that it cannot be
//! estimated.

use ps_config::noise;
use ps_config::{Aggregation, Config, LossReduction, Transport};
use ps_data::order::BatchPlanner;
use ps_tests::inproc::{Finished, run_in_process};
use ps_tests::{Spec, mnist_train};
use serde_json::Value;

/// Every log of the run, concatenated.
fn logs(run: &Finished) -> String {
    run.shard_logs
        .iter()
        .chain(&run.worker_logs)
        .cloned()
        .collect()
}

fn metrics_lines(cfg: &Config) -> Vec<Value> {
    std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .filter(|v: &Value| v.get("final").is_none())
        .collect()
}

/// Each rank's gradient of step 0 (initial weights, its slice of the first global batch), as
/// the worker computes it, in f32.
fn step0_gradients(cfg: &Config) -> Vec<Vec<f32>> {
    let train = mnist_train();
    let n = cfg.layout().num_params();
    let params = cfg.initial_range(0..n).unwrap();
    let mut backend = ps_worker::cpu::cpu_model(&cfg.layout(), 1);
    backend.set_weights(&params).unwrap();
    let mut planner = BatchPlanner::new(cfg.data_order(train.len()));
    let w = cfg.cluster.workers;
    (0..w)
        .map(|r| {
            let (mut x, mut y) = (Vec::new(), Vec::new());
            train.gather(planner.worker_batch(0, r, w), &mut x, &mut y);
            let mut g = vec![0f32; n];
            backend
                .forward_backward(&x, &y, cfg.train.loss_reduction, &mut g)
                .unwrap();
            g
        })
        .collect()
}

fn sq(v: &[f32]) -> f64 {
    v.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

/// Runs `spec` and checks the noise figures against the offline recomputation.
fn check_run(spec: &Spec) {
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let run = run_in_process(&path);
    let lines = metrics_lines(&cfg);
    let what = format!(
        "{:?} aggregation, {:?} loss, {:?} transport",
        spec.aggregation, spec.loss, spec.transport
    );
    assert_eq!(lines.len() as u64, spec.steps, "{what}: one line per step");

    // step 1: the shards' per-rank norms (summed over the shards) against the gradients
    // recomputed here; tolerance 1e-5 relative (the same f32 gradients; only the f64
    // summation order differs, and the worker's GEMM may block differently)
    let grads = step0_gradients(&cfg);
    let first = &lines[0];
    assert_eq!(first["step"], 1);
    let by_rank = first["rank_grad_sq_norms"]
        .as_object()
        .unwrap_or_else(|| panic!("{what}: step 1 has rank_grad_sq_norms: {first}"));
    assert_eq!(by_rank.len(), spec.workers, "{what}");
    let exact: Vec<f64> = grads.iter().map(|g| sq(g)).collect();
    for (r, want) in exact.iter().enumerate() {
        let got = by_rank[&r.to_string()].as_f64().unwrap();
        assert!(
            rel(got, *want) < 1e-5,
            "{what}: rank {r}: shards say |g|² = {got}, offline {want}"
        );
    }
    // the aggregate's norm, |Σ c_r g_r|², from the same gradients and coefficients
    let samples: Vec<u32> = (0..spec.workers)
        .map(|r| {
            BatchPlanner::new(cfg.data_order(mnist_train().len()))
                .worker_batch(0, r, spec.workers)
                .len() as u32
        })
        .collect();
    let coeffs = noise::coefficients(spec.aggregation, &samples);
    let n = grads[0].len();
    let agg: Vec<f64> = (0..n)
        .map(|i| {
            grads
                .iter()
                .zip(&coeffs)
                .map(|(g, c)| c * f64::from(g[i]))
                .sum()
        })
        .collect();
    let agg_sq: f64 = agg.iter().map(|v| v * v).sum();
    let grad_norm = first["grad_norm"].as_f64().unwrap();
    assert!(
        rel(grad_norm * grad_norm, agg_sq) < 1e-4,
        "{what}: aggregate |G|² {} vs offline {agg_sq}",
        grad_norm * grad_norm
    );
    // the first smoothed estimate is step 1's own (bias-corrected average of one value):
    // McCandlish's unbiased estimators on the offline norms; tolerance 1e-3 relative (a
    // difference of norms, which amplifies their rounding)
    let ranks: Vec<noise::RankNorm> = exact
        .iter()
        .zip(&samples)
        .zip(&coeffs)
        .map(|((&sq_norm, &samples), &coeff)| noise::RankNorm {
            sq_norm,
            samples,
            coeff,
        })
        .collect();
    let e = noise::estimate(&ranks, agg_sq, spec.loss).expect("W >= 2");
    let trace = first["noise_trace_sigma"].as_f64().unwrap();
    let g2 = first["noise_grad_sq"].as_f64().unwrap();
    assert!(
        rel(trace, e.trace_sigma) < 1e-3,
        "{what}: tr(Σ) {trace} vs offline {}",
        e.trace_sigma
    );
    assert!(
        (g2 - e.grad_sq).abs()
            < 1e-3 * e.trace_sigma.abs() / samples.iter().sum::<u32>() as f64
                + 1e-3 * e.grad_sq.abs(),
        "{what}: |G|² {g2} vs offline {}",
        e.grad_sq
    );

    // every step has norms; the last step's smoothed B_noise is finite, positive and
    // plausible for an MLP on MNIST early in training (a batch of 1 to 100,000 samples)
    assert!(
        lines.iter().all(|l| l["rank_grad_sq_norms"].is_object()),
        "{what}: every step line has the per-rank norms"
    );
    let last = lines.last().unwrap();
    let b = last["b_noise"]
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: the last step has b_noise: {last}"));
    assert!(
        b.is_finite() && (1.0..1e5).contains(&b),
        "{what}: B_noise {b}"
    );
    eprintln!(
        "{what}: step 1 tr(Σ) {trace:.4e} (offline {:.4e}), last B_noise {b:.1}",
        e.trace_sigma
    );

    // the log: every log_every steps, with the batch and the advice
    let log = logs(&run);
    let noise_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("gradient noise scale: B_noise ≈"))
        .collect();
    assert!(
        noise_lines.len() as u64 >= spec.steps / 5,
        "{what}: a noise line per logged step:\n{log}"
    );
    let global = spec.global_batch;
    let last_line = noise_lines.last().unwrap();
    assert!(
        last_line.contains(&format!("a global batch of {global} is"))
            && last_line.contains("a noisy estimate, smoothed"),
        "{what}: {last_line}"
    );
    assert!(
        !log.contains("cannot be estimated with one worker"),
        "{what}"
    );
}

#[test]
fn noise_scale_matches_the_gradients_recomputed_offline() {
    // shared-memory gradients where the host allows them (folded from boards), mean
    // aggregation
    check_run(&Spec {
        steps: 30,
        ..Spec::default()
    });
    // gRPC gradients, sum aggregation (the first gradient kept as it is in the
    // accumulator), uneven batches, sum loss
    check_run(&Spec {
        steps: 30,
        global_batch: 30,
        shards: 3,
        workers: 4,
        transport: Transport::Grpc,
        aggregation: Aggregation::Sum,
        loss: LossReduction::Sum,
        config: Spec::base().sgd(0.002, 0.9),
        ..Spec::default()
    });
}

#[test]
fn one_worker_says_once_that_the_noise_scale_cannot_be_estimated() {
    let spec = Spec {
        shards: 2,
        workers: 1,
        steps: 12,
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let log = logs(&run_in_process(&path));
    assert_eq!(
        log.matches("gradient noise scale: cannot be estimated with one worker")
            .count(),
        1,
        "{log}"
    );
    assert!(!log.contains("B_noise ≈"), "{log}");
    for l in metrics_lines(&cfg) {
        assert!(
            l.get("b_noise").is_none() && l.get("noise_trace_sigma").is_none(),
            "{l}"
        );
    }
}
