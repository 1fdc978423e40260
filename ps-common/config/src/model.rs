//! `[model]`: the built-in MLP's layer widths, the built-in CNN's geometry (`kind = "cnn"`),
//! or a model declared by its init file (`init = "init.safetensors"`, see [`ps_model::declared`]),
//! and what it costs in memory.

use super::Resolve;
use super::limits::{MAX_HIDDEN_LAYERS, MAX_PARAMS, MAX_WIDTH};
use crate::error::Invalid;
use ps_model::declared::Declared;
use ps_model::layout::{CnnLayout, CnnShape};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The built-in MLP's hidden widths when `[model] hidden` is not given.
const DEFAULT_HIDDEN: [usize; 2] = [256, 128];
/// The built-in CNN's hidden linear widths when `[model] hidden` is not given.
const DEFAULT_CNN_HIDDEN: [usize; 1] = [64];
/// The built-in CNN's convolution channels when `[model] channels` is not given.
const DEFAULT_CHANNELS: [usize; 2] = [8, 16];

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawModel {
    pub hidden: Option<Vec<usize>>,
    pub inputs: usize,
    pub classes: usize,
    /// A declared model's safetensors file (instead of `hidden`); with `kind = "cnn"`, the
    /// built-in CNN's initial weights (the same names and shapes).
    pub init: Option<PathBuf>,
    /// `mlp` (the default) or `cnn`.
    pub kind: Option<String>,
    /// The CNN's input image `[channels, height, width]` (default `[1, 28, 28]`).
    pub image: Option<[usize; 3]>,
    /// The CNN's convolution output channels, one per convolution.
    pub channels: Option<Vec<usize>>,
    /// The CNN's kernel side (default 5).
    pub kernel: Option<usize>,
    /// The CNN's convolution stride (default 1).
    pub stride: Option<usize>,
    /// The CNN's zero padding (default 0).
    pub padding: Option<usize>,
}

impl Default for RawModel {
    fn default() -> Self {
        Self {
            hidden: None,
            inputs: 784,
            classes: 10,
            init: None,
            kind: None,
            image: None,
            channels: None,
            kernel: None,
            stride: None,
            padding: None,
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
    /// The model declared by `init`, when given: the server trains it instead of the MLP
    /// (with `kind = "cnn"`: the built-in CNN's initial weights).
    pub declared: Option<Declared>,
    /// The built-in CNN's geometry (`kind = "cnn"`); `dims` is then `inputs`, the hidden linear
    /// widths and `classes`.
    pub cnn: Option<CnnShape>,
}

impl RawModel {
    pub(super) fn validate(&self, resolve: &Resolve) -> Result<ModelConfig, Invalid> {
        let cnn = match self.kind.as_deref() {
            None | Some("mlp") => {
                for (key, given) in [
                    ("image", self.image.is_some()),
                    ("channels", self.channels.is_some()),
                    ("kernel", self.kernel.is_some()),
                    ("stride", self.stride.is_some()),
                    ("padding", self.padding.is_some()),
                ] {
                    if given {
                        return Err(invalid!(
                            "[model] {key} is a key of the CNN: set kind = \"cnn\" (the model is the MLP)"
                        ));
                    }
                }
                false
            }
            Some("cnn") => true,
            Some(other) => {
                return Err(invalid!(
                    "[model] kind = {other:?}: expected \"mlp\" or \"cnn\""
                ));
            }
        };
        if cnn {
            return self.validate_cnn(resolve);
        }
        let declared = match &self.init {
            None => None,
            Some(_) if self.hidden.is_some() => {
                return Err("[model] init and hidden are both given: expected one (init declares the model, hidden sizes the built-in MLP)".into());
            }
            Some(p) => Some(Declared::open(&resolve.path(p)).map_err(|e| e.to_string())?),
        };
        let hidden = self.hidden.clone().unwrap_or(DEFAULT_HIDDEN.to_vec());
        if self.inputs == 0 || self.classes < 2 || hidden.contains(&0) {
            return Err(invalid!(
                "[model] inputs = {}, classes = {}, hidden = {:?}: expected inputs >= 1, classes >= 2 and hidden widths >= 1",
                self.inputs,
                self.classes,
                hidden
            ));
        }
        if hidden.len() > MAX_HIDDEN_LAYERS {
            return Err(invalid!(
                "[model] hidden has {} layers: expected at most {MAX_HIDDEN_LAYERS}",
                hidden.len()
            ));
        }
        for (key, v) in [("inputs", self.inputs), ("classes", self.classes)] {
            if v > MAX_WIDTH {
                return Err(invalid!(
                    "[model] {key} = {v}: expected at most {MAX_WIDTH}"
                ));
            }
        }
        for (i, &v) in hidden.iter().enumerate() {
            if v > MAX_WIDTH {
                return Err(invalid!(
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
            .and_then(|d| ps_model::layout::MlpLayout::from_spec(&d.spec))
        {
            dims = m.dims;
        }
        let m = ModelConfig {
            dims,
            declared,
            cnn: None,
        };
        let params = m.num_params();
        if params > MAX_PARAMS {
            return Err(invalid!(
                "[model] hidden = {:?}: {params} parameters, expected at most {MAX_PARAMS}",
                hidden
            ));
        }
        Ok(m)
    }
}

impl RawModel {
    /// `kind = "cnn"`: the geometry, checked by [`CnnLayout::new`], and an init file (if any)
    /// with exactly the CNN's tensors.
    fn validate_cnn(&self, resolve: &Resolve) -> Result<ModelConfig, Invalid> {
        let image = self.image.unwrap_or([1, 28, 28]);
        let hidden = self.hidden.clone().unwrap_or(DEFAULT_CNN_HIDDEN.to_vec());
        let channels = self.channels.clone().unwrap_or(DEFAULT_CHANNELS.to_vec());
        let pixels = image.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
        if pixels != Some(self.inputs) {
            return Err(invalid!(
                "[model] image = {image:?} is {} values per sample but inputs = {}: expected them equal",
                pixels.map_or("too many".to_string(), |p| p.to_string()),
                self.inputs
            ));
        }
        if hidden.len() > MAX_HIDDEN_LAYERS || channels.len() > MAX_HIDDEN_LAYERS {
            return Err(invalid!(
                "[model] hidden has {} layers and channels {}: expected at most {MAX_HIDDEN_LAYERS} each",
                hidden.len(),
                channels.len()
            ));
        }
        for (key, v) in [("inputs", self.inputs), ("classes", self.classes)]
            .into_iter()
            .chain(hidden.iter().map(|&h| ("hidden", h)))
            .chain(channels.iter().map(|&c| ("channels", c)))
            .chain([
                ("kernel", self.kernel.unwrap_or(5)),
                ("padding", self.padding.unwrap_or(0)),
                ("stride", self.stride.unwrap_or(1)),
            ])
        {
            if v > MAX_WIDTH {
                return Err(invalid!(
                    "[model] {key} = {v}: expected at most {MAX_WIDTH}"
                ));
            }
        }
        // the convolutions' weights, bounded before the layout multiplies sizes in usize
        let k = self.kernel.unwrap_or(5) as u128;
        let conv_params: u128 = std::iter::once(image[0])
            .chain(channels.iter().copied())
            .zip(&channels)
            .map(|(i, &o)| i as u128 * k * k * o as u128)
            .sum();
        if conv_params > u128::from(MAX_PARAMS) {
            return Err(invalid!(
                "[model] kind = \"cnn\": channels = {channels:?} with kernel {k}: {conv_params} convolution weights, expected at most {MAX_PARAMS} parameters"
            ));
        }
        let shape = CnnShape {
            image,
            channels,
            kernel: self.kernel.unwrap_or(5),
            stride: self.stride.unwrap_or(1),
            padding: self.padding.unwrap_or(0),
            hidden: hidden.clone(),
            classes: self.classes,
        };
        let layout =
            CnnLayout::new(shape.clone()).map_err(|e| invalid!("[model] kind = \"cnn\": {e}"))?;
        let params = layout.num_params() as u64;
        if params > MAX_PARAMS {
            return Err(invalid!(
                "[model] kind = \"cnn\": {params} parameters, expected at most {MAX_PARAMS}"
            ));
        }
        let declared = match &self.init {
            None => None,
            Some(p) => {
                let d = Declared::open(&resolve.path(p)).map_err(|e| e.to_string())?;
                if d.spec.names_and_shapes() != layout.names_and_shapes() {
                    return Err(invalid!(
                        "[model] init = {}: its tensors {:?} are not those of the CNN of [model] ({:?})",
                        p.display(),
                        d.spec.names_and_shapes(),
                        layout.names_and_shapes()
                    ));
                }
                Some(d)
            }
        };
        let mut dims = vec![self.inputs];
        dims.extend(&hidden);
        dims.push(self.classes);
        Ok(ModelConfig {
            dims,
            declared,
            cnn: Some(shape),
        })
    }
}

impl ModelConfig {
    /// Parameters (a declared model's, or the MLP's weights and biases), computed without overflow (widths are at most
    /// [`MAX_WIDTH`] and layers at most [`MAX_HIDDEN_LAYERS`] + 1, so this fits in u64).
    pub fn num_params(&self) -> u64 {
        if let Some(d) = &self.declared {
            return d.spec.num_params() as u64;
        }
        if let Some(c) = &self.cnn {
            return CnnLayout::new(c.clone()).map_or(0, |l| l.num_params() as u64);
        }
        self.dims
            .windows(2)
            .map(|w| (w[0] as u64) * (w[1] as u64) + w[1] as u64)
            .sum()
    }

    /// Values per sample that a worker keeps for the forward and backward pass (activations
    /// and their gradients; for the CNN also the column matrices), an estimate.
    pub fn activation_units(&self) -> u64 {
        let dims: u64 = self.dims.iter().map(|&d| d as u64).sum();
        let Some(l) = self.cnn.clone().and_then(|c| CnnLayout::new(c).ok()) else {
            return dims;
        };
        let k = l.shape.kernel as u64;
        l.stages
            .iter()
            .map(|s| {
                let conv = (s.conv_hw[0] * s.conv_hw[1]) as u64;
                let pool = (s.pool_hw[0] * s.pool_hw[1]) as u64;
                let out = s.out_channels as u64;
                s.input[0] as u64 * k * k * conv + 2 * out * conv + 3 * out * pool
            })
            .sum::<u64>()
            + dims
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
