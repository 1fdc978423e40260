//! The MLP of [`MlpLayout`] written once over the [`Device`] operations: linear layers with
//! ReLU between them and a softmax cross-entropy loss over the last layer's outputs. Weights
//! and gradients are ranges of one flat vector in PyTorch `state_dict` order.
//!
//! A step uploads the batch's features, queues the forward pass, the loss and the backward
//! pass on the device, and reads the results back once: on a device that computes in host
//! memory (the CPU) the gradient is written straight into the caller's vector, layer by layer
//! as backward produces it; on any other device (CUDA) it is computed in a device buffer, each
//! layer's range copied to the host asynchronously right behind that layer's backward (last
//! layer first), and handed on as soon as its copy has arrived, while the device computes the
//! layers below.

use crate::backend::{Backend, BackendError, BackendResult, StepStats, check_shapes};
use crate::ops::{Device, Mat};
use ps_common::config::LossReduction;
use ps_common::layout::MlpLayout;
use std::ops::Range;

/// Called by the backward pass once a layer's gradient is queued: the device, the layer's
/// range (weight and bias) and the gradient view.
type LayerReady<'r, D> =
    dyn FnMut(&mut D, Range<usize>, &<D as Device>::ViewMut<'_>) -> BackendResult<()> + 'r;

/// The MLP on device `D`: its flat weights and the per-layer buffers of one batch.
pub struct Mlp<D: Device> {
    layout: MlpLayout,
    weights: D::Buf,
    /// The gradient on the device: always used by a device that cannot write host memory, and
    /// by [`Mlp::compute_uploaded`] on any device. Allocated at its first use.
    grad: Option<D::Buf>,
    /// Whether the device computes in host memory (the backward pass then writes the caller's
    /// gradient directly).
    host: bool,
    x: D::Buf,
    /// Labels of the batch whose features are in `x` (see [`Mlp::upload_batch`]).
    labels: Vec<u8>,
    /// Output of layer `l` (`[rows, dims[l + 1]]`): post-ReLU for hidden layers, logits last.
    acts: Vec<D::Buf>,
    /// `dL/dz` of hidden layer `l` (`[rows, dims[l + 1]]`).
    deltas: Vec<D::Buf>,
    /// Rows the batch buffers hold; a smaller batch uses their first rows.
    rows: usize,
    /// Last, so the buffers above are released while the device is still there.
    dev: D,
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

impl<D: Device> Drop for Mlp<D> {
    fn drop(&mut self) {
        // Wait for queued work before the buffers go (on CUDA this also makes the device's
        // context current on the dropping thread). An error has nowhere to go here.
        let _ = self.dev.sync();
    }
}

impl<D: Device> Mlp<D> {
    /// The MLP of `layout` on `dev`, weights zero.
    pub fn on(layout: MlpLayout, mut dev: D) -> BackendResult<Self> {
        let weights = dev.alloc(layout.num_params())?;
        let host = D::host_view_mut(&mut []).is_some();
        let x = dev.alloc(0)?;
        Ok(Self {
            layout,
            weights,
            grad: None,
            host,
            x,
            labels: Vec::new(),
            acts: Vec::new(),
            deltas: Vec::new(),
            rows: 0,
            dev,
        })
    }

    /// The layout.
    pub fn layout(&self) -> &MlpLayout {
        &self.layout
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The device, to queue operations on.
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    /// Rows the batch buffers hold (0 before the first batch).
    pub fn capacity_rows(&self) -> usize {
        self.rows
    }

    /// Waits until the device has finished every queued operation.
    pub fn sync(&mut self) -> BackendResult<()> {
        self.dev.sync()
    }

    /// The logits (`[n, classes]`, row-major) of the rows of `x`. Replaces the batch of
    /// [`Mlp::upload_batch`] (by an empty one).
    pub fn logits(&mut self, x: &[f32]) -> BackendResult<Vec<f32>> {
        let dims = self.layout.dims.clone();
        let n = x.len() / dims[0];
        check_shapes(&dims, self.layout.num_params(), x, &vec![0; n], None)?;
        let classes = *dims.last().expect("dims");
        let mut out = vec![0f32; n * classes];
        self.labels.clear();
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

    /// Copies a batch (`x` row-major `[n, inputs]`, `n` labels) to the device for
    /// [`Mlp::compute_uploaded`], growing the batch buffers when needed. [`Mlp::logits`],
    /// [`Backend::evaluate`] and the [`Backend`] steps replace it.
    pub fn upload_batch(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<()> {
        check_shapes(&self.layout.dims, self.layout.num_params(), x, labels, None)?;
        self.stage(x, labels)
    }

    /// Forward and backward on the batch of [`Mlp::upload_batch`], leaving the gradient in the
    /// device's gradient buffer (see [`Mlp::download_gradient`]); returns the loss sum and
    /// correct count, reading which waits for the device. An empty batch zeroes the gradient.
    pub fn compute_uploaded(&mut self, reduction: LossReduction) -> BackendResult<StepStats> {
        let n = self.labels.len();
        let mut buf = self.take_grad()?;
        let result = if n == 0 {
            let p = self.layout.num_params();
            self.dev
                .fill_zero(D::view_mut(&mut buf, 0..p))
                .map(|()| StepStats::default())
        } else {
            self.queue_step(n, reduction, &mut buf)
                .and_then(|()| self.dev.stats())
        };
        self.grad = Some(buf);
        result
    }

    /// Copies the device's gradient buffer (of the last [`Mlp::compute_uploaded`]) into `grad`
    /// (length = number of parameters).
    pub fn download_gradient(&mut self, grad: &mut [f32]) -> BackendResult<()> {
        let p = self.layout.num_params();
        if grad.len() != p {
            return Err(BackendError::Shape(format!(
                "gradient buffer holds {}: expected {p}",
                grad.len()
            )));
        }
        let Some(buf) = &self.grad else {
            return Err(BackendError::Shape(
                "no gradient on the device yet: compute_uploaded first".into(),
            ));
        };
        self.dev.download(D::view(buf, 0..p), grad)
    }

    /// Benchmark helper: queues only the matrix products of a step over `rows` rows (per layer
    /// the forward product, the weight gradient and, except for the first layer, the input
    /// gradient), on whatever the buffers hold. Does not wait; overwrites the activations, the
    /// backward buffers and the device's gradient buffer.
    pub fn gemm_only(&mut self, rows: usize) -> BackendResult<()> {
        if rows == 0 {
            return Ok(());
        }
        self.ensure_rows(rows)?;
        let mut buf = self.take_grad()?;
        let result = self.gemms(rows, &mut buf);
        self.grad = Some(buf);
        result
    }

    fn gemms(&mut self, n: usize, grad: &mut D::Buf) -> BackendResult<()> {
        let dims = &self.layout.dims;
        for l in 0..self.layout.num_layers() {
            let (wr, _) = self.layout.layer(l);
            let (fan_in, fan_out) = (dims[l], dims[l + 1]);
            let (before, rest) = self.acts.split_at_mut(l);
            let input = if l == 0 { &self.x } else { &before[l - 1] };
            let z = &mut rest[0];
            self.dev.gemm(
                Mat::new(D::view(input, 0..n * fan_in), n, fan_in),
                Mat::new(D::view(&self.weights, wr.clone()), fan_out, fan_in).t(),
                D::view_mut(z, 0..n * fan_out),
            )?;
            self.dev.gemm(
                Mat::new(D::view(z, 0..n * fan_out), n, fan_out).t(),
                Mat::new(D::view(input, 0..n * fan_in), n, fan_in),
                D::view_mut(grad, wr.clone()),
            )?;
            if l > 0 {
                self.dev.gemm(
                    Mat::new(D::view(z, 0..n * fan_out), n, fan_out),
                    Mat::new(D::view(&self.weights, wr), fan_out, fan_in),
                    D::view_mut(&mut self.deltas[l - 1], 0..n * fan_in),
                )?;
            }
        }
        Ok(())
    }

    /// The device gradient buffer, allocated at its first use (the caller puts it back).
    fn take_grad(&mut self) -> BackendResult<D::Buf> {
        match self.grad.take() {
            Some(b) => Ok(b),
            None => self.dev.alloc(self.layout.num_params()),
        }
    }

    /// Makes the batch buffers hold at least `rows` rows (reallocates only to grow; the old
    /// buffers are released first).
    fn ensure_rows(&mut self, rows: usize) -> BackendResult<()> {
        if rows <= self.rows {
            return Ok(());
        }
        self.rows = 0;
        self.acts.clear();
        self.deltas.clear();
        self.x = self.dev.alloc(0)?;
        let dims = &self.layout.dims;
        self.x = self.dev.alloc(rows * dims[0])?;
        for l in 0..self.layout.num_layers() {
            self.acts.push(self.dev.alloc(rows * dims[l + 1])?);
            if l + 1 < self.layout.num_layers() {
                self.deltas.push(self.dev.alloc(rows * dims[l + 1])?);
            }
        }
        self.rows = rows;
        Ok(())
    }

    /// Uploads the features of a batch whose shapes were checked and keeps its labels.
    fn stage(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<()> {
        self.labels.clear();
        if labels.is_empty() {
            return Ok(());
        }
        self.ensure_rows(labels.len())?;
        self.upload_x(x)?;
        self.labels.extend_from_slice(labels);
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

    /// Queues the softmax cross-entropy of the `n` staged rows' logits: they become `dL/dz`.
    fn loss(&mut self, n: usize, reduction: LossReduction) -> BackendResult<()> {
        let scale = match reduction {
            LossReduction::Mean => 1.0 / n as f32,
            LossReduction::Sum => 1.0,
        };
        let classes = *self.layout.dims.last().expect("dims");
        let last = self.acts.len() - 1;
        let logits = D::view_mut(&mut self.acts[last], 0..n * classes);
        self.dev.softmax_xent(logits, &self.labels, classes, scale)
    }

    /// Queues forward, loss and backward of the `n` staged rows into the device buffer `grad`.
    fn queue_step(
        &mut self,
        n: usize,
        reduction: LossReduction,
        grad: &mut D::Buf,
    ) -> BackendResult<()> {
        self.forward(n)?;
        self.loss(n, reduction)?;
        let p = self.layout.num_params();
        self.backward(n, D::view_mut(grad, 0..p), &mut |_, _, _| Ok(()))
    }

    /// Backward pass from the logits of the `n` rows in `acts` (already turned into `dL/dz` by
    /// the loss) into `grad`; calls `ready(device, layer, grad)` once the layer's gradient
    /// (`layer`, its weight and bias range) is queued, so `grad[layer.start..]` is final once
    /// the device has run what is queued.
    fn backward(
        &mut self,
        n: usize,
        mut grad: D::ViewMut<'_>,
        ready: &mut LayerReady<'_, D>,
    ) -> BackendResult<()> {
        let dims = &self.layout.dims;
        let layers = self.layout.num_layers();
        for l in (0..layers).rev() {
            let (wr, br) = self.layout.layer(l);
            let (fan_in, fan_out) = (dims[l], dims[l + 1]);
            let (start, br_end) = (wr.start, br.end);
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
            ready(&mut self.dev, start..br_end, &grad)?;
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

    /// A step on a device with its own memory: queues forward, loss and backward into the
    /// device buffer `buf`, with an asynchronous copy of each layer's gradient to the host
    /// queued right behind that layer's backward (last layer first); then waits for the copies
    /// one layer at a time, calling `ready` after each. So the host hands on (pushes) the last
    /// layers' ranges while the device still computes the first layers' gradients, as the CPU
    /// path does.
    fn device_step(
        &mut self,
        n: usize,
        reduction: LossReduction,
        buf: &mut D::Buf,
        grad: &mut [f32],
        ready: &mut dyn FnMut(usize, &[f32], StepStats),
    ) -> BackendResult<StepStats> {
        self.forward(n)?;
        self.loss(n, reduction)?;
        let p = self.layout.num_params();
        self.backward(n, D::view_mut(buf, 0..p), &mut |dev, layer, g| {
            dev.start_download(D::sub(g, layer.clone()), layer.start)
        })?;
        let mut stats = None;
        for l in (0..self.layout.num_layers()).rev() {
            let (wr, br) = self.layout.layer(l);
            let r = wr.start..br.end;
            self.dev.finish_download(r.start, &mut grad[r])?;
            let s = match stats {
                Some(s) => s,
                None => *stats.insert(self.dev.stats()?),
            };
            ready(wr.start, &grad[wr.start..], s);
        }
        Ok(stats.unwrap_or_default())
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
        self.stage(x, labels)?;
        if n == 0 {
            grad.fill(0.0);
            ready(0, grad, StepStats::default());
            return Ok(StepStats::default());
        }
        if self.host {
            // the device computes in host memory: it writes the caller's gradient directly
            // and each final range is handed on as soon as it is written
            self.forward(n)?;
            self.loss(n, reduction)?;
            let stats = self.dev.stats()?;
            let view = D::host_view_mut(grad).expect("a host device");
            self.backward(n, view, &mut |_, layer, g| {
                let g = D::host_of(g).expect("host view");
                ready(layer.start, &g[layer.start..], stats);
                Ok(())
            })?;
            return Ok(stats);
        }
        let mut buf = self.take_grad()?;
        let result = self.device_step(n, reduction, &mut buf, grad, ready);
        self.grad = Some(buf);
        result
    }

    fn evaluate(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<u64> {
        let dims = self.layout.dims.clone();
        check_shapes(&dims, self.layout.num_params(), x, labels, None)?;
        let n = labels.len();
        let chunk = self.dev.eval_rows().max(1);
        let (inputs, classes) = (dims[0], *dims.last().expect("dims"));
        let mut correct = 0;
        self.labels.clear();
        for start in (0..n).step_by(chunk) {
            let end = (start + chunk).min(n);
            let rows = end - start;
            self.stage(&x[start * inputs..end * inputs], &labels[start..end])?;
            self.forward(rows)?;
            let last = self.acts.len() - 1;
            correct += self.dev.count_correct(
                D::view(&self.acts[last], 0..rows * classes),
                &self.labels,
                classes,
            )?;
        }
        Ok(correct)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{CpuBackend, CpuDevice};
    use std::ops::Range;

    /// The CPU device, but claiming it cannot write host memory: an [`Mlp`] on it takes the
    /// path of a GPU (device gradient buffer, downloads layer by layer), so that path is
    /// checked here, bit for bit against the host path, on a machine without a GPU.
    #[derive(Debug)]
    struct Hostless(CpuDevice, std::collections::HashMap<usize, Vec<f32>>);

    impl Device for Hostless {
        type Buf = Vec<f32>;
        type View<'a> = &'a [f32];
        type ViewMut<'a> = &'a mut [f32];

        fn name(&self) -> String {
            format!("hostless {}", self.0.name())
        }
        fn alloc(&mut self, len: usize) -> BackendResult<Vec<f32>> {
            // garbage rather than zeros, so that a value read before it is written shows up
            Ok(vec![f32::NAN; len])
        }
        fn view(buf: &Vec<f32>, r: Range<usize>) -> &[f32] {
            &buf[r]
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
        fn start_download(&mut self, src: &[f32], slot: usize) -> BackendResult<()> {
            self.1.insert(slot, src.to_vec());
            Ok(())
        }
        fn finish_download(&mut self, slot: usize, dst: &mut [f32]) -> BackendResult<()> {
            let src = self
                .1
                .get(&slot)
                .expect("a download was started in this slot");
            dst.copy_from_slice(src);
            Ok(())
        }
        fn im2col(
            &mut self,
            x: &[f32],
            cols: &mut [f32],
            n: usize,
            g: crate::ops::ConvGeom,
        ) -> BackendResult<()> {
            self.0.im2col(x, cols, n, g)
        }
        fn col2im(
            &mut self,
            cols: &[f32],
            dx: &mut [f32],
            n: usize,
            g: crate::ops::ConvGeom,
        ) -> BackendResult<()> {
            self.0.col2im(cols, dx, n, g)
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
            self.0.maxpool2(x, y, arg, planes, h, w)
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
            self.0.maxpool2_backward(dy, arg, dx, planes, h, w)
        }
        fn host_view_mut(_: &mut [f32]) -> Option<&mut [f32]> {
            None
        }
        fn host_of<'a>(_: &'a &mut [f32]) -> Option<&'a [f32]> {
            None
        }
        fn host_buf(_: &mut Vec<f32>) -> Option<&mut [f32]> {
            None
        }
        fn upload(&mut self, src: &[f32], dst: &mut [f32]) -> BackendResult<()> {
            self.0.upload(src, dst)
        }
        fn download(&mut self, src: &[f32], dst: &mut [f32]) -> BackendResult<()> {
            self.0.download(src, dst)
        }
        fn fill_zero(&mut self, v: &mut [f32]) -> BackendResult<()> {
            self.0.fill_zero(v)
        }
        fn sync(&mut self) -> BackendResult<()> {
            self.0.sync()
        }
        fn gemm(&mut self, a: Mat<&[f32]>, b: Mat<&[f32]>, c: &mut [f32]) -> BackendResult<()> {
            self.0.gemm(a, b, c)
        }
        fn bias_act(
            &mut self,
            z: &mut [f32],
            bias: &[f32],
            rows: usize,
            cols: usize,
            relu: bool,
        ) -> BackendResult<()> {
            self.0.bias_act(z, bias, rows, cols, relu)
        }
        fn relu_backward(&mut self, d: &mut [f32], act: &[f32]) -> BackendResult<()> {
            self.0.relu_backward(d, act)
        }
        fn softmax_xent(
            &mut self,
            logits: &mut [f32],
            labels: &[u8],
            cols: usize,
            scale: f32,
        ) -> BackendResult<()> {
            self.0.softmax_xent(logits, labels, cols, scale)
        }
        fn stats(&mut self) -> BackendResult<StepStats> {
            self.0.stats()
        }
        fn bias_grad(
            &mut self,
            dz: &[f32],
            rows: usize,
            cols: usize,
            out: &mut [f32],
        ) -> BackendResult<()> {
            self.0.bias_grad(dz, rows, cols, out)
        }
        fn count_correct(
            &mut self,
            logits: &[f32],
            labels: &[u8],
            cols: usize,
        ) -> BackendResult<u64> {
            self.0.count_correct(logits, labels, cols)
        }
        fn eval_rows(&self) -> usize {
            7 // several chunks even for small test sets
        }
    }

    fn batch(layout: &MlpLayout, n: usize, seed: usize) -> (Vec<f32>, Vec<u8>) {
        let x = (0..n * layout.dims[0])
            .map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) / 7.0)
            .collect();
        let classes = *layout.dims.last().unwrap();
        let y = (0..n).map(|i| ((i * 5 + seed) % classes) as u8).collect();
        (x, y)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// A range handed on by the overlapped step: its start and its values then.
    type Handed = (usize, Vec<f32>);

    /// Runs a step with the overlapped API and checks each handed-on range is final.
    fn step(
        b: &mut dyn Backend,
        layout: &MlpLayout,
        x: &[f32],
        y: &[u8],
        reduction: LossReduction,
    ) -> (StepStats, Vec<f32>, Vec<Handed>) {
        let mut g = vec![f32::NAN; layout.num_params()];
        let mut seen = Vec::new();
        let s = b
            .forward_backward_overlapped(x, y, reduction, &mut g, &mut |start, tail, st| {
                seen.push((start, tail.to_vec()));
                assert!(st.loss_sum > 0.0 || y.is_empty());
            })
            .unwrap();
        for (start, tail) in &seen {
            assert_eq!(
                bits(tail),
                bits(&g[*start..]),
                "range from {start} not final"
            );
        }
        (s, g, seen)
    }

    /// The device path (gradient buffer on the device, downloaded layer by layer) gives the
    /// same bits as the host path, over growing and shrinking batches, both reductions, with
    /// the same ranges handed on in the same order; evaluation in chunks agrees too.
    #[test]
    fn device_path_equals_host_path() {
        let layout = MlpLayout::new(&[6, 9, 5, 4]);
        let w = layout.init_range(3, 0..layout.num_params());
        let mut host = CpuBackend::new(layout.clone(), 1);
        let mut dev = Mlp::on(
            layout.clone(),
            Hostless(CpuDevice::new(1), Default::default()),
        )
        .unwrap();
        assert!(dev.host_weights().is_none() && host.host_weights().is_some());
        host.set_weights(&w).unwrap();
        dev.set_weights(&w).unwrap();
        let starts: Vec<usize> = (0..3).rev().map(|l| layout.layer(l).0.start).collect();
        for (i, n) in [5usize, 40, 1, 17, 0, 3].into_iter().enumerate() {
            let (x, y) = batch(&layout, n, i);
            for reduction in [LossReduction::Mean, LossReduction::Sum] {
                let (sh, gh, seen_h) = step(&mut host, &layout, &x, &y, reduction);
                let (sd, gd, seen_d) = step(&mut dev, &layout, &x, &y, reduction);
                assert_eq!(sh, sd, "batch {n} {reduction}");
                assert_eq!(bits(&gh), bits(&gd), "batch {n} {reduction}");
                let s: Vec<usize> = seen_d.iter().map(|(s, _)| *s).collect();
                if n == 0 {
                    assert_eq!(s, [0]);
                    assert!(gd.iter().all(|&v| v == 0.0));
                } else {
                    assert_eq!(s, starts, "device path hands on one range per layer");
                    assert_eq!(seen_h.len(), 3);
                }
            }
            assert_eq!(dev.capacity_rows(), if i == 0 { 5 } else { 40 });
        }
        let (x, y) = batch(&layout, 30, 9);
        let want = host.evaluate(&x, &y).unwrap();
        assert_eq!(dev.evaluate(&x, &y).unwrap(), want);
        assert!(want > 0);
        assert_eq!(dev.logits(&x).unwrap(), host.logits(&x).unwrap());
    }

    /// `upload_batch` + `compute_uploaded` + `download_gradient` is `forward_backward`, on both
    /// paths; `gemm_only` runs; misuse is a typed error.
    #[test]
    fn split_step_equals_forward_backward() {
        let layout = MlpLayout::new(&[6, 9, 4]);
        let w = layout.init_range(5, 0..layout.num_params());
        let (x, y) = batch(&layout, 12, 1);
        let p = layout.num_params();
        let mut want = vec![0.0; p];
        let mut host = CpuBackend::new(layout.clone(), 1);
        host.set_weights(&w).unwrap();
        let s = host
            .forward_backward(&x, &y, LossReduction::Mean, &mut want)
            .unwrap();
        let mut dev = Mlp::on(
            layout.clone(),
            Hostless(CpuDevice::new(1), Default::default()),
        )
        .unwrap();
        dev.set_weights(&w).unwrap();
        let mut g = vec![0.0; p];
        let e = dev.download_gradient(&mut g).unwrap_err();
        assert!(e.to_string().contains("compute_uploaded first"), "{e}");
        for b in [&mut host as &mut dyn SplitStep, &mut dev] {
            b.upload(&x, &y).unwrap();
            assert_eq!(b.compute(LossReduction::Mean).unwrap(), s);
            let mut g = vec![f32::NAN; p];
            b.download(&mut g).unwrap();
            assert_eq!(bits(&g), bits(&want));
            b.gemms(12).unwrap();
            b.gemms(3).unwrap();
            // the staged batch is still there after the products
            assert_eq!(b.compute(LossReduction::Mean).unwrap(), s);
            b.download(&mut g).unwrap();
            assert_eq!(bits(&g), bits(&want));
            // an empty batch zeroes the gradient
            b.upload(&[], &[]).unwrap();
            assert_eq!(b.compute(LossReduction::Sum).unwrap(), StepStats::default());
            b.download(&mut g).unwrap();
            assert!(g.iter().all(|&v| v == 0.0));
            assert!(matches!(
                b.download(&mut [0.0; 3]).unwrap_err(),
                BackendError::Shape(_)
            ));
            assert!(matches!(
                b.upload(&x[1..], &y).unwrap_err(),
                BackendError::Shape(_)
            ));
        }
    }

    /// The split API of both devices, as one object type.
    trait SplitStep {
        fn upload(&mut self, x: &[f32], y: &[u8]) -> BackendResult<()>;
        fn compute(&mut self, r: LossReduction) -> BackendResult<StepStats>;
        fn download(&mut self, g: &mut [f32]) -> BackendResult<()>;
        fn gemms(&mut self, rows: usize) -> BackendResult<()>;
    }

    impl<D: Device> SplitStep for Mlp<D> {
        fn upload(&mut self, x: &[f32], y: &[u8]) -> BackendResult<()> {
            self.upload_batch(x, y)
        }
        fn compute(&mut self, r: LossReduction) -> BackendResult<StepStats> {
            self.compute_uploaded(r)
        }
        fn download(&mut self, g: &mut [f32]) -> BackendResult<()> {
            self.download_gradient(g)
        }
        fn gemms(&mut self, rows: usize) -> BackendResult<()> {
            self.gemm_only(rows)?;
            self.sync()
        }
    }

    /// A device operation given views of the wrong length refuses them.
    #[test]
    fn device_operations_check_lengths() {
        let mut d = CpuDevice::new(1);
        let mut z = vec![0.0; 6];
        assert!(d.bias_act(&mut z, &[0.0; 3], 2, 3, true).is_ok());
        assert!(d.bias_act(&mut z, &[0.0; 2], 2, 3, true).is_err());
        assert!(d.bias_act(&mut z, &[0.0; 3], 3, 3, true).is_err());
        assert!(d.relu_backward(&mut z, &[0.0; 5]).is_err());
        let e = d.softmax_xent(&mut z, &[0, 3], 3, 1.0).unwrap_err();
        assert_eq!(e.to_string(), "shape: label 3: expected < 3");
        assert!(d.softmax_xent(&mut z, &[0], 3, 1.0).is_err());
        assert!(d.bias_grad(&z, 2, 3, &mut [0.0; 2]).is_err());
        assert!(d.count_correct(&z, &[0, 1, 2], 3).is_err());
        assert!(d.upload(&[1.0; 2], &mut z).is_err());
        assert!(d.download(&z, &mut [0.0; 2]).is_err());
        // the statistics are those of the last softmax cross-entropy, not of a count
        let mut logits = vec![0.0, 1.0, 0.0, 2.0, 0.0, 0.0];
        d.softmax_xent(&mut logits, &[1, 1], 3, 1.0).unwrap();
        let s = d.stats().unwrap();
        assert_eq!(s.correct, 1);
        assert_eq!(d.count_correct(&[5.0, 0.0, 0.0], &[0], 3).unwrap(), 1);
        assert_eq!(d.stats().unwrap(), s);
    }
}
