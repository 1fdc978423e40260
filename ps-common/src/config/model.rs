//! `[model]`: the built-in MLP's layer widths, or a model declared by its init file
//! (`init = "init.safetensors"`, see [`crate::declared`]), and what it costs in memory.

use super::Resolve;
use super::limits::{MAX_HIDDEN_LAYERS, MAX_PARAMS, MAX_WIDTH};
use crate::declared::Declared;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The built-in MLP's hidden widths when `[model] hidden` is not given.
const DEFAULT_HIDDEN: [usize; 2] = [256, 128];

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawModel {
    pub hidden: Option<Vec<usize>>,
    pub inputs: usize,
    pub classes: usize,
    /// A declared model's safetensors file (instead of `hidden`).
    pub init: Option<PathBuf>,
}

impl Default for RawModel {
    fn default() -> Self {
        Self {
            hidden: None,
            inputs: 784,
            classes: 10,
            init: None,
        }
    }
}

/// `[model]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Model layer widths, input first (`inputs`, `hidden...`, `classes`); for a declared
    /// model shaped like the MLP (`fc1.weight`, `fc1.bias`, ...), its widths; for another
    /// declared model, the MLP's default widths (unused by the model itself).
    pub dims: Vec<usize>,
    /// The model declared by `init`, when given: the server trains it instead of the MLP.
    pub declared: Option<Declared>,
}

impl RawModel {
    pub(super) fn validate(&self, resolve: &Resolve) -> Result<ModelConfig, String> {
        let declared = match &self.init {
            None => None,
            Some(_) if self.hidden.is_some() => {
                return Err("[model] init and hidden are both given: expected one (init declares the model, hidden sizes the built-in MLP)".into());
            }
            Some(p) => Some(Declared::open(&resolve.path(p))?),
        };
        let hidden = self.hidden.clone().unwrap_or(DEFAULT_HIDDEN.to_vec());
        if self.inputs == 0 || self.classes < 2 || hidden.contains(&0) {
            return Err(format!(
                "[model] inputs = {}, classes = {}, hidden = {:?}: expected inputs >= 1, classes >= 2 and hidden widths >= 1",
                self.inputs, self.classes, hidden
            ));
        }
        if hidden.len() > MAX_HIDDEN_LAYERS {
            return Err(format!(
                "[model] hidden has {} layers: expected at most {MAX_HIDDEN_LAYERS}",
                hidden.len()
            ));
        }
        for (key, v) in [("inputs", self.inputs), ("classes", self.classes)] {
            if v > MAX_WIDTH {
                return Err(format!("[model] {key} = {v}: expected at most {MAX_WIDTH}"));
            }
        }
        for (i, &v) in hidden.iter().enumerate() {
            if v > MAX_WIDTH {
                return Err(format!(
                    "[model] hidden[{i}] = {v}: expected at most {MAX_WIDTH} units per layer"
                ));
            }
        }
        let mut dims = vec![self.inputs];
        dims.extend(&hidden);
        dims.push(self.classes);
        // a declared model shaped like the built-in MLP: its widths (the MLP worker can train it)
        if let Some(m) = declared
            .as_ref()
            .and_then(|d| crate::layout::MlpLayout::from_spec(&d.spec))
        {
            dims = m.dims;
        }
        let m = ModelConfig { dims, declared };
        let params = m.num_params();
        if params > MAX_PARAMS {
            return Err(format!(
                "[model] hidden = {:?}: {params} parameters, expected at most {MAX_PARAMS}",
                hidden
            ));
        }
        Ok(m)
    }
}

impl ModelConfig {
    /// Parameters (a declared model's, or the MLP's weights and biases), computed without overflow (widths are at most
    /// [`MAX_WIDTH`] and layers at most [`MAX_HIDDEN_LAYERS`] + 1, so this fits in u64).
    pub fn num_params(&self) -> u64 {
        if let Some(d) = &self.declared {
            return d.spec.num_params() as u64;
        }
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
