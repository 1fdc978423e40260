//! A step's end: [`Shard::apply`] (take the step's work, finish the buckets or update the
//! whole range, commit or abandon the new version) and [`Shard::complete`] (apply, figures,
//! checkpoint).

use crate::intake::Acc;
use crate::{
    Applied, Grad, RankNorm, Shard, Slot, StepError, StepFigures, StepObserver, bucket, store,
    unused,
};
use ps_optim::OptState;
use ps_proto::{PsError, PsResult};
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Shard {
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
    pub fn apply(&self, slots: Vec<Slot>) -> PsResult<StepFigures> {
        let started = Instant::now();
        // waits for a fold under way, and for a bucket update under way, to finish
        let mut acc = self.acc.lock().unwrap_or_else(|p| p.into_inner());
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        let taken = self.take_step(&mut work, &slots);
        let (step, waiting_since) = (taken.step, taken.waiting_since);
        let lr = self.schedule.lr(step);
        let (pending, applied, old_opt, current_opt) =
            self.update_step(&mut work, &acc, &slots, taken, lr);
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
            Err(why) => return Err(self.abandon(pending, opt, why)),
        };
        opt.steps += 1;

        let now = Instant::now();
        let figures = self.figures(
            (step, lr, grad_sq_norm),
            &slots,
            (rank_sq, clip, buckets),
            (started, waiting_since, now),
        );
        self.commit(step, slots, &mut acc, (pending, opt, &skip), now);
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

    /// The step's work taken under the state lock: the tentative per-bucket work when it is
    /// exactly this step's ([`Shard::take_work`]), else the pending version to update the
    /// whole range into, and the optimizer state of the current version.
    fn take_step(&self, work: &mut bucket::Work, slots: &[Slot]) -> Taken {
        let mut st = self.lock();
        let step = st.barrier.step();
        let (tentative, begun) = self.take_work(&mut st, work, step, slots);
        let pending = match (&tentative, begun) {
            (Some(_), _) => None,
            (None, Some(update)) => Some(update),
            (None, None) => Some(st.store.begin(step + 1)),
        };
        Taken {
            step,
            tentative,
            pending,
            current_opt: Some(std::mem::take(&mut st.opt)),
            waiting_since: st.barrier.waiting_since(),
        }
    }

    /// The update of the step: the buckets not applied yet, when the tentative work is kept
    /// ([`Shard::finish_buckets`]), else the whole range ([`Shard::whole_range`]). Returns the
    /// pending version, what was computed, the optimizer state to recycle (per bucket) and
    /// the current one (still shared until the commit).
    #[allow(clippy::type_complexity)]
    fn update_step(
        &self,
        work: &mut bucket::Work,
        acc: &Acc,
        slots: &[Slot],
        taken: Taken,
        lr: f64,
    ) -> (
        store::Update,
        Applied,
        Option<Arc<OptState>>,
        Option<Arc<OptState>>,
    ) {
        let Taken {
            step,
            tentative,
            pending,
            mut current_opt,
            ..
        } = taken;
        let mut pending = match tentative.map(|t| self.finish_buckets(work, t)) {
            Some(Ok(done)) => {
                let rank_sq = slots
                    .iter()
                    .zip(&done.norms.inputs)
                    .map(|(s, &sq_norm)| RankNorm {
                        rank: s.rank,
                        samples: s.samples,
                        sq_norm,
                    })
                    .collect();
                let applied = Applied {
                    result: Ok(done.norms.aggregate),
                    rank_sq,
                    skip: unused::local_parts(&self.spec, &self.range, &done.skip),
                    clip: None,
                    opt: done.opt,
                    buckets: Some(done.early),
                };
                return (done.pending, applied, Some(done.old), current_opt);
            }
            Some(Err(update)) => update,
            None => pending.expect("begun"),
        };
        // the only holder now (a bucket update's clone went with its work): no copy
        let opt = Arc::unwrap_or_clone(current_opt.take().expect("taken once"));
        let applied = self.whole_range(step, slots, acc, &mut pending, opt, lr);
        (pending, applied, None, current_opt)
    }

    /// A step refused by its update (`why`): the pending version abandoned, the optimizer
    /// state kept as it is, the run failed; wakes whoever waits.
    fn abandon(&self, pending: store::Update, opt: OptState, why: StepError) -> PsError {
        let why = why.to_string();
        tracing::error!("shard {}: {why}", self.index);
        {
            let mut st = self.lock();
            st.store.abandon(pending);
            st.opt = Arc::new(opt);
            st.failed = Some(why.clone());
        }
        self.wake();
        self.version_tx.send_modify(|_| {});
        PsError::RunFailed(why)
    }

    /// Commits the new version of `step` under the state lock: the parameters, the optimizer
    /// state (`skip`: the tensors no rank reached, counted), the buffers rank 0 put, the
    /// gradient buffers back to the spares, the accumulator reset for the next step.
    fn commit(
        &self,
        step: u64,
        slots: Vec<Slot>,
        acc: &mut Acc,
        (pending, mut opt, skip): (store::Update, OptState, &[(u32, std::ops::Range<usize>)]),
        now: Instant,
    ) {
        let mut st = self.lock();
        st.store.commit(pending);
        if !skip.is_empty() && opt.skipped.len() < self.spec.tensors.len() {
            opt.skipped.resize(self.spec.tensors.len(), 0);
        }
        for (t, _) in skip {
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

    /// An update refused before any arithmetic: `why`, the state as it was.
    pub(crate) fn refused(&self, why: StepError, opt: OptState) -> Applied {
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
    pub(crate) fn rank_norms(
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
                    Grad::Owned(_) | Grad::InPlace(_) | Grad::Received(_) => {
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
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What [`Shard::apply`] takes under the state lock.
struct Taken {
    step: u64,
    tentative: Option<bucket::Finish>,
    pending: Option<store::Update>,
    current_opt: Option<Arc<OptState>>,
    waiting_since: Instant,
}
