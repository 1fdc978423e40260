//! The compute backend a worker runs the model on: one trait, a CPU implementation (ndarray)
//! that always builds and runs, and a CUDA implementation (cudarc) loaded at run time.
//! The models are those of [`ps_model::layout::ModelLayout`] (the MLP and the CNN), each with
//! a softmax cross-entropy loss over its last layer's outputs ([`crate::model`]).

use crate::gate::PullGate;
use ps_config::LossReduction;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

pub use crate::error::{BackendError, BackendResult};
pub use crate::ops::StepStats;

/// A model on a device, computing its loss gradient: what the worker's loop, the reference
/// run and the benchmarks call, whatever the model and the device ([`crate::model::Model`]).
pub trait Backend: Send {
    /// "cpu (2 threads)", "cuda:0 (NVIDIA H100 80GB HBM3)".
    fn name(&self) -> String;

    /// Loads the full flat parameter vector (PyTorch `state_dict` order), after each pull.
    fn set_weights(&mut self, flat: &[f32]) -> BackendResult<()>;

    /// The backend's own host-side weight vector, when it has one that a pull can decode
    /// into directly (saving [`Backend::set_weights`]'s copy); `None` for device backends.
    fn host_weights(&mut self) -> Option<&mut [f32]> {
        None
    }

    /// The flat range of each layer's parameters, in forward order.
    fn layers(&self) -> Vec<Range<usize>>;

    /// A gate for the pull of `version` from shards holding `shards` ([`PullGate`]): over the
    /// weights themselves when they live in host memory, else over the device's staging
    /// memory ([`crate::ops::Device::staging`], pinned on a GPU). Until
    /// [`Backend::close_gate`], every forward pass waits at it for each layer's parameters, so
    /// that the pull's writers fill the weights while forward runs on the layers already
    /// there (on a device, while the pieces already published are copied to it). `None` when
    /// the backend has neither: the caller pulls into a host vector and uploads it.
    fn open_gate(
        &mut self,
        _version: u64,
        _shards: Vec<Range<usize>>,
        _patience: Duration,
    ) -> Option<Arc<PullGate>> {
        None
    }

    /// Ends the gate of [`Backend::open_gate`]: forward reads the weights as they are.
    fn close_gate(&mut self) {}

    /// The registrar of the device's DMA ([`crate::ops::Device::registrar`]): the boards
    /// registered with it are read and written by the device where they lie, with no host copy.
    fn registrar(&self) -> Option<Arc<dyn ps_net::shm::Registrar>> {
        None
    }

    /// Whether the gates of [`Backend::open_gate`] may take values in place from registered
    /// boards (on by default; off, every pull copies into the staging memory: the redo of a
    /// step whose in-place version was torn).
    fn set_in_place(&mut self, _on: bool) {}

    /// What the copies between host and device memory took since the last call
    /// ([`crate::ops::Device::take_copy_times`]); `None` for a backend in host memory.
    fn take_copy_times(&mut self) -> BackendResult<Option<crate::ops::CopyTimes>> {
        Ok(None)
    }

    /// Forward and backward on `labels.len()` samples whose features are the rows of `x`
    /// (row-major, `[n, inputs]`). Writes the gradient of the batch loss with `reduction`
    /// (`mean`: divided by n, `sum`: not) into `grad` (length = number of parameters).
    /// An empty batch writes zeros.
    fn forward_backward(
        &mut self,
        x: &[f32],
        labels: &[u8],
        reduction: LossReduction,
        grad: &mut [f32],
    ) -> BackendResult<StepStats>;

    /// Like [`Backend::forward_backward`], and calls `ready(start, &grad[start..], stats)` each
    /// time the gradient from flat index `start` to the end is final: backward produces the
    /// last layer first, so a worker can push the shards holding the end of the vector while
    /// the earlier layers are still being computed. The default calls it once, at the end.
    fn forward_backward_overlapped(
        &mut self,
        x: &[f32],
        labels: &[u8],
        reduction: LossReduction,
        grad: &mut [f32],
        ready: &mut dyn FnMut(usize, &[f32], StepStats),
    ) -> BackendResult<StepStats> {
        let stats = self.forward_backward(x, labels, reduction, grad)?;
        ready(0, grad, stats);
        Ok(stats)
    }

    /// Number of correctly classified samples among `labels.len()` rows of `x`.
    fn evaluate(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<u64>;
}

/// The gradient of a step's batch computed in `k` micro-batches (`[train] micro_batches`,
/// gradient accumulation): the batch is split as evenly as possible (`k` equal parts when `k`
/// divides it, as the config requires of full batches), each part's gradient is computed by
/// [`Backend::forward_backward`] into `part` and summed into `grad`, weighted by its share of
/// the batch with a `mean` loss (the mean over the whole batch) and by 1 with a `sum` loss;
/// `ready` is called once, with the whole sum, and the figures are summed over the parts.
/// With `k <= 1` this is [`Backend::forward_backward_overlapped`] (the push of the last layers
/// overlaps the backward of the first); with accumulation the pushes start after the last
/// micro-batch.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_micro(
    backend: &mut dyn Backend,
    x: &[f32],
    labels: &[u8],
    reduction: LossReduction,
    k: usize,
    grad: &mut [f32],
    part: &mut Vec<f32>,
    ready: &mut dyn FnMut(usize, &[f32], StepStats),
) -> BackendResult<StepStats> {
    if k <= 1 {
        return backend.forward_backward_overlapped(x, labels, reduction, grad, ready);
    }
    let n = labels.len();
    let inputs = x.len().checked_div(n).unwrap_or(0);
    part.resize(grad.len(), 0.0);
    grad.fill(0.0);
    let mut total = StepStats::default();
    for r in ps_model::layout::split_even(n, k) {
        if r.is_empty() {
            continue;
        }
        let stats = backend.forward_backward(
            &x[r.start * inputs..r.end * inputs],
            &labels[r.clone()],
            reduction,
            part,
        )?;
        let w = match reduction {
            LossReduction::Mean => r.len() as f32 / n as f32,
            LossReduction::Sum => 1.0,
        };
        grad.iter_mut()
            .zip(part.iter())
            .for_each(|(g, &p)| *g += w * p);
        total.loss_sum += stats.loss_sum;
        total.correct += stats.correct;
    }
    ready(0, grad, total);
    Ok(total)
}

/// Checks the common argument shapes of [`Backend::forward_backward`]: `x` is `labels.len()`
/// rows of `inputs` features, every label is below `classes`, `grad` (if given) holds
/// `num_params` values.
pub fn check_shapes(
    inputs: usize,
    classes: usize,
    num_params: usize,
    x: &[f32],
    labels: &[u8],
    grad: Option<&[f32]>,
) -> BackendResult<()> {
    let n = labels.len();
    if x.len() != n * inputs {
        return Err(BackendError::Shape(format!(
            "features hold {} values: expected {n} samples x {inputs} inputs = {}",
            x.len(),
            n * inputs
        )));
    }
    if let Some(bad) = labels.iter().find(|&&l| usize::from(l) >= classes) {
        return Err(BackendError::Shape(format!(
            "label {bad}: expected < {classes}"
        )));
    }
    if let Some(g) = grad
        && g.len() != num_params
    {
        return Err(BackendError::Shape(format!(
            "gradient buffer holds {}: expected {num_params}",
            g.len()
        )));
    }
    Ok(())
}
