//! Per-bucket apply: the update of a part ("bucket") of the shard's range runs as soon as every
//! member rank's gradient for that part is in, while the rest of the pushes still stream in,
//! with the same bits as the whole-range update at the barrier's completion.
//!
//! - [`plan`]: the buckets, a pure function of (model spec, range): each tensor's part of the
//!   range, split into blocks of at most [`BUCKET_VALUES`]. A bucket lies in one tensor, so its
//!   treatment (skipped, its parameter group, Adam's own step count: [`Shard::treatment`]) is
//!   one, and its update is ONE [`fused_update`] over its sub-slices: element-wise, the same
//!   bits as the whole-range update and its per-tensor reruns.
//! - [`RecvBuf`]: a receive buffer shared between the task receiving a push and the applier,
//!   which reads only regions published as received ([`Intake`]); [`Intake`] is the receiving
//!   task's handle, whose drop without the push being counted discards the step's work.
//! - The work is tentative: it reads the current version's parameters and optimizer state and
//!   writes the pending version's parameters and a pending copy of `m`/`v`; nothing is
//!   published per bucket. At the barrier's completion ([`Shard::apply`]) the buckets not yet
//!   applied are, then the version is committed; anything that could change what a bucket's
//!   update would be (a push refused or broken after its pieces were used, a second push of a
//!   rank, other members, other unused tensors, another optimizer state) discards the work,
//!   and the completion runs the whole-range update from the intact state.
//! - Where it runs ([`Mode`]): no `clip_norm` (the global norm comes first), and a receive
//!   buffer for every rank (`max_pending_gradients >= workers`: no fold into the accumulator).
//!   Decided at start-up. A push whose values lie in place (a shared-memory gradient board,
//!   [`PushSource`]) is not copied: its [`RecvBuf`] is a view of the source, checked
//!   (finiteness, fingerprint) and published bucket by bucket in one pass
//!   ([`Shard::receive_in_place`]).
//!
//! Locks: the tracking ([`Track`]) is in the shard's `State` (quick, per published region);
//! the arithmetic runs under the shard's `work` lock only (taken before `State`, never after),
//! so the completion waits for a bucket update under way.

mod handle;

use super::{Grad, Shard, State};
pub use handle::Intake;

/// Why a bucket's update is not made (the per-bucket work is discarded, or the completion
/// runs the whole-range update, which says the same of the step).
#[derive(Debug, thiserror::Error)]
#[error("rank {rank}'s gradient holds {value} at index {index}")]
pub struct BadGradient {
    /// The rank whose gradient it is.
    pub rank: u32,
    /// The value that is not finite.
    pub value: f32,
    /// Its index in the flat vector.
    pub index: usize,
}
use crate::update::{Norms, Simd, UpdateInputs, fused_update, threads_for};
use ps_model::layout::ModelSpec;
use ps_net::source::{PushSource, SourceFault};
use ps_optim::{OptState, Optimizer};
use ps_proto::PsResult;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Most values in one bucket (1 MiB of f32: a few per layer of a large model).
pub const BUCKET_VALUES: usize = 1 << 18;

/// One bucket: a part of one tensor's part of the shard's range (shard coordinates).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// The tensor it lies in.
    pub tensor: u32,
    /// Its values, from the shard's range start.
    pub range: Range<usize>,
}

/// The buckets of a shard holding `range` of `spec`, in flat order, covering the range.
pub fn plan(spec: &ModelSpec, range: &Range<usize>) -> Vec<Bucket> {
    let all: Vec<u32> = (0..spec.tensors.len() as u32).collect();
    crate::unused::local_parts(spec, range, &all)
        .into_iter()
        .flat_map(|(tensor, r)| {
            (r.start..r.end)
                .step_by(BUCKET_VALUES)
                .map(move |lo| Bucket {
                    tensor,
                    range: lo..(lo + BUCKET_VALUES).min(r.end),
                })
        })
        .collect()
}

/// Whether a shard applies per bucket, and why (said once at start-up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Per bucket, as the pushes' parts come in.
    Buckets,
    /// The whole range at the barrier's completion, for this reason.
    Whole(&'static str),
}

impl Mode {
    /// The mode for a shard with these settings (a shared-memory host applies per bucket
    /// too: a board push is read in place, bucket by bucket, [`Shard::receive_in_place`]).
    pub fn of(clip: bool, buffers: usize, world: usize) -> Self {
        if clip {
            Mode::Whole("[optimizer] clip_norm needs the global gradient norm before any update")
        } else if buffers < world {
            Mode::Whole(
                "[server] max_pending_gradients < workers: gradients are folded as they arrive",
            )
        } else {
            Mode::Buckets
        }
    }
}

/// A receive buffer of `len` values written by one receiving task, region by region, and read
/// by the bucket applier in the regions published as received.
///
/// Invariant: a value is written at most once, through [`Intake::region`] or
/// [`Intake::decode`], before its region is published; the applier reads only published
/// regions (published under the shard's lock, read after taking it: the write happens
/// before the read); the whole is read only once complete, when nothing writes it any more.
pub struct RecvBuf {
    ptr: NonNull<f32>,
    cap: usize,
    len: usize,
    complete: AtomicBool,
    /// For a view of values in place: their source, which keeps them alive (nothing is
    /// written through the view, and nothing is freed).
    view: Option<Arc<dyn PushSource>>,
}

// SAFETY: the buffer is plain memory owned by the RecvBuf; concurrent access follows the
// invariant above (disjoint regions written by one task before they are read).
unsafe impl Send for RecvBuf {}
// SAFETY: as above.
unsafe impl Sync for RecvBuf {}

impl std::fmt::Debug for RecvBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBuf")
            .field("len", &self.len)
            .field("complete", &self.complete.load(Ordering::Acquire))
            .finish()
    }
}

impl RecvBuf {
    /// A buffer of `len` values in `values`' allocation (grown if short; nothing is written).
    pub fn new(mut values: Vec<f32>, len: usize) -> Self {
        values.clear();
        values.reserve_exact(len);
        let mut values = std::mem::ManuallyDrop::new(values);
        let cap = values.capacity();
        let ptr = NonNull::new(values.as_mut_ptr()).expect("a Vec's pointer is never null");
        Self {
            ptr,
            cap,
            len,
            complete: AtomicBool::new(false),
            view: None,
        }
    }

    /// A view of `src`'s values, read in place (its memory stays the same while it lives:
    /// [`PushSource`]'s contract; nothing is written through the view).
    fn in_place(src: Arc<dyn PushSource>) -> Self {
        let values = src.values();
        let ptr = NonNull::from(values).cast::<f32>();
        Self {
            ptr,
            cap: 0,
            len: values.len(),
            complete: AtomicBool::new(false),
            view: Some(src),
        }
    }

    /// Why the values this views are not the push's (their memory faulted while read: a
    /// truncated board, read as zeros under the SIGBUS guard); None for a buffer of its own.
    pub fn fault(&self) -> Option<SourceFault> {
        self.view.as_ref().and_then(|src| src.fault())
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every value, once all were written ([`Intake::finish`]); None before.
    pub fn values(&self) -> Option<&[f32]> {
        // SAFETY: complete: every value was written and none is written any more.
        self.complete
            .load(Ordering::Acquire)
            .then(|| unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// The values of `r`.
    ///
    /// # Safety
    /// `r` lies in regions written and published (no writer touches them any more).
    unsafe fn part(&self, r: Range<usize>) -> &[f32] {
        assert!(r.start <= r.end && r.end <= self.len, "part out of range");
        // SAFETY: in bounds; initialised and not written (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(r.start), r.len()) }
    }

    /// The buffer as a Vec (its values when complete, else empty), for reuse; None while
    /// another holder (the applier) still reads it.
    pub fn into_vec(this: Arc<Self>) -> Option<Vec<f32>> {
        let buf = Arc::try_unwrap(this).ok()?;
        if buf.view.is_some() {
            return None;
        }
        let buf = std::mem::ManuallyDrop::new(buf);
        let len = if buf.complete.load(Ordering::Acquire) {
            buf.len
        } else {
            0
        };
        // SAFETY: the allocation of the Vec taken apart in `new` (same pointer and capacity),
        // its first `len` values initialised; `buf` is not dropped (ManuallyDrop), so the
        // allocation has this one owner.
        Some(unsafe { Vec::from_raw_parts(buf.ptr.as_ptr(), len, buf.cap) })
    }
}

impl Drop for RecvBuf {
    fn drop(&mut self) {
        if self.view.is_some() {
            // a view: its source owns the memory
            return;
        }
        // SAFETY: the allocation taken apart in `new`; f32 needs no drop, so length 0 frees it.
        drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), 0, self.cap) });
    }
}

/// A gradient received into a [`RecvBuf`] (complete, checked), with the permit to hold it.
#[derive(Debug)]
pub struct Received {
    /// The values ([`RecvBuf::values`] is Some).
    pub buf: Arc<RecvBuf>,
    /// Given back with the buffer.
    pub permit: Option<crate::intake::Permit>,
}

impl Received {
    /// The values.
    pub fn values(&self) -> &[f32] {
        self.buf.values().expect("a received gradient is complete")
    }
}

/// A gradient received into a shard buffer (or viewed in place) for per-bucket apply.
impl PushSource for Received {
    fn values(&self) -> &[f32] {
        Received::values(self)
    }

    fn fault(&self) -> Option<SourceFault> {
        self.buf.fault()
    }
}

/// One rank's push being received for the step.
#[derive(Debug)]
struct RankIn {
    buf: Arc<RecvBuf>,
    /// Values received per bucket.
    got: Vec<u32>,
    /// Counted by the barrier ([`Shard::accept`]).
    counted: bool,
    /// Some region was published (buckets may have used it).
    published: bool,
}

/// The bucket tracking of the step being gathered (in the shard's `State`).
#[derive(Debug, Default)]
pub(crate) struct Track {
    step: u64,
    /// The step's tentative work is discarded: the completion runs the whole range.
    broken: bool,
    ranks: Vec<Option<RankIn>>,
    /// Buckets in for every member, not yet taken by the applier.
    ready: Vec<usize>,
    /// Buckets taken by the applier (ready once).
    taken: Vec<bool>,
    /// An applier runs or is scheduled ([`Shard::run_buckets`]).
    runner: bool,
}

impl Track {
    /// The tracking of `step` (reset when it is of another).
    fn at(&mut self, step: u64, world: usize, buckets: usize) -> &mut Self {
        if self.step != step || self.ranks.len() != world {
            *self = Track {
                step,
                ranks: (0..world).map(|_| None).collect(),
                taken: vec![false; buckets],
                ..Track::default()
            };
        }
        self
    }

    /// Discards the step's work (the reason logged at debug level).
    fn discard(&mut self, index: usize, why: &str) {
        if !self.broken {
            tracing::debug!(
                "shard {index}: step {}: per-bucket work discarded ({why}); the update runs over the whole range at the barrier's completion",
                self.step
            );
        }
        self.broken = true;
        self.ready.clear();
    }
}

/// The tentative work of one step (under the shard's `work` lock).
#[derive(Debug, Default)]
pub(crate) struct Work {
    /// What it is the work of; None: nothing started.
    of: Option<Basis>,
    /// The pending version's parameters (begun at the first bucket).
    update: Option<crate::store::Update>,
    /// The pending optimizer state (`m`, `v` of the applied buckets); their allocations are
    /// kept from step to step.
    m: Vec<f32>,
    v: Vec<f32>,
    /// Buckets applied.
    done: Vec<bool>,
    /// Buckets applied before the barrier completed.
    early: u32,
    /// The norms summed over the applied buckets.
    norms: Option<Norms>,
}

/// What a step's bucket updates depend on: the completion checks it is unchanged.
#[derive(Debug)]
struct Basis {
    step: u64,
    /// Member ranks and their `b_r`, rank order.
    ranks: Vec<u32>,
    samples: Vec<u32>,
    coeffs: Vec<f32>,
    /// Each member's buffer.
    bufs: Vec<Arc<RecvBuf>>,
    /// Tensors no member reached (sorted).
    skip: Vec<u32>,
    /// The optimizer state of the current version.
    opt: Arc<OptState>,
    lr: f64,
}

/// How a tensor's part is updated in a step: None when it is skipped (no rank reached it),
/// else its parameter group and the steps its optimizer has taken.
pub(crate) type Treatment = Option<(Option<usize>, u64)>;

impl Shard {
    /// How tensor `t` is updated in a step whose unreached tensors are `skip` (sorted), from
    /// optimizer state `opt`: skipped; or with its group's settings (None: `[optimizer]`'s),
    /// Adam's bias correction counting the tensor's own steps ([`crate::unused`]).
    pub(crate) fn treatment(&self, t: u32, skip: &[u32], opt: &OptState) -> Treatment {
        if skip.binary_search(&t).is_ok() {
            return None;
        }
        let adam = matches!(self.optimizer, Optimizer::Adam { .. });
        let behind = opt.skipped.get(t as usize).copied().unwrap_or(0);
        let steps = if adam { opt.steps - behind } else { opt.steps };
        Some((self.group_of[t as usize], steps))
    }

    /// The optimizer and learning rate of a tensor of `group` in a step of learning rate `lr`.
    pub(crate) fn optimizer_of(&self, group: Option<usize>, lr: f64) -> (&Optimizer, f64) {
        match group {
            Some(g) => (&self.groups[g].optimizer, lr * self.groups[g].lr_scale),
            None => (&self.optimizer, lr),
        }
    }

    /// Whether this shard applies per bucket, and why not (for the start-up log).
    pub fn apply_mode(&self) -> &Mode {
        &self.mode
    }

    /// The buckets of this shard (empty when it applies the whole range only).
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Starts the receipt of `rank`'s gradient of `step` into a buffer of the pool for
    /// per-bucket apply; None when this shard applies the whole range only, or the step is not
    /// the one being gathered (receive as before then). A second push of a rank under way for
    /// the step discards the step's work.
    pub fn intake(self: &Arc<Self>, rank: u32, step: u64) -> Option<Intake> {
        if self.buckets.is_empty() {
            return None;
        }
        let buf = Arc::new(RecvBuf::new(self.take_buffer(), self.len()));
        self.intake_into(rank, step, buf)
    }

    /// [`Shard::intake`] into `buf` (a receive buffer, or a view of a gradient board).
    fn intake_into(self: &Arc<Self>, rank: u32, step: u64, buf: Arc<RecvBuf>) -> Option<Intake> {
        let mut st = self.lock();
        let r = st.barrier.rank(rank).ok()?;
        if st.barrier.step() != step || st.barrier.applying() || st.failed.is_some() {
            drop(st);
            if let Some(v) = RecvBuf::into_vec(buf) {
                self.return_buffer(v);
            }
            return None;
        }
        let (world, n) = (self.world, self.buckets.len());
        let index = self.index;
        let track = st.track.at(step, world, n);
        if track.ranks[r].is_some() {
            track.discard(index, "a second push of a rank under way");
        }
        track.ranks[r] = Some(RankIn {
            buf: buf.clone(),
            got: vec![0; n],
            counted: false,
            published: false,
        });
        Some(Intake {
            shard: self.clone(),
            rank,
            step,
            buf: Some(buf),
            given: Vec::new(),
            last: None,
        })
    }

    /// Records that values `r` of `rank`'s buffer `buf` for `step` are written; true when
    /// buckets became ready and no applier runs: the caller runs [`Shard::run_buckets`] on a
    /// blocking thread.
    fn published(&self, rank: u32, step: u64, buf: &Arc<RecvBuf>, r: Range<usize>) -> bool {
        let mut guard = self.lock();
        let st: &mut State = &mut guard;
        if st.barrier.step() != step || st.barrier.applying() || st.failed.is_some() {
            return false;
        }
        // the barrier and the tracking are two fields of the state: both borrowed at once,
        // without a copy of the member list per published region
        let members = st.barrier.freeze_if_ready().map(|(m, _)| m.as_slice());
        let (world, n) = (self.world, self.buckets.len());
        let track = st.track.at(step, world, n);
        let Some(me) = track.ranks[rank as usize]
            .as_mut()
            .filter(|me| Arc::ptr_eq(&me.buf, buf))
        else {
            return false;
        };
        me.published = true;
        if track.broken {
            return false;
        }
        // the buckets `r` overlaps
        let first = self.buckets.partition_point(|b| b.range.end <= r.start);
        let mut full = Vec::new();
        for (b, bucket) in self.buckets.iter().enumerate().skip(first) {
            if bucket.range.start >= r.end {
                break;
            }
            let overlap = r.end.min(bucket.range.end) - r.start.max(bucket.range.start);
            me.got[b] += overlap as u32;
            if me.got[b] as usize == bucket.range.len() {
                full.push(b);
            }
        }
        let Some(members) = members else {
            return false;
        };
        for b in full {
            let len = self.buckets[b].range.len() as u32;
            let all = (0..world)
                .filter(|&q| members[q])
                .all(|q| track.ranks[q].as_ref().is_some_and(|x| x.got[b] == len));
            if all && !track.taken[b] {
                track.taken[b] = true;
                track.ready.push(b);
            }
        }
        let start = !track.ready.is_empty() && !track.runner;
        track.runner |= start;
        start
    }

    /// `rank`'s push of `step` was counted (its buffer is the step's gradient of the rank).
    pub(crate) fn intake_counted(st: &mut State, rank: usize, step: u64, buf: &Arc<RecvBuf>) {
        if st.track.step == step
            && let Some(Some(me)) = st.track.ranks.get_mut(rank)
            && Arc::ptr_eq(&me.buf, buf)
        {
            me.counted = true;
        }
    }

    /// The receipt of `rank`'s push of `step` into `buf` ended without the push being counted:
    /// the step's work that may have used it is discarded.
    fn intake_ended(&self, rank: u32, step: u64, buf: &Arc<RecvBuf>) {
        let mut st = self.lock();
        let index = self.index;
        let track = &mut st.track;
        if track.step != step {
            return;
        }
        let Some(slot) = track.ranks.get_mut(rank as usize) else {
            return;
        };
        if slot
            .as_ref()
            .is_some_and(|me| Arc::ptr_eq(&me.buf, buf) && !me.counted)
        {
            let used = slot.take().is_some_and(|me| me.published);
            if used {
                track.discard(index, "a push whose values were used was not counted");
            }
        }
    }

    /// Applies the buckets that are ready, one after the other, until none is (the applier of
    /// [`Intake::publish`]); blocking: call it from a blocking thread. Never holds the shard's
    /// state lock during the arithmetic.
    pub fn run_buckets(&self) {
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let b = {
                let mut st = self.lock();
                let step = st.barrier.step();
                let usable = st.track.step == step
                    && !st.track.broken
                    && !st.barrier.applying()
                    && st.failed.is_none();
                let b = if usable { st.track.ready.pop() } else { None };
                let Some(b) = b else {
                    st.track.runner = false;
                    return;
                };
                if work.of.as_ref().is_none_or(|o| o.step != step)
                    && let Err(why) = self.begin_work(&mut st, &mut work, step)
                {
                    let index = self.index;
                    st.track.discard(index, why);
                    st.track.runner = false;
                    return;
                }
                b
            };
            if let Err(why) = self.run_bucket(&mut work, b, 1) {
                let mut st = self.lock();
                let index = self.index;
                st.track.discard(index, &why.to_string());
                st.track.runner = false;
                return;
            }
            work.early += 1;
        }
    }

    /// Begins the tentative work of the step being gathered, unless it is begun, or the
    /// per-bucket work of the step cannot be had (then discarded, saying why).
    fn begin_if_usable(&self) {
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        let mut st = self.lock();
        let step = st.barrier.step();
        let usable = st.track.step == step
            && !st.track.broken
            && !st.barrier.applying()
            && st.failed.is_none();
        if usable
            && work.of.as_ref().is_none_or(|o| o.step != step)
            && let Err(why) = self.begin_work(&mut st, &mut work, step)
        {
            let index = self.index;
            st.track.discard(index, why);
        }
    }

    /// Starts the tentative work of `step`: its members, coefficients, unreached tensors, the
    /// optimizer state it reads and the pending version it writes.
    fn begin_work(&self, st: &mut State, work: &mut Work, step: u64) -> Result<(), &'static str> {
        let Some((members, samples)) = st.barrier.frozen().cloned() else {
            return Err("the step's members are not fixed");
        };
        let ranks: Vec<u32> = (0..self.world as u32)
            .filter(|&r| members[r as usize])
            .collect();
        let samples: Vec<u32> = ranks.iter().map(|&r| samples[r as usize]).collect();
        let mut bufs = Vec::with_capacity(ranks.len());
        for &r in &ranks {
            match &st.track.ranks[r as usize] {
                Some(me) => bufs.push(me.buf.clone()),
                None => return Err("a member's push is not received into a buffer"),
            }
        }
        let skip = st.unused.skipped_by_all(step, &ranks);
        let opt = st.opt.clone();
        let len = self.len();
        let sized = |v: &mut Vec<f32>, keep: bool| {
            if keep {
                v.resize(len, 0.0);
            } else {
                v.clear();
            }
        };
        sized(&mut work.m, !opt.m.is_empty());
        sized(&mut work.v, !opt.v.is_empty());
        // a stale update (of a step left behind) is dropped; the store's spare went with it
        work.update = Some(st.store.begin(step + 1));
        work.done = vec![false; self.buckets.len()];
        work.early = 0;
        work.norms = None;
        work.of = Some(Basis {
            step,
            coeffs: crate::update::coefficients(self.aggregation, &samples),
            ranks,
            samples,
            bufs,
            skip,
            opt,
            lr: self.schedule.lr(step),
        });
        Ok(())
    }

    /// Applies bucket `b` from the work's basis: reads the current parameters and optimizer
    /// state, writes the pending ones; its norms are added to the work's.
    fn run_bucket(&self, work: &mut Work, b: usize, threads: usize) -> Result<(), BadGradient> {
        let Work {
            of,
            update,
            m,
            v,
            done,
            norms,
            ..
        } = work;
        let basis = of.as_ref().expect("work begun");
        let update = update.as_mut().expect("work begun");
        let bucket = &self.buckets[b];
        let r = bucket.range.clone();
        let opt = &basis.opt;
        let (current, next) = update.buffers();
        let Some((group, steps)) = self.treatment(bucket.tensor, &basis.skip, opt) else {
            // not updated: the pending version and state keep the current ones
            next[r.clone()].copy_from_slice(&current[r.clone()]);
            if !m.is_empty() {
                m[r.clone()].copy_from_slice(&opt.m[r.clone()]);
            }
            if !v.is_empty() {
                v[r.clone()].copy_from_slice(&opt.v[r.clone()]);
            }
            done[b] = true;
            return Ok(());
        };
        let (optimizer, lr) = self.optimizer_of(group, basis.lr);
        // SAFETY: bucket b is in for every member (the tracking counted all its values
        // published), so each buffer's region is written and no longer written.
        let grads: Vec<&[f32]> = basis
            .bufs
            .iter()
            .map(|buf| unsafe { buf.part(r.clone()) })
            .collect();
        let inputs = UpdateInputs {
            optimizer,
            step: optimizer.coeffs(steps, lr as f32),
            current: &current[r.clone()],
            grads: &grads,
            coeffs: &basis.coeffs,
            threads,
            simd: Simd::Auto,
            checked: 0,
            // the current state stays intact: each block of it is copied into the pending one
            // right before its update
            state_from: Some((
                opt.m.get(r.clone()).unwrap_or_default(),
                opt.v.get(r.clone()).unwrap_or_default(),
            )),
        };
        let got = fused_update(
            inputs,
            &mut next[r.clone()],
            super::block(m, &r),
            super::block(v, &r),
        )
        .map_err(|bad| BadGradient {
            rank: basis.ranks[bad.source],
            value: bad.value,
            index: r.start + bad.index,
        })?;
        let sum = norms.get_or_insert_with(|| Norms {
            aggregate: 0.0,
            inputs: vec![0.0; grads.len()],
        });
        sum.aggregate += got.aggregate;
        sum.inputs
            .iter_mut()
            .zip(&got.inputs)
            .for_each(|(a, b)| *a += b);
        done[b] = true;
        Ok(())
    }

    /// Drops the step's tentative work and the update it began, for `why` (the buckets not
    /// applied yet are not either: the completion updates the whole range).
    pub(crate) fn drop_work(&self, st: &mut State, work: &mut Work, why: &str) {
        if work.of.take().is_some() {
            st.track.discard(self.index, why);
        }
        work.update = None;
    }

    /// At the barrier's completion with `slots` (under the `work` lock, the state locked as
    /// `st`): the step's tentative work when it is exactly what the whole-range update of
    /// these slots would compute, else None (the work is dropped; its pending version is
    /// handed back for the whole-range update to overwrite, when it is of this step).
    pub(crate) fn take_work(
        &self,
        st: &mut State,
        work: &mut Work,
        step: u64,
        slots: &[super::Slot],
    ) -> (Option<Finish>, Option<crate::store::Update>) {
        let index = self.index;
        let track = std::mem::take(&mut st.track);
        let Some(basis) = work.of.take() else {
            return (None, None);
        };
        let update = work.update.take();
        if basis.step != step {
            return (None, None);
        }
        let same = !track.broken
            && track.step == step
            && basis.ranks.len() == slots.len()
            && slots.iter().zip(&basis.ranks).all(|(s, &r)| s.rank == r)
            && slots
                .iter()
                .zip(&basis.samples)
                .all(|(s, &n)| s.samples == n)
            && slots.iter().zip(&basis.bufs).all(
                |(s, buf)| matches!(&s.grad, Grad::Received(rec) if Arc::ptr_eq(&rec.buf, buf)),
            )
            && !basis.bufs.iter().any(|b| b.fault().is_some())
            && Arc::ptr_eq(&basis.opt, &st.opt)
            && st.unused.skipped_by_all(step, &basis.ranks) == basis.skip;
        if !same {
            tracing::debug!(
                "shard {index}: step {step}: the per-bucket work does not match the completed barrier; the whole range is updated"
            );
            return (None, update);
        }
        let finish = Finish {
            basis,
            update: update.expect("work begun with its update"),
        };
        (Some(finish), None)
    }

    /// Completes a step from its tentative work: applies the buckets not applied yet (every
    /// gradient is in), and returns the pending version, the new optimizer state, the norms
    /// and the unreached tensors; Err(pending version) when a bucket fails (the caller then
    /// updates the whole range from the intact state).
    pub(crate) fn finish_buckets(
        &self,
        work: &mut Work,
        finish: Finish,
    ) -> Result<Finished, crate::store::Update> {
        let Finish { basis, update } = finish;
        work.update = Some(update);
        work.of = Some(basis);
        let early = work.early;
        for b in 0..self.buckets.len() {
            if work.done[b] {
                continue;
            }
            let threads = threads_for(self.buckets[b].range.len());
            if let Err(why) = self.run_bucket(work, b, threads) {
                tracing::warn!(
                    "shard {}: a bucket update failed at the barrier's completion ({why}); the whole range is updated",
                    self.index
                );
                work.of = None;
                return Err(work.update.take().expect("work begun"));
            }
        }
        let basis = work.of.take().expect("work begun");
        let pending = work.update.take().expect("work begun");
        let opt = OptState {
            steps: basis.opt.steps,
            m: std::mem::take(&mut work.m),
            v: std::mem::take(&mut work.v),
            skipped: basis.opt.skipped.clone(),
        };
        let norms = work.norms.take().unwrap_or(Norms {
            aggregate: 0.0,
            inputs: vec![0.0; basis.ranks.len()],
        });
        Ok(Finished {
            pending,
            opt,
            old: basis.opt,
            norms,
            skip: basis.skip,
            early,
        })
    }

    /// Keeps the `m`/`v` allocations of an optimizer state left behind for the next step's
    /// pending state.
    pub(crate) fn recycle_opt(&self, work: &mut Work, old: Arc<OptState>) {
        if let Ok(old) = Arc::try_unwrap(old) {
            work.m = old.m;
            work.v = old.v;
        }
    }
}

/// A step's tentative work, found exact at the barrier's completion.
#[derive(Debug)]
pub(crate) struct Finish {
    basis: Basis,
    update: crate::store::Update,
}

/// What [`Shard::finish_buckets`] gives the completion.
#[derive(Debug)]
pub(crate) struct Finished {
    pub pending: crate::store::Update,
    pub opt: OptState,
    /// The optimizer state of the version before (its buffers are recycled).
    pub old: Arc<OptState>,
    pub norms: Norms,
    pub skip: Vec<u32>,
    /// Buckets applied before the barrier completed.
    pub early: u32,
}

/// Per-bucket apply of values that lie in place.
impl Shard {
    /// A push of `rank` for `step` whose values lie in place in `src` (a shared-memory
    /// gradient board's range), on a shard that applies per bucket: read where they lie (not
    /// copied), bucket by bucket, each bucket checked for finite values and added to the
    /// push's fingerprint while in cache, then published to the applier, which runs beside the
    /// pass when buckets became ready (the last push of a bucket: its values are still in
    /// cache), until the barrier completes. Blocking: call it from a blocking thread. None
    /// when this shard applies the whole range only or the step is not the one being gathered
    /// (the caller checks the whole range then, [`Shard::check_in_place`]). A value that is not
    /// finite refuses the push at the end of the pass ([`PsError::NonFinite`], the first such
    /// index in the shard's range); the work that used its buckets is discarded with the
    /// intake (dropped uncounted), as for a gRPC push refused halfway.
    /// Keep the intake until [`Shard::accept`] answered.
    pub fn receive_in_place(
        self: &Arc<Self>,
        rank: u32,
        step: u64,
        src: Arc<dyn PushSource>,
    ) -> Option<PsResult<(Grad, u64, Intake)>> {
        if self.buckets.is_empty() {
            return None;
        }
        let buf = RecvBuf::in_place(src);
        let mut intake = self.intake_into(rank, step, Arc::new(buf))?;
        Some(
            self.read_in_place(rank, &mut intake)
                .map(|(grad, fp)| (grad, fp, intake)),
        )
    }

    /// Runs [`Shard::run_buckets`] on a thread of its own, beside the pass that publishes the
    /// buckets (inline when no thread can be had). It stops once the barrier completed: the
    /// completion applies the buckets left, each on several threads.
    fn start_applier(self: &Arc<Self>) {
        // the step's work begun here, before the push is counted: the completion then finds
        // it, whether or not the applier got to a bucket first
        self.begin_if_usable();
        let shard = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ps-buckets".into())
            .spawn(move || shard.run_buckets());
        if spawned.is_err() {
            self.run_buckets();
        }
    }

    /// The pass of [`Shard::receive_in_place`] over the view's values, bucket by bucket.
    fn read_in_place(self: &Arc<Self>, rank: u32, intake: &mut Intake) -> PsResult<(Grad, u64)> {
        let buf = intake.buf().clone();
        let mut check = ps_net::wire::StreamCheck::new(buf.len());
        for bucket in &self.buckets {
            let r = bucket.range.clone();
            // SAFETY: a view is never written through (RecvBuf::in_place)
            let values = unsafe { buf.part(r.clone()) };
            // finiteness and the fingerprint in one (vectorised) pass; a bucket holding a value
            // that is not finite fails its update, if it comes to one, which discards the work
            check.push_values(r.start as u64, values)?;
            intake.mark(r)?;
            // SAFETY: the region's values are the source's, in place (nothing to write)
            if unsafe { intake.publish() } {
                self.start_applier();
            }
        }
        if let Some(fault) = buf.fault() {
            return Err(fault.refused(rank));
        }
        let fp = check.finish()?;
        buf.complete.store(true, Ordering::Release);
        // the intake lives on until the push is counted or refused, as a gRPC push's
        let grad = Grad::Received(Received { buf, permit: None });
        Ok((grad, fp))
    }
}
