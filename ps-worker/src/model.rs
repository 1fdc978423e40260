//! The MLP of [`MlpLayout`] written once over the [`Device`] operations: linear layers with
//! ReLU between them and a softmax cross-entropy loss over the last layer's outputs. Weights
//! and gradients are ranges of one flat vector in PyTorch `state_dict` order.

use crate::backend::{Backend, BackendError, BackendResult, StepStats, check_shapes};
use crate::ops::{Device, Mat};
use ps_common::config::LossReduction;
use ps_common::layout::MlpLayout;

/// The MLP on device `D`: its flat weights and the per-layer buffers of one batch.
pub struct Mlp<D: Device> {
    layout: MlpLayout,
    dev: D,
    weights: D::Buf,
    /// Gradient, when the device cannot write the caller's host memory.
    grad: Option<D::Buf>,
    x: D::Buf,
    /// Output of layer `l` (`[rows, dims[l + 1]]`): post-ReLU for hidden layers, logits last.
    acts: Vec<D::Buf>,
    /// `dL/dz` of hidden layer `l` (`[rows, dims[l + 1]]`).
    deltas: Vec<D::Buf>,
    /// Rows the batch buffers hold.
    rows: usize,
}

impl<D: Device> std::fmt::Debug for Mlp<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mlp")
            .field("dims", &self.layout.dims)
            .field("device", &self.dev.name())
            .field("rows", &self.rows)
            .finish()
    }
}

impl<D: Device> Mlp<D> {
    /// The MLP of `layout` on `dev`, weights zero.
    pub fn on(layout: MlpLayout, mut dev: D) -> BackendResult<Self> {
        let weights = dev.alloc(layout.num_params())?;
        let mut host = vec![0f32; 0];
        let grad = if D::host_view_mut(&mut host).is_some() {
            None
        } else {
            Some(dev.alloc(layout.num_params())?)
        };
        let x = dev.alloc(0)?;
        Ok(Self {
            layout,
            dev,
            weights,
            grad,
            x,
            acts: Vec::new(),
            deltas: Vec::new(),
            rows: 0,
        })
    }

    /// The layout.
    pub fn layout(&self) -> &MlpLayout {
        &self.layout
    }

    /// The device.
    pub fn device(&mut self) -> &mut D {
        &mut self.dev
    }

    /// The logits (`[n, classes]`, row-major) of the rows of `x`.
    pub fn logits(&mut self, x: &[f32]) -> BackendResult<Vec<f32>> {
        let dims = self.layout.dims.clone();
        let n = x.len() / dims[0];
        check_shapes(&dims, self.layout.num_params(), x, &vec![0; n], None)?;
        let classes = *dims.last().expect("dims");
        let mut out = vec![0f32; n * classes];
        if n == 0 {
            return Ok(out);
        }
        self.ensure_rows(n)?;
        self.upload_x(x)?;
        self.forward(n)?;
        let last = self.acts.len() - 1;
        self.dev
            .download(D::view(&self.acts[last], 0..n * classes), &mut out)?;
        Ok(out)
    }

    /// Makes the batch buffers hold at least `rows` rows.
    fn ensure_rows(&mut self, rows: usize) -> BackendResult<()> {
        if rows <= self.rows {
            return Ok(());
        }
        let dims = &self.layout.dims;
        self.x = self.dev.alloc(rows * dims[0])?;
        self.acts.clear();
        self.deltas.clear();
        for l in 0..self.layout.num_layers() {
            self.acts.push(self.dev.alloc(rows * dims[l + 1])?);
            if l + 1 < self.layout.num_layers() {
                self.deltas.push(self.dev.alloc(rows * dims[l + 1])?);
            }
        }
        self.rows = rows;
        Ok(())
    }

    /// Uploads `n` rows of features.
    fn upload_x(&mut self, x: &[f32]) -> BackendResult<()> {
        let v = D::view_mut(&mut self.x, 0..x.len());
        self.dev.upload(x, v)
    }

    /// Forward pass over the `n` uploaded rows into `acts`.
    fn forward(&mut self, n: usize) -> BackendResult<()> {
        let dims = &self.layout.dims;
        let layers = self.layout.num_layers();
        for l in 0..layers {
            let (wr, br) = self.layout.layer(l);
            let (fan_in, fan_out) = (dims[l], dims[l + 1]);
            let (before, rest) = self.acts.split_at_mut(l);
            let input = if l == 0 {
                D::view(&self.x, 0..n * fan_in)
            } else {
                D::view(&before[l - 1], 0..n * fan_in)
            };
            let w = Mat::new(D::view(&self.weights, wr), fan_out, fan_in).t();
            let z = &mut rest[0];
            self.dev.gemm(
                Mat::new(input, n, fan_in),
                w,
                D::view_mut(z, 0..n * fan_out),
            )?;
            self.dev.bias_act(
                D::view_mut(z, 0..n * fan_out),
                D::view(&self.weights, br),
                n,
                fan_out,
                l + 1 < layers,
            )?;
        }
        Ok(())
    }

    /// Backward pass from the logits of the `n` rows in `acts` (already turned into `dL/dz` by
    /// the loss) into `grad`; calls `ready(start, grad)` when `grad[start..]` is final.
    fn backward(
        &mut self,
        n: usize,
        mut grad: D::ViewMut<'_>,
        ready: &mut dyn FnMut(&D, usize, &D::ViewMut<'_>),
    ) -> BackendResult<()> {
        let dims = &self.layout.dims;
        let layers = self.layout.num_layers();
        for l in (0..layers).rev() {
            let (wr, br) = self.layout.layer(l);
            let (fan_in, fan_out) = (dims[l], dims[l + 1]);
            let start = wr.start;
            let split = l.min(self.deltas.len());
            let (lower, upper) = self.deltas.split_at_mut(split);
            let dz = if l + 1 == layers {
                D::view(&self.acts[l], 0..n * fan_out)
            } else {
                D::view(&upper[0], 0..n * fan_out)
            };
            let input = if l == 0 {
                D::view(&self.x, 0..n * fan_in)
            } else {
                D::view(&self.acts[l - 1], 0..n * fan_in)
            };
            // dW [out, in] = dzᵀ · input
            self.dev.gemm(
                Mat::new(dz, n, fan_out).t(),
                Mat::new(input, n, fan_in),
                D::sub_mut(&mut grad, wr.clone()),
            )?;
            let dz = if l + 1 == layers {
                D::view(&self.acts[l], 0..n * fan_out)
            } else {
                D::view(&upper[0], 0..n * fan_out)
            };
            self.dev
                .bias_grad(dz, n, fan_out, D::sub_mut(&mut grad, br))?;
            ready(&self.dev, start, &grad);
            if l > 0 {
                let dz = if l + 1 == layers {
                    D::view(&self.acts[l], 0..n * fan_out)
                } else {
                    D::view(&upper[0], 0..n * fan_out)
                };
                // d(input) [n, in] = dz · W, then through the ReLU of layer l - 1
                let da = &mut lower[l - 1];
                self.dev.gemm(
                    Mat::new(dz, n, fan_out),
                    Mat::new(D::view(&self.weights, wr), fan_out, fan_in),
                    D::view_mut(da, 0..n * fan_in),
                )?;
                self.dev.relu_backward(
                    D::view_mut(da, 0..n * fan_in),
                    D::view(&self.acts[l - 1], 0..n * fan_in),
                )?;
            }
        }
        Ok(())
    }
}

impl<D: Device> Backend for Mlp<D> {
    fn name(&self) -> String {
        self.dev.name()
    }

    fn set_weights(&mut self, flat: &[f32]) -> BackendResult<()> {
        if flat.len() != self.layout.num_params() {
            return Err(BackendError::Shape(format!(
                "weights hold {}: expected {}",
                flat.len(),
                self.layout.num_params()
            )));
        }
        let v = D::view_mut(&mut self.weights, 0..flat.len());
        self.dev.upload(flat, v)
    }

    fn host_weights(&mut self) -> Option<&mut [f32]> {
        D::host_buf(&mut self.weights)
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
        let num_params = self.layout.num_params();
        check_shapes(&self.layout.dims, num_params, x, labels, Some(grad))?;
        let n = labels.len();
        if n == 0 {
            grad.fill(0.0);
            ready(0, grad, StepStats::default());
            return Ok(StepStats::default());
        }
        self.ensure_rows(n)?;
        self.upload_x(x)?;
        self.forward(n)?;
        let scale = match reduction {
            LossReduction::Mean => 1.0 / n as f32,
            LossReduction::Sum => 1.0,
        };
        let classes = *self.layout.dims.last().expect("dims");
        let last = self.acts.len() - 1;
        let logits = D::view_mut(&mut self.acts[last], 0..n * classes);
        let stats = self.dev.softmax_xent(logits, labels, classes, scale)?;
        match self.grad.take() {
            None => {
                // the device computes in host memory: it writes the caller's gradient directly
                // and each final range is handed on as soon as it is written
                let view = D::host_view_mut(grad).expect("a device without a gradient buffer");
                self.backward(n, view, &mut |_, start, g| {
                    let g = D::host_of(g).expect("host view");
                    ready(start, &g[start..], stats);
                })?;
            }
            Some(mut buf) => {
                let result = self
                    .backward(n, D::view_mut(&mut buf, 0..num_params), &mut |_, _, _| {})
                    .and_then(|()| self.dev.download(D::view(&buf, 0..num_params), grad));
                self.grad = Some(buf);
                result?;
                ready(0, grad, stats);
            }
        }
        Ok(stats)
    }

    fn evaluate(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<u64> {
        let dims = self.layout.dims.clone();
        check_shapes(&dims, self.layout.num_params(), x, labels, None)?;
        let n = labels.len();
        let chunk = self.dev.eval_rows().max(1);
        let (inputs, classes) = (dims[0], *dims.last().expect("dims"));
        let mut correct = 0;
        for start in (0..n).step_by(chunk) {
            let end = (start + chunk).min(n);
            let rows = end - start;
            self.ensure_rows(rows)?;
            self.upload_x(&x[start * inputs..end * inputs])?;
            self.forward(rows)?;
            let last = self.acts.len() - 1;
            correct += self.dev.count_correct(
                D::view(&self.acts[last], 0..rows * classes),
                &labels[start..end],
                classes,
            )?;
        }
        Ok(correct)
    }
}
