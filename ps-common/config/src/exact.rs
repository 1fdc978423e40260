//! `[train] exact_sum`: the mode in which the weights are the same bits at any `W`.
//!
//! Every gradient term is computed on a micro-batch of `m` samples (`[train]
//! exact_micro_batch`, independent of `W`): the global batch `B` is `M = B / m` micro-batches,
//! worker `r` computes the contiguous micro-batches `split_even(M, W)[r]` (the data order of
//! the global batch is unchanged), and the terms are summed exactly in fixed point
//! (`ps_net::exact`), rounded to f32 once on the shard. The aggregate is `S / M` with a mean
//! loss (the mean over `B`, whatever the aggregation `mean` or `weighted`) and `S` with a sum
//! loss and `sum` aggregation; the combinations whose math depends on `W` are refused.

use super::kinds::{Aggregation, LossReduction, Wire};
use super::train::TrainConfig;
use crate::error::Invalid;

/// The micro-batch size when `exact_micro_batch` is not stated: the largest of 16, 8, 4, 2, 1
/// that divides the global batch.
const DEFAULT_MICRO_BATCH: usize = 16;

/// Resolves the micro-batch size against the global batch `B` and `W`, and refuses what the
/// mode cannot make independent of `W` (exit 2 at start-up), saying why. A declared model
/// (`[model] init`) is trained by PyTorch workers, which push exact partial sums too
/// (`ps_torch.Worker.terms`).
pub(super) fn resolve(train: &mut TrainConfig, workers: usize, wire: Wire) -> Result<(), Invalid> {
    let Some(stated) = train.exact_micro_batch else {
        return Ok(());
    };
    let b = train.global_batch;
    let m = if stated == 0 {
        let mut m = DEFAULT_MICRO_BATCH;
        while !b.is_multiple_of(m) {
            m /= 2;
        }
        m
    } else {
        stated
    };
    let refuse = |why: String| Err(invalid!("[train] exact_sum = true: {why}"));
    if !b.is_multiple_of(m) {
        return refuse(format!(
            "exact_micro_batch = {m} does not divide the global batch {b}: expected B to be whole micro-batches"
        ));
    }
    if b / m < workers {
        return refuse(format!(
            "the global batch {b} is {} micro-batches of {m}, fewer than [cluster] workers = {workers}: expected every worker to compute at least one (a smaller exact_micro_batch, or fewer workers)",
            b / m
        ));
    }
    if train.micro_batches > 1 {
        return refuse(format!(
            "[train] micro_batches = {}: the exact mode computes whole micro-batches of exact_micro_batch = {m} samples on its own; remove micro_batches",
            train.micro_batches
        ));
    }
    if train.keep_last {
        return refuse("keep_last = true: a short last batch is not whole micro-batches; expected keep_last = false".into());
    }
    match (train.loss_reduction, train.aggregation) {
        (LossReduction::Mean, Aggregation::Sum) => {
            return refuse("loss_reduction \"mean\" with aggregation \"sum\" sums W mean gradients: the result scales with W; use aggregation \"mean\" or \"weighted\" (both are the mean over the global batch in this mode)".into());
        }
        (LossReduction::Sum, Aggregation::Mean) => {
            return refuse("loss_reduction \"sum\" with aggregation \"mean\" divides the summed gradient by W: the result depends on W; use aggregation \"sum\"".into());
        }
        _ => {}
    }
    if wire == Wire::Bf16 {
        return refuse("[cluster] wire = \"bf16\" rounds each worker's gradient to bfloat16 with a per-worker error feedback: not exact; use wire = \"f32\"".into());
    }
    train.exact_micro_batch = Some(m);
    Ok(())
}

/// The mode's guarantee in words, for the start-up statement (`clip`: `[optimizer]
/// clip_norm` is set).
pub(super) fn statement(train: &TrainConfig, clip: bool) -> Option<String> {
    let m = train.exact_micro_batch?;
    let terms = train.global_batch / m;
    let aggregate = match train.loss_reduction {
        LossReduction::Mean => "divided by the number of terms (the mean over the global batch)",
        LossReduction::Sum => "as it is (the sum over the global batch)",
    };
    // the clipping norm sums each tensor's squares in f64 over the shards' parts of it
    let shards = if clip {
        "and a given number of shards, and with one shard bit-identical to the single-process reference in this mode (with clip_norm a tensor split between shards has its squared norm summed in parts, which may change the norm's last bit, so other shard counts are not guaranteed the same bits)"
    } else {
        "and any number of shards, and bit-identical to the single-process reference in this mode"
    };
    Some(format!(
        "; exact sum (exact_sum = true): every step's gradient is {terms} terms of {m} samples (each worker computes whole ones), summed in fixed point without rounding (terms rounded below 2^-50, each worker's partial sum below 2^22 in magnitude) and rounded to f32 once, {aggregate}: the weights are the same bits at any number of workers, any split, any arrival order, any transport {shards}"
    ))
}
