//! The step's types: where a rank's gradient lies ([`Grad`], read through
//! [`ps_net::source::PushSource`] whatever plane carried it), a rank's slot ([`Slot`]), what a
//! push carries and gets ([`PushMeta`], [`PushOutcome`]), a completed step's figures
//! ([`StepFigures`], [`RankNorm`]), and the two traits the process around the shard implements
//! ([`NormExchange`], [`StepObserver`]).

use crate::intake::Held;
use crate::{NormError, Shard, bucket, checkpoint};
use ps_net::source::PushSource;
use ps_optim::OptState;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Where a rank's gradient slice for the current step lies.
#[derive(Debug)]
pub enum Grad {
    /// Received through gRPC into a shard buffer (with the permit to hold it).
    Owned(Held),
    /// Read in place where its plane put it (a shared-memory gradient board's range): checked
    /// at push time, and for finiteness again by the update that reads it.
    InPlace(Arc<dyn PushSource>),
    /// Received into a buffer shared with the per-bucket applier ([`bucket`]).
    Received(bucket::Received),
    /// Already folded into the step's accumulator ([`crate::intake::Acc`]).
    Folded,
    /// Received and checked (fingerprint, finiteness) without being kept: a push of a rank
    /// the step has already counted (a retry, a conflict) or no longer waits for.
    Checked,
}

impl Grad {
    /// Its values, wherever they lie (received into a shard buffer, or in place); None for a
    /// gradient already folded or not kept.
    pub fn source(&self) -> Option<&dyn PushSource> {
        match self {
            Grad::Owned(held) => Some(held),
            Grad::InPlace(src) => Some(&**src),
            Grad::Received(received) => Some(received),
            Grad::Folded | Grad::Checked => None,
        }
    }
}

/// One rank's gradient for the current step.
#[derive(Debug)]
pub struct Slot {
    /// The rank it came from.
    pub rank: u32,
    /// The gradient slice.
    pub grad: Grad,
    /// Fingerprint of its bytes (to recognise retries).
    pub fingerprint: u64,
    /// `b_r`.
    pub samples: u32,
    /// Sum of per-sample losses.
    pub loss_sum: f64,
    /// Correct predictions.
    pub correct: u64,
    /// Test-set evaluation carried with the push (correct, count).
    pub eval: (u64, u64),
    /// When it arrived.
    pub arrived: Instant,
}

/// What a push carries besides the gradient.
#[derive(Debug, Clone, Copy)]
pub struct PushMeta {
    /// Rank.
    pub rank: u32,
    /// Step.
    pub step: u64,
    /// `b_r`.
    pub samples: u32,
    /// Sum of per-sample losses.
    pub loss_sum: f64,
    /// Correct predictions.
    pub correct: u64,
    /// Evaluation (correct, count).
    pub eval: (u64, u64),
}

/// The outcome of an accepted push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushOutcome {
    /// False for an idempotent retry of a gradient already counted.
    pub counted: bool,
    /// Ranks in for the step now.
    pub ranks_in: u32,
}

/// Figures of one completed step on this shard.
#[derive(Debug, Clone)]
pub struct StepFigures {
    /// The step that was applied (version is now `step + 1`).
    pub step: u64,
    /// Squared norm of this shard's slice of the aggregated gradient.
    pub grad_sq_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Σ b_r.
    pub samples: u64,
    /// Σ loss sums.
    pub loss_sum: f64,
    /// Σ correct.
    pub correct: u64,
    /// Workers whose gradient went in.
    pub workers_in: u32,
    /// Time from the previous version bump to this one.
    pub step_ms: f64,
    /// Time from the first to the last arrival.
    pub barrier_wait_ms: f64,
    /// Rank that arrived last.
    pub slowest_rank: u32,
    /// Each rank's arrival after the step's first gradient, ms (rank order).
    pub arrival_lag_ms: Vec<(u32, f64)>,
    /// Time spent aggregating and updating at the barrier's completion (with per-bucket apply,
    /// the buckets not applied before it only).
    pub apply_ms: f64,
    /// Time from the last gradient's arrival (counted) to the new version.
    pub tail_ms: f64,
    /// Test-set evaluation summed over ranks (correct, count), when carried.
    pub eval: (u64, u64),
    /// Each rank's squared gradient norm over this shard's range, in rank order (the gradient
    /// noise scale's input); empty when one is not known (a rank the step went on without
    /// after it had been folded).
    pub ranks: Vec<RankNorm>,
    /// With `[optimizer] clip_norm`: the global norm of the aggregated gradient over the whole
    /// model (before clipping) and the coefficient applied (1: not clipped).
    pub clip: Option<(f32, f32)>,
    /// With per-bucket apply ([`bucket`]): the buckets applied before the barrier completed,
    /// and the shard's buckets; None when the step was applied over the whole range at once.
    pub buckets: Option<(u32, u32)>,
}

/// What an update computed, for the completion to commit ([`Shard::apply`]).
#[derive(Debug)]
pub(crate) struct Applied {
    /// The aggregate's squared norm, or why the step is refused.
    pub(crate) result: Result<f64, StepError>,
    pub(crate) rank_sq: Vec<RankNorm>,
    /// The parts of the tensors no rank reached.
    pub(crate) skip: Vec<(u32, Range<usize>)>,
    pub(crate) clip: Option<(f32, f32)>,
    /// The new optimizer state (steps not yet counted; partly advanced on an error).
    pub(crate) opt: OptState,
    /// Buckets applied before the barrier completed, when applied per bucket.
    pub(crate) buckets: Option<u32>,
}

/// How a shard learns the global gradient norm of a step from every shard's per-tensor squared
/// norms (`ps_model::clip`; over gRPC, `ps_server::clip`): it blocks (bounded) and is called
/// from the update's blocking thread.
pub trait NormExchange: Send + Sync + std::fmt::Debug {
    /// The total norm of `step` (torch's clip_grad_norm_), given this shard's squared norms of
    /// its part of each tensor from `first`; an error saying why when it cannot be had.
    fn total_norm(
        &self,
        shard: &Shard,
        step: u64,
        first: u32,
        sq: Vec<f64>,
    ) -> Result<f32, NormError>;
}

/// What the process around the shard does with a completed step ([`Shard::complete`]): its
/// metrics, its report to shard 0, its logs. Called on the update's blocking thread.
pub trait StepObserver {
    /// The figures of the step just applied (the new version is published already).
    fn step_done(&self, figures: StepFigures);
    /// A checkpoint that was due after the step was attempted (written, retried, or failed).
    fn checkpointed(&self, attempted: &checkpoint::Attempted);
}

/// One rank's share of a step on one shard.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankNorm {
    /// The rank.
    pub rank: u32,
    /// Its `b_r`.
    pub samples: u32,
    /// |g_r|² over the shard's range of the gradient it pushed.
    pub sq_norm: f64,
}

/// Why a step is not applied (the shard stays at its version and the run stops); each says
/// which step, and what was found where.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A rank pushed something that is not an exact partial sum (`[train] exact_sum`).
    #[error(
        "step {step}: rank {rank}'s exact partial sum on shard {shard}: {why}; the step is not applied (the shard stays at version {step}) and the run stops"
    )]
    ExactSum {
        /// The step.
        step: u64,
        /// The rank.
        rank: u32,
        /// The shard.
        shard: usize,
        /// What is wrong with it.
        why: ps_net::exact::ExactError,
    },
    /// The global gradient norm could not be had (`[optimizer] clip_norm`).
    #[error(
        "step {step}: gradient clipping ([optimizer] clip_norm) needs the gradient norm of every shard: {why}; the step is not applied (the shard stays at version {step}) and the run stops"
    )]
    NormExchange {
        /// The step.
        step: u64,
        /// Why.
        why: NormError,
    },
    /// A rank's gradient board shrank while the shard read it.
    #[error(
        "step {step}: rank {rank}'s shared-memory gradient board was truncated while the update read it (another process shrank the file, against the protocol): what was read is not its gradient; the step is not applied (the shard stays at version {step}) and the run stops"
    )]
    BoardTruncated {
        /// The step.
        step: u64,
        /// The rank.
        rank: u32,
    },
    /// The shard's parameters board shrank during the update.
    #[error(
        "step {step}: shard {shard}'s shared-memory parameters board was truncated during the update (another process shrank the file): the parameters are lost; the run stops"
    )]
    ParamsTruncated {
        /// The step.
        step: u64,
        /// The shard.
        shard: usize,
    },
    /// A gradient value not finite where the update reads it, although its push was checked.
    #[error(
        "step {step}: rank {rank}'s gradient holds {value} at index {index} of shard {shard}'s range when the update reads it, although its push was checked: its shared-memory board was written after the push was accepted; the step is not applied (the shard stays at version {step}) and the run stops"
    )]
    NonFinite {
        /// The step.
        step: u64,
        /// The rank.
        rank: u32,
        /// The value.
        value: f32,
        /// Its index in the shard's range.
        index: usize,
        /// The shard.
        shard: usize,
    },
}
