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
}

impl Acc {
    /// True when some gradient has been folded.
    pub fn folded(&self) -> bool {
        self.values.is_some()
    }
}

/// Values per block of [`fold`] (as in the fused update).
const BLOCK: usize = 2048;

/// Folds `src` with coefficient `c` into `acc` (`first`: `acc` is empty and becomes `c src`),
/// with the fused update's exact operations. With `check`, a non-finite value of `src`
/// (a shared-memory gradient written after its push was checked) stops the fold: its index and
/// value; `acc` must then be discarded.
pub fn fold(
    acc: &mut Vec<f32>,
    src: &[f32],
    c: f32,
    first: bool,
    check: bool,
) -> Result<(), (usize, f32)> {
    if first {
        acc.clear();
        acc.resize(src.len(), 0.0);
    }
    assert_eq!(acc.len(), src.len(), "fold: lengths differ");
    let mut at = 0;
    while at < src.len() {
        let end = (at + BLOCK).min(src.len());
        let (a, x) = (&mut acc[at..end], &src[at..end]);
        match (first, c == 1.0) {
            (true, true) => a.copy_from_slice(x),
            (true, false) => a.iter_mut().zip(x).for_each(|(a, &x)| *a = c * x),
            (false, true) => a.iter_mut().zip(x).for_each(|(a, &x)| *a += x),
            (false, false) => a.iter_mut().zip(x).for_each(|(a, &x)| *a += c * x),
        }
        if check && let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return Err((at + i, x[i]));
        }
        at = end;
    }
    Ok(())
}

/// Scales `values` in place by `c` (`values` becomes `c values` exactly as [`fold`] would
/// write it into an empty accumulator).
pub fn scale_in_place(values: &mut [f32], c: f32) {
    if c != 1.0 {
        values.iter_mut().for_each(|v| *v *= c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::update::{self, Simd, UpdateInputs, fused_update};
    use ps_common::config::Aggregation;
    use ps_common::optim::Optimizer;

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
                    },
                    &mut next,
                    &mut st.m,
                    &mut st.v,
                )
                .unwrap();
                (bits(&next), bits(&st.m), sq.to_bits())
            };
            let all: Vec<&[f32]> = g.iter().map(Vec::as_slice).collect();
            let reference = run(&all, &coeffs, 0, Simd::Portable);
            for split in 1..w {
                let mut acc = Vec::new();
                for r in 0..split {
                    fold(&mut acc, &g[r], coeffs[r], r == 0, false).unwrap();
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
                scale_in_place(&mut own, coeffs[0]);
                let mut acc0 = Vec::new();
                fold(&mut acc0, &g[0], coeffs[0], true, false).unwrap();
                assert_eq!(bits(&own), bits(&acc0));
            }
        }
    }

    #[test]
    fn a_non_finite_checked_source_is_named() {
        let mut src = vec![1.0f32; 5000];
        src[4321] = f32::NAN;
        let mut acc = vec![0.0; 5000];
        let e = fold(&mut acc, &src, 0.5, false, true).unwrap_err();
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
