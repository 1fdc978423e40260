//! The model as a list of named tensors in PyTorch `state_dict` order, flattened into one
//! `f32` vector; the split of that vector into shards; and the initial weights, a pure
//! function of the seed and the flat index so every shard initialises its own range.

use std::ops::Range;

/// One named tensor of the flat parameter vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// PyTorch name, e.g. `fc1.weight`.
    pub name: String,
    /// PyTorch shape: `[out, in]` for a weight, `[out]` for a bias.
    pub shape: Vec<usize>,
    /// Offset of the first element in the flat vector.
    pub offset: usize,
}

impl Tensor {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Its range in the flat vector.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// A multi-layer perceptron `dims[0] -> dims[1] -> ... -> dims[n]` with ReLU between layers,
/// laid out as PyTorch's `nn.Sequential` of `nn.Linear` would name it (`fc1`, `fc2`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpLayout {
    /// Layer widths, input first, classes last.
    pub dims: Vec<usize>,
    /// `fc{i}.weight`, `fc{i}.bias` for each layer in order.
    pub tensors: Vec<Tensor>,
}

impl MlpLayout {
    /// The layout of an MLP with the given widths (at least input and output).
    pub fn new(dims: &[usize]) -> Self {
        assert!(
            dims.len() >= 2,
            "an MLP needs at least an input and an output width"
        );
        let mut tensors = Vec::with_capacity(2 * (dims.len() - 1));
        let mut offset = 0;
        for (i, w) in dims.windows(2).enumerate() {
            let (fan_in, fan_out) = (w[0], w[1]);
            for (suffix, shape) in [("weight", vec![fan_out, fan_in]), ("bias", vec![fan_out])] {
                let t = Tensor {
                    name: format!("fc{}.{suffix}", i + 1),
                    shape,
                    offset,
                };
                offset += t.numel();
                tensors.push(t);
            }
        }
        Self {
            dims: dims.to_vec(),
            tensors,
        }
    }

    /// Number of linear layers.
    pub fn num_layers(&self) -> usize {
        self.dims.len() - 1
    }

    /// Total parameter count.
    pub fn num_params(&self) -> usize {
        self.tensors.last().map_or(0, |t| t.offset + t.numel())
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

    /// Initial value of every parameter in `range`: PyTorch's default `nn.Linear` init
    /// distribution, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases, drawn from a
    /// counter-based generator keyed by `(seed, flat index)`.
    pub fn init_range(&self, seed: u64, range: Range<usize>) -> Vec<f32> {
        let mut out = Vec::with_capacity(range.len());
        for (t, fan_in) in self
            .tensors
            .iter()
            .zip(self.dims.iter().flat_map(|&d| [d, d]))
        {
            let r = t.range();
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            let bound = 1.0 / (fan_in as f64).sqrt();
            out.extend((lo..hi).map(|i| ((2.0 * unit_f64(seed, i as u64) - 1.0) * bound) as f32));
        }
        out
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
        let mean = all.iter().sum::<f32>() / all.len() as f32;
        assert!(mean.abs() < 0.05, "mean {mean}");
    }
}
