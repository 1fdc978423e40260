//! `[model]`: the MLP's layer widths, and what it costs in memory.

use super::limits::{MAX_HIDDEN_LAYERS, MAX_PARAMS, MAX_WIDTH};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawModel {
    pub hidden: Vec<usize>,
    pub inputs: usize,
    pub classes: usize,
}

impl Default for RawModel {
    fn default() -> Self {
        Self {
            hidden: vec![256, 128],
            inputs: 784,
            classes: 10,
        }
    }
}

/// `[model]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Model layer widths, input first (`inputs`, `hidden...`, `classes`).
    pub dims: Vec<usize>,
}

impl RawModel {
    pub(super) fn validate(&self) -> Result<ModelConfig, String> {
        if self.inputs == 0 || self.classes < 2 || self.hidden.contains(&0) {
            return Err(format!(
                "[model] inputs = {}, classes = {}, hidden = {:?}: expected inputs >= 1, classes >= 2 and hidden widths >= 1",
                self.inputs, self.classes, self.hidden
            ));
        }
        if self.hidden.len() > MAX_HIDDEN_LAYERS {
            return Err(format!(
                "[model] hidden has {} layers: expected at most {MAX_HIDDEN_LAYERS}",
                self.hidden.len()
            ));
        }
        for (key, v) in [("inputs", self.inputs), ("classes", self.classes)] {
            if v > MAX_WIDTH {
                return Err(format!("[model] {key} = {v}: expected at most {MAX_WIDTH}"));
            }
        }
        for (i, &v) in self.hidden.iter().enumerate() {
            if v > MAX_WIDTH {
                return Err(format!(
                    "[model] hidden[{i}] = {v}: expected at most {MAX_WIDTH} units per layer"
                ));
            }
        }
        let mut dims = vec![self.inputs];
        dims.extend(&self.hidden);
        dims.push(self.classes);
        let m = ModelConfig { dims };
        let params = m.num_params();
        if params > MAX_PARAMS {
            return Err(format!(
                "[model] hidden = {:?}: {params} parameters, expected at most {MAX_PARAMS}",
                self.hidden
            ));
        }
        Ok(m)
    }
}

impl ModelConfig {
    /// Parameters (weights and biases), computed without overflow (widths are at most
    /// [`MAX_WIDTH`] and layers at most [`MAX_HIDDEN_LAYERS`] + 1, so this fits in u64).
    pub fn num_params(&self) -> u64 {
        self.dims
            .windows(2)
            .map(|w| (w[0] as u64) * (w[1] as u64) + w[1] as u64)
            .sum()
    }

    /// Input features.
    pub fn inputs(&self) -> usize {
        self.dims[0]
    }

    /// Output classes.
    pub fn classes(&self) -> usize {
        self.dims[self.dims.len() - 1]
    }
}
