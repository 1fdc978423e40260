//! The whole-range update ([`Shard::apply`] when the step is not applied per bucket): the
//! inputs in rank order (the accumulator first), the exact sum, the parts of the range left
//! alone or updated again on their own, clipping, the fused update, and why a step is refused.

use crate::intake::Acc;
use crate::update::{self, Simd, UpdateInputs, fused_update, threads_for};
use crate::{Applied, NormError, Shard, Slot, StepError, store, unused};
use ps_config::Aggregation;
use ps_optim::OptState;
use std::ops::Range;

/// The optimizer state (`m`, `v`) of each part the fused update must leave or redo: the
/// parts no rank reached (`skip`) and those updated again on their own (`reruns`).
#[allow(clippy::type_complexity)]
fn kept_state(
    skip: &[(u32, Range<usize>)],
    reruns: &[(u64, Range<usize>, Option<usize>)],
    opt: &OptState,
) -> Vec<(Range<usize>, Vec<f32>, Vec<f32>)> {
    skip.iter()
        .map(|(_, r)| r.clone())
        .chain(reruns.iter().map(|(_, r, _)| r.clone()))
        .map(|r| {
            let m = opt.m.get(r.clone()).map_or_else(Vec::new, <[f32]>::to_vec);
            let v = opt.v.get(r.clone()).map_or_else(Vec::new, <[f32]>::to_vec);
            (r, m, v)
        })
        .collect()
}

impl Shard {
    /// The whole-range update of `slots` (and of the accumulator, when gradients were folded)
    /// into `pending`, from optimizer state `opt`: the fused update over the range, tensors no
    /// rank reached kept as they were, those of parameter groups and Adam's tensors behind
    /// updated again on their own; with `[optimizer] clip_norm`, the aggregate first and its
    /// global norm. The result says why the step is refused, when it is.
    pub(crate) fn whole_range(
        &self,
        step: u64,
        slots: &[Slot],
        acc: &Acc,
        pending: &mut store::Update,
        mut opt: OptState,
        lr: f64,
    ) -> Applied {
        let folded = acc.step == step && acc.folded();
        let mut exact_sum = Vec::new();
        let (mut grads, mut cs, mut ranks) = self.inputs(slots, acc, folded);
        // the exact sum: one input, the partial sums added without rounding and rounded once
        if let Some(m) = self.exact {
            match exact_aggregate(&grads, self.len(), &mut exact_sum) {
                Ok(()) => {
                    grads = vec![&exact_sum];
                    cs = vec![self.exact_coefficient(m, slots)];
                    ranks.truncate(1);
                }
                Err((i, why)) => {
                    let e = StepError::ExactSum {
                        step,
                        rank: ranks[i],
                        shard: self.index,
                        why,
                    };
                    return self.refused(e, opt);
                }
            }
        }
        // tensors no rank reached are not updated; Adam's bias correction of a tensor skipped
        // before counts its own steps ([`unused`]); a tensor of a parameter group is updated
        // with its group's settings: both are updated again on their own after the fused
        // update, from the state kept before it
        let (skip, reruns) = self.untouched(step, slots, &opt);
        let kept = kept_state(&skip, &reruns, &opt);
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
        let (clip, exchange_failed, before_clip) =
            self.clip_first(step, aggregated, &skip, &mut clipped);
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
        if updated.is_ok()
            && exchange_failed.is_none()
            && !kept.is_empty()
            && let Err(e) = self.keep_and_rerun(&kept, &reruns, inputs, next, &mut opt, lr)
        {
            updated = Err(e);
        }
        // (a step refused for its norm exchange has no per-rank norms)
        let rank_sq = updated
            .as_ref()
            .ok()
            // the exact sum's one input is no rank's own: no per-rank norms
            .filter(|_| exchange_failed.is_none() && self.exact.is_none())
            .and_then(|n| self.rank_norms(acc, folded, slots, &ranks, &n.inputs))
            .unwrap_or_default();
        let result = self.verdict(step, slots, pending, (updated, exchange_failed), &ranks);
        Applied {
            result,
            rank_sq,
            skip,
            clip,
            opt,
            buckets: None,
        }
    }

    /// The update's inputs in order, their coefficients and ranks: the accumulator first when
    /// gradients were `folded` (it holds the lowest ranks, coefficient 1), the others after it
    /// in rank order.
    #[allow(clippy::type_complexity)]
    fn inputs<'a>(
        &self,
        slots: &'a [Slot],
        acc: &'a Acc,
        folded: bool,
    ) -> (Vec<&'a [f32]>, Vec<f32>, Vec<u32>) {
        let samples: Vec<u32> = slots.iter().map(|s| s.samples).collect();
        let coeffs = update::coefficients(self.aggregation, &samples);
        let mut grads: Vec<&[f32]> = Vec::with_capacity(slots.len() + 1);
        let mut cs: Vec<f32> = Vec::with_capacity(slots.len() + 1);
        let mut ranks: Vec<u32> = Vec::with_capacity(slots.len() + 1);
        if folded {
            grads.push(acc.values.as_deref().expect("folded"));
            cs.push(self.rescale(acc, slots));
            ranks.push(slots.first().map_or(0, |s| s.rank));
        }
        for (s, &c) in slots.iter().zip(&coeffs) {
            // in place or received: a writer breaking its plane's protocol (a worker writing
            // its board before pulling the version this update makes) can only change the
            // values read, which are checked for finiteness right where they are used
            let Some(src) = s.grad.source() else {
                continue; // folded, or not kept
            };
            grads.push(src.values());
            cs.push(c);
            ranks.push(s.rank);
        }
        (grads, cs, ranks)
    }

    /// With `[optimizer] clip_norm`: the aggregate of `aggregated` into `clipped`, and its
    /// global norm from every shard: (the norm and the coefficient, why the exchange failed,
    /// the aggregate's norms or its non-finite input). Nothing without clipping.
    #[allow(clippy::type_complexity)]
    fn clip_first(
        &self,
        step: u64,
        aggregated: UpdateInputs<'_>,
        skip: &[(u32, Range<usize>)],
        clipped: &mut Vec<f32>,
    ) -> (
        Option<(f32, f32)>,
        Option<NormError>,
        Option<Result<update::Norms, update::NonFiniteInput>>,
    ) {
        let mut clip = None;
        let mut exchange_failed = None;
        let before_clip = self.clip_norm.map(|max_norm| {
            clipped.resize(aggregated.current.len(), 0.0);
            let norms = update::aggregate_only(aggregated, clipped)?;
            match self.global_norm(step, clipped, skip) {
                Ok(total) => clip = Some((total, ps_model::clip::coefficient(max_norm, total))),
                Err(why) => exchange_failed = Some(why),
            }
            Ok(norms)
        });
        (clip, exchange_failed, before_clip)
    }

    /// After the fused update: the parts `kept` (tensors no rank reached, and those updated
    /// again) put back as they were, then the `reruns` updated on their own with their group's
    /// settings and their own Adam steps. The last update's error, if any.
    fn keep_and_rerun(
        &self,
        kept: &[(Range<usize>, Vec<f32>, Vec<f32>)],
        reruns: &[(u64, Range<usize>, Option<usize>)],
        inputs: UpdateInputs<'_>,
        next: &mut [f32],
        opt: &mut OptState,
        lr: f64,
    ) -> Result<(), update::NonFiniteInput> {
        let current = inputs.current;
        for (r, m, v) in kept {
            next[r.clone()].copy_from_slice(&current[r.clone()]);
            if !m.is_empty() {
                opt.m[r.clone()].copy_from_slice(m);
            }
            if !v.is_empty() {
                opt.v[r.clone()].copy_from_slice(v);
            }
        }
        let mut last = Ok(());
        for (steps_done, r, group) in reruns {
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
                last = Err(e);
            }
        }
        last
    }

    /// The update's result: the aggregate's squared norm, or why the step is refused (the norm
    /// exchange failed, a board truncated under the update, a non-finite value read).
    fn verdict(
        &self,
        step: u64,
        slots: &[Slot],
        pending: &store::Update,
        (updated, exchange_failed): (
            Result<update::Norms, update::NonFiniteInput>,
            Option<NormError>,
        ),
        ranks: &[u32],
    ) -> Result<f64, StepError> {
        // memory that faulted under the update (a truncated board, read as zeros): not the
        // rank's values
        let truncated = slots
            .iter()
            .find(|s| s.grad.source().is_some_and(|src| src.fault().is_some()))
            .map(|s| s.rank);
        match (updated, truncated, exchange_failed) {
            (_, _, Some(why)) => Err(StepError::NormExchange { step, why }),
            (_, Some(rank), None) => Err(StepError::BoardTruncated { step, rank }),
            _ if pending.faulted() => Err(StepError::ParamsTruncated {
                step,
                shard: self.index,
            }),
            (Err(bad), None, None) => Err(StepError::NonFinite {
                step,
                rank: ranks[bad.source],
                value: bad.value,
                index: bad.index,
                shard: self.index,
            }),
            (Ok(norms), None, None) => Ok(norms.aggregate),
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
}

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

/// `v[r]`, or `v` itself when empty (an optimizer buffer the optimizer does not keep).
pub(crate) fn block<'a>(v: &'a mut [f32], r: &Range<usize>) -> &'a mut [f32] {
    if v.is_empty() { v } else { &mut v[r.clone()] }
}
