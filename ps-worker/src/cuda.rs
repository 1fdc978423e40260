//! The CUDA backend: cuBLAS sgemm for the matrix products and a handful of NVRTC kernels
//! (compiled once per backend, no headers needed) for bias, ReLU, softmax cross-entropy and
//! the reductions. Everything runs in full FP32 on one stream of one device; the libraries
//! (`libcuda`, `libnvrtc`, `libcublas`) are loaded at run time, so this builds and runs on
//! machines without CUDA, where [`CudaBackend::new`] returns [`BackendError::NoGpu`].
//!
//! Layout: every matrix is row-major like the CPU backend (`x [n, in]`, `fcN.weight [out, in]`,
//! activations `[n, out]`). cuBLAS is column-major, so a row-major `[r, c]` matrix is passed as
//! the column-major `[c, r]` matrix with leading dimension `c` (its transpose), and each
//! product is computed transposed: `Zᵀ = W·Xᵀ`, `dWᵀ = Xᵀ·dZ`, `dXᵀ = Wᵀ·dZᵀ`.

use crate::backend::{Backend, BackendError, BackendResult, StepStats, check_shapes};
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use ps_common::config::LossReduction;
use ps_common::layout::MlpLayout;
use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

/// Rows per forward pass when evaluating, to bound device memory.
pub const EVAL_ROWS: usize = 4096;

/// Threads per block of the element-wise and row kernels.
const BLOCK: u32 = 256;
/// Upper bound on the grid of the grid-stride kernels (enough to fill any current GPU).
const MAX_GRID: usize = 4096;
/// Rows summed in parallel per column by `bias_grad_f32` (its block is `32 x BIAS_GRAD_ROWS`).
const BIAS_GRAD_ROWS: u32 = 8;

/// The kernels, compiled by NVRTC at start-up. Plain CUDA C with no `#include`, so no toolkit
/// headers are needed on the GPU host. All loops are grid-stride loops; all indices into
/// `[rows, cols]` matrices are 64-bit.
pub const KERNELS: &str = include_str!("cuda/kernels.cu");

/// `BackendError::Cuda` with what was being done.
fn cuda_err<E: Display>(what: impl Display) -> impl FnOnce(E) -> BackendError {
    move |e| BackendError::Cuda(one_line(&format!("{what}: {e}")))
}

/// Collapses a multi-line message (a compiler log, a panic) onto one line.
fn one_line(s: &str) -> String {
    s.split('\n')
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Text of a caught panic.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    let s = if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    };
    one_line(&s)
}

/// Checks that the three shared libraries can be loaded, so that no cudarc call panics on a
/// missing library (cudarc panics, rather than returning an error, when it cannot `dlopen`).
fn check_driver() -> BackendResult<()> {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names and closes the
    // library again; it calls no CUDA function.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(BackendError::NoGpu(
            "no CUDA driver found (libcuda.so.1 not loadable)".into(),
        ));
    }
    Ok(())
}

/// NVRTC and cuBLAS (checked after the driver reported the devices, so that a machine with
/// a driver but no device says so rather than that the toolkit is missing).
fn check_toolkit_libraries() -> BackendResult<()> {
    // SAFETY: as above, a `dlopen` probe only.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(BackendError::NoGpu(
            "CUDA driver found but NVRTC is not loadable (libnvrtc.so.13 or .12): install the CUDA toolkit \
             or add its lib64 directory to LD_LIBRARY_PATH"
                .into(),
        ));
    }
    // SAFETY: as above, a `dlopen` probe only.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(BackendError::NoGpu(
            "CUDA driver found but cuBLAS is not loadable (libcublas.so.13 or .12): install the CUDA toolkit \
             or add its lib64 directory to LD_LIBRARY_PATH"
                .into(),
        ));
    }
    Ok(())
}

/// Number of CUDA devices the driver sees. `NoGpu` when there is no driver library or the
/// driver fails to initialise (for example `CUDA_ERROR_NO_DEVICE`); never panics.
pub fn device_count() -> BackendResult<usize> {
    check_driver()?;
    let r = catch_unwind(CudaContext::device_count).map_err(|p| {
        BackendError::NoGpu(format!(
            "CUDA driver found but it panicked on initialisation: {}",
            panic_text(&*p)
        ))
    })?;
    let n = r.map_err(|e| {
        BackendError::NoGpu(one_line(&format!("CUDA driver found but unusable: {e}")))
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The compiled kernels.
#[derive(Debug)]
struct Kernels {
    bias_act: CudaFunction,
    relu_backward: CudaFunction,
    softmax_xent: CudaFunction,
    bias_grad: CudaFunction,
    reduce_stats: CudaFunction,
}

/// Device buffers for batches of up to `rows` samples.
#[derive(Debug)]
struct Buffers {
    rows: usize,
    /// Input features `[rows, dims[0]]`.
    x: CudaSlice<f32>,
    /// Labels `[rows]`.
    labels: CudaSlice<u8>,
    /// Output of layer `l` `[rows, dims[l + 1]]`: post-ReLU activation (hidden) or logits
    /// (last); overwritten by dL/dz of that layer during the backward pass.
    acts: Vec<CudaSlice<f32>>,
    /// dL/d(activation) before the ReLU mask `[rows, max(dims)]`.
    scratch: CudaSlice<f32>,
    row_loss: CudaSlice<f32>,
    row_correct: CudaSlice<i32>,
}

/// The MLP on one CUDA device. See the module documentation.
pub struct CudaBackend {
    // Buffers first: they are dropped (freed on the stream) before the stream and context.
    bufs: Option<Buffers>,
    /// The flat parameter vector, PyTorch `state_dict` order.
    weights: CudaSlice<f32>,
    /// The flat gradient vector, same layout.
    grad: CudaSlice<f32>,
    /// `[loss sum, correct count]` of the last batch.
    stats: CudaSlice<f64>,
    blas: CudaBlas,
    k: Kernels,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    layout: MlpLayout,
    ordinal: usize,
    device_name: String,
    arch: String,
    /// Rows of the batch now in the input buffer (see [`CudaBackend::upload_batch`]).
    uploaded: usize,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("device", &self.device_name)
            .field("arch", &self.arch)
            .field("layout", &self.layout.dims)
            .field("rows", &self.bufs.as_ref().map_or(0, |b| b.rows))
            .finish()
    }
}

/// Compiles [`KERNELS`] for the device's virtual architecture (`compute_90` on Hopper); if
/// this NVRTC does not know that architecture, falls back to its default one (the driver then
/// JIT-compiles the PTX).
fn compile_kernels(major: i32, minor: i32) -> BackendResult<(Ptx, String)> {
    let arch = format!("compute_{major}{minor}");
    let opts = |arch: Option<&str>| CompileOptions {
        name: Some("ps_worker_kernels.cu".into()),
        options: arch
            .map(|a| vec![format!("--gpu-architecture={a}")])
            .unwrap_or_default(),
        ..Default::default()
    };
    let describe = |e: CompileError| match e {
        CompileError::CompileError {
            nvrtc,
            options,
            log,
        } => {
            format!(
                "{nvrtc:?} with options {options:?}: {}",
                log.to_string_lossy()
            )
        }
        other => format!("{other:?}"),
    };
    match compile_ptx_with_opts(KERNELS, opts(Some(&arch))) {
        Ok(ptx) => Ok((ptx, arch)),
        Err(first) => match compile_ptx_with_opts(KERNELS, opts(None)) {
            Ok(ptx) => Ok((ptx, "nvrtc default".into())),
            Err(_) => Err(BackendError::Cuda(one_line(&format!(
                "compiling the kernels with NVRTC for {arch}: {}",
                describe(first)
            )))),
        },
    }
}

/// The cuBLAS (column-major) arguments of one row-major product of a layer. A row-major
/// `[r, c]` matrix is the column-major `[c, r]` matrix (its transpose) with leading dimension
/// `c`, so each row-major product `C = A·B` is computed as the column-major `Cᵀ = Bᵀ·Aᵀ`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct GemmShape {
    transa: cublasOperation_t,
    transb: cublasOperation_t,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
}

const OP_N: cublasOperation_t = cublasOperation_t::CUBLAS_OP_N;
const OP_T: cublasOperation_t = cublasOperation_t::CUBLAS_OP_T;

impl GemmShape {
    /// Forward, `Z [rows, out] = X [rows, in] · Wᵀ` with `W [out, in]`: column-major
    /// `Zᵀ [out, rows] = W · Xᵀ`; cuBLAS `A` = the weight (stored as Wᵀ [in, out], so `T`),
    /// `B` = the input (stored as Xᵀ [in, rows], `N`), `C` = the output.
    fn forward(rows: usize, fan_in: usize, fan_out: usize) -> Self {
        Self {
            transa: OP_T,
            transb: OP_N,
            m: fan_out,
            n: rows,
            k: fan_in,
            lda: fan_in,
            ldb: fan_in,
            ldc: fan_out,
        }
    }

    /// Weight gradient, `dW [out, in] = dZᵀ · X`: column-major `dWᵀ [in, out] = Xᵀ · dZ`;
    /// `A` = the input (stored as Xᵀ [in, rows], `N`), `B` = dZ (stored as dZᵀ [out, rows],
    /// so `T`), `C` = the weight gradient.
    fn weight_grad(rows: usize, fan_in: usize, fan_out: usize) -> Self {
        Self {
            transa: OP_N,
            transb: OP_T,
            m: fan_in,
            n: fan_out,
            k: rows,
            lda: fan_in,
            ldb: fan_out,
            ldc: fan_in,
        }
    }

    /// Input gradient, `dX [rows, in] = dZ · W`: column-major `dXᵀ [in, rows] = Wᵀ · dZᵀ`;
    /// `A` = the weight (stored as Wᵀ [in, out], `N`), `B` = dZ (stored as dZᵀ [out, rows], `N`),
    /// `C` = the input gradient.
    fn input_grad(rows: usize, fan_in: usize, fan_out: usize) -> Self {
        Self {
            transa: OP_N,
            transb: OP_N,
            m: fan_in,
            n: rows,
            k: fan_out,
            lda: fan_in,
            ldb: fan_out,
            ldc: fan_in,
        }
    }
}

/// `C = op(A)·op(B)` (alpha 1, beta 0) in full FP32 on the handle's stream.
fn sgemm<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    blas: &CudaBlas,
    what: &str,
    g: GemmShape,
    a: &A,
    b: &B,
    c: &mut C,
) -> BackendResult<()> {
    // Sizes were checked against i32::MAX when the backend and its buffers were made.
    let i = |v: usize| v as i32;
    let cfg = GemmConfig {
        transa: g.transa,
        transb: g.transb,
        m: i(g.m),
        n: i(g.n),
        k: i(g.k),
        alpha: 1.0f32,
        lda: i(g.lda),
        ldb: i(g.ldb),
        beta: 0.0f32,
        ldc: i(g.ldc),
    };
    // SAFETY: the callers pass buffers of at least the sizes the configuration reads and writes
    // (`[rows, width]` buffers allocated for at least `rows` rows, weight and gradient views of
    // exactly one layer's tensor, as the `GemmShape` constructors describe), all on the handle's
    // stream; alpha and beta are host values (the default host pointer mode).
    unsafe { blas.gemm(cfg, a, b, c) }.map_err(cuda_err(format_args!("cuBLAS sgemm for {what}")))
}

fn grid(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).clamp(1, MAX_GRID) as u32
}

/// Element-wise kernels: 256 threads per block, grid-stride.
fn cfg_elems(total: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid(total, BLOCK as usize), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Row kernels: one warp per row, 8 warps per block.
fn cfg_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid(rows, (BLOCK / 32) as usize), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Column kernels: 32 columns by `BIAS_GRAD_ROWS` row strides per block.
fn cfg_cols(cols: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid(cols, 32), 1, 1),
        block_dim: (32, BIAS_GRAD_ROWS, 1),
        shared_mem_bytes: 0,
    }
}

fn check_i32(what: &str, v: usize) -> BackendResult<i32> {
    i32::try_from(v)
        .map_err(|_| BackendError::Shape(format!("{what} = {v}: the CUDA backend needs < 2^31")))
}

impl CudaBackend {
    /// A backend for `layout` on device `ordinal`: checks the libraries, creates the context,
    /// a stream, compiles the kernels with NVRTC and creates a cuBLAS handle on the stream.
    /// `NoGpu` when the driver, NVRTC or cuBLAS is missing or the device does not exist;
    /// `Cuda` when a CUDA call fails. Never panics (a panic inside cudarc is caught).
    pub fn new(ordinal: usize, layout: MlpLayout) -> BackendResult<Self> {
        check_driver()?;
        match catch_unwind(AssertUnwindSafe(|| Self::init(ordinal, layout))) {
            Ok(r) => r,
            Err(p) => Err(BackendError::NoGpu(format!(
                "CUDA initialisation panicked: {}",
                panic_text(&*p)
            ))),
        }
    }

    fn init(ordinal: usize, layout: MlpLayout) -> BackendResult<Self> {
        for &d in &layout.dims {
            check_i32("a layer width", d)?;
        }
        let count = device_count()?;
        if count == 0 {
            return Err(BackendError::NoGpu(
                "CUDA driver found but it sees no device (check CUDA_VISIBLE_DEVICES)".into(),
            ));
        }
        if ordinal >= count {
            return Err(BackendError::NoGpu(format!(
                "cuda:{ordinal} requested but the driver sees only {count} device(s) (cuda:0..cuda:{})",
                count - 1
            )));
        }
        check_toolkit_libraries()?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err(format_args!(
            "creating the context of cuda:{ordinal}"
        )))?;
        // SAFETY: this backend uses exactly one stream for every allocation, copy, kernel and
        // cuBLAS call, so stream order alone orders all uses of its buffers and frees; the
        // per-buffer events cudarc records for multi-stream use are not needed. Host copies
        // are from/to pageable memory, which CUDA stages synchronously (htod returns once the
        // source has been read, dtoh once the destination is written); we also synchronise
        // after each download. Only slices allocated by this `ctx` handle are affected.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let device_name = ctx.name().map_err(cuda_err("reading the device name"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("reading the compute capability"))?;
        let (ptx, arch) = compile_kernels(major, minor)?;
        let module = ctx.load_module(ptx).map_err(cuda_err(format_args!(
            "loading the NVRTC kernels ({arch}) into cuda:{ordinal} (an UNSUPPORTED_PTX_VERSION error means \
             libnvrtc is newer than the driver)"
        )))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(cuda_err(format_args!("loading kernel {name}")))
        };
        let k = Kernels {
            bias_act: f("bias_act_f32")?,
            relu_backward: f("relu_backward_f32")?,
            softmax_xent: f("softmax_xent_f32")?,
            bias_grad: f("bias_grad_f32")?,
            reduce_stats: f("reduce_stats_f32")?,
        };
        let blas = CudaBlas::new(stream.clone()).map_err(cuda_err("creating the cuBLAS handle"))?;
        // Full FP32: the default math mode never uses TF32 tensor cores for sgemm; set it
        // explicitly in case a later cuBLAS changes its default.
        // SAFETY: the handle is valid (just created) and owned by `blas`.
        unsafe {
            cudarc::cublas::sys::cublasSetMathMode(
                *blas.handle(),
                cublasMath_t::CUBLAS_DEFAULT_MATH,
            )
        }
        .result()
        .map_err(cuda_err("setting the cuBLAS math mode"))?;
        let p = layout.num_params();
        let weights = stream
            .alloc_zeros::<f32>(p)
            .map_err(cuda_err(format_args!("allocating {p} weights")))?;
        let grad = stream
            .alloc_zeros::<f32>(p)
            .map_err(cuda_err(format_args!("allocating {p} gradients")))?;
        let stats = stream
            .alloc_zeros::<f64>(2)
            .map_err(cuda_err("allocating the statistics"))?;
        let mut me = Self {
            bufs: None,
            weights,
            grad,
            stats,
            blas,
            k,
            stream,
            ctx,
            layout,
            ordinal,
            device_name,
            arch,
            uploaded: 0,
        };
        me.self_test()?;
        Ok(me)
    }

    /// One sample through zero weights: every logit is 0, so the loss is ln(classes) and the
    /// last bias gradient is softmax - onehot = 1/classes - [j == label]. Runs every kernel,
    /// sgemm and copy once, so a broken installation fails here, inside `new`.
    fn self_test(&mut self) -> BackendResult<()> {
        let dims = self.layout.dims.clone();
        let classes = *dims.last().expect("dims");
        let x: Vec<f32> = (0..dims[0]).map(|i| (i % 7) as f32 - 3.0).collect();
        let label = u8::try_from(classes.min(256) - 1).unwrap_or(0);
        let mut g = vec![f32::NAN; self.layout.num_params()];
        let stats = self.forward_backward(&x, &[label], LossReduction::Mean, &mut g)?;
        let (_, b) = self.layout.layer(self.layout.num_layers() - 1);
        let want_loss = (classes as f64).ln();
        let bias_ok = g[b.clone()].iter().enumerate().all(|(j, &v)| {
            let want = 1.0 / classes as f32 - f32::from(u8::from(j == usize::from(label)));
            (v - want).abs() <= 1e-5
        });
        if (stats.loss_sum - want_loss).abs() > 1e-4 * want_loss.max(1.0)
            || !bias_ok
            || g.iter().any(|v| !v.is_finite())
        {
            return Err(BackendError::Cuda(format!(
                "self-test on cuda:{} failed: loss {} (expected {want_loss:.6}), last bias gradient {:?}",
                self.ordinal,
                stats.loss_sum,
                &g[b][..classes.min(4)]
            )));
        }
        Ok(())
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The architecture the kernels were compiled for, e.g. "compute_90".
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The model layout.
    pub fn layout(&self) -> &MlpLayout {
        &self.layout
    }

    /// Rows the device buffers currently hold (0 before the first batch).
    pub fn capacity_rows(&self) -> usize {
        self.bufs.as_ref().map_or(0, |b| b.rows)
    }

    fn bind(&self) -> BackendResult<()> {
        self.ctx.bind_to_thread().map_err(cuda_err(format_args!(
            "binding the context of cuda:{}",
            self.ordinal
        )))
    }

    /// Waits until all work queued on the backend's stream has finished.
    pub fn sync(&self) -> BackendResult<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(cuda_err("synchronising the stream"))
    }

    /// Makes the buffers hold at least `rows` rows (reallocates only to grow).
    fn ensure_rows(&mut self, rows: usize) -> BackendResult<()> {
        if self.bufs.as_ref().is_some_and(|b| b.rows >= rows) {
            return Ok(());
        }
        check_i32("the batch size", rows)?;
        self.bufs = None; // free the old buffers before allocating larger ones
        self.uploaded = 0;
        let dims = &self.layout.dims;
        let s = &self.stream;
        let alloc = |len: usize, what: &str| {
            s.alloc_zeros::<f32>(len).map_err(cuda_err(format_args!(
                "allocating {what} ({len} floats, {rows} rows)"
            )))
        };
        let widest = dims.iter().copied().max().unwrap_or(1);
        let bufs = Buffers {
            rows,
            x: alloc(rows * dims[0], "the input batch")?,
            labels: s
                .alloc_zeros::<u8>(rows)
                .map_err(cuda_err("allocating the labels"))?,
            acts: dims[1..]
                .iter()
                .map(|&d| alloc(rows * d, "activations"))
                .collect::<BackendResult<_>>()?,
            scratch: alloc(rows * widest, "the backward scratch")?,
            row_loss: alloc(rows, "the row losses")?,
            row_correct: s
                .alloc_zeros::<i32>(rows)
                .map_err(cuda_err("allocating the row flags"))?,
        };
        self.bufs = Some(bufs);
        Ok(())
    }

    /// Copies a batch to the device, growing the buffers when needed (shapes unchecked).
    fn upload_unchecked(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<()> {
        let n = labels.len();
        self.uploaded = 0;
        if n == 0 {
            return Ok(());
        }
        self.ensure_rows(n)?;
        let b = self.bufs.as_mut().expect("ensured");
        self.stream
            .memcpy_htod(x, &mut b.x)
            .map_err(cuda_err("copying the input batch to the device"))?;
        self.stream
            .memcpy_htod(labels, &mut b.labels)
            .map_err(cuda_err("copying the labels to the device"))?;
        self.uploaded = n;
        Ok(())
    }

    /// Copies a batch (`x` row-major `[n, inputs]`, `n` labels) into the device's input
    /// buffers, growing them when needed, for [`CudaBackend::compute_uploaded`]. The copy
    /// from pageable memory has left `x` and `labels` when this returns.
    pub fn upload_batch(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<()> {
        check_shapes(&self.layout.dims, self.layout.num_params(), x, labels, None)?;
        self.bind()?;
        self.upload_unchecked(x, labels)
    }

    /// Queues the forward pass over the first `n` rows of the input buffer: the logits end
    /// in `acts[last]`, the hidden activations in the other `acts`.
    fn forward(&mut self, n: usize) -> BackendResult<()> {
        let Self {
            bufs,
            weights,
            blas,
            k,
            stream,
            layout,
            ..
        } = self;
        let b = bufs.as_mut().expect("ensure_rows first");
        let dims = &layout.dims;
        let layers = layout.num_layers();
        for l in 0..layers {
            let (wr, br) = layout.layer(l);
            let (fan_in, fan_out) = (dims[l], dims[l + 1]);
            let (prev, rest) = b.acts.split_at_mut(l);
            let out = &mut rest[0];
            let input = if l == 0 { &b.x } else { &prev[l - 1] };
            let g = GemmShape::forward(n, fan_in, fan_out);
            sgemm(
                blas,
                "the forward product X·Wᵀ",
                g,
                &weights.slice(wr),
                input,
                out,
            )?;
            let bias = weights.slice(br);
            let (rows_i, cols_i, relu) = (n as i32, fan_out as i32, i32::from(l + 1 < layers));
            // SAFETY: bias_act_f32(float* z, const float* b, int rows, int cols, int relu):
            // `out` holds at least n*fan_out floats, `bias` exactly fan_out; the kernel touches
            // only indices below rows*cols and b[c] for c < cols.
            unsafe {
                stream
                    .launch_builder(&k.bias_act)
                    .arg(out)
                    .arg(&bias)
                    .arg(&rows_i)
                    .arg(&cols_i)
                    .arg(&relu)
                    .launch(cfg_elems(n * fan_out))
            }
            .map_err(cuda_err(format_args!(
                "launching bias_act_f32 for layer {}",
                l + 1
            )))?;
        }
        Ok(())
    }

    /// Queues the fused softmax cross-entropy on the logits of the first `n` rows (replacing
    /// them by `scale * (softmax - onehot)`) and the reduction into `stats`.
    fn loss_and_stats(&mut self, n: usize, scale: f32) -> BackendResult<()> {
        let Self {
            bufs,
            stats,
            k,
            stream,
            layout,
            ..
        } = self;
        let b = bufs.as_mut().expect("ensure_rows first");
        let classes = *layout.dims.last().expect("dims");
        let logits = b.acts.last_mut().expect("at least one layer");
        let (rows_i, cols_i) = (n as i32, classes as i32);
        // SAFETY: softmax_xent_f32(float* z, const unsigned char* labels, float* row_loss,
        // int* row_correct, int rows, int cols, float scale): `logits` holds at least
        // n*classes floats, `labels`, `row_loss`, `row_correct` at least n entries; labels
        // were checked < classes by `check_shapes` before upload. Block size is a multiple of 32.
        unsafe {
            stream
                .launch_builder(&k.softmax_xent)
                .arg(logits)
                .arg(&b.labels)
                .arg(&mut b.row_loss)
                .arg(&mut b.row_correct)
                .arg(&rows_i)
                .arg(&cols_i)
                .arg(&scale)
                .launch(cfg_rows(n))
        }
        .map_err(cuda_err("launching softmax_xent_f32"))?;
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reduce_stats_f32(const float* row_loss, const int* row_correct, int rows,
        // double* out): reads n entries of each row buffer, writes out[0..2] of `stats` (2
        // doubles); launched with exactly one block of 256 threads, the size of its shared arrays.
        unsafe {
            stream
                .launch_builder(&k.reduce_stats)
                .arg(&b.row_loss)
                .arg(&b.row_correct)
                .arg(&rows_i)
                .arg(stats)
                .launch(one)
        }
        .map_err(cuda_err("launching reduce_stats_f32"))?;
        Ok(())
    }

    /// Downloads `[loss sum, correct]` (synchronises the stream).
    fn read_stats(&mut self) -> BackendResult<StepStats> {
        let mut host = [0.0f64; 2];
        self.stream
            .memcpy_dtoh(&self.stats, &mut host)
            .map_err(cuda_err("copying the loss and accuracy to the host"))?;
        self.stream
            .synchronize()
            .map_err(cuda_err("synchronising after the batch"))?;
        Ok(StepStats {
            loss_sum: host[0],
            correct: host[1] as u64,
        })
    }

    /// Queues the backward pass for the first `n` rows: the last layer's dL/dz must already be
    /// in `acts[last]`. Writes every entry of the device gradient.
    fn backward(&mut self, n: usize) -> BackendResult<()> {
        let Self {
            bufs,
            weights,
            grad,
            blas,
            k,
            stream,
            layout,
            ..
        } = self;
        let b = bufs.as_mut().expect("ensure_rows first");
        let dims = &layout.dims;
        for l in (0..layout.num_layers()).rev() {
            let (wr, br) = layout.layer(l);
            let (fan_in, fan_out) = (dims[l], dims[l + 1]);
            let (prev, rest) = b.acts.split_at_mut(l);
            let dz = &rest[0];
            {
                let input = if l == 0 { &b.x } else { &prev[l - 1] };
                let g = GemmShape::weight_grad(n, fan_in, fan_out);
                sgemm(
                    blas,
                    "the weight gradient dZᵀ·X",
                    g,
                    input,
                    dz,
                    &mut grad.slice_mut(wr.clone()),
                )?;
            }
            let mut db = grad.slice_mut(br);
            let (rows_i, cols_i) = (n as i32, fan_out as i32);
            // SAFETY: bias_grad_f32(const float* dz, float* db, int rows, int cols): `dz` holds
            // at least n*fan_out floats, `db` is exactly fan_out floats; block is (32, 8), the
            // shape of the kernel's shared array.
            unsafe {
                stream
                    .launch_builder(&k.bias_grad)
                    .arg(dz)
                    .arg(&mut db)
                    .arg(&rows_i)
                    .arg(&cols_i)
                    .launch(cfg_cols(fan_out))
            }
            .map_err(cuda_err(format_args!(
                "launching bias_grad_f32 for layer {}",
                l + 1
            )))?;
            if l > 0 {
                let g = GemmShape::input_grad(n, fan_in, fan_out);
                sgemm(
                    blas,
                    "the input gradient dZ·W",
                    g,
                    &weights.slice(wr),
                    dz,
                    &mut b.scratch,
                )?;
                let total = n * fan_in;
                let total_i = total as i64;
                // SAFETY: relu_backward_f32(const float* da, float* act_dz, long long n):
                // `scratch` holds rows*max(dims) >= n*fan_in floats and `prev[l - 1]` (the
                // activation of layer l-1, [rows, fan_in]) at least n*fan_in.
                unsafe {
                    stream
                        .launch_builder(&k.relu_backward)
                        .arg(&b.scratch)
                        .arg(&mut prev[l - 1])
                        .arg(&total_i)
                        .launch(cfg_elems(total))
                }
                .map_err(cuda_err(format_args!(
                    "launching relu_backward_f32 for layer {l}"
                )))?;
            }
        }
        Ok(())
    }

    /// Forward and backward on the batch last copied by [`CudaBackend::upload_batch`],
    /// leaving the gradient on the device (see [`CudaBackend::download_gradient`]); returns
    /// the loss sum and correct count, reading which synchronises with the device. An empty
    /// batch zeroes the gradient. (`evaluate` replaces the uploaded batch by its last chunk.)
    pub fn compute_uploaded(&mut self, reduction: LossReduction) -> BackendResult<StepStats> {
        self.bind()?;
        let n = self.uploaded;
        if n == 0 {
            self.stream
                .memset_zeros(&mut self.grad)
                .map_err(cuda_err("zeroing the gradient"))?;
            return Ok(StepStats::default());
        }
        self.forward(n)?;
        let scale = match reduction {
            LossReduction::Mean => 1.0 / n as f32,
            LossReduction::Sum => 1.0,
        };
        self.loss_and_stats(n, scale)?;
        self.backward(n)?;
        self.read_stats()
    }

    /// [`CudaBackend::upload_batch`] then [`CudaBackend::compute_uploaded`]: forward and
    /// backward with the gradient left on the device. [`Backend::forward_backward`] is this
    /// plus [`CudaBackend::download_gradient`].
    pub fn compute_gradient(
        &mut self,
        x: &[f32],
        labels: &[u8],
        reduction: LossReduction,
    ) -> BackendResult<StepStats> {
        self.upload_batch(x, labels)?;
        self.compute_uploaded(reduction)
    }

    /// Copies the device gradient into `grad` (length = number of parameters), one layer at a
    /// time, last layer first, then synchronises.
    pub fn download_gradient(&mut self, grad: &mut [f32]) -> BackendResult<()> {
        let p = self.layout.num_params();
        if grad.len() != p {
            return Err(BackendError::Shape(format!(
                "gradient buffer holds {}: expected {p}",
                grad.len()
            )));
        }
        self.bind()?;
        for l in (0..self.layout.num_layers()).rev() {
            let (w, b) = self.layout.layer(l);
            let r = w.start..b.end;
            self.stream
                .memcpy_dtoh(&self.grad.slice(r.clone()), &mut grad[r])
                .map_err(cuda_err(format_args!(
                    "copying the gradient of layer {} to the host",
                    l + 1
                )))?;
        }
        self.stream
            .synchronize()
            .map_err(cuda_err("synchronising after the gradient download"))
    }

    /// Benchmark helper: queues only the three sgemm calls per layer of a forward and backward
    /// pass over `rows` rows (forward product, weight gradient, input gradient, including the
    /// input gradient of the first layer that a real step skips), on whatever the buffers hold.
    /// Does not synchronise; the weights' gradient buffer is overwritten.
    pub fn gemm_only(&mut self, rows: usize) -> BackendResult<()> {
        self.bind()?;
        if rows == 0 {
            return Ok(());
        }
        self.ensure_rows(rows)?;
        let Self {
            bufs,
            weights,
            grad,
            blas,
            layout,
            ..
        } = self;
        let b = bufs.as_mut().expect("ensured");
        let dims = &layout.dims;
        let n = rows;
        for l in 0..layout.num_layers() {
            let (wr, _) = layout.layer(l);
            let (fan_in, fan_out) = (dims[l], dims[l + 1]);
            let (prev, rest) = b.acts.split_at_mut(l);
            let out = &mut rest[0];
            let input = if l == 0 { &b.x } else { &prev[l - 1] };
            let w = weights.slice(wr.clone());
            sgemm(
                blas,
                "bench forward",
                GemmShape::forward(n, fan_in, fan_out),
                &w,
                input,
                out,
            )?;
            let g = GemmShape::weight_grad(n, fan_in, fan_out);
            sgemm(
                blas,
                "bench weight gradient",
                g,
                input,
                &*out,
                &mut grad.slice_mut(wr),
            )?;
            sgemm(
                blas,
                "bench input gradient",
                GemmShape::input_grad(n, fan_in, fan_out),
                &w,
                &*out,
                &mut b.scratch,
            )?;
        }
        Ok(())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // The fields free device memory and the cuBLAS handle; make sure this thread has the
        // context and nothing is still running. Errors here have nowhere to go.
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.stream.synchronize();
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.device_name)
    }

    fn set_weights(&mut self, flat: &[f32]) -> BackendResult<()> {
        let p = self.layout.num_params();
        if flat.len() != p {
            return Err(BackendError::Shape(format!(
                "weights hold {}: expected {p}",
                flat.len()
            )));
        }
        self.bind()?;
        self.stream
            .memcpy_htod(flat, &mut self.weights)
            .map_err(cuda_err("copying the weights to the device"))
    }

    fn forward_backward(
        &mut self,
        x: &[f32],
        labels: &[u8],
        reduction: LossReduction,
        grad: &mut [f32],
    ) -> BackendResult<StepStats> {
        check_shapes(
            &self.layout.dims,
            self.layout.num_params(),
            x,
            labels,
            Some(grad),
        )?;
        if labels.is_empty() {
            grad.fill(0.0);
            return Ok(StepStats::default());
        }
        let stats = self.compute_gradient(x, labels, reduction)?;
        self.download_gradient(grad)?;
        Ok(stats)
    }

    fn evaluate(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<u64> {
        check_shapes(&self.layout.dims, self.layout.num_params(), x, labels, None)?;
        self.bind()?;
        let n = labels.len();
        let inputs = self.layout.dims[0];
        let mut correct = 0;
        for start in (0..n).step_by(EVAL_ROWS) {
            let end = (start + EVAL_ROWS).min(n);
            let rows = end - start;
            self.upload_unchecked(&x[start * inputs..end * inputs], &labels[start..end])?;
            self.forward(rows)?;
            self.loss_and_stats(rows, 0.0)?;
            correct += self.read_stats()?.correct;
        }
        Ok(correct)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_source_has_every_entry_point_and_no_include() {
        for name in [
            "bias_act_f32",
            "relu_backward_f32",
            "softmax_xent_f32",
            "bias_grad_f32",
            "reduce_stats_f32",
        ] {
            assert!(
                KERNELS.contains(&format!("extern \"C\" __global__ void {name}(")),
                "{name}"
            );
        }
        assert!(!KERNELS.contains("#include"));
        assert!(KERNELS.contains(&format!("#define BIAS_GRAD_ROWS {BIAS_GRAD_ROWS}")));
    }

    #[test]
    fn launch_shapes() {
        assert_eq!(cfg_elems(0).grid_dim.0, 1);
        assert_eq!(cfg_elems(257).grid_dim.0, 2);
        assert_eq!(cfg_elems(1 << 30).grid_dim.0, MAX_GRID as u32);
        assert_eq!(cfg_rows(9).grid_dim.0, 2);
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
    #[ignore = "needs libnvrtc (a CUDA toolkit, or pip's nvidia-cuda-nvrtc on LD_LIBRARY_PATH): run with --ignored"]
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
            for name in [
                "bias_act_f32",
                "relu_backward_f32",
                "softmax_xent_f32",
                "bias_grad_f32",
                "reduce_stats_f32",
            ] {
                assert!(src.contains(&format!(".entry {name}(")), "{name} in {arch}");
            }
            if let Ok(dir) = std::env::var("PS_PTX_OUT") {
                std::fs::write(format!("{dir}/kernels_{arch}.ptx"), &src).unwrap();
            }
        }
        // An architecture this NVRTC does not know falls back to its default one.
        let (_, arch) = compile_kernels(1, 0).unwrap();
        assert_eq!(arch, "nvrtc default");
    }

    /// Column-major sgemm exactly as BLAS defines it (alpha 1, beta 0), on exact-size slices so
    /// that any read or write outside a matrix panics.
    fn sgemm_ref(g: GemmShape, a: &[f32], b: &[f32], c: &mut [f32]) {
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

    /// The three GEMM configurations give the row-major products the backward pass needs.
    #[test]
    fn gemm_shapes_compute_the_row_major_products() {
        let val = |seed: usize, len: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i * 7 + seed * 13) % 17) as f32 - 8.0) / 8.0)
                .collect()
        };
        for (rows, fan_in, fan_out) in [(1, 1, 1), (5, 3, 2), (3, 7, 4), (33, 13, 10)] {
            let x = val(1, rows * fan_in); // [rows, in]
            let w = val(2, fan_out * fan_in); // [out, in]
            let dz = val(3, rows * fan_out); // [rows, out]

            let mut z = vec![f32::NAN; rows * fan_out];
            sgemm_ref(GemmShape::forward(rows, fan_in, fan_out), &w, &x, &mut z);
            let want = matmul(
                rows,
                fan_in,
                fan_out,
                |i, p| x[i * fan_in + p],
                |p, j| w[j * fan_in + p],
            );
            assert_eq!(z, want, "Z = X·Wᵀ for {rows}x{fan_in}->{fan_out}");

            let mut dw = vec![f32::NAN; fan_out * fan_in];
            sgemm_ref(
                GemmShape::weight_grad(rows, fan_in, fan_out),
                &x,
                &dz,
                &mut dw,
            );
            let want = matmul(
                fan_out,
                rows,
                fan_in,
                |i, p| dz[p * fan_out + i],
                |p, j| x[p * fan_in + j],
            );
            assert_eq!(dw, want, "dW = dZᵀ·X for {rows}x{fan_in}->{fan_out}");

            let mut dx = vec![f32::NAN; rows * fan_in];
            sgemm_ref(
                GemmShape::input_grad(rows, fan_in, fan_out),
                &w,
                &dz,
                &mut dx,
            );
            let want = matmul(
                rows,
                fan_out,
                fan_in,
                |i, p| dz[i * fan_out + p],
                |p, j| w[p * fan_in + j],
            );
            assert_eq!(dx, want, "dX = dZ·W for {rows}x{fan_in}->{fan_out}");
        }
    }

    /// Without a GPU (this test passes either way): errors, never panics.
    #[test]
    fn no_gpu_is_an_error_not_a_panic() {
        match device_count() {
            Ok(n) => eprintln!("{n} CUDA device(s)"),
            Err(e) => assert!(matches!(e, BackendError::NoGpu(_)), "{e}"),
        }
        match CudaBackend::new(0, MlpLayout::new(&[3, 2])) {
            Ok(b) => eprintln!("{}", b.name()),
            Err(e) => {
                let m = e.to_string();
                assert!(!m.is_empty() && !m.contains('\n'), "{m:?}");
            }
        }
    }
}
