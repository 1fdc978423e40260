//! The operations a model needs from a device: buffers, upload and download, matrix products
//! with transposes (overwriting or accumulating, one at a time or a strided batch of them per
//! call), bias and activation (per column or per channel), the ReLU backward mask, softmax cross-entropy, the bias gradients, and the
//! convolution's column matrices and 2x2 max-pooling. A model ([`crate::model`]: the MLP and
//! the CNN) is written once over this trait; the CPU
//! ([`crate::cpu::CpuDevice`]) and CUDA ([`crate::cuda::CudaDevice`]) devices implement it.
//! Every matrix is row-major.
//!
//! Operations are queued in order and may run asynchronously (the CUDA device queues them on
//! one stream). Only [`Device::download`], [`Device::finish_download`], [`Device::stats`],
//! [`Device::count_correct`] and [`Device::sync`] wait for the device, so a training step's intermediate values stay in
//! device buffers and the host waits once, when it reads the gradient.

use crate::error::{BackendError, BackendResult};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// Figures of one forward and backward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Sum over the batch of the per-sample cross-entropy loss (whatever the reduction).
    pub loss_sum: f64,
    /// Samples whose largest logit is their label.
    pub correct: u64,
}

/// `Shape` unless `got == want`.
pub fn check_len(what: &str, got: usize, want: usize) -> BackendResult<()> {
    if got == want {
        Ok(())
    } else {
        Err(BackendError::Shape(format!(
            "{what} holds {got} values: expected {want}"
        )))
    }
}

/// What a device's copies between host and device memory took since it was last asked
/// ([`Device::take_copy_times`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CopyTimes {
    /// Device time of the uploads (host to device: the weights, the batch), measured by
    /// events around each copy.
    pub up: Duration,
    /// Their bytes.
    pub up_bytes: u64,
    /// Device time of the downloads into pinned memory (device to host: the gradient).
    pub down: Duration,
    /// Their bytes.
    pub down_bytes: u64,
    /// Host time copying the downloads out of pinned memory into their destination.
    pub copy_out: Duration,
}

impl std::ops::AddAssign for CopyTimes {
    fn add_assign(&mut self, o: Self) {
        self.up += o.up;
        self.up_bytes += o.up_bytes;
        self.down += o.down;
        self.down_bytes += o.down_bytes;
        self.copy_out += o.copy_out;
    }
}

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

/// `count` products of the same shapes made by one call (cuBLAS's strided batch): product `i`
/// reads its left matrix at offset `i * a` of the left operand's data (0: one matrix for all
/// the products, such as a convolution's weight), its right matrix at `i * b`, and writes its
/// result at `i * c` (unused by [`Device::gemm_batched_sum`]). A convolution over a batch is
/// three such calls, whatever the batch size, instead of one product per sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Products.
    pub count: usize,
    /// Offset between the left matrices.
    pub a: usize,
    /// Offset between the right matrices.
    pub b: usize,
    /// Offset between the results.
    pub c: usize,
}

impl Strides {
    /// The values an operand of `count` matrices of `size` values, `stride` apart, spans:
    /// exactly what its data must hold.
    pub fn extent(&self, stride: usize, size: usize) -> usize {
        match self.count {
            0 => 0,
            n => (n - 1) * stride + size,
        }
    }

    /// Checks a batch of products `op(a) [m, k] · op(b) [k, n]` and its operands' lengths (`c`:
    /// the result's, `sum`: one `[m, n]` result for the whole batch); `(m, k, n)`.
    pub fn check<V, W>(
        &self,
        a: &Mat<V>,
        a_len: usize,
        b: &Mat<W>,
        b_len: usize,
        c_len: usize,
        sum: bool,
    ) -> BackendResult<(usize, usize, usize)> {
        let (m, k) = a.dim();
        let (k2, n) = b.dim();
        if k != k2 {
            return Err(BackendError::Shape(format!(
                "batched product of [{m}, {k}] and [{k2}, {n}]"
            )));
        }
        check_len(
            "a batched product's left matrices",
            a_len,
            self.extent(self.a, m * k),
        )?;
        check_len(
            "a batched product's right matrices",
            b_len,
            self.extent(self.b, k * n),
        )?;
        let c_want = if sum {
            m * n
        } else {
            self.extent(self.c, m * n)
        };
        check_len("a batched product's result", c_len, c_want)?;
        Ok((m, k, n))
    }
}

/// The geometry of a 2-D convolution over NCHW tensors (PyTorch's layout): `channels` input
/// planes of `height x width`, a square `kernel`, `stride` and zero `padding` on every side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeom {
    /// Input channels.
    pub channels: usize,
    /// Input height.
    pub height: usize,
    /// Input width.
    pub width: usize,
    /// Kernel side.
    pub kernel: usize,
    /// Stride (at least 1).
    pub stride: usize,
    /// Zero padding on each side.
    pub padding: usize,
}

impl ConvGeom {
    /// Output height and width: `(h + 2p - k) / s + 1` (`None` when the kernel does not fit
    /// or the stride is 0).
    pub fn out_hw(&self) -> Option<(usize, usize)> {
        let o = |n: usize| {
            (self.stride > 0 && self.kernel > 0 && n + 2 * self.padding >= self.kernel)
                .then(|| (n + 2 * self.padding - self.kernel) / self.stride + 1)
        };
        Some((o(self.height)?, o(self.width)?))
    }
    /// Values of one sample's input, `c * h * w`.
    pub fn input_len(&self) -> usize {
        self.channels * self.height * self.width
    }
    /// Rows of one sample's column matrix: `c * k * k` (the weight's `[out, c, k, k]` flattened
    /// to `[out, c * k * k]` multiplies it).
    pub fn col_rows(&self) -> usize {
        self.channels * self.kernel * self.kernel
    }

    /// Checks that an input of `x_len` and column matrices of `cols_len` values hold `n`
    /// samples of this geometry; the output height and width.
    pub fn check(&self, n: usize, x_len: usize, cols_len: usize) -> BackendResult<(usize, usize)> {
        let (oh, ow) = self.out_hw().ok_or_else(|| {
            BackendError::Shape(format!(
                "convolution {self:?}: the kernel does not fit the padded input (or stride 0)"
            ))
        })?;
        check_len("the convolution's input", x_len, n * self.input_len())?;
        check_len(
            "the column matrices",
            cols_len,
            n * self.col_rows() * oh * ow,
        )?;
        Ok((oh, ow))
    }
}

/// Checks the lengths of a 2x2 max-pooling over `planes` planes of `h x w`: input `x_len`,
/// output `y_len`, argmax `arg_len`; the output height and width.
pub fn check_pool(
    planes: usize,
    h: usize,
    w: usize,
    x_len: usize,
    y_len: usize,
    arg_len: usize,
) -> BackendResult<(usize, usize)> {
    let (oh, ow) = (h / 2, w / 2);
    check_len("the pooling's input", x_len, planes * h * w)?;
    check_len("the pooling's output", y_len, planes * oh * ow)?;
    check_len("the pooling's argmax", arg_len, planes * oh * ow)?;
    Ok((oh, ow))
}

/// A compute device: owned `f32` buffers, views of their ranges, and the operations of a
/// model's forward and backward pass. Operations may run asynchronously; results are visible
/// after [`Device::download`] or an operation that returns host values. Every operation
/// checks the lengths of its views against its shape arguments and returns
/// [`BackendError::Shape`] rather than reading or writing outside them.
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
    /// `buf[r]`; no reference to the rest of the buffer is made (see [`Device::host_ptr`]).
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
    /// A pointer to the host memory of a buffer, when it lives there, made without a
    /// reference to the whole buffer (so that another thread may write the parts that
    /// [`Device::view`] is not reading, as a [`crate::gate::PullGate`] does); `None` otherwise.
    fn host_ptr(_buf: &mut Self::Buf) -> Option<*mut f32> {
        None
    }
    /// Host memory of the device's own for `len` weights that a pull writes and
    /// [`Device::upload`] then copies to the device piece by piece (pinned on a GPU: such an
    /// upload is queued without waiting, and the copy runs while the pull goes on). Waits
    /// until no queued copy reads the memory any more; it stays allocated and unmoved until
    /// the next call or the device's end. `None` on a device that computes in host memory,
    /// whose weights are host memory already ([`Device::host_ptr`]).
    fn staging(&mut self, _len: usize) -> BackendResult<Option<*mut f32>> {
        Ok(None)
    }
    /// Copies `src` into `dst` (same length). From the memory of [`Device::staging`] the copy
    /// may still be running when this returns: `src` must not change until [`Device::sync`].
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
    /// queued before it) and copies its values into `dst` (same length); after
    /// [`Device::start_download_registered`] into `dst` itself, waits and copies nothing.
    fn finish_download(&mut self, slot: usize, dst: &mut [f32]) -> BackendResult<()>;
    /// The registrar of host memory for this device's DMA, when it reads and writes host
    /// memory directly once registered (a GPU: `cuMemHostRegister`): a shared-memory board
    /// registered with it ([`ps_net::shm::Board::register`]) is then uploaded from and
    /// downloaded into where it lies, with no host copy. `None` otherwise.
    fn registrar(&self) -> Option<Arc<dyn ps_net::shm::Registrar>> {
        None
    }
    /// True when the `len` values at `ptr` lie in host memory registered with
    /// [`Device::registrar`].
    fn is_registered(&self, _ptr: *const f32, _len: usize) -> bool {
        false
    }
    /// [`Device::start_download`] straight into `dst`, host memory registered for this device's
    /// DMA ([`Device::is_registered`]): no staging buffer; [`Device::finish_download`] of `slot`
    /// with `dst` then waits for the copy and copies nothing. Refused by default.
    ///
    /// # Safety
    /// The `src.len()` values at `dst` stay allocated, and neither read nor written by the
    /// host, until [`Device::finish_download`] of `slot` or [`Device::sync`] returned.
    unsafe fn start_download_registered(
        &mut self,
        _src: Self::View<'_>,
        _dst: *mut f32,
        _slot: usize,
    ) -> BackendResult<()> {
        Err(BackendError::Shape(format!(
            "{}: no download into registered host memory",
            self.name()
        )))
    }
    /// Sets every value of `v` to zero.
    fn fill_zero(&mut self, v: Self::ViewMut<'_>) -> BackendResult<()>;
    /// Waits until every queued operation has finished.
    fn sync(&mut self) -> BackendResult<()>;
    /// What the copies between host and device memory took since the last call (waits for
    /// those still queued); `None` on a device that computes in host memory.
    fn take_copy_times(&mut self) -> BackendResult<Option<CopyTimes>> {
        Ok(None)
    }

    /// `c = a · b` (`[m, k] · [k, n]`, `c` `[m, n]` overwritten).
    fn gemm(
        &mut self,
        a: Mat<Self::View<'_>>,
        b: Mat<Self::View<'_>>,
        c: Self::ViewMut<'_>,
    ) -> BackendResult<()>;
    /// `c += a · b` (`[m, k] · [k, n]`, `c` `[m, n]` accumulated into): a sum of products,
    /// such as a convolution's weight gradient over the samples of a batch.
    fn gemm_acc(
        &mut self,
        a: Mat<Self::View<'_>>,
        b: Mat<Self::View<'_>>,
        c: Self::ViewMut<'_>,
    ) -> BackendResult<()>;
    /// `c[i] = a[i] · b[i]` for each of the `s.count` products (see [`Strides`]; results may
    /// not overlap).
    fn gemm_batched(
        &mut self,
        a: Mat<Self::View<'_>>,
        b: Mat<Self::View<'_>>,
        c: Self::ViewMut<'_>,
        s: Strides,
    ) -> BackendResult<()>;
    /// `c = Σ_i a[i] · b[i]` over the `s.count` products (`c` `[m, n]` overwritten; zero when
    /// there are none): a convolution's weight gradient over the samples of a batch. A host
    /// device sums in the order of `i`.
    fn gemm_batched_sum(
        &mut self,
        a: Mat<Self::View<'_>>,
        b: Mat<Self::View<'_>>,
        c: Self::ViewMut<'_>,
        s: Strides,
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
    /// `z[b, c, i] += bias[c]` over `[n, channels, plane]` (a convolution's output: one bias per
    /// channel, added to each of its `plane` positions), then ReLU when `relu`.
    fn channel_bias_act(
        &mut self,
        z: Self::ViewMut<'_>,
        bias: Self::View<'_>,
        n: usize,
        channels: usize,
        plane: usize,
        relu: bool,
    ) -> BackendResult<()>;
    /// `out[c] = sum over b and i of dz[b, c, i]`, `dz` `[n, channels, plane]` (the gradient of
    /// [`Device::channel_bias_act`]'s bias).
    fn channel_bias_grad(
        &mut self,
        dz: Self::View<'_>,
        n: usize,
        channels: usize,
        plane: usize,
        out: Self::ViewMut<'_>,
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

    /// The column matrices of a convolution's input: `x` is `[n, c, h, w]`, `cols` becomes
    /// `[n, c * k * k, oh * ow]` with `cols[b, (ci * k + ki) * k + kj, oy * ow + ox] =
    /// x[b, ci, oy * s + ki - p, ox * s + kj - p]` (0 outside the input), so each sample's
    /// output `[out, oh * ow]` is the weight `[out, c * k * k]` times its column matrix.
    fn im2col(
        &mut self,
        x: Self::View<'_>,
        cols: Self::ViewMut<'_>,
        n: usize,
        g: ConvGeom,
    ) -> BackendResult<()>;
    /// The adjoint of [`Device::im2col`]: `dx` (`[n, c, h, w]`, overwritten) receives the sum of
    /// the entries of `cols` that [`Device::im2col`] copies from each input position (the
    /// gradient of the convolution's input from the gradient of its column matrices).
    fn col2im(
        &mut self,
        cols: Self::View<'_>,
        dx: Self::ViewMut<'_>,
        n: usize,
        g: ConvGeom,
    ) -> BackendResult<()>;
    /// 2x2 max-pooling with stride 2 of `x` (`[planes, h, w]`, `planes` = batch x channels)
    /// into `y` (`[planes, h / 2, w / 2]`, odd edges dropped as PyTorch's `floor` mode does),
    /// and in `arg` the index (0..4, row-major in the window, stored as f32) of each window's
    /// maximum: the first largest, a NaN winning as in PyTorch.
    fn maxpool2(
        &mut self,
        x: Self::View<'_>,
        y: Self::ViewMut<'_>,
        arg: Self::ViewMut<'_>,
        planes: usize,
        h: usize,
        w: usize,
    ) -> BackendResult<()>;
    /// The gradient of [`Device::maxpool2`]: `dx` (`[planes, h, w]`, overwritten) is `dy` at each
    /// window's maximum (`arg`) and 0 elsewhere.
    fn maxpool2_backward(
        &mut self,
        dy: Self::View<'_>,
        arg: Self::View<'_>,
        dx: Self::ViewMut<'_>,
        planes: usize,
        h: usize,
        w: usize,
    ) -> BackendResult<()>;
}
