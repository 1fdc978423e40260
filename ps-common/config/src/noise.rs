//! The gradient noise scale, live: from each worker's squared gradient norm (on its b_r
//! samples) and the squared norm of the aggregated gradient (on all of them), the unbiased
//! two-batch-size estimators of McCandlish et al. (2018, "An Empirical Model of Large-Batch
//! Training", appendix A) give tr(Σ) (the per-sample gradient variance, summed over
//! parameters) and |G|² (the squared norm of the true gradient); their smoothed ratio is the
//! simple noise scale B_noise = tr(Σ) / |G|².
//!
//! Generalised to what the cluster sums: worker r pushes p_r = s_r · m_r, where m_r is the mean
//! gradient of its b_r samples and s_r is 1 (loss mean) or b_r (loss sum); the shard
//! aggregates A = Σ c_r p_r. With a_r = c_r s_r, α = Σ a_r and w_r = a_r / α, A / α = Σ w_r m_r
//! is a weighted mean gradient, and for independent samples
//!   E|m_r|²   = |G|² + tr(Σ) / b_r,
//!   E|A / α|² = |G|² + tr(Σ) · k,   k = Σ w_r² / b_r,
//! so Σ_r (|m_r|² − |A/α|²) / Σ_r (1/b_r − k) estimates tr(Σ) without bias, and
//! |A/α|² − k · tr(Σ) estimates |G|². (With W equal batches b this is McCandlish's pair with
//! B_small = b, B_big = W b.) It needs two workers with samples: with one there is nothing to
//! compare.

use crate::{Aggregation, LossReduction};

/// The shard's aggregation coefficient of each worker with these sample counts (in f64; the
/// shard applies them rounded to f32).
pub fn coefficients(aggregation: Aggregation, samples: &[u32]) -> Vec<f64> {
    let total: u64 = samples.iter().map(|&s| u64::from(s)).sum();
    samples
        .iter()
        .map(|&s| match aggregation {
            Aggregation::Sum => 1.0,
            Aggregation::Mean => 1.0 / samples.len() as f64,
            Aggregation::Weighted if total == 0 => 0.0,
            Aggregation::Weighted => f64::from(s) / total as f64,
        })
        .collect()
}

/// One worker's part of a step, as the shards see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankNorm {
    /// Squared norm of the gradient the worker pushed (summed over every shard).
    pub sq_norm: f64,
    /// Its number of samples.
    pub samples: u32,
    /// Its aggregation coefficient (as the shard applied it).
    pub coeff: f64,
}

/// The two unbiased estimates of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepEstimate {
    /// tr(Σ): per-sample gradient variance, summed over parameters.
    pub trace_sigma: f64,
    /// |G|²: squared norm of the expected gradient.
    pub grad_sq: f64,
}

/// The unbiased estimates of one step from the workers' squared norms and the aggregated
/// gradient's (`agg_sq_norm`, summed over every shard). None when fewer than two workers have
/// samples, or the coefficients do not allow the comparison (all zero).
pub fn estimate(ranks: &[RankNorm], agg_sq_norm: f64, loss: LossReduction) -> Option<StepEstimate> {
    let ranks: Vec<_> = ranks.iter().filter(|r| r.samples > 0).collect();
    if ranks.len() < 2 {
        return None;
    }
    let scale = |r: &RankNorm| match loss {
        LossReduction::Mean => 1.0,
        LossReduction::Sum => f64::from(r.samples),
    };
    let alpha: f64 = ranks.iter().map(|r| r.coeff * scale(r)).sum();
    if alpha <= 0.0 || !alpha.is_finite() {
        return None;
    }
    let k: f64 = ranks
        .iter()
        .map(|r| (r.coeff * scale(r) / alpha).powi(2) / f64::from(r.samples))
        .sum();
    let big = agg_sq_norm / (alpha * alpha);
    let (mut num, mut den) = (0.0, 0.0);
    for r in &ranks {
        num += r.sq_norm / scale(r).powi(2) - big;
        den += 1.0 / f64::from(r.samples) - k;
    }
    if den <= 0.0 {
        return None;
    }
    let trace_sigma = num / den;
    Some(StepEstimate {
        trace_sigma,
        grad_sq: big - k * trace_sigma,
    })
}

/// Exponential moving averages of the two estimates (each alone, as McCandlish et al. advise:
/// the ratio of averages, not the average of noisy ratios), with Adam's bias correction so the
/// first steps are not pulled towards zero.
#[derive(Debug, Clone)]
pub struct NoiseScale {
    beta: f64,
    trace: f64,
    grad_sq: f64,
    weight: f64,
    steps: u64,
}

/// What the smoothed estimate says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Smoothed {
    /// Smoothed tr(Σ).
    pub trace_sigma: f64,
    /// Smoothed |G|².
    pub grad_sq: f64,
    /// B_noise = tr(Σ) / |G|²; None while |G|² is not yet positive (the noise dominates).
    pub b_noise: Option<f64>,
    /// Steps observed.
    pub steps: u64,
}

impl NoiseScale {
    /// `beta` is the decay per step (0.95 averages over about 20 steps).
    pub fn new(beta: f64) -> Self {
        NoiseScale {
            beta: beta.clamp(0.0, 0.999_999),
            trace: 0.0,
            grad_sq: 0.0,
            weight: 0.0,
            steps: 0,
        }
    }

    /// Adds one step's estimates (non-finite ones are skipped).
    pub fn observe(&mut self, e: StepEstimate) {
        if !e.trace_sigma.is_finite() || !e.grad_sq.is_finite() {
            return;
        }
        let b = self.beta;
        self.trace = b * self.trace + (1.0 - b) * e.trace_sigma;
        self.grad_sq = b * self.grad_sq + (1.0 - b) * e.grad_sq;
        self.weight = b * self.weight + (1.0 - b);
        self.steps += 1;
    }

    /// The smoothed estimate; None before the first step.
    pub fn get(&self) -> Option<Smoothed> {
        if self.steps == 0 || self.weight <= 0.0 {
            return None;
        }
        let trace_sigma = self.trace / self.weight;
        let grad_sq = self.grad_sq / self.weight;
        Some(Smoothed {
            trace_sigma,
            grad_sq,
            b_noise: (grad_sq > 0.0).then(|| trace_sigma / grad_sq),
            steps: self.steps,
        })
    }
}

/// Where the global batch stands against B_noise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// `B < B_noise / 4`: a bigger batch cuts the steps nearly in proportion.
    FarBelow,
    /// Between: a good trade-off.
    Near,
    /// `B > 4 B_noise`: more samples per step buy little.
    FarAbove,
}

/// The advice on the global batch, given step after step from a noisy estimate. A verdict
/// changes only when the estimate moves well past a boundary (hysteresis): it goes "far"
/// when `B` is beyond a factor of 4 from B_noise and comes back "near" only within a factor
/// of 2, so an estimate that wobbles around one boundary does not flip the advice from one
/// line to the next. (McCandlish et al.: the steps needed go as 1 + B_noise / B, so below
/// B_noise a bigger batch cuts them nearly in proportion, above it hardly at all.)
#[derive(Debug, Clone, Default)]
pub struct Advisor {
    verdict: Option<Verdict>,
}

impl Advisor {
    /// No verdict yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The verdict so far (None before the first estimate).
    pub fn verdict(&self) -> Option<Verdict> {
        self.verdict
    }

    /// Takes the smoothed `b_noise` for a global batch of `batch` samples; one line of advice.
    /// An estimate that is not positive (None) leaves the verdict as it was.
    pub fn advise(&mut self, b_noise: Option<f64>, batch: u64) -> String {
        let Some(bn) = b_noise.filter(|b| b.is_finite() && *b > 0.0) else {
            return match self.verdict {
                None => "the noise dominates the gradient (|G|² estimate ≤ 0): a larger batch would average it; keep watching".into(),
                Some(_) => "the |G|² estimate is ≤ 0 this time (the noise dominates it): the advice so far stands".into(),
            };
        };
        let r = batch as f64 / bn;
        let v = match self.verdict {
            None | Some(Verdict::Near) if r < 0.25 => Verdict::FarBelow,
            None | Some(Verdict::Near) if r > 4.0 => Verdict::FarAbove,
            None | Some(Verdict::Near) => Verdict::Near,
            Some(Verdict::FarBelow) if r > 4.0 => Verdict::FarAbove,
            Some(Verdict::FarBelow) if r > 0.5 => Verdict::Near,
            Some(Verdict::FarAbove) if r < 0.25 => Verdict::FarBelow,
            Some(Verdict::FarAbove) if r < 2.0 => Verdict::Near,
            Some(v) => v,
        };
        self.verdict = Some(v);
        match v {
            Verdict::FarBelow => format!(
                "a global batch of {batch} is far below B_noise ≈ {bn:.0}: a bigger batch (more workers, or more samples per worker, with a scaled lr) would cut the steps needed nearly in proportion"
            ),
            Verdict::FarAbove => format!(
                "a global batch of {batch} is far above B_noise ≈ {bn:.0}: diminishing returns, more samples per step buy little; a smaller batch would need about as many steps for less compute"
            ),
            Verdict::Near => format!(
                "a global batch of {batch} is near B_noise ≈ {bn:.0}: a good trade-off between steps and compute per step"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64* and Box-Muller: Gaussian draws without a dependency.
    struct Gauss(u64);
    impl Gauss {
        fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
        fn normal(&mut self) -> f64 {
            let (u, v) = (self.uniform(), self.uniform());
            (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        }
    }

    /// Least squares ½(x·w − y)², x ~ N(0, I_d), y = x·w* + ε, ε ~ N(0, σ²): the per-sample
    /// gradient is x(x·u − ε) with u = w − w*, so G = u and, by Isserlis' theorem,
    /// Σ = |u|² I + u uᵀ + σ² I: tr(Σ) = (d + 1)|u|² + d σ², |G|² = |u|².
    fn sample_mean_grad(rng: &mut Gauss, u: &[f64], sigma: f64, b: u32) -> Vec<f64> {
        let mut g = vec![0.0; u.len()];
        for _ in 0..b {
            let x: Vec<f64> = u.iter().map(|_| rng.normal()).collect();
            let r = x.iter().zip(u).map(|(a, b)| a * b).sum::<f64>() - sigma * rng.normal();
            g.iter_mut()
                .zip(&x)
                .for_each(|(g, x)| *g += x * r / f64::from(b));
        }
        g
    }

    fn run(samples: &[u32], agg: Aggregation, loss: LossReduction, steps: usize) -> Smoothed {
        let d = 16;
        let u: Vec<f64> = (0..d).map(|i| 0.1 + 0.02 * i as f64).collect();
        let sigma = 0.5;
        let mut rng = Gauss(0x9E37_79B9_7F4A_7C15);
        let coeffs = coefficients(agg, samples);
        let mut ns = NoiseScale::new(0.9995);
        for _ in 0..steps {
            let mut agg_g = vec![0.0; d];
            let mut ranks = Vec::new();
            for (&b, &c) in samples.iter().zip(&coeffs) {
                let m = sample_mean_grad(&mut rng, &u, sigma, b);
                let s = match loss {
                    LossReduction::Mean => 1.0,
                    LossReduction::Sum => f64::from(b),
                };
                let p: Vec<f64> = m.iter().map(|v| v * s).collect();
                agg_g.iter_mut().zip(&p).for_each(|(a, v)| *a += c * v);
                ranks.push(RankNorm {
                    sq_norm: p.iter().map(|v| v * v).sum(),
                    samples: b,
                    coeff: c,
                });
            }
            let agg_sq = agg_g.iter().map(|v| v * v).sum();
            ns.observe(estimate(&ranks, agg_sq, loss).expect("two workers"));
        }
        let got = ns.get().unwrap();
        let u2: f64 = u.iter().map(|v| v * v).sum();
        let trace = (d as f64 + 1.0) * u2 + d as f64 * sigma * sigma;
        // tolerance: 5% relative, about 4 standard errors of the smoothed estimates here
        let rel = |a: f64, b: f64| (a - b).abs() / b;
        assert!(
            rel(got.trace_sigma, trace) < 0.05,
            "tr(Σ) {} vs {trace}",
            got.trace_sigma
        );
        assert!(rel(got.grad_sq, u2) < 0.05, "|G|² {} vs {u2}", got.grad_sq);
        let bn = got.b_noise.unwrap();
        assert!(rel(bn, trace / u2) < 0.08, "B_noise {bn} vs {}", trace / u2);
        got
    }

    #[test]
    fn least_squares_equal_batches_mean_aggregation() {
        run(
            &[8, 8, 8, 8],
            Aggregation::Mean,
            LossReduction::Mean,
            20_000,
        );
    }

    #[test]
    fn least_squares_uneven_batches_weighted_and_mean() {
        run(
            &[3, 5, 8, 16],
            Aggregation::Weighted,
            LossReduction::Mean,
            20_000,
        );
        run(
            &[3, 5, 8, 16],
            Aggregation::Mean,
            LossReduction::Mean,
            20_000,
        );
    }

    #[test]
    fn least_squares_sum_loss_and_sum_aggregation() {
        run(&[4, 12], Aggregation::Sum, LossReduction::Sum, 20_000);
        run(&[6, 6], Aggregation::Sum, LossReduction::Mean, 20_000);
    }

    #[test]
    fn one_worker_or_no_samples_gives_nothing() {
        let r = RankNorm {
            sq_norm: 1.0,
            samples: 4,
            coeff: 1.0,
        };
        assert_eq!(estimate(&[r], 1.0, LossReduction::Mean), None);
        let empty = RankNorm { samples: 0, ..r };
        assert_eq!(estimate(&[r, empty], 1.0, LossReduction::Mean), None);
        assert!(NoiseScale::new(0.9).get().is_none());
    }

    #[test]
    fn advice_reads_both_ways() {
        let first = |bn, b| Advisor::new().advise(bn, b);
        assert!(first(Some(1000.0), 32).contains("far below"));
        assert!(first(Some(10.0), 512).contains("diminishing returns"));
        assert!(first(Some(100.0), 128).contains("near"));
        assert!(first(None, 128).contains("noise dominates"));
    }

    /// An estimate wobbling around a boundary (B = 32 against B_noise 100..160, across
    /// 4 B = 128) changes the verdict at most once; only a move well back (within a factor of
    /// 2) changes it again. The stateless advice flipped between "near" and "far below" from
    /// one line to the next (7 times here).
    #[test]
    fn the_advice_does_not_flip_on_a_wobbling_estimate() {
        let mut a = Advisor::new();
        let wobble = [110.0, 140.0, 120.0, 150.0, 100.0, 135.0, 125.0, 160.0];
        let verdicts: Vec<&str> = wobble
            .iter()
            .map(|&b| {
                let l = a.advise(Some(b), 32);
                if l.contains("is near") {
                    "near"
                } else {
                    "far below"
                }
            })
            .collect();
        let changes = verdicts.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(changes <= 1, "{verdicts:?}");
        assert_eq!(a.verdict(), Some(Verdict::FarBelow));
        // well past the boundary: far below, and it stays so while the estimate wobbles
        // back towards it
        assert!(a.advise(Some(400.0), 32).contains("far below"));
        for b in [120.0, 100.0, 70.0] {
            assert!(a.advise(Some(b), 32).contains("far below"), "{b}");
        }
        assert_eq!(a.verdict(), Some(Verdict::FarBelow));
        // back within a factor of 2: near again
        assert!(a.advise(Some(60.0), 32).contains("is near"));
        // a non-positive estimate leaves it
        assert!(a.advise(None, 32).contains("the advice so far stands"));
        assert_eq!(a.verdict(), Some(Verdict::Near));
        // far above, and back
        assert!(a.advise(Some(4.0), 32).contains("far above"));
        assert!(a.advise(Some(12.0), 32).contains("far above"));
        assert!(a.advise(Some(20.0), 32).contains("is near"));
    }
}
