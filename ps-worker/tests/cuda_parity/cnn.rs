//! The CNN's device operations and step on the CUDA device against the CPU device: im2col,
//! col2im, pooling, the per-channel bias, the products of a whole batch in one strided-batched
//! cuBLAS call (and their sum over the batch, chunk by chunk), and a whole CNN step; under the
//! CUDA harness also that a step makes the same number of cuBLAS calls at any batch size.

use super::*;
/// The convolution and pooling operations of the CNN (im2col, col2im, 2x2 max-pooling and its
/// gradient) on the CUDA device equal the CPU device's, for geometries with and without
/// padding, strides that do and do not tile the input, odd pooling edges, ties and NaNs. The
/// copies and the per-element sums run in the same order on both, so equal to the bit is
/// expected; the bound is the 1e-4 per tensor.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn conv_and_pool_operations_parity() {
    use ps_worker::cpu::CpuDevice;
    use ps_worker::ops::ConvGeom;
    let mut cpu = CpuDevice::new(1);
    let mut gpu = CudaDevice::new(ordinal()).expect("a CUDA device");
    for (n, c, h, w, k, s, p) in [
        (2, 1, 28, 28, 5, 1, 0),
        (3, 4, 12, 12, 5, 1, 2),
        (2, 3, 9, 7, 3, 2, 1),
        (1, 2, 10, 11, 4, 3, 0),
    ] {
        let g = ConvGeom {
            channels: c,
            height: h,
            width: w,
            kernel: k,
            stride: s,
            padding: p,
        };
        let (oh, ow) = g.out_hw().unwrap();
        let what = format!("{g:?} n {n}");
        let x = rand(31, n * g.input_len());
        let clen = n * g.col_rows() * oh * ow;
        let mut cols = vec![f32::NAN; clen];
        cpu.im2col(&x, &mut cols, n, g).unwrap();
        let xb = on_gpu(&mut gpu, &x);
        let mut cb = gpu.alloc(clen).unwrap();
        gpu.im2col(
            CudaDevice::view(&xb, 0..x.len()),
            CudaDevice::view_mut(&mut cb, 0..clen),
            n,
            g,
        )
        .unwrap();
        let got = back(&mut gpu, &cb, clen);
        assert!(rel_err(&got, &cols) < TOL, "{what}: im2col");
        let dcols = rand(32, clen);
        let mut dx = vec![f32::NAN; x.len()];
        cpu.col2im(&dcols, &mut dx, n, g).unwrap();
        let db = on_gpu(&mut gpu, &dcols);
        let mut dxb = gpu.alloc(x.len()).unwrap();
        gpu.col2im(
            CudaDevice::view(&db, 0..clen),
            CudaDevice::view_mut(&mut dxb, 0..x.len()),
            n,
            g,
        )
        .unwrap();
        let got = back(&mut gpu, &dxb, x.len());
        let e = rel_err(&got, &dx);
        assert!(e < TOL, "{what}: col2im {e:e}");
        // pooling over the n*c planes of the input, with ties and a NaN in it
        let planes = n * c;
        let mut xp = x.clone();
        xp[1] = xp[0];
        xp[w + 1] = f32::NAN;
        let olen = planes * (h / 2) * (w / 2);
        let (mut y, mut arg) = (vec![0.0; olen], vec![0.0; olen]);
        cpu.maxpool2(&xp, &mut y, &mut arg, planes, h, w).unwrap();
        let xpb = on_gpu(&mut gpu, &xp);
        let (mut yb, mut ab) = (gpu.alloc(olen).unwrap(), gpu.alloc(olen).unwrap());
        gpu.maxpool2(
            CudaDevice::view(&xpb, 0..xp.len()),
            CudaDevice::view_mut(&mut yb, 0..olen),
            CudaDevice::view_mut(&mut ab, 0..olen),
            planes,
            h,
            w,
        )
        .unwrap();
        let (gy, ga) = (back(&mut gpu, &yb, olen), back(&mut gpu, &ab, olen));
        assert!(
            gy[0].is_nan() && y[0].is_nan(),
            "{what}: the NaN wins its window"
        );
        assert_eq!(ga, arg, "{what}: argmax");
        assert!(rel_err(&gy[1..], &y[1..]) < TOL, "{what}: max-pool");
        let dy = rand(33, olen);
        let mut dxp = vec![f32::NAN; xp.len()];
        cpu.maxpool2_backward(&dy, &arg, &mut dxp, planes, h, w)
            .unwrap();
        let dyb = on_gpu(&mut gpu, &dy);
        let mut dxpb = gpu.alloc(xp.len()).unwrap();
        gpu.maxpool2_backward(
            CudaDevice::view(&dyb, 0..olen),
            CudaDevice::view(&ab, 0..olen),
            CudaDevice::view_mut(&mut dxpb, 0..xp.len()),
            planes,
            h,
            w,
        )
        .unwrap();
        let got = back(&mut gpu, &dxpb, xp.len());
        assert!(rel_err(&got, &dxp) < TOL, "{what}: max-pool gradient");
        eprintln!("{what}: im2col, col2im, max-pool and its gradient equal the CPU's");
    }
}

/// The CNN's other device operations on the CUDA device equal the CPU device's: the
/// per-channel bias with and without ReLU, its gradient (a fixed-order tree sum on the GPU, so
/// within rounding, not to the bit) and the accumulating product.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn channel_bias_and_accumulating_product_parity() {
    use ps_worker::cpu::CpuDevice;
    use ps_worker::ops::Mat;
    let mut cpu = CpuDevice::new(1);
    let mut gpu = CudaDevice::new(ordinal()).expect("a CUDA device");
    for (n, c, plane) in [(3, 5, 7), (2, 8, 576), (1, 300, 1)] {
        let len = n * c * plane;
        let z = rand(41, len);
        let bias = rand(42, c);
        let bb = on_gpu(&mut gpu, &bias);
        for relu in [false, true] {
            let mut want = z.clone();
            cpu.channel_bias_act(&mut want, &bias, n, c, plane, relu)
                .unwrap();
            let mut zb = on_gpu(&mut gpu, &z);
            gpu.channel_bias_act(
                CudaDevice::view_mut(&mut zb, 0..len),
                CudaDevice::view(&bb, 0..c),
                n,
                c,
                plane,
                relu,
            )
            .unwrap();
            assert_eq!(
                back(&mut gpu, &zb, len),
                want,
                "[{n}, {c}, {plane}] relu {relu}"
            );
        }
        let mut want = vec![f32::NAN; c];
        cpu.channel_bias_grad(&z, n, c, plane, &mut want).unwrap();
        let zb = on_gpu(&mut gpu, &z);
        let mut gb = gpu.alloc(c).unwrap();
        gpu.channel_bias_grad(
            CudaDevice::view(&zb, 0..len),
            n,
            c,
            plane,
            CudaDevice::view_mut(&mut gb, 0..c),
        )
        .unwrap();
        let e = rel_err(&back(&mut gpu, &gb, c), &want);
        assert!(e < TOL, "[{n}, {c}, {plane}]: channel bias gradient {e:e}");
    }
    // c [m, n] += a [m, k] · bᵀ, both operands in every transpose
    let (m, k, nn) = (6, 9, 5);
    let a = rand(43, m * k);
    let b = rand(44, nn * k);
    let c0 = rand(45, m * nn);
    let mut want = c0.clone();
    cpu.gemm_acc(
        Mat::new(&a[..], m, k),
        Mat::new(&b[..], nn, k).t(),
        &mut want,
    )
    .unwrap();
    let (ab, bb) = (on_gpu(&mut gpu, &a), on_gpu(&mut gpu, &b));
    let mut cb = on_gpu(&mut gpu, &c0);
    gpu.gemm_acc(
        Mat::new(CudaDevice::view(&ab, 0..m * k), m, k),
        Mat::new(CudaDevice::view(&bb, 0..nn * k), nn, k).t(),
        CudaDevice::view_mut(&mut cb, 0..m * nn),
    )
    .unwrap();
    let e = rel_err(&back(&mut gpu, &cb, m * nn), &want);
    assert!(e < TOL, "accumulating product {e:e}");
}

/// A CNN step (the built-in CNN, `ps_worker::model::Cnn`) on the CUDA device against the CPU
/// device: every gradient tensor and the loss within 1e-4 relative, the correct counts and
/// `evaluate` equal, over growing and shrinking batches and both reductions, the weights
/// changed between steps.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn cnn_step_parity() {
    use ps_model::layout::{CnnLayout, CnnShape, ModelLayout};
    let layout = CnnLayout::new(CnnShape {
        image: [1, 28, 28],
        channels: vec![4, 8],
        kernel: 5,
        stride: 1,
        padding: 0,
        hidden: vec![16],
        classes: 10,
    })
    .unwrap();
    let ml = ModelLayout::from(layout.clone());
    let (mut gpu, arch) = ps_worker::cuda::open(ordinal(), &ml).unwrap_or_else(|e| {
        panic!(
            "these tests need a usable CUDA GPU (cuda:{}): {e}",
            ordinal()
        )
    });
    eprintln!("cnn on {} [{arch}]", gpu.name());
    let mut cpu = ps_worker::cpu::cpu_model(&ml, 1);
    let p = layout.num_params();
    for (i, n) in [16usize, 5, 33, 1].into_iter().enumerate() {
        let w = layout.init_range(100 + i as u64, 0..p);
        cpu.set_weights(&w).unwrap();
        gpu.set_weights(&w).unwrap();
        let x: Vec<f32> = (0..(n * 784) as u64)
            .map(|j| (uniform(7 + i as u64, j) + 1.0) / 2.0)
            .collect();
        let y: Vec<u8> = (0..n as u64)
            .map(|j| (splitmix64(j + 31 * i as u64) % 10) as u8)
            .collect();
        for reduction in [LossReduction::Mean, LossReduction::Sum] {
            let mut want = vec![f32::NAN; p];
            let mut got = vec![f32::NAN; p];
            let sw = cpu.forward_backward(&x, &y, reduction, &mut want).unwrap();
            let sg = gpu.forward_backward(&x, &y, reduction, &mut got).unwrap();
            assert_eq!(sg.correct, sw.correct, "batch {n} {reduction}");
            let le = (sg.loss_sum - sw.loss_sum).abs() / sw.loss_sum.abs().max(1e-6);
            assert!(le < TOL, "batch {n} {reduction}: loss {le:e}");
            for t in &layout.tensors {
                let e = rel_err(&got[t.range()], &want[t.range()]);
                assert!(
                    e < TOL,
                    "batch {n} {reduction}: {} differs by {e:e}",
                    t.name
                );
            }
        }
        assert_eq!(gpu.evaluate(&x, &y).unwrap(), cpu.evaluate(&x, &y).unwrap());
    }
}

/// One case of [`strided_batched_products_parity`]: `count` products `[m, k] · [k, n]`, the
/// left (right) matrix shared by all when `shared.0` (`.1`), stored transposed when `t.0`
/// (`.1`), `gap` unused values between consecutive matrices.
struct Batch {
    m: usize,
    k: usize,
    n: usize,
    count: usize,
    shared: (bool, bool),
    t: (bool, bool),
    gap: usize,
}

impl Batch {
    fn strides(&self) -> ps_worker::ops::Strides {
        let (a, b) = (self.m * self.k, self.k * self.n);
        ps_worker::ops::Strides {
            count: self.count,
            a: if self.shared.0 { 0 } else { a + self.gap },
            b: if self.shared.1 { 0 } else { b + self.gap },
            c: self.m * self.n + self.gap,
        }
    }

    /// The left and right operands over `a` and `b`, as stored.
    fn mats<V>(&self, a: V, b: V) -> (ps_worker::ops::Mat<V>, ps_worker::ops::Mat<V>) {
        use ps_worker::ops::Mat;
        let (m, k, n) = (self.m, self.k, self.n);
        let a = match self.t.0 {
            true => Mat::new(a, k, m).t(),
            false => Mat::new(a, m, k),
        };
        let b = match self.t.1 {
            true => Mat::new(b, n, k).t(),
            false => Mat::new(b, k, n),
        };
        (a, b)
    }
}

/// A device buffer holding `v` (one unused value when `v` is empty: the device allocates no
/// empty buffer).
fn on_gpu_or_empty(gpu: &mut CudaDevice, v: &[f32]) -> cudarc::driver::CudaSlice<f32> {
    match v.is_empty() {
        true => gpu.alloc(0).unwrap(),
        false => on_gpu(gpu, v),
    }
}

/// The products of a whole batch in one call (`Device::gemm_batched`, one strided-batched
/// cuBLAS call) and their sum over the batch (`Device::gemm_batched_sum`) on the CUDA device
/// against the CPU device, which makes the products one by one: a shared left or right matrix
/// (stride 0, as a convolution's weight), every transpose, gaps between matrices (left as
/// they were), a batch of one and of none (the sum is then zero); within 1e-4. A wrong length
/// is a `Shape` error on both devices, not a panic.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn strided_batched_products_parity() {
    use ps_worker::cpu::CpuDevice;
    let mut cpu = CpuDevice::new(1);
    let mut gpu = CudaDevice::new(ordinal()).expect("a CUDA device");
    let b = |m, k, n, count, shared, t, gap| Batch {
        m,
        k,
        n,
        count,
        shared,
        t,
        gap,
    };
    let cases = [
        b(16, 25, 576, 5, (true, false), (false, false), 0), // a convolution's forward
        b(25, 16, 144, 4, (true, false), (true, false), 0),  // its input gradient
        b(8, 100, 25, 6, (false, false), (false, true), 0),  // its weight gradient
        b(7, 3, 5, 1, (false, true), (false, false), 2),
        b(5, 4, 3, 6, (false, false), (true, true), 3),
        b(4, 6, 3, 0, (true, false), (false, false), 0),
        b(3, 0, 4, 3, (false, false), (false, false), 2), // empty products: zero results
    ];
    for (i, case) in cases.iter().enumerate() {
        let s = case.strides();
        let seed = 60 + 3 * i as u64;
        let a = rand(seed, s.extent(s.a, case.m * case.k));
        let bv = rand(seed + 1, s.extent(s.b, case.k * case.n));
        let (mn, clen) = (case.m * case.n, s.extent(s.c, case.m * case.n));
        let c0 = rand(seed + 2, clen);
        let (ab, bb) = (
            on_gpu_or_empty(&mut gpu, &a),
            on_gpu_or_empty(&mut gpu, &bv),
        );
        let gpu_mats = |case: &Batch| {
            case.mats(
                CudaDevice::view(&ab, 0..a.len()),
                CudaDevice::view(&bb, 0..bv.len()),
            )
        };

        let mut want = c0.clone();
        let (ma, mb) = case.mats(&a[..], &bv[..]);
        cpu.gemm_batched(ma, mb, &mut want, s).unwrap();
        let mut cb = on_gpu_or_empty(&mut gpu, &c0);
        let (ga, gb) = gpu_mats(case);
        gpu.gemm_batched(ga, gb, CudaDevice::view_mut(&mut cb, 0..clen), s)
            .unwrap();
        let got = back(&mut gpu, &cb, clen);
        let e = rel_err(&got, &want);
        assert!(e < TOL, "case {i}: batched products differ by {e:e}");
        for j in 0..clen {
            if j % s.c >= mn {
                assert_eq!(got[j].to_bits(), c0[j].to_bits(), "case {i}: gap value {j}");
            }
        }

        let mut want = vec![f32::NAN; mn];
        let (ma, mb) = case.mats(&a[..], &bv[..]);
        cpu.gemm_batched_sum(ma, mb, &mut want, s).unwrap();
        let mut cb = on_gpu(&mut gpu, &vec![f32::NAN; mn]);
        let (ga, gb) = gpu_mats(case);
        gpu.gemm_batched_sum(ga, gb, CudaDevice::view_mut(&mut cb, 0..mn), s)
            .unwrap();
        let got = back(&mut gpu, &cb, mn);
        let e = rel_err(&got, &want);
        assert!(e < TOL, "case {i}: summed products differ by {e:e}");
        if case.count == 0 {
            assert!(got.iter().all(|&v| v == 0.0), "case {i}: an empty sum is 0");
        }
    }
    // a right operand one value short: a Shape error on both devices
    let case = b(3, 4, 5, 2, (true, false), (false, false), 0);
    let s = case.strides();
    let (a, bv) = (rand(1, 12), rand(2, s.extent(s.b, 20) - 1));
    let mut c = vec![0.0; 30];
    let (ma, mb) = case.mats(&a[..], &bv[..]);
    let e = cpu.gemm_batched(ma, mb, &mut c, s).unwrap_err();
    assert!(matches!(e, BackendError::Shape(_)), "{e}");
    let (ab, bb) = (on_gpu(&mut gpu, &a), on_gpu(&mut gpu, &bv));
    let mut cb = gpu.alloc(30).unwrap();
    let (ga, gb) = case.mats(
        CudaDevice::view(&ab, 0..a.len()),
        CudaDevice::view(&bb, 0..bv.len()),
    );
    let e = gpu
        .gemm_batched_sum(ga, gb, CudaDevice::view_mut(&mut cb, 0..15), s)
        .unwrap_err();
    assert!(
        matches!(e, BackendError::Shape(_)) && e.to_string().contains("right matrices"),
        "{e}"
    );
}

/// `cuda_harness_sgemm_calls` (ps-worker/cuda-harness/harness.cpp: the cuBLAS calls so far)
/// when this process's CUDA driver is the harness; `None` on a real driver.
fn harness_sgemm_calls() -> Option<extern "C" fn() -> i64> {
    // SAFETY: dlopen of the driver library the backend has already loaded (the same file, so
    // the same instance) and dlsym of a function taking nothing and returning a long.
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW);
        let f = (!h.is_null()).then(|| libc::dlsym(h, c"cuda_harness_sgemm_calls".as_ptr()))?;
        (!f.is_null()).then(|| std::mem::transmute::<*mut libc::c_void, extern "C" fn() -> i64>(f))
    }
}

/// A CNN step makes its products over the whole batch: the same number of cuBLAS calls at a
/// batch of 2 as at 24 (before, three per sample and convolution: 1 + 3·24·2 more at 24).
/// Counted by the CUDA harness; on a real GPU (no counter) it says so and checks nothing.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn a_cnn_step_makes_the_same_cublas_calls_at_any_batch() {
    use ps_model::layout::{CnnLayout, CnnShape, ModelLayout};
    let Some(calls) = harness_sgemm_calls() else {
        eprintln!("not the CUDA harness: cuBLAS calls are not counted here");
        return;
    };
    let layout = CnnLayout::new(CnnShape {
        image: [1, 12, 12],
        channels: vec![3, 4],
        kernel: 3,
        stride: 1,
        padding: 1,
        hidden: vec![8],
        classes: 10,
    })
    .unwrap();
    let ml = ModelLayout::from(layout.clone());
    let (mut gpu, _) = ps_worker::cuda::open(ordinal(), &ml).unwrap();
    let p = layout.num_params();
    gpu.set_weights(&layout.init_range(5, 0..p)).unwrap();
    let mut per_step = Vec::new();
    for n in [2usize, 24, 2] {
        let x = rand(9, n * 144);
        let y: Vec<u8> = (0..n as u64).map(|j| (j % 10) as u8).collect();
        let mut g = vec![f32::NAN; p];
        let before = calls();
        gpu.forward_backward(&x, &y, LossReduction::Mean, &mut g)
            .unwrap();
        per_step.push(calls() - before);
    }
    eprintln!("cuBLAS calls per step at batches 2, 24, 2: {per_step:?}");
    assert!(
        per_step.iter().all(|&c| c == per_step[0]),
        "a step's cuBLAS calls depend on the batch size: {per_step:?}"
    );
    // per convolution: forward, weight gradient (batch + sum), input gradient but the first's;
    // per linear layer: forward, weight gradient, input gradient but the first's
    assert_eq!(
        per_step[0],
        (1 + 2) + (1 + 2 + 1) + (1 + 1 + 1) + (1 + 1 + 1)
    );
}
