//! The fused update of one step, a pure function over slices: aggregate the ranks' gradients
//! in rank order (bit-reproducible whatever the arrival order, the thread count or the
//! instruction set), take the squared norm, apply the optimizer, in one cache-blocked pass,
//! split across cores for large shards. Finiteness rides along the aggregation: a block whose
//! aggregate is not finite because one of its inputs is not stops the update before its
//! optimizer step, and the function says where the value came from.

use ps_config::Aggregation;
use ps_optim::{Optimizer, StepCoeffs};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// A non-finite input found by [`fused_update`] at the point of use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NonFiniteInput {
    /// Index in the shard's slice.
    pub index: usize,
    /// Position of the gradient in `grads` (the caller maps it to a rank).
    pub source: usize,
    /// The value.
    pub value: f32,
}

/// Instruction set of the update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    /// AVX2 where the CPU has it (decided at run time), portable code otherwise.
    Auto,
    /// Portable code only (for the bit-identity tests).
    Portable,
}

/// What one update reads and how it runs.
#[derive(Debug, Clone, Copy)]
pub struct UpdateInputs<'a> {
    /// The optimizer.
    pub optimizer: &'a Optimizer,
    /// Its per-step scalars.
    pub step: StepCoeffs,
    /// Parameters of the current version.
    pub current: &'a [f32],
    /// Gradient slices, in rank order, each of `current.len()` values.
    pub grads: &'a [&'a [f32]],
    /// Aggregation coefficient of each gradient ([`coefficients`]).
    pub coeffs: &'a [f32],
    /// Threads (1 = this one only); [`threads_for`] picks the default.
    pub threads: usize,
    /// Instruction set.
    pub simd: Simd,
    /// The first `checked` gradients are known to hold only finite values or the overflow of
    /// finite ones (an accumulator of gradients folded earlier): a non-finite aggregate is
    /// searched for in the others only.
    pub checked: usize,
    /// The optimizer state to start from (`m`, `v`, aligned with `current`; empty for a buffer
    /// the optimizer does not keep), when it is not what `m`/`v` hold: each block is copied in
    /// right before its update, while in cache (no pass of its own over memory). None: `m`/`v`
    /// are advanced in place.
    pub state_from: Option<(&'a [f32], &'a [f32])>,
}

/// The aggregation coefficient of each of the gradients with these sample counts, in order.
pub fn coefficients(aggregation: Aggregation, samples: &[u32]) -> Vec<f32> {
    let total: u64 = samples.iter().map(|&s| u64::from(s)).sum();
    samples
        .iter()
        .map(|&s| match aggregation {
            Aggregation::Sum => 1.0,
            Aggregation::Mean => 1.0 / samples.len() as f32,
            Aggregation::Weighted if total == 0 => 0.0,
            Aggregation::Weighted => (f64::from(s) / total as f64) as f32,
        })
        .collect()
}

/// Squared norms an update takes on its way (the gradient noise scale's inputs).
#[derive(Debug, Clone, PartialEq)]
pub struct Norms {
    /// |Σ_r c_r g_r|², the aggregated gradient's.
    pub aggregate: f64,
    /// |g_r|² of each input, in the order of `grads` (taken from each block of the input while
    /// the aggregation has it in cache: no extra pass over memory).
    pub inputs: Vec<f64>,
}

/// `next = optimizer(current, Σ_r coeffs[r] · grads[r])`, advancing the optimizer buffers `m`
/// and `v` (empty when the optimizer keeps none) in place; returns the squared norms of the
/// aggregated gradient and of each input. `next` must not alias anything else.
///
/// A gradient value that is NaN or infinite is reported as an error, and the block holding it
/// (and, on other threads, the blocks not yet started) is not updated: `next` and `m`/`v` are
/// then partly written and must be discarded by the caller; `current` is never written.
pub fn fused_update(
    inp: UpdateInputs<'_>,
    next: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
) -> Result<Norms, NonFiniteInput> {
    fused(inp, next, m, v, true)
}

/// The aggregation of [`fused_update`] alone: `out = Σ_r coeffs[r] · grads[r]` (the same
/// values, bit for bit), with the same norms and finiteness check; the optimizer is not
/// applied and `inp.current` is only read for its length. Gradient clipping needs the whole
/// aggregate's norm before any update (`ps_model::clip`).
pub fn aggregate_only(inp: UpdateInputs<'_>, out: &mut [f32]) -> Result<Norms, NonFiniteInput> {
    fused(inp, out, &mut [], &mut [], false)
}

/// [`fused_update`] (`apply`), or [`aggregate_only`].
fn fused(
    inp: UpdateInputs<'_>,
    next: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    apply: bool,
) -> Result<Norms, NonFiniteInput> {
    let len = inp.current.len();
    assert_eq!(
        next.len(),
        len,
        "fused update: next and current lengths differ"
    );
    assert_eq!(
        inp.grads.len(),
        inp.coeffs.len(),
        "one coefficient per gradient"
    );
    assert!(inp.grads.iter().all(|g| g.len() == len), "gradient length");
    let threads = inp.threads.max(1);
    // several pieces per thread, taken from a shared queue: a helper thread that starts late
    // (the other core is busy) leaves its pieces to the others instead of making every one
    // wait for it
    let pieces = if threads == 1 { 1 } else { 4 * threads };
    let chunk = len.div_ceil(pieces).max(1);
    let stop = AtomicBool::new(false);
    let queue = Mutex::new(
        next.chunks_mut(chunk)
            .zip(split_parts(m, chunk, pieces))
            .zip(split_parts(v, chunk, pieces))
            .enumerate(),
    );
    let work = || {
        let mut done = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let piece = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            let Some((i, ((p, m), v))) = piece else {
                break;
            };
            let r = run(&inp, i * chunk, p, m, v, apply);
            if r.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            done.push((i, r));
        }
        done
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
    let mut norms = Norms {
        aggregate: 0.0,
        inputs: vec![0.0; inp.grads.len()],
    };
    for (_, r) in sqs {
        let (sq, inputs) = r?;
        norms.aggregate += sq;
        norms
            .inputs
            .iter_mut()
            .zip(inputs)
            .for_each(|(a, b)| *a += b);
    }
    Ok(norms)
}

/// A piece's squared norms: the aggregate's and each input's.
type PieceNorms = (f64, Vec<f64>);

/// Updates `p` (values `lo..lo + p.len()` of the shard) and its optimizer state; returns the
/// squared norms of that part of the aggregated gradient and of each input.
fn run(
    inp: &UpdateInputs<'_>,
    lo: usize,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    apply: bool,
) -> Result<PieceNorms, NonFiniteInput> {
    #[cfg(target_arch = "x86_64")]
    if inp.simd == Simd::Auto && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { run_avx2(inp, lo, p, m, v, apply) };
    }
    run_portable(inp, lo, p, m, v, apply)
}

/// [`run_portable`] compiled for AVX2: element-wise IEEE operations in the same order, so the
/// numbers are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn run_avx2(
    inp: &UpdateInputs<'_>,
    lo: usize,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    apply: bool,
) -> Result<PieceNorms, NonFiniteInput> {
    run_portable(inp, lo, p, m, v, apply)
}

/// Cache-sized blocks: aggregate into a block buffer, take its norm, copy the old parameters in
/// and update them while the block is in L1/L2, so memory sees one read of every input and one
/// write of the output (gradients are only read). Without `apply`, `p` receives the aggregate.
#[inline(always)]
fn run_portable(
    inp: &UpdateInputs<'_>,
    lo: usize,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    apply: bool,
) -> Result<PieceNorms, NonFiniteInput> {
    let mut sq = 0.0;
    let mut inputs = vec![0.0; inp.grads.len()];
    let mut g = vec![0f32; BLOCK.min(p.len())];
    let mut at = 0;
    while at < p.len() {
        let end = (at + BLOCK).min(p.len());
        let gb = &mut g[..end - at];
        let block_sq = aggregate(gb, inp.grads, inp.coeffs, lo + at, &mut inputs);
        // Σ g² in f64 of at most BLOCK f32 values is finite exactly when every value is
        if !block_sq.is_finite()
            && let Some(bad) = find_non_finite(inp.grads, inp.checked, lo + at, end - at)
        {
            return Err(bad);
        }
        sq += block_sq;
        let pb = &mut p[at..end];
        if !apply {
            pb.copy_from_slice(gb);
            at = end;
            continue;
        }
        pb.copy_from_slice(&inp.current[lo + at..lo + end]);
        let (mb, vb) = (block_of(m, at, end), block_of(v, at, end));
        if let Some((m0, v0)) = inp.state_from {
            if !mb.is_empty() {
                mb.copy_from_slice(&m0[lo + at..lo + end]);
            }
            if !vb.is_empty() {
                vb.copy_from_slice(&v0[lo + at..lo + end]);
            }
        }
        inp.optimizer.update_chunk(inp.step, pb, gb, mb, vb);
        at = end;
    }
    Ok((sq, inputs))
}

/// The first non-finite input of values `lo..lo + n`, by index and then rank; None when every
/// input is finite (the aggregate overflowed: applied as before, like any large gradient).
#[cold]
fn find_non_finite(
    grads: &[&[f32]],
    checked: usize,
    lo: usize,
    n: usize,
) -> Option<NonFiniteInput> {
    (lo..lo + n).find_map(|i| {
        grads
            .iter()
            .enumerate()
            .skip(checked)
            .find_map(|(source, g)| {
                let value = g[i];
                (!value.is_finite()).then_some(NonFiniteInput {
                    index: i,
                    source,
                    value,
                })
            })
    })
}

/// `g = Σ_r cs[r] * grads[r][lo..lo + g.len()]`, summed in rank order (bit-reproducible
/// whatever the arrival order and however the shard is split into blocks), in straight-line
/// loops over slices; returns the squared norm of the result, and adds each input's block's
/// to `input_sq` (read again from L1, where the aggregation just brought it).
#[inline(always)]
fn aggregate(g: &mut [f32], grads: &[&[f32]], cs: &[f32], lo: usize, input_sq: &mut [f64]) -> f64 {
    let n = g.len();
    for (r, (src, &c)) in grads.iter().zip(cs).enumerate() {
        let src = &src[lo..lo + n];
        match (r, c == 1.0) {
            (0, true) => g.copy_from_slice(src),
            (0, false) => g.iter_mut().zip(src).for_each(|(a, &x)| *a = c * x),
            (_, true) => g.iter_mut().zip(src).for_each(|(a, &x)| *a += x),
            (_, false) => g.iter_mut().zip(src).for_each(|(a, &x)| *a += c * x),
        }
        input_sq[r] += sum_of_squares(src);
    }
    sum_of_squares(g)
}

pub(crate) use ps_optim::sum_of_squares;

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

/// How many threads an update of `len` values uses by default.
pub fn threads_for(len: usize) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, w: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
        let current = (0..len)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let grads = (0..w)
            .map(|r| {
                (0..len)
                    .map(|i| (((i * 13 + r * 7) % 29) as f32 - 14.0) * 1e-3 * (r + 1) as f32)
                    .collect()
            })
            .collect();
        (current, grads)
    }

    struct Run {
        next: Vec<f32>,
        m: Vec<f32>,
        v: Vec<f32>,
        sq: Result<f64, NonFiniteInput>,
        inputs: Vec<f64>,
    }

    fn run_with(
        opt: &Optimizer,
        current: &[f32],
        grads: &[Vec<f32>],
        threads: usize,
        simd: Simd,
    ) -> Run {
        let mut st = opt.init_state(current.len());
        let grads: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
        let samples: Vec<u32> = (0..grads.len() as u32).map(|r| 3 + r).collect();
        let coeffs = coefficients(Aggregation::Weighted, &samples);
        let mut next = vec![0f32; current.len()];
        let inp = UpdateInputs {
            optimizer: opt,
            step: opt.coeffs(0, 0.05),
            current,
            grads: &grads,
            coeffs: &coeffs,
            threads,
            simd,
            checked: 0,
            state_from: None,
        };
        let norms = fused_update(inp, &mut next, &mut st.m, &mut st.v);
        Run {
            next,
            m: st.m,
            v: st.v,
            inputs: norms.as_ref().map_or(Vec::new(), |n| n.inputs.clone()),
            sq: norms.map(|n| n.aggregate),
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn optimizers() -> Vec<Optimizer> {
        vec![
            Optimizer::Sgd {
                momentum: 0.0,
                nesterov: false,
                weight_decay: 0.0,
            },
            Optimizer::Sgd {
                momentum: 0.9,
                nesterov: true,
                weight_decay: 1e-4,
            },
            Optimizer::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                decoupled: true,
            },
        ]
    }

    #[test]
    fn bit_identical_across_thread_counts_and_instruction_sets() {
        // not a multiple of the block nor of the pieces: ragged ends everywhere
        let (current, grads) = data(3 * BLOCK * 4 + 77, 3);
        for opt in optimizers() {
            let reference = run_with(&opt, &current, &grads, 1, Simd::Portable);
            let sq = reference.sq.unwrap();
            assert!(sq > 0.0 && sq.is_finite());
            for threads in [1, 2, 3, 5] {
                // the norm is summed per piece, and the pieces follow the thread count: equal
                // to rounding across thread counts, bit-identical across instruction sets
                let portable = run_with(&opt, &current, &grads, threads, Simd::Portable);
                let portable_sq = portable.sq.unwrap();
                assert!(
                    (portable_sq - sq).abs() <= 1e-12 * sq,
                    "{opt:?}, {threads} threads"
                );
                for simd in [Simd::Portable, Simd::Auto] {
                    let r = run_with(&opt, &current, &grads, threads, simd);
                    let what = format!("{opt:?}, {threads} threads, {simd:?}");
                    assert_eq!(r.sq.unwrap().to_bits(), portable_sq.to_bits(), "{what}");
                    assert_eq!(bits(&r.next), bits(&reference.next), "{what}");
                    assert_eq!(bits(&r.m), bits(&reference.m), "{what}");
                    assert_eq!(bits(&r.v), bits(&reference.v), "{what}");
                    for (a, b) in r.inputs.iter().zip(&reference.inputs) {
                        assert!((a - b).abs() <= 1e-12 * b, "{what}: input norms {a} vs {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn matches_the_optimizer_applied_to_the_sum_in_rank_order() {
        let (current, grads) = data(1000, 2);
        let opt = Optimizer::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let r = run_with(&opt, &current, &grads, 1, Simd::Auto);
        let c = coefficients(Aggregation::Weighted, &[3, 4]);
        assert_eq!(c, vec![3.0 / 7.0, 4.0 / 7.0]);
        let mut sq = 0.0;
        for i in 0..1000 {
            let g = c[0] * grads[0][i] + c[1] * grads[1][i];
            sq += f64::from(g) * f64::from(g);
            assert_eq!(r.next[i], current[i] - 0.05 * g, "value {i}");
        }
        assert!((r.sq.unwrap() - sq).abs() <= 1e-9 * sq);
        // each input's squared norm, as taken on the way
        for (g, &got) in grads.iter().zip(&r.inputs) {
            let want: f64 = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
        }
        assert_eq!(coefficients(Aggregation::Mean, &[1, 9]), vec![0.5, 0.5]);
        assert_eq!(coefficients(Aggregation::Sum, &[1, 9]), vec![1.0, 1.0]);
        assert_eq!(coefficients(Aggregation::Weighted, &[0, 0]), vec![0.0, 0.0]);
    }

    #[test]
    fn a_non_finite_input_is_named_and_never_reaches_the_optimizer() {
        let len = 5 * BLOCK + 3;
        let (current, mut grads) = data(len, 3);
        let at = 2 * BLOCK + 17;
        grads[2][at] = f32::NAN;
        grads[1][at + 5] = f32::INFINITY;
        for threads in [1, 3] {
            for opt in optimizers() {
                let r = run_with(&opt, &current, &grads, threads, Simd::Auto);
                let e = r.sq.expect_err("NaN in rank 2's gradient");
                assert_eq!((e.index, e.source), (at, 2), "{opt:?}");
                assert!(e.value.is_nan());
                // the block with the NaN was not updated: no NaN reached the output or state
                assert!(
                    r.next.iter().chain(&r.m).chain(&r.v).all(|x| x.is_finite()),
                    "{opt:?}"
                );
            }
        }
        // an aggregate that overflows from finite inputs is not an input error (as before)
        let big = [vec![3e38f32; 10], vec![3e38f32; 10]];
        let opt = Optimizer::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let mut next = vec![0f32; 10];
        let grads: Vec<&[f32]> = big.iter().map(Vec::as_slice).collect();
        let inp = UpdateInputs {
            optimizer: &opt,
            step: opt.coeffs(0, 0.1),
            current: &[0.0; 10],
            grads: &grads,
            coeffs: &[1.0, 1.0],
            threads: 1,
            simd: Simd::Auto,
            checked: 0,
            state_from: None,
        };
        assert!(
            fused_update(inp, &mut next, &mut [], &mut [])
                .unwrap()
                .aggregate
                .is_infinite()
        );
    }
}
