//! The models written once over the [`Device`] operations: [`Model`] holds what every model
//! needs (the flat weights, the batch, the device gradient buffer, the step's plumbing) and a
//! [`Net`], the computation of one model kind: [`MlpNet`] (linear layers with ReLU between
//! them) and [`CnnNet`] (convolution -> ReLU -> 2x2 max-pooling stages, then an [`MlpNet`] over
//! the flattened features). Both end in a softmax cross-entropy loss. Weights and gradients are
//! ranges of one flat vector in PyTorch `state_dict` order. [`build`] makes the model of a
//! [`ModelLayout`] on a device, as the [`Backend`] the worker calls.
//!
//! A step uploads the batch's features, queues the forward pass, the loss and the backward
//! pass on the device, and reads the results back once: on a device that computes in host
//! memory (the CPU) the gradient is written straight into the caller's vector, layer by layer
//! as backward produces it; on any other device (CUDA) it is computed in a device buffer, each
//! layer's range copied to the host asynchronously right behind that layer's backward (last
//! layer first), and handed on as soon as its copy has arrived, while the device computes the
//! layers below.

use crate::backend::{Backend, BackendError, BackendResult, StepStats, check_shapes};
use crate::gate::{PullGate, Source};
use crate::ops::Device;
use ps_config::LossReduction;
use ps_model::layout::{CnnLayout, MlpLayout, ModelLayout};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

mod cnn;
mod mlp;

pub use cnn::CnnNet;
pub use mlp::MlpNet;

/// Called by the backward pass once a layer's gradient is queued: the device, the layer's
/// range (weight and bias) and the gradient view.
pub type LayerReady<'r, D> =
    dyn FnMut(&mut D, Range<usize>, &<D as Device>::ViewMut<'_>) -> BackendResult<()> + 'r;

/// Called by the forward pass before it reads a layer's parameters (its flat range).
pub type WaitLayer<'w> = dyn Fn(Range<usize>) -> BackendResult<()> + 'w;

/// The computation of one model kind on device `D`: its per-batch buffers, its forward pass
/// into logits and its backward pass from their gradient. [`Model`] does the rest.
pub trait Net<D: Device>: Send {
    /// The flat range of each layer's parameters (its weight and bias), in flat order; the
    /// backward pass finishes them last first.
    fn layers(&self) -> Vec<Range<usize>>;
    /// Releases the batch buffers, then allocates them for `rows` rows.
    fn alloc_rows(&mut self, dev: &mut D, rows: usize) -> BackendResult<()>;
    /// Forward pass of the `n` rows of `x` (`[n, inputs]`) with weights `w` into the logits;
    /// calls `wait(layer)` before it reads a layer's parameters (a pull may still be writing
    /// them: [`crate::gate`]).
    fn forward(
        &mut self,
        dev: &mut D,
        w: &D::Buf,
        x: D::View<'_>,
        n: usize,
        wait: &WaitLayer<'_>,
    ) -> BackendResult<()>;
    /// The buffer whose first `n * classes` values are the logits after [`Net::forward`] (and
    /// the loss's gradient after the loss).
    fn logits(&self) -> &D::Buf;
    /// [`Net::logits`], writable.
    fn logits_mut(&mut self) -> &mut D::Buf;
    /// Backward pass of the `n` rows of `x` from the logits' gradient into `grad` (the whole
    /// flat vector); calls `ready(device, layer, grad)` once a layer's range is queued.
    fn backward(
        &mut self,
        dev: &mut D,
        w: &D::Buf,
        x: D::View<'_>,
        n: usize,
        grad: &mut D::ViewMut<'_>,
        ready: &mut LayerReady<'_, D>,
    ) -> BackendResult<()>;
}

/// Most values one upload of the weights a pull publishes copies ([`Backend::open_gate`] on a
/// device with its own memory): 4 MiB, so that the copies follow the pull closely.
pub const UPLOAD_PIECE: usize = 1 << 20;

/// A model on device `D`: its flat weights, the batch, and the computation `N`.
pub struct Model<D: Device, N: Net<D>> {
    layout: ModelLayout,
    net: N,
    weights: D::Buf,
    /// The gradient on the device: always used by a device that cannot write host memory, and
    /// by [`Model::compute_uploaded`] on any device. Allocated at its first use.
    grad: Option<D::Buf>,
    /// Whether the device computes in host memory (the backward pass then writes the caller's
    /// gradient directly).
    host: bool,
    x: D::Buf,
    /// The pull the weights are being filled by ([`Backend::open_gate`]): the forward pass
    /// waits at it for each layer.
    gate: Option<Arc<PullGate>>,
    /// With a gate over the device's staging memory ([`Device::staging`]) rather than over
    /// the weights themselves: how far the upload of what the pull published there has got.
    upload_from: Option<usize>,
    /// A gate may take shards' values in place from boards registered with the device
    /// ([`Backend::set_in_place`]).
    in_place: bool,
    /// Labels of the batch whose features are in `x` (see [`Model::upload_batch`]).
    labels: Vec<u8>,
    /// Rows the batch buffers hold; a smaller batch uses their first rows.
    rows: usize,
    /// Last, so the buffers above are released while the device is still there.
    dev: D,
}

/// The MLP on device `D`.
pub type Mlp<D> = Model<D, MlpNet<D>>;
/// The CNN on device `D`.
pub type Cnn<D> = Model<D, CnnNet<D>>;

/// The model of `layout` on `dev`, weights zero, as a [`Backend`].
pub fn build<D: Device + 'static>(layout: &ModelLayout, dev: D) -> BackendResult<Box<dyn Backend>> {
    Ok(match layout {
        ModelLayout::Mlp(m) => Box::new(Mlp::on(m.clone(), dev)?),
        ModelLayout::Cnn(c) => Box::new(Cnn::on(c.clone(), dev)?),
    })
}

impl<D: Device, N: Net<D>> std::fmt::Debug for Model<D, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("model", &self.layout.describe())
            .field("device", &self.dev.name())
            .field("rows", &self.rows)
            .finish()
    }
}

impl<D: Device, N: Net<D>> Drop for Model<D, N> {
    fn drop(&mut self) {
        // Wait for queued work before the buffers go (on CUDA this also makes the device's
        // context current on the dropping thread). An error has nowhere to go here.
        let _ = self.dev.sync();
    }
}

impl<D: Device> Mlp<D> {
    /// The MLP of `layout` on `dev`, weights zero.
    pub fn on(layout: MlpLayout, dev: D) -> BackendResult<Self> {
        let net = MlpNet::new(layout.clone(), 0);
        Model::with(layout.into(), net, dev)
    }

    /// The MLP's layout.
    pub fn mlp_layout(&self) -> &MlpLayout {
        &self.net.layout
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
        let result = self
            .net
            .gemms(&mut self.dev, &self.weights, &self.x, rows, &mut buf);
        self.grad = Some(buf);
        result
    }
}

impl<D: Device> Cnn<D> {
    /// The CNN of `layout` on `dev`, weights zero.
    pub fn on(layout: CnnLayout, dev: D) -> BackendResult<Self> {
        let net = CnnNet::new(layout.clone());
        Model::with(layout.into(), net, dev)
    }
}

impl<D: Device, N: Net<D>> Model<D, N> {
    /// The model of `layout` computed by `net` on `dev`, weights zero.
    pub fn with(layout: ModelLayout, net: N, mut dev: D) -> BackendResult<Self> {
        let weights = dev.alloc(layout.num_params())?;
        let host = D::host_view_mut(&mut []).is_some();
        let x = dev.alloc(0)?;
        Ok(Self {
            layout,
            net,
            weights,
            grad: None,
            host,
            x,
            gate: None,
            upload_from: None,
            in_place: true,
            labels: Vec::new(),
            rows: 0,
            dev,
        })
    }

    /// The layout.
    pub fn layout(&self) -> &ModelLayout {
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

    fn check(&self, x: &[f32], labels: &[u8], grad: Option<&[f32]>) -> BackendResult<()> {
        let l = &self.layout;
        check_shapes(l.inputs(), l.classes(), l.num_params(), x, labels, grad)
    }

    /// The logits (`[n, classes]`, row-major) of the rows of `x`. Replaces the batch of
    /// [`Model::upload_batch`] (by an empty one).
    pub fn logits(&mut self, x: &[f32]) -> BackendResult<Vec<f32>> {
        let (inputs, classes) = (self.layout.inputs(), self.layout.classes());
        let n = x.len() / inputs;
        self.check(x, &vec![0; n], None)?;
        let mut out = vec![0f32; n * classes];
        self.labels.clear();
        if n == 0 {
            return Ok(out);
        }
        self.ensure_rows(n)?;
        self.upload_x(x)?;
        self.forward(n)?;
        self.dev
            .download(D::view(self.net.logits(), 0..n * classes), &mut out)?;
        Ok(out)
    }

    /// Copies a batch (`x` row-major `[n, inputs]`, `n` labels) to the device for
    /// [`Model::compute_uploaded`], growing the batch buffers when needed. [`Model::logits`],
    /// [`Backend::evaluate`] and the [`Backend`] steps replace it.
    pub fn upload_batch(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<()> {
        self.check(x, labels, None)?;
        self.stage(x, labels)
    }

    /// Forward and backward on the batch of [`Model::upload_batch`], leaving the gradient in
    /// the device's gradient buffer (see [`Model::download_gradient`]); returns the loss sum
    /// and correct count, reading which waits for the device. An empty batch zeroes the
    /// gradient.
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

    /// Copies the device's gradient buffer (of the last [`Model::compute_uploaded`]) into
    /// `grad` (length = number of parameters).
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
        self.x = self.dev.alloc(0)?;
        self.net.alloc_rows(&mut self.dev, 0)?;
        self.x = self.dev.alloc(rows * self.layout.inputs())?;
        self.net.alloc_rows(&mut self.dev, rows)?;
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

    /// With a gate over the device's staging memory: queues the upload of the weights the
    /// pull has not finished yet, piece by piece (at most [`UPLOAD_PIECE`] values, never across
    /// a layer's end) as soon as each piece is published, so that the copies run while the
    /// rest arrives and the forward pass queued after them reads version `t` alone.
    fn upload_published(&mut self) -> BackendResult<()> {
        let (Some(gate), Some(mut at)) = (self.gate.as_deref(), self.upload_from) else {
            return Ok(());
        };
        let len = self.layout.num_params();
        let ends: Vec<usize> = self.net.layers().iter().map(|l| l.end).collect();
        while at < len {
            let layer_end = ends.iter().copied().filter(|&e| e > at).min();
            let end = layer_end.unwrap_or(len).min(at + UPLOAD_PIECE).min(len);
            let end = end.min(gate.shard_end(at));
            gate.wait(at..end)?;
            let dst = D::view_mut(&mut self.weights, at..end);
            match gate.source(at..end) {
                Source::Copied(v) => self.dev.upload(v, dst)?,
                // SAFETY: read by the device's DMA from a registered board; the values are
                // used only if `verify_in_place` finds the slot intact after the copies
                Source::InPlace(slot, r) => self.dev.upload(unsafe { slot.values(r) }, dst)?,
            }
            at = end;
            self.upload_from = Some(at);
        }
        Ok(())
    }

    /// After the device's copies out of the gate's in-place board slots completed: refuses
    /// the values when a shard overwrote its slot meanwhile ([`PullGate::verify`]).
    fn verify_in_place(&self) -> BackendResult<()> {
        match &self.gate {
            Some(g) if g.any_in_place() => g.verify().map_err(BackendError::from),
            _ => Ok(()),
        }
    }

    /// Forward pass over the `n` uploaded rows, each layer after its weights are pulled
    /// when a gate is open.
    fn forward(&mut self, n: usize) -> BackendResult<()> {
        self.upload_published()?;
        let x = D::view(&self.x, 0..n * self.layout.inputs());
        let gate = self.gate.as_deref();
        let wait = |r: Range<usize>| match gate {
            Some(g) => g.wait(r).map_err(BackendError::from),
            None => Ok(()),
        };
        self.net.forward(&mut self.dev, &self.weights, x, n, &wait)
    }

    /// Queues the softmax cross-entropy of the `n` staged rows' logits: they become `dL/dz`.
    fn loss(&mut self, n: usize, reduction: LossReduction) -> BackendResult<()> {
        let scale = match reduction {
            LossReduction::Mean => 1.0 / n as f32,
            LossReduction::Sum => 1.0,
        };
        let classes = self.layout.classes();
        let logits = D::view_mut(self.net.logits_mut(), 0..n * classes);
        self.dev.softmax_xent(logits, &self.labels, classes, scale)
    }

    /// Backward pass of the `n` staged rows into `grad`.
    fn backward(
        &mut self,
        n: usize,
        mut grad: D::ViewMut<'_>,
        ready: &mut LayerReady<'_, D>,
    ) -> BackendResult<()> {
        let x = D::view(&self.x, 0..n * self.layout.inputs());
        self.net
            .backward(&mut self.dev, &self.weights, x, n, &mut grad, ready)
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
        // straight into `grad` where it is registered host memory (a gradient board)
        let direct = self.dev.is_registered(grad.as_ptr(), grad.len());
        let result = self.device_step_queued(n, reduction, buf, grad, direct, ready);
        if result.is_err() && direct {
            // no copy may still write `grad` once this returns; the error is what counts
            let _ = self.dev.sync();
        }
        result
    }

    fn device_step_queued(
        &mut self,
        n: usize,
        reduction: LossReduction,
        buf: &mut D::Buf,
        grad: &mut [f32],
        direct: bool,
        ready: &mut dyn FnMut(usize, &[f32], StepStats),
    ) -> BackendResult<StepStats> {
        self.forward(n)?;
        self.loss(n, reduction)?;
        let p = self.layout.num_params();
        let to = grad.as_mut_ptr();
        self.backward(n, D::view_mut(buf, 0..p), &mut |dev, layer, g| {
            let src = D::sub(g, layer.clone());
            if direct {
                // SAFETY: `layer` lies inside `grad` (the gradient's length), registered; it
                // is left alone until its finish_download below (or the sync on an error)
                unsafe { dev.start_download_registered(src, to.add(layer.start), layer.start) }
            } else {
                dev.start_download(src, layer.start)
            }
        })?;
        let mut stats = None;
        for r in self.net.layers().into_iter().rev() {
            self.dev.finish_download(r.start, &mut grad[r.clone()])?;
            let s = match stats {
                Some(s) => s,
                None => {
                    // the first copy back waited for every upload queued before the backward
                    // pass: the weights read in place were that version alone, or are refused
                    // before any gradient is handed on
                    self.verify_in_place()?;
                    *stats.insert(self.dev.stats()?)
                }
            };
            ready(r.start, &grad[r.start..], s);
        }
        Ok(stats.unwrap_or_default())
    }
}

impl<D: Device, N: Net<D>> Backend for Model<D, N> {
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
        self.close_gate();
        let v = D::view_mut(&mut self.weights, 0..flat.len());
        self.dev.upload(flat, v)
    }

    fn host_weights(&mut self) -> Option<&mut [f32]> {
        self.close_gate();
        D::host_buf(&mut self.weights)
    }

    fn layers(&self) -> Vec<Range<usize>> {
        self.net.layers()
    }

    fn open_gate(
        &mut self,
        version: u64,
        shards: Vec<Range<usize>>,
        patience: Duration,
    ) -> Option<Arc<PullGate>> {
        self.close_gate();
        let len = self.layout.num_params();
        let (ptr, staged) = match D::host_ptr(&mut self.weights) {
            Some(p) => (p, false),
            None => match self.dev.staging(len) {
                Ok(Some(p)) => (p, true),
                Ok(None) => return None,
                Err(e) => {
                    tracing::warn!(
                        "{}: no staging memory for the weights ({e}): the pull fills a host vector, uploaded once complete",
                        self.dev.name()
                    );
                    return None;
                }
            },
        };
        // SAFETY: on a host device, the weights stay allocated and unmoved while the gate is
        // open (nothing resizes them; `set_weights` and `host_weights`, which would write
        // them, close it first), and while it is open this model reads them only through
        // `D::view` of a layer's range after `PullGate::wait` returned for it
        // (`Model::forward`; the backward pass reads layers its forward pass waited for).
        // On a device with its own memory the gate is over the staging memory, which only
        // this gate writes until the next `Device::staging` call (made by the next
        // `open_gate`, after this gate is closed), and which is read only by the uploads of
        // `upload_published`, of ranges `PullGate::wait` returned for. The caller drops the
        // writers before it closes the gate.
        let gate = unsafe { PullGate::new(ptr, len, version, shards, self.net.layers(), patience) };
        let gate = match self.dev.registrar() {
            // values a pull hands over in place are uploaded from their board
            // (`upload_published`) and checked after the copies (`verify_in_place`)
            Some(r) if staged && self.in_place => gate.with_in_place(r.key()),
            _ => gate,
        };
        let gate = Arc::new(gate);
        self.gate = Some(gate.clone());
        self.upload_from = staged.then_some(0);
        Some(gate)
    }

    fn close_gate(&mut self) {
        self.gate = None;
        self.upload_from = None;
    }

    fn registrar(&self) -> Option<Arc<dyn ps_net::shm::Registrar>> {
        self.dev.registrar()
    }

    fn set_in_place(&mut self, on: bool) {
        self.in_place = on;
    }

    fn take_copy_times(&mut self) -> BackendResult<Option<crate::ops::CopyTimes>> {
        self.dev.take_copy_times()
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
        self.check(x, labels, Some(grad))?;
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
        self.check(x, labels, None)?;
        let n = labels.len();
        let chunk = self.dev.eval_rows().max(1);
        let (inputs, classes) = (self.layout.inputs(), self.layout.classes());
        let mut correct = 0;
        self.labels.clear();
        for start in (0..n).step_by(chunk) {
            let end = (start + chunk).min(n);
            let rows = end - start;
            self.stage(&x[start * inputs..end * inputs], &labels[start..end])?;
            self.forward(rows)?;
            correct += self.dev.count_correct(
                D::view(self.net.logits(), 0..rows * classes),
                &self.labels,
                classes,
            )?;
        }
        self.verify_in_place()?;
        Ok(correct)
    }
}

#[cfg(test)]
mod tests;
