//! `[optimizer]` and `[schedule]`: validated into [`Optimizer`] and [`LrSchedule`].

use super::kinds::{OptimizerKind, ScheduleKind};
use super::limits::{MAX_STEPS, at_most, show};
use crate::error::Invalid;
use ps_optim::{Decay, LrSchedule, Optimizer};
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
    /// `[[optimizer.groups]]`: parameter groups by tensor-name pattern.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<RawGroup>,
    /// Global gradient-norm clipping: `max_norm` of `torch.nn.utils.clip_grad_norm_`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_norm: Option<f64>,
}

/// One `[[optimizer.groups]]` table: the tensors whose names match one of `params` (glob
/// patterns: `*` any run of characters, `?` one) train with these settings instead of the
/// `[optimizer]` ones (those not given are the `[optimizer]` ones).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGroup {
    pub params: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_scale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta1: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta2: Option<f32>,
}

/// A parameter group, resolved against the model: its tensors (indices in flat order), the
/// optimizer with the group's settings, and its learning-rate multiplier.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// Tensor indices (flat order of the model), ascending.
    pub tensors: Vec<u32>,
    /// The optimizer with the group's weight decay and betas.
    pub optimizer: Optimizer,
    /// Its lr is the schedule's times this.
    pub lr_scale: f64,
    /// The patterns, as written (for the description).
    pub patterns: Vec<String>,
}

/// `*` (any run of characters) and `?` (one character) glob matching.
pub fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // dp[j]: pattern[..i] matches name[..j]
    let mut dp = vec![false; n.len() + 1];
    dp[0] = true;
    for &c in &p {
        let mut next = vec![false; n.len() + 1];
        if c == '*' {
            let mut any = false;
            for j in 0..=n.len() {
                any |= dp[j];
                next[j] = any;
            }
        } else {
            for j in 1..=n.len() {
                next[j] = dp[j - 1] && (c == '?' || c == n[j - 1]);
            }
        }
        dp = next;
    }
    dp[n.len()]
}

/// Resolves `groups` against the model's tensor `names` (flat order) and the base
/// `optimizer`: every pattern must match a tensor, no tensor may be in two groups, the
/// settings must be valid for the optimizer. The errors name the group and what is wrong.
pub(super) fn resolve_groups(
    groups: &[RawGroup],
    names: &[&str],
    optimizer: &Optimizer,
) -> Result<Vec<ParamGroup>, Invalid> {
    let mut owner: Vec<Option<usize>> = vec![None; names.len()];
    let mut out = Vec::with_capacity(groups.len());
    for (i, g) in groups.iter().enumerate() {
        let at = format!("[[optimizer.groups]] {i} (params = {:?})", g.params);
        if g.params.is_empty() {
            return Err(invalid!("{at}: params is empty: expected name patterns"));
        }
        let mut tensors = Vec::new();
        for pat in &g.params {
            let hits: Vec<usize> = (0..names.len()).filter(|&t| glob(pat, names[t])).collect();
            if hits.is_empty() {
                let shown: Vec<&str> = names.iter().take(8).copied().collect();
                return Err(invalid!(
                    "{at}: pattern {pat:?} matches no tensor of the model (its tensors: {shown:?}{})",
                    if names.len() > 8 { " ..." } else { "" }
                ));
            }
            for t in hits {
                match owner[t] {
                    Some(j) if j != i => {
                        return Err(invalid!(
                            "{at}: tensor {:?} is in group {j} too: each tensor may be in one group only",
                            names[t]
                        ));
                    }
                    _ => {
                        owner[t] = Some(i);
                        tensors.push(t as u32);
                    }
                }
            }
        }
        tensors.sort_unstable();
        tensors.dedup();
        let lr_scale = g.lr_scale.unwrap_or(1.0);
        if !(lr_scale.is_finite() && lr_scale > 0.0) {
            return Err(invalid!(
                "{at}: lr_scale = {}: expected a positive number",
                show(lr_scale)
            ));
        }
        if let Some(wd) = g.weight_decay
            && !(wd.is_finite() && wd >= 0.0)
        {
            return Err(invalid!("{at}: weight_decay = {wd}: expected 0 or more"));
        }
        let mut opt = optimizer.clone();
        match &mut opt {
            Optimizer::Sgd { weight_decay, .. } => {
                if g.beta1.is_some() || g.beta2.is_some() {
                    return Err(invalid!(
                        "{at}: beta1/beta2 are Adam settings; the optimizer is SGD"
                    ));
                }
                if let Some(wd) = g.weight_decay {
                    *weight_decay = wd;
                }
            }
            Optimizer::Adam {
                beta1,
                beta2,
                weight_decay,
                ..
            } => {
                for (k, v) in [("beta1", g.beta1), ("beta2", g.beta2)] {
                    if let Some(v) = v
                        && !(0.0..1.0).contains(&v)
                    {
                        return Err(invalid!("{at}: {k} = {v}: expected 0 <= {k} < 1"));
                    }
                }
                *beta1 = g.beta1.unwrap_or(*beta1);
                *beta2 = g.beta2.unwrap_or(*beta2);
                if let Some(wd) = g.weight_decay {
                    *weight_decay = wd;
                }
            }
        }
        out.push(ParamGroup {
            tensors,
            optimizer: opt,
            lr_scale,
            patterns: g.params.clone(),
        });
    }
    Ok(out)
}

/// The groups in words (empty when there are none): `; groups: ["*.bias"] sgd(...) lr x 1`.
pub fn describe_groups(groups: &[ParamGroup]) -> String {
    groups
        .iter()
        .map(|g| {
            format!(
                "; group {:?} ({} tensors): {}, lr x {}",
                g.patterns,
                g.tensors.len(),
                g.optimizer.describe(),
                g.lr_scale
            )
        })
        .collect()
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
    /// `clip_norm`, checked: a positive, finite number that is one as an f32 too (the shards
    /// clip in f32, as torch does).
    pub(super) fn clip_norm(&self) -> Result<Option<f32>, Invalid> {
        let Some(c) = self.clip_norm else {
            return Ok(None);
        };
        let f = c as f32;
        if !(c.is_finite() && c > 0.0 && f.is_finite() && f > 0.0) {
            return Err(invalid!(
                "[optimizer] clip_norm = {}: expected a positive, finite number (the max_norm of torch.nn.utils.clip_grad_norm_); leave it out for no clipping",
                show(c)
            ));
        }
        Ok(Some(f))
    }

    pub(super) fn validate(&self) -> Result<Optimizer, Invalid> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(invalid!(
                "[optimizer] lr = {}: expected a positive number",
                show(self.lr)
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(invalid!(
                "[optimizer] weight_decay = {}: expected 0 or more",
                self.weight_decay
            ));
        }
        match self.kind {
            OptimizerKind::Sgd => {
                if !(0.0..1.0).contains(&self.momentum) {
                    return Err(invalid!(
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
                        return Err(invalid!("[optimizer] {k} = {v}: expected 0 <= {k} < 1"));
                    }
                }
                if self.eps.is_nan() || self.eps <= 0.0 {
                    return Err(invalid!(
                        "[optimizer] eps = {}: expected a positive number",
                        self.eps
                    ));
                }
                if self.momentum != 0.0 || self.nesterov {
                    return Err(invalid!(
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
    pub(super) fn validate(&self, lr: f64) -> Result<LrSchedule, Invalid> {
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
                    return Err(invalid!(
                        "[schedule] gamma = {}: expected a positive number",
                        show(gamma)
                    ));
                }
                Decay::Step { step_size, gamma }
            }
            ScheduleKind::Cosine => {
                if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr < lr) {
                    return Err(invalid!(
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
            return Err(invalid!(
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

#[cfg(test)]
mod tests {
    use super::glob;

    #[test]
    fn glob_matches_star_and_question_mark() {
        assert!(glob("*.bias", "fc1.bias"));
        assert!(glob("*bn*", "blocks.0.bn1.weight"));
        assert!(glob("fc?.weight", "fc2.weight"));
        assert!(!glob("fc?.weight", "fc12.weight"));
        assert!(!glob("*.bias", "fc1.bias.x"));
        assert!(glob("*", ""));
        assert!(!glob("a", ""));
    }
}
