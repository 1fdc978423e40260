//! Bounded receive memory for gRPC gradients (`[server] max_pending_gradients`):
//!
//! - [`Gate`]: the permits to hold a shard-sized receive buffer. A push whose gradient the
//!   shard must keep waits for a permit before its data is read (its stream stays under
//!   HTTP/2 flow control, the bytes with their sender). One permit is always left for the
//!   awaited rank (the lowest rank whose gradient the step still needs), so every arrival
//!   order makes progress, the reverse one with a single permit included.
//! - [`Acc`] and [`fold`]: the running aggregate of a step. As soon as the next rank in rank
//!   order is in, its gradient is folded into the accumulator with the same f32 operations,
//!   in the same order, as the fused update's aggregation (`g = c_0 x_0`, then `g += c_r x_r`,
//!   `c == 1` as a plain copy or add), so the weights are bit-identical to aggregating every
//!   gradient at once; its buffer (and permit) is then free for the next push.
//! - [`Shard::fold_ready`] and the buffer pool: the shard's side of the above. Each fold also
//!   takes the squared norm of the gradient it folds (the gradient noise scale's input) in
//!   the pass that reads it.

use super::update::{self, sum_of_squares};
use super::{Grad, Shard, Slot, StepError};
use ps_config::Aggregation;
use ps_net::source::PushSource;
use ps_proto::PsError;
use ps_proto::PsResult;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// Permits to hold a gRPC gradient buffer, shard-wide.
#[derive(Debug)]
pub struct Gate {
    limit: usize,
    state: Mutex<GateState>,
    /// Woken on every change a waiting push may care about (a permit back, a gradient
    /// counted or folded, a step applied).
    pub changed: Notify,
}

#[derive(Debug, Default)]
struct GateState {
    held: usize,
    /// Permits held per (rank, step).
    holders: HashMap<(u32, u64), usize>,
}

/// The right to hold one gradient buffer; given back when dropped.
#[derive(Debug)]
pub struct Permit {
    gate: Arc<Gate>,
    key: (u32, u64),
}

impl Drop for Permit {
    fn drop(&mut self) {
        {
            let mut st = self.gate.lock();
            st.held -= 1;
            if let Some(n) = st.holders.get_mut(&self.key) {
                *n -= 1;
                if *n == 0 {
                    st.holders.remove(&self.key);
                }
            }
        }
        self.gate.changed.notify_waiters();
    }
}

impl Gate {
    /// A gate of `limit` permits (at least 1).
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit: limit.max(1),
            state: Mutex::default(),
            changed: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The configured number of permits.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Permits held now.
    pub fn held(&self) -> usize {
        self.lock().held
    }

    /// A permit for a push of `rank` for `step` when one can be given now: the awaited rank
    /// (of `current`, the step being gathered) takes any free permit; every other push leaves
    /// one for the awaited rank while it holds none.
    pub fn try_grant(
        self: &Arc<Self>,
        rank: u32,
        step: u64,
        current: u64,
        awaited: Option<u32>,
    ) -> Option<Permit> {
        let mut st = self.lock();
        let free = self.limit.saturating_sub(st.held);
        let awaited_holds =
            awaited.is_some_and(|a| st.holders.get(&(a, current)).copied().unwrap_or(0) > 0);
        let is_awaited = step == current && awaited == Some(rank);
        let need = if is_awaited || awaited.is_none() || awaited_holds {
            1
        } else {
            2
        };
        if free < need {
            return None;
        }
        st.held += 1;
        *st.holders.entry((rank, step)).or_insert(0) += 1;
        Some(Permit {
            gate: self.clone(),
            key: (rank, step),
        })
    }
}

/// A received gRPC gradient and the permit that let it be received.
#[derive(Debug)]
pub struct Held {
    /// The values.
    pub values: Vec<f32>,
    /// Given back with the buffer.
    pub permit: Option<Permit>,
}

/// A gradient received whole into a shard buffer, read where it lies.
impl PushSource for Held {
    fn values(&self) -> &[f32] {
        &self.values
    }
}

/// The running aggregate of the step being gathered.
#[derive(Debug, Default)]
pub struct Acc {
    /// The step it aggregates.
    pub step: u64,
    /// Ranks below this are folded (or take no part in the step).
    pub next: usize,
    /// `Σ c_r g_r` over the folded ranks, None before the first.
    pub values: Option<Vec<f32>>,
    /// The aggregation coefficient of each rank of the step (0 for ranks not in it), fixed
    /// once every rank of the step had announced its push.
    pub coeffs: Vec<f32>,
    /// The ranks of the step and their sample counts when the coefficients were fixed.
    pub members: Vec<bool>,
    /// See `members`.
    pub samples: Vec<u32>,
    /// |g_r|² of each folded rank (None for the others), taken as it was folded.
    pub norms: Vec<Option<f64>>,
    /// The rank whose gradient the accumulator holds as it is (the first one, with
    /// coefficient 1: taken without a pass over it): its norm is the accumulator's, taken by
    /// whichever reads the accumulator next (a fold, or the update).
    pub as_is: Option<usize>,
}

impl Acc {
    /// True when some gradient has been folded.
    pub fn folded(&self) -> bool {
        self.values.is_some()
    }

    /// Records the norms of a fold of rank `r`.
    fn record(&mut self, r: usize, f: FoldNorms) {
        if let (Some(q), Some(sq)) = (self.as_is.take(), f.acc)
            && let Some(n) = self.norms.get_mut(q)
        {
            *n = Some(sq);
        }
        if let Some(n) = self.norms.get_mut(r) {
            *n = Some(f.src);
        }
    }

    /// |g_r|² of rank `r` once the update read the accumulator (`acc_sq`: its squared norm):
    /// for the rank held as it is, that one.
    pub fn norm_of(&self, r: usize, acc_sq: Option<f64>) -> Option<f64> {
        if self.as_is == Some(r) {
            return acc_sq;
        }
        self.norms.get(r).copied().flatten()
    }
}

/// Squared norms taken by a [`fold`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FoldNorms {
    /// |src|².
    pub src: f64,
    /// |acc|² before the fold, when asked for (and `acc` was not empty).
    pub acc: Option<f64>,
}

/// Values per block of [`fold`] (as in the fused update).
const BLOCK: usize = 2048;

/// Folds `src` with coefficient `c` into `acc` (`first`: `acc` is empty and becomes `c src`),
/// with the fused update's exact operations; returns |src|² (and, with `acc_norm`, |acc|²
/// before the fold), taken block by block while the block is in cache. With `check`, a
/// non-finite value of `src` (a shared-memory gradient written after its push was checked)
/// stops the fold: its index and value; `acc` must then be discarded.
pub fn fold(
    acc: &mut Vec<f32>,
    src: &[f32],
    c: f32,
    first: bool,
    check: bool,
    acc_norm: bool,
) -> Result<FoldNorms, (usize, f32)> {
    if first {
        acc.clear();
        acc.resize(src.len(), 0.0);
    }
    assert_eq!(acc.len(), src.len(), "fold: lengths differ");
    let acc_norm = acc_norm && !first;
    let (mut src_sq, mut acc_sq) = (0.0, 0.0);
    let mut at = 0;
    while at < src.len() {
        let end = (at + BLOCK).min(src.len());
        let (a, x) = (&mut acc[at..end], &src[at..end]);
        if acc_norm {
            acc_sq += sum_of_squares(a);
        }
        match (first, c == 1.0) {
            (true, true) => a.copy_from_slice(x),
            (true, false) => a.iter_mut().zip(x).for_each(|(a, &x)| *a = c * x),
            (false, true) => a.iter_mut().zip(x).for_each(|(a, &x)| *a += x),
            (false, false) => a.iter_mut().zip(x).for_each(|(a, &x)| *a += c * x),
        }
        // Σ x² in f64 of at most BLOCK f32 values is finite exactly when every value is
        let block_sq = sum_of_squares(x);
        if check
            && !block_sq.is_finite()
            && let Some(i) = x.iter().position(|v| !v.is_finite())
        {
            return Err((at + i, x[i]));
        }
        src_sq += block_sq;
        at = end;
    }
    Ok(FoldNorms {
        src: src_sq,
        acc: acc_norm.then_some(acc_sq),
    })
}

/// Scales `values` in place by `c` (`values` becomes `c values` exactly as [`fold`] would
/// write it into an empty accumulator); returns |values|² before scaling, taken in the same
/// pass, or None for `c == 1` (nothing to do, and no pass over the values).
pub fn scale_in_place(values: &mut [f32], c: f32) -> Option<f64> {
    if c == 1.0 {
        return None;
    }
    let mut sq = 0.0;
    for block in values.chunks_mut(BLOCK) {
        sq += sum_of_squares(block);
        block.iter_mut().for_each(|v| *v *= c);
    }
    Some(sq)
}

impl Shard {
    /// A gradient buffer to receive a push into: a recycled one when available, else an
    /// empty one (its memory is reserved as the data arrives).
    pub fn take_buffer(&self) -> Vec<f32> {
        self.lock().spare.pop().unwrap_or_default()
    }

    /// Returns a buffer (of a refused push, or of an applied step) to the pool, which keeps at
    /// most `max_pending_gradients + 1` (the excess is freed).
    pub fn return_buffer(&self, buf: Vec<f32>) {
        let mut st = self.lock();
        if st.spare.len() <= self.gate.limit() && buf.capacity() >= self.len() {
            st.spare.push(buf);
        }
    }

    /// `rank`'s gradient whose values lie in place in `src` (a shared-memory gradient board's
    /// range), taken whole: its values checked (finite) and fingerprinted like a received
    /// one, in one pass. Refused when a value is not finite, or when the memory faulted under
    /// the pass (a truncated board, read as zeros).
    pub fn check_in_place(&self, rank: u32, src: Arc<dyn PushSource>) -> PsResult<(Grad, u64)> {
        let fp = ps_net::wire::check_and_fingerprint(src.values())?;
        if let Some(fault) = src.fault() {
            return Err(fault.refused(rank));
        }
        Ok((Grad::InPlace(src), fp))
    }

    /// gRPC gradient buffers held now (receiving, or received and not yet folded).
    pub fn buffers_held(&self) -> usize {
        self.gate.held()
    }

    /// Records that a push of `rank` for `step` (checked by [`Shard::precheck`]) is under way,
    /// announcing `samples`: the rank is not missing while the returned guard lives.
    pub fn announce(self: &Arc<Self>, rank: u32, step: u64, samples: u32) -> Announced {
        let recorded = {
            let mut st = self.lock();
            st.barrier
                .rank(rank)
                .is_ok_and(|r| st.barrier.announce(r, step, samples))
        };
        Announced {
            shard: self.clone(),
            rank,
            step,
            recorded,
        }
    }

    /// A permit to hold a buffer for a push of `rank` for `step` when one is free now (as
    /// [`Gate::try_grant`]: never the last one the awaited rank needs), without waiting: for a
    /// push checked, not kept, whose pieces came out of order (its fingerprint needs them in
    /// order).
    pub fn try_permit(&self, rank: u32, step: u64) -> Option<Permit> {
        let st = self.lock();
        self.gate
            .try_grant(rank, step, st.barrier.step(), st.barrier.awaited())
    }

    /// Waits for the turn of a push of `rank` for `step`: `Some(permit)` to receive a gradient
    /// the step needs into a buffer, `None` to check one that will not be kept as it streams
    /// in. Until then the push's stream is not read (it waits under flow control).
    pub async fn wait_turn(&self, rank: u32, step: u64) -> PsResult<Option<Permit>> {
        let mut logged = false;
        loop {
            let notified = self.gate.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                let r = st.barrier.rank(rank)?;
                self.refuse_if_failed(&mut st, r)?;
                if !st.barrier.needs_buffer(r, step) {
                    return Ok(None);
                }
                let awaited = st.barrier.awaited();
                if let Some(p) = self.gate.try_grant(rank, step, st.barrier.step(), awaited) {
                    return Ok(Some(p));
                }
                if !logged {
                    tracing::debug!(
                        "shard {}: rank {rank}'s push of step {step} waits for its turn (awaiting rank {awaited:?}, {} of {} buffers held)",
                        self.index,
                        self.gate.held(),
                        self.gate.limit()
                    );
                    logged = true;
                }
            }
            notified.await;
        }
    }

    /// Wakes the pushes waiting for their turn (something they depend on changed).
    pub(super) fn wake(&self) {
        self.gate.changed.notify_waiters();
    }

    /// Folds the step's gradients into its accumulator in rank order, as far as they are in
    /// (never the last rank the step needs: the update reads that one directly). Blocking:
    /// call it from a blocking thread. A shared-memory gradient found not finite fails the run.
    pub fn fold_ready(&self) -> PsResult<()> {
        if !self.buckets.is_empty() || self.exact.is_some() {
            // every rank has a buffer: the update (per bucket, or the exact sum) reads them
            // where they are
            return Ok(());
        }
        let mut acc = self.acc.lock().unwrap_or_else(|p| p.into_inner());
        while let Some((r, grad, c, first)) = self.next_to_fold(&mut acc) {
            if let Err(why) = self.fold_one(&mut acc, r, grad, c, first) {
                let why = why.to_string();
                tracing::error!("shard {}: {why}", self.index);
                acc.values = None;
                self.fail(why.clone());
                return Err(PsError::RunFailed(why));
            }
            acc.next = r + 1;
            self.wake();
        }
        Ok(())
    }

    /// The next gradient to fold, taken out of the barrier under the state lock: (its rank,
    /// the gradient, its coefficient, whether it is the first folded). The accumulator is
    /// reset for a new step, and its coefficients fixed once the barrier's members are. None
    /// when nothing is to be folded now (the run failed, the update runs, the next rank is not
    /// in yet, or it is the last the step needs).
    fn next_to_fold(&self, acc: &mut Acc) -> Option<(usize, Grad, f32, bool)> {
        let mut st = self.lock();
        if st.failed.is_some() || st.barrier.applying() {
            return None;
        }
        let step = st.barrier.step();
        if acc.step != step || (acc.coeffs.is_empty() && acc.folded()) {
            if let Some(v) = acc.values.take() {
                st.spare.push(v);
            }
            *acc = Acc {
                step,
                ..Acc::default()
            };
        }
        if acc.coeffs.is_empty() {
            let (members, samples) = st.barrier.freeze_if_ready()?;
            acc.coeffs = self.member_coeffs(members, samples);
            acc.norms = vec![None; self.world];
            acc.members = members.clone();
            acc.samples = samples.clone();
        }
        while acc.next < self.world && !acc.members[acc.next] {
            acc.next += 1;
        }
        let r = acc.next;
        let last = (r + 1..self.world).all(|q| !acc.members[q]);
        if r >= self.world || last {
            return None;
        }
        let grad = st.barrier.take_for_fold(r)?;
        Some((r, grad, acc.coeffs[r], !acc.folded()))
    }

    /// Folds rank `r`'s gradient into the accumulator with coefficient `c` (`first`: the
    /// accumulator is empty), its squared norm taken in the same pass; why the run stops when
    /// a shared-memory gradient is not finite or its board was truncated under the fold.
    fn fold_one(
        &self,
        acc: &mut Acc,
        r: usize,
        grad: Grad,
        c: f32,
        first: bool,
    ) -> Result<(), StepError> {
        let in_place = match &grad {
            Grad::InPlace(src) => Some(src.clone()),
            _ => None,
        };
        // the squared norm of the gradient, taken in the pass that folds it
        let acc_norm = acc.as_is.is_some();
        let folded = match grad {
            Grad::Owned(mut held) if first => {
                match scale_in_place(&mut held.values, c) {
                    Some(sq) => acc.norms[r] = Some(sq),
                    // kept as it is: its norm is the accumulator's, taken when it is next
                    // read (the next fold, or the update)
                    None => acc.as_is = Some(r),
                }
                acc.values = Some(std::mem::take(&mut held.values));
                Ok(())
            }
            Grad::Owned(held) => {
                let out = fold(
                    acc.values.as_mut().expect("folded before"),
                    &held.values,
                    c,
                    false,
                    false,
                    acc_norm,
                );
                self.return_buffer(held.values);
                out.map(|f| acc.record(r, f))
            }
            Grad::InPlace(src) => {
                let mut values = acc.values.take().unwrap_or_else(|| self.take_buffer());
                // read in place: a writer breaking its plane's protocol only changes the
                // values, checked here
                let out = fold(&mut values, src.values(), c, first, true, acc_norm);
                acc.values = Some(values);
                out.map(|f| acc.record(r, f))
            }
            Grad::Folded | Grad::Checked | Grad::Received(_) => Ok(()),
        };
        let step = acc.step;
        // memory that faulted under the fold (a truncated board, read as zeros): not its values
        if in_place.is_some_and(|src| src.fault().is_some()) {
            return Err(StepError::BoardTruncated {
                step,
                rank: r as u32,
            });
        }
        folded.map_err(|(index, value)| StepError::NonFinite {
            step,
            rank: r as u32,
            value,
            index,
            shard: self.index,
        })
    }

    /// The coefficient of the accumulator in an update of `slots`: 1 when they are the ranks
    /// its coefficients were fixed for (always, but for a step the barrier policy went on
    /// without some of them: then the folded sum is rescaled to the coefficients of the ranks
    /// that are in, close to but not bit-identical with aggregating them afresh).
    pub(super) fn rescale(&self, acc: &Acc, slots: &[Slot]) -> f32 {
        let same = slots.len() == acc.members.iter().filter(|&&m| m).count()
            && slots
                .iter()
                .all(|s| acc.members[s.rank as usize] && acc.samples[s.rank as usize] == s.samples);
        if same {
            return 1.0;
        }
        let n_was = acc.members.iter().filter(|&&m| m).count() as f64;
        let t_was: u64 = (0..self.world)
            .filter(|&r| acc.members[r])
            .map(|r| u64::from(acc.samples[r]))
            .sum();
        let t_now: u64 = slots.iter().map(|s| u64::from(s.samples)).sum();
        let f = match self.aggregation {
            Aggregation::Sum => 1.0,
            Aggregation::Mean => n_was / slots.len().max(1) as f64,
            Aggregation::Weighted if t_now == 0 => 0.0,
            Aggregation::Weighted => t_was as f64 / t_now as f64,
        };
        tracing::warn!(
            "shard {}: step {} goes on with {} of the {} ranks its aggregation started with: the sum folded so far is rescaled by {f}",
            self.index,
            acc.step,
            slots.len(),
            n_was
        );
        f as f32
    }

    /// The coefficient of each rank (0 for ranks not in `members`).
    fn member_coeffs(&self, members: &[bool], samples: &[u32]) -> Vec<f32> {
        let ranks: Vec<usize> = (0..self.world).filter(|&r| members[r]).collect();
        let s: Vec<u32> = ranks.iter().map(|&r| samples[r]).collect();
        let c = update::coefficients(self.aggregation, &s);
        let mut out = vec![0.0; self.world];
        for (&r, c) in ranks.iter().zip(c) {
            out[r] = c;
        }
        out
    }
}

/// A push under way ([`Shard::announce`]); withdrawn when dropped.
#[derive(Debug)]
pub struct Announced {
    shard: Arc<Shard>,
    rank: u32,
    step: u64,
    recorded: bool,
}

impl Drop for Announced {
    fn drop(&mut self) {
        if self.recorded {
            let mut st = self.shard.lock();
            if let Ok(r) = st.barrier.rank(self.rank) {
                st.barrier.withdraw(r, self.step);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::update::{self, Simd, UpdateInputs, fused_update};
    use ps_config::Aggregation;
    use ps_optim::Optimizer;

    fn grads(len: usize, w: usize) -> Vec<Vec<f32>> {
        (0..w)
            .map(|r| {
                (0..len)
                    .map(|i| (((i * 13 + r * 7) % 29) as f32 - 14.0) * 1e-3 * (r + 1) as f32 / 3.0)
                    .collect()
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Folding a prefix then updating with [accumulator, rest] gives the bits of updating
    /// with every gradient, for every split point, aggregation and instruction set.
    #[test]
    fn folding_then_updating_equals_updating_with_every_gradient() {
        let len = 3 * BLOCK + 77;
        let w = 6;
        let g = grads(len, w);
        let current: Vec<f32> = (0..len).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
        let opt = Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        };
        for agg in [Aggregation::Sum, Aggregation::Mean, Aggregation::Weighted] {
            let samples: Vec<u32> = (0..w as u32).map(|r| 3 + 2 * r).collect();
            let coeffs = update::coefficients(agg, &samples);
            let run = |gs: &[&[f32]], cs: &[f32], checked: usize, simd: Simd| {
                let mut st = opt.init_state(len);
                let mut next = vec![0f32; len];
                let sq = fused_update(
                    UpdateInputs {
                        optimizer: &opt,
                        step: opt.coeffs(0, 0.05),
                        current: &current,
                        grads: gs,
                        coeffs: cs,
                        threads: 2,
                        simd,
                        checked,
                        state_from: None,
                    },
                    &mut next,
                    &mut st.m,
                    &mut st.v,
                )
                .unwrap();
                (bits(&next), bits(&st.m), sq.aggregate.to_bits())
            };
            let all: Vec<&[f32]> = g.iter().map(Vec::as_slice).collect();
            let reference = run(&all, &coeffs, 0, Simd::Portable);
            for split in 1..w {
                let mut acc = Vec::new();
                for r in 0..split {
                    fold(&mut acc, &g[r], coeffs[r], r == 0, false, false).unwrap();
                }
                let mut gs: Vec<&[f32]> = vec![&acc];
                gs.extend(all[split..].iter().copied());
                let mut cs = vec![1.0];
                cs.extend(&coeffs[split..]);
                for simd in [Simd::Portable, Simd::Auto] {
                    assert_eq!(
                        run(&gs, &cs, 1, simd),
                        reference,
                        "{agg:?}, {split} folded, {simd:?}"
                    );
                }
                // the first rank scaled in place equals folding it into an empty accumulator
                let mut own = g[0].clone();
                let _ = scale_in_place(&mut own, coeffs[0]);
                let mut acc0 = Vec::new();
                fold(&mut acc0, &g[0], coeffs[0], true, false, false).unwrap();
                assert_eq!(bits(&own), bits(&acc0));
            }
        }
    }

    /// The per-rank squared norms taken by the folds (the first gradient scaled in place, or
    /// kept as it is and measured at the next fold) equal those the fused update takes of the
    /// same gradients, for every split point, aggregation and thread count, and the exact f64
    /// sums (to 1e-12 relative: only the order of the additions differs).
    #[test]
    fn per_rank_norms_from_the_folds_equal_the_updates() {
        let len = 3 * BLOCK + 77;
        let w = 5;
        let g = grads(len, w);
        let exact: Vec<f64> = g
            .iter()
            .map(|v| v.iter().map(|&x| f64::from(x) * f64::from(x)).sum())
            .collect();
        let current = vec![0.25f32; len];
        let opt = Optimizer::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let close = |a: f64, b: f64, what: &str| {
            assert!((a - b).abs() <= 1e-12 * b, "{what}: {a} vs {b}");
        };
        for agg in [Aggregation::Sum, Aggregation::Mean, Aggregation::Weighted] {
            let samples: Vec<u32> = (0..w as u32).map(|r| 2 + r).collect();
            let coeffs = update::coefficients(agg, &samples);
            let update = |gs: &[&[f32]], cs: &[f32], threads: usize| {
                let mut next = vec![0f32; len];
                fused_update(
                    UpdateInputs {
                        optimizer: &opt,
                        step: opt.coeffs(0, 0.05),
                        current: &current,
                        grads: gs,
                        coeffs: cs,
                        threads,
                        simd: Simd::Auto,
                        checked: 1,
                        state_from: None,
                    },
                    &mut next,
                    &mut [],
                    &mut [],
                )
                .unwrap()
                .inputs
            };
            let all: Vec<&[f32]> = g.iter().map(Vec::as_slice).collect();
            for threads in [1, 3] {
                let from_update = update(&all, &coeffs, threads);
                for r in 0..w {
                    close(
                        from_update[r],
                        exact[r],
                        &format!("{agg:?} update rank {r}"),
                    );
                }
            }
            for split in 1..w {
                // the shard's way: the first gRPC gradient scaled in place (or kept as it is)
                let mut a = Acc {
                    norms: vec![None; w],
                    ..Acc::default()
                };
                let mut values = g[0].clone();
                match scale_in_place(&mut values, coeffs[0]) {
                    Some(sq) => a.norms[0] = Some(sq),
                    None => a.as_is = Some(0),
                }
                for r in 1..split {
                    let f = fold(
                        &mut values,
                        &g[r],
                        coeffs[r],
                        false,
                        true,
                        a.as_is.is_some(),
                    );
                    a.record(r, f.unwrap());
                }
                let mut gs: Vec<&[f32]> = vec![&values];
                gs.extend(all[split..].iter().copied());
                let mut cs = vec![1.0];
                cs.extend(&coeffs[split..]);
                let inputs = update(&gs, &cs, 2);
                for (r, &want) in exact.iter().enumerate().take(split) {
                    let got = a.norm_of(r, Some(inputs[0])).expect("known");
                    close(got, want, &format!("{agg:?} split {split} folded rank {r}"));
                }
                for (r, &want) in exact.iter().enumerate().skip(split) {
                    close(
                        inputs[1 + r - split],
                        want,
                        &format!("{agg:?} split {split} updated rank {r}"),
                    );
                }
                assert_eq!(
                    a.as_is.is_some(),
                    agg == Aggregation::Sum && split == 1,
                    "kept as it is only until the next fold"
                );
            }
        }
    }

    #[test]
    fn a_non_finite_checked_source_is_named() {
        let mut src = vec![1.0f32; 5000];
        src[4321] = f32::NAN;
        let mut acc = vec![0.0; 5000];
        let e = fold(&mut acc, &src, 0.5, false, true, false).unwrap_err();
        assert_eq!(e.0, 4321);
        assert!(e.1.is_nan());
    }

    #[test]
    fn the_awaited_rank_always_finds_a_permit() {
        let gate = Gate::new(2);
        // rank 5 (not awaited) may take one while one stays for the awaited rank 0
        let p5 = gate
            .try_grant(5, 0, 0, Some(0))
            .expect("one is free beside the reserve");
        assert!(
            gate.try_grant(6, 0, 0, Some(0)).is_none(),
            "the last one is the awaited rank's"
        );
        let p0 = gate.try_grant(0, 0, 0, Some(0)).expect("the awaited rank");
        assert_eq!(gate.held(), 2);
        assert!(gate.try_grant(0, 0, 0, Some(0)).is_none(), "none left");
        drop(p5);
        // the awaited rank holds one: the free one may go to anybody
        let p6 = gate.try_grant(6, 0, 0, Some(0)).unwrap();
        drop((p0, p6));
        assert_eq!(gate.held(), 0);
        let one = Gate::new(1);
        assert!(
            one.try_grant(3, 0, 0, Some(0)).is_none(),
            "limit 1: only the awaited"
        );
        assert!(one.try_grant(0, 0, 0, Some(0)).is_some());
    }
}
