//! The shard core: one shard of the model, with no gRPC in it (the handlers, the process and
//! the exchanges with other shards are `ps-server`'s; this crate compiles no tonic). A small
//! facade over parts with one job each:
//!
//! - [`barrier`]: which ranks take part, their gradient slots for the step being gathered,
//!   retries and conflicts, the timeout and its policy;
//! - [`store`]: the parameters of the current and previous versions (heap or shared-memory
//!   board), updated by begin / commit;
//! - [`intake`]: bounded receive buffers for gRPC gradients, and the step's accumulator that
//!   folds gradients in rank order as they arrive ([`Shard::fold_ready`]);
//! - [`update`]: the fused aggregation + optimizer update, a pure function over slices;
//! - [`bucket`]: per-bucket apply: each bucket of the range updated (tentatively, into the
//!   pending version) as soon as every rank's gradient for it is in, bit-identical to the
//!   whole-range update, which the barrier's completion falls back to when the work is not
//!   exactly its own;
//! - [`unused`]: the tensors a step's backward did not reach (not updated when no rank did);
//! - [`constants`]: the frozen parameters every worker must hold alike;
//! - the model's buffers (shard 0 of a declared model with buffers): rank 0 puts them after
//!   the forward pass of step t ([`Shard::put_buffers`]), they become the buffers of version
//!   t + 1 when the step is applied ([`Shard::buffers`]), and are checkpointed with it;
//! - [`shm`]: the shard's side of the shared-memory data path (boards, [`Shard::offer_shm`],
//!   [`Shard::shm_grad`], each push read through `ps_net::source`);
//! - [`checkpoint`]: the checkpoint files (format, checksum, plan, retries, recovery's reads).
//!
//! The shard's own methods are grouped by what they do, in private modules: `step` (the
//! step's types, re-exported here), `build` (a shard from the seed or a checkpoint), `apply`
//! (a step's end: take the work, update, commit or abandon), `whole` (the whole-range
//! update), `pull` (what pulls read), `saving` (checkpoints at step boundaries and
//! preemption), `buffers` (the model's buffers), `failure` (a failed run and who was told).
//!
//! With `[train] exact_sum` a push carries the rank's exact partial sum (`ps_net::exact`,
//! [`Shard::push_len`] values): nothing is folded or applied per bucket, the whole-range update
//! adds every rank's partial sum in integers, rounds once and applies the optimizer to that.
//!
//! The fold and the update also take each rank's squared gradient norm in the pass that reads
//! the gradient ([`StepFigures::ranks`]): shard 0 turns them into the gradient noise scale.
//!
//! The facade: [`Shard::register`], [`Shard::precheck`] and [`Shard::accept`] (push),
//! [`Shard::complete`] (a step whose barrier completed: apply -> figures -> checkpoint, the
//! figures handed to a [`StepObserver`]), [`Shard::snapshot`] / [`Shard::previous`] /
//! [`Shard::params`] (pull), [`Shard::poll_barrier`] (what the barrier policy says while a
//! step waits).
//!
//! The state and its four locks are documented on [`Shard`], where they live: the order in
//! which they are taken is fixed there.

pub mod barrier;
pub mod bucket;
pub mod constants;
pub mod intake;
pub mod norm;
pub mod shm;
pub mod store;
pub mod unused;
pub mod update;

pub mod checkpoint;

mod apply;
mod buffers;
mod build;
pub use build::StartError;
mod failure;
mod pull;
mod saving;
mod step;
mod whole;

use barrier::{Accepted, Barrier, Verdict};
use bytes::Bytes;
pub use intake::Announced;
use intake::{Acc, Gate};
pub use norm::NormError;
use ps_config::Aggregation;
use ps_optim::{LrSchedule, OptState, Optimizer};
use ps_proto::{PsError, PsResult};
use shm::ShmHost;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
pub(crate) use step::Applied;
pub use step::{
    Grad, NormExchange, PushMeta, PushOutcome, RankNorm, Slot, StepError, StepFigures, StepObserver,
};
use store::Store;
use tokio::sync::watch;
pub(crate) use whole::block;

/// What the `state` lock of [`Shard`] guards (taken last in the lock order): the barrier,
/// the parameters and the optimizer state of the current version, and the run's bookkeeping.
#[derive(Debug)]
struct State {
    /// The barrier; its step is the shard's version.
    barrier: Barrier,
    /// The parameters.
    store: Store,
    /// The optimizer state of the current version (shared with a bucket update reading it).
    opt: Arc<OptState>,
    /// The per-bucket tracking of the step being gathered ([`bucket`]).
    track: bucket::Track,
    /// Gradient buffers of earlier steps, recycled by pushes (no allocation per step).
    spare: Vec<Vec<f32>>,
    /// Final test evaluation reported by each rank when it leaves.
    left: Vec<Option<(u64, u64)>>,
    failed: Option<String>,
    /// Ranks that learned of the failure: a request of theirs was refused with it, or they left.
    told: Vec<bool>,
    /// Tensors the ranks' backward of the step being gathered did not reach.
    unused: unused::Unused,
    /// The first worker's frozen parameters and buffers (fingerprints).
    constants: constants::Constants,
    /// The model's buffers of the current version (shard 0 of a model with buffers).
    buffers: Option<Bytes>,
    /// Rank 0's buffers put for a step not yet applied: (step, buffers).
    next_buffers: Option<(u64, Bytes)>,
}

/// One shard of the model: its range of the flat vector, optimizer, schedule and barrier.
///
/// Locking: four std mutexes on [`Shard`], none held across an `.await`, taken in this order
/// only (a lock is never taken while a later one in the order is held):
///
/// 1. `acc`, the step's running aggregate ([`intake::Acc`]): held during a fold, and by the
///    completion's update, so each waits for the other;
/// 2. `work`, the step's tentative per-bucket work ([`bucket::Work`]): held during a bucket
///    update's arithmetic, so the completion waits for it;
/// 3. `preempt_closed`: held while a preemption checkpoint is written;
/// 4. `state` (`State`: the barrier, the parameter store, the optimizer state, the
///    failure, the buffers): held for bookkeeping only, never during the arithmetic; the
///    barrier-completing push takes the slots out, computes on a blocking thread, and commits
///    the new version under it.
#[derive(Debug)]
pub struct Shard {
    /// Shard index.
    pub index: usize,
    /// Its range of the flat parameter vector.
    pub range: Range<usize>,
    /// W.
    pub world: usize,
    /// Total parameter count of the model.
    pub num_params: usize,
    /// The model's tensors (names, shapes, flat order): a worker describing another is refused.
    pub spec: ps_model::layout::ModelSpec,
    /// Number of shards.
    pub num_shards: usize,
    /// Steps of the run.
    pub total_steps: u64,
    aggregation: Aggregation,
    /// `[train] exact_sum`: the micro-batch of a gradient term; pushes carry exact partial
    /// sums ([`ps_net::exact`], [`Shard::push_len`]) and the update adds them without rounding.
    exact: Option<usize>,
    optimizer: Optimizer,
    /// `[[optimizer.groups]]`, and the group of each tensor of the model (None: the
    /// `[optimizer]` settings).
    groups: Vec<ps_config::ParamGroup>,
    group_of: Vec<Option<usize>>,
    /// `[optimizer] clip_norm`.
    clip_norm: Option<f32>,
    /// With clipping over several shards: how the global norm is had ([`Shard::set_norm_exchange`]).
    exchange: std::sync::OnceLock<Arc<dyn NormExchange>>,
    schedule: LrSchedule,
    state: Mutex<State>,
    /// Permits to hold gRPC gradient buffers (`[server] max_pending_gradients`).
    gate: Arc<Gate>,
    /// The step's running aggregate; held during a fold, so an update waits for it.
    acc: Mutex<Acc>,
    /// Whether the shard applies per bucket, and why not.
    mode: bucket::Mode,
    /// The buckets of the range ([`bucket::plan`]); empty when applying the whole range.
    buckets: Vec<bucket::Bucket>,
    /// The step's tentative per-bucket work; held during a bucket update (taken before the
    /// state lock, never after).
    work: Mutex<bucket::Work>,
    version_tx: watch::Sender<u64>,
    /// Signalled when a rank learns of the run's failure ([`Shard::wait_all_told`]).
    told_changed: tokio::sync::Notify,
    shm: Option<ShmHost>,
    checkpoint: Option<checkpoint::Plan>,
    /// Preemption (SIGTERM, SIGUSR1): requested, and the plan its checkpoints follow.
    preempt: std::sync::atomic::AtomicBool,
    preempt_plan: checkpoint::Plan,
    /// The declared model, on the shard that holds its buffers (shard 0, when it has any).
    buffer_model: Option<ps_model::declared::Declared>,
    /// The newest version of which a preemption checkpoint was written (None: none yet).
    preempt_saved: watch::Sender<Option<u64>>,
    /// Held while a preemption checkpoint is written; true once the shard said which version
    /// it stopped at ([`Shard::close_preempt`]): no newer one is written after that.
    preempt_closed: std::sync::Mutex<bool>,
}

impl Shard {
    /// How this shard exchanges gradient norms with the others for clipping (set once, before
    /// the first step; a shard of several with clipping and none fails its first step).
    pub fn set_norm_exchange(&self, exchange: Arc<dyn NormExchange>) {
        let _ = self.exchange.set(exchange);
    }

    /// The global norm of `step`'s aggregated gradient, of which `g` is this shard's range:
    /// torch's clip_grad_norm_ total over every tensor a rank's backward reached (`skip`: the
    /// parts of those it did not, which count 0).
    fn global_norm(
        &self,
        step: u64,
        g: &[f32],
        skip: &[(u32, Range<usize>)],
    ) -> Result<f32, NormError> {
        let mut none: Vec<u32> = skip.iter().map(|(t, _)| *t).collect();
        none.sort_unstable();
        let sq = ps_model::clip::partials(&self.spec, &self.range, g, &none);
        if self.num_shards == 1 {
            return Ok(ps_model::clip::total_norm(&sq));
        }
        let first = ps_model::clip::tensors_of(&self.spec, &self.range).start as u32;
        match self.exchange.get() {
            Some(e) => e.total_norm(self, step, first, sq),
            None => Err(NormError::NoExchange {
                shard: self.index,
                shards: self.num_shards,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // a panic while holding the lock would be a bug; keep serving with the data as it is
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Length of the shard's slice.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Values of a push: the slice's length, or, with `exact_sum`, [`ps_net::exact::LIMBS`]
    /// times it (an encoded partial sum).
    pub fn push_len(&self) -> usize {
        self.push_range().len()
    }

    /// Where a push's values lie in a worker's gradient (its shared-memory board): the
    /// shard's range, or, with `exact_sum`, that of its encoded partial sum.
    pub fn push_range(&self) -> Range<usize> {
        match self.exact {
            Some(_) => {
                let l = ps_net::exact::LIMBS;
                l * self.range.start..l * self.range.end
            }
            None => self.range.clone(),
        }
    }

    /// Values of a worker's whole gradient as pushed (its shared-memory board): the model's
    /// parameters, or [`ps_net::exact::LIMBS`] times them with `exact_sum`.
    pub fn push_values(&self) -> usize {
        match self.exact {
            Some(_) => ps_net::exact::LIMBS * self.num_params,
            None => self.num_params,
        }
    }

    /// True for an empty shard (more shards than parameters).
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Current version.
    pub fn version(&self) -> u64 {
        *self.version_tx.borrow()
    }

    /// A receiver that sees every version bump.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version_tx.subscribe()
    }

    /// Records the tensors `rank`'s backward of `step` did not reach (sent before its push of
    /// the step). A mark of a step already applied changes nothing; one of a step the shard
    /// has not reached, or naming a tensor outside the model, is refused.
    pub fn mark_unused(&self, rank: u32, step: u64, tensors: Vec<u32>) -> PsResult<()> {
        let mut st = self.lock();
        let r = st.barrier.rank(rank)?;
        self.refuse_if_failed(&mut st, r)?;
        let at = st.barrier.step();
        if step > at {
            return Err(PsError::BadChunk(format!(
                "rank {rank} marked unused tensors of step {step}: the shard is at step {at}"
            )));
        }
        if step < at {
            return Ok(());
        }
        st.unused.mark(r, step, tensors)
    }

    /// Checks `rank`'s frozen parameters and buffers against the first worker's
    /// ([`constants`]).
    pub fn check_constants(
        &self,
        rank: u32,
        entries: Vec<ps_proto::pb::TensorPrint>,
    ) -> PsResult<()> {
        let mut st = self.lock();
        st.barrier.rank(rank)?;
        let version = st.barrier.step();
        st.constants.check(rank, entries, version)
    }

    /// [`PsError::UnknownRank`] unless `rank` is below the world size; changes nothing.
    pub fn check_rank(&self, rank: u32) -> PsResult<()> {
        self.lock().barrier.rank(rank).map(drop)
    }

    /// Records a worker's registration; returns the step it joins at (the current version, or
    /// the next one while an update runs: that step is settled without this rank, or with the
    /// gradient its predecessor pushed), and whether that step already counts a gradient of
    /// this rank (its predecessor pushed it and died): the worker then pulls exactly that
    /// version and does not push the step again, since the step may be applied at any moment.
    pub fn register(&self, rank: u32) -> PsResult<(u64, bool)> {
        let mut st = self.lock();
        let step = st.barrier.register(rank, Instant::now())?;
        Ok((step, st.barrier.counts(rank, step)))
    }

    /// Checks a push header before its data is received: rank, registration, length, and a
    /// step of the run that can still be accepted (the current one, or the previous one as a
    /// retry).
    pub fn precheck(&self, rank: u32, step: u64, len: u64) -> PsResult<()> {
        let mut st = self.lock();
        let r = st.barrier.rank(rank)?;
        self.refuse_if_failed(&mut st, r)?;
        if !st.barrier.registered(rank) {
            return Err(PsError::NotRegistered(rank));
        }
        if len != self.push_len() as u64 {
            return Err(PsError::WrongLength {
                expected: self.push_len() as u64,
                got: len,
            });
        }
        st.barrier.check(rank, step).map(drop)
    }

    /// Counts a complete, validated gradient. Returns the outcome and, when this push completed
    /// the barrier, the slots to aggregate (in rank order) with [`Shard::apply`].
    pub fn accept(
        &self,
        meta: PushMeta,
        grad: Grad,
        fingerprint: u64,
    ) -> PsResult<(PushOutcome, Option<Vec<Slot>>)> {
        let mut st = self.lock();
        let r = st.barrier.rank(meta.rank)?;
        self.refuse_if_failed(&mut st, r)?;
        let slot = Slot {
            rank: meta.rank,
            grad,
            fingerprint,
            samples: meta.samples,
            loss_sum: meta.loss_sum,
            correct: meta.correct,
            eval: meta.eval,
            arrived: Instant::now(),
        };
        let received = match &slot.grad {
            Grad::Received(r) => Some(r.buf.clone()),
            _ => None,
        };
        let accepted = st.barrier.accept(meta.step, slot)?;
        if let Some(buf) = received
            && accepted.counted()
        {
            Self::intake_counted(&mut st, r, meta.step, &buf);
        }
        drop(st);
        self.wake();
        let outcome = PushOutcome {
            counted: accepted.counted(),
            ranks_in: accepted.ranks_in(),
        };
        match accepted {
            Accepted::Complete { slots, .. } => Ok((outcome, Some(slots))),
            _ => Ok((outcome, None)),
        }
    }

    /// The barrier policy's verdict on the step being gathered at `now` ([`Verdict::Idle`]
    /// once the run failed). A [`Verdict::Continue`] carries slots for [`Shard::apply`].
    pub fn poll_barrier(&self, now: Instant) -> Verdict {
        let mut st = self.lock();
        if st.failed.is_some() {
            return Verdict::Idle;
        }
        st.barrier.poll(now)
    }

    /// Records that `rank` left with its final evaluation; returns true when every rank has.
    /// Figures whose sum with the other ranks' would not fit in a u64 are refused.
    pub fn leave(&self, rank: u32, eval: (u64, u64)) -> PsResult<bool> {
        let mut st = self.lock();
        let r = st.barrier.rank(rank)?;
        let others = st
            .left
            .iter()
            .enumerate()
            .filter(|&(q, _)| q != r)
            .filter_map(|(_, e)| *e);
        let mut sum = Some(eval);
        for e in others {
            sum = sum.and_then(|s| Some((s.0.checked_add(e.0)?, s.1.checked_add(e.1)?)));
        }
        if sum.is_none() {
            return Err(PsError::BadChunk(format!(
                "rank {rank} left with an evaluation of {}/{}: the sum over the ranks would overflow",
                eval.0, eval.1
            )));
        }
        st.left[r] = Some(eval);
        Ok(st.left.iter().all(Option::is_some))
    }

    /// Final evaluation summed over the ranks that left, and the ranks that did not.
    pub fn final_eval(&self) -> ((u64, u64), Vec<usize>) {
        let st = self.lock();
        let sum = st.left.iter().flatten().fold((0u64, 0u64), |a, e| {
            (a.0.saturating_add(e.0), a.1.saturating_add(e.1))
        });
        let missing = st
            .left
            .iter()
            .enumerate()
            .filter(|(_, e)| e.is_none())
            .map(|(r, _)| r)
            .collect();
        (sum, missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_config::{TestConfig, Transport};
    use std::path::Path;

    /// A `Leave` whose figures would overflow the sum over the ranks is refused, and changes
    /// nothing; the final sum never wraps.
    #[test]
    fn leave_figures_that_would_overflow_the_sum_are_refused() {
        let cfg = TestConfig::new()
            .shards(1)
            .workers(2)
            .hidden(&[4])
            .transport(Transport::Grpc)
            .build(Path::new("/tmp/leave-test.toml"))
            .unwrap();
        let shard = Shard::new(&cfg, 0, 10);
        assert!(!shard.leave(0, (u64::MAX - 5, u64::MAX - 1)).unwrap());
        let e = shard.leave(1, (3, 4)).unwrap_err();
        assert!(
            e.to_string().contains(
                "rank 1 left with an evaluation of 3/4: the sum over the ranks would overflow"
            ),
            "{e}"
        );
        assert_eq!(shard.final_eval(), ((u64::MAX - 5, u64::MAX - 1), vec![1]));
        // a rank leaving again replaces its own figures (not added to them)
        assert!(!shard.leave(0, (2, 5)).unwrap());
        assert!(shard.leave(1, (3, 4)).unwrap());
        assert_eq!(shard.final_eval(), ((5, 9), vec![]));
    }
}
