//! The operations a model needs from a device: buffers, upload and download, matrix products
//! with transposes, bias and activation, the ReLU backward mask, softmax cross-entropy and the
//! bias gradient. A model ([`crate::model::Mlp`]) is written once over this trait; the CPU
//! ([`crate::cpu::CpuDevice`]) and CUDA ([`crate::cuda::CudaDevice`]) devices implement it.
//! Every matrix is row-major.
//!
//! Operations are queued in order and may run asynchronously (the CUDA device queues them on
//! one stream). Only [`Device::download`], [`Device::finish_download`], [`Device::stats`],
//! [`Device::count_correct`] and [`Device::sync`] wait for the device, so a training step's intermediate values stay in
//! device buffers and the host waits once, when it reads the gradient.

use crate::backend::{BackendResult, StepStats};
use std::ops::Range;

/// A row-major `[rows, cols]` matrix stored in `data`, used as itself or, with `t`, as its
/// transpose.
#[derive(Debug)]
pub struct Mat<V> {
    /// The `rows * cols` values.
    pub data: V,
    /// Rows as stored.
    pub rows: usize,
    /// Columns as stored.
    pub cols: usize,
    /// Use the transpose.
    pub t: bool,
}

impl<V> Mat<V> {
    /// `data` as a `[rows, cols]` matrix.
    pub fn new(data: V, rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            t: false,
        }
    }
    /// The same storage, transposed.
    pub fn t(self) -> Self {
        Self { t: !self.t, ..self }
    }
    /// Shape of the matrix as used (after the transpose).
    pub fn dim(&self) -> (usize, usize) {
        if self.t {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// A compute device: owned `f32` buffers, views of their ranges, and the operations of a
/// model's forward and backward pass. Operations may run asynchronously; results are visible
/// after [`Device::download`] or an operation that returns host values. Every operation
/// checks the lengths of its views against its shape arguments and returns
/// [`crate::backend::BackendError::Shape`] rather than reading or writing outside them.
pub trait Device: Send {
    /// An owned buffer of `f32` on the device.
    type Buf: Send;
    /// A read-only range of a buffer.
    type View<'a>
    where
        Self: 'a;
    /// A writable range of a buffer (or of host memory the device can write directly).
    type ViewMut<'a>
    where
        Self: 'a;

    /// "cpu (2 matmul threads)".
    fn name(&self) -> String;
    /// A zeroed buffer of `len` values (a device may reserve room for one value when `len` is 0).
    fn alloc(&mut self, len: usize) -> BackendResult<Self::Buf>;
    /// `buf[r]`.
    fn view(buf: &Self::Buf, r: Range<usize>) -> Self::View<'_>;
    /// `buf[r]`, writable.
    fn view_mut(buf: &mut Self::Buf, r: Range<usize>) -> Self::ViewMut<'_>;
    /// `v[r]` of a writable view.
    fn sub_mut<'a, 'b: 'a>(v: &'a mut Self::ViewMut<'b>, r: Range<usize>) -> Self::ViewMut<'a>
    where
        Self: 'b;
    /// `v[r]` of a writable view, read-only.
    fn sub<'a, 'b: 'a>(v: &'a Self::ViewMut<'b>, r: Range<usize>) -> Self::View<'a>
    where
        Self: 'b;
    /// Host memory as a writable view, when the device computes in host memory (the CPU);
    /// `None` otherwise.
    fn host_view_mut(host: &mut [f32]) -> Option<Self::ViewMut<'_>>;
    /// The host memory of a view made by [`Device::host_view_mut`]; `None` on other devices.
    fn host_of<'a>(v: &'a Self::ViewMut<'_>) -> Option<&'a [f32]>;
    /// Host memory of a buffer, when it lives there (the CPU); `None` otherwise.
    fn host_buf(buf: &mut Self::Buf) -> Option<&mut [f32]>;
    /// Copies `src` into `dst` (same length).
    fn upload(&mut self, src: &[f32], dst: Self::ViewMut<'_>) -> BackendResult<()>;
    /// Copies `src` into `dst` (same length), waiting for the operations before it.
    fn download(&mut self, src: Self::View<'_>, dst: &mut [f32]) -> BackendResult<()>;
    /// Queues a copy of `src` to host memory of the device's own (a pinned staging buffer
    /// named `slot`) behind the operations queued before, without waiting: the device goes on
    /// with what is queued after it. [`Device::finish_download`] waits for this copy alone.
    /// A later copy into the same slot replaces it. Devices that compute in host memory (the
    /// CPU) have nothing to download and refuse it.
    fn start_download(&mut self, src: Self::View<'_>, slot: usize) -> BackendResult<()>;
    /// Waits for the copy of [`Device::start_download`] into `slot` (only for it and what was
    /// queued before it) and copies its values into `dst` (same length).
    fn finish_download(&mut self, slot: usize, dst: &mut [f32]) -> BackendResult<()>;
    /// Sets every value of `v` to zero.
    fn fill_zero(&mut self, v: Self::ViewMut<'_>) -> BackendResult<()>;
    /// Waits until every queued operation has finished.
    fn sync(&mut self) -> BackendResult<()>;

    /// `c = a · b` (`[m, k] · [k, n]`, `c` `[m, n]` overwritten).
    fn gemm(
        &mut self,
        a: Mat<Self::View<'_>>,
        b: Mat<Self::View<'_>>,
        c: Self::ViewMut<'_>,
    ) -> BackendResult<()>;
    /// `z[r, c] += bias[c]` over `[rows, cols]`, then ReLU when `relu`.
    fn bias_act(
        &mut self,
        z: Self::ViewMut<'_>,
        bias: Self::View<'_>,
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> BackendResult<()>;
    /// `d[i] = 0` where `act[i] <= 0` (the gradient through a ReLU whose output is `act`).
    fn relu_backward(&mut self, d: Self::ViewMut<'_>, act: Self::View<'_>) -> BackendResult<()>;
    /// Softmax cross-entropy of each row of `logits` (`[labels.len(), cols]`) against `labels`
    /// (each `< cols`): replaces the logits by `scale * (softmax - onehot)`; the loss summed
    /// over rows and the rows whose largest logit (first on ties) is their label are kept on
    /// the device until [`Device::stats`].
    fn softmax_xent(
        &mut self,
        logits: Self::ViewMut<'_>,
        labels: &[u8],
        cols: usize,
        scale: f32,
    ) -> BackendResult<()>;
    /// The loss sum and correct count of the last [`Device::softmax_xent`], waiting for it.
    fn stats(&mut self) -> BackendResult<StepStats>;
    /// `out[c] = sum over r of dz[r, c]` (the bias gradient), `dz` `[rows, cols]`.
    fn bias_grad(
        &mut self,
        dz: Self::View<'_>,
        rows: usize,
        cols: usize,
        out: Self::ViewMut<'_>,
    ) -> BackendResult<()>;
    /// Rows of `logits` (`[labels.len(), cols]`) whose largest value (first on ties) is their
    /// label (waits for the device; leaves [`Device::stats`] unchanged).
    fn count_correct(
        &mut self,
        logits: Self::View<'_>,
        labels: &[u8],
        cols: usize,
    ) -> BackendResult<u64>;
    /// Rows per forward pass when evaluating, to bound memory.
    fn eval_rows(&self) -> usize;
}
