//! CPU-versus-CUDA parity of the MLP backends: gradients (per tensor, relative error
//! `max|cuda - cpu| / max|cpu|` below 1e-4), loss sums (relative error below 1e-4), correct
//! counts and `evaluate` (exactly equal), on random inputs for several shapes, batch sizes
//! and both loss reductions.
//!
//! Every test needs a CUDA GPU, so every test is `#[ignore]`d: on a machine without one they
//! show up as ignored, never as passed. Run them on a GPU machine with
//! `cargo test --release -p ps-worker --test cuda_parity -- --ignored --test-threads=1`, or
//! through `scripts/gpu-check.sh` from a prebuilt test executable. Run with `--ignored` on a
//! machine without a usable GPU, they fail with the reason. `PS_CUDA_DEVICE=N` picks the device
//! (default 0).
//!
//! The inputs are random but kept away from the two places where an f32 rounding difference
//! between cuBLAS and the CPU matmul changes a result discontinuously: a hidden pre-activation
//! within `MARGIN` of the ReLU kink (the mask would flip) and a row whose two largest logits are
//! within `MARGIN` (the argmax would flip). A row that comes that close, measured in f64, is
//! drawn again.

use ps_common::config::LossReduction;
use ps_common::layout::{MlpLayout, splitmix64};
use ps_worker::backend::{Backend, BackendError, StepStats};
use ps_worker::cpu::CpuBackend;
use ps_worker::cuda::{CudaBackend, EVAL_ROWS};

/// Largest accepted relative error of a gradient tensor or a loss sum.
const TOL: f64 = 1e-4;
/// Smallest accepted |pre-activation| of a hidden unit and gap between the two largest logits.
const MARGIN: f64 = 1e-5;

fn ordinal() -> usize {
    std::env::var("PS_CUDA_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The CUDA backend, or a panic saying why there is none (so `--ignored` without a GPU fails).
fn gpu(layout: &MlpLayout) -> CudaBackend {
    match CudaBackend::new(ordinal(), layout.clone()) {
        Ok(b) => b,
        Err(e) => panic!(
            "these tests need a usable CUDA GPU (cuda:{}) and there is none: {e}; run them on a GPU machine \
             (scripts/gpu-check.sh)",
            ordinal()
        ),
    }
}

/// Uniform in [-1, 1), a function of (seed, counter).
fn uniform(seed: u64, i: u64) -> f32 {
    let z = splitmix64(splitmix64(seed) ^ i);
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// f64 forward pass of one row; returns the hidden pre-activations' smallest magnitude and the
/// logits.
fn forward_row_f64(layout: &MlpLayout, w: &[f32], x: &[f32]) -> (f64, Vec<f64>) {
    let mut a: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let mut min_abs = f64::INFINITY;
    let layers = layout.num_layers();
    for l in 0..layers {
        let (wr, br) = layout.layer(l);
        let (fan_in, fan_out) = (layout.dims[l], layout.dims[l + 1]);
        let wt = &w[wr];
        let b = &w[br];
        let mut z = vec![0.0f64; fan_out];
        for (j, zj) in z.iter_mut().enumerate() {
            let row = &wt[j * fan_in..(j + 1) * fan_in];
            *zj = f64::from(b[j])
                + row
                    .iter()
                    .zip(&a)
                    .map(|(&wv, &av)| f64::from(wv) * av)
                    .sum::<f64>();
        }
        if l + 1 < layers {
            min_abs = z.iter().fold(min_abs, |m, v| m.min(v.abs()));
            z.iter_mut().for_each(|v| *v = v.max(0.0));
        }
        a = z;
    }
    (min_abs, a)
}

/// Gap between the largest and the second largest logit (infinite with one class).
fn top_gap(logits: &[f64]) -> f64 {
    let (mut first, mut second) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    for &v in logits {
        if v > first {
            second = first;
            first = v;
        } else if v > second {
            second = v;
        }
    }
    first - second
}

fn argmax(v: &[f64]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f64::NEG_INFINITY),
            |m, (j, &x)| if x > m.1 { (j, x) } else { m },
        )
        .0
}

/// A batch of `n` rows whose hidden pre-activations and logit gaps all exceed `MARGIN`, with
/// random labels; also the number of rows the f64 reference classifies correctly.
fn batch(layout: &MlpLayout, w: &[f32], n: usize, seed: u64) -> (Vec<f32>, Vec<u8>, u64) {
    let inputs = layout.dims[0];
    let classes = *layout.dims.last().unwrap();
    let mut x = Vec::with_capacity(n * inputs);
    let mut labels = Vec::with_capacity(n);
    let mut correct = 0;
    for i in 0..n as u64 {
        let mut attempt = 0u64;
        let (row, logits) = loop {
            let row: Vec<f32> = (0..inputs as u64)
                .map(|j| uniform(seed ^ (attempt << 48), (i << 20) ^ j))
                .collect();
            let (min_abs, logits) = forward_row_f64(layout, w, &row);
            if min_abs >= MARGIN && top_gap(&logits) >= MARGIN {
                break (row, logits);
            }
            attempt += 1;
            assert!(attempt < 1000, "no row with margin {MARGIN} found");
        };
        // Labels: mostly random, every fourth one the reference argmax so accuracy is not ~1/classes.
        let y = if i % 4 == 0 {
            argmax(&logits)
        } else {
            (splitmix64(seed.wrapping_mul(31) ^ i) % classes as u64) as usize
        };
        correct += u64::from(argmax(&logits) == y);
        x.extend_from_slice(&row);
        labels.push(y as u8);
    }
    (x, labels, correct)
}

/// `max|a - b| / max|b|` (0 when both are all zeros).
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(&p, &q)| (f64::from(p) - f64::from(q)).abs())
        .fold(0.0, f64::max);
    let scale = b.iter().map(|&q| f64::from(q).abs()).fold(0.0, f64::max);
    if diff == 0.0 { 0.0 } else { diff / scale }
}

/// Runs one batch through both backends and checks every tensor, the loss sum and the count.
fn check_step(
    layout: &MlpLayout,
    cpu: &mut CpuBackend,
    cuda: &mut CudaBackend,
    x: &[f32],
    labels: &[u8],
    reduction: LossReduction,
    what: &str,
) -> StepStats {
    let p = layout.num_params();
    let mut g_cpu = vec![0.0f32; p];
    let mut g_gpu = vec![f32::NAN; p];
    let s_cpu = cpu
        .forward_backward(x, labels, reduction, &mut g_cpu)
        .unwrap();
    let s_gpu = cuda
        .forward_backward(x, labels, reduction, &mut g_gpu)
        .unwrap();
    assert!(
        g_gpu.iter().all(|v| v.is_finite()),
        "{what}: non-finite gradient from CUDA"
    );
    let mut report = Vec::new();
    for t in &layout.tensors {
        let e = rel_err(&g_gpu[t.range()], &g_cpu[t.range()]);
        report.push(format!("{} {e:.2e}", t.name));
        assert!(
            e < TOL,
            "{what}: {} relative error {e:.3e} >= {TOL:e} ({})",
            t.name,
            report.join(", ")
        );
    }
    let loss_err =
        (s_gpu.loss_sum - s_cpu.loss_sum).abs() / s_cpu.loss_sum.abs().max(f64::MIN_POSITIVE);
    assert!(
        loss_err < TOL,
        "{what}: loss sum cuda {} vs cpu {} (relative error {loss_err:.3e})",
        s_gpu.loss_sum,
        s_cpu.loss_sum
    );
    assert_eq!(
        s_gpu.correct, s_cpu.correct,
        "{what}: correct count cuda vs cpu"
    );
    eprintln!("{what}: loss rel err {loss_err:.2e}; {}", report.join(", "));
    s_gpu
}

/// Both reductions at each batch size for `dims`, on one CUDA backend (so buffers are reused
/// and grown in the order of `batches`).
fn parity(dims: &[usize], batches: &[usize], seed: u64) {
    let layout = MlpLayout::new(dims);
    let w = layout.init_range(seed, 0..layout.num_params());
    let mut cpu = CpuBackend::new(layout.clone(), 2);
    let mut cuda = gpu(&layout);
    cpu.set_weights(&w).unwrap();
    cuda.set_weights(&w).unwrap();
    for &n in batches {
        let (x, labels, want_correct) = batch(&layout, &w, n, seed ^ n as u64);
        for reduction in [LossReduction::Mean, LossReduction::Sum] {
            let what = format!("{dims:?} batch {n} {reduction}");
            let s = check_step(&layout, &mut cpu, &mut cuda, &x, &labels, reduction, &what);
            assert_eq!(
                s.correct, want_correct,
                "{what}: correct count vs the f64 reference"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn parity_784_100_37_10() {
    parity(&[784, 100, 37, 10], &[1, 33, 1024], 11);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn parity_13_7_3() {
    parity(&[13, 7, 3], &[1, 33, 1024], 12);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn parity_shrinking_batches_reuse_buffers() {
    // Largest first: later, smaller batches run in buffers sized for 1024 rows.
    parity(&[13, 7, 3], &[1024, 33, 1, 500], 13);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn parity_no_hidden_layer() {
    parity(&[5, 3], &[1, 33, 1024], 14);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn parity_many_classes_and_odd_widths() {
    // More classes than a warp has lanes (labels are u8, so at most 256) (the softmax loops over 32-column strides and the
    // argmax ties across lanes); widths that are not multiples of 32; four layers.
    parity(&[31, 65, 33, 200], &[1, 33, 257], 15);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn parity_784_1024_1024_10() {
    parity(&[784, 1024, 1024, 10], &[64, 256], 16);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn evaluate_parity_across_chunks() {
    let layout = MlpLayout::new(&[784, 100, 37, 10]);
    let w = layout.init_range(21, 0..layout.num_params());
    let mut cpu = CpuBackend::new(layout.clone(), 2);
    let mut cuda = gpu(&layout);
    cpu.set_weights(&w).unwrap();
    cuda.set_weights(&w).unwrap();
    let n = 2 * EVAL_ROWS + 5;
    let (x, labels, want) = batch(&layout, &w, n, 21);
    let c_cpu = cpu.evaluate(&x, &labels).unwrap();
    let c_gpu = cuda.evaluate(&x, &labels).unwrap();
    assert_eq!(c_cpu, want, "cpu vs the f64 reference");
    assert_eq!(c_gpu, c_cpu, "cuda vs cpu on {n} rows");
    // The first 33 rows only, and none.
    let inputs = layout.dims[0];
    assert_eq!(
        cuda.evaluate(&x[..33 * inputs], &labels[..33]).unwrap(),
        cpu.evaluate(&x[..33 * inputs], &labels[..33]).unwrap()
    );
    assert_eq!(cuda.evaluate(&[], &[]).unwrap(), 0);
    // Training after evaluating (buffers now hold EVAL_ROWS rows) still matches.
    check_step(
        &layout,
        &mut cpu,
        &mut cuda,
        &x[..64 * inputs],
        &labels[..64],
        LossReduction::Mean,
        "after evaluate",
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn new_weights_other_threads_empty_batches_and_bad_shapes() {
    let layout = MlpLayout::new(&[13, 7, 3]);
    let mut cpu = CpuBackend::new(layout.clone(), 1);
    let mut cuda = gpu(&layout);
    assert!(
        cuda.name().starts_with(&format!("cuda:{} (", ordinal())),
        "{}",
        cuda.name()
    );
    // Weights replaced between steps, each step from a different thread.
    for seed in [1u64, 2, 3] {
        let w = layout.init_range(seed, 0..layout.num_params());
        let (x, labels, _) = batch(&layout, &w, 40, seed);
        cpu.set_weights(&w).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                cuda.set_weights(&w).unwrap();
                check_step(
                    &layout,
                    &mut cpu,
                    &mut cuda,
                    &x,
                    &labels,
                    LossReduction::Sum,
                    &format!("thread, seed {seed}"),
                );
            });
        });
    }
    // Deterministic: the same batch twice gives the same bits, and the split API
    // (upload_batch, compute_uploaded, download_gradient) the same as forward_backward.
    let w = layout.init_range(9, 0..layout.num_params());
    let (x, labels, _) = batch(&layout, &w, 70, 9);
    cuda.set_weights(&w).unwrap();
    let p = layout.num_params();
    let (mut g1, mut g2, mut g3) = (vec![0.0f32; p], vec![0.0f32; p], vec![0.0f32; p]);
    let s1 = cuda
        .forward_backward(&x, &labels, LossReduction::Mean, &mut g1)
        .unwrap();
    let s2 = cuda
        .forward_backward(&x, &labels, LossReduction::Mean, &mut g2)
        .unwrap();
    cuda.upload_batch(&x, &labels).unwrap();
    let s3 = cuda.compute_uploaded(LossReduction::Mean).unwrap();
    cuda.download_gradient(&mut g3).unwrap();
    assert_eq!((s1, s1), (s2, s3));
    let bits = |g: &[f32]| g.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&g1), bits(&g2), "two runs of the same batch differ");
    assert_eq!(
        bits(&g1),
        bits(&g3),
        "upload_batch + compute_uploaded + download_gradient differs"
    );
    // The trait object is Send (the worker moves it into its compute thread).
    let boxed: Box<dyn Backend> = Box::new(cuda);
    let mut cuda = std::thread::spawn(move || boxed).join().unwrap();
    let mut g = vec![1.0f32; layout.num_params()];
    assert_eq!(
        cuda.forward_backward(&[], &[], LossReduction::Mean, &mut g)
            .unwrap(),
        StepStats::default()
    );
    assert!(g.iter().all(|&v| v == 0.0));
    let e = cuda
        .forward_backward(&[1.0], &[0], LossReduction::Mean, &mut g)
        .unwrap_err();
    assert!(matches!(e, BackendError::Shape(_)), "{e}");
    let e = cuda
        .forward_backward(&[0.0; 13], &[3], LossReduction::Mean, &mut g)
        .unwrap_err();
    assert!(e.to_string().contains("label 3: expected < 3"), "{e}");
    assert!(matches!(
        cuda.set_weights(&[0.0; 5]).unwrap_err(),
        BackendError::Shape(_)
    ));
    let mut short = vec![0.0f32; 3];
    assert!(matches!(
        cuda.forward_backward(&[0.0; 13], &[1], LossReduction::Mean, &mut short)
            .unwrap_err(),
        BackendError::Shape(_)
    ));
    // An ordinal past the last device is a one-line NoGpu error.
    let e = CudaBackend::new(4096, layout.clone()).unwrap_err();
    assert!(
        matches!(e, BackendError::NoGpu(_)) && !e.to_string().contains('\n'),
        "{e}"
    );
}
