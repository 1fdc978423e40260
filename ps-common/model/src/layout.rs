//! The model as a list of named tensor specs in PyTorch `state_dict` order, flattened into one
//! `f32` vector ([`ModelSpec`]); the split of that vector into shards; and the initial weights,
//! a pure function of the seed and the flat index so every shard initialises its own range.
//! [`MlpLayout`] is the built-in MLP and [`CnnLayout`] the built-in CNN, each its geometry plus
//! the [`ModelSpec`] it produces; [`ModelLayout`] is either.

use std::ops::{Deref, Range};

/// How a tensor's initial values are made. Every random draw is keyed by `(seed, flat index)`,
/// so any range of the flat vector can be initialised alone (each shard does its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// PyTorch's default `nn.Linear` and `nn.Conv2d` init for weights and biases:
    /// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (`kaiming_uniform_(a = sqrt(5))` for the weight),
    /// `fan_in` being the inputs of a linear layer or `in_channels * k * k` of a convolution.
    LinearUniform {
        /// Inputs of the layer the tensor belongs to.
        fan_in: usize,
    },
    /// Read from a declared model's init file ([`crate::declared`]), where the tensor's data
    /// starts at this byte: not a function of the seed ([`Init::value`] is NaN, loudly wrong;
    /// read it with [`crate::declared::Declared::read_range`]).
    File {
        /// Byte offset of the tensor's first value in the file.
        byte_offset: u64,
    },
}

impl Init {
    /// Value of flat element `index` under `seed`.
    pub fn value(&self, seed: u64, index: usize) -> f32 {
        match self {
            Init::Zeros => 0.0,
            Init::LinearUniform { fan_in } => {
                let bound = 1.0 / (*fan_in as f64).sqrt();
                ((2.0 * unit_f64(seed, index as u64) - 1.0) * bound) as f32
            }
            Init::File { .. } => f32::NAN,
        }
    }
}

/// One named tensor of the flat parameter vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// PyTorch name, e.g. `fc1.weight`.
    pub name: String,
    /// PyTorch shape: `[out, in]` for a linear weight, `[out]` for a bias.
    pub shape: Vec<usize>,
    /// Offset of the first element in the flat vector.
    pub offset: usize,
    /// Its initial values.
    pub init: Init,
}

/// The former name of [`TensorSpec`].
pub type Tensor = TensorSpec;

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Its range in the flat vector.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// A model's parameters: named tensors laid end to end, in order, in one flat `f32` vector.
/// Weights files, shard initialisation, checkpoints, export and the reference run all read it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelSpec {
    /// The tensors in flat order; each starts where the previous one ends.
    pub tensors: Vec<TensorSpec>,
}

impl ModelSpec {
    /// The spec of `(name, shape, init)` tensors laid out in the given order.
    pub fn new(tensors: impl IntoIterator<Item = (String, Vec<usize>, Init)>) -> Self {
        let mut offset = 0;
        let tensors = tensors
            .into_iter()
            .map(|(name, shape, init)| {
                let t = TensorSpec {
                    name,
                    shape,
                    offset,
                    init,
                };
                offset += t.numel();
                t
            })
            .collect();
        Self { tensors }
    }

    /// Total parameter count.
    pub fn num_params(&self) -> usize {
        self.tensors.last().map_or(0, |t| t.offset + t.numel())
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The flat ranges of `num_shards` shards (see [`shard_ranges`]).
    pub fn shard_ranges(&self, num_shards: usize) -> Vec<Range<usize>> {
        shard_ranges(self.num_params(), num_shards)
    }

    /// "10 tensors (21,840 parameters)".
    pub fn describe(&self) -> String {
        format!(
            "{} tensors ({} parameters)",
            self.tensors.len(),
            group_thousands(self.num_params())
        )
    }

    /// Names and shapes in flat order (what a worker sends at registration).
    pub fn names_and_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect()
    }

    /// Initial value of every parameter in `range`, each tensor by its [`Init`].
    pub fn init_range(&self, seed: u64, range: Range<usize>) -> Vec<f32> {
        let mut out = Vec::with_capacity(range.len());
        for t in &self.tensors {
            let r = t.range();
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            out.extend((lo..hi).map(|i| t.init.value(seed, i)));
        }
        out
    }
}

/// A multi-layer perceptron `dims[0] -> dims[1] -> ... -> dims[n]` with ReLU between layers,
/// laid out as PyTorch's `nn.Sequential` of `nn.Linear` would name it (`fc1`, `fc2`, ...).
/// Dereferences to its [`ModelSpec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpLayout {
    /// Layer widths, input first, classes last.
    pub dims: Vec<usize>,
    /// `fc{i}.weight` `[out, in]`, `fc{i}.bias` `[out]` for each layer in order, both with
    /// PyTorch's `nn.Linear` init.
    pub spec: ModelSpec,
}

impl Deref for MlpLayout {
    type Target = ModelSpec;
    fn deref(&self) -> &ModelSpec {
        &self.spec
    }
}

impl MlpLayout {
    /// The layout of an MLP with the given widths (at least input and output).
    pub fn new(dims: &[usize]) -> Self {
        assert!(
            dims.len() >= 2,
            "an MLP needs at least an input and an output width"
        );
        let spec = ModelSpec::new(dims.windows(2).enumerate().flat_map(|(i, w)| {
            let (fan_in, fan_out) = (w[0], w[1]);
            let init = Init::LinearUniform { fan_in };
            [
                (
                    format!("fc{}.weight", i + 1),
                    vec![fan_out, fan_in],
                    init.clone(),
                ),
                (format!("fc{}.bias", i + 1), vec![fan_out], init),
            ]
        }));
        Self {
            dims: dims.to_vec(),
            spec,
        }
    }

    /// The MLP a spec is, when it is one: `fc1.weight [h1, in]`, `fc1.bias [h1]`, `fc2.weight
    /// [h2, h1]`, ... in that order (a declared model that the built-in MLP worker can train).
    pub fn from_spec(spec: &ModelSpec) -> Option<Self> {
        let t = &spec.tensors;
        if t.len() < 2 || !t.len().is_multiple_of(2) {
            return None;
        }
        let mut dims = vec![*t[0].shape.get(1)?];
        for (l, pair) in t.chunks(2).enumerate() {
            let (w, b) = (&pair[0], &pair[1]);
            let out = *w.shape.first()?;
            if w.name != format!("fc{}.weight", l + 1)
                || b.name != format!("fc{}.bias", l + 1)
                || w.shape != [out, dims[l]]
                || b.shape != [out]
            {
                return None;
            }
            dims.push(out);
        }
        Some(Self::new(&dims))
    }

    /// Number of linear layers.
    pub fn num_layers(&self) -> usize {
        self.dims.len() - 1
    }

    /// Ranges of the weight and the bias of layer `l` (0-based).
    pub fn layer(&self, l: usize) -> (Range<usize>, Range<usize>) {
        (self.tensors[2 * l].range(), self.tensors[2 * l + 1].range())
    }

    /// "784-256-128-10 (235,146 parameters)".
    pub fn describe(&self) -> String {
        let dims: Vec<String> = self.dims.iter().map(|d| d.to_string()).collect();
        format!(
            "mlp {} ({} parameters)",
            dims.join("-"),
            group_thousands(self.num_params())
        )
    }
}

/// The geometry of the built-in CNN: `conv k x k -> ReLU -> maxpool 2` for each of `channels`,
/// then linear layers with ReLU between them (`hidden` widths, then `classes`), as PyTorch's
/// `nn.Conv2d`/`nn.MaxPool2d(2)`/`nn.Linear` compute it over NCHW images.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CnnShape {
    /// The input image: channels, height, width (`inputs` = their product).
    pub image: [usize; 3],
    /// Output channels of each convolution, in order (`conv1`, `conv2`, ...).
    pub channels: Vec<usize>,
    /// Kernel side of every convolution.
    pub kernel: usize,
    /// Stride of every convolution.
    pub stride: usize,
    /// Zero padding of every convolution, on each side.
    pub padding: usize,
    /// Widths of the hidden linear layers after the convolutions (`fc1`, ...).
    pub hidden: Vec<usize>,
    /// Output classes (the last linear layer's width).
    pub classes: usize,
}

/// One convolution stage of a [`CnnLayout`]: `conv -> ReLU -> maxpool 2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvStage {
    /// Input channels, height and width.
    pub input: [usize; 3],
    /// Output channels.
    pub out_channels: usize,
    /// The convolution's output height and width (before the pooling).
    pub conv_hw: [usize; 2],
    /// The pooling's output height and width (half of `conv_hw`).
    pub pool_hw: [usize; 2],
}

/// The built-in CNN: its [`CnnShape`], the stages it implies, and its [`ModelSpec`] with
/// PyTorch's names and layouts (`conv1.weight [out, in, k, k]`, `conv1.bias [out]`, ...,
/// `fc1.weight [out, in]`, ...; the flattened features are in NCHW order as `torch.flatten`
/// gives them). Dereferences to its [`ModelSpec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CnnLayout {
    /// The geometry.
    pub shape: CnnShape,
    /// The convolution stages in order.
    pub stages: Vec<ConvStage>,
    /// The linear layers after the convolutions, as an MLP over the flattened features
    /// (its ranges start at 0: add [`CnnLayout::head_offset`]).
    pub head: MlpLayout,
    /// The tensors.
    pub spec: ModelSpec,
}

impl Deref for CnnLayout {
    type Target = ModelSpec;
    fn deref(&self) -> &ModelSpec {
        &self.spec
    }
}

/// Why a `[model] kind = "cnn"` shape is not a CNN this worker computes ([`CnnLayout::new`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CnnError {
    /// A zero size, or fewer than two classes.
    #[error(
        "image = {image:?}, kernel = {kernel}, stride = {stride}, classes = {classes}: expected every size >= 1 and classes >= 2"
    )]
    ZeroSize {
        /// `[c, h, w]`.
        image: [usize; 3],
        /// The kernel's side.
        kernel: usize,
        /// The stride.
        stride: usize,
        /// The classes.
        classes: usize,
    },
    /// No convolution, or a zero width.
    #[error(
        "channels = {channels:?}, hidden = {hidden:?}: expected at least one convolution and every width >= 1"
    )]
    Widths {
        /// The convolutions' output channels.
        channels: Vec<usize>,
        /// The hidden layers' widths.
        hidden: Vec<usize>,
    },
    /// The padded input is smaller than the kernel (`what`: height or width).
    #[error(
        "{conv}: input {what} {n} + 2 x padding {padding} = {} is smaller than the kernel {kernel}",
        n + 2 * padding
    )]
    KernelTooLarge {
        /// The convolution (`conv1`, ...).
        conv: String,
        /// `height` or `width`.
        what: &'static str,
        /// The input's size.
        n: usize,
        /// The padding.
        padding: usize,
        /// The kernel's side.
        kernel: usize,
    },
    /// The stride does not divide the padded input minus the kernel.
    #[error(
        "{conv}: stride {stride} does not divide input {what} {n} + 2 x padding {padding} - kernel {kernel} = {}",
        n + 2 * padding - kernel
    )]
    Stride {
        /// The convolution.
        conv: String,
        /// `height` or `width`.
        what: &'static str,
        /// The input's size.
        n: usize,
        /// The padding.
        padding: usize,
        /// The kernel's side.
        kernel: usize,
        /// The stride.
        stride: usize,
    },
    /// The convolution's output is odd: 2x2 pooling would drop a row or column.
    #[error(
        "{conv}: output {what} {o} is odd: 2x2 max-pooling would drop its last row or column (change kernel, stride or padding)"
    )]
    OddOutput {
        /// The convolution.
        conv: String,
        /// `height` or `width`.
        what: &'static str,
        /// The output's size.
        o: usize,
    },
}

impl CnnLayout {
    /// The layout of `shape`, or why it is not a CNN this worker computes: a zero size, a
    /// kernel larger than the padded input, a stride that does not divide the padded input
    /// minus the kernel, or a convolution output that 2x2 pooling does not halve exactly.
    pub fn new(shape: CnnShape) -> Result<Self, CnnError> {
        let CnnShape {
            image,
            kernel: k,
            stride: s,
            padding: p,
            ..
        } = shape;
        if image.contains(&0) || k == 0 || s == 0 || shape.classes < 2 {
            return Err(CnnError::ZeroSize {
                image,
                kernel: k,
                stride: s,
                classes: shape.classes,
            });
        }
        if shape.channels.is_empty() || shape.channels.contains(&0) || shape.hidden.contains(&0) {
            return Err(CnnError::Widths {
                channels: shape.channels.clone(),
                hidden: shape.hidden.clone(),
            });
        }
        let mut stages = Vec::new();
        let mut tensors = Vec::new();
        let [mut c, mut h, mut w] = image;
        for (i, &out) in shape.channels.iter().enumerate() {
            let conv = format!("conv{}", i + 1);
            let side = |n: usize, what: &'static str| -> Result<usize, CnnError> {
                let padded = n + 2 * p;
                if padded < k {
                    return Err(CnnError::KernelTooLarge {
                        conv: conv.clone(),
                        what,
                        n,
                        padding: p,
                        kernel: k,
                    });
                }
                if !(padded - k).is_multiple_of(s) {
                    return Err(CnnError::Stride {
                        conv: conv.clone(),
                        what,
                        n,
                        padding: p,
                        kernel: k,
                        stride: s,
                    });
                }
                let o = (padded - k) / s + 1;
                if !o.is_multiple_of(2) {
                    return Err(CnnError::OddOutput {
                        conv: conv.clone(),
                        what,
                        o,
                    });
                }
                Ok(o)
            };
            let (oh, ow) = (side(h, "height")?, side(w, "width")?);
            let fan_in = c * k * k;
            let init = Init::LinearUniform { fan_in };
            tensors.push((format!("{conv}.weight"), vec![out, c, k, k], init.clone()));
            tensors.push((format!("{conv}.bias"), vec![out], init));
            stages.push(ConvStage {
                input: [c, h, w],
                out_channels: out,
                conv_hw: [oh, ow],
                pool_hw: [oh / 2, ow / 2],
            });
            (c, h, w) = (out, oh / 2, ow / 2);
        }
        let mut dims = vec![c * h * w];
        dims.extend(&shape.hidden);
        dims.push(shape.classes);
        let head = MlpLayout::new(&dims);
        tensors.extend(
            head.tensors
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone(), t.init.clone())),
        );
        Ok(Self {
            shape,
            stages,
            head,
            spec: ModelSpec::new(tensors),
        })
    }

    /// Input features per sample (`c * h * w` of the image).
    pub fn inputs(&self) -> usize {
        self.shape.image.iter().product()
    }

    /// Flat offset of the first linear layer's weight (the parameters of the convolutions
    /// come first).
    pub fn head_offset(&self) -> usize {
        self.spec.tensors[2 * self.stages.len()].offset
    }

    /// Ranges of the weight and the bias of convolution `i` (0-based).
    pub fn conv(&self, i: usize) -> (Range<usize>, Range<usize>) {
        (self.tensors[2 * i].range(), self.tensors[2 * i + 1].range())
    }

    /// "cnn 1x28x28 conv5x5 8-16 pool2, fc 256-64-10 (21,840 parameters)".
    pub fn describe(&self) -> String {
        let s = &self.shape;
        let join = |v: &[usize]| {
            v.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("-")
        };
        let pad = if s.padding > 0 {
            format!(" padding {}", s.padding)
        } else {
            String::new()
        };
        let stride = if s.stride > 1 {
            format!(" stride {}", s.stride)
        } else {
            String::new()
        };
        format!(
            "cnn {}x{}x{} conv{k}x{k}{stride}{pad} {} maxpool2, fc {} ({} parameters)",
            s.image[0],
            s.image[1],
            s.image[2],
            join(&s.channels),
            join(&self.head.dims),
            group_thousands(self.num_params()),
            k = s.kernel,
        )
    }
}

/// The built-in model of a run: the MLP or the CNN. Dereferences to its [`ModelSpec`], which is
/// all that shards, checkpoints, export and comparisons need; the workers build the model's
/// computation from it (`ps_worker::model`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelLayout {
    /// The MLP of `[model] hidden`.
    Mlp(MlpLayout),
    /// The CNN of `[model] kind = "cnn"`.
    Cnn(CnnLayout),
}

impl Deref for ModelLayout {
    type Target = ModelSpec;
    fn deref(&self) -> &ModelSpec {
        match self {
            ModelLayout::Mlp(m) => &m.spec,
            ModelLayout::Cnn(c) => &c.spec,
        }
    }
}

impl From<MlpLayout> for ModelLayout {
    fn from(m: MlpLayout) -> Self {
        ModelLayout::Mlp(m)
    }
}

impl From<CnnLayout> for ModelLayout {
    fn from(c: CnnLayout) -> Self {
        ModelLayout::Cnn(c)
    }
}

impl ModelLayout {
    /// Input features per sample.
    pub fn inputs(&self) -> usize {
        match self {
            ModelLayout::Mlp(m) => m.dims[0],
            ModelLayout::Cnn(c) => c.inputs(),
        }
    }

    /// Output classes.
    pub fn classes(&self) -> usize {
        match self {
            ModelLayout::Mlp(m) => *m.dims.last().expect("dims"),
            ModelLayout::Cnn(c) => c.shape.classes,
        }
    }

    /// The model in words ([`MlpLayout::describe`], [`CnnLayout::describe`]).
    pub fn describe(&self) -> String {
        match self {
            ModelLayout::Mlp(m) => m.describe(),
            ModelLayout::Cnn(c) => c.describe(),
        }
    }

    /// Its tensors.
    pub fn into_spec(self) -> ModelSpec {
        match self {
            ModelLayout::Mlp(m) => m.spec,
            ModelLayout::Cnn(c) => c.spec,
        }
    }

    /// The MLP, when it is one.
    pub fn mlp(&self) -> Option<&MlpLayout> {
        match self {
            ModelLayout::Mlp(m) => Some(m),
            ModelLayout::Cnn(_) => None,
        }
    }
}

/// The contiguous, near-equal ranges of `num_params` split `num_shards` ways, independent of
/// tensor boundaries: the first `num_params % num_shards` shards hold one extra element.
pub fn shard_ranges(num_params: usize, num_shards: usize) -> Vec<Range<usize>> {
    split_even(num_params, num_shards)
}

/// Splits `n` items into `parts` contiguous ranges as evenly as possible (the first `n % parts`
/// ranges are one longer). Used for shards and for the per-worker slices of a batch.
pub fn split_even(n: usize, parts: usize) -> Vec<Range<usize>> {
    assert!(parts > 0, "cannot split into zero parts");
    let (base, extra) = (n / parts, n % parts);
    let mut start = 0;
    (0..parts)
        .map(|p| {
            let len = base + usize::from(p < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// SplitMix64 finaliser: a good 64-bit mix of one counter.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform number in [0, 1) that depends only on `(seed, counter)`.
fn unit_f64(seed: u64, counter: u64) -> f64 {
    let x = splitmix64(splitmix64(seed ^ 0x005E_ED0F_1A17) ^ counter);
    (x >> 11) as f64 / (1u64 << 53) as f64
}

fn group_thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pytorch_names_shapes_and_counts() {
        let m = MlpLayout::new(&[784, 1024, 1024, 10]);
        assert_eq!(m.num_params(), 1_863_690);
        let names: Vec<&str> = m.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "fc1.weight",
                "fc1.bias",
                "fc2.weight",
                "fc2.bias",
                "fc3.weight",
                "fc3.bias"
            ]
        );
        assert_eq!(m.tensors[0].shape, [1024, 784]);
        assert_eq!(m.layer(1), (803_840..1_852_416, 1_852_416..1_853_440));
        assert_eq!(
            MlpLayout::new(&[784, 4096, 4096, 10]).num_params(),
            20_037_642
        );
        assert_eq!(m.describe(), "mlp 784-1024-1024-10 (1,863,690 parameters)");
    }

    #[test]
    fn a_spec_lays_tensors_end_to_end() {
        let s = ModelSpec::new([
            (
                "a".to_string(),
                vec![2, 3],
                Init::LinearUniform { fan_in: 3 },
            ),
            ("b".to_string(), vec![4], Init::Zeros),
        ]);
        assert_eq!(s.num_params(), 10);
        assert_eq!(s.tensor("b").unwrap().range(), 6..10);
        assert!(s.tensor("c").is_none());
        let v = s.init_range(1, 4..10);
        assert_eq!(v.len(), 6);
        assert!(v[2..].iter().all(|&x| x == 0.0) && v[..2].iter().all(|&x| x != 0.0));
        assert_eq!(s.shard_ranges(3), [0..4, 4..7, 7..10]);
        let m = MlpLayout::new(&[3, 2]);
        assert_eq!(m.tensors[0].init, Init::LinearUniform { fan_in: 3 });
        assert_eq!(m.spec.tensors[1].name, "fc1.bias");
    }

    #[test]
    fn an_mlp_shaped_spec_is_recognised() {
        let m = MlpLayout::new(&[5, 4, 3]);
        assert_eq!(MlpLayout::from_spec(&m.spec).unwrap().dims, [5, 4, 3]);
        let mut other = m.spec.clone();
        other.tensors[2].shape = vec![3, 5];
        assert!(MlpLayout::from_spec(&other).is_none());
        other.tensors.pop();
        assert!(MlpLayout::from_spec(&other).is_none());
    }

    #[test]
    fn shards_cover_everything_evenly() {
        let r = shard_ranges(10, 3);
        assert_eq!(r, [0..4, 4..7, 7..10]);
        assert_eq!(split_even(30, 4), [0..8, 8..16, 16..23, 23..30]);
        assert_eq!(split_even(2, 4), [0..1, 1..2, 2..2, 2..2]);
    }

    #[test]
    fn init_is_a_function_of_the_index_and_within_bounds() {
        let m = MlpLayout::new(&[16, 8, 3]);
        let all = m.init_range(7, 0..m.num_params());
        let parts: Vec<f32> = shard_ranges(m.num_params(), 3)
            .into_iter()
            .flat_map(|r| m.init_range(7, r))
            .collect();
        assert_eq!(all, parts);
        let bound1 = 1.0 / 16f32.sqrt();
        let bound2 = 1.0 / 8f32.sqrt();
        assert!(all[..16 * 8 + 8].iter().all(|v| v.abs() <= bound1));
        assert!(all[16 * 8 + 8..].iter().all(|v| v.abs() <= bound2));
        assert!(
            all[16 * 8 + 8..].iter().any(|v| v.abs() > bound1),
            "layer 2 uses its own, wider bound"
        );
        assert_ne!(all, m.init_range(8, 0..m.num_params()));
        // the values of the original formula, bit for bit
        for (i, v) in all.iter().enumerate() {
            let fan_in = if i < 16 * 8 + 8 { 16.0f64 } else { 8.0 };
            let old = ((2.0 * unit_f64(7, i as u64) - 1.0) * (1.0 / fan_in.sqrt())) as f32;
            assert_eq!(v.to_bits(), old.to_bits(), "index {i}");
        }
        let mean = all.iter().sum::<f32>() / all.len() as f32;
        assert!(mean.abs() < 0.05, "mean {mean}");
    }

    fn lenet() -> CnnShape {
        CnnShape {
            image: [1, 28, 28],
            channels: vec![6, 16],
            kernel: 5,
            stride: 1,
            padding: 0,
            hidden: vec![120],
            classes: 10,
        }
    }

    /// The names, shapes and count of `nn.Conv2d(1, 6, 5)`, `nn.Conv2d(6, 16, 5)`,
    /// `nn.Linear(256, 120)`, `nn.Linear(120, 10)` (torch: 34,622 parameters).
    #[test]
    fn the_cnn_has_pytorchs_names_shapes_and_count() {
        let c = CnnLayout::new(lenet()).unwrap();
        let got: Vec<(&str, &[usize])> = c
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.as_slice()))
            .collect();
        let want: Vec<(&str, &[usize])> = vec![
            ("conv1.weight", &[6, 1, 5, 5]),
            ("conv1.bias", &[6]),
            ("conv2.weight", &[16, 6, 5, 5]),
            ("conv2.bias", &[16]),
            ("fc1.weight", &[120, 256]),
            ("fc1.bias", &[120]),
            ("fc2.weight", &[10, 120]),
            ("fc2.bias", &[10]),
        ];
        assert_eq!(got, want);
        assert_eq!(c.num_params(), 34_622);
        assert_eq!(c.head.dims, [256, 120, 10]);
        assert_eq!(c.head_offset(), 156 + 2416);
        assert_eq!(c.stages[1].conv_hw, [8, 8]);
        assert_eq!(c.tensors[2].init, Init::LinearUniform { fan_in: 150 });
        assert_eq!(
            c.describe(),
            "cnn 1x28x28 conv5x5 6-16 maxpool2, fc 256-120-10 (34,622 parameters)"
        );
        let l = ModelLayout::from(c);
        assert_eq!((l.inputs(), l.classes()), (784, 10));
        // padding 2 keeps each convolution's input size: 28 -> pool 14 -> 14 -> pool 7
        let padded = CnnLayout::new(CnnShape {
            padding: 2,
            ..lenet()
        })
        .unwrap();
        assert_eq!(padded.stages[0].conv_hw, [28, 28]);
        assert_eq!(padded.head.dims[0], 16 * 7 * 7);
    }

    #[test]
    fn a_cnn_that_does_not_fit_is_refused_precisely() {
        let bad = |f: fn(&mut CnnShape)| {
            let mut s = lenet();
            f(&mut s);
            CnnLayout::new(s).unwrap_err().to_string()
        };
        assert_eq!(
            bad(|s| s.stride = 2),
            "conv1: stride 2 does not divide input height 28 + 2 x padding 0 - kernel 5 = 23"
        );
        assert_eq!(
            bad(|s| s.kernel = 4),
            "conv1: output height 25 is odd: 2x2 max-pooling would drop its last row or column (change kernel, stride or padding)"
        );
        assert_eq!(
            bad(|s| s.channels = vec![4, 4, 4]),
            "conv3: input height 4 + 2 x padding 0 = 4 is smaller than the kernel 5"
        );
        assert!(bad(|s| s.channels = vec![]).contains("at least one convolution"));
        assert!(bad(|s| s.kernel = 0).contains("every size >= 1"));
        assert!(bad(|s| s.hidden = vec![0]).contains("every width >= 1"));
    }
}
