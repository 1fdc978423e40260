//! Global gradient-norm clipping exactly as `torch.nn.utils.clip_grad_norm_(params,
//! max_norm)`: the L2 norm of each tensor's gradient rounded to f32 (`torch._foreach_norm`),
//! the norm of those norms, and every gradient scaled by `min(1, max_norm / (total + 1e-6))`
//! in f32. The shards compute the per-tensor sums over their ranges and exchange them
//! (`ps-server`'s `clip`); the single-process reference clips its whole gradient with
//! [`clip_grad_norm`].

use crate::layout::{ModelSpec, TensorSpec};
use ps_optim::sum_of_squares;
use std::ops::Range;

/// The tensors (flat order) that `range` of the flat vector holds part of.
pub fn tensors_of(spec: &ModelSpec, range: &Range<usize>) -> Range<usize> {
    let holds = |t: &TensorSpec| {
        t.numel() > 0 && t.offset < range.end && range.start < t.offset + t.numel()
    };
    match spec.tensors.iter().position(holds) {
        Some(first) => {
            let n = spec.tensors[first..]
                .iter()
                .take_while(|t| holds(t) || t.numel() == 0)
                .count();
            first..first + n
        }
        None => 0..0,
    }
}

/// The squared L2 norm (f64) of each tensor's part in `g`, the gradient over `range` of the
/// flat vector, for the tensors [`tensors_of`] names; a tensor in `none` (sorted: no
/// sample's backward reached it, `grad is None` in torch) counts 0.
pub fn partials(spec: &ModelSpec, range: &Range<usize>, g: &[f32], none: &[u32]) -> Vec<f64> {
    tensors_of(spec, range)
        .map(|t| {
            let tensor = &spec.tensors[t];
            let lo = tensor.offset.max(range.start);
            let hi = (tensor.offset + tensor.numel()).min(range.end);
            if none.binary_search(&(t as u32)).is_ok() || lo >= hi {
                return 0.0;
            }
            sum_of_squares(&g[lo - range.start..hi - range.start])
        })
        .collect()
}

/// torch's total norm from each tensor's whole squared norm: each tensor's norm rounded to
/// f32, then the norm of those (`vector_norm` of the stacked norms), as an f32.
pub fn total_norm(sq: &[f64]) -> f32 {
    let sum: f64 = sq
        .iter()
        .map(|&s| {
            let n = f64::from(s.sqrt() as f32);
            n * n
        })
        .sum();
    sum.sqrt() as f32
}

/// torch's clipping coefficient: `clamp(max_norm / (total + 1e-6), max = 1)` in f32,
/// where `max_norm / tensor` is `tensor.reciprocal() * max_norm` (`Tensor.__rtruediv__`).
pub fn coefficient(max_norm: f32, total: f32) -> f32 {
    let c = (1.0f32 / (total + 1e-6f32)) * max_norm;
    if c > 1.0 { 1.0 } else { c }
}

/// Clips the whole-model gradient `g` in place as `clip_grad_norm_(params, max_norm)`;
/// returns the total norm before clipping and the coefficient applied.
pub fn clip_grad_norm(spec: &ModelSpec, g: &mut [f32], max_norm: f32) -> (f32, f32) {
    let total = total_norm(&partials(spec, &(0..g.len()), g, &[]));
    let c = coefficient(max_norm, total);
    g.iter_mut().for_each(|x| *x *= c);
    (total, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coefficient_and_the_norm_are_torchs() {
        assert_eq!(coefficient(1.0, 2.0), (1.0f32 / 2.000001f32) * 1.0);
        assert_eq!(coefficient(5.0, 2.0), 1.0, "never scales up");
        assert_eq!(coefficient(1.0, 0.0), 1.0);
        assert_eq!(total_norm(&[9.0, 16.0]), 5.0);
        assert_eq!(total_norm(&[]), 0.0);
    }
}
