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
//!   [`Shard::shm_grad`]);
//! - [`checkpoint`]: the checkpoint files (format, checksum, plan, retries, recovery's reads).
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
//! Locking: four std mutexes on [`Shard`], none held across an `.await`, taken in this order
//! only (a lock is never taken while a later one in the order is held):
//!
//! 1. `acc`, the step's running aggregate ([`intake::Acc`]): held during a fold, and by the
//!    completion's update, so each waits for the other;
//! 2. `work`, the step's tentative per-bucket work ([`bucket::Work`]): held during a bucket
//!    update's arithmetic, so the completion waits for it;
//! 3. `preempt_closed`: held while a preemption checkpoint is written;
//! 4. `state` (`State`: the barrier, the parameter store, the optimizer state, the
//!    failure, the buffers): held for bookkeeping only, never during the arithmetic; the
//!    barrier-completing push takes the slots out, computes on a blocking thread, and commits
//!    the new version under it.

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
use barrier::{Accepted, Barrier, Rules, Verdict};
use bytes::Bytes;
use checkpoint::Saved;
pub use intake::Announced;
use intake::{Acc, Gate, Held};
pub use norm::NormError;
use ps_config::{Aggregation, Config, Transport};
use ps_net::shm::{Board, shm_root};
use ps_optim::{LrSchedule, OptState, Optimizer};
use ps_proto::{PsError, PsResult};
use shm::ShmHost;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
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
    /// Builds shard `index` of `cfg` for a run of `total_steps`, with initial weights from the
    /// seed (or, for a declared model, from its init file: see [`Shard::try_starting_from`]).
    pub fn new(cfg: &Config, index: usize, total_steps: u64) -> Arc<Self> {
        Self::starting_from(cfg, index, total_steps, None)
    }

    /// The range of the flat vector that shard `index` of `cfg` holds.
    pub fn range_of(cfg: &Config, index: usize) -> Range<usize> {
        ps_model::layout::shard_ranges(cfg.spec().num_params(), cfg.num_shards())[index].clone()
    }

    /// Like [`Shard::new`], but from `saved` (a checkpoint) when given: its version, parameters
    /// and optimizer state. A declared model's init file that cannot be read (it changed
    /// after the config was loaded) leaves NaN weights: use [`Shard::try_starting_from`].
    pub fn starting_from(
        cfg: &Config,
        index: usize,
        total_steps: u64,
        saved: Option<Saved>,
    ) -> Arc<Self> {
        let saved = saved.or_else(|| {
            let range = Self::range_of(cfg, index);
            let init = cfg
                .initial_range(range.clone())
                .unwrap_or_else(|_| vec![f32::NAN; range.len()]);
            let opt = cfg.optimizer.init_state(init.len());
            let buffers = Self::initial_buffers(cfg, index).ok().flatten();
            Some(Saved {
                version: 0,
                params: init,
                opt,
                buffers,
            })
        });
        Self::build(cfg, index, total_steps, saved.expect("filled in"))
    }

    /// [`Shard::starting_from`], with the error of an unreadable init file (declared models).
    pub fn try_starting_from(
        cfg: &Config,
        index: usize,
        total_steps: u64,
        saved: Option<Saved>,
    ) -> Result<Arc<Self>, String> {
        let saved = match saved {
            Some(s) => s,
            None => {
                let init = cfg.initial_range(Self::range_of(cfg, index))?;
                let opt = cfg.optimizer.init_state(init.len());
                Saved {
                    version: 0,
                    params: init,
                    opt,
                    buffers: Self::initial_buffers(cfg, index)?,
                }
            }
        };
        if saved.buffers.is_none() && Self::buffer_model(cfg, index).is_some() {
            return Err(format!(
                "the checkpoint of version {} holds no buffers, but the run's model has buffers ([model] init names them): a checkpoint of another model",
                saved.version
            ));
        }
        Ok(Self::build(cfg, index, total_steps, saved))
    }

    /// The declared model when shard `index` holds its buffers (shard 0, a model with buffers).
    fn buffer_model(cfg: &Config, index: usize) -> Option<ps_model::declared::Declared> {
        cfg.model
            .declared
            .as_ref()
            .filter(|d| index == 0 && !d.buffers.is_empty())
            .cloned()
    }

    /// The buffers of version 0 on shard `index` (from the init file), None when it holds none.
    fn initial_buffers(cfg: &Config, index: usize) -> Result<Option<Bytes>, String> {
        match Self::buffer_model(cfg, index) {
            Some(d) => Ok(d.initial_buffers()?.map(Bytes::from)),
            None => Ok(None),
        }
    }

    fn build(cfg: &Config, index: usize, total_steps: u64, saved: Saved) -> Arc<Self> {
        let spec = cfg.spec();
        let range = Self::range_of(cfg, index);
        let (version, init, opt, buffers) = (saved.version, saved.params, saved.opt, saved.buffers);
        let w = cfg.cluster.workers;
        let shm = match (cfg.cluster.transport, shm_root()) {
            (Transport::Auto, Some(root)) => {
                let run = ps_config::runid::board_prefix(cfg.cluster.run_id.as_deref());
                ShmHost::create(&root, &run, index, w)
            }
            _ => None,
        };
        let rules = Rules {
            warn: Duration::from_secs_f64(cfg.server.barrier_warn_secs),
            timeout: Duration::from_secs_f64(cfg.server.barrier_timeout_secs),
            policy: cfg.server.barrier_policy,
        };
        let exact = cfg.train.exact_micro_batch;
        let mode = if exact.is_some() {
            bucket::Mode::Whole("the exact sum (exact_sum) adds the workers' whole partial sums")
        } else {
            bucket::Mode::of(
                cfg.clip_norm.is_some(),
                shm.is_some(),
                cfg.server.max_pending_gradients,
                w,
            )
        };
        let buckets = match &mode {
            bucket::Mode::Buckets => bucket::plan(&spec, &range),
            bucket::Mode::Whole(_) => Vec::new(),
        };
        let state = State {
            barrier: Barrier::new(w, version, total_steps, rules, Instant::now()),
            store: Store::heap(version, init),
            opt: Arc::new(opt),
            track: Default::default(),
            spare: Vec::new(),
            left: vec![None; w],
            failed: None,
            told: vec![false; w],
            unused: unused::Unused::new(w, spec.tensors.len()),
            constants: Default::default(),
            buffers,
            next_buffers: None,
        };
        Arc::new(Self {
            index,
            range,
            world: w,
            num_params: spec.num_params(),
            spec,
            num_shards: cfg.num_shards(),
            total_steps,
            aggregation: cfg.train.aggregation,
            exact,
            optimizer: cfg.optimizer.clone(),
            group_of: {
                let mut of = vec![None; cfg.spec().tensors.len()];
                for (g, group) in cfg.groups.iter().enumerate() {
                    for &t in &group.tensors {
                        of[t as usize] = Some(g);
                    }
                }
                of
            },
            groups: cfg.groups.clone(),
            clip_norm: cfg.clip_norm,
            exchange: std::sync::OnceLock::new(),
            schedule: cfg.schedule_for(total_steps),
            state: Mutex::new(state),
            // the exact sum holds every rank's partial sum until the barrier (it does not fold)
            gate: Gate::new(if exact.is_some() {
                cfg.server.max_pending_gradients.max(w)
            } else {
                cfg.server.max_pending_gradients
            }),
            acc: Mutex::new(Acc::default()),
            buckets,
            mode,
            work: Mutex::default(),
            version_tx: watch::Sender::new(version),
            told_changed: tokio::sync::Notify::new(),
            shm,
            checkpoint: checkpoint::Plan::of(cfg, index, Self::range_of(cfg, index)),
            preempt: Default::default(),
            preempt_plan: checkpoint::Plan::for_preemption(cfg, index, Self::range_of(cfg, index)),
            buffer_model: Self::buffer_model(cfg, index),
            preempt_saved: watch::Sender::new(None),
            preempt_closed: std::sync::Mutex::new(false),
        })
    }

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

    /// Rank 0's buffers after the forward pass of `step` (a safetensors serialization of the
    /// model's buffers, checked against the declared ones): they become the buffers of
    /// version `step + 1` when the step is applied. Only rank 0 puts buffers (its are the
    /// model's, as DDP's broadcast_buffers); a put for a step already applied changes nothing
    /// (a retry); one for a step the shard has not reached, from another rank, or on a shard
    /// that holds no buffers is refused, changing nothing.
    pub fn put_buffers(&self, rank: u32, step: u64, data: Bytes) -> PsResult<()> {
        let Some(model) = &self.buffer_model else {
            return Err(PsError::BadChunk(format!(
                "shard {}: holds no buffers (the run's model declares none, or they are on shard 0)",
                self.index
            )));
        };
        if rank != 0 {
            return Err(PsError::BadChunk(format!(
                "rank {rank} put buffers: only rank 0's buffers are the model's"
            )));
        }
        model.check_buffers(&data).map_err(PsError::BadChunk)?;
        let mut st = self.lock();
        st.barrier.rank(rank)?;
        if let Some(why) = &st.failed {
            return Err(PsError::Unavailable(why.clone()));
        }
        if !st.barrier.registered(rank) {
            return Err(PsError::NotRegistered(rank));
        }
        let at = st.barrier.step();
        if step > at {
            return Err(PsError::BadChunk(format!(
                "rank {rank} put buffers of step {step}: the shard is at step {at}"
            )));
        }
        if step == at && !st.barrier.applying() {
            st.next_buffers = Some((step, data));
        }
        Ok(())
    }

    /// The buffers of the current version when it is `version` (None: not reached yet); a
    /// version already left behind is [`PsError::VersionGone`].
    pub fn buffers(&self, version: u64) -> PsResult<Option<(u64, Bytes)>> {
        if self.buffer_model.is_none() {
            return Err(PsError::BadChunk(format!(
                "shard {}: holds no buffers (the run's model declares none, or they are on shard 0)",
                self.index
            )));
        }
        let st = self.lock();
        if let Some(why) = &st.failed {
            return Err(PsError::Unavailable(why.clone()));
        }
        let at = st.barrier.step();
        if version > at {
            return Ok(None);
        }
        if version < at {
            return Err(PsError::VersionGone {
                asked: version,
                shard: self.index,
                current: at,
            });
        }
        Ok(st.buffers.clone().map(|b| (at, b)))
    }

    /// The buffers of the current version (the final ones at the run's end), if the shard
    /// holds any.
    pub fn current_buffers(&self) -> Option<Bytes> {
        self.lock().buffers.clone()
    }

    /// Marks the run failed: pulls and pushes are refused from now on.
    pub fn fail(&self, why: String) {
        self.lock().failed = Some(why);
        self.wake();
        // wake pulls (and the run's watcher) so they see the failure
        self.version_tx.send_modify(|_| {});
    }

    /// Why the run failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    /// [`PsError::RunFailed`] once the run failed, noting that `rank` (when it is one) has
    /// now been told; changes nothing otherwise.
    pub fn refuse_failed(&self, rank: u32) -> PsResult<()> {
        let mut st = self.lock();
        match st.barrier.rank(rank) {
            Ok(r) => self.refuse_if_failed(&mut st, r),
            Err(_) => st
                .failed
                .clone()
                .map_or(Ok(()), |why| Err(PsError::RunFailed(why))),
        }
    }

    /// Notes that `rank` learned of the run's failure (it said it stopped, or was refused).
    pub fn told(&self, rank: u32) {
        let mut st = self.lock();
        if let Ok(r) = st.barrier.rank(rank) {
            st.told[r] = true;
            drop(st);
            self.told_changed.notify_waiters();
        }
    }

    fn refuse_if_failed(&self, st: &mut State, r: usize) -> PsResult<()> {
        let Some(why) = &st.failed else { return Ok(()) };
        let e = PsError::RunFailed(why.clone());
        if !std::mem::replace(&mut st.told[r], true) {
            self.told_changed.notify_waiters();
        }
        Err(e)
    }

    /// Waits until every rank has learned of the run's failure (a request of its refused with
    /// the reason, or it left), at most `bound`. The ranks that did not, in order.
    pub async fn wait_all_told(&self, bound: Duration) -> Vec<usize> {
        let untold = |st: &State| -> Vec<usize> {
            (0..self.world)
                .filter(|&r| !st.told[r] && st.left[r].is_none())
                .collect()
        };
        let all = async {
            loop {
                let changed = self.told_changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if untold(&self.lock()).is_empty() {
                    return;
                }
                changed.await;
            }
        };
        let _ = tokio::time::timeout(bound, all).await;
        untold(&self.lock())
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

        let now = Instant::now();
        let figures = self.figures(
            (step, lr, grad_sq_norm),
            &slots,
            (rank_sq, clip, buckets),
            (started, waiting_since, now),
        );
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

    /// The figures of the step `step` applied from `slots` (`times`: the update's start, when
    /// the barrier began waiting, now).
    #[allow(clippy::type_complexity)]
    fn figures(
        &self,
        (step, lr, grad_sq_norm): (u64, f64, f64),
        slots: &[Slot],
        (rank_sq, clip, buckets): (Vec<RankNorm>, Option<(f32, f32)>, Option<u32>),
        (started, waiting_since, now): (Instant, Instant, Instant),
    ) -> StepFigures {
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
        StepFigures {
            step,
            grad_sq_norm,
            lr,
            samples: slots.iter().map(|s| u64::from(s.samples)).sum(),
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
        }
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
                Grad::Board(b) => grads.push(unsafe { &b.slot(0)[self.push_range()] }),
                Grad::Folded | Grad::Checked => continue,
            }
            cs.push(c);
            ranks.push(s.rank);
        }
        // the exact sum: one input, the partial sums added without rounding and rounded once
        let mut exact_sum = Vec::new();
        if let Some(m) = self.exact {
            match exact_aggregate(&grads, self.len(), &mut exact_sum) {
                Ok(()) => {
                    grads = vec![&exact_sum];
                    cs = vec![self.exact_coefficient(m, slots)];
                    ranks.truncate(1);
                }
                Err((i, e)) => {
                    return self.refused(
                        format!(
                            "step {step}: rank {}'s exact partial sum on shard {}: {e}; the step is not applied (the shard stays at version {step}) and the run stops",
                            ranks[i], self.index
                        ),
                        opt,
                    );
                }
            }
        }
        // tensors no rank reached are not updated; Adam's bias correction of a tensor skipped
        // before counts its own steps ([`unused`]); a tensor of a parameter group is updated
        // with its group's settings: both are updated again on their own after the fused
        // update, from the state kept before it
        let (skip, reruns) = self.untouched(step, slots, &opt);
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
        // (a step refused for its norm exchange has no per-rank norms)
        let rank_sq = updated
            .as_ref()
            .ok()
            // the exact sum's one input is no rank's own: no per-rank norms
            .filter(|_| exchange_failed.is_none() && self.exact.is_none())
            .and_then(|n| self.rank_norms(acc, folded, slots, &ranks, &n.inputs))
            .unwrap_or_default();
        // a board truncated under the update read as zeros (the SIGBUS guard): not its values
        let truncated = slots
            .iter()
            .find(|s| matches!(&s.grad, Grad::Board(b) if b.faulted()))
            .map(|s| s.rank);
        let result = match (updated, truncated, exchange_failed) {
            (_, _, Some(why)) => Err(format!(
                "step {step}: gradient clipping ([optimizer] clip_norm) needs the gradient norm of every shard: {why}; the step is not applied (the shard stays at version {step}) and the run stops"
            )),
            (_, Some(rank), None) => {
                if let Some(h) = &self.shm {
                    h.detach(rank as usize);
                }
                Err(board_truncated(step, rank))
            }
            _ if pending.faulted() => Err(format!(
                "step {step}: shard {}'s shared-memory parameters board was truncated during the update (another process shrank the file): the parameters are lost; the run stops",
                self.index
            )),
            (Err(bad), None, None) => Err(format!(
                "step {step}: rank {}'s gradient holds {} at index {} of shard {}'s range when the update reads it, although its push was checked: its shared-memory board was written after the push was accepted; the step is not applied (the shard stays at version {step}) and the run stops",
                ranks[bad.source], bad.value, bad.index, self.index
            )),
            (Ok(norms), None, None) => Ok(norms.aggregate),
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

    /// The parts of this shard's range the fused update must not change (tensors no rank of
    /// `slots` reached at `step`), and those updated again on their own after it (a parameter
    /// group's, or a tensor whose Adam steps differ from the state's: `(its steps, range,
    /// group)`).
    #[allow(clippy::type_complexity)]
    fn untouched(
        &self,
        step: u64,
        slots: &[Slot],
        opt: &OptState,
    ) -> (
        Vec<(u32, Range<usize>)>,
        Vec<(u64, Range<usize>, Option<usize>)>,
    ) {
        let st = self.lock();
        let ranks: Vec<u32> = slots.iter().map(|s| s.rank).collect();
        let skip = st.unused.skipped_by_all(step, &ranks);
        let again: Vec<(u32, Option<usize>, u64)> = (0..self.spec.tensors.len() as u32)
            .filter_map(|t| match self.treatment(t, &skip, opt) {
                Some((group, own)) if group.is_some() || own != opt.steps => Some((t, group, own)),
                _ => None,
            })
            .collect();
        let tensors: Vec<u32> = again.iter().map(|a| a.0).collect();
        let reruns = unused::local_parts(&self.spec, &self.range, &tensors)
            .into_iter()
            .map(|(t, r)| {
                let (_, group, own) = again[again.partition_point(|a| a.0 < t)];
                (own, r, group)
            })
            .collect();
        (unused::local_parts(&self.spec, &self.range, &skip), reruns)
    }

    /// The coefficient of the exact sum `S` of the step's terms of `m` samples: 1 / (number of
    /// terms) with a mean loss (the mean over the samples in), 1 with a sum loss.
    fn exact_coefficient(&self, m: usize, slots: &[Slot]) -> f32 {
        match self.aggregation {
            Aggregation::Sum => 1.0,
            Aggregation::Mean | Aggregation::Weighted => {
                let samples: u64 = slots.iter().map(|s| u64::from(s.samples)).sum();
                ps_net::exact::mean_coefficient(samples as usize / m)
            }
        }
    }

    /// An update refused before any arithmetic: `why`, the state as it was.
    fn refused(&self, why: String, opt: OptState) -> Applied {
        Applied {
            result: Err(why),
            rank_sq: Vec::new(),
            skip: Vec::new(),
            clip: None,
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
        let acc_sq = if folded { Some(*inputs.first()?) } else { None };
        let direct = usize::from(folded);
        slots
            .iter()
            .map(|s| {
                let sq_norm = match s.grad {
                    Grad::Folded => acc.norm_of(s.rank as usize, acc_sq)?,
                    Grad::Owned(_) | Grad::Board(_) | Grad::Received(_) => {
                        let i = input_ranks
                            .get(direct..)?
                            .iter()
                            .position(|&r| r == s.rank)?;
                        *inputs.get(direct + i)?
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

    /// Writes a checkpoint of the current version if one is due (every `[checkpoint] every`
    /// steps); None when none was due, or when a preemption wrote the step boundary instead
    /// ([`Shard::request_preempt`]). Call it right after [`Shard::apply`], before the
    /// barrier-completing push is answered: the next update cannot start before that push's
    /// worker pushes again, so the state copied here is the version's. A failed write is
    /// retried once; after `[checkpoint] max_failures` consecutive failed checkpoints the run
    /// fails (refused from now on, and the shard exits non-zero), saying why.
    pub fn checkpoint_if_due(&self) -> Option<checkpoint::Attempted> {
        if self.preempt.load(std::sync::atomic::Ordering::SeqCst) {
            // the step boundary a preemption waits for: the same state as below
            let version = self.version();
            let (opt, buffers) = {
                let st = self.lock();
                ((*st.opt).clone(), st.buffers.clone())
            };
            self.write_preempt(version, opt, buffers);
            return None;
        }
        let plan = self.checkpoint.as_ref()?;
        let version = self.version();
        if !plan.due(version) {
            return None;
        }
        let (opt, buffers) = {
            let st = self.lock();
            ((*st.opt).clone(), st.buffers.clone())
        };
        let saved = self
            .params()
            .map(|(version, params)| Saved {
                version,
                params,
                opt,
                buffers,
            })
            .map_err(|e| e.to_string());
        let attempted = plan.write_retrying(version, saved);
        if let Some(why) = &attempted.fatal {
            self.fail(why.clone());
        }
        Some(attempted)
    }

    /// Preemption (SIGTERM, Slurm's `--signal=USR1`): from now on every step boundary writes a
    /// checkpoint; the version the shard is at is written at once, unless an update is running
    /// (its end is the boundary, written by [`Shard::checkpoint_if_due`]). Returns the version
    /// the shard was at. Shards of one run are at most one version apart (a worker pulls
    /// version t from every shard before pushing step t), so each writing the version it is at
    /// and the next gives every shard the newer of the two, which a resume then agrees on.
    pub fn request_preempt(&self) -> u64 {
        self.preempt
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let (version, opt) = {
            let st = self.lock();
            (
                st.barrier.step(),
                (!st.barrier.applying()).then(|| ((*st.opt).clone(), st.buffers.clone())),
            )
        };
        if let Some((opt, buffers)) = opt {
            self.write_preempt(version, opt, buffers);
        }
        version
    }

    /// The preemption checkpoints written: the newest version (None before the first).
    pub fn preempt_saved(&self) -> watch::Receiver<Option<u64>> {
        self.preempt_saved.subscribe()
    }

    /// Ends the preemption's checkpoints and returns the newest written: one being written now
    /// is waited for, none is written after (an update still in flight would otherwise add the
    /// next version after the shard said where it stopped).
    pub fn close_preempt(&self) -> Option<u64> {
        let mut closed = self
            .preempt_closed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *closed = true;
        *self.preempt_saved.borrow()
    }

    /// Writes the preemption checkpoint of `version` with optimizer state `opt` (taken at that
    /// version), once per version; the parameters are read as of `version` (the double buffer
    /// keeps it while the next update writes the other half).
    fn write_preempt(&self, version: u64, opt: OptState, buffers: Option<Bytes>) {
        let closed = self
            .preempt_closed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *closed {
            return;
        }
        // the boundary after an update can be written before the version the preemption
        // found (both race for the disk): an older one adds nothing then
        if self.preempt_saved.borrow().is_some_and(|v| v >= version) {
            return;
        }
        let params = self.lock().store.source();
        let saved = params
            .read(version)
            .map(|params| Saved {
                version,
                params,
                opt,
                buffers,
            })
            .ok_or_else(|| format!("version {version} left the buffer during the copy"));
        if self.preempt_plan.write_checked(version, saved) {
            self.preempt_saved.send_if_modified(|newest| {
                let newer = newest.is_none_or(|v| v < version);
                if newer {
                    *newest = Some(version);
                }
                newer
            });
        }
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
/// The exact sum of the encoded partial sums `grads` (each `LIMBS * len` values), rounded
/// once into `out`, split across threads as the fused update is (each value's sum is its own:
/// the split changes no bit); the index of the input and the error for one that is not an
/// encoded sum.
fn exact_aggregate(
    grads: &[&[f32]],
    len: usize,
    out: &mut Vec<f32>,
) -> Result<(), (usize, ps_net::exact::ExactError)> {
    use ps_net::exact::LIMBS;
    out.resize(len, 0.0);
    if let Some((i, g)) = grads
        .iter()
        .enumerate()
        .find(|(_, g)| g.len() != LIMBS * len)
    {
        let e = ps_net::exact::ExactError::Length {
            what: "the encoded partial sum",
            got: g.len(),
            expected: LIMBS * len,
        };
        return Err((i, e));
    }
    let chunk = len.div_ceil(threads_for(len)).max(1);
    std::thread::scope(|scope| {
        let jobs: Vec<_> = out
            .chunks_mut(chunk)
            .enumerate()
            .map(|(c, part)| {
                scope.spawn(move || ps_net::exact::sum_encoded(grads, c * chunk, part))
            })
            .collect();
        jobs.into_iter()
            .try_for_each(|j| j.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

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
    use ps_config::TestConfig;
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
