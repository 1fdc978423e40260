//! CPU-versus-CUDA parity of the one MLP (`ps_worker::model::Mlp`) on its two devices:
//! `Mlp<CudaDevice>` against `Mlp<CpuDevice>` (the CPU path is itself checked exactly against an
//! independent PyTorch computation). Gradients (per tensor, relative error
//! `max|cuda - cpu| / max|cpu|` below 1e-4), loss sums (relative error below 1e-4), correct
//! counts and `evaluate` (exactly equal), on random inputs for several shapes, batch sizes
//! (growing and shrinking, so device buffers are reused) and both loss reductions.
//!
//! Every parity test needs a CUDA GPU, so each is `#[ignore]`d: on a machine without one they
//! show up as ignored, never as passed (only `batches_keep_their_margins`, which checks this
//! file's input generator on the CPU, runs everywhere). Run them on a GPU machine with
//! `cargo test --release -p ps-worker --test cuda_parity -- --ignored --test-threads=1`, or
//! through `scripts/gpu-check.sh` from a prebuilt test executable. Run with `--ignored` on a
//! machine without a usable GPU, they fail with the reason. `PS_CUDA_DEVICE=N` picks the device
//! (default 0).
//!
//! The inputs are random but kept away from the two places where an f32 rounding difference
//! between cuBLAS and the CPU matmul changes a result discontinuously: a hidden pre-activation
//! within `MARGIN` of the ReLU kink (the mask would flip) and a row whose two largest logits are
//! within `MARGIN` (the argmax would flip). A row that comes that close is drawn again. The
//! pre-activations of hidden layer `l` are the logits of the CPU MLP of the layout's first
//! `l + 1` layers (whose parameters are the first ones of the flat vector), so no third copy of
//! the MLP is needed to find them.

use ps_config::LossReduction;
use ps_model::layout::{MlpLayout, splitmix64};
use ps_worker::backend::{Backend, BackendError, StepStats};
use ps_worker::cpu::CpuBackend;
use ps_worker::cuda::{CudaBackend, CudaDevice, EVAL_ROWS};
use ps_worker::ops::Device;

/// Largest accepted relative error of a gradient tensor or a loss sum.
const TOL: f64 = 1e-4;
/// Smallest accepted |pre-activation| of a hidden unit and gap between the two largest logits.
const MARGIN: f32 = 1e-5;

#[path = "cuda_parity/cnn.rs"]
mod cnn;

fn ordinal() -> usize {
    std::env::var("PS_CUDA_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The CUDA backend, or a panic saying why there is none (so `--ignored` without a GPU fails).
fn gpu(layout: &MlpLayout) -> CudaBackend {
    match CudaBackend::new(ordinal(), layout.clone()) {
        // machine code for the device, not PTX left to the driver's JIT (which needs a
        // driver at least as new as NVRTC)
        Ok(b) if b.arch().ends_with(" cubin") => b,
        Ok(b) => panic!("the kernels were loaded as {}, not as a cubin", b.arch()),
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

/// Gap between the largest and the second largest value (infinite with one class).
fn top_gap(logits: &[f32]) -> f32 {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
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

/// Index of the largest value, the first on ties.
fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |m, (j, &x)| if x > m.1 { (j, x) } else { m },
        )
        .0
}

/// The CPU MLPs of the first 1, 2, ..., all layers of `layout`, with the matching prefix of
/// `w`: the logits of prefix `l` are the pre-activations of layer `l` of the whole MLP.
fn prefixes(layout: &MlpLayout, w: &[f32]) -> Vec<CpuBackend> {
    (2..=layout.dims.len())
        .map(|end| {
            let sub = MlpLayout::new(&layout.dims[..end]);
            assert_eq!(sub.tensors[..], layout.tensors[..sub.tensors.len()]);
            let mut b = CpuBackend::new(sub.clone(), 1);
            b.set_weights(&w[..sub.num_params()]).unwrap();
            b
        })
        .collect()
}

/// `len` values uniform in [-1, 1), a function of `seed`.
fn rand(seed: u64, len: usize) -> Vec<f32> {
    (0..len as u64).map(|i| uniform(seed, i)).collect()
}

/// A device buffer holding `v`.
fn on_gpu(gpu: &mut CudaDevice, v: &[f32]) -> cudarc::driver::CudaSlice<f32> {
    let mut b = gpu.alloc(v.len()).unwrap();
    gpu.upload(v, CudaDevice::view_mut(&mut b, 0..v.len()))
        .unwrap();
    b
}

/// The first `len` values of a device buffer.
fn back(gpu: &mut CudaDevice, b: &cudarc::driver::CudaSlice<f32>, len: usize) -> Vec<f32> {
    let mut v = vec![f32::NAN; len];
    gpu.download(CudaDevice::view(b, 0..len), &mut v).unwrap();
    v
}

/// For each row of `x`, its logits when every hidden pre-activation is at least `MARGIN` from
/// 0 and the two largest logits are at least `MARGIN` apart; `None` otherwise.
fn checked_logits(prefixes: &mut [CpuBackend], x: &[f32], inputs: usize) -> Vec<Option<Vec<f32>>> {
    let n = x.len() / inputs;
    let mut ok = vec![true; n];
    let (last, hidden) = prefixes.split_last_mut().unwrap();
    for p in hidden {
        let width = *p.mlp_layout().dims.last().unwrap();
        let z = p.logits(x).unwrap();
        for (r, row) in z.chunks(width).enumerate() {
            ok[r] &= row.iter().all(|v| v.abs() >= MARGIN);
        }
    }
    let classes = *last.mlp_layout().dims.last().unwrap();
    let z = last.logits(x).unwrap();
    z.chunks(classes)
        .zip(ok)
        .map(|(row, ok)| (ok && top_gap(row) >= MARGIN).then(|| row.to_vec()))
        .collect()
}

/// A batch of `n` rows whose hidden pre-activations and logit gaps all exceed `MARGIN`, with
/// random labels; also the number of rows the CPU logits classify correctly.
fn batch(layout: &MlpLayout, w: &[f32], n: usize, seed: u64) -> (Vec<f32>, Vec<u8>, u64) {
    let inputs = layout.dims[0];
    let classes = *layout.dims.last().unwrap();
    let mut prefixes = prefixes(layout, w);
    let draw = |i: u64, attempt: u64| -> Vec<f32> {
        (0..inputs as u64)
            .map(|j| uniform(seed ^ (attempt << 48), (i << 20) ^ j))
            .collect()
    };
    let mut x: Vec<f32> = (0..n as u64).flat_map(|i| draw(i, 0)).collect();
    let mut logits: Vec<Option<Vec<f32>>> = vec![None; n];
    let mut todo: Vec<usize> = (0..n).collect();
    for attempt in 0..1000u64 {
        if todo.is_empty() {
            break;
        }
        if attempt > 0 {
            for &i in &todo {
                x[i * inputs..(i + 1) * inputs].copy_from_slice(&draw(i as u64, attempt));
            }
        }
        let rows: Vec<f32> = todo
            .iter()
            .flat_map(|&i| x[i * inputs..(i + 1) * inputs].iter().copied())
            .collect();
        let got = checked_logits(&mut prefixes, &rows, inputs);
        let mut still = Vec::new();
        for (&i, l) in todo.iter().zip(got) {
            match l {
                Some(l) => logits[i] = Some(l),
                None => still.push(i),
            }
        }
        todo = still;
    }
    assert!(
        todo.is_empty(),
        "no rows with margin {MARGIN} found for {todo:?}"
    );
    let mut labels = Vec::with_capacity(n);
    let mut correct = 0;
    for (i, l) in logits.iter().enumerate() {
        let l = l.as_ref().unwrap();
        // Labels: mostly random, every fourth one the argmax so accuracy is not ~1/classes.
        let y = if i % 4 == 0 {
            argmax(l)
        } else {
            (splitmix64(seed.wrapping_mul(31) ^ i as u64) % classes as u64) as usize
        };
        correct += u64::from(argmax(l) == y);
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
                "{what}: correct count vs the argmax of the CPU logits"
            );
        }
    }
}

/// The generator of the parity inputs, on the CPU alone: the rows keep their margins (checked
/// again on the whole MLP's logits), the count it returns is what `evaluate` counts, and a
/// quarter of the labels are the predicted class.
#[test]
fn batches_keep_their_margins() {
    for dims in [&[13, 7, 3][..], &[784, 100, 37, 10]] {
        let layout = MlpLayout::new(dims);
        let w = layout.init_range(11, 0..layout.num_params());
        let n = 300;
        let (x, labels, correct) = batch(&layout, &w, n, 11);
        assert_eq!((x.len(), labels.len()), (n * dims[0], n));
        let mut cpu = CpuBackend::new(layout.clone(), 1);
        cpu.set_weights(&w).unwrap();
        assert_eq!(cpu.evaluate(&x, &labels).unwrap(), correct);
        assert!(correct >= (n / 4) as u64, "{correct}");
        let classes = *dims.last().unwrap();
        let logits = cpu.logits(&x).unwrap();
        assert!(logits.chunks(classes).all(|r| top_gap(r) >= MARGIN));
        let mut pre = prefixes(&layout, &w);
        assert!(
            checked_logits(&mut pre, &x, dims[0])
                .iter()
                .all(Option::is_some)
        );
        // the same seed gives the same batch
        assert_eq!(batch(&layout, &w, n, 11).0, x);
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
    assert_eq!(c_cpu, want, "cpu evaluate vs the argmax of the CPU logits");
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
    // The overlapped step hands on one range per layer, last layer first, each already final
    // (downloaded before the call), and computes the same bits.
    let mut g4 = vec![f32::NAN; p];
    let mut seen = Vec::new();
    let s4 = cuda
        .forward_backward_overlapped(
            &x,
            &labels,
            LossReduction::Mean,
            &mut g4,
            &mut |start, tail, st| {
                seen.push((start, tail.to_vec(), st));
            },
        )
        .unwrap();
    assert_eq!(s4, s1);
    assert_eq!(bits(&g4), bits(&g1), "overlapped step differs");
    let starts: Vec<usize> = seen.iter().map(|(s, _, _)| *s).collect();
    let want: Vec<usize> = (0..layout.num_layers())
        .rev()
        .map(|l| layout.layer(l).0.start)
        .collect();
    assert_eq!(starts, want);
    for (start, tail, st) in &seen {
        assert_eq!(
            bits(tail),
            bits(&g1[*start..]),
            "range from {start} handed on before it was final"
        );
        assert_eq!(*st, s1);
    }
    // evaluate (argmax kernel, separate statistics) counts what the step counted.
    let before = cuda.evaluate(&x, &labels).unwrap();
    assert_eq!(before, s1.correct);
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

/// The harness's counters of queued and run operations (`cuda_harness_ops_queued`,
/// `cuda_harness_ops_run` in ps-worker/cuda-harness/harness.cpp), when the CUDA driver of this
/// process is the harness; `None` on a real driver.
fn harness_counters() -> Option<(extern "C" fn() -> i64, extern "C" fn() -> i64)> {
    // SAFETY: dlopen of the driver library the backend has already loaded (the same file,
    // so the same instance) and dlsym of two functions taking nothing and returning a long.
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW);
        if h.is_null() {
            return None;
        }
        let q = libc::dlsym(h, c"cuda_harness_ops_queued".as_ptr());
        let r = libc::dlsym(h, c"cuda_harness_ops_run".as_ptr());
        if q.is_null() || r.is_null() {
            return None;
        }
        Some((
            std::mem::transmute::<*mut libc::c_void, extern "C" fn() -> i64>(q),
            std::mem::transmute::<*mut libc::c_void, extern "C" fn() -> i64>(r),
        ))
    }
}

/// The gradient is handed on layer by layer, last layer first, while the device still has the
/// lower layers' backward queued: each layer's range is copied to pinned host memory right
/// behind its backward and only that copy is waited for. On the harness (which runs queued
/// work only when the host must see it) the first range arrives with operations still
/// queued; before, the first download synchronised the whole stream, so nothing was left.
/// On a GPU the overlap cannot be observed this way; the ranges and values are checked.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn the_gradient_is_handed_on_while_backward_runs() {
    let layout = MlpLayout::new(&[13, 11, 9, 7, 3]);
    let p = layout.num_params();
    let w = layout.init_range(21, 0..p);
    let mut cpu = CpuBackend::new(layout.clone(), 1);
    let mut cuda = gpu(&layout);
    cpu.set_weights(&w).unwrap();
    cuda.set_weights(&w).unwrap();
    let (x, labels, _) = batch(&layout, &w, 17, 5);
    let mut want = vec![0.0f32; p];
    let s_cpu = cpu
        .forward_backward(&x, &labels, LossReduction::Mean, &mut want)
        .unwrap();
    let counters = harness_counters();
    let mut got = vec![f32::NAN; p];
    let mut seen = Vec::new();
    let s = cuda
        .forward_backward_overlapped(
            &x,
            &labels,
            LossReduction::Mean,
            &mut got,
            &mut |start, tail, stats| {
                let pending = counters.map(|(q, r)| q() - r());
                seen.push((start, tail.len(), stats, pending));
            },
        )
        .unwrap();
    let starts: Vec<usize> = seen.iter().map(|t| t.0).collect();
    let want_starts: Vec<usize> = (0..layout.num_layers())
        .rev()
        .map(|l| layout.layer(l).0.start)
        .collect();
    assert_eq!(starts, want_starts, "one call per layer, last layer first");
    for &(start, len, stats, _) in &seen {
        assert_eq!(
            len,
            p - start,
            "each call sees the gradient from its start on"
        );
        assert_eq!(stats, s, "every call carries the step's figures");
    }
    assert!(rel_err(&got, &want) < TOL, "{}", rel_err(&got, &want));
    assert!((s.loss_sum - s_cpu.loss_sum).abs() < TOL * s_cpu.loss_sum);
    if counters.is_some() {
        let pending: Vec<i64> = seen.iter().map(|t| t.3.unwrap()).collect();
        eprintln!("operations still queued at each hand-over: {pending:?}");
        assert!(
            pending[0] > 0 && pending.windows(2).all(|w| w[0] > w[1]),
            "the last layer's gradient must arrive while the lower layers' work is still queued: {pending:?}"
        );
    }
}

/// A gated pull on the GPU: the pull writes the device's pinned staging memory while the
/// forward pass queues an upload of each piece as it is published (a layer of more than one
/// piece, the last shard arriving slowly, two steps so the staging memory is reused): the
/// gradient and loss are those of `set_weights` of the same values, bit for bit.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn gated_pull_uploads_pieces_as_they_arrive() {
    use ps_worker::model::UPLOAD_PIECE;
    use std::time::Duration;
    let layout = MlpLayout::new(&[1100, 1000, 3]);
    let p = layout.num_params();
    assert!(layout.layer(0).0.len() > UPLOAD_PIECE, "fc1 fits one piece");
    let mut cuda = gpu(&layout);
    let shards = vec![0..p / 3, p / 3..p];
    for seed in [1u64, 2] {
        let w = layout.init_range(seed, 0..p);
        let (x, labels, _) = batch(&layout, &w, 8, seed);
        cuda.set_weights(&w).unwrap();
        let mut want = vec![0f32; p];
        let want_stats = cuda
            .forward_backward(&x, &labels, LossReduction::Mean, &mut want)
            .unwrap();
        // the previous version on the device: every value different
        let old: Vec<f32> = w.iter().map(|v| v * 3.0 + 1.0).collect();
        cuda.set_weights(&old).unwrap();
        cuda.take_copy_times().unwrap();
        let gate = cuda
            .open_gate(seed, shards.clone(), Duration::from_secs(60))
            .expect("the CUDA backend gates a pull through its staging memory");
        let mut got = vec![0f32; p];
        let stats = std::thread::scope(|s| {
            for (i, pause) in [(0, 0), (1, 300)] {
                let (g, w) = (&gate, &w);
                s.spawn(move || g.deliver(i, w, 40_000, Duration::from_micros(pause)));
            }
            cuda.forward_backward(&x, &labels, LossReduction::Mean, &mut got)
                .unwrap()
        });
        cuda.close_gate();
        // the step's copies: the weights and the batch up, the gradient down
        let c = cuda
            .take_copy_times()
            .unwrap()
            .expect("a GPU counts its copies");
        assert_eq!(c.up_bytes, 4 * (p + x.len()) as u64, "seed {seed}");
        assert_eq!(c.down_bytes, 4 * p as u64, "seed {seed}");
        assert!(c.up > Duration::ZERO && c.down > Duration::ZERO, "{c:?}");
        eprintln!("gated pull, seed {seed}: copies {c:?}");
        let none = cuda.take_copy_times().unwrap().unwrap();
        assert_eq!(none, Default::default(), "counted twice");
        assert_eq!(stats, want_stats, "seed {seed}");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert!(bits(&got) == bits(&want), "seed {seed}: gradients differ");
        eprintln!("gated pull, seed {seed}: gradient equals set_weights' bit for bit");
    }
}
