//! The CUDA device: cuBLAS sgemm for the matrix products and a handful of NVRTC kernels
//! (`cuda/kernels.cu`, compiled once per device, no headers needed) for bias, ReLU, softmax
//! cross-entropy and the reductions, implementing [`Device`]; [`CudaBackend`] is the MLP of
//! [`crate::model`] on it. Everything runs in full FP32 on one stream of one device, and every
//! buffer of a step stays on the device: the host uploads the weights and the batch and
//! downloads the gradient and two statistics. The libraries (`libcuda`, `libnvrtc`,
//! `libcublas`) are loaded at run time, so this builds and runs on machines without CUDA, where
//! [`CudaBackend::new`] returns [`BackendError::NoGpu`].
//!
//! Layout: every matrix is row-major like the CPU device (`x [n, in]`, `fcN.weight [out, in]`,
//! activations `[n, out]`). cuBLAS is column-major, so a row-major `[r, c]` matrix is passed as
//! the column-major `[c, r]` matrix with leading dimension `c` (its transpose), and each
//! row-major product `C = op(A)·op(B)` is computed as the column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`
//! (see `GemmShape::row_major`).
//!
//! Submodules: `compile` (compiling and loading the kernels), `ops` ([`Device`] for
//! [`CudaDevice`]), `dma` (host memory registered for the GPU's DMA).

mod batched;
mod compile;
mod dma;
mod ops;

use crate::backend::Backend;
use crate::backend::{BackendError, BackendResult};
use crate::cpu::check_len;
use crate::model::{Cnn, Mlp, Model, Net};
use crate::ops::{ConvGeom, CopyTimes, Device, Mat};
#[cfg(test)]
use compile::{ENTRY_POINTS, compile_cubin, compile_kernels};
use compile::{Kernels, load_kernels};
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use ps_config::LossReduction;
use ps_model::layout::{CnnLayout, MlpLayout, ModelLayout};
use std::collections::HashMap;
use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Rows per forward pass when evaluating, to bound device memory.
pub const EVAL_ROWS: usize = 4096;

/// Seed of the start-up self-test's weights (the layout's own initialisation).
const SELF_TEST_SEED: u64 = 0x5e1f_7e57;
/// Largest relative difference the start-up self-test accepts between the CUDA and CPU loss
/// and per tensor of the gradient (FP32 sums in another order differ by ~1e-6).
pub const SELF_TEST_TOL: f64 = 1e-3;

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

/// The file the CUDA driver library was loaded from (from `/proc/self/maps`), to name it in
/// errors; `libcuda.so` when it cannot be found there.
pub fn driver_path() -> String {
    std::fs::read_to_string("/proc/self/maps")
        .ok()
        .and_then(|maps| {
            maps.lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .find(|p| {
                    Path::new(p).file_name().is_some_and(|f| {
                        let f = f.to_string_lossy();
                        f.starts_with("libcuda") && !f.starts_with("libcudart")
                    })
                })
                .map(str::to_string)
        })
        .unwrap_or_else(|| "libcuda.so".into())
}

/// Number of CUDA devices the driver sees; never panics. `NoGpu` only when there is no
/// driver: no library, the toolkit's stub library (`CUDA_ERROR_STUB_LIBRARY`), or a driver
/// that sees no device (`CUDA_ERROR_NO_DEVICE`). A driver that fails otherwise or panics in
/// initialisation is broken, which is `Cuda`, naming the library, so that `--device auto`
/// does not silently train on the CPU beside a broken GPU driver.
pub fn device_count() -> BackendResult<usize> {
    use cudarc::driver::sys::CUresult;
    check_driver()?;
    let r = catch_unwind(CudaContext::device_count).map_err(|p| {
        BackendError::Cuda(format!(
            "the CUDA driver {} panicked in initialisation: {}",
            driver_path(),
            panic_text(&*p)
        ))
    })?;
    let n = r.map_err(|e| match e.0 {
        CUresult::CUDA_ERROR_NO_DEVICE | CUresult::CUDA_ERROR_STUB_LIBRARY => {
            BackendError::NoGpu(one_line(&format!(
                "CUDA driver {} found but unusable: {e}",
                driver_path()
            )))
        }
        _ => BackendError::Cuda(one_line(&format!(
            "the CUDA driver {} failed in initialisation: {e}",
            driver_path()
        ))),
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The cuBLAS (column-major) arguments of one row-major product. A row-major `[r, c]` matrix
/// is the column-major `[c, r]` matrix (its transpose) with leading dimension `c`, so each
/// row-major product `C = A·B` is computed as the column-major `Cᵀ = Bᵀ·Aᵀ`.
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
    /// The row-major `C [m, n] = op(A) [m, k] · op(B) [k, n]`, where `A` is stored as a
    /// row-major `[a.0, a.1]` matrix and used transposed when `a.2` (likewise `B`), `C` stored
    /// densely (`ldc = n`). cuBLAS computes the column-major `Cᵀ [n, m] = op(B)ᵀ · op(A)ᵀ`: its
    /// first operand is `B`'s storage, which read column-major is `B_storedᵀ` (leading dimension
    /// `b.1`), so `op(B)ᵀ` is that matrix itself (`N`) when `B` is used as stored and its
    /// transpose (`T`) when `B` is used transposed; the second operand is `A`'s storage in the
    /// same way (leading dimension `a.1`).
    fn row_major(a: (usize, usize, bool), b: (usize, usize, bool)) -> Self {
        let (a_rows, a_cols, a_t) = a;
        let (b_rows, b_cols, b_t) = b;
        let m = if a_t { a_cols } else { a_rows };
        let k = if a_t { a_rows } else { a_cols };
        let n = if b_t { b_rows } else { b_cols };
        Self {
            transa: if b_t { OP_T } else { OP_N },
            transb: if a_t { OP_T } else { OP_N },
            m: n,
            n: m,
            k,
            lda: b_cols,
            ldb: a_cols,
            ldc: n,
        }
    }
}

impl GemmShape {
    /// cuBLAS's arguments of this shape (alpha 1), each checked to fit an `int`.
    fn config(&self, beta: f32) -> BackendResult<GemmConfig<f32>> {
        let i = |what: &str, v: usize| check_i32(what, v);
        Ok(GemmConfig {
            transa: self.transa,
            transb: self.transb,
            m: i("a product's width", self.m)?,
            n: i("a product's height", self.n)?,
            k: i("a product's inner size", self.k)?,
            alpha: 1.0f32,
            lda: i("a leading dimension", self.lda)?,
            ldb: i("a leading dimension", self.ldb)?,
            beta,
            ldc: i("a leading dimension", self.ldc)?,
        })
    }
}

/// cuBLAS's column-major `C = op(A)·op(B) + beta C` (alpha 1) in full FP32 on the handle's
/// stream; `a` and `b` are cuBLAS's operands, so [`CudaDevice::gemm`] passes the storage of
/// the row-major right matrix as `a` and of the left one as `b` (see [`GemmShape::row_major`]).
///
/// # Safety
/// `a`, `b` and `c` must hold at least the elements `g` reads and writes (checked by
/// [`CudaDevice::gemm`]: each is exactly its row-major matrix, which the shapes of
/// [`GemmShape::row_major`] address within), on the handle's stream.
unsafe fn sgemm(
    blas: &CudaBlas,
    g: GemmShape,
    beta: f32,
    a: &CudaView<'_, f32>,
    b: &CudaView<'_, f32>,
    c: &mut CudaViewMut<'_, f32>,
) -> BackendResult<()> {
    let cfg = g.config(beta)?;
    // SAFETY: as the caller promises; alpha and beta are host values (the default host
    // pointer mode).
    unsafe { blas.gemm(cfg, a, b, c) }.map_err(cuda_err(format_args!(
        "cuBLAS sgemm (transa {:?}, transb {:?}, m {}, n {}, k {})",
        g.transa, g.transb, g.m, g.n, g.k
    )))
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

/// Row kernels: one warp per row, 8 warps per block, grid-stride over the rows.
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

/// `channel_bias_grad_f32`: one block of 256 threads (its shared array) per channel.
fn cfg_channels(channels: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid(channels, 1), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `reduce_stats_f32`: exactly one block of 256 threads (the size of its shared arrays).
const CFG_REDUCE: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (256, 1, 1),
    shared_mem_bytes: 0,
};

/// The `int` arguments `n, c, h, w, k, s, p, oh, ow` of the convolution kernels.
fn conv_args(n: usize, g: ConvGeom, oh: usize, ow: usize) -> BackendResult<[i32; 9]> {
    let i = check_i32;
    Ok([
        i("a batch", n)?,
        i("channels", g.channels)?,
        i("a height", g.height)?,
        i("a width", g.width)?,
        i("a kernel", g.kernel)?,
        i("a stride", g.stride)?,
        i("a padding", g.padding)?,
        i("an output height", oh)?,
        i("an output width", ow)?,
    ])
}

/// The `planes, h, w` arguments of the pooling kernels.
fn pool_args(planes: usize, h: usize, w: usize) -> BackendResult<(i64, i32, i32)> {
    Ok((
        i64::try_from(planes)
            .map_err(|_| BackendError::Shape(format!("{planes} planes: too many")))?,
        check_i32("a height", h)?,
        check_i32("a width", w)?,
    ))
}

/// Copies `src` into `dst` (same length) on up to [`COPY_THREADS`] threads, at least
/// [`COPY_PIECE`] values each: one core copies out of pinned memory at a fraction of the rate
/// the DMA fills it (measured on an H100 host: the download of 80 MB at 14 GB/s against 55
/// GB/s for the upload from pinned memory), and a big layer's gradient waits for that copy
/// before it is pushed.
fn copy_out(dst: &mut [f32], src: &[f32]) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (src.len() / COPY_PIECE).min(COPY_THREADS).min(cores);
    if threads <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    let per = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(per).zip(src.chunks(per)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

/// Most threads [`copy_out`] uses.
const COPY_THREADS: usize = 4;
/// Fewest values a thread of [`copy_out`] copies (4 MiB).
const COPY_PIECE: usize = 1 << 20;

fn check_i32(what: &str, v: usize) -> BackendResult<i32> {
    i32::try_from(v)
        .map_err(|_| BackendError::Shape(format!("{what} = {v}: the CUDA device needs < 2^31")))
}

/// One copy between host and device memory, between two timing events on the stream.
struct CopySpan {
    up: bool,
    bytes: u64,
    start: CudaEvent,
    end: CudaEvent,
}

/// Spans queued that make [`CudaDevice`] read the times of those already done (without
/// waiting), so that spans do not pile up when nobody asks for them.
const FOLD_SPANS: usize = 64;

/// One CUDA GPU as a [`Device`]: a context, one stream on which every copy, kernel and cuBLAS
/// call is queued, the compiled kernels, and the small per-row buffers of the loss.
pub struct CudaDevice {
    // Buffers first: they are freed (stream-ordered) before the handle, stream and context.
    /// Pinned host buffers of [`Device::start_download`], by slot, each with the event
    /// recorded behind its last copy. (The pinned slice's own event is not recorded: event
    /// tracking is disabled on this context, see `init`.)
    staging: HashMap<usize, (PinnedHostSlice<f32>, CudaEvent)>,
    /// Downloads straight into registered host memory ([`Device::start_download_registered`]),
    /// by slot: the destination (address, values) and the event recorded behind the copy.
    direct: HashMap<usize, (usize, usize, CudaEvent)>,
    /// The host ranges registered with this context ([`Device::registrar`]).
    registered: dma::Ranges,
    /// Pinned host memory of [`Device::staging`]: the weights a pull writes, uploaded from
    /// there piece by piece while the rest arrives.
    weight_staging: Option<PinnedHostSlice<f32>>,
    /// Scratch memory of the batched sums (a convolution's weight gradient).
    sum_scratch: batched::SumScratch,
    /// The copies between host and device queued since the last [`Device::take_copy_times`],
    /// each between two timing events, and the times of those already read.
    copy_spans: Vec<CopySpan>,
    copy_times: CopyTimes,
    /// Timing events of read spans, for reuse.
    spare_events: Vec<CudaEvent>,
    /// Pinned copy of `stats[0..2]`, queued right behind each loss, and the event recorded
    /// behind that copy (so reading the loss does not wait for the backward pass after it).
    stats_host: (PinnedHostSlice<f64>, CudaEvent),
    /// Labels of the rows of the last loss or count, `[rows]`.
    labels: CudaSlice<u8>,
    /// Per-row loss and correct flag of the last loss or count, `[rows]` each.
    row_loss: CudaSlice<f32>,
    row_correct: CudaSlice<i32>,
    /// `[loss sum, correct]` of the last softmax cross-entropy, then `[0, correct]` of the
    /// last count.
    stats: CudaSlice<f64>,
    /// Rows the per-row buffers hold.
    rows: usize,
    k: Kernels,
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    ordinal: usize,
    device_name: String,
    arch: String,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("device", &self.device_name)
            .field("arch", &self.arch)
            .field("rows", &self.rows)
            .finish()
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // The fields free device memory and the cuBLAS handle; make sure this thread has the
        // context and nothing is still running. Errors here have nowhere to go.
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.stream.synchronize();
        }
    }
}

/// The MLP on a CUDA device.
pub type CudaBackend = Mlp<CudaDevice>;

impl CudaBackend {
    /// The MLP of `layout` on device `ordinal` ([`CudaDevice::new`]), checked by the self-test
    /// of [`open`].
    pub fn new(ordinal: usize, layout: MlpLayout) -> BackendResult<Self> {
        checked(ordinal, &layout.clone().into(), |dev| Mlp::on(layout, dev))
    }
}

/// The CNN on a CUDA device.
pub type CudaCnn = Cnn<CudaDevice>;

impl CudaCnn {
    /// The CNN of `layout` on device `ordinal` ([`CudaDevice::new`]), checked by the self-test
    /// of [`open`].
    pub fn new(ordinal: usize, layout: CnnLayout) -> BackendResult<Self> {
        checked(ordinal, &layout.clone().into(), |dev| Cnn::on(layout, dev))
    }
}

/// The model of `layout` on device `ordinal` ([`CudaDevice::new`]), checked by a three-sample
/// self-test that runs every kernel, sgemm and copy of its step once against the CPU device,
/// so that a broken installation fails here; with what the kernels were loaded as. `NoGpu`
/// when the driver, NVRTC or cuBLAS is missing or the device does not exist; `Cuda` when a
/// CUDA call fails. Never panics (a panic inside cudarc is caught).
pub fn open(ordinal: usize, layout: &ModelLayout) -> BackendResult<(Box<dyn Backend>, String)> {
    Ok(match layout {
        ModelLayout::Mlp(m) => {
            let b = CudaBackend::new(ordinal, m.clone())?;
            let arch = b.arch().to_string();
            (Box::new(b), arch)
        }
        ModelLayout::Cnn(c) => {
            let b = CudaCnn::new(ordinal, c.clone())?;
            let arch = b.arch().to_string();
            (Box::new(b), arch)
        }
    })
}

/// The model `make` builds on device `ordinal`, after [`self_test`].
fn checked<N: Net<CudaDevice>>(
    ordinal: usize,
    layout: &ModelLayout,
    make: impl FnOnce(CudaDevice) -> BackendResult<Model<CudaDevice, N>>,
) -> BackendResult<Model<CudaDevice, N>> {
    for t in &layout.tensors {
        for &d in &t.shape {
            check_i32("a tensor dimension", d)?;
        }
    }
    let dev = CudaDevice::new(ordinal)?;
    match catch_unwind(AssertUnwindSafe(move || {
        let mut me = make(dev)?;
        self_test(&mut me)?;
        Ok(me)
    })) {
        Ok(r) => r,
        Err(p) => Err(BackendError::Cuda(format!(
            "the self-test on cuda:{ordinal} panicked: {}",
            panic_text(&*p)
        ))),
    }
}

impl<N: Net<CudaDevice>> Model<CudaDevice, N> {
    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.device().ordinal
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.device().device_name
    }

    /// What the kernels were loaded as: "sm_90 cubin", or "compute_90 PTX, JIT-compiled by the
    /// driver (no cubin: why)".
    pub fn arch(&self) -> &str {
        &self.device().arch
    }
}

/// Three samples through the layout's initial weights of a fixed seed, against the CPU
/// device: the loss within [`SELF_TEST_TOL`] relative, and every tensor of the gradient
/// within [`SELF_TEST_TOL`] of the CPU's, relative to the tensor's largest value. Random
/// weights, so a wrong sgemm (a transposed operand, a dropped term) cannot pass as it did
/// with zero weights, where every product is zero. The weights are zero again afterwards.
fn self_test<N: Net<CudaDevice>>(m: &mut Model<CudaDevice, N>) -> BackendResult<()> {
    let layout = m.layout().clone();
    let p = layout.num_params();
    let (inputs, classes) = (layout.inputs(), layout.classes());
    let rows = 3;
    let weights = layout.init_range(SELF_TEST_SEED, 0..p);
    let x: Vec<f32> = (0..rows * inputs)
        .map(|i| ((i * 7919 + 13) % 199) as f32 / 99.0 - 1.0)
        .collect();
    let labels: Vec<u8> = (0..rows)
        .map(|r| u8::try_from((r * 5 + 1) % classes.min(256)).unwrap_or(0))
        .collect();
    let mut cpu = crate::model::build(&layout, crate::cpu::CpuDevice::new(1))?;
    cpu.set_weights(&weights)?;
    let mut want = vec![0.0f32; p];
    let want_stats = cpu.forward_backward(&x, &labels, LossReduction::Mean, &mut want)?;
    m.set_weights(&weights)?;
    let mut got = vec![f32::NAN; p];
    let stats = m.forward_backward(&x, &labels, LossReduction::Mean, &mut got)?;
    m.set_weights(&vec![0.0; p])?;
    let fail = |what: String| {
        BackendError::Cuda(format!(
            "self-test on cuda:{} failed (seeded random weights, {rows} samples, against the CPU device, tolerance {SELF_TEST_TOL:e}): {what}",
            m.ordinal()
        ))
    };
    let loss_err =
        (stats.loss_sum - want_stats.loss_sum).abs() / want_stats.loss_sum.abs().max(1e-6);
    if loss_err.is_nan() || loss_err > SELF_TEST_TOL {
        return Err(fail(format!(
            "loss {} where the CPU has {}",
            stats.loss_sum, want_stats.loss_sum
        )));
    }
    let tensors = layout.tensors.iter().map(|t| (t.name.clone(), t.range()));
    for (name, r) in tensors {
        let scale = want[r.clone()]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(1e-12);
        let err = got[r.clone()]
            .iter()
            .zip(&want[r.clone()])
            .map(|(a, b)| (a - b).abs() / scale)
            .fold(0f32, |m, e| {
                if e.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(e)
                }
            });
        if err.is_nan() || f64::from(err) > SELF_TEST_TOL {
            return Err(fail(format!(
                "gradient of {name} differs by {err:e} of its largest value"
            )));
        }
    }
    Ok(())
}

impl CudaDevice {
    /// Launches the convolution kernel `name` (`im2col_f32` or `col2im_f32`, both
    /// `(const float* src, float* dst, int n, c, h, w, k, s, p, oh, ow)`) with one thread per
    /// element of `dst` (grid-stride).
    ///
    /// # Safety
    /// `src` and `dst` must hold exactly the elements the kernel addresses for `a`.
    unsafe fn launch_conv(
        &mut self,
        name: &str,
        src: &CudaView<'_, f32>,
        dst: &mut CudaViewMut<'_, f32>,
        a: [i32; 9],
    ) -> BackendResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let f = match name {
            "im2col_f32" => &self.k.im2col,
            "col2im_f32" => &self.k.col2im,
            other => {
                return Err(BackendError::Cuda(format!(
                    "{other}: not a convolution kernel"
                )));
            }
        };
        let cfg = cfg_elems(dst.len());
        self.bind()?;
        let mut b = self.stream.launch_builder(f);
        b.arg(src).arg(dst);
        for v in &a {
            b.arg(v);
        }
        // SAFETY: as the caller promises.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(cuda_err(format_args!("launching {name}")))
    }

    /// `c = a · b + beta c` with cuBLAS ([`Device::gemm`], [`Device::gemm_acc`]).
    fn gemm_beta(
        &mut self,
        a: Mat<CudaView<'_, f32>>,
        b: Mat<CudaView<'_, f32>>,
        mut c: CudaViewMut<'_, f32>,
        beta: f32,
    ) -> BackendResult<()> {
        let (m, k) = a.dim();
        let (k2, n) = b.dim();
        if k != k2 {
            return Err(BackendError::Shape(format!(
                "product of [{m}, {k}] and [{k2}, {n}]"
            )));
        }
        check_len("a product's left matrix", a.data.len(), a.rows * a.cols)?;
        check_len("a product's right matrix", b.data.len(), b.rows * b.cols)?;
        check_len("a product", c.len(), m * n)?;
        if m == 0 || n == 0 || (k == 0 && beta != 0.0) {
            return Ok(());
        }
        if k == 0 {
            return self.fill_zero(c);
        }
        let g = GemmShape::row_major((a.rows, a.cols, a.t), (b.rows, b.cols, b.t));
        self.bind()?;
        // SAFETY: a, b and c are exactly their row-major matrices (checked above), which is
        // what `GemmShape::row_major` addresses; all three are on the handle's stream.
        unsafe { sgemm(&self.blas, g, beta, &b.data, &a.data, &mut c) }
    }

    /// Device `ordinal`: checks the libraries, creates the context and a stream, compiles the
    /// kernels with NVRTC and creates a cuBLAS handle on the stream. `NoGpu` when the driver,
    /// NVRTC or cuBLAS is missing or the device does not exist; `Cuda` when a CUDA call fails.
    /// Never panics (a panic inside cudarc is caught).
    pub fn new(ordinal: usize) -> BackendResult<Self> {
        check_driver()?;
        match catch_unwind(AssertUnwindSafe(|| Self::init(ordinal))) {
            Ok(r) => r,
            Err(p) => Err(BackendError::Cuda(format!(
                "CUDA initialisation of cuda:{ordinal} panicked (driver {}): {}",
                driver_path(),
                panic_text(&*p)
            ))),
        }
    }

    /// An event that records time (a spare one when there is one).
    fn timing_event(&mut self) -> BackendResult<CudaEvent> {
        if let Some(e) = self.spare_events.pop() {
            return Ok(e);
        }
        self.ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cuda_err("creating a timing event"))
    }

    /// Records a timing event before a copy.
    fn span_begin(&mut self) -> BackendResult<CudaEvent> {
        let e = self.timing_event()?;
        e.record(&self.stream)
            .map_err(cuda_err("recording a timing event"))?;
        Ok(e)
    }

    /// Records a timing event after the copy of `values` floats that `start` began, for
    /// [`Device::take_copy_times`].
    fn span_end(&mut self, up: bool, values: usize, start: CudaEvent) -> BackendResult<()> {
        let end = self.timing_event()?;
        end.record(&self.stream)
            .map_err(cuda_err("recording a timing event"))?;
        self.copy_spans.push(CopySpan {
            up,
            bytes: 4 * values as u64,
            start,
            end,
        });
        if self.copy_spans.len() >= FOLD_SPANS {
            self.fold_spans(false)?;
        }
        Ok(())
    }

    /// Adds the times of the spans that are done (all of them, waiting, with `wait`) to
    /// `copy_times`, and keeps their events for reuse.
    fn fold_spans(&mut self, wait: bool) -> BackendResult<()> {
        let mut pending = Vec::new();
        for s in std::mem::take(&mut self.copy_spans) {
            if !wait && !s.end.is_complete() {
                pending.push(s);
                continue;
            }
            let ms = s
                .start
                .elapsed_ms(&s.end)
                .map_err(cuda_err("reading the time of a copy"))?;
            let d = Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
            let t = &mut self.copy_times;
            if s.up {
                t.up += d;
                t.up_bytes += s.bytes;
            } else {
                t.down += d;
                t.down_bytes += s.bytes;
            }
            self.spare_events.extend([s.start, s.end]);
        }
        self.copy_spans = pending;
        Ok(())
    }

    fn init(ordinal: usize) -> BackendResult<Self> {
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
        // SAFETY: this device uses exactly one stream for every allocation, copy, kernel and
        // cuBLAS call, so stream order alone orders all uses of its buffers and their
        // (stream-ordered) frees; the per-buffer events cudarc records for multi-stream use are
        // not needed. Host copies are from/to pageable memory, which CUDA stages synchronously
        // (htod returns once the source has been read, dtoh once the destination is written);
        // downloads also synchronise. Only slices allocated by this `ctx` handle are affected.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let device_name = ctx.name().map_err(cuda_err("reading the device name"))?;
        let (k, arch) = load_kernels(&ctx, ordinal)?;
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
        let stats = stream
            .alloc_zeros::<f64>(4)
            .map_err(cuda_err("allocating the statistics"))?;
        // SAFETY: written by a copy before it is read (stats() reads only after a loss, whose
        // statistics it copies); flags 0: cached, readable host memory
        let stats_host = unsafe { ctx.alloc_pinned_with_flags::<f64>(2, 0) }
            .map_err(cuda_err("allocating pinned host memory for the statistics"))?;
        let stats_host = (
            stats_host,
            ctx.new_event(None).map_err(cuda_err("creating an event"))?,
        );
        let labels = stream
            .alloc_zeros::<u8>(1)
            .map_err(cuda_err("allocating the labels"))?;
        let row_loss = stream
            .alloc_zeros::<f32>(1)
            .map_err(cuda_err("allocating the row losses"))?;
        let row_correct = stream
            .alloc_zeros::<i32>(1)
            .map_err(cuda_err("allocating the row flags"))?;
        Ok(Self {
            staging: HashMap::new(),
            direct: HashMap::new(),
            registered: Default::default(),
            weight_staging: None,
            sum_scratch: Default::default(),
            copy_spans: Vec::new(),
            copy_times: CopyTimes::default(),
            spare_events: Vec::new(),
            stats_host,
            labels,
            row_loss,
            row_correct,
            stats,
            rows: 1,
            k,
            blas,
            stream,
            ctx,
            ordinal,
            device_name,
            arch,
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// What the kernels were loaded as (see [`CudaBackend::arch`]).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    fn bind(&self) -> BackendResult<()> {
        self.ctx.bind_to_thread().map_err(cuda_err(format_args!(
            "binding the context of cuda:{}",
            self.ordinal
        )))
    }

    /// Makes the per-row buffers hold at least `rows` rows (reallocates only to grow; the old
    /// buffers are freed in stream order, after the work queued before).
    fn ensure_rows(&mut self, rows: usize) -> BackendResult<()> {
        if rows <= self.rows {
            return Ok(());
        }
        let s = &self.stream;
        self.labels = s
            .alloc_zeros::<u8>(rows)
            .map_err(cuda_err(format_args!("allocating labels for {rows} rows")))?;
        self.row_loss = s.alloc_zeros::<f32>(rows).map_err(cuda_err(format_args!(
            "allocating row losses for {rows} rows"
        )))?;
        self.row_correct = s.alloc_zeros::<i32>(rows).map_err(cuda_err(format_args!(
            "allocating row flags for {rows} rows"
        )))?;
        self.rows = rows;
        Ok(())
    }

    /// Copies `labels` (checked `< cols`) into the first rows of the label buffer.
    fn upload_labels(&mut self, labels: &[u8]) -> BackendResult<()> {
        self.ensure_rows(labels.len())?;
        let mut dst = self.labels.slice_mut(0..labels.len());
        self.stream
            .memcpy_htod(labels, &mut dst)
            .map_err(cuda_err("copying the labels to the device"))
    }

    /// Queues the sum of the first `rows` per-row losses and flags into `stats[at..at + 2]`.
    fn reduce_rows(&mut self, rows: i32, at: usize) -> BackendResult<()> {
        let mut out = self.stats.slice_mut(at..at + 2);
        // SAFETY: reduce_stats_f32(const float* row_loss, const int* row_correct, int rows,
        // double* out): reads `rows` <= self.rows entries of each per-row buffer, writes
        // out[0..2], a view of exactly 2 doubles; one block of 256 threads, the size of its
        // shared arrays.
        unsafe {
            self.stream
                .launch_builder(&self.k.reduce_stats)
                .arg(&self.row_loss)
                .arg(&self.row_correct)
                .arg(&rows)
                .arg(&mut out)
                .launch(CFG_REDUCE)
        }
        .map(|_| ())
        .map_err(cuda_err("launching reduce_stats_f32"))
    }

    /// Downloads `stats[at..at + 2]` (waits for the stream).
    fn read_stats(&mut self, at: usize) -> BackendResult<[f64; 2]> {
        let mut host = [0.0f64; 2];
        self.stream
            .memcpy_dtoh(&self.stats.slice(at..at + 2), &mut host)
            .map_err(cuda_err("copying the loss and accuracy to the host"))?;
        self.stream
            .synchronize()
            .map_err(cuda_err("synchronising after the statistics"))?;
        Ok(host)
    }
}

#[cfg(test)]
mod tests;
