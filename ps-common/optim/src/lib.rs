//! Optimizers and learning-rate schedules: pure functions of (params, grad, state, lr), owned by each shard.
//!
//! The update rules follow PyTorch (`torch.optim.SGD` with dampening 0, `torch.optim.Adam` and
//! `torch.optim.AdamW`) in `f32` arithmetic per element. Per-step scalars (bias corrections,
//! decoupled decay factor) are computed once in `f64` and cast to `f32`.
//!
//! The element loops are private functions over sub-slices so that a large shard can later be
//! split across cores: each chunk function only touches the elements it is given.

use std::f64::consts::PI;

/// The update rule a shard applies to its range, with its hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum Optimizer {
    /// PyTorch torch.optim.SGD semantics (dampening 0).
    Sgd {
        /// Momentum factor (0: plain SGD).
        momentum: f32,
        /// Nesterov momentum.
        nesterov: bool,
        /// L2 penalty added to the gradient.
        weight_decay: f32,
    },
    /// PyTorch Adam (decoupled = false: L2 weight decay added to the gradient) or AdamW (decoupled = true).
    Adam {
        /// Decay of the first moment.
        beta1: f32,
        /// Decay of the second moment.
        beta2: f32,
        /// Added to the second moment's square root.
        eps: f32,
        /// Weight decay (L2 or decoupled, as `decoupled` says).
        weight_decay: f32,
        /// AdamW: the decay applies to the weights, not through the gradient.
        decoupled: bool,
    },
}

/// Per-shard optimizer state (sized to the shard's length; empty vectors when not needed).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OptState {
    /// Steps applied.
    pub steps: u64,
    /// SGD's momentum buffer, or Adam's first moment.
    pub m: Vec<f32>,
    /// Adam's second moment.
    pub v: Vec<f32>,
    /// Per tensor of the model: the steps in which no worker's backward reached it, so it was
    /// not updated (Adam's bias correction counts each tensor's own steps: `steps - skipped`);
    /// empty while none was skipped.
    pub skipped: Vec<u64>,
}

impl Optimizer {
    /// Fresh state for a shard of `len` parameters: SGD without momentum keeps no buffers,
    /// SGD with momentum keeps `m` (the momentum buffer), Adam keeps `m` and `v`.
    pub fn init_state(&self, len: usize) -> OptState {
        match *self {
            Optimizer::Sgd { momentum, .. } => OptState {
                steps: 0,
                m: if momentum != 0.0 {
                    vec![0.0; len]
                } else {
                    Vec::new()
                },
                v: Vec::new(),
                skipped: Vec::new(),
            },
            Optimizer::Adam { .. } => OptState {
                steps: 0,
                m: vec![0.0; len],
                v: vec![0.0; len],
                skipped: Vec::new(),
            },
        }
    }

    /// One update in place. params.len() == grad.len() == state length (assert_eq! is fine: callers validate lengths).
    pub fn step(&self, params: &mut [f32], grad: &[f32], state: &mut OptState, lr: f32) {
        assert_eq!(params.len(), grad.len(), "params and grad lengths differ");
        let c = self.coeffs(state.steps, lr);
        self.update_chunk(c, params, grad, &mut state.m, &mut state.v);
        state.steps += 1;
    }

    /// The per-step scalars of the update after `steps_done` earlier steps, computed once so
    /// that [`Optimizer::update_chunk`] can run on disjoint parts of a shard (on several cores)
    /// with results identical to one [`Optimizer::step`] over the whole.
    pub fn coeffs(&self, steps_done: u64, lr: f32) -> StepCoeffs {
        match *self {
            Optimizer::Sgd {
                momentum,
                nesterov,
                weight_decay,
            } if momentum != 0.0 => StepCoeffs::Momentum(SgdMomentumCoeffs {
                lr,
                weight_decay,
                momentum,
                nesterov,
                first: steps_done == 0,
            }),
            Optimizer::Sgd { weight_decay, .. } => StepCoeffs::Plain { lr, weight_decay },
            Optimizer::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
            } => StepCoeffs::Adam(AdamCoeffs::new(
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
                lr,
                steps_done + 1,
            )),
        }
    }

    /// Updates one part of a shard: `p`, `g` and the matching parts of the state buffers
    /// (`m`, `v`: empty when the optimizer keeps none). Does not count the step. Inlined into
    /// its callers, so that one compiled with `#[target_feature]` vectorises it with them.
    #[inline(always)]
    pub fn update_chunk(
        &self,
        c: StepCoeffs,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        assert_eq!(p.len(), g.len(), "params and grad lengths differ");
        match c {
            StepCoeffs::Plain { lr, weight_decay } => sgd_plain_chunk(p, g, lr, weight_decay),
            StepCoeffs::Momentum(c) => {
                assert_eq!(
                    m.len(),
                    p.len(),
                    "momentum buffer length differs from params"
                );
                sgd_momentum_chunk(p, g, m, c)
            }
            StepCoeffs::Adam(c) => {
                assert_eq!(m.len(), p.len(), "Adam m length differs from params");
                assert_eq!(v.len(), p.len(), "Adam v length differs from params");
                adam_chunk(p, g, m, v, c)
            }
        }
    }

    /// Human-readable summary, e.g. "sgd(momentum 0.9, nesterov, weight decay 0.0005)" or
    /// "adamw(betas 0.9/0.999, eps 1e-8, weight decay 0.01)". Zero momentum / weight decay are
    /// left out ("sgd", "adam(betas 0.9/0.999, eps 1e-8)").
    pub fn describe(&self) -> String {
        match *self {
            Optimizer::Sgd {
                momentum,
                nesterov,
                weight_decay,
            } => {
                let mut parts = Vec::new();
                if momentum != 0.0 {
                    parts.push(format!("momentum {momentum}"));
                }
                if nesterov {
                    parts.push("nesterov".to_string());
                }
                if weight_decay != 0.0 {
                    parts.push(format!("weight decay {weight_decay}"));
                }
                if parts.is_empty() {
                    "sgd".to_string()
                } else {
                    format!("sgd({})", parts.join(", "))
                }
            }
            Optimizer::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
            } => {
                let name = if decoupled { "adamw" } else { "adam" };
                let mut s = format!("{name}(betas {beta1}/{beta2}, eps {eps:e}");
                if weight_decay != 0.0 {
                    s.push_str(&format!(", weight decay {weight_decay}"));
                }
                s.push(')');
                s
            }
        }
    }
}

/// The scalars of one optimizer step (see [`Optimizer::coeffs`]).
#[derive(Debug, Clone, Copy)]
pub enum StepCoeffs {
    /// SGD without momentum.
    Plain {
        /// Learning rate.
        lr: f32,
        /// L2 weight decay.
        weight_decay: f32,
    },
    /// SGD with momentum.
    Momentum(SgdMomentumCoeffs),
    /// Adam or AdamW.
    Adam(AdamCoeffs),
}

/// Plain SGD (no momentum): d = g + wd*p; p -= lr*d.
#[inline(always)] // so that callers compiled for wider vectors (the shard's update) get them
fn sgd_plain_chunk(p: &mut [f32], g: &[f32], lr: f32, weight_decay: f32) {
    for (p, &g) in p.iter_mut().zip(g) {
        let d = g + weight_decay * *p;
        *p -= lr * d;
    }
}

/// SGD-with-momentum scalars.
#[derive(Debug, Clone, Copy)]
pub struct SgdMomentumCoeffs {
    lr: f32,
    weight_decay: f32,
    momentum: f32,
    nesterov: bool,
    /// First step: the buffer is set to d (undamped), not momentum*buf + d.
    first: bool,
}

/// SGD with momentum (dampening 0), optionally Nesterov. `nesterov` and `first` are loop
/// invariant, so the branches below become selects / get unswitched.
#[inline(always)] // so that callers compiled for wider vectors (the shard's update) get them
fn sgd_momentum_chunk(p: &mut [f32], g: &[f32], buf: &mut [f32], c: SgdMomentumCoeffs) {
    let SgdMomentumCoeffs {
        lr,
        weight_decay,
        momentum,
        nesterov,
        first,
    } = c;
    for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
        let d = g + weight_decay * *p;
        *b = if first { d } else { momentum * *b + d };
        let d = if nesterov { d + momentum * *b } else { *b };
        *p -= lr * d;
    }
}

/// Per-step scalars for Adam/AdamW, all in f32.
#[derive(Debug, Clone, Copy)]
pub struct AdamCoeffs {
    /// Multiplier applied to p before the update (1 - lr*wd for AdamW, 1 for Adam).
    decay_factor: f32,
    /// L2 coefficient added to the gradient (wd for Adam, 0 for AdamW).
    l2: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    /// lr / (1 - beta1^t)
    step_size: f32,
    /// sqrt(1 - beta2^t)
    bc2_sqrt: f32,
    eps: f32,
}

impl AdamCoeffs {
    fn new(
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        decoupled: bool,
        lr: f32,
        t: u64,
    ) -> Self {
        // Exponent saturates; beta^t is 0 long before i32::MAX for beta < 1.
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let bc1 = 1.0 - f64::from(beta1).powi(t);
        let bc2 = 1.0 - f64::from(beta2).powi(t);
        let (decay_factor, l2) = if decoupled {
            ((1.0 - f64::from(lr) * f64::from(weight_decay)) as f32, 0.0)
        } else {
            (1.0, weight_decay)
        };
        AdamCoeffs {
            decay_factor,
            l2,
            beta1,
            one_minus_beta1: (1.0 - f64::from(beta1)) as f32,
            beta2,
            one_minus_beta2: (1.0 - f64::from(beta2)) as f32,
            step_size: (f64::from(lr) / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps,
        }
    }
}

/// Adam / AdamW element update (PyTorch formulation):
/// g += l2*p; p *= decay_factor; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
/// p -= step_size * m / (sqrt(v)/sqrt(bc2) + eps).
#[inline(always)] // so that callers compiled for wider vectors (the shard's update) get them
fn adam_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamCoeffs) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g + c.l2 * *p;
        *p *= c.decay_factor;
        *m = c.beta1 * *m + c.one_minus_beta1 * g;
        *v = c.beta2 * *v + c.one_minus_beta2 * g * g;
        let denom = v.sqrt() / c.bc2_sqrt + c.eps;
        *p -= c.step_size * *m / denom;
    }
}

/// Σ v² in f64, over eight independent lanes so that it vectorises (a single running sum is a
/// chain of dependent adds, slower than the rest of the update together). Each square is exact
/// in f64 (an f32 has 24 significant bits): only the additions round.
#[inline(always)]
pub fn sum_of_squares(g: &[f32]) -> f64 {
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

/// How the learning rate decays after warmup.
#[derive(Debug, Clone, PartialEq)]
pub enum Decay {
    /// The base lr throughout.
    Constant,
    /// lr * gamma^(floor(t / step_size)), t counted after warmup
    Step {
        /// Steps between two decays.
        step_size: u64,
        /// Factor of each decay.
        gamma: f64,
    },
    /// cosine from base lr down to min_lr over `total_steps - warmup` steps (PyTorch CosineAnnealingLR with T_max = total - warmup), then stays at min_lr
    Cosine {
        /// Steps of the run, warmup included.
        total_steps: u64,
        /// The lr at the end.
        min_lr: f64,
    },
}

/// The learning rate of each step: linear warmup, then a decay.
#[derive(Debug, Clone, PartialEq)]
pub struct LrSchedule {
    /// The lr after warmup, before decay.
    pub base_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// The decay after warmup.
    pub decay: Decay,
}

impl LrSchedule {
    /// Learning rate used for step t (0-based). Linear warmup: for t < warmup_steps, lr = base_lr * (t + 1) / warmup_steps. After warmup, the decay applies to t' = t - warmup_steps.
    ///
    /// A `Step` decay with `step_size == 0` never decays. A `Cosine` decay with
    /// `total_steps <= warmup_steps` goes straight to `min_lr` after warmup.
    pub fn lr(&self, t: u64) -> f64 {
        if t < self.warmup_steps {
            return self.base_lr * (t + 1) as f64 / self.warmup_steps as f64;
        }
        let t = t - self.warmup_steps;
        match self.decay {
            Decay::Constant => self.base_lr,
            Decay::Step { step_size, gamma } => match t.checked_div(step_size) {
                Some(k) => self.base_lr * gamma.powf(k as f64),
                None => self.base_lr,
            },
            Decay::Cosine {
                total_steps,
                min_lr,
            } => {
                let t_max = total_steps.saturating_sub(self.warmup_steps);
                if t >= t_max {
                    min_lr
                } else {
                    let cos = (PI * t as f64 / t_max as f64).cos();
                    min_lr + (self.base_lr - min_lr) * (1.0 + cos) / 2.0
                }
            }
        }
    }

    /// Human-readable summary, e.g. "constant 0.1", "step 0.1 x0.5 every 100 steps after 10
    /// warmup steps", "cosine 0.1 -> 0 over 500 steps". For cosine, the step count is
    /// `total_steps` (warmup included), and warmup is reported as "including N warmup steps".
    pub fn describe(&self) -> String {
        let base = self.base_lr;
        let w = self.warmup_steps;
        match self.decay {
            Decay::Constant => {
                let mut s = format!("constant {base}");
                if w > 0 {
                    s.push_str(&format!(" after {w} warmup steps"));
                }
                s
            }
            Decay::Step { step_size, gamma } => {
                let mut s = format!("step {base} x{gamma} every {step_size} steps");
                if w > 0 {
                    s.push_str(&format!(" after {w} warmup steps"));
                }
                s
            }
            Decay::Cosine {
                total_steps,
                min_lr,
            } => {
                let mut s = if total_steps == 0 {
                    // resolved from the data set's size when the shard starts
                    format!("cosine {base} -> {min_lr} over the whole run")
                } else {
                    format!("cosine {base} -> {min_lr} over {total_steps} steps")
                };
                if w > 0 {
                    s.push_str(&format!(" including {w} warmup steps"));
                }
                s
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Parameters and gradient sequence shared by the optimizer tests. Expected values were
    // computed by hand (and cross-checked with a plain-python f32 emulation of the PyTorch
    // update formulas).
    const P0: [f32; 3] = [1.0, -2.0, 0.5];
    const GRADS: [[f32; 3]; 3] = [[0.1, -0.2, 0.3], [0.4, -0.1, -0.5], [-0.3, 0.25, 0.05]];

    fn assert_close_f32(actual: &[f32], expected: &[f32], what: &str) {
        assert_eq!(actual.len(), expected.len(), "{what}: length");
        for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            let tol = 1e-6 * e.abs();
            assert!(
                (a - e).abs() <= tol,
                "{what}[{i}]: got {a}, expected {e} (diff {})",
                (a - e).abs()
            );
        }
    }

    fn assert_close_f64(actual: f64, expected: f64, what: &str) {
        let tol = 1e-12 * expected.abs();
        assert!(
            (actual - expected).abs() <= tol,
            "{what}: got {actual}, expected {expected}"
        );
    }

    /// Runs three steps from P0 with GRADS and compares the params after each step.
    fn run_three(opt: &Optimizer, lr: f32, expected: [[f32; 3]; 3]) -> OptState {
        let mut p = P0;
        let mut state = opt.init_state(p.len());
        for (k, (g, e)) in GRADS.iter().zip(expected.iter()).enumerate() {
            opt.step(&mut p, g, &mut state, lr);
            assert_eq!(state.steps, k as u64 + 1);
            assert_close_f32(&p, e, &format!("{} step {}", opt.describe(), k + 1));
        }
        state
    }

    #[test]
    fn sgd_plain_three_steps() {
        let opt = Optimizer::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        // p -= 0.1 * g
        let state = run_three(
            &opt,
            0.1,
            [
                [0.99, -1.98, 0.47],
                [0.95, -1.97, 0.52],
                [0.98, -1.995, 0.515],
            ],
        );
        assert!(state.m.is_empty() && state.v.is_empty());
    }

    #[test]
    fn sgd_weight_decay_three_steps() {
        let opt = Optimizer::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.1,
        };
        // step 1: p0 = 1: d = 0.1 + 0.1*1 = 0.2, p = 1 - 0.02 = 0.98
        // step 2: d = 0.4 + 0.098 = 0.498, p = 0.98 - 0.0498 = 0.9302
        run_three(
            &opt,
            0.1,
            [
                [0.98, -1.96, 0.465],
                [0.9302, -1.9304, 0.51035],
                [0.950898, -1.936096, 0.5002465],
            ],
        );
    }

    #[test]
    fn sgd_momentum_three_steps_first_step_undamped() {
        let opt = Optimizer::Sgd {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
        };
        // element 0: first step buf = g = 0.1 (not damped to 0.1 * 0.1), p = 0.99;
        // buf = 0.09 + 0.4 = 0.49, p = 0.941; buf = 0.441 - 0.3 = 0.141, p = 0.9269
        let state = run_three(
            &opt,
            0.1,
            [
                [0.99, -1.98, 0.47],
                [0.941, -1.952, 0.493],
                [0.9269, -1.9518, 0.5087],
            ],
        );
        // element 1: -0.2, -0.18 - 0.1 = -0.28, -0.252 + 0.25 = -0.002; that last subtraction
        // cancels in f32, whose exact result is -0.002000004 (2e-6 relative from -0.002).
        assert_close_f32(&state.m, &[0.141, -0.002000004, -0.157], "momentum buffer");
    }

    #[test]
    fn sgd_nesterov_three_steps() {
        let opt = Optimizer::Sgd {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.0,
        };
        // element 0: buf = 0.1, d = 0.1 + 0.09 = 0.19, p = 0.981;
        // buf = 0.49, d = 0.4 + 0.441 = 0.841, p = 0.8969;
        // buf = 0.141, d = -0.3 + 0.1269 = -0.1731, p = 0.91421
        run_three(
            &opt,
            0.1,
            [
                [0.981, -1.962, 0.443],
                [0.8969, -1.9268, 0.5137],
                [0.91421, -1.95162, 0.52283],
            ],
        );
    }

    #[test]
    fn sgd_nesterov_with_weight_decay_three_steps() {
        let opt = Optimizer::Sgd {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
        };
        run_three(
            &opt,
            0.1,
            [
                [0.9791, -1.9582, 0.44205],
                [0.8923297, -1.9176594, 0.5115051],
                [0.9064222, -1.9357917, 0.5189407],
            ],
        );
    }

    #[test]
    fn adam_three_steps_l2_weight_decay() {
        let opt = Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: false,
        };
        // Step 1 moves every element by lr * sign(g + wd*p) (m_hat / sqrt(v_hat) = +-1).
        let state = run_three(
            &opt,
            0.01,
            [
                [0.99, -1.99, 0.49],
                [0.98060054, -1.9801774, 0.4917731],
                [0.97604674, -1.9732872, 0.4920293],
            ],
        );
        assert_eq!(state.m.len(), 3);
        assert_eq!(state.v.len(), 3);
    }

    #[test]
    fn adam_three_steps_no_weight_decay() {
        let opt = Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        };
        run_three(
            &opt,
            0.01,
            [
                [0.99, -1.99, 0.49],
                [0.98115623, -1.9806782, 0.49293563],
                [0.97938913, -1.98064, 0.49465045],
            ],
        );
    }

    #[test]
    fn adamw_three_steps_decoupled_weight_decay() {
        let opt = Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: true,
        };
        // Step 1: p = p*(1 - 0.01*0.1) - 0.01*sign(g): 1*0.999 - 0.01 = 0.989
        // (Adam with L2 gives 0.99 instead).
        run_three(
            &opt,
            0.01,
            [
                [0.989, -1.988, 0.4895],
                [0.9791673, -1.9766903, 0.49194613],
                [0.97642106, -1.9746755, 0.493169],
            ],
        );
    }

    #[test]
    fn init_state_sizes() {
        let plain = Optimizer::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.1,
        };
        assert_eq!(plain.init_state(5), OptState::default());

        let mom = Optimizer::Sgd {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.0,
        };
        let s = mom.init_state(5);
        assert_eq!(s.steps, 0);
        assert_eq!(s.m, vec![0.0; 5]);
        assert!(s.v.is_empty());

        let adam = Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: true,
        };
        let s = adam.init_state(7);
        assert_eq!(s.steps, 0);
        assert_eq!(s.m, vec![0.0; 7]);
        assert_eq!(s.v, vec![0.0; 7]);
        assert_eq!(adam.init_state(0), OptState::default());
    }

    #[test]
    fn optimizer_describe() {
        let sgd = Optimizer::Sgd {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.0005,
        };
        assert_eq!(
            sgd.describe(),
            "sgd(momentum 0.9, nesterov, weight decay 0.0005)"
        );
        let plain = Optimizer::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        assert_eq!(plain.describe(), "sgd");
        let adamw = Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        };
        assert_eq!(
            adamw.describe(),
            "adamw(betas 0.9/0.999, eps 1e-8, weight decay 0.01)"
        );
        let adam = Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        };
        assert_eq!(adam.describe(), "adam(betas 0.9/0.999, eps 1e-8)");
    }

    #[test]
    fn schedule_constant() {
        let s = LrSchedule {
            base_lr: 0.1,
            warmup_steps: 0,
            decay: Decay::Constant,
        };
        for t in [0, 1, 10, 1_000_000] {
            assert_eq!(s.lr(t), 0.1);
        }
        assert_eq!(s.describe(), "constant 0.1");
    }

    #[test]
    fn schedule_step_decay_boundaries() {
        let s = LrSchedule {
            base_lr: 0.1,
            warmup_steps: 0,
            decay: Decay::Step {
                step_size: 100,
                gamma: 0.5,
            },
        };
        let cases = [
            (0, 0.1),
            (99, 0.1),
            (100, 0.05),
            (199, 0.05),
            (200, 0.025),
            (350, 0.0125),
        ];
        for (t, e) in cases {
            assert_close_f64(s.lr(t), e, &format!("step decay t={t}"));
        }
        assert_eq!(s.describe(), "step 0.1 x0.5 every 100 steps");

        // With warmup the boundaries shift by warmup_steps.
        let s = LrSchedule {
            warmup_steps: 10,
            ..s
        };
        assert_close_f64(s.lr(109), 0.1, "step decay after warmup t=109");
        assert_close_f64(s.lr(110), 0.05, "step decay after warmup t=110");
        assert_close_f64(s.lr(210), 0.025, "step decay after warmup t=210");
        assert_eq!(
            s.describe(),
            "step 0.1 x0.5 every 100 steps after 10 warmup steps"
        );
    }

    #[test]
    fn schedule_cosine_start_middle_end() {
        let s = LrSchedule {
            base_lr: 0.1,
            warmup_steps: 0,
            decay: Decay::Cosine {
                total_steps: 100,
                min_lr: 0.001,
            },
        };
        // min + (base - min) * (1 + cos(pi * t / 100)) / 2
        let cases = [
            (0, 0.1),
            (25, 0.0855017856687341),
            (50, 0.0505),
            (75, 0.0154982143312659),
            (99, 0.0010244252618962857),
            (100, 0.001),
            (101, 0.001),
            (10_000, 0.001),
        ];
        for (t, e) in cases {
            assert_close_f64(s.lr(t), e, &format!("cosine t={t}"));
        }
        let zero_min = LrSchedule {
            base_lr: 0.1,
            warmup_steps: 0,
            decay: Decay::Cosine {
                total_steps: 500,
                min_lr: 0.0,
            },
        };
        assert_eq!(zero_min.describe(), "cosine 0.1 -> 0 over 500 steps");
        assert_eq!(zero_min.lr(500), 0.0);
        assert_eq!(zero_min.lr(600), 0.0);
    }

    #[test]
    fn schedule_cosine_with_warmup() {
        // T_max = 110 - 10 = 100: same curve as above, shifted by 10 steps.
        let s = LrSchedule {
            base_lr: 0.1,
            warmup_steps: 10,
            decay: Decay::Cosine {
                total_steps: 110,
                min_lr: 0.001,
            },
        };
        assert_close_f64(s.lr(0), 0.01, "warmup t=0");
        assert_close_f64(s.lr(9), 0.1, "warmup t=9");
        assert_close_f64(s.lr(10), 0.1, "cosine start");
        assert_close_f64(s.lr(35), 0.0855017856687341, "cosine quarter");
        assert_close_f64(s.lr(60), 0.0505, "cosine middle");
        assert_close_f64(s.lr(110), 0.001, "cosine end");
        assert_close_f64(s.lr(111), 0.001, "after cosine end");
        assert_eq!(
            s.describe(),
            "cosine 0.1 -> 0.001 over 110 steps including 10 warmup steps"
        );
    }

    #[test]
    fn schedule_linear_warmup_and_handoff() {
        let s = LrSchedule {
            base_lr: 0.1,
            warmup_steps: 4,
            decay: Decay::Constant,
        };
        // base * (t + 1) / 4 for t = 0..3, then base.
        let cases = [
            (0, 0.025),
            (1, 0.05),
            (2, 0.075),
            (3, 0.1),
            (4, 0.1),
            (5, 0.1),
        ];
        for (t, e) in cases {
            assert_close_f64(s.lr(t), e, &format!("warmup constant t={t}"));
        }
        assert_eq!(s.describe(), "constant 0.1 after 4 warmup steps");

        // Handoff into step decay: t' = t - 3.
        let s = LrSchedule {
            base_lr: 0.2,
            warmup_steps: 3,
            decay: Decay::Step {
                step_size: 2,
                gamma: 0.1,
            },
        };
        let cases = [
            (0, 0.2 / 3.0),
            (1, 0.4 / 3.0),
            (2, 0.2),
            (3, 0.2),
            (4, 0.2),
            (5, 0.02),
            (6, 0.02),
            (7, 0.002),
        ];
        for (t, e) in cases {
            assert_close_f64(s.lr(t), e, &format!("warmup step t={t}"));
        }
    }

    #[test]
    fn schedule_degenerate_inputs_do_not_panic() {
        let s = LrSchedule {
            base_lr: 0.1,
            warmup_steps: 0,
            decay: Decay::Step {
                step_size: 0,
                gamma: 0.5,
            },
        };
        assert_eq!(s.lr(1000), 0.1);
        let s = LrSchedule {
            base_lr: 0.1,
            warmup_steps: 20,
            decay: Decay::Cosine {
                total_steps: 10,
                min_lr: 0.01,
            },
        };
        assert_close_f64(s.lr(19), 0.1, "warmup end");
        assert_eq!(s.lr(20), 0.01);
    }

    #[test]
    fn chunked_update_matches_whole_slice() {
        // Splitting the element loops into sub-slices must give bit-identical results.
        let p0: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.07).collect();
        let g: Vec<f32> = (0..37)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.03)
            .collect();
        let c = AdamCoeffs::new(0.9, 0.999, 1e-8, 0.01, true, 0.001, 3);
        let (mut pa, mut ma, mut va) = (p0.clone(), vec![0.01; 37], vec![0.02; 37]);
        adam_chunk(&mut pa, &g, &mut ma, &mut va, c);
        let (mut pb, mut mb, mut vb) = (p0.clone(), vec![0.01; 37], vec![0.02; 37]);
        for (((p, g), m), v) in pb
            .chunks_mut(8)
            .zip(g.chunks(8))
            .zip(mb.chunks_mut(8))
            .zip(vb.chunks_mut(8))
        {
            adam_chunk(p, g, m, v, c);
        }
        assert_eq!((pa, ma, va), (pb, mb, vb));

        let c = SgdMomentumCoeffs {
            lr: 0.1,
            weight_decay: 0.001,
            momentum: 0.9,
            nesterov: true,
            first: false,
        };
        let (mut pa, mut ba) = (p0.clone(), vec![0.5; 37]);
        sgd_momentum_chunk(&mut pa, &g, &mut ba, c);
        let (mut pb, mut bb) = (p0, vec![0.5; 37]);
        for ((p, g), b) in pb.chunks_mut(5).zip(g.chunks(5)).zip(bb.chunks_mut(5)) {
            sgd_momentum_chunk(p, g, b, c);
        }
        assert_eq!((pa, ba), (pb, bb));
    }
}
