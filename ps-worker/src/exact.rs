//! The worker's part of `[train] exact_sum`: its batch is whole micro-batches of `m` samples
//! (the data order gives it `split_even(B / m, W)[rank]` of them); the gradient of each is
//! computed on its own (the same samples meet the same shapes at any `W`) and added to a
//! fixed-point sum without rounding ([`ps_net::exact`]); the push carries that partial sum,
//! encoded, which the shards add to the others' and round once.

use crate::backend::{Backend, BackendResult, StepStats};
use ps_config::LossReduction;
use ps_net::exact::{LIMBS, add_term, encode};

/// The gradient terms of `x`/`labels` (whole micro-batches of `m`), summed exactly into `acc`
/// (the model's length; reset here), then encoded into `wire` ([`LIMBS`] values per
/// parameter); `part` is the scratch of one term. `ready` is called once, with the whole
/// encoded sum at offset 0, and the figures summed over the micro-batches.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_exact(
    backend: &mut dyn Backend,
    x: &[f32],
    labels: &[u8],
    reduction: LossReduction,
    m: usize,
    acc: &mut Vec<i128>,
    part: &mut Vec<f32>,
    wire: &mut [f32],
    ready: &mut dyn FnMut(usize, &[f32], StepStats),
) -> BackendResult<StepStats> {
    let params = wire.len() / LIMBS;
    let total = partial_sum(backend, x, labels, reduction, (m, params), acc, part)?;
    encode(acc, wire)?;
    ready(0, wire, total);
    Ok(total)
}

/// The exact sum of the gradient terms of `x`/`labels` in micro-batches of `m`, into `acc`
/// (resized to the model's `params` and reset), with the figures summed over them.
pub fn partial_sum(
    backend: &mut dyn Backend,
    x: &[f32],
    labels: &[u8],
    reduction: LossReduction,
    (m, params): (usize, usize),
    acc: &mut Vec<i128>,
    part: &mut Vec<f32>,
) -> BackendResult<StepStats> {
    let n = labels.len();
    let inputs = x.len().checked_div(n).unwrap_or(0);
    acc.clear();
    acc.resize(params, 0);
    part.resize(params, 0.0);
    let mut total = StepStats::default();
    for start in (0..n).step_by(m.max(1)) {
        let end = (start + m).min(n);
        let stats = backend.forward_backward(
            &x[start * inputs..end * inputs],
            &labels[start..end],
            reduction,
            part,
        )?;
        add_term(acc, part)?;
        total.loss_sum += stats.loss_sum;
        total.correct += stats.correct;
    }
    Ok(total)
}

/// The length of a worker's encoded gradient for a model of `params` values.
pub fn wire_len(params: usize) -> usize {
    LIMBS * params
}
