//! `[data]` and `[train]`: the data set, the batch, the length of the run.

use super::Resolve;
use super::kinds::{Aggregation, LossReduction};
use super::limits::{MAX_BATCH, MAX_STEPS, at_most};
use crate::error::Invalid;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawData {
    #[serde(default, skip_serializing_if = "is_empty_path")]
    pub dir: PathBuf,
    /// Set by a command-line override: taken as given, not relative to the file.
    #[serde(skip)]
    pub dir_as_given: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_len: Option<u64>,
}

fn is_empty_path(p: &std::path::Path) -> bool {
    p.as_os_str().is_empty()
}

/// `[data]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct DataConfig {
    /// Dataset directory (IDX files); empty when the run's data is the user's own
    /// (`train_len` given, a declared model).
    pub dir: PathBuf,
    /// `train_len`: the number of samples of the user's own training set (a declared model's
    /// workers bring their data): the shards take the run's length from it instead of reading
    /// `dir`, and each worker's `batches(train_len)` must name the same number.
    pub train_len: Option<usize>,
}

impl RawData {
    pub(super) fn validate(&self, resolve: &Resolve) -> Result<DataConfig, Invalid> {
        if let Some(n) = self.train_len
            && (n == 0 || n > u64::from(u32::MAX))
        {
            return Err(invalid!(
                "[data] train_len = {n}: expected 1..={} samples",
                u32::MAX
            ));
        }
        if is_empty_path(&self.dir) && self.train_len.is_none() {
            return Err("[data]: expected dir (a directory of IDX files) or train_len (the number of samples of the user's own training set, for a declared model)".into());
        }
        Ok(DataConfig {
            dir: if self.dir_as_given || is_empty_path(&self.dir) {
                self.dir.clone()
            } else {
                resolve.path(&self.dir)
            },
            train_len: self.train_len.map(|n| n as usize),
        })
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTrain {
    #[serde(default)]
    pub seed: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_worker_batch: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epochs: Option<u64>,
    #[serde(default)]
    pub keep_last: bool,
    pub loss_reduction: LossReduction,
    pub aggregation: Aggregation,
    #[serde(default = "default_log_every")]
    pub log_every: u64,
    #[serde(default)]
    pub eval_every: u64,
    /// Gradient accumulation: each worker computes its batch of a step in this many
    /// micro-batches and sums their gradients before pushing.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub micro_batches: u64,
    /// The exact-sum mode ([`super::exact`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exact_sum: bool,
    /// Samples per micro-batch in the exact-sum mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact_micro_batch: Option<u64>,
}

fn default_log_every() -> u64 {
    10
}

fn one() -> u64 {
    1
}

fn is_one(k: &u64) -> bool {
    *k == 1
}

/// `[train]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Seed of the data order and of the initial weights.
    pub seed: u64,
    /// `B` (from `global_batch`, or `per_worker_batch` x workers).
    pub global_batch: usize,
    /// Whether the config stated the per-worker batch (then `B = W * per_worker_batch`).
    pub batch_from_per_worker: bool,
    /// Stop after this many steps, or
    pub steps: Option<u64>,
    /// after this many epochs (exactly one of the two).
    pub epochs: Option<u64>,
    /// Keep the short last batch of each epoch.
    pub keep_last: bool,
    /// Worker loss reduction.
    pub loss_reduction: LossReduction,
    /// Shard aggregation.
    pub aggregation: Aggregation,
    /// Log every N steps (1 = every step).
    pub log_every: u64,
    /// Evaluate on the test set every N steps (0 = only at the end).
    pub eval_every: u64,
    /// `k`: each worker's batch of a step is computed in `k` micro-batches of `b_r / k`
    /// samples whose gradients it sums before pushing (the same gradient as one pass over
    /// `b_r`, to float rounding; less activation memory, more passes). 1: no accumulation.
    pub micro_batches: usize,
    /// `exact_sum = true`: the samples of each gradient term (`exact_micro_batch`, resolved:
    /// the global batch is split into `B / m` micro-batches, each worker computes whole ones,
    /// their gradients are summed exactly, [`super::exact`]); None: the mode is off.
    pub exact_micro_batch: Option<usize>,
}

impl RawTrain {
    /// Validates the section alone; `global_batch` is then the number stated, which
    /// [`super::Config`]'s cross-section checks multiply by the workers when it is per worker.
    pub(super) fn validate(&self) -> Result<TrainConfig, Invalid> {
        let (batch, batch_from_per_worker) = match (self.global_batch, self.per_worker_batch) {
            (Some(b), None) if b > 0 => (b, false),
            (None, Some(b)) if b > 0 => (b, true),
            (Some(_), Some(_)) => {
                return Err(
                    "[train] global_batch and per_worker_batch are both set: expected exactly one of them".into(),
                );
            }
            (None, None) => {
                return Err("[train]: expected one of global_batch or per_worker_batch".into());
            }
            _ => return Err("[train] batch size 0: expected a positive batch size".into()),
        };
        let key = if batch_from_per_worker {
            "[train] per_worker_batch"
        } else {
            "[train] global_batch"
        };
        let batch = at_most(key, batch, MAX_BATCH)? as usize;
        match (self.steps, self.epochs) {
            (Some(s), None) if s > 0 => {
                at_most("[train] steps", s, MAX_STEPS)?;
            }
            (None, Some(e)) if e > 0 => {
                at_most("[train] epochs", e, MAX_STEPS)?;
            }
            (Some(_), Some(_)) => {
                return Err(
                    "[train] steps and epochs are both set: expected exactly one of them".into(),
                );
            }
            (None, None) => return Err("[train]: expected one of steps or epochs".into()),
            _ => return Err("[train] steps/epochs = 0: expected a positive number".into()),
        }
        if self.log_every == 0 {
            return Err("[train] log_every = 0: expected 1 or more".into());
        }
        at_most("[train] log_every", self.log_every, MAX_STEPS)?;
        at_most("[train] eval_every", self.eval_every, MAX_STEPS)?;
        if self.micro_batches == 0 {
            return Err("[train] micro_batches = 0: expected 1 (no accumulation) or more".into());
        }
        let micro_batches =
            at_most("[train] micro_batches", self.micro_batches, MAX_BATCH)? as usize;
        if self.loss_reduction == LossReduction::Sum && self.aggregation == Aggregation::Weighted {
            return Err(
                "[train] aggregation = \"weighted\" with loss_reduction = \"sum\": weighted aggregation expects mean-reduced worker gradients; use loss_reduction = \"mean\"".into(),
            );
        }
        Ok(TrainConfig {
            seed: self.seed,
            global_batch: batch,
            batch_from_per_worker,
            steps: self.steps,
            epochs: self.epochs,
            keep_last: self.keep_last,
            loss_reduction: self.loss_reduction,
            aggregation: self.aggregation,
            log_every: self.log_every,
            eval_every: self.eval_every,
            micro_batches,
            exact_micro_batch: exact_stated(self)?,
        })
    }
}

/// `exact_micro_batch` as stated (0: not stated), when the mode is on; an error when the key is
/// given without the mode or is 0.
fn exact_stated(raw: &RawTrain) -> Result<Option<usize>, Invalid> {
    match (raw.exact_sum, raw.exact_micro_batch) {
        (false, None) => Ok(None),
        (false, Some(m)) => Err(invalid!(
            "[train] exact_micro_batch = {m} without exact_sum = true: expected it only in the exact-sum mode"
        )),
        (true, Some(0)) => Err(
            "[train] exact_micro_batch = 0: expected the samples of one gradient term (1 or more)"
                .into(),
        ),
        (true, m) => Ok(Some(m.unwrap_or(0) as usize)),
    }
}
