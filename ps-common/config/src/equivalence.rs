//! [`Equivalence`]: the single-process training run a distributed configuration equals, and
//! the statement of it that the processes print.

use crate::LossReduction;
use std::fmt;

/// The single-process training run a distributed configuration equals.
#[derive(Debug, Clone, PartialEq)]
pub struct Equivalence {
    /// Batch of the single process: `B`.
    pub global_batch: usize,
    /// Its loss reduction.
    pub loss_reduction: LossReduction,
    /// The cluster's aggregated gradient is this times the single-process gradient.
    pub grad_scale: f64,
    /// The single-process learning rate that gives the same updates when `lr_is_scale`.
    pub lr: f64,
    /// True when scaling the gradient is exactly scaling the lr (plain SGD, no weight decay);
    /// otherwise the equivalent single process scales its gradient by `grad_scale`.
    pub lr_is_scale: bool,
    /// False when the combination is only approximately a single-process run.
    pub exact: bool,
    /// True for `aggregation = "mean"` over per-worker batches that are not all equal (uneven
    /// split, or a kept short last batch): the run then equals exactly one process that
    /// averages the workers' mean gradients with equal weights (mean of means; times
    /// `grad_scale` with aggregation "sum": the sum of their means), not the global-batch
    /// mean; `--check-reference` compares with that.
    pub mean_of_means: bool,
    /// `W`, the workers whose mean gradients are averaged.
    pub workers: usize,
    /// Plain-words warnings (rescaled lr, biased mean).
    pub warnings: Vec<String>,
    /// `[optimizer] clip_norm`: the single process clips its gradient (the one multiplied by
    /// `grad_scale`, which is what the shards hold) with `clip_grad_norm_(params, max_norm)`.
    pub clip_norm: Option<f32>,
    /// `[train] micro_batches`: each worker sums this many micro-batch gradients (the same
    /// gradient as one pass over its batch).
    pub micro_batches: usize,
    /// `[train] exact_sum`: what the mode guarantees, in words (appended to the statement).
    pub exact_sum: Option<String>,
    /// A declared model with buffers: what its BatchNorm equals (appended to the statement).
    pub buffers: Option<String>,
}

impl fmt::Display for Equivalence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head = if self.exact {
            "equivalent to"
        } else {
            "approximately (not exactly) equivalent to"
        };
        if self.grad_scale == 1.0 || self.lr_is_scale {
            write!(
                f,
                "{head} one process with batch {}, {} loss, lr {}",
                self.global_batch,
                self.loss_reduction,
                fmt_num(self.lr)
            )?;
        } else {
            write!(
                f,
                "{head} one process with batch {}, {} loss, its gradient multiplied by {} (with this optimizer that is not the same as scaling the lr)",
                self.global_batch,
                self.loss_reduction,
                fmt_num(self.grad_scale)
            )?;
        }
        if self.mean_of_means {
            write!(
                f,
                "; it equals (up to float rounding) one process that averages the {} workers' mean gradients with equal weights (mean of means)",
                self.workers
            )?;
            if self.grad_scale != 1.0 {
                write!(
                    f,
                    ", multiplied by {}: the sum of their mean gradients",
                    fmt_num(self.grad_scale)
                )?;
            }
        }
        if let Some(c) = self.clip_norm {
            write!(
                f,
                "; before each step it clips {} gradient as torch.nn.utils.clip_grad_norm_(params, max_norm = {c}) does (the global L2 norm over the whole model, across the shards; parameters no sample reached do not count)",
                if self.grad_scale == 1.0 {
                    "its"
                } else {
                    "that (multiplied)"
                }
            )?;
        }
        if self.micro_batches > 1 {
            write!(
                f,
                "; each worker computes its batch in {} micro-batches and sums their gradients before pushing (gradient accumulation: the same gradient as one pass, to float rounding; BatchNorm statistics would be over the micro-batch)",
                self.micro_batches
            )?;
        }
        f.write_str(self.exact_sum.as_deref().unwrap_or(""))?;
        f.write_str(self.buffers.as_deref().unwrap_or(""))
    }
}

/// What a declared model's BatchNorm without running statistics (`modules`, per-worker
/// batches `b`, global batch `global`) makes the run equal (appended to the statement); None
/// when there is none or one worker (its batch is the whole batch).
pub(crate) fn batch_statistics_statement(
    modules: &[String],
    b: &[usize],
    global: usize,
) -> Option<String> {
    if modules.is_empty() || b.len() < 2 {
        return None;
    }
    let mut names = modules
        .iter()
        .take(3)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if modules.len() > 3 {
        names.push_str(", ...");
    }
    Some(format!(
        "; the model's BatchNorm without running statistics ({} module{}: {names}) normalises each worker's forward pass over that worker's own samples of a step: the one process normalises its batch in {} chunks of b_r = {b:?} samples (per-worker batch statistics, ghost batch norm), not over the whole batch of {global}",
        modules.len(),
        if modules.len() == 1 { "" } else { "s" },
        b.len()
    ))
}

fn fmt_num(x: f64) -> String {
    let s = format!("{x}");
    if s.len() > 10 { format!("{x:.6e}") } else { s }
}
