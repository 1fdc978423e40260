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
//! - `buffers`: the model's buffers (shard 0 of a declared model with buffers): rank 0 puts
//!   them after the forward pass of step t ([`Shard::put_buffers`]), they become the buffers
//!   of version t + 1 when the step is applied ([`Shard::buffers`]), and are checkpointed
//!   with it;
//! - `failure`: a failed run, refused with its reason, and which ranks have been told;
//! - `saving`: the checkpoints of step boundaries, periodic and on preemption;
//! - [`step`]: what a push carries and a completed step yields, and the traits the process
//!   implements ([`StepObserver`], [`NormExchange`]);
//! - [`shm`]: the shard's side of the shared-memory data path (boards, [`Shard::offer_shm`],
//!   [`Shard::shm_grad`]);
//! - [`checkpoint`]: the checkpoint files (format, checksum, plan, retries, recovery's reads).
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
//! Locking: four std mutexes on [`Shard`], none held across an `.await`, taken in this order
//! only (a lock is never taken while a later one in the order is held):
//!
//! 1. `acc`, the step's running aggregate ([`intake::Acc`]): held during a fold, and by the
//!    completion's update, so each waits for the other;
//! 2. `work`, the step's tentative per-bucket work ([`bucket::Work`]): held during a bucket
//!    update's arithmetic, so the completion waits for it;
//! 3. `preempt_closed` (`saving`): held while a preemption checkpoint is written;
//! 4. `state` (`State`: the barrier, the parameter store, the optimizer state, the
//!    failure, the buffers): held for bookkeeping only, never during the arithmetic; the
//!    barrier-completing push takes the slots out, computes on a blocking thread, and commits
//!    the new version under it.

pub mod barrier;
pub mod bucket;
mod buffers;
mod build;
pub mod constants;
mod failure;
pub mod intake;
mod saving;
pub mod shm;
pub mod step;
pub mod store;
pub mod unused;
pub mod update;

pub mod checkpoint;
use barrier::{Accepted, Barrier, Verdict};
use bytes::Bytes;
pub use intake::Announced;
use intake::{Acc, Gate, Held};
use ps_config::Aggregation;
use ps_net::shm::Board;
use ps_optim::{LrSchedule, OptState, Optimizer};
use ps_proto::{PsError, PsResult};
use shm::ShmHost;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
pub use step::{NormExchange, PushMeta, PushOutcome, RankNorm, StepFigures, StepObserver};
use store::{Previous, Source, Store};
use tokio::sync::watch;
use update::{Simd, UpdateInputs, fused_update, threads_for};

/// Where a rank's gradient slice for the current step lies.
#[derive(Debug)]
pub enum Grad {
    /// Received through gRPC into a shard buffer (with the permit to hold it).
    Owned(Held),
    /// In the shard's range of the rank's shared-memory gradient board (checked in place at
    /// push time, and for finiteness again by the update that reads it).
    Board(Arc<Board>),
    /// Received into a buffer shared with the per-bucket applier ([`bucket`]).
    Received(bucket::Received),
    /// Already folded into the step's accumulator ([`intake::Acc`]).
    Folded,
    /// Received and checked (fingerprint, finiteness) without being kept: a push of a rank
    /// the step has already counted (a retry, a conflict) or no longer waits for.
    Checked,
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

/// What an update computed, for the completion to commit ([`Shard::apply`]).
#[derive(Debug)]
struct Applied {
    /// The aggregate's squared norm, or why the step is refused.
    result: Result<f64, String>,
    rank_sq: Vec<RankNorm>,
    /// The parts of the tensors no rank reached.
    skip: Vec<(u32, Range<usize>)>,
    clip: Option<(f32, f32)>,
    /// The new optimizer state (steps not yet counted; partly advanced on an error).
    opt: OptState,
    /// Buckets applied before the barrier completed, when applied per bucket.
    buckets: Option<u32>,
}

/// What the `state` lock guards (the last lock of the order in the crate's doc).
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
    ) -> Result<f32, String> {
        let mut none: Vec<u32> = skip.iter().map(|(t, _)| *t).collect();
        none.sort_unstable();
        let sq = ps_model::clip::partials(&self.spec, &self.range, g, &none);
        if self.num_shards == 1 {
            return Ok(ps_model::clip::total_norm(&sq));
        }
        let first = ps_model::clip::tensors_of(&self.spec, &self.range).start as u32;
        match self.exchange.get() {
            Some(e) => e.total_norm(self, step, first, sq),
            None => Err(format!(
                "shard {} of {} has no way to exchange gradient norms with the other shards",
                self.index, self.num_shards
            )),
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
        if len != self.len() as u64 {
            return Err(PsError::WrongLength {
                expected: self.len() as u64,
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

    /// Aggregates `slots` (rank order), applies the optimizer and publishes the next version.
    /// Runs the arithmetic without holding the lock; call it from a blocking thread. With
    /// per-bucket apply ([`bucket`]) the buckets applied while the pushes came in are kept
    /// when they are exactly this update's, and only the others are applied here.
    ///
    /// A gradient value that is not finite when the update reads it (only a shared-memory
    /// gradient can be: its worker wrote its board after the push was checked, against the
    /// protocol) stops the update: nothing is published, the current version stays as it was,
    /// and the run fails with [`PsError::Unavailable`] naming the rank, the step and the
    /// value. The rank's push was already acknowledged, so it would never send a correct one;
    /// going on without it would silently change the run. The optimizer state in memory may
    /// be partly advanced, but a failed run never uses or saves it.
    #[allow(clippy::too_many_lines)] // split by its owner's work in progress (issue 39)
    pub fn apply(&self, slots: Vec<Slot>) -> PsResult<StepFigures> {
        let started = Instant::now();
        // waits for a fold under way, and for a bucket update under way, to finish
        let mut acc = self.acc.lock().unwrap_or_else(|p| p.into_inner());
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        let (step, tentative, pending, mut current_opt, waiting_since) = {
            let mut st = self.lock();
            let step = st.barrier.step();
            let (tentative, begun) = self.take_work(&mut st, &mut work, step, &slots);
            let pending = match (&tentative, begun) {
                (Some(_), _) => None,
                (None, Some(update)) => Some(update),
                (None, None) => Some(st.store.begin(step + 1)),
            };
            let opt = Some(std::mem::take(&mut st.opt));
            (step, tentative, pending, opt, st.barrier.waiting_since())
        };
        let samples: Vec<u32> = slots.iter().map(|s| s.samples).collect();
        let lr = self.schedule.lr(step);
        let (mut pending, by_buckets) = match tentative.map(|t| self.finish_buckets(&mut work, t)) {
            Some(Ok(done)) => (
                done.pending,
                Some((done.opt, done.old, done.norms, done.skip, done.early)),
            ),
            Some(Err(update)) => (update, None),
            None => (pending.expect("begun"), None),
        };
        let (applied, old_opt) = match by_buckets {
            Some((opt, old, norms, skip, early)) => {
                let rank_sq = slots
                    .iter()
                    .zip(&norms.inputs)
                    .map(|(s, &sq_norm)| RankNorm {
                        rank: s.rank,
                        samples: s.samples,
                        sq_norm,
                    })
                    .collect();
                let applied = Applied {
                    result: Ok(norms.aggregate),
                    rank_sq,
                    skip: unused::local_parts(&self.spec, &self.range, &skip),
                    clip: None,
                    opt,
                    buckets: Some(early),
                };
                (applied, Some(old))
            }
            None => {
                // the only holder now (a bucket update's clone went with its work): no copy
                let opt = Arc::unwrap_or_clone(current_opt.take().expect("taken once"));
                (
                    self.whole_range(step, &slots, &acc, &mut pending, opt, lr),
                    None,
                )
            }
        };
        let Applied {
            result,
            rank_sq,
            skip,
            clip,
            mut opt,
            buckets,
        } = applied;
        let grad_sq_norm = match result {
            Ok(sq) => sq,
            Err(why) => {
                tracing::error!("shard {}: {why}", self.index);
                {
                    let mut st = self.lock();
                    st.store.abandon(pending);
                    st.opt = Arc::new(opt);
                    st.failed = Some(why.clone());
                }
                self.wake();
                self.version_tx.send_modify(|_| {});
                return Err(PsError::RunFailed(why));
            }
        };
        opt.steps += 1;

        let first = slots
            .iter()
            .map(|s| s.arrived)
            .min()
            .expect("at least one rank");
        let (last_rank, last) = slots
            .iter()
            .map(|s| (s.rank, s.arrived))
            .max_by_key(|&(_, t)| t)
            .expect("at least one rank");
        let now = Instant::now();
        let figures = StepFigures {
            step,
            grad_sq_norm,
            lr,
            samples: samples.iter().map(|&s| u64::from(s)).sum(),
            loss_sum: slots.iter().map(|s| s.loss_sum).sum(),
            correct: slots.iter().map(|s| s.correct).sum(),
            workers_in: slots.len() as u32,
            step_ms: ms(now - waiting_since),
            barrier_wait_ms: ms(last - first),
            slowest_rank: last_rank,
            arrival_lag_ms: slots
                .iter()
                .map(|s| (s.rank, ms(s.arrived - first)))
                .collect(),
            apply_ms: ms(now - started),
            tail_ms: ms(now.saturating_duration_since(last)),
            eval: slots.iter().fold((0u64, 0u64), |a, s| {
                (a.0.saturating_add(s.eval.0), a.1.saturating_add(s.eval.1))
            }),
            ranks: rank_sq,
            clip,
            buckets: buckets.map(|early| (early, self.buckets.len() as u32)),
        };
        {
            let mut st = self.lock();
            st.store.commit(pending);
            if !skip.is_empty() && opt.skipped.len() < self.spec.tensors.len() {
                opt.skipped.resize(self.spec.tensors.len(), 0);
            }
            for (t, _) in &skip {
                opt.skipped[*t as usize] += 1;
            }
            st.opt = Arc::new(opt);
            // rank 0's buffers of the step are those of the new version (a step settled
            // without rank 0 keeps the buffers it had)
            if let Some((s, b)) = st.next_buffers.take()
                && s == step
            {
                st.buffers = Some(b);
            }
            let done = slots.into_iter().filter_map(|s| match s.grad {
                Grad::Owned(h) => Some(h.values),
                Grad::Received(r) => bucket::RecvBuf::into_vec(r.buf),
                _ => None,
            });
            for v in done.chain(acc.values.take()) {
                if st.spare.len() <= self.gate.limit() {
                    st.spare.push(v);
                }
            }
            *acc = Acc {
                step: step + 1,
                ..Acc::default()
            };
            st.barrier.finish(now);
        }
        drop(current_opt);
        if let Some(old) = old_opt {
            self.recycle_opt(&mut work, old);
        }
        drop(work);
        drop(acc);
        self.wake();
        self.version_tx.send_replace(step + 1);
        Ok(figures)
    }

    /// The whole-range update of `slots` (and of the accumulator, when gradients were folded)
    /// into `pending`, from optimizer state `opt`: the fused update over the range, tensors no
    /// rank reached kept as they were, those of parameter groups and Adam's tensors behind
    /// updated again on their own; with `[optimizer] clip_norm`, the aggregate first and its
    /// global norm. The result says why the step is refused, when it is.
    #[allow(clippy::too_many_lines)] // split by its owner's work in progress (issue 39)
    fn whole_range(
        &self,
        step: u64,
        slots: &[Slot],
        acc: &Acc,
        pending: &mut store::Update,
        mut opt: OptState,
        lr: f64,
    ) -> Applied {
        let samples: Vec<u32> = slots.iter().map(|s| s.samples).collect();
        let coeffs = update::coefficients(self.aggregation, &samples);
        // the gradients folded already are in the accumulator: it comes first (it holds the
        // lowest ranks), with coefficient 1, the others follow in rank order
        let folded = acc.step == step && acc.folded();
        let mut grads: Vec<&[f32]> = Vec::with_capacity(slots.len() + 1);
        let mut cs: Vec<f32> = Vec::with_capacity(slots.len() + 1);
        let mut ranks: Vec<u32> = Vec::with_capacity(slots.len() + 1);
        if folded {
            grads.push(acc.values.as_deref().expect("folded"));
            cs.push(self.rescale(acc, slots));
            ranks.push(slots.first().map_or(0, |s| s.rank));
        }
        for (s, &c) in slots.iter().zip(&coeffs) {
            match &s.grad {
                Grad::Owned(h) => grads.push(h.values.as_slice()),
                Grad::Received(r) => grads.push(r.values()),
                // SAFETY: the Arc keeps the board mapped. The worker writes its board again
                // only after pulling the version this update makes (ps_net::shm); one that
                // breaks this can only change the values read, which are checked for
                // finiteness right where they are used.
                Grad::Board(b) => grads.push(unsafe { &b.slot(0)[self.range.clone()] }),
                Grad::Folded | Grad::Checked => continue,
            }
            cs.push(c);
            ranks.push(s.rank);
        }
        // tensors no rank reached are not updated; Adam's bias correction of a tensor skipped
        // before counts its own steps ([`unused`]); a tensor of a parameter group is updated
        // with its group's settings: both are updated again on their own after the fused
        // update, from the state kept before it
        let (skip, reruns) = {
            let st = self.lock();
            let ranks: Vec<u32> = slots.iter().map(|s| s.rank).collect();
            let skip = st.unused.skipped_by_all(step, &ranks);
            let again: Vec<(u32, Option<usize>, u64)> = (0..self.spec.tensors.len() as u32)
                .filter_map(|t| match self.treatment(t, &skip, &opt) {
                    Some((group, own)) if group.is_some() || own != opt.steps => {
                        Some((t, group, own))
                    }
                    _ => None,
                })
                .collect();
            let tensors: Vec<u32> = again.iter().map(|a| a.0).collect();
            let reruns: Vec<(u64, Range<usize>, Option<usize>)> =
                unused::local_parts(&self.spec, &self.range, &tensors)
                    .into_iter()
                    .map(|(t, r)| {
                        let (_, group, own) = again[again.partition_point(|a| a.0 < t)];
                        (own, r, group)
                    })
                    .collect();
            (unused::local_parts(&self.spec, &self.range, &skip), reruns)
        };
        let kept: Vec<(Range<usize>, Vec<f32>, Vec<f32>)> = skip
            .iter()
            .map(|(_, r)| r.clone())
            .chain(reruns.iter().map(|(_, r, _)| r.clone()))
            .map(|r| {
                let m = opt.m.get(r.clone()).map_or_else(Vec::new, <[f32]>::to_vec);
                let v = opt.v.get(r.clone()).map_or_else(Vec::new, <[f32]>::to_vec);
                (r, m, v)
            })
            .collect();
        let (current, next) = pending.buffers();
        let aggregated = UpdateInputs {
            optimizer: &self.optimizer,
            step: self.optimizer.coeffs(opt.steps, lr as f32),
            current,
            grads: &grads,
            coeffs: &cs,
            threads: threads_for(current.len()),
            simd: Simd::Auto,
            checked: usize::from(folded),
            state_from: None,
        };
        // with [optimizer] clip_norm: the aggregate first, its global norm from every shard
        // (ps_model::clip), then the update of the aggregate scaled as torch's clip_grad_norm_
        let mut clipped = Vec::new();
        let mut clip = None;
        let mut exchange_failed = None;
        let before_clip = self.clip_norm.map(|max_norm| {
            clipped.resize(current.len(), 0.0);
            let norms = update::aggregate_only(aggregated, &mut clipped)?;
            match self.global_norm(step, &clipped, &skip) {
                Ok(total) => clip = Some((total, ps_model::clip::coefficient(max_norm, total))),
                Err(why) => exchange_failed = Some(why),
            }
            Ok(norms)
        });
        let clipped_grads: [&[f32]; 1] = [&clipped];
        let clip_coeffs = [clip.map_or(1.0, |(_, c)| c)];
        let inputs = if clip.is_some() {
            UpdateInputs {
                grads: &clipped_grads,
                coeffs: &clip_coeffs,
                checked: 1,
                ..aggregated
            }
        } else {
            aggregated
        };
        let mut updated = match before_clip {
            Some(Err(bad)) => Err(bad),
            // not applied: refused below
            _ if exchange_failed.is_some() => Ok(update::Norms {
                aggregate: 0.0,
                inputs: Vec::new(),
            }),
            // the norms logged are those before clipping (what clip_grad_norm_ returns)
            Some(Ok(norms)) => fused_update(inputs, next, &mut opt.m, &mut opt.v).map(|_| norms),
            None => fused_update(inputs, next, &mut opt.m, &mut opt.v),
        };
        if updated.is_ok() && exchange_failed.is_none() && !kept.is_empty() {
            for (r, m, v) in &kept {
                next[r.clone()].copy_from_slice(&current[r.clone()]);
                if !m.is_empty() {
                    opt.m[r.clone()].copy_from_slice(m);
                }
                if !v.is_empty() {
                    opt.v[r.clone()].copy_from_slice(v);
                }
            }
            for (steps_done, r, group) in &reruns {
                let (optimizer, lr) = self.optimizer_of(*group, lr);
                let part: Vec<&[f32]> = inputs.grads.iter().map(|g| &g[r.clone()]).collect();
                let inputs = UpdateInputs {
                    optimizer,
                    step: optimizer.coeffs(*steps_done, lr as f32),
                    current: &current[r.clone()],
                    grads: &part,
                    threads: 1,
                    ..inputs
                };
                let again = fused_update(
                    inputs,
                    &mut next[r.clone()],
                    block(&mut opt.m, r),
                    block(&mut opt.v, r),
                );
                if let Err(e) = again {
                    updated = Err(e);
                }
            }
        }
        let rank_sq = updated
            .as_ref()
            .ok()
            .and_then(|n| self.rank_norms(acc, folded, slots, &ranks, &n.inputs))
            .unwrap_or_default();
        // a board truncated under the update read as zeros (the SIGBUS guard): not its values
        let truncated = slots
            .iter()
            .find(|s| matches!(&s.grad, Grad::Board(b) if b.faulted()))
            .map(|s| s.rank);
        let result = match (updated, truncated) {
            _ if exchange_failed.is_some() => Err(format!(
                "step {step}: gradient clipping ([optimizer] clip_norm) needs the gradient norm of every shard: {}; the step is not applied (the shard stays at version {step}) and the run stops",
                exchange_failed.take().unwrap_or_default()
            )),
            (_, Some(rank)) => {
                if let Some(h) = &self.shm {
                    h.detach(rank as usize);
                }
                Err(board_truncated(step, rank))
            }
            _ if pending.faulted() => Err(format!(
                "step {step}: shard {}'s shared-memory parameters board was truncated during the update (another process shrank the file): the parameters are lost; the run stops",
                self.index
            )),
            (Err(bad), None) => Err(format!(
                "step {step}: rank {}'s gradient holds {} at index {} of shard {}'s range when the update reads it, although its push was checked: its shared-memory board was written after the push was accepted; the step is not applied (the shard stays at version {step}) and the run stops",
                ranks[bad.source], bad.value, bad.index, self.index
            )),
            (Ok(norms), None) => Ok(norms.aggregate),
        };
        Applied {
            result,
            rank_sq,
            skip,
            clip,
            opt,
            buckets: None,
        }
    }

    /// Completes a step whose barrier is complete (or given up on): applies `slots`
    /// ([`Shard::apply`]), hands the figures to `observer`, then writes a checkpoint when one
    /// is due ([`Shard::checkpoint_if_due`]) and tells `observer`. This is the whole sequence
    /// of a step's end; call it from a blocking thread, before the barrier-completing push is
    /// answered. An update that finds a non-finite gradient value fails the run, and so do
    /// `[checkpoint] max_failures` failed checkpoints in a row ([`PsError::RunFailed`]).
    pub fn complete(&self, slots: Vec<Slot>, observer: &dyn StepObserver) -> PsResult<()> {
        let figures = self.apply(slots)?;
        observer.step_done(figures);
        if let Some(attempted) = self.checkpoint_if_due() {
            observer.checkpointed(&attempted);
            if let Some(why) = attempted.fatal {
                return Err(PsError::RunFailed(why));
            }
        }
        Ok(())
    }

    /// Each slot's |g_r|² over this shard's range, in rank order: from the folds, and from the
    /// update (`inputs`: its inputs' norms, the accumulator first when `folded`; `input_ranks`:
    /// their ranks). None when one is not known.
    fn rank_norms(
        &self,
        acc: &Acc,
        folded: bool,
        slots: &[Slot],
        input_ranks: &[u32],
        inputs: &[f64],
    ) -> Option<Vec<RankNorm>> {
        let acc_sq = folded.then(|| inputs[0]);
        let direct = usize::from(folded);
        slots
            .iter()
            .map(|s| {
                let sq_norm = match s.grad {
                    Grad::Folded => acc.norm_of(s.rank as usize, acc_sq)?,
                    Grad::Owned(_) | Grad::Board(_) | Grad::Received(_) => {
                        let i = input_ranks[direct..].iter().position(|&r| r == s.rank)?;
                        inputs[direct + i]
                    }
                    Grad::Checked => return None,
                };
                Some(RankNorm {
                    rank: s.rank,
                    samples: s.samples,
                    sq_norm,
                })
            })
            .collect()
    }

    /// The current parameters as bytes for gRPC pulls, and their version: shared by every
    /// pull of the version (with a board, copied out of it at the version's first gRPC pull).
    pub fn snapshot(&self) -> PsResult<(u64, Bytes)> {
        let reuse = {
            let mut st = self.lock();
            if let Some(why) = &st.failed {
                return Err(PsError::RunFailed(why.clone()));
            }
            if let Some(snap) = st.store.snapshot(st.barrier.step()) {
                return Ok((st.barrier.step(), snap));
            }
            st.store.take_snapshot_buffer()
        };
        let (version, values) = self.params_into(reuse.unwrap_or_default())?;
        let values = Arc::new(values);
        let mut st = self.lock();
        if st.barrier.step() == version {
            return Ok((version, st.store.keep_snapshot(version, values)));
        }
        Ok((version, store::shared_bytes(values)))
    }

    /// The parameters of `version` when it is the one before the current version and this
    /// shard still holds it (the other half of its double buffer), for a restarted worker that
    /// redoes that step; [`PsError::VersionGone`] otherwise.
    pub fn previous(&self, version: u64) -> PsResult<(u64, Bytes)> {
        let gone = |current| PsError::VersionGone {
            asked: version,
            shard: self.index,
            current,
        };
        let st = self.lock();
        if version + 1 != st.barrier.step() || st.barrier.applying() {
            return Err(gone(st.barrier.step()));
        }
        match st.store.previous(self.len()) {
            Some(Previous::Bytes(b)) => Ok((version, b)),
            None => Err(gone(st.barrier.step())),
            Some(Previous::Board(b)) => {
                drop(st);
                match Source::Board(b).read(version) {
                    Some(values) => Ok((version, store::shared_bytes(Arc::new(values)))),
                    None => Err(gone(self.version())),
                }
            }
        }
    }

    /// The parameters of exactly `version`: the current one, or the one before while this
    /// shard still holds it ([`Shard::previous`]); an update that ends between the two looks
    /// is seen, since the current version it made is checked.
    pub fn exactly(&self, version: u64) -> PsResult<(u64, Bytes)> {
        if version < self.version() {
            return self.previous(version);
        }
        match self.snapshot()? {
            (v, snapshot) if v == version => Ok((v, snapshot)),
            _ => self.previous(version),
        }
    }

    /// A copy of the optimizer state of the current version (what a checkpoint saves).
    pub fn optimizer_state(&self) -> OptState {
        (*self.lock().opt).clone()
    }

    /// A copy of the current parameters and their version (final weights, gRPC pulls).
    pub fn params(&self) -> PsResult<(u64, Vec<f32>)> {
        self.params_into(Vec::new())
    }

    /// [`Shard::params`] copied into `values` (its allocation reused when it has the length).
    fn params_into(&self, mut values: Vec<f32>) -> PsResult<(u64, Vec<f32>)> {
        for _ in 0..100 {
            let (version, source) = {
                let st = self.lock();
                (st.barrier.step(), st.store.source())
            };
            // fails only if two updates completed during the copy: then copy the newer one
            if source.read_into(version, &mut values) {
                return Ok((version, values));
            }
        }
        Err(PsError::Unavailable(
            "the parameters kept changing while being copied".into(),
        ))
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

/// `v[r]`, or `v` itself when empty (an optimizer buffer the optimizer does not keep).
fn block<'a>(v: &'a mut [f32], r: &Range<usize>) -> &'a mut [f32] {
    if v.is_empty() { v } else { &mut v[r.clone()] }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Why a step stops when rank `rank`'s gradient board shrank while the shard read it.
fn board_truncated(step: u64, rank: u32) -> String {
    format!(
        "step {step}: rank {rank}'s shared-memory gradient board was truncated while the update read it (another process shrank the file, against the protocol): what was read is not its gradient; the step is not applied (the shard stays at version {step}) and the run stops"
    )
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
