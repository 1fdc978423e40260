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
mod tests {
    use super::*;
    use crate::cpu::{CpuBackend, CpuDevice};
    use crate::ops::{Mat, Strides};
    use ps_model::layout::{CnnShape, ModelSpec};
    use std::ops::Range;

    /// The CPU device, but claiming it cannot write host memory: an [`Mlp`] on it takes the
    /// path of a GPU (device gradient buffer, downloads layer by layer), so that path is
    /// checked here, bit for bit against the host path, on a machine without a GPU.
    #[derive(Debug)]
    /// (The third field: the memory of [`Device::staging`], counted uploads from it.)
    struct Hostless(
        CpuDevice,
        std::collections::HashMap<usize, Vec<f32>>,
        (Vec<f32>, usize),
    );

    fn hostless() -> Hostless {
        Hostless(CpuDevice::new(1), Default::default(), Default::default())
    }

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
        fn staging(&mut self, len: usize) -> BackendResult<Option<*mut f32>> {
            // garbage, like `alloc`, so that an upload of unpublished values shows up
            self.2.0 = vec![f32::NAN; len];
            Ok(Some(self.2.0.as_mut_ptr()))
        }
        fn upload(&mut self, src: &[f32], dst: &mut [f32]) -> BackendResult<()> {
            let s = self.2.0.as_ptr_range();
            if s.contains(&src.as_ptr()) {
                self.2.1 += 1;
            }
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
        fn gemm_acc(&mut self, a: Mat<&[f32]>, b: Mat<&[f32]>, c: &mut [f32]) -> BackendResult<()> {
            self.0.gemm_acc(a, b, c)
        }
        fn gemm_batched(
            &mut self,
            a: Mat<&[f32]>,
            b: Mat<&[f32]>,
            c: &mut [f32],
            s: Strides,
        ) -> BackendResult<()> {
            self.0.gemm_batched(a, b, c, s)
        }
        fn gemm_batched_sum(
            &mut self,
            a: Mat<&[f32]>,
            b: Mat<&[f32]>,
            c: &mut [f32],
            s: Strides,
        ) -> BackendResult<()> {
            self.0.gemm_batched_sum(a, b, c, s)
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
            self.0.channel_bias_act(z, bias, n, channels, plane, relu)
        }
        fn channel_bias_grad(
            &mut self,
            dz: &[f32],
            n: usize,
            channels: usize,
            plane: usize,
            out: &mut [f32],
        ) -> BackendResult<()> {
            self.0.channel_bias_grad(dz, n, channels, plane, out)
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

    fn batch(layout: &ModelLayout, n: usize, seed: usize) -> (Vec<f32>, Vec<u8>) {
        let x = (0..n * layout.inputs())
            .map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) / 7.0)
            .collect();
        let classes = layout.classes();
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
        layout: &ModelSpec,
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

    /// On a device with its own memory a gated pull writes the device's staging memory, and
    /// the forward pass uploads each piece as soon as it is published (a big layer in several
    /// pieces, none across a layer's end): with the last shard arriving slowly, the gradient
    /// is that of `set_weights`, bit for bit, step after step; a pull that fails midway stops
    /// the step before anything is handed on.
    #[test]
    fn a_gated_pull_on_a_device_uploads_each_piece_as_it_arrives() {
        use crate::gate::GateError;
        use ps_net::sink::PullSink;
        use std::time::Duration;
        // fc1 holds 1,101,000 values: more than one upload piece
        let layout = MlpLayout::new(&[1100, 1000, 3]);
        let p = layout.num_params();
        let w = layout.init_range(5, 0..p);
        let (x, y) = batch(&layout.clone().into(), 2, 1);
        let mut want = vec![0f32; p];
        let mut host = CpuBackend::new(layout.clone(), 1);
        host.set_weights(&w).unwrap();
        host.forward_backward(&x, &y, LossReduction::Mean, &mut want)
            .unwrap();

        let mut dev = Mlp::on(layout.clone(), hostless()).unwrap();
        // the previous version's weights on the device: all different
        let old: Vec<f32> = w.iter().map(|v| v * 3.0 + 1.0).collect();
        dev.set_weights(&old).unwrap();
        let shards = vec![0..p / 3, p / 3..p];
        let pieces: usize = dev
            .layers()
            .iter()
            .map(|l| l.len().div_ceil(UPLOAD_PIECE))
            .sum();
        assert!(pieces > dev.layers().len(), "no layer split into pieces");
        for step in 1..=3u64 {
            let gate = dev
                .open_gate(step, shards.clone(), Duration::from_secs(30))
                .expect("a device with staging memory opens a gate");
            let mut got = vec![0f32; p];
            let mut handed = 0;
            let result = std::thread::scope(|s| {
                for (i, pause) in [(0, 0), (1, 200)] {
                    let (g, w, at) = (&gate, &w, shards[i].start);
                    s.spawn(move || {
                        if step == 3 && i == 1 {
                            // one piece, then the pull breaks
                            let mut wr = g.writer(i);
                            wr.next(50_000).copy_from_slice(&w[at..at + 50_000]);
                            wr.publish(50_000);
                            g.fail(1, "shard 1: connection reset".into());
                        } else {
                            g.deliver(i, w, 50_000, Duration::from_micros(pause));
                        }
                    });
                }
                dev.forward_backward_overlapped(
                    &x,
                    &y,
                    LossReduction::Mean,
                    &mut got,
                    &mut |_, _, _| handed += 1,
                )
            });
            dev.close_gate();
            if step < 3 {
                result.unwrap();
                assert_eq!(bits(&got), bits(&want), "step {step}");
                assert_eq!(dev.device().2.1, pieces * step as usize, "step {step}");
            } else {
                let err = result.unwrap_err();
                assert!(
                    matches!(
                        &err,
                        BackendError::Gate(GateError::PullFailed { shard: 1, .. })
                    ),
                    "{err}"
                );
                assert_eq!(handed, 0, "a gradient was handed on after a failed pull");
            }
        }
    }

    /// The device path (gradient buffer on the device, downloaded layer by layer) gives the
    /// same bits as the host path, over growing and shrinking batches, both reductions, with
    /// the same ranges handed on in the same order; evaluation in chunks agrees too.
    #[test]
    fn device_path_equals_host_path() {
        let layout = MlpLayout::new(&[6, 9, 5, 4]);
        let w = layout.init_range(3, 0..layout.num_params());
        let mut host = CpuBackend::new(layout.clone(), 1);
        let mut dev = Mlp::on(layout.clone(), hostless()).unwrap();
        assert!(dev.host_weights().is_none() && host.host_weights().is_some());
        host.set_weights(&w).unwrap();
        dev.set_weights(&w).unwrap();
        let starts: Vec<usize> = (0..3).rev().map(|l| layout.layer(l).0.start).collect();
        for (i, n) in [5usize, 40, 1, 17, 0, 3].into_iter().enumerate() {
            let (x, y) = batch(&layout.clone().into(), n, i);
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
        let (x, y) = batch(&layout.clone().into(), 30, 9);
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
        let (x, y) = batch(&layout.clone().into(), 12, 1);
        let p = layout.num_params();
        let mut want = vec![0.0; p];
        let mut host = CpuBackend::new(layout.clone(), 1);
        host.set_weights(&w).unwrap();
        let s = host
            .forward_backward(&x, &y, LossReduction::Mean, &mut want)
            .unwrap();
        let mut dev = Mlp::on(layout.clone(), hostless()).unwrap();
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

    /// A CNN small enough for finite differences: 2 x 8 x 8 images, 3 x 3 kernels with padding
    /// 1, channels 3 and 4, a hidden linear layer of 5, 3 classes.
    fn small_cnn() -> CnnLayout {
        CnnLayout::new(CnnShape {
            image: [2, 8, 8],
            channels: vec![3, 4],
            kernel: 3,
            stride: 1,
            padding: 1,
            hidden: vec![5],
            classes: 3,
        })
        .unwrap()
    }

    /// Loss of the whole batch in f64 from the model's logits, for finite differences.
    fn loss_f64(b: &mut dyn Logits, x: &[f32], labels: &[u8], classes: usize) -> f64 {
        let logits = b.logits_of(x);
        let mut total = 0.0;
        for (row, &y) in logits.chunks(classes).zip(labels) {
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
            total += lse - row[usize::from(y)] as f64;
        }
        total
    }

    trait Logits: Backend {
        fn logits_of(&mut self, x: &[f32]) -> Vec<f32>;
    }
    impl<D: Device, N: Net<D>> Logits for Model<D, N> {
        fn logits_of(&mut self, x: &[f32]) -> Vec<f32> {
            self.logits(x).unwrap()
        }
    }

    /// The CNN's gradient (convolutions, per-channel bias, pooling, head) is the derivative of
    /// its loss: central differences of every parameter agree, for a stride-1 padded geometry
    /// and for a stride-2 one.
    #[test]
    fn cnn_gradient_matches_finite_differences() {
        let strided = CnnLayout::new(CnnShape {
            image: [1, 15, 15],
            channels: vec![2],
            kernel: 3,
            stride: 2,
            padding: 1,
            hidden: vec![],
            classes: 3,
        })
        .unwrap();
        for layout in [small_cnn(), strided] {
            let ml: ModelLayout = layout.clone().into();
            let mut b = Cnn::on(layout.clone(), CpuDevice::new(1)).unwrap();
            let p = layout.num_params();
            let w = layout.init_range(17, 0..p);
            b.set_weights(&w).unwrap();
            let (x, labels) = batch(&ml, 4, 2);
            let mut g = vec![0.0; p];
            let stats = b
                .forward_backward(&x, &labels, LossReduction::Sum, &mut g)
                .unwrap();
            let classes = ml.classes();
            assert!((stats.loss_sum - loss_f64(&mut b, &x, &labels, classes)).abs() < 1e-4);
            let eps = 1e-3f32;
            let mut worst = (0.0f64, 0);
            for i in 0..p {
                let mut wp = w.clone();
                wp[i] += eps;
                b.set_weights(&wp).unwrap();
                let lp = loss_f64(&mut b, &x, &labels, classes);
                wp[i] -= 2.0 * eps;
                b.set_weights(&wp).unwrap();
                let lm = loss_f64(&mut b, &x, &labels, classes);
                let fd = (lp - lm) / (2.0 * eps as f64);
                let e = (fd - g[i] as f64).abs();
                if e > worst.0 {
                    worst = (e, i);
                }
            }
            assert!(
                worst.0 < 2e-3,
                "{}: largest |finite difference - gradient| = {} at {}",
                layout.describe(),
                worst.0,
                worst.1
            );
            assert!(g.iter().filter(|v| **v != 0.0).count() > p / 2);
        }
    }

    /// The CNN's device path (gradient buffer on the device, downloaded layer by layer) gives
    /// the same bits as its host path, over growing and shrinking batches and both reductions,
    /// handing on one range per layer, last layer first; evaluation in chunks agrees too.
    #[test]
    fn cnn_device_path_equals_host_path() {
        let layout = small_cnn();
        let ml: ModelLayout = layout.clone().into();
        let p = layout.num_params();
        let w = layout.init_range(3, 0..p);
        let mut host = crate::cpu::cpu_model(&ml, 1);
        let mut dev = Cnn::on(layout.clone(), hostless()).unwrap();
        host.set_weights(&w).unwrap();
        dev.set_weights(&w).unwrap();
        let starts: Vec<usize> = ["fc2.weight", "fc1.weight", "conv2.weight", "conv1.weight"]
            .iter()
            .map(|n| layout.tensor(n).unwrap().offset)
            .collect();
        for (i, n) in [5usize, 9, 1, 0, 3].into_iter().enumerate() {
            let (x, y) = batch(&ml, n, i);
            for reduction in [LossReduction::Mean, LossReduction::Sum] {
                let (sh, gh, seen_h) = step(host.as_mut(), &layout, &x, &y, reduction);
                let (sd, gd, seen_d) = step(&mut dev, &layout, &x, &y, reduction);
                assert_eq!(sh, sd, "batch {n} {reduction}");
                assert_eq!(bits(&gh), bits(&gd), "batch {n} {reduction}");
                let s: Vec<usize> = seen_d.iter().map(|(s, _)| *s).collect();
                let sh: Vec<usize> = seen_h.iter().map(|(s, _)| *s).collect();
                if n > 0 {
                    assert_eq!(s, starts);
                    assert_eq!(sh, starts);
                }
            }
        }
        let (x, y) = batch(&ml, 30, 9);
        let want = host.evaluate(&x, &y).unwrap();
        assert_eq!(dev.evaluate(&x, &y).unwrap(), want);
        // a wrong shape is a typed error, not a panic
        assert!(matches!(
            dev.forward_backward(&x[1..], &y, LossReduction::Mean, &mut vec![0.0; p]),
            Err(BackendError::Shape(_))
        ));
    }

    /// The per-channel bias and its gradient, and the accumulating product, on the CPU.
    #[test]
    fn channel_bias_and_accumulating_product() {
        let mut d = CpuDevice::new(1);
        // [n 2, channels 3, plane 2]
        let mut z: Vec<f32> = (0..12).map(|i| i as f32 - 6.0).collect();
        d.channel_bias_act(&mut z, &[1.0, 10.0, 100.0], 2, 3, 2, false)
            .unwrap();
        assert_eq!(
            z,
            [-5., -4., 6., 7., 98., 99., 1., 2., 12., 13., 104., 105.]
        );
        let mut r = z.clone();
        d.channel_bias_act(&mut r, &[0.0; 3], 2, 3, 2, true)
            .unwrap();
        assert_eq!(r[..2], [0.0, 0.0]);
        let mut gb = [0.0; 3];
        d.channel_bias_grad(&z, 2, 3, 2, &mut gb).unwrap();
        assert_eq!(gb, [-6.0, 38.0, 406.0]);
        assert!(d.channel_bias_grad(&z, 2, 3, 3, &mut gb).is_err());
        assert!(
            d.channel_bias_act(&mut z, &[0.0; 2], 2, 3, 2, true)
                .is_err()
        );
        let mut c = vec![1.0f32; 4];
        let a = [1.0f32, 2.0, 3.0, 4.0];
        d.gemm_acc(Mat::new(&a[..], 2, 2), Mat::new(&a[..], 2, 2), &mut c)
            .unwrap();
        assert_eq!(c, [8.0, 11.0, 16.0, 23.0]);
    }
}
