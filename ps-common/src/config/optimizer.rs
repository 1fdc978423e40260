//! `[optimizer]` and `[schedule]`: validated into [`Optimizer`] and [`LrSchedule`].

use super::kinds::{OptimizerKind, ScheduleKind};
use super::limits::{MAX_STEPS, at_most, show};
use crate::optim::{Decay, LrSchedule, Optimizer};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOptimizer {
    pub kind: OptimizerKind,
    pub lr: f64,
    #[serde(default)]
    pub momentum: f32,
    #[serde(default)]
    pub nesterov: bool,
    #[serde(default)]
    pub weight_decay: f32,
    #[serde(default = "default_beta1")]
    pub beta1: f32,
    #[serde(default = "default_beta2")]
    pub beta2: f32,
    #[serde(default = "default_eps")]
    pub eps: f32,
}

pub(super) fn default_beta1() -> f32 {
    0.9
}
pub(super) fn default_beta2() -> f32 {
    0.999
}
pub(super) fn default_eps() -> f32 {
    1e-8
}

impl RawOptimizer {
    pub(super) fn validate(&self) -> Result<Optimizer, String> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!(
                "[optimizer] lr = {}: expected a positive number",
                show(self.lr)
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(format!(
                "[optimizer] weight_decay = {}: expected 0 or more",
                self.weight_decay
            ));
        }
        match self.kind {
            OptimizerKind::Sgd => {
                if !(0.0..1.0).contains(&self.momentum) {
                    return Err(format!(
                        "[optimizer] momentum = {}: expected 0 <= momentum < 1",
                        self.momentum
                    ));
                }
                if self.nesterov && self.momentum == 0.0 {
                    return Err("[optimizer] nesterov = true needs momentum > 0".into());
                }
                Ok(Optimizer::Sgd {
                    momentum: self.momentum,
                    nesterov: self.nesterov,
                    weight_decay: self.weight_decay,
                })
            }
            OptimizerKind::Adam | OptimizerKind::AdamW => {
                for (k, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
                    if !(0.0..1.0).contains(&v) {
                        return Err(format!("[optimizer] {k} = {v}: expected 0 <= {k} < 1"));
                    }
                }
                if self.eps.is_nan() || self.eps <= 0.0 {
                    return Err(format!(
                        "[optimizer] eps = {}: expected a positive number",
                        self.eps
                    ));
                }
                if self.momentum != 0.0 || self.nesterov {
                    return Err(format!(
                        "[optimizer] momentum/nesterov are SGD settings; kind = {:?} uses beta1/beta2",
                        self.kind.name()
                    ));
                }
                Ok(Optimizer::Adam {
                    beta1: self.beta1,
                    beta2: self.beta2,
                    eps: self.eps,
                    weight_decay: self.weight_decay,
                    decoupled: self.kind == OptimizerKind::AdamW,
                })
            }
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSchedule {
    #[serde(default = "default_schedule_kind")]
    pub kind: ScheduleKind,
    #[serde(default)]
    pub warmup_steps: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gamma: Option<f64>,
    #[serde(default)]
    pub min_lr: f64,
}

fn default_schedule_kind() -> ScheduleKind {
    ScheduleKind::Constant
}

impl Default for RawSchedule {
    fn default() -> Self {
        Self {
            kind: default_schedule_kind(),
            warmup_steps: 0,
            step_size: None,
            gamma: None,
            min_lr: 0.0,
        }
    }
}

impl RawSchedule {
    /// Validates the schedule, whose base is `[optimizer] lr` (already checked positive).
    pub(super) fn validate(&self, lr: f64) -> Result<LrSchedule, String> {
        let decay = match self.kind {
            ScheduleKind::Constant => Decay::Constant,
            ScheduleKind::Step => {
                let step_size = self
                    .step_size
                    .filter(|&n| n > 0)
                    .ok_or("[schedule] kind = \"step\" needs step_size >= 1")?;
                at_most("[schedule] step_size", step_size, MAX_STEPS)?;
                let gamma = self.gamma.ok_or(
                    "[schedule] kind = \"step\" needs gamma (the factor applied every step_size steps)",
                )?;
                if !(gamma.is_finite() && gamma > 0.0) {
                    return Err(format!(
                        "[schedule] gamma = {}: expected a positive number",
                        show(gamma)
                    ));
                }
                Decay::Step { step_size, gamma }
            }
            ScheduleKind::Cosine => {
                if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr < lr) {
                    return Err(format!(
                        "[schedule] min_lr = {}: expected 0 <= min_lr < lr ({lr})",
                        show(self.min_lr)
                    ));
                }
                // length filled in from the run's total steps (Config::schedule_for)
                Decay::Cosine {
                    total_steps: 0,
                    min_lr: self.min_lr,
                }
            }
        };
        if self.kind != ScheduleKind::Step && (self.step_size.is_some() || self.gamma.is_some()) {
            return Err(format!(
                "[schedule] step_size/gamma only apply to kind = \"step\", not {:?}",
                self.kind.name()
            ));
        }
        at_most("[schedule] warmup_steps", self.warmup_steps, MAX_STEPS)?;
        Ok(LrSchedule {
            base_lr: lr,
            warmup_steps: self.warmup_steps,
            decay,
        })
    }
}
