//! One shard's state and its BSP step: per-rank gradient slots for the current step, the
//! aggregation in fixed rank order, the optimizer update, the version bump that wakes pulls,
//! and the validation every push goes through before it touches state.
//!
//! Locking: one std `Mutex<State>`, never held across an `.await` nor during the arithmetic;
//! the barrier-completing push moves the slots out, computes on a blocking thread, and puts
//! the new parameters back.

use crate::checkpoint::{self, Identity, Saved};
use bytes::Bytes;
use ps_common::config::Transport;
use ps_common::config::{Aggregation, Config};
use ps_common::optim::{LrSchedule, OptState, Optimizer, StepCoeffs};
use ps_common::shm::{Board, BoardDir, params_path, shm_root};
use ps_common::wire::check_and_fingerprint;
use ps_common::{PsError, PsResult};
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Where a rank's gradient slice for the current step lies.
#[derive(Debug)]
pub enum Grad {
    /// Received through gRPC into a shard buffer.
    Owned(Vec<f32>),
    /// In the shard's range of the rank's shared-memory gradient board (checked in place).
    Board(Arc<Board>),
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
    /// Time spent aggregating and updating.
    pub apply_ms: f64,
    /// Test-set evaluation summed over ranks (correct, count), when carried.
    pub eval: (u64, u64),
}

#[derive(Debug)]
struct State {
    /// Steps applied: the next step expected.
    version: u64,
    /// Parameters of `version` as bytes shared by every gRPC pull without a copy: always there
    /// with heap storage (a view of it), made at the first gRPC pull of a version with a board.
    snapshot: Option<(u64, Bytes)>,
    /// Gradient buffers of earlier steps, recycled by pushes (no allocation per step).
    spare: Vec<Vec<f32>>,
    /// Where the parameters live.
    store: Store,
    opt: OptState,
    registered: Vec<bool>,
    /// Ranks the barrier no longer waits for (`barrier_policy = "continue"` dropped them after a
    /// timeout) until they register or push again.
    absent: Vec<bool>,
    /// Ranks the last step went on without: their late push of it is acknowledged, not counted.
    dropped: Vec<bool>,
    slots: Vec<Option<Slot>>,
    /// Fingerprints of this step's gradients (kept while applying) and of the previous step's.
    current_fp: Vec<Option<u64>>,
    previous_fp: Vec<Option<u64>>,
    applying: bool,
    /// When the shard started waiting for the current step.
    waiting_since: Instant,
    /// Final test evaluation reported by each rank when it leaves.
    left: Vec<Option<(u64, u64)>>,
    failed: Option<String>,
}

/// The two versions of the parameters an update reads and writes (double buffering).
#[derive(Debug)]
enum Store {
    /// In this process: the parameters of `version`, and those of the version before,
    /// recycled as the next update's output once no pull holds them any more.
    Heap {
        params: Arc<Vec<f32>>,
        spare: Option<Arc<Vec<f32>>>,
    },
    /// In the shared-memory board that co-located workers read (version `v` in slot `v % 2`).
    Board(Arc<Board>),
}

/// The shard's side of the shared-memory data path.
#[derive(Debug)]
struct ShmHost {
    /// The directory of the parameters board.
    dir: BoardDir,
    /// Each rank's gradient board (the worker's file), once opened.
    grads: Mutex<Vec<Option<Arc<Board>>>>,
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
    /// Number of shards.
    pub num_shards: usize,
    /// Steps of the run.
    pub total_steps: u64,
    aggregation: Aggregation,
    optimizer: Optimizer,
    schedule: LrSchedule,
    state: Mutex<State>,
    version_tx: watch::Sender<u64>,
    shm: Option<ShmHost>,
    checkpoint: Option<CheckpointPlan>,
}

/// When and where this shard writes checkpoints.
#[derive(Debug)]
struct CheckpointPlan {
    every: u64,
    keep: usize,
    dir: std::path::PathBuf,
    id: Identity,
}

impl Shard {
    /// Builds shard `index` of `cfg` for a run of `total_steps`, with initial weights from the seed.
    pub fn new(cfg: &Config, index: usize, total_steps: u64) -> Arc<Self> {
        Self::starting_from(cfg, index, total_steps, None)
    }

    /// The range of the flat vector that shard `index` of `cfg` holds.
    pub fn range_of(cfg: &Config, index: usize) -> Range<usize> {
        ps_common::layout::shard_ranges(cfg.layout().num_params(), cfg.num_shards())[index].clone()
    }

    /// Like [`Shard::new`], but from `saved` (a checkpoint) when given: its version, parameters
    /// and optimizer state.
    pub fn starting_from(
        cfg: &Config,
        index: usize,
        total_steps: u64,
        saved: Option<Saved>,
    ) -> Arc<Self> {
        let layout = cfg.layout();
        let range = Self::range_of(cfg, index);
        let (version, init, opt) = match saved {
            Some(s) => (s.version, s.params, s.opt),
            None => {
                let init = layout.init_range(cfg.train.seed, range.clone());
                let opt = cfg.optimizer.init_state(init.len());
                (0, init, opt)
            }
        };
        let w = cfg.cluster.workers;
        let shm = match (cfg.cluster.transport, shm_root()) {
            (Transport::Auto, Some(root)) => {
                match BoardDir::create(&root, &format!("shard{index}")) {
                    Ok(dir) => Some(ShmHost {
                        dir,
                        grads: Mutex::new(vec![None; w]),
                    }),
                    Err(e) => {
                        tracing::warn!(
                            "shard {index}: no shared-memory data path ({e}); tensors go through gRPC"
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        let params = Arc::new(init);
        let snapshot = Some((version, Bytes::from_owner(SharedParams(params.clone()))));
        let store = Store::Heap {
            params,
            spare: None,
        };
        let state = State {
            version,
            snapshot,
            spare: Vec::new(),
            opt,
            store,
            registered: vec![false; w],
            absent: vec![false; w],
            dropped: vec![false; w],
            slots: (0..w).map(|_| None).collect(),
            current_fp: vec![None; w],
            previous_fp: vec![None; w],
            applying: false,
            waiting_since: Instant::now(),
            left: vec![None; w],
            failed: None,
        };
        Arc::new(Self {
            index,
            range,
            world: w,
            num_params: layout.num_params(),
            num_shards: cfg.num_shards(),
            total_steps,
            aggregation: cfg.train.aggregation,
            optimizer: cfg.optimizer.clone(),
            schedule: cfg.schedule_for(total_steps),
            state: Mutex::new(state),
            version_tx: watch::Sender::new(version),
            shm,
            checkpoint: (cfg.checkpoint.every > 0).then(|| CheckpointPlan {
                every: cfg.checkpoint.every,
                keep: cfg.checkpoint.keep,
                dir: cfg.checkpoint_dir(),
                id: Identity::of(cfg, index, Self::range_of(cfg, index)),
            }),
        })
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

    /// A gradient buffer to receive a push into: a recycled one when available.
    pub fn take_buffer(&self) -> Vec<f32> {
        self.lock().spare.pop().unwrap_or_default()
    }

    /// Returns a buffer (of a refused push, or of an applied step) for reuse.
    pub fn return_buffer(&self, buf: Vec<f32>) {
        let mut st = self.lock();
        if st.spare.len() < self.world + 1 {
            st.spare.push(buf);
        }
    }

    /// Current version.
    pub fn version(&self) -> u64 {
        *self.version_tx.borrow()
    }

    /// A receiver that sees every version bump.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version_tx.subscribe()
    }

    /// Marks the run failed: pulls and pushes are refused from now on.
    pub fn fail(&self, why: String) {
        self.lock().failed = Some(why);
        // wake pulls so they see the failure
        self.version_tx.send_modify(|_| {});
    }

    /// Why the run failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    fn check_rank(&self, rank: u32) -> PsResult<usize> {
        if (rank as usize) < self.world {
            Ok(rank as usize)
        } else {
            Err(PsError::UnknownRank {
                rank,
                world: self.world as u32,
            })
        }
    }

    /// Records a worker's registration; returns the step it joins at: the current version, or
    /// the next one while an update runs (that step is settled without this rank, or with the
    /// gradient its predecessor pushed).
    pub fn register(&self, rank: u32) -> PsResult<u64> {
        let r = self.check_rank(rank)?;
        let mut st = self.lock();
        st.registered[r] = true;
        st.absent[r] = false;
        Ok(st.version + u64::from(st.applying))
    }

    /// Checks a push header before its data is received: rank, registration, length, and a
    /// step that can still be accepted (the current one, or the previous one as a retry).
    pub fn precheck(&self, rank: u32, step: u64, len: u64) -> PsResult<()> {
        let r = self.check_rank(rank)?;
        let st = self.lock();
        if let Some(why) = &st.failed {
            return Err(PsError::Unavailable(why.clone()));
        }
        if !st.registered[r] {
            return Err(PsError::NotRegistered(rank));
        }
        if len != self.len() as u64 {
            return Err(PsError::WrongLength {
                expected: self.len() as u64,
                got: len,
            });
        }
        check_step(step, st.version)
    }

    /// Counts a complete, validated gradient. Returns the outcome and, when this push completed
    /// the barrier, the slots to aggregate (in rank order).
    pub fn accept(
        &self,
        meta: PushMeta,
        grad: Grad,
        fingerprint: u64,
    ) -> PsResult<(PushOutcome, Option<Vec<Slot>>)> {
        let r = self.check_rank(meta.rank)?;
        let mut st = self.lock();
        if let Some(why) = &st.failed {
            return Err(PsError::Unavailable(why.clone()));
        }
        check_step(meta.step, st.version)?;
        let ranks_in = |st: &State| st.current_fp.iter().filter(|f| f.is_some()).count() as u32;
        if meta.step + 1 == st.version {
            if st.dropped[r] {
                // the step went on without this rank (barrier timeout, policy "continue"): its
                // late gradient is acknowledged and not counted; it takes part again from now
                st.absent[r] = false;
                return Ok((
                    PushOutcome {
                        counted: false,
                        ranks_in: ranks_in(&st),
                    },
                    None,
                ));
            }
            // a retry of the step just applied: acknowledged only if it is the same gradient
            return if st.previous_fp[r] == Some(fingerprint) {
                Ok((
                    PushOutcome {
                        counted: false,
                        ranks_in: self.world as u32,
                    },
                    None,
                ))
            } else {
                Err(PsError::StaleStep {
                    step: meta.step,
                    expected: st.version,
                })
            };
        }
        match st.current_fp[r] {
            Some(fp) if fp == fingerprint => {
                return Ok((
                    PushOutcome {
                        counted: false,
                        ranks_in: ranks_in(&st),
                    },
                    None,
                ));
            }
            Some(_) => {
                return Err(PsError::Conflict {
                    rank: meta.rank,
                    step: meta.step,
                });
            }
            None => {}
        }
        st.current_fp[r] = Some(fingerprint);
        st.slots[r] = Some(Slot {
            rank: meta.rank,
            grad,
            fingerprint,
            samples: meta.samples,
            loss_sum: meta.loss_sum,
            correct: meta.correct,
            eval: meta.eval,
            arrived: Instant::now(),
        });
        st.absent[r] = false;
        let n = ranks_in(&st);
        let outcome = PushOutcome {
            counted: true,
            ranks_in: n,
        };
        let complete = (0..self.world).all(|q| st.absent[q] || st.current_fp[q].is_some());
        if complete && !st.applying {
            st.applying = true;
            st.dropped = st.absent.clone();
            let slots = st.slots.iter_mut().filter_map(Option::take).collect();
            return Ok((outcome, Some(slots)));
        }
        Ok((outcome, None))
    }

    /// Aggregates `slots` (rank order), applies the optimizer and publishes the next version.
    /// Runs the arithmetic without holding the lock; call it from a blocking thread.
    pub fn apply(&self, slots: Vec<Slot>) -> StepFigures {
        let started = Instant::now();
        let (step, mut taken, mut opt, waiting_since) = {
            let mut st = self.lock();
            let opt = std::mem::take(&mut st.opt);
            let taken = match &mut st.store {
                Store::Heap { params, spare } => Store::Heap {
                    params: params.clone(),
                    spare: spare.take(),
                },
                Store::Board(b) => Store::Board(b.clone()),
            };
            (st.version, taken, opt, st.waiting_since)
        };
        let samples: u64 = slots.iter().map(|s| u64::from(s.samples)).sum();
        let coeffs: Vec<f32> = slots
            .iter()
            .map(|s| match self.aggregation {
                Aggregation::Sum => 1.0,
                Aggregation::Mean => 1.0 / slots.len() as f32,
                Aggregation::Weighted if samples == 0 => 0.0,
                Aggregation::Weighted => (f64::from(s.samples) / samples as f64) as f32,
            })
            .collect();
        let lr = self.schedule.lr(step);
        let update = self.optimizer.coeffs(opt.steps, lr as f32);
        let grads: Vec<&[f32]> = slots
            .iter()
            .map(|s| match &s.grad {
                Grad::Owned(v) => v.as_slice(),
                // SAFETY: the worker writes its board again only after pulling the version this
                // update makes (module docs of ps_common::shm); the Arc keeps it mapped.
                Grad::Board(b) => unsafe { &b.slot(0)[self.range.clone()] },
            })
            .collect();
        let (grad_sq_norm, store) = match &mut taken {
            Store::Heap { params, spare } => {
                // the parameters of two versions ago are free unless a slow pull still holds them
                let len = params.len();
                let mut next = match spare.take().map(Arc::try_unwrap) {
                    Some(Ok(v)) if v.len() == len => v,
                    _ => vec![0f32; len],
                };
                let sq = self.update(&params[..], &mut next, &grads, &coeffs, update, &mut opt);
                let next = Arc::new(next);
                let snapshot = Bytes::from_owner(SharedParams(next.clone()));
                let old = std::mem::replace(params, next);
                (sq, Some((old, snapshot)))
            }
            Store::Board(b) => {
                // SAFETY: `applying` makes this the only update in flight, the only writer of
                // the board in this process; other readers go through `read_version`.
                let (current, next) = unsafe { b.update_slots(step + 1) };
                let sq = self.update(current, next, &grads, &coeffs, update, &mut opt);
                b.end_version(step + 1);
                (sq, None)
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
            samples,
            loss_sum: slots.iter().map(|s| s.loss_sum).sum(),
            correct: slots.iter().map(|s| s.correct).sum(),
            workers_in: slots.len() as u32,
            step_ms: ms(now - waiting_since),
            barrier_wait_ms: ms(last - first),
            slowest_rank: last_rank,
            apply_ms: ms(now - started),
            eval: slots
                .iter()
                .fold((0, 0), |a, s| (a.0 + s.eval.0, a.1 + s.eval.1)),
        };
        {
            let mut st = self.lock();
            match (&mut st.store, taken, store) {
                (
                    Store::Heap { params, spare },
                    Store::Heap { params: next, .. },
                    Some((old, snap)),
                ) => {
                    *params = next;
                    *spare = Some(old);
                    st.snapshot = Some((step + 1, snap));
                }
                _ => st.snapshot = None,
            }
            st.opt = opt;
            st.spare
                .extend(slots.into_iter().filter_map(|s| match s.grad {
                    Grad::Owned(v) => Some(v),
                    Grad::Board(_) => None,
                }));
            st.version = step + 1;
            st.previous_fp = std::mem::replace(&mut st.current_fp, vec![None; self.world]);
            st.applying = false;
            st.waiting_since = now;
        }
        self.version_tx.send_replace(step + 1);
        figures
    }

    /// `next = optimizer(current, Σ_r coeffs[r] · grads[r])` in one cache-blocked pass, split
    /// across cores for large shards; returns the squared norm of the aggregated gradient.
    fn update(
        &self,
        current: &[f32],
        next: &mut [f32],
        grads: &[&[f32]],
        coeffs: &[f32],
        update: StepCoeffs,
        opt: &mut OptState,
    ) -> f64 {
        let len = current.len();
        let threads = parts_for(len);
        // several pieces per thread, taken from a shared queue: a helper thread that starts
        // late (the other core is busy) leaves its pieces to the others instead of making
        // every one wait for it
        let pieces = if threads == 1 { 1 } else { 4 * threads };
        let chunk = len.div_ceil(pieces).max(1);
        let part = Part {
            optimizer: &self.optimizer,
            update,
            current,
            grads,
            coeffs,
        };
        let queue = Mutex::new(
            next.chunks_mut(chunk)
                .zip(split_parts(&mut opt.m, chunk, pieces))
                .zip(split_parts(&mut opt.v, chunk, pieces))
                .enumerate(),
        );
        let work = || {
            let mut done = Vec::new();
            loop {
                let piece = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                let Some((i, ((p, m), v))) = piece else {
                    return done;
                };
                done.push((i, part.run(i * chunk, p, m, v)));
            }
        };
        let mut sqs = if threads == 1 {
            work()
        } else {
            std::thread::scope(|scope| {
                let helpers: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
                let mut all = work();
                for h in helpers {
                    all.extend(h.join().expect("update thread"));
                }
                all
            })
        };
        // summed in piece order: the logged norm does not depend on which thread took what
        sqs.sort_by_key(|&(i, _)| i);
        sqs.iter().map(|&(_, sq)| sq).sum()
    }

    /// The current parameters as bytes for gRPC pulls, and their version: shared by every
    /// pull of the version (with a board, copied out of it at the version's first gRPC pull).
    pub fn snapshot(&self) -> PsResult<(u64, Bytes)> {
        {
            let st = self.lock();
            if let Some(why) = &st.failed {
                return Err(PsError::Unavailable(why.clone()));
            }
            match &st.snapshot {
                Some((v, snap)) if *v == st.version => return Ok((*v, snap.clone())),
                _ => {}
            }
        }
        let (version, values) = self.params()?;
        let snap = Bytes::from_owner(SharedParams(Arc::new(values)));
        let mut st = self.lock();
        if st.version == version {
            st.snapshot = Some((version, snap.clone()));
        }
        Ok((version, snap))
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
        if version + 1 != st.version || st.applying {
            return Err(gone(st.version));
        }
        match &st.store {
            Store::Heap {
                spare: Some(prev), ..
            } if prev.len() == self.len() => {
                Ok((version, Bytes::from_owner(SharedParams(prev.clone()))))
            }
            Store::Heap { .. } => Err(gone(st.version)),
            Store::Board(b) => {
                let b = b.clone();
                drop(st);
                let mut values = vec![0f32; b.len()];
                if b.read_version(version, &mut values) {
                    Ok((version, Bytes::from_owner(SharedParams(Arc::new(values)))))
                } else {
                    Err(gone(self.version()))
                }
            }
        }
    }

    /// A copy of the current parameters and their version (final weights, gRPC pulls).
    pub fn params(&self) -> PsResult<(u64, Vec<f32>)> {
        for _ in 0..100 {
            let (version, board) = {
                let st = self.lock();
                match &st.store {
                    Store::Heap { params, .. } => return Ok((st.version, params.to_vec())),
                    Store::Board(b) => (st.version, b.clone()),
                }
            };
            let mut values = vec![0f32; board.len()];
            // fails only if two updates completed during the copy: then copy the newer one
            if board.read_version(version, &mut values) {
                return Ok((version, values));
            }
        }
        Err(PsError::Unavailable(
            "the parameters kept changing while being copied".into(),
        ))
    }

    /// The shared-memory directory and token to offer `rank` on registration for its pulls,
    /// or None when this shard serves through gRPC only. The first offer moves the parameters
    /// into the shared-memory board (updates then read and write them there).
    pub fn offer_shm(&self, rank: u32) -> PsResult<Option<(String, u64)>> {
        self.check_rank(rank)?;
        let Some(host) = &self.shm else {
            return Ok(None);
        };
        let (dir, token) = (host.dir.path(), host.dir.token());
        let mut st = self.lock();
        if let Store::Heap { params, .. } = &st.store {
            if st.applying {
                tracing::info!(
                    "shard {}: rank {rank} registered during an update; it pulls through gRPC",
                    self.index
                );
                return Ok(None);
            }
            let path = params_path(dir);
            let mut board = match Board::create(&path, token, self.len(), 2) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(
                        "shard {}: cannot create {} ({e}); workers pull through gRPC",
                        self.index,
                        path.display()
                    );
                    return Ok(None);
                }
            };
            board.publish(st.version, params);
            st.store = Store::Board(Arc::new(board));
            tracing::info!(
                "shard {}: parameters in shared memory for the workers on this host ({})",
                self.index,
                dir.display()
            );
        }
        Ok(Some((dir.display().to_string(), token)))
    }

    /// Opens `rank`'s gradient board (a file it made, of the whole model's length, with
    /// `token` in its header); true when this shard will read the rank's pushes there. A file
    /// this shard cannot open (the worker is on another host) means gRPC pushes.
    pub fn attach_grad(&self, rank: u32, file: &Path, token: u64) -> PsResult<bool> {
        let r = self.check_rank(rank)?;
        let Some(host) = &self.shm else {
            return Ok(false);
        };
        let board = match Board::open(file, token, self.num_params, 1) {
            Ok(b) => Arc::new(b),
            Err(why) => {
                tracing::info!(
                    "shard {}: rank {rank} pushes through gRPC: its gradient board is not usable here ({why})",
                    self.index
                );
                return Ok(false);
            }
        };
        host.grads.lock().unwrap_or_else(|p| p.into_inner())[r] = Some(board);
        Ok(true)
    }

    /// True when pulls can be answered through the shared-memory board.
    pub fn has_board(&self) -> bool {
        matches!(self.lock().store, Store::Board(_))
    }

    /// `rank`'s gradient for a push that says it is in shared memory: the rank's board, once
    /// its range is checked in place (finite values) and fingerprinted like a received one.
    pub fn shm_grad(&self, rank: u32) -> PsResult<(Grad, u64)> {
        let r = self.check_rank(rank)?;
        let board = self
            .shm
            .as_ref()
            .and_then(|h| h.grads.lock().unwrap_or_else(|p| p.into_inner())[r].clone());
        let board = board.ok_or_else(|| {
            PsError::BadChunk(format!(
                "rank {rank} pushed through shared memory but shard {} has no gradient board of it: expected a registration with a grad_file first",
                self.index
            ))
        })?;
        // SAFETY: the worker does not write its board between its push and the update that
        // uses it (module docs of ps_common::shm).
        let fp = check_and_fingerprint(unsafe { &board.slot(0)[self.range.clone()] })?;
        Ok((Grad::Board(board), fp))
    }

    /// Writes a checkpoint of the current version if one is due (every `[checkpoint] every`
    /// steps). Call it right after [`Shard::apply`], before the barrier-completing push is
    /// answered: the next update cannot start before that push's worker pushes again, so the
    /// state copied here is the version's. A failed write is logged, and training goes on.
    pub fn checkpoint_if_due(&self) {
        let Some(plan) = &self.checkpoint else {
            return;
        };
        let version = self.version();
        if version == 0 || !version.is_multiple_of(plan.every) {
            return;
        }
        let started = Instant::now();
        let opt = self.lock().opt.clone();
        let written = self
            .params()
            .map_err(|e| e.to_string())
            .and_then(|(v, params)| {
                let saved = Saved {
                    version: v,
                    params,
                    opt,
                };
                checkpoint::write(&plan.dir, &plan.id, &saved, plan.keep)
            });
        match written {
            Ok(path) => tracing::info!(
                "shard {}: checkpoint of version {version} written to {} in {:.0} ms",
                self.index,
                path.display(),
                started.elapsed().as_secs_f64() * 1e3
            ),
            Err(e) => tracing::error!(
                "shard {}: checkpoint of version {version} not written: {e}",
                self.index
            ),
        }
    }

    /// Records that `rank` left with its final evaluation; returns true when every rank has.
    pub fn leave(&self, rank: u32, eval: (u64, u64)) -> PsResult<bool> {
        let r = self.check_rank(rank)?;
        let mut st = self.lock();
        st.left[r] = Some(eval);
        Ok(st.left.iter().all(Option::is_some))
    }

    /// Final evaluation summed over the ranks that left, and the ranks that did not.
    pub fn final_eval(&self) -> ((u64, u64), Vec<usize>) {
        let st = self.lock();
        let sum = st
            .left
            .iter()
            .flatten()
            .fold((0, 0), |a, e| (a.0 + e.0, a.1 + e.1));
        let missing = st
            .left
            .iter()
            .enumerate()
            .filter(|(_, e)| e.is_none())
            .map(|(r, _)| r)
            .collect();
        (sum, missing)
    }

    /// The barrier's state while the current step waits: the step, the ranks still missing
    /// and how long it has waited (None while applying, after the last step, or after failure).
    pub fn barrier_wait(&self) -> Option<(u64, Vec<usize>, Duration)> {
        let st = self.lock();
        if st.applying || st.version >= self.total_steps || st.failed.is_some() {
            return None;
        }
        let missing = st
            .current_fp
            .iter()
            .enumerate()
            .filter(|&(r, f)| f.is_none() && !st.absent[r])
            .map(|(r, _)| r)
            .collect();
        Some((st.version, missing, st.waiting_since.elapsed()))
    }

    /// The barrier policy "continue": the current step goes on with the ranks that pushed, and
    /// the barrier stops waiting for the others until they register or push again. Returns
    /// the slots to apply and the ranks left out, or None when no rank pushed (nothing to go
    /// on with) or an update already runs.
    pub fn continue_without_missing(&self) -> Option<(Vec<Slot>, Vec<usize>)> {
        let mut st = self.lock();
        if st.applying || st.failed.is_some() || st.slots.iter().all(Option::is_none) {
            return None;
        }
        let missing: Vec<usize> = (0..self.world)
            .filter(|&r| st.current_fp[r].is_none())
            .collect();
        for &r in &missing {
            st.absent[r] = true;
        }
        st.dropped = st.absent.clone();
        st.applying = true;
        let slots = st.slots.iter_mut().filter_map(Option::take).collect();
        Some((slots, missing))
    }
}

/// The parameters of one version as little-endian bytes, owned by the `Bytes` that pulls share.
struct SharedParams(Arc<Vec<f32>>);

impl AsRef<[u8]> for SharedParams {
    fn as_ref(&self) -> &[u8] {
        ps_common::wire::as_le_bytes(&self.0)
    }
}

fn check_step(step: u64, version: u64) -> PsResult<()> {
    if step > version {
        Err(PsError::FutureStep {
            step,
            expected: version,
        })
    } else if step + 1 < version {
        Err(PsError::StaleStep {
            step,
            expected: version,
        })
    } else {
        Ok(())
    }
}

/// What every part of one update shares.
struct Part<'a> {
    optimizer: &'a Optimizer,
    update: StepCoeffs,
    current: &'a [f32],
    grads: &'a [&'a [f32]],
    coeffs: &'a [f32],
}

impl Part<'_> {
    /// Updates `p` (values `lo..lo + p.len()` of the shard) and its optimizer state; returns
    /// the squared norm of that part of the aggregated gradient. Uses AVX2 where the CPU has
    /// it (decided at run time): element-wise IEEE operations, so the numbers are the same.
    fn run(&self, lo: usize, p: &mut [f32], m: &mut [f32], v: &mut [f32]) -> f64 {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { self.run_avx2(lo, p, m, v) };
        }
        self.run_portable(lo, p, m, v)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run_avx2(&self, lo: usize, p: &mut [f32], m: &mut [f32], v: &mut [f32]) -> f64 {
        self.run_portable(lo, p, m, v)
    }

    /// Cache-sized blocks: aggregate into a block buffer, take its norm, copy the old
    /// parameters in and update them while the block is in L1/L2, so memory sees one read of
    /// every input and one write of the output (gradients are only read).
    #[inline(always)]
    fn run_portable(&self, lo: usize, p: &mut [f32], m: &mut [f32], v: &mut [f32]) -> f64 {
        let mut sq = 0.0;
        let mut g = vec![0f32; BLOCK.min(p.len())];
        let mut at = 0;
        while at < p.len() {
            let end = (at + BLOCK).min(p.len());
            let gb = &mut g[..end - at];
            sq += aggregate(gb, self.grads, self.coeffs, lo + at);
            let pb = &mut p[at..end];
            pb.copy_from_slice(&self.current[lo + at..lo + end]);
            let (mb, vb) = (block_of(m, at, end), block_of(v, at, end));
            self.optimizer.update_chunk(self.update, pb, gb, mb, vb);
            at = end;
        }
        sq
    }
}

/// `g = Σ_r cs[r] * grads[r][lo..lo + g.len()]`, summed in rank order (bit-reproducible
/// whatever the arrival order and however the shard is split into blocks), in straight-line
/// loops over slices; returns the squared norm of the result.
#[inline(always)]
fn aggregate(g: &mut [f32], grads: &[&[f32]], cs: &[f32], lo: usize) -> f64 {
    let n = g.len();
    for (r, (src, &c)) in grads.iter().zip(cs).enumerate() {
        let src = &src[lo..lo + n];
        match (r, c == 1.0) {
            (0, true) => g.copy_from_slice(src),
            (0, false) => g.iter_mut().zip(src).for_each(|(a, &x)| *a = c * x),
            (_, true) => g.iter_mut().zip(src).for_each(|(a, &x)| *a += x),
            (_, false) => g.iter_mut().zip(src).for_each(|(a, &x)| *a += c * x),
        }
    }
    sum_of_squares(g)
}

/// Σ v² in f64, over eight independent lanes so that it vectorises (a single running sum is a
/// chain of dependent adds, slower than the rest of the update together).
#[inline(always)]
fn sum_of_squares(g: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut blocks = g.chunks_exact(8);
    for b in &mut blocks {
        for (l, &v) in lanes.iter_mut().zip(b) {
            *l += f64::from(v) * f64::from(v);
        }
    }
    let tail: f64 = blocks
        .remainder()
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum();
    lanes.iter().sum::<f64>() + tail
}

/// Values per cache block of the fused update (8 KiB per array: the block buffer, the new
/// parameters and the optimizer state of a block stay in L1; measured against 8192 and 32768).
const BLOCK: usize = 2048;

/// `v[at..end]`, or an empty slice for an optimizer buffer that does not exist.
#[inline(always)]
fn block_of(v: &mut [f32], at: usize, end: usize) -> &mut [f32] {
    if v.is_empty() { v } else { &mut v[at..end] }
}

/// Below this many values a shard updates on one thread (spawning costs more than it saves).
const PARALLEL_MIN: usize = 1 << 17;

/// How many threads an update of `len` values uses.
fn parts_for(len: usize) -> usize {
    if len < PARALLEL_MIN {
        return 1;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.min(len / (PARALLEL_MIN / 2)).clamp(1, 8)
}

/// `pieces` mutable pieces of `v` of `chunk` values each, or `pieces` empty slices when `v` is
/// empty (an optimizer without that buffer).
fn split_parts(v: &mut [f32], chunk: usize, pieces: usize) -> Vec<&mut [f32]> {
    if v.is_empty() {
        (0..pieces).map(|_| &mut [][..]).collect()
    } else {
        v.chunks_mut(chunk).collect()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
