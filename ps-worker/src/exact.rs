//! The worker's part of `[train] exact_sum`: its batch is whole micro-batches of `m` samples
//! (the data order gives it `split_even(B / m, W)[rank]` of them); the gradient of each is
//! computed on its own (the same samples meet the same shapes at any `W`) and added to a
//! fixed-point sum without rounding ([`ps_net::exact`]); the push carries that partial sum,
//! encoded, which the shards add to the others' and round once.

use crate::backend::{Backend, BackendResult, StepStats};
use ps_config::LossReduction;
use ps_net::exact::{LIMBS, TermSum};

/// The gradient terms of `x`/`labels` (whole micro-batches of `m`), summed exactly into `acc`
/// (reset here to the model's length), then encoded into `wire` ([`LIMBS`] values per
/// parameter); `part` is the scratch of one term. `ready` is called once, with the whole
/// encoded sum at offset 0, and the figures summed over the micro-batches.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_exact(
    backend: &mut dyn Backend,
    x: &[f32],
    labels: &[u8],
    reduction: LossReduction,
    m: usize,
    acc: &mut TermSum,
    part: &mut Vec<f32>,
    wire: &mut [f32],
    ready: &mut dyn FnMut(usize, &[f32], StepStats),
) -> BackendResult<StepStats> {
    let params = wire.len() / LIMBS;
    let total = partial_sum(backend, x, labels, reduction, (m, params), acc, part)?;
    acc.encode(0..params, wire)?;
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
    acc: &mut TermSum,
    part: &mut Vec<f32>,
) -> BackendResult<StepStats> {
    let n = labels.len();
    let inputs = x.len().checked_div(n).unwrap_or(0);
    acc.reset(params);
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
        acc.add_term(part)?;
        total.loss_sum += stats.loss_sum;
        total.correct += stats.correct;
    }
    Ok(total)
}

/// The length of a worker's encoded gradient for a model of `params` values.
pub fn wire_len(params: usize) -> usize {
    LIMBS * params
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_model::layout::{MlpLayout, ModelLayout};

    /// A worker's encoded partial sums of any split of the micro-batches, added on the shard,
    /// round to the same bits as one partial sum of them all; the figures are summed.
    #[test]
    fn partial_sums_of_any_split_merge_to_the_same_bits() {
        let layout: ModelLayout = MlpLayout::new(&[6, 9, 4]).into();
        let n = layout.num_params();
        let mut backend = crate::cpu::cpu_model(&layout, 1);
        backend.set_weights(&layout.init_range(3, 0..n)).unwrap();
        let (m, batches) = (4, 6);
        let x: Vec<f32> = (0..m * batches * 6)
            .map(|i| ((i * 37) % 23) as f32 / 23.0 - 0.4)
            .collect();
        let y: Vec<u8> = (0..m * batches).map(|i| (i * 7 % 4) as u8).collect();
        let rounded = |splits: &[usize], backend: &mut dyn Backend| {
            let (mut wires, mut loss) = (Vec::new(), 0.0);
            let (mut acc, mut part) = (TermSum::default(), Vec::new());
            let mut start = 0;
            for &k in splits {
                let (xs, ys) = (
                    &x[start * m * 6..(start + k) * m * 6],
                    &y[start * m..(start + k) * m],
                );
                let mut wire = vec![0f32; wire_len(n)];
                let stats = forward_backward_exact(
                    backend,
                    xs,
                    ys,
                    LossReduction::Mean,
                    m,
                    &mut acc,
                    &mut part,
                    &mut wire,
                    &mut |at, _, _| assert_eq!(at, 0),
                )
                .unwrap();
                loss += stats.loss_sum;
                wires.push(wire);
                start += k;
            }
            let parts: Vec<&[f32]> = wires.iter().map(|w| &w[..]).collect();
            let mut out = vec![0f32; n];
            ps_net::exact::sum_encoded(&parts, 0, &mut out).unwrap();
            (out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), loss)
        };
        let (one, loss) = rounded(&[6], backend.as_mut());
        assert!(one.iter().any(|&b| b != 0), "a gradient");
        for splits in [&[3, 3][..], &[2, 2, 1, 1], &[1, 1, 1, 1, 1, 1], &[5, 1]] {
            let (got, l) = rounded(splits, backend.as_mut());
            assert_eq!(got, one, "split {splits:?}");
            assert!((l - loss).abs() < 1e-9 * loss.abs(), "loss {l} vs {loss}");
        }
    }
}
