//! The CPU backend: ndarray matrix products (matrixmultiply, threaded) over views of the flat
//! parameter vector, so weights and gradients are never copied into separate tensors.

use crate::backend::{Backend, BackendResult, StepStats, check_shapes};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis, s};
use ps_common::config::LossReduction;
use ps_common::layout::MlpLayout;

/// Rows per forward pass when evaluating, to bound memory.
const EVAL_ROWS: usize = 2048;

/// The MLP on the CPU.
#[derive(Debug, Clone)]
pub struct CpuBackend {
    layout: MlpLayout,
    weights: Vec<f32>,
    threads: usize,
}

impl CpuBackend {
    /// A backend for `layout`; `threads` is only reported (matrixmultiply reads
    /// `MATMUL_NUM_THREADS` once per process).
    pub fn new(layout: MlpLayout, threads: usize) -> Self {
        let weights = vec![0.0; layout.num_params()];
        Self {
            layout,
            weights,
            threads,
        }
    }

    fn weight(&self, l: usize) -> (ArrayView2<'_, f32>, &[f32]) {
        let (w, b) = self.layout.layer(l);
        let (fan_out, fan_in) = (self.layout.dims[l + 1], self.layout.dims[l]);
        let wv =
            ArrayView2::from_shape((fan_out, fan_in), &self.weights[w]).expect("layout matches");
        (wv, &self.weights[b])
    }

    /// Forward pass; returns the post-ReLU activations of each hidden layer and the logits.
    fn forward(&self, x: ArrayView2<'_, f32>) -> Vec<Array2<f32>> {
        let layers = self.layout.num_layers();
        let mut outs: Vec<Array2<f32>> = Vec::with_capacity(layers);
        for l in 0..layers {
            let (w, b) = self.weight(l);
            let input = if l == 0 { x } else { outs[l - 1].view() };
            let mut z = input.dot(&w.t());
            let relu = l + 1 < layers;
            for mut row in z.rows_mut() {
                for (v, bias) in row.iter_mut().zip(b) {
                    let t = *v + bias;
                    *v = if relu { t.max(0.0) } else { t };
                }
            }
            outs.push(z);
        }
        outs
    }
}

/// Softmax cross-entropy of each row of `logits` against `labels`: replaces `logits` by
/// `scale * (softmax - onehot)` and returns (loss sum, correct count).
fn softmax_xent_grad(logits: &mut Array2<f32>, labels: &[u8], scale: f32) -> StepStats {
    let mut stats = StepStats::default();
    for (mut row, &y) in logits.rows_mut().into_iter().zip(labels) {
        let y = usize::from(y);
        let (mut arg, mut max) = (0, f32::NEG_INFINITY);
        for (j, &v) in row.iter().enumerate() {
            if v > max {
                (arg, max) = (j, v);
            }
        }
        stats.correct += u64::from(arg == y);
        let mut sum = 0.0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        // loss = log(sum exp(z - max)) - (z_y - max)
        stats.loss_sum += f64::from(sum.ln() - (row[y].ln()));
        let inv = 1.0 / sum;
        for v in row.iter_mut() {
            *v *= inv * scale;
        }
        row[y] -= scale;
    }
    stats
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu ({} matmul threads)", self.threads)
    }

    fn set_weights(&mut self, flat: &[f32]) -> BackendResult<()> {
        if flat.len() != self.weights.len() {
            return Err(crate::backend::BackendError::Shape(format!(
                "weights hold {}: expected {}",
                flat.len(),
                self.weights.len()
            )));
        }
        self.weights.copy_from_slice(flat);
        Ok(())
    }

    fn host_weights(&mut self) -> Option<&mut [f32]> {
        Some(&mut self.weights)
    }

    fn forward_backward(
        &mut self,
        x: &[f32],
        labels: &[u8],
        reduction: LossReduction,
        grad: &mut [f32],
    ) -> BackendResult<StepStats> {
        self.forward_backward_overlapped(x, labels, reduction, grad, &mut |_, _, _| {})
    }

    fn forward_backward_overlapped(
        &mut self,
        x: &[f32],
        labels: &[u8],
        reduction: LossReduction,
        grad: &mut [f32],
        ready: &mut dyn FnMut(usize, &[f32], StepStats),
    ) -> BackendResult<StepStats> {
        let dims = &self.layout.dims;
        check_shapes(dims, self.weights.len(), x, labels, Some(grad))?;
        let n = labels.len();
        if n == 0 {
            grad.fill(0.0);
            ready(0, grad, StepStats::default());
            return Ok(StepStats::default());
        }
        let x = ArrayView2::from_shape((n, dims[0]), x).expect("checked");
        let mut acts = self.forward(x);
        let layers = self.layout.num_layers();
        let scale = match reduction {
            LossReduction::Mean => 1.0 / n as f32,
            LossReduction::Sum => 1.0,
        };
        let mut dz = acts.pop().expect("at least one layer");
        let stats = softmax_xent_grad(&mut dz, labels, scale);
        for l in (0..layers).rev() {
            let (wr, br) = self.layout.layer(l);
            let start = wr.start;
            let input = if l == 0 { x } else { acts[l - 1].view() };
            {
                let mut gw = ArrayViewMut2::from_shape((dims[l + 1], dims[l]), &mut grad[wr])
                    .expect("layout matches");
                general_mat_mul(1.0, &dz.t(), &input, 0.0, &mut gw);
            }
            let gb = &mut grad[br];
            gb.fill(0.0);
            for row in dz.rows() {
                for (g, v) in gb.iter_mut().zip(row) {
                    *g += v;
                }
            }
            ready(start, &grad[start..], stats);
            if l > 0 {
                let (w, _) = self.weight(l);
                let mut da = dz.dot(&w);
                da.zip_mut_with(&acts[l - 1], |d, &a| {
                    if a <= 0.0 {
                        *d = 0.0;
                    }
                });
                dz = da;
            }
        }
        Ok(stats)
    }

    fn evaluate(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<u64> {
        let dims = &self.layout.dims;
        check_shapes(dims, self.weights.len(), x, labels, None)?;
        let n = labels.len();
        let x = ArrayView2::from_shape((n, dims[0]), x).expect("checked");
        let mut correct = 0;
        for start in (0..n).step_by(EVAL_ROWS) {
            let end = (start + EVAL_ROWS).min(n);
            let logits = self
                .forward(x.slice(s![start..end, ..]))
                .pop()
                .expect("layers");
            for (row, &y) in logits.axis_iter(Axis(0)).zip(&labels[start..end]) {
                let arg = row
                    .iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |m, (j, &v)| if v > m.1 { (j, v) } else { m },
                    )
                    .0;
                correct += u64::from(arg == usize::from(y));
            }
        }
        Ok(correct)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loss of the whole batch in f64, for finite differences.
    fn loss(b: &CpuBackend, x: &[f32], labels: &[u8]) -> f64 {
        let n = labels.len();
        let xv = ArrayView2::from_shape((n, b.layout.dims[0]), x).unwrap();
        let logits = b.forward(xv).pop().unwrap();
        let mut total = 0.0;
        for (row, &y) in logits.rows().into_iter().zip(labels) {
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
        assert!((stats.loss_sum - loss(&b, &x, &labels)).abs() < 1e-4);
        // seed 17 keeps every pre-activation farther than eps from a ReLU kink (seed 3 does not)
        let eps = 1e-3f32;
        let mut worst = 0.0f64;
        for i in 0..layout.num_params() {
            let mut wp = w.clone();
            wp[i] += eps;
            b.set_weights(&wp).unwrap();
            let lp = loss(&b, &x, &labels);
            wp[i] -= 2.0 * eps;
            b.set_weights(&wp).unwrap();
            let lm = loss(&b, &x, &labels);
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
}
