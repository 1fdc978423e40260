//! Strided batches of products on cuBLAS (`cublasSgemmStridedBatched`, [`Device::gemm_batched`]):
//! a convolution's products over a whole batch in one call instead of one call per sample; and
//! their sum over the batch ([`Device::gemm_batched_sum`], the weight gradient) as one batched
//! call into scratch memory then one product with a vector of ones, chunk by chunk when the
//! partial products would not fit the scratch limit.
//!
//! [`Device::gemm_batched`]: crate::ops::Device::gemm_batched
//! [`Device::gemm_batched_sum`]: crate::ops::Device::gemm_batched_sum

use super::{CudaDevice, GemmShape, check_i32, cuda_err};
use crate::backend::BackendResult;
use crate::ops::{Device, Mat, Strides};
use cudarc::cublas::{CudaBlas, Gemm, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

/// Values of scratch memory a batched sum uses at most (64 MiB); a batch whose partial products
/// need more is summed chunk by chunk.
pub(super) const SUM_SCRATCH: usize = 1 << 24;

/// The device memory of [`Device::gemm_batched_sum`]: the partial products of a chunk and the
/// ones that sum them, grown on demand and kept for the next step.
pub(super) struct SumScratch {
    partial: Option<CudaSlice<f32>>,
    ones: Option<CudaSlice<f32>>,
    /// Values of `partial` at most ([`SUM_SCRATCH`]; smaller in tests, to make chunks).
    pub(super) limit: usize,
}

impl Default for SumScratch {
    fn default() -> Self {
        Self {
            partial: None,
            ones: None,
            limit: SUM_SCRATCH,
        }
    }
}

/// cuBLAS's strided batch of column-major products `C[i] = op(A[i])·op(B[i]) + beta C[i]`
/// (alpha 1, full FP32) on the handle's stream; operands as in [`super::sgemm`], `A[i]` at
/// `i * stride_a` (likewise `B`, `C`).
///
/// # Safety
/// `a`, `b` and `c` must hold every element the `count` products read and write (checked by
/// [`Strides::check`] in the callers), on the handle's stream; the results may not overlap.
unsafe fn sgemm_strided(
    blas: &CudaBlas,
    g: GemmShape,
    a: (&CudaView<'_, f32>, usize),
    b: (&CudaView<'_, f32>, usize),
    c: (&mut CudaViewMut<'_, f32>, usize),
    count: usize,
) -> BackendResult<()> {
    let i = |what: &str, v: usize| check_i32(what, v);
    let stride = |v: usize| i("a batch stride", v).map(i64::from);
    let cfg = StridedBatchedConfig {
        gemm: g.config(0.0)?,
        batch_size: i("a batch's products", count)?,
        stride_a: stride(a.1)?,
        stride_b: stride(b.1)?,
        stride_c: stride(c.1)?,
    };
    // SAFETY: as the caller promises; alpha and beta are host values.
    unsafe { blas.gemm_strided_batched(cfg, a.0, b.0, c.0) }.map_err(cuda_err(format_args!(
        "cuBLAS sgemmStridedBatched (transa {:?}, transb {:?}, m {}, n {}, k {}, {count} products)",
        g.transa, g.transb, g.m, g.n, g.k
    )))
}

/// The matrices `first..first + chunk.count` of a strided operand whose matrices are `stride`
/// apart.
fn chunk_of<'a>(
    x: &Mat<CudaView<'a, f32>>,
    first: usize,
    stride: usize,
    chunk: Strides,
) -> Mat<CudaView<'a, f32>> {
    let start = first * stride;
    Mat {
        data: x
            .data
            .slice(start..start + chunk.extent(stride, x.rows * x.cols)),
        rows: x.rows,
        cols: x.cols,
        t: x.t,
    }
}

impl CudaDevice {
    /// [`Device::gemm_batched`]: one strided-batched cuBLAS call.
    pub(super) fn strided_products(
        &mut self,
        a: Mat<CudaView<'_, f32>>,
        b: Mat<CudaView<'_, f32>>,
        mut c: CudaViewMut<'_, f32>,
        s: Strides,
    ) -> BackendResult<()> {
        let (m, k, n) = s.check(&a, a.data.len(), &b, b.data.len(), c.len(), false)?;
        if s.count == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            // empty products: each result is zero, the values between results stay
            for i in 0..s.count {
                self.fill_zero(c.slice_mut(i * s.c..i * s.c + m * n))?;
            }
            return Ok(());
        }
        let g = GemmShape::row_major((a.rows, a.cols, a.t), (b.rows, b.cols, b.t));
        self.bind()?;
        // SAFETY: the operands hold exactly their `count` matrices at their strides (checked
        // above), which is what `g` addresses; cuBLAS's first operand is the row-major right
        // matrix (see `GemmShape::row_major`); all on the handle's stream.
        unsafe {
            sgemm_strided(
                &self.blas,
                g,
                (&b.data, s.b),
                (&a.data, s.a),
                (&mut c, s.c),
                s.count,
            )
        }
    }

    /// [`Device::gemm_batched_sum`]: per chunk of products, their partial results by one
    /// strided-batched call into the scratch memory, then `c (+)= onesᵀ · partials`.
    pub(super) fn strided_sum(
        &mut self,
        a: Mat<CudaView<'_, f32>>,
        b: Mat<CudaView<'_, f32>>,
        mut c: CudaViewMut<'_, f32>,
        s: Strides,
    ) -> BackendResult<()> {
        let (m, _, n) = s.check(&a, a.data.len(), &b, b.data.len(), c.len(), true)?;
        let mn = m * n;
        if s.count == 0 || mn == 0 {
            return self.fill_zero(c);
        }
        let per = (self.sum_scratch.limit / mn).clamp(1, s.count);
        let (mut partial, ones) = self.sum_buffers(per * mn, per)?;
        let result = (|| {
            for first in (0..s.count).step_by(per) {
                let count = per.min(s.count - first);
                let chunk = Strides { count, c: mn, ..s };
                let ai = chunk_of(&a, first, s.a, chunk);
                let bi = chunk_of(&b, first, s.b, chunk);
                self.strided_products(ai, bi, partial.slice_mut(0..count * mn), chunk)?;
                let beta = if first == 0 { 0.0 } else { 1.0 };
                self.gemm_beta(
                    Mat::new(ones.slice(0..count), 1, count),
                    Mat::new(partial.slice(0..count * mn), count, mn),
                    c.slice_mut(0..mn),
                    beta,
                )?;
            }
            Ok(())
        })();
        self.sum_scratch.partial = Some(partial);
        self.sum_scratch.ones = Some(ones);
        result
    }

    /// The scratch memory for `partial` values and `ones` ones, taken out of the device (put
    /// back by the caller), grown when smaller.
    fn sum_buffers(
        &mut self,
        partial: usize,
        ones: usize,
    ) -> BackendResult<(CudaSlice<f32>, CudaSlice<f32>)> {
        let p = match self.sum_scratch.partial.take() {
            Some(p) if p.len() >= partial => p,
            _ => self.alloc(partial)?,
        };
        let o = match self.sum_scratch.ones.take() {
            Some(o) if o.len() >= ones => o,
            _ => {
                let mut o = self.alloc(ones)?;
                self.bind()?;
                self.stream
                    .memcpy_htod(&vec![1.0f32; ones], &mut o)
                    .map_err(cuda_err(format_args!("filling {ones} ones")))?;
                o
            }
        };
        Ok((p, o))
    }
}
