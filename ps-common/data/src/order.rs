//! The data-order contract (what makes a distributed run comparable with one process): for epoch `e` the training set is permuted by a
//! generator seeded with `(seed, e)`; global step `t` takes the next `B` indices of that
//! permutation; worker `r` takes its contiguous slice of those. Everything here is a pure
//! function of `(seed, step, rank, W, B)`, so a single-process run with batch `B` sees exactly
//! the same global batches and a restarted worker needs no other state.

use ps_model::layout::{split_even, splitmix64};
use std::ops::Range;

/// How a run walks through the training set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataOrder {
    /// The run's seed.
    pub seed: u64,
    /// Training-set size `N`.
    pub n: usize,
    /// Global batch `B`.
    pub global_batch: usize,
    /// Keep the short last batch of each epoch (default: drop it, as `drop_last=True`).
    pub keep_last: bool,
    /// The unit the global batch is split in among the workers: 1 (any split), or the
    /// micro-batch of `[train] exact_sum` (each worker takes whole micro-batches).
    pub micro_batch: usize,
}

/// Where a global step falls: its epoch and its slice of that epoch's permutation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSlot {
    /// Epoch of the step.
    pub epoch: u64,
    /// Positions `[start, end)` in that epoch's permutation.
    pub positions: Range<usize>,
}

impl DataOrder {
    /// Steps in one epoch: `floor(N / B)`, or `ceil(N / B)` when the short last batch is kept.
    pub fn steps_per_epoch(&self) -> u64 {
        let full = self.n / self.global_batch;
        let extra = usize::from(self.keep_last && !self.n.is_multiple_of(self.global_batch));
        (full + extra) as u64
    }

    /// The epoch and positions of global step `t`.
    pub fn slot(&self, t: u64) -> StepSlot {
        let spe = self.steps_per_epoch();
        let (epoch, i) = (t / spe, (t % spe) as usize);
        let start = i * self.global_batch;
        StepSlot {
            epoch,
            positions: start..(start + self.global_batch).min(self.n),
        }
    }

    /// Samples in global step `t` (`B`, or fewer for a kept short last batch).
    pub fn batch_len(&self, t: u64) -> usize {
        self.slot(t).positions.len()
    }

    /// The range of step `t`'s global batch that worker `rank` of `world` takes: contiguous,
    /// as even as possible, the first `b % world` workers one sample more; in units of
    /// `micro_batch` samples when it is above 1.
    pub fn worker_range(&self, t: u64, rank: usize, world: usize) -> Range<usize> {
        let m = self.micro_batch.max(1);
        let units = split_even(self.batch_len(t) / m, world)[rank].clone();
        units.start * m..units.end * m
    }

    /// The dataset indices of the whole global batch of step `t`, given the epoch's permutation.
    pub fn global_indices<'a>(&self, t: u64, perm: &'a Permutation) -> &'a [u32] {
        let slot = self.slot(t);
        assert_eq!(perm.epoch, slot.epoch, "permutation of the wrong epoch");
        &perm.indices[slot.positions]
    }
}

/// One epoch's permutation of `0..N`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permutation {
    /// The epoch it belongs to.
    pub epoch: u64,
    /// A permutation of `0..N`.
    pub indices: Vec<u32>,
}

impl Permutation {
    /// Fisher-Yates shuffle of `0..n` driven by a SplitMix64 stream seeded with `(seed, epoch)`.
    pub fn new(seed: u64, epoch: u64, n: usize) -> Self {
        let mut indices: Vec<u32> = (0..n as u32).collect();
        let mut state = splitmix64(seed ^ splitmix64(epoch.wrapping_add(0xE90C)));
        for i in (1..n).rev() {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let r = splitmix64(state);
            // unbiased enough for n < 2^32: multiply-shift reduction of 64 random bits
            let j = ((r as u128 * (i as u128 + 1)) >> 64) as usize;
            indices.swap(i, j);
        }
        Self { epoch, indices }
    }
}

/// Keeps the current epoch's permutation and recomputes it when a step crosses into a new epoch.
#[derive(Debug, Clone)]
pub struct BatchPlanner {
    order: DataOrder,
    perm: Option<Permutation>,
}

impl BatchPlanner {
    /// A planner for `order`.
    pub fn new(order: DataOrder) -> Self {
        Self { order, perm: None }
    }

    /// The order it follows.
    pub fn order(&self) -> &DataOrder {
        &self.order
    }

    /// Dataset indices of step `t`'s global batch.
    pub fn global_batch(&mut self, t: u64) -> &[u32] {
        let epoch = self.order.slot(t).epoch;
        if self.perm.as_ref().is_none_or(|p| p.epoch != epoch) {
            self.perm = Some(Permutation::new(self.order.seed, epoch, self.order.n));
        }
        let perm = self.perm.as_ref().expect("permutation just computed");
        self.order.global_indices(t, perm)
    }

    /// Dataset indices worker `rank` of `world` uses at step `t`.
    pub fn worker_batch(&mut self, t: u64, rank: usize, world: usize) -> &[u32] {
        let r = self.order.worker_range(t, rank, world);
        &self.global_batch(t)[r]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(n: usize, b: usize, keep_last: bool) -> DataOrder {
        DataOrder {
            seed: 42,
            n,
            global_batch: b,
            keep_last,
            micro_batch: 1,
        }
    }

    #[test]
    fn permutation_is_a_permutation_and_depends_on_seed_and_epoch() {
        let p = Permutation::new(42, 0, 1000);
        let mut sorted = p.indices.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<u32>>());
        assert_eq!(p, Permutation::new(42, 0, 1000));
        assert_ne!(p.indices, Permutation::new(42, 1, 1000).indices);
        assert_ne!(p.indices, Permutation::new(43, 0, 1000).indices);
        assert_ne!(p.indices, (0..1000).collect::<Vec<u32>>());
    }

    #[test]
    fn steps_and_short_last_batch() {
        assert_eq!(order(100, 30, false).steps_per_epoch(), 3);
        assert_eq!(order(100, 30, true).steps_per_epoch(), 4);
        assert_eq!(order(100, 30, true).batch_len(3), 10);
        assert_eq!(
            order(100, 30, true).slot(5),
            StepSlot {
                epoch: 1,
                positions: 30..60
            }
        );
        assert_eq!(order(90, 30, true).steps_per_epoch(), 3);
    }

    #[test]
    fn worker_slices_concatenate_to_the_global_batch() {
        let o = order(1000, 30, false);
        let mut planner = BatchPlanner::new(o.clone());
        for t in [0u64, 1, 32, 33, 70] {
            let global = planner.global_batch(t).to_vec();
            let mut joined = Vec::new();
            let mut sizes = Vec::new();
            for r in 0..4 {
                let part = planner.worker_batch(t, r, 4).to_vec();
                sizes.push(part.len());
                joined.extend(part);
            }
            assert_eq!(joined, global, "step {t}");
            assert_eq!(sizes, [8, 8, 7, 7]);
        }
        // step 33 is in epoch 1: different indices than step 0 of epoch 0 positions 0..30
        assert_eq!(o.slot(33).epoch, 1);
    }
}
