//! The CPU device: ndarray matrix products (matrixmultiply, threaded) over slices of host
//! memory, so the model's weights and gradients are ranges of the flat vectors themselves,
//! never copied into separate tensors. [`CpuBackend`] is the MLP on it, [`cpu_model`] any
//! built-in model.

use crate::backend::Backend;
use crate::backend::{BackendError, BackendResult, StepStats};
use crate::model::Mlp;
pub(crate) use crate::ops::check_len;
use crate::ops::{ConvGeom, Device, Mat, Strides, check_pool};
use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};
use ps_model::layout::{MlpLayout, ModelLayout};
use std::ops::Range;

/// Rows per forward pass when evaluating, to bound memory.
const EVAL_ROWS: usize = 2048;

/// The host CPU as a [`Device`]; `threads` is only reported (matrixmultiply reads
/// `MATMUL_NUM_THREADS` once per process).
#[derive(Debug, Clone, Copy)]
pub struct CpuDevice {
    threads: usize,
    /// Figures of the last softmax cross-entropy.
    last: StepStats,
}

impl CpuDevice {
    /// The CPU, reporting `threads` matmul threads.
    pub fn new(threads: usize) -> Self {
        Self {
            threads,
            last: StepStats::default(),
        }
    }
}

/// `Shape` unless `logits` is `[labels.len(), cols]` and every label is below `cols`.
pub(crate) fn check_rows(logits: usize, labels: &[u8], cols: usize) -> BackendResult<()> {
    check_len("the logits", logits, labels.len() * cols)?;
    match labels.iter().find(|&&y| usize::from(y) >= cols) {
        Some(y) => Err(BackendError::Shape(format!("label {y}: expected < {cols}"))),
        None => Ok(()),
    }
}

/// The MLP on the CPU.
pub type CpuBackend = Mlp<CpuDevice>;

impl CpuBackend {
    /// The MLP of `layout` on the CPU; `threads` is only reported.
    pub fn new(layout: MlpLayout, threads: usize) -> Self {
        Mlp::on(layout, CpuDevice::new(threads)).expect("host allocation does not fail")
    }
}

/// The model of `layout` (the MLP or the CNN) on the CPU; `threads` is only reported.
pub fn cpu_model(layout: &ModelLayout, threads: usize) -> Box<dyn Backend> {
    crate::model::build(layout, CpuDevice::new(threads)).expect("host allocation does not fail")
}

fn view2(data: &[f32], rows: usize, cols: usize) -> BackendResult<ArrayView2<'_, f32>> {
    ArrayView2::from_shape((rows, cols), data)
        .map_err(|e| BackendError::Shape(format!("[{rows}, {cols}] over {}: {e}", data.len())))
}

/// Index of the largest value (the first on ties; NaN never wins).
fn argmax(row: &[f32]) -> usize {
    let (mut arg, mut max) = (0, f32::NEG_INFINITY);
    for (j, &v) in row.iter().enumerate() {
        if v > max {
            (arg, max) = (j, v);
        }
    }
    arg
}

impl Device for CpuDevice {
    type Buf = Vec<f32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];

    fn name(&self) -> String {
        format!("cpu ({} matmul threads)", self.threads)
    }

    fn alloc(&mut self, len: usize) -> BackendResult<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn view(buf: &Vec<f32>, r: Range<usize>) -> &[f32] {
        assert!(
            r.start <= r.end && r.end <= buf.len(),
            "view {r:?} of a buffer of {}",
            buf.len()
        );
        // SAFETY: the range lies inside the buffer (checked above). `as_ptr` makes no
        // reference to the whole buffer, so the view covers `r` alone: a pull may be writing
        // other parts of the weights meanwhile (`crate::gate`), never `r` while it is read.
        unsafe { std::slice::from_raw_parts(buf.as_ptr().add(r.start), r.len()) }
    }

    fn view_mut(buf: &mut Vec<f32>, r: Range<usize>) -> &mut [f32] {
        &mut buf[r]
    }

    fn sub_mut<'a, 'b: 'a>(v: &'a mut &'b mut [f32], r: Range<usize>) -> &'a mut [f32] {
        &mut v[r]
    }

    fn sub<'a, 'b: 'a>(v: &'a &'b mut [f32], r: Range<usize>) -> &'a [f32] {
        &v[r]
    }

    fn host_view_mut(host: &mut [f32]) -> Option<&mut [f32]> {
        Some(host)
    }

    fn host_of<'a>(v: &'a &mut [f32]) -> Option<&'a [f32]> {
        Some(v)
    }

    fn host_buf(buf: &mut Vec<f32>) -> Option<&mut [f32]> {
        Some(buf)
    }

    fn host_ptr(buf: &mut Vec<f32>) -> Option<*mut f32> {
        Some(buf.as_mut_ptr())
    }

    fn upload(&mut self, src: &[f32], dst: &mut [f32]) -> BackendResult<()> {
        check_len("the upload destination", dst.len(), src.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn download(&mut self, src: &[f32], dst: &mut [f32]) -> BackendResult<()> {
        check_len("the download destination", dst.len(), src.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn start_download(&mut self, _: &[f32], _: usize) -> BackendResult<()> {
        Err(BackendError::Shape(
            "the CPU device computes in host memory: there is nothing to download".into(),
        ))
    }

    fn finish_download(&mut self, _: usize, _: &mut [f32]) -> BackendResult<()> {
        Err(BackendError::Shape(
            "the CPU device computes in host memory: there is nothing to download".into(),
        ))
    }
    fn fill_zero(&mut self, v: &mut [f32]) -> BackendResult<()> {
        v.fill(0.0);
        Ok(())
    }

    fn sync(&mut self) -> BackendResult<()> {
        Ok(())
    }

    fn gemm(&mut self, a: Mat<&[f32]>, b: Mat<&[f32]>, c: &mut [f32]) -> BackendResult<()> {
        gemm_beta(a, b, c, 0.0)
    }

    fn gemm_acc(&mut self, a: Mat<&[f32]>, b: Mat<&[f32]>, c: &mut [f32]) -> BackendResult<()> {
        gemm_beta(a, b, c, 1.0)
    }

    fn gemm_batched(
        &mut self,
        a: Mat<&[f32]>,
        b: Mat<&[f32]>,
        c: &mut [f32],
        s: Strides,
    ) -> BackendResult<()> {
        let (m, _, n) = s.check(&a, a.data.len(), &b, b.data.len(), c.len(), false)?;
        for i in 0..s.count {
            let (ai, bi) = (nth(&a, i, s.a), nth(&b, i, s.b));
            gemm_beta(ai, bi, &mut c[i * s.c..i * s.c + m * n], 0.0)?;
        }
        Ok(())
    }

    fn gemm_batched_sum(
        &mut self,
        a: Mat<&[f32]>,
        b: Mat<&[f32]>,
        c: &mut [f32],
        s: Strides,
    ) -> BackendResult<()> {
        s.check(&a, a.data.len(), &b, b.data.len(), c.len(), true)?;
        if s.count == 0 {
            c.fill(0.0);
        }
        for i in 0..s.count {
            let beta = if i == 0 { 0.0 } else { 1.0 };
            gemm_beta(nth(&a, i, s.a), nth(&b, i, s.b), c, beta)?;
        }
        Ok(())
    }

    fn channel_bias_act(
        &mut self,
        z: &mut [f32],
        bias: &[f32],
        n: usize,
        channels: usize,
        plane: usize,
        relu: bool,
    ) -> BackendResult<()> {
        check_len("the convolution's output", z.len(), n * channels * plane)?;
        check_len("the channel bias", bias.len(), channels)?;
        if plane == 0 {
            return Ok(());
        }
        for (p, &b) in z.chunks_exact_mut(plane).zip(bias.iter().cycle()) {
            for v in p {
                let t = *v + b;
                *v = if relu { t.max(0.0) } else { t };
            }
        }
        Ok(())
    }

    fn channel_bias_grad(
        &mut self,
        dz: &[f32],
        n: usize,
        channels: usize,
        plane: usize,
        out: &mut [f32],
    ) -> BackendResult<()> {
        check_len("dL/dz", dz.len(), n * channels * plane)?;
        check_len("the channel bias gradient", out.len(), channels)?;
        out.fill(0.0);
        if plane == 0 {
            return Ok(());
        }
        for (p, g) in dz.chunks_exact(plane).zip((0..channels).cycle()) {
            out[g] += p.iter().sum::<f32>();
        }
        Ok(())
    }

    fn bias_act(
        &mut self,
        z: &mut [f32],
        bias: &[f32],
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> BackendResult<()> {
        check_len("the pre-activations", z.len(), rows * cols)?;
        check_len("the bias", bias.len(), cols)?;
        for row in z.chunks_exact_mut(cols) {
            for (v, b) in row.iter_mut().zip(bias) {
                let t = *v + b;
                *v = if relu { t.max(0.0) } else { t };
            }
        }
        Ok(())
    }

    fn relu_backward(&mut self, d: &mut [f32], act: &[f32]) -> BackendResult<()> {
        check_len("the gradient through the ReLU", d.len(), act.len())?;
        // a select, not a conditional store, so that it compiles to vector blends
        for (d, &a) in d.iter_mut().zip(act) {
            *d = if a <= 0.0 { 0.0 } else { *d };
        }
        Ok(())
    }

    fn softmax_xent(
        &mut self,
        logits: &mut [f32],
        labels: &[u8],
        cols: usize,
        scale: f32,
    ) -> BackendResult<()> {
        check_rows(logits.len(), labels, cols)?;
        let mut stats = StepStats::default();
        for (row, &y) in logits.chunks_exact_mut(cols).zip(labels) {
            let y = usize::from(y);
            let arg = argmax(row);
            let max = if row[arg] > f32::NEG_INFINITY {
                row[arg]
            } else {
                f32::NEG_INFINITY
            };
            stats.correct += u64::from(arg == y);
            let zy = row[y];
            let mut sum = 0.0f32;
            for v in row.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            // loss = ln(sum exp(z - max)) - (z_y - max): the kernel's formula (softmax_xent_f32),
            // finite however far z_y is below the max (ln(exp(z_y - max)) underflows to -inf
            // once z_y - max < -104)
            stats.loss_sum += f64::from(sum.ln() - (zy - max));
            let inv = 1.0 / sum;
            for v in row.iter_mut() {
                *v *= inv * scale;
            }
            row[y] -= scale;
        }
        self.last = stats;
        Ok(())
    }

    fn stats(&mut self) -> BackendResult<StepStats> {
        Ok(self.last)
    }

    fn bias_grad(
        &mut self,
        dz: &[f32],
        rows: usize,
        cols: usize,
        out: &mut [f32],
    ) -> BackendResult<()> {
        check_len("dL/dz", dz.len(), rows * cols)?;
        check_len("the bias gradient", out.len(), cols)?;
        out.fill(0.0);
        for row in dz.chunks_exact(cols) {
            for (g, v) in out.iter_mut().zip(row) {
                *g += v;
            }
        }
        Ok(())
    }

    fn count_correct(&mut self, logits: &[f32], labels: &[u8], cols: usize) -> BackendResult<u64> {
        check_rows(logits.len(), labels, cols)?;
        Ok(logits
            .chunks_exact(cols)
            .zip(labels)
            .filter(|&(row, &y)| argmax(row) == usize::from(y))
            .count() as u64)
    }

    fn eval_rows(&self) -> usize {
        EVAL_ROWS
    }

    fn im2col(&mut self, x: &[f32], cols: &mut [f32], n: usize, g: ConvGeom) -> BackendResult<()> {
        let (oh, ow) = g.check(n, x.len(), cols.len())?;
        let (h, w, k) = (g.height, g.width, g.kernel);
        let mut out = cols.iter_mut();
        for xb in x.chunks_exact(g.input_len().max(1)).take(n) {
            for plane in xb.chunks_exact(h * w) {
                for ki in 0..k {
                    for kj in 0..k {
                        for oy in 0..oh {
                            let y = (oy * g.stride + ki)
                                .checked_sub(g.padding)
                                .filter(|&y| y < h);
                            for ox in 0..ow {
                                let xx = (ox * g.stride + kj)
                                    .checked_sub(g.padding)
                                    .filter(|&xx| xx < w);
                                let v = match (y, xx) {
                                    (Some(y), Some(xx)) => plane[y * w + xx],
                                    _ => 0.0,
                                };
                                *out.next().expect("checked length") = v;
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn col2im(&mut self, cols: &[f32], dx: &mut [f32], n: usize, g: ConvGeom) -> BackendResult<()> {
        let (oh, ow) = g.check(n, dx.len(), cols.len())?;
        let (h, w, k) = (g.height, g.width, g.kernel);
        dx.fill(0.0);
        let mut src = cols.iter();
        for xb in dx.chunks_exact_mut(g.input_len().max(1)).take(n) {
            for plane in xb.chunks_exact_mut(h * w) {
                for ki in 0..k {
                    for kj in 0..k {
                        for oy in 0..oh {
                            let y = (oy * g.stride + ki)
                                .checked_sub(g.padding)
                                .filter(|&y| y < h);
                            for ox in 0..ow {
                                let v = *src.next().expect("checked length");
                                let xx = (ox * g.stride + kj)
                                    .checked_sub(g.padding)
                                    .filter(|&xx| xx < w);
                                if let (Some(y), Some(xx)) = (y, xx) {
                                    plane[y * w + xx] += v;
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn maxpool2(
        &mut self,
        x: &[f32],
        y: &mut [f32],
        arg: &mut [f32],
        planes: usize,
        h: usize,
        w: usize,
    ) -> BackendResult<()> {
        let (oh, ow) = check_pool(planes, h, w, x.len(), y.len(), arg.len())?;
        for p in 0..planes {
            let plane = &x[p * h * w..(p + 1) * h * w];
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut best, mut at) = (f32::NEG_INFINITY, 0usize);
                    for (i, (dy, dx)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                        let v = plane[(2 * oy + dy) * w + 2 * ox + dx];
                        if i == 0 || v > best || (v.is_nan() && !best.is_nan()) {
                            best = v;
                            at = i;
                        }
                    }
                    let o = (p * oh + oy) * ow + ox;
                    y[o] = best;
                    arg[o] = at as f32;
                }
            }
        }
        Ok(())
    }

    fn maxpool2_backward(
        &mut self,
        dy: &[f32],
        arg: &[f32],
        dx: &mut [f32],
        planes: usize,
        h: usize,
        w: usize,
    ) -> BackendResult<()> {
        let (oh, ow) = check_pool(planes, h, w, dx.len(), dy.len(), arg.len())?;
        dx.fill(0.0);
        for p in 0..planes {
            for oy in 0..oh {
                for ox in 0..ow {
                    let o = (p * oh + oy) * ow + ox;
                    let at = arg[o] as usize;
                    dx[p * h * w + (2 * oy + at / 2) * w + 2 * ox + at % 2] = dy[o];
                }
            }
        }
        Ok(())
    }
}

/// `c = a · b + beta c`, on the calling thread (matrixmultiply's threads).
/// Matrix `i` of a strided batch whose matrices are `stride` apart in `m`'s data (the lengths
/// were checked by [`Strides::check`]).
fn nth<'a>(m: &Mat<&'a [f32]>, i: usize, stride: usize) -> Mat<&'a [f32]> {
    let start = i * stride;
    Mat {
        data: &m.data[start..start + m.rows * m.cols],
        ..*m
    }
}

fn gemm_beta(a: Mat<&[f32]>, b: Mat<&[f32]>, c: &mut [f32], beta: f32) -> BackendResult<()> {
    let (m, k) = a.dim();
    let (k2, n) = b.dim();
    if k != k2 {
        return Err(BackendError::Shape(format!(
            "product of [{m}, {k}] and [{k2}, {n}]"
        )));
    }
    let av = view2(a.data, a.rows, a.cols)?;
    let bv = view2(b.data, b.rows, b.cols)?;
    let (av, bv) = (
        if a.t { av.reversed_axes() } else { av },
        if b.t { bv.reversed_axes() } else { bv },
    );
    let mut cv = ArrayViewMut2::from_shape((m, n), c)
        .map_err(|e| BackendError::Shape(format!("product [{m}, {n}]: {e}")))?;
    general_mat_mul(1.0, &av, &bv, beta, &mut cv);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use ps_config::LossReduction;

    /// Loss of the whole batch in f64, for finite differences.
    fn loss(b: &mut CpuBackend, x: &[f32], labels: &[u8]) -> f64 {
        let logits = b.logits(x).unwrap();
        let classes = b.layout().classes();
        let mut total = 0.0;
        for (row, &y) in logits.chunks(classes).zip(labels) {
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
            total += lse - row[usize::from(y)] as f64;
        }
        total
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let layout = MlpLayout::new(&[5, 7, 4, 3]);
        let mut b = CpuBackend::new(layout.clone(), 1);
        let w = layout.init_range(17, 0..layout.num_params());
        b.set_weights(&w).unwrap();
        let x: Vec<f32> = (0..6 * 5)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let labels = [0u8, 2, 1, 1, 0, 2];
        let mut g = vec![0.0; layout.num_params()];
        let stats = b
            .forward_backward(&x, &labels, LossReduction::Sum, &mut g)
            .unwrap();
        assert!((stats.loss_sum - loss(&mut b, &x, &labels)).abs() < 1e-4);
        // seed 17 keeps every pre-activation farther than eps from a ReLU kink (seed 3 does not)
        let eps = 1e-3f32;
        let mut worst = 0.0f64;
        for i in 0..layout.num_params() {
            let mut wp = w.clone();
            wp[i] += eps;
            b.set_weights(&wp).unwrap();
            let lp = loss(&mut b, &x, &labels);
            wp[i] -= 2.0 * eps;
            b.set_weights(&wp).unwrap();
            let lm = loss(&mut b, &x, &labels);
            let fd = (lp - lm) / (2.0 * eps as f64);
            worst = worst.max((fd - g[i] as f64).abs());
        }
        assert!(
            worst < 2e-3,
            "largest |finite difference - gradient| = {worst}"
        );
        // mean reduction divides by n
        b.set_weights(&w).unwrap();
        let mut gm = vec![0.0; layout.num_params()];
        b.forward_backward(&x, &labels, LossReduction::Mean, &mut gm)
            .unwrap();
        for (m, s) in gm.iter().zip(&g) {
            assert!((m * 6.0 - s).abs() <= 1e-5 * s.abs().max(1.0));
        }
    }

    #[test]
    fn empty_batch_and_bad_shapes() {
        let layout = MlpLayout::new(&[2, 3]);
        let mut b = CpuBackend::new(layout.clone(), 1);
        let mut g = vec![1.0; layout.num_params()];
        assert_eq!(
            b.forward_backward(&[], &[], LossReduction::Mean, &mut g)
                .unwrap(),
            StepStats::default()
        );
        assert!(g.iter().all(|&v| v == 0.0));
        let e = b
            .forward_backward(&[1.0], &[0], LossReduction::Mean, &mut g)
            .unwrap_err();
        assert!(
            e.to_string().contains("expected 1 samples x 2 inputs"),
            "{e}"
        );
        let e = b
            .forward_backward(&[1.0, 2.0], &[5], LossReduction::Mean, &mut g)
            .unwrap_err();
        assert!(e.to_string().contains("label 5: expected < 3"), "{e}");
    }

    /// A row whose label logit is far below the largest (a diverging run) has a finite loss
    /// equal to the margin, as on the CUDA device: the old `ln(sum) - ln(exp(z_y - max))` was
    /// +inf once `z_y - max < -104`.
    #[test]
    fn loss_is_finite_far_below_the_max() {
        let mut d = CpuDevice::new(1);
        for margin in [20.0f32, 90.0, 120.0, 1000.0] {
            let mut z = vec![0.0, margin, 0.0, -5.0, 0.0, 3.0];
            d.softmax_xent(&mut z, &[0, 2], 3, 1.0).unwrap();
            let s = d.stats().unwrap();
            let sum0 = 1.0 + 2.0 * f64::from(-margin).exp();
            let want = (sum0.ln() + f64::from(margin)) + ((-8f64).exp() + (-3f64).exp() + 1.0).ln();
            assert!(s.loss_sum.is_finite(), "margin {margin}: {}", s.loss_sum);
            assert!(
                (s.loss_sum - want).abs() <= 1e-5 * want,
                "margin {margin}: loss {} expected {want}",
                s.loss_sum
            );
            assert!(z.iter().all(|v| v.is_finite()));
            assert_eq!(z[0], -1.0, "softmax of the label row is ~0 at the label");
        }
    }

    fn rand(seed: u64, len: usize) -> Vec<f32> {
        (0..len as u64)
            .map(|i| {
                (ps_model::layout::splitmix64(seed ^ i.wrapping_mul(0x9e37)) % 2001) as f32 / 1000.0
                    - 1.0
            })
            .collect()
    }

    /// A convolution as im2col + one matrix product per sample equals the direct sum
    /// `out[b, o, oy, ox] = sum over ci, ki, kj of w[o, ci, ki, kj] x[b, ci, oy s + ki - p, ox s + kj - p]`,
    /// and col2im is im2col's adjoint (`<im2col(x), c> = <x, col2im(c)>`), for strides,
    /// paddings and kernels that do and do not tile the input.
    #[test]
    fn im2col_convolution_and_its_adjoint() {
        let mut d = CpuDevice::new(1);
        for (c, h, w, k, s, p, oc, n) in [
            (1, 5, 5, 5, 1, 0, 2, 1),
            (2, 7, 6, 3, 2, 1, 3, 2),
            (3, 8, 8, 5, 1, 2, 4, 2),
            (2, 9, 7, 4, 3, 0, 1, 3),
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
            let x = rand(1, n * g.input_len());
            let wt = rand(2, oc * g.col_rows());
            let mut cols = vec![f32::NAN; n * g.col_rows() * oh * ow];
            d.im2col(&x, &mut cols, n, g).unwrap();
            for b in 0..n {
                let col = &cols[b * g.col_rows() * oh * ow..(b + 1) * g.col_rows() * oh * ow];
                let mut out = vec![0.0f32; oc * oh * ow];
                d.gemm(
                    Mat::new(&wt[..], oc, g.col_rows()),
                    Mat::new(col, g.col_rows(), oh * ow),
                    &mut out,
                )
                .unwrap();
                for o in 0..oc {
                    for oy in 0..oh {
                        for ox in 0..ow {
                            let mut want = 0.0f64;
                            for ci in 0..c {
                                for ki in 0..k {
                                    for kj in 0..k {
                                        let (y, xx) = (
                                            (oy * s + ki) as i64 - p as i64,
                                            (ox * s + kj) as i64 - p as i64,
                                        );
                                        if y < 0 || xx < 0 || y >= h as i64 || xx >= w as i64 {
                                            continue;
                                        }
                                        want += f64::from(wt[((o * c + ci) * k + ki) * k + kj])
                                            * f64::from(
                                                x[((b * c + ci) * h + y as usize) * w
                                                    + xx as usize],
                                            );
                                    }
                                }
                            }
                            let got = f64::from(out[(o * oh + oy) * ow + ox]);
                            assert!(
                                (got - want).abs() < 1e-5,
                                "{g:?} b{b} o{o} ({oy},{ox}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
            let cvec = rand(3, cols.len());
            let mut dx = vec![f32::NAN; x.len()];
            d.col2im(&cvec, &mut dx, n, g).unwrap();
            let lhs: f64 = cols
                .iter()
                .zip(&cvec)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let rhs: f64 = x
                .iter()
                .zip(&dx)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            assert!(
                (lhs - rhs).abs() < 1e-4 * lhs.abs().max(1.0),
                "{g:?}: {lhs} vs {rhs}"
            );
        }
        let g = ConvGeom {
            channels: 1,
            height: 3,
            width: 3,
            kernel: 5,
            stride: 1,
            padding: 0,
        };
        let e = d.im2col(&[0.0; 9], &mut [], 1, g).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        let g = ConvGeom { kernel: 3, ..g };
        let e = d.im2col(&[0.0; 9], &mut [0.0; 8], 1, g).unwrap_err();
        assert!(
            e.to_string()
                .contains("the column matrices holds 8 values: expected 9"),
            "{e}"
        );
    }

    /// 2x2 max-pooling: the first largest of each window (a NaN wins), odd edges dropped; its
    /// gradient goes to that element only.
    #[test]
    fn maxpool2_and_its_gradient() {
        let mut d = CpuDevice::new(1);
        // one plane of 3 x 5: windows (0,0) tie 4 at index 1 and 2 -> 1; (0,1) NaN at 3
        #[rustfmt::skip]
        let x = [
            1.0, 4.0, 0.0, -1.0, 9.0,
            4.0, 2.0, -3.0, f32::NAN, 9.0,
            7.0, 7.0, 7.0, 7.0, 7.0,
        ];
        let (mut y, mut arg) = ([0.0f32; 2], [0.0f32; 2]);
        d.maxpool2(&x, &mut y, &mut arg, 1, 3, 5).unwrap();
        assert_eq!(y[0], 4.0);
        assert!(y[1].is_nan());
        assert_eq!(arg, [1.0, 3.0]);
        let mut dx = [f32::NAN; 15];
        d.maxpool2_backward(&[10.0, 20.0], &arg, &mut dx, 1, 3, 5)
            .unwrap();
        let mut want = [0.0f32; 15];
        want[1] = 10.0;
        want[8] = 20.0;
        assert_eq!(dx, want);
        let e = d
            .maxpool2(&x, &mut [0.0; 3], &mut arg, 1, 3, 5)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("the pooling's output holds 3 values: expected 2"),
            "{e}"
        );
    }

    /// A strided batch of products on the CPU is the products one by one, bit for bit (a
    /// shared left matrix, a transposed right one, gaps between results left as they were);
    /// the batched sum is the first product then each next one added, in order, bit for bit
    /// (the CNN's weight gradient as it was computed before batching); an empty sum is zero;
    /// a wrong length is a `Shape` error naming the operand.
    #[test]
    fn strided_batches_are_the_products_one_by_one() {
        let mut d = CpuDevice::new(1);
        let (m, k, n, count, gap) = (3, 4, 5, 3, 2);
        let s = Strides {
            count,
            a: 0,
            b: k * n + gap,
            c: m * n + gap,
        };
        let v = |seed: u64, len: usize| -> Vec<f32> {
            (0..len as u64)
                .map(|i| {
                    (ps_model::layout::splitmix64(seed * 977 + i) % 2001) as f32 / 1000.0 - 1.0
                })
                .collect()
        };
        let a = v(1, m * k);
        let b = v(2, s.extent(s.b, k * n));
        let mut got = vec![7.0; s.extent(s.c, m * n)];
        d.gemm_batched(Mat::new(&a[..], m, k), Mat::new(&b[..], k, n), &mut got, s)
            .unwrap();
        let mut sum = vec![f32::NAN; m * n];
        for i in 0..count {
            let bi = Mat::new(&b[i * s.b..i * s.b + k * n], k, n);
            let mut want = vec![0.0; m * n];
            d.gemm(Mat::new(&a[..], m, k), bi, &mut want).unwrap();
            assert_eq!(&got[i * s.c..i * s.c + m * n], &want[..], "product {i}");
            if i + 1 < count {
                assert_eq!(&got[i * s.c + m * n..(i + 1) * s.c], &[7.0; 2], "gap {i}");
            }
            let bi = Mat::new(&b[i * s.b..i * s.b + k * n], k, n);
            match i {
                0 => d.gemm(Mat::new(&a[..], m, k), bi, &mut sum).unwrap(),
                _ => d.gemm_acc(Mat::new(&a[..], m, k), bi, &mut sum).unwrap(),
            }
        }
        let mut got_sum = vec![f32::NAN; m * n];
        d.gemm_batched_sum(
            Mat::new(&a[..], m, k),
            Mat::new(&b[..], k, n),
            &mut got_sum,
            s,
        )
        .unwrap();
        assert_eq!(
            got_sum.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            sum.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let none = Strides { count: 0, ..s };
        d.gemm_batched_sum(
            Mat::new(&a[..0], m, k),
            Mat::new(&b[..0], k, n),
            &mut got_sum,
            none,
        )
        .unwrap();
        assert!(got_sum.iter().all(|&x| x == 0.0));
        let e = d
            .gemm_batched_sum(
                Mat::new(&a[..], m, k),
                Mat::new(&b[1..], k, n),
                &mut got_sum,
                s,
            )
            .unwrap_err();
        assert!(
            matches!(e, BackendError::Shape(_)) && e.to_string().contains("right matrices"),
            "{e}"
        );
    }
}
