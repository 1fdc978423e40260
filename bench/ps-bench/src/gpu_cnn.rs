//! gpu-bench's CNN part: the built-in CNN of `ps_worker::model` (`Cnn` over the CUDA device,
//! the code a CUDA worker runs for `[model] kind = "cnn"`), timed per step at each batch.
//!
//! A CNN is given as `CxHxW:CHANNELS:KERNEL:HIDDEN:CLASSES[:STRIDE[:PADDING]]` (channels and
//! hidden widths joined by '-', hidden possibly empty; stride 1 and padding 0 by default):
//! `1x28x28:16-32:5:64:10` is the CNN of `deploy/fashion-cnn.toml` (conv 5x5 16, ReLU, maxpool 2,
//! conv 5x5 32, ReLU, maxpool 2, linear 512 -> 64 -> ReLU -> 10; 46,730 parameters).
//! `scripts/torch_mlp_bench.py --cnns` takes the same strings and builds the same network.
//!
//! FLOPs per step are counted as 2·batch·(3·ΣM − M₁), where M is each product layer's
//! multiply-adds per sample (a convolution `out·oh·ow·(c·k·k)`, a linear layer `in·out`) and
//! M₁ the first layer's: forward, weight gradient and input gradient of every layer but the
//! first (whose input gradient neither this backend nor PyTorch computes, the images needing
//! none). Bias, ReLU, pooling and the loss are not counted.

use crate::median_ms;
use ps_config::LossReduction;
use ps_model::layout::{CnnLayout, CnnShape, splitmix64};
use ps_worker::backend::{Backend, BackendError};
use ps_worker::cuda::{CudaCnn, SELF_TEST_TOL};

/// The Fashion-MNIST CNN of `deploy/fashion-cnn.toml`.
pub const FASHION_CNN: &str = "1x28x28:16-32:5:64:10";

/// One `--cnns` entry: the text it was given as and its layout.
#[derive(Debug, Clone)]
pub struct CnnSpec {
    /// As given (the model's name in the table and the JSON, as in PyTorch's).
    pub text: String,
    /// The network.
    pub layout: CnnLayout,
}

/// The `--cnns` list: CNN specifications joined by ',', or `none`.
#[derive(Debug, Clone)]
pub struct CnnList(pub Vec<CnnSpec>);

/// `--cnns`: `none`, or CNN specifications joined by ','.
pub fn parse_cnns(s: &str) -> Result<CnnList, String> {
    if s.trim() == "none" {
        return Ok(CnnList(Vec::new()));
    }
    s.split(',')
        .map(parse_cnn)
        .collect::<Result<_, _>>()
        .map(CnnList)
}

/// Positive integers joined by '-' (`empty_ok`: or nothing).
fn widths(s: &str, what: &str, empty_ok: bool) -> Result<Vec<usize>, String> {
    if s.is_empty() && empty_ok {
        return Ok(Vec::new());
    }
    s.split('-')
        .map(|w| match w.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "{what} {s:?}: expected positive integers joined by '-'"
            )),
        })
        .collect()
}

/// One CNN: `CxHxW:CHANNELS:KERNEL:HIDDEN:CLASSES[:STRIDE[:PADDING]]`.
pub fn parse_cnn(s: &str) -> Result<CnnSpec, String> {
    let s = s.trim();
    let f: Vec<&str> = s.split(':').collect();
    if !(5..=7).contains(&f.len()) {
        return Err(format!(
            "{s:?}: expected CxHxW:CHANNELS:KERNEL:HIDDEN:CLASSES[:STRIDE[:PADDING]], like {FASHION_CNN}"
        ));
    }
    let image: Vec<usize> = f[0]
        .split('x')
        .map(|d| d.parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| format!("{s:?}: image {:?}: expected CxHxW, like 1x28x28", f[0]))?;
    let [c, h, w] = image[..] else {
        return Err(format!(
            "{s:?}: image {:?}: expected CxHxW, like 1x28x28",
            f[0]
        ));
    };
    let one = |i: usize, what: &str| -> Result<usize, String> {
        f[i].parse::<usize>()
            .map_err(|_| format!("{s:?}: {what} {:?}: expected an integer", f[i]))
    };
    let shape = CnnShape {
        image: [c, h, w],
        channels: widths(f[1], "channels", false).map_err(|e| format!("{s:?}: {e}"))?,
        kernel: one(2, "kernel")?,
        stride: if f.len() > 5 { one(5, "stride")? } else { 1 },
        padding: if f.len() > 6 { one(6, "padding")? } else { 0 },
        hidden: widths(f[3], "hidden", true).map_err(|e| format!("{s:?}: {e}"))?,
        classes: one(4, "classes")?,
    };
    if shape.classes > 256 {
        return Err(format!(
            "{s:?}: classes {}: expected at most 256 (labels are bytes)",
            shape.classes
        ));
    }
    let layout = CnnLayout::new(shape).map_err(|e| format!("{s:?}: {e}"))?;
    Ok(CnnSpec {
        text: s.to_string(),
        layout,
    })
}

/// Multiply-adds per sample of each product layer, in forward order: each convolution
/// `out·oh·ow·(c·k·k)`, then each linear layer `in·out`.
pub fn layer_macs(l: &CnnLayout) -> Vec<usize> {
    let k = l.shape.kernel;
    let conv = l
        .stages
        .iter()
        .map(|st| st.out_channels * st.conv_hw[0] * st.conv_hw[1] * st.input[0] * k * k);
    let linear = l.head.dims.windows(2).map(|d| d[0] * d[1]);
    conv.chain(linear).collect()
}

/// FLOPs of one step over `batch` samples: 2·batch·(3·ΣM − M₁) (see the module's comment).
pub fn step_flops(l: &CnnLayout, batch: usize) -> f64 {
    let m = layer_macs(l);
    let per_sample = 3 * m.iter().sum::<usize>() - m[0];
    2.0 * batch as f64 * per_sample as f64
}

/// One CNN at one batch size.
#[derive(Debug)]
pub struct CnnRow {
    /// The `--cnns` text.
    pub model: String,
    /// Parameters of the network.
    pub params: usize,
    /// Samples per step.
    pub batch: usize,
    /// GFLOP per step ([`step_flops`]).
    pub gflop: f64,
    /// Forward+backward on the batch already on the device, gradient left there, then a
    /// stream synchronisation.
    pub step_ms: f64,
    /// The batch's features and labels copied to the device (pageable), synchronised.
    pub batch_ms: f64,
    /// The worker's step without a pull: weights and batch uploaded, forward+backward, the
    /// gradient downloaded layer by layer ([`Backend::forward_backward`]).
    pub full_ms: f64,
    /// The step's loss and gradient against the CPU device's on the same weights and batch:
    /// the larger of the loss's relative error and, over the tensors, the gradient's largest
    /// difference relative to the tensor's largest CPU value.
    pub err: f64,
}

impl CnnRow {
    /// GFLOP/s of the fwd+bwd step.
    pub fn gflops(&self) -> f64 {
        self.gflop / (self.step_ms * 1e-3)
    }
    /// Samples per second of the fwd+bwd step.
    pub fn images_per_s(&self) -> f64 {
        self.batch as f64 / (self.step_ms * 1e-3)
    }
}

/// Deterministic features in [0, 1) and labels below `classes` for `n` samples.
fn batch(n: usize, inputs: usize, classes: usize) -> (Vec<f32>, Vec<u8>) {
    let x = (0..(n * inputs) as u64)
        .map(|i| (splitmix64(i) >> 40) as f32 / (1u64 << 24) as f32)
        .collect();
    let labels = (0..n as u64)
        .map(|i| (splitmix64(!i) % classes as u64) as u8)
        .collect();
    (x, labels)
}

/// The difference of a step's loss and gradient (`loss`, `grad`) from the CPU device's on the
/// same weights and batch, as [`CnnRow::err`] defines it.
fn error_vs_cpu(
    l: &CnnLayout,
    w: &[f32],
    x: &[f32],
    labels: &[u8],
    loss: f64,
    grad: &[f32],
) -> Result<f64, BackendError> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut cpu = ps_worker::cpu::cpu_model(&l.clone().into(), threads);
    cpu.set_weights(w)?;
    let mut want = vec![0f32; grad.len()];
    let stats = cpu.forward_backward(x, labels, LossReduction::Mean, &mut want)?;
    let mut err = (loss - stats.loss_sum).abs() / stats.loss_sum.abs().max(1e-12);
    for t in &l.tensors {
        let r = t.range();
        let scale = want[r.clone()]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(1e-12);
        for (a, b) in grad[r.clone()].iter().zip(&want[r]) {
            let e = f64::from((a - b).abs() / scale);
            // NaN sticks (f64::max would drop it)
            err = if e.is_nan() || err.is_nan() {
                f64::NAN
            } else {
                err.max(e)
            };
        }
    }
    Ok(err)
}

/// Times `spec`'s CNN on device `ordinal` at each of `batches`; `(rows, device name, arch)`.
/// A step whose result differs from the CPU's by more than the start-up self-test's tolerance
/// ([`SELF_TEST_TOL`]) is an error: nothing wrong is timed.
pub fn bench_cnn(
    spec: &CnnSpec,
    ordinal: usize,
    batches: &[usize],
    warmup: usize,
    steps: usize,
) -> Result<(Vec<CnnRow>, String, String), BackendError> {
    let l = &spec.layout;
    let mut m = CudaCnn::new(ordinal, l.clone())?;
    let (device, arch) = (m.name(), m.arch().to_string());
    let p = l.num_params();
    let w = l.init_range(1, 0..p);
    let mut g = vec![0f32; p];
    let mut rows = Vec::new();
    for &n in batches {
        let (x, labels) = batch(n, l.inputs(), l.shape.classes);
        m.set_weights(&w)?;
        m.upload_batch(&x, &labels)?;
        let loss = m.compute_uploaded(LossReduction::Mean)?.loss_sum;
        m.download_gradient(&mut g)?;
        let err = error_vs_cpu(l, &w, &x, &labels, loss, &g)?;
        if err.is_nan() || err > SELF_TEST_TOL {
            return Err(BackendError::Cuda(format!(
                "{} at batch {n}: the CUDA step's loss or gradient differs from the CPU's by {err:e} (tolerance {SELF_TEST_TOL:e})",
                spec.text
            )));
        }
        let step_ms = median_ms(warmup, steps, || {
            m.compute_uploaded(LossReduction::Mean)?;
            m.sync()
        })?;
        let batch_ms = median_ms(warmup, steps, || {
            m.upload_batch(&x, &labels)?;
            m.sync()
        })?;
        let full_ms = median_ms(warmup, steps, || {
            m.set_weights(&w)?;
            m.forward_backward(&x, &labels, LossReduction::Mean, &mut g)
                .map(|_| ())
        })?;
        rows.push(CnnRow {
            model: spec.text.clone(),
            params: p,
            batch: n,
            gflop: step_flops(l, n) / 1e9,
            step_ms,
            batch_ms,
            full_ms,
            err,
        });
    }
    Ok((rows, device, arch))
}

/// The CNN rows as a markdown table (nothing when there are none).
pub fn markdown(rows: &[CnnRow]) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "\nThe built-in CNN (FLOPs = 2·batch·(3·ΣM − M₁), M = multiply-adds per sample of each conv/linear layer):\n\n\
         | cnn | params | batch | fwd+bwd ms | GFLOP/s | images/s | batch htod ms | full step ms | max rel err vs CPU |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.0} | {:.0} | {:.3} | {:.3} | {:.1e} |\n",
            r.model,
            r.params,
            r.batch,
            r.step_ms,
            r.gflops(),
            r.images_per_s(),
            r.batch_ms,
            r.full_ms,
            r.err,
        ));
    }
    s
}

/// The CNN rows as JSON objects, one per line.
pub fn json_items(rows: &[CnnRow], json_str: impl Fn(&str) -> String) -> Vec<String> {
    rows.iter()
        .map(|r| {
            format!(
                "    {{\"model\": {}, \"params\": {}, \"batch\": {}, \"gflop_per_step\": {}, \
                 \"step_ms\": {:.6}, \"step_gflops\": {:.3}, \"images_per_s\": {:.1}, \
                 \"batch_htod_ms\": {:.6}, \"full_step_ms\": {:.6}, \"max_rel_err_vs_cpu\": {:e}}}",
                json_str(&r.model),
                r.params,
                r.batch,
                r.gflop,
                r.step_ms,
                r.gflops(),
                r.images_per_s(),
                r.batch_ms,
                r.full_ms,
                r.err,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_fashion_cnn_of_the_deploy_config() {
        let s = parse_cnn(FASHION_CNN).unwrap();
        assert_eq!(s.layout.num_params(), 46_730);
        assert_eq!(s.layout.head.dims, vec![512, 64, 10]);
        let names: Vec<_> = s.layout.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "conv1.weight",
                "conv1.bias",
                "conv2.weight",
                "conv2.bias",
                "fc1.weight",
                "fc1.bias",
                "fc2.weight",
                "fc2.bias"
            ]
        );
    }

    #[test]
    fn flops_count_every_product_but_the_first_layers_input_gradient() {
        let l = parse_cnn(FASHION_CNN).unwrap().layout;
        // conv1 16·24·24·(1·25), conv2 32·8·8·(16·25), fc1 512·64, fc2 64·10
        assert_eq!(layer_macs(&l), vec![230_400, 819_200, 32_768, 640]);
        // 2·(3·1,083,008 − 230,400) = 6,037,248 per sample
        assert_eq!(step_flops(&l, 1), 6_037_248.0);
        assert_eq!(step_flops(&l, 256), 256.0 * 6_037_248.0);
        // stride and padding: 3x8x8 padded by 1, 3x3 stride 1 -> 8x8, pool 4x4; 3x3 -> 2x2
        let l = parse_cnn("3x8x8:4-6:3::5:1:1").unwrap().layout;
        assert_eq!(layer_macs(&l), vec![4 * 64 * 27, 6 * 16 * 36, 6 * 4 * 5]);
    }

    #[test]
    fn bad_cnns_are_refused_with_what_was_expected() {
        let err = |s: &str| parse_cnns(s).unwrap_err();
        assert!(
            err("1x28x28:16-32:5:64").contains("expected CxHxW:CHANNELS"),
            "{}",
            err("1x28x28:16-32:5:64")
        );
        assert!(err("28x28:16:5:64:10").contains("image \"28x28\": expected CxHxW"));
        assert!(err("1x28x28:16-0:5:64:10").contains("channels \"16-0\": expected positive"));
        assert!(err("1x28x28:16:x:64:10").contains("kernel \"x\": expected an integer"));
        assert!(err("1x28x28:16:5:64:300").contains("at most 256"));
        // 28 - 3 + 1 = 26 -> pool 13, 13 - 3 + 1 = 11: odd
        assert!(err("1x28x28:8-8:3:64:10").contains("conv2: output height 11 is odd"));
        assert!(err(&format!("{FASHION_CNN},1x2x2:4:5::10")).contains("smaller than the kernel"));
        assert!(parse_cnns(" none ").unwrap().0.is_empty());
        let two = parse_cnns(&format!("{FASHION_CNN},1x8x8:2:3::2"))
            .unwrap()
            .0;
        assert_eq!(
            two.iter().map(|c| c.text.as_str()).collect::<Vec<_>>(),
            [FASHION_CNN, "1x8x8:2:3::2"]
        );
    }
}
