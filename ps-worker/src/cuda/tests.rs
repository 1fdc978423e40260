//! Unit tests of the CUDA device that need no GPU: the host copy, the kernel source and its
//! NVRTC compile (with libnvrtc), launch shapes, one-line messages, the row-major to
//! column-major BLAS mapping, and no GPU as an error rather than a panic.

use super::*;

#[test]
fn copy_out_copies_every_value_in_order() {
    for len in [0, 5, COPY_PIECE - 1, 3 * COPY_PIECE + 7, 9 * COPY_PIECE + 1] {
        let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
        let mut dst = vec![f32::NAN; len];
        copy_out(&mut dst, &src);
        assert!(dst == src, "{len} values");
    }
}

#[test]
fn kernel_source_has_every_entry_point_and_no_include() {
    for name in ENTRY_POINTS {
        assert!(
            KERNELS.contains(&format!("extern \"C\" __global__ void {name}(")),
            "{name}"
        );
    }
    assert_eq!(
        KERNELS.matches("extern \"C\" __global__ void ").count(),
        ENTRY_POINTS.len()
    );
    assert!(!KERNELS.contains("#include"));
    assert!(KERNELS.contains(&format!("#define BIAS_GRAD_ROWS {BIAS_GRAD_ROWS}")));
    assert!(KERNELS.contains("__shared__ double sl[256];"));
    assert_eq!(CFG_REDUCE.block_dim, (256, 1, 1));
}

#[test]
fn launch_shapes() {
    assert_eq!(cfg_elems(0).grid_dim.0, 1);
    assert_eq!(cfg_elems(256).grid_dim.0, 1);
    assert_eq!(cfg_elems(257).grid_dim.0, 2);
    assert_eq!(cfg_elems(1 << 30).grid_dim.0, MAX_GRID as u32);
    assert_eq!(cfg_rows(8).grid_dim.0, 1);
    assert_eq!(cfg_rows(9).grid_dim.0, 2);
    assert_eq!(
        cfg_rows(9).block_dim.0 % 32,
        0,
        "row kernels need whole warps"
    );
    assert_eq!(cfg_cols(33).grid_dim.0, 2);
    assert_eq!(cfg_cols(33).block_dim, (32, BIAS_GRAD_ROWS, 1));
}

#[test]
fn messages_are_one_line() {
    assert_eq!(one_line("a\nb\r\n\nc\n"), "a | b | c");
    let e = cuda_err::<&str>("doing x")("bad\nthing");
    assert_eq!(e.to_string(), "cuda: doing x: bad | thing");
}

/// NVRTC needs no GPU, only the library: `pip install nvidia-cuda-nvrtc==13.0.*` and put
/// its `nvidia/cu13/lib` on LD_LIBRARY_PATH. `PS_PTX_OUT=DIR` also writes the PTX there
/// (for `ptxas --gpu-name sm_90`).
#[test]
#[ignore = "needs libnvrtc (a CUDA toolkit, or pip's nvidia-cuda-nvrtc on LD_LIBRARY_PATH): scripts/cuda-harness.sh test runs it"]
fn nvrtc_compiles_the_kernels() {
    // SAFETY: a dlopen probe only.
    assert!(
        unsafe { cudarc::nvrtc::sys::is_culib_present() },
        "libnvrtc is not loadable"
    );
    for (major, minor) in [(9, 0), (8, 0), (12, 0)] {
        let (ptx, arch) = compile_kernels(major, minor).unwrap();
        assert_eq!(arch, format!("compute_{major}{minor}"));
        let src = ptx.to_src();
        assert!(
            src.contains(&format!(".target sm_{major}{minor}")),
            "{arch}"
        );
        for name in ENTRY_POINTS {
            assert!(src.contains(&format!(".entry {name}(")), "{name} in {arch}");
        }
        if let Ok(dir) = std::env::var("PS_PTX_OUT") {
            std::fs::write(format!("{dir}/kernels_{arch}.ptx"), &src).unwrap();
        }
    }
    // Machine code for the architectures of the GPUs we run on (A100, H100): ELF for
    // EM_CUDA (190) holding every kernel.
    for (major, minor) in [(8, 0), (9, 0)] {
        let bin = compile_cubin(major, minor).unwrap();
        assert_eq!(&bin[..4], b"\x7fELF", "sm_{major}{minor}");
        assert_eq!(u16::from_le_bytes([bin[18], bin[19]]), 190, "EM_CUDA");
        // e_flags (at 48 in ELF64): the SM version in bits 8..15
        let flags = u32::from_le_bytes([bin[48], bin[49], bin[50], bin[51]]);
        assert_eq!(
            (flags >> 8) & 0xff,
            (major * 10 + minor) as u32,
            "{flags:#x}"
        );
        for name in ENTRY_POINTS {
            assert!(
                bin.windows(name.len()).any(|w| w == name.as_bytes()),
                "{name} in the sm_{major}{minor} cubin"
            );
        }
    }
    let e = compile_cubin(1, 0).unwrap_err();
    assert!(e.contains("sm_10") && !e.contains('\n'), "{e}");
    // An architecture this NVRTC does not know falls back to its default one.
    let (_, arch) = compile_kernels(1, 0).unwrap();
    assert_eq!(arch, "nvrtc default");
}

/// Column-major sgemm exactly as BLAS defines it (alpha 1, beta 0), on exact-size slices so
/// that any read or write outside a matrix panics.
fn sgemm_ref(g: GemmShape, a: &[f32], b: &[f32], c: &mut [f32]) {
    // BLAS's own argument rules
    assert!(g.lda >= if g.transa == OP_N { g.m } else { g.k }.max(1));
    assert!(g.ldb >= if g.transb == OP_N { g.k } else { g.n }.max(1));
    assert!(g.ldc >= g.m.max(1));
    let at = |i: usize, p: usize| {
        if g.transa == OP_N {
            a[i + p * g.lda]
        } else {
            a[p + i * g.lda]
        }
    };
    let bt = |p: usize, j: usize| {
        if g.transb == OP_N {
            b[p + j * g.ldb]
        } else {
            b[j + p * g.ldb]
        }
    };
    for j in 0..g.n {
        for i in 0..g.m {
            c[i + j * g.ldc] = (0..g.k).map(|p| at(i, p) * bt(p, j)).sum();
        }
    }
}

/// Row-major `[r, k] x [k, c]` with accessors.
fn matmul(
    r: usize,
    k: usize,
    c: usize,
    a: impl Fn(usize, usize) -> f32,
    b: impl Fn(usize, usize) -> f32,
) -> Vec<f32> {
    let mut out = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            out[i * c + j] = (0..k).map(|p| a(i, p) * b(p, j)).sum();
        }
    }
    out
}

fn val(seed: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7 + seed * 13) % 17) as f32 - 8.0) / 8.0)
        .collect()
}

/// `GemmShape::row_major` makes cuBLAS (as BLAS defines it, with `B`'s storage as its first
/// operand, as `CudaDevice::gemm` passes them) compute every row-major product, for all four
/// transpose combinations and many shapes, reading and writing exact-size buffers.
#[test]
fn row_major_products_through_column_major_blas() {
    for (m, k, n) in [(1, 1, 1), (5, 3, 2), (3, 7, 4), (33, 13, 10), (2, 1, 9)] {
        for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
            // op(A) [m, k] stored as [k, m] when transposed; op(B) [k, n] likewise
            let (ar, ac) = if a_t { (k, m) } else { (m, k) };
            let (br, bc) = if b_t { (n, k) } else { (k, n) };
            let a = val(1, ar * ac);
            let b = val(2, br * bc);
            let opa = |i: usize, p: usize| if a_t { a[p * ac + i] } else { a[i * ac + p] };
            let opb = |p: usize, j: usize| if b_t { b[j * bc + p] } else { b[p * bc + j] };
            let want = matmul(m, k, n, opa, opb);
            let g = GemmShape::row_major((ar, ac, a_t), (br, bc, b_t));
            let mut c = vec![f32::NAN; m * n];
            sgemm_ref(g, &b, &a, &mut c);
            assert_eq!(c, want, "[{m}, {k}] x [{k}, {n}], transposes {a_t} {b_t}");
        }
    }
}

/// The three products of the MLP (as `Mlp` asks for them) give the cuBLAS arguments worked
/// out by hand: forward `Zᵀ = W·Xᵀ`, weight gradient `dWᵀ = Xᵀ·dZ`, input gradient
/// `dXᵀ = Wᵀ·dZᵀ`.
#[test]
fn mlp_products_map_to_the_expected_cublas_calls() {
    let (rows, fan_in, fan_out) = (64, 784, 1024);
    let shape = |transa, transb, m, n, k, lda, ldb, ldc| GemmShape {
        transa,
        transb,
        m,
        n,
        k,
        lda,
        ldb,
        ldc,
    };
    // Z [rows, out] = X [rows, in] · Wᵀ (W stored [out, in], used transposed)
    assert_eq!(
        GemmShape::row_major((rows, fan_in, false), (fan_out, fan_in, true)),
        shape(OP_T, OP_N, fan_out, rows, fan_in, fan_in, fan_in, fan_out)
    );
    // dW [out, in] = dZᵀ · X (dZ stored [rows, out], used transposed)
    assert_eq!(
        GemmShape::row_major((rows, fan_out, true), (rows, fan_in, false)),
        shape(OP_N, OP_T, fan_in, fan_out, rows, fan_in, fan_out, fan_in)
    );
    // dX [rows, in] = dZ · W
    assert_eq!(
        GemmShape::row_major((rows, fan_out, false), (fan_out, fan_in, false)),
        shape(OP_N, OP_N, fan_in, rows, fan_out, fan_in, fan_out, fan_in)
    );
}

/// Without a GPU (this test passes either way): errors, never panics.
#[test]
fn no_gpu_is_an_error_not_a_panic() {
    match device_count() {
        Ok(n) => eprintln!("{n} CUDA device(s)"),
        Err(e) => assert!(matches!(e, BackendError::NoGpu(_)), "{e}"),
    }
    match CudaBackend::new(0, MlpLayout::new(&[3, 2])) {
        Ok(b) => eprintln!("{}", crate::backend::Backend::name(&b)),
        Err(e) => {
            let m = e.to_string();
            assert!(!m.is_empty() && !m.contains('\n'), "{m:?}");
        }
    }
    match CudaDevice::new(0) {
        Ok(d) => eprintln!("{}", d.name()),
        Err(e) => assert!(!e.to_string().contains('\n'), "{e}"),
    }
}

/// A batched sum whose partial products exceed the scratch limit is summed chunk by chunk
/// (here 8 products in chunks of 3, 3 and 2, the later chunks added onto the result): the same
/// as in one chunk and as the products one by one on the CPU, within rounding.
#[test]
#[ignore = "needs a CUDA GPU (or scripts/cuda-harness.sh test)"]
fn a_batched_sum_beyond_the_scratch_limit_is_summed_in_chunks() {
    use crate::cpu::CpuDevice;
    use crate::ops::Strides;
    let mut gpu = CudaDevice::new(0).expect("a CUDA device");
    let mut cpu = CpuDevice::new(1);
    let (m, k, n, count) = (4, 5, 6, 8);
    let s = Strides {
        count,
        a: m * k,
        b: n * k,
        c: 0,
    };
    let (a, b) = (val(3, count * m * k), val(4, count * n * k));
    let mut want = vec![f32::NAN; m * n];
    cpu.gemm_batched_sum(
        Mat::new(&a[..], m, k),
        Mat::new(&b[..], n, k).t(),
        &mut want,
        s,
    )
    .unwrap();
    let up = |gpu: &mut CudaDevice, v: &[f32]| {
        let mut d = gpu.alloc(v.len()).unwrap();
        gpu.upload(v, CudaDevice::view_mut(&mut d, 0..v.len()))
            .unwrap();
        d
    };
    let (ab, bb) = (up(&mut gpu, &a), up(&mut gpu, &b));
    let mut sums = Vec::new();
    for limit in [batched::SUM_SCRATCH, 3 * m * n] {
        gpu.sum_scratch.limit = limit;
        let mut c = up(&mut gpu, &vec![f32::NAN; m * n]);
        gpu.gemm_batched_sum(
            Mat::new(CudaDevice::view(&ab, 0..a.len()), m, k),
            Mat::new(CudaDevice::view(&bb, 0..b.len()), n, k).t(),
            CudaDevice::view_mut(&mut c, 0..m * n),
            s,
        )
        .unwrap();
        let mut got = vec![f32::NAN; m * n];
        gpu.download(CudaDevice::view(&c, 0..m * n), &mut got)
            .unwrap();
        sums.push(got);
    }
    for (got, what) in sums.iter().zip(["one chunk", "chunks of 3"]) {
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{what}: {g} vs {w}"
            );
        }
    }
}
