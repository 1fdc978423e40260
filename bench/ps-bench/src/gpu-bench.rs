//! gpu-bench: micro-benchmark of the CUDA backend.
//!
//! For each model and batch size, on the MLP of `ps_worker::model` over the CUDA device (the
//! code the worker runs): the forward+backward time per step on a batch already on the device,
//! with the gradient left there (kernels, sgemm, reading the loss back), beside the same step's
//! sgemm calls alone (per layer the forward product and the weight gradient, and the input
//! gradient of every layer but the first, exactly the products a step makes); the host-to-device
//! copies of the batch features and of the weights (from pageable memory, and from the device's
//! pinned staging memory) and the device-to-host gradient download; a full step (upload
//! weights, upload batch, forward+backward, download gradient layer by layer); and the
//! worker's gated step (the weights copied into the staging memory as a pull writes them, then
//! uploaded piece by piece by the forward pass). Medians over `--steps` timed steps after
//! `--warmup` untimed ones, each timed step ending with a stream synchronisation (the fwd+bwd
//! step too: the loss is read back, then the stream synchronised, so the backward pass after
//! the loss is inside the time). FLOPs are counted as 6·batch·Σ(in·out) per step
//! (forward, weight gradient and input gradient of every layer; a real step skips the first
//! layer's input gradient but the count, like PyTorch's usual one, includes it); the sgemm-only
//! rate counts the FLOPs of the products it runs.
//!
//! Then, for each CNN of `--cnns` (default the Fashion-MNIST CNN of `deploy/fashion-cnn.toml`;
//! `none` to skip), the built-in CNN of `ps_worker::model` on the CUDA device at each batch:
//! forward+backward on a batch already on the device, stream-synchronised, checked once per
//! batch against the CPU device; the batch upload; the worker's step without a pull
//! ([`gpu_cnn`]). Its FLOPs are counted as 2·batch·(3·ΣM − M₁) per step, M being each
//! convolution's (`out·oh·ow·c·k·k`) and linear layer's (`in·out`) multiply-adds per sample and
//! M₁ the first layer's: forward, weight gradient and input gradient of every layer but the
//! first, whose input gradient is not computed (here the real step's count, not the MLP's
//! convention: the first convolution is a fifth of the CNN's products).
//!
//! Prints markdown tables; `--json PATH` also writes the figures as JSON (the MLPs under
//! `results`, the CNNs under `cnn_results`). Without a GPU it prints one "no GPU: …" line and
//! exits 0.

mod gpu_cnn;

use gpu_cnn::{CnnList, FASHION_CNN, parse_cnns};
use ps_config::LossReduction;
use ps_model::layout::{MlpLayout, splitmix64};
use ps_worker::backend::{Backend, BackendError};
use ps_worker::cuda::{CudaBackend, CudaDevice};
use ps_worker::ops::Device;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// The command line.
#[derive(Debug, clap::Parser)]
#[command(
    name = "gpu-bench",
    version,
    about = "Time the CUDA backend per layer and per step, for each model and batch (a markdown table; without a GPU it says so and exits 0)"
)]
struct Args {
    /// Also write the figures as JSON to this file.
    #[arg(long, value_name = "PATH")]
    json: Option<String>,
    /// Timed steps per figure (the median is reported).
    #[arg(long, default_value = "50", value_parser = positive)]
    steps: usize,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// CUDA device index.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// MLPs as layer widths joined by '-', comma-separated (at least two widths each), or
    /// `none`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "784-1024-1024-10,784-4096-4096-10",
        value_parser = parse_model
    )]
    models: Vec<Vec<usize>>,
    /// CNNs as CxHxW:CHANNELS:KERNEL:HIDDEN:CLASSES[:STRIDE[:PADDING]] (channels and hidden
    /// widths joined by '-'), comma-separated, or `none`; the default is the Fashion-MNIST
    /// CNN of deploy/fashion-cnn.toml.
    #[arg(long, default_value = FASHION_CNN, value_parser = parse_cnns)]
    cnns: CnnList,
    /// Global batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024", value_parser = positive)]
    batches: Vec<usize>,
}

/// A positive integer.
fn positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?}: expected a positive integer")),
    }
}

/// One `--models` entry: positive widths joined by '-', at least two (e.g. 784-10); `none`: no
/// MLP (an empty list, skipped).
fn parse_model(s: &str) -> Result<Vec<usize>, String> {
    if s.trim() == "none" {
        return Ok(Vec::new());
    }
    let dims: Vec<usize> = s.split('-').map(positive).collect::<Result<_, _>>()?;
    if dims.len() < 2 {
        return Err(format!(
            "{s:?}: a model is at least two widths, like 784-10"
        ));
    }
    Ok(dims)
}

/// Median of the wall times of `steps` calls of `f`, in milliseconds, after `warmup` calls.
fn median_ms(
    warmup: usize,
    steps: usize,
    mut f: impl FnMut() -> Result<(), BackendError>,
) -> Result<f64, BackendError> {
    for _ in 0..warmup {
        f()?;
    }
    let mut t = Vec::with_capacity(steps);
    for _ in 0..steps {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    let m = t.len() / 2;
    Ok(if t.len() % 2 == 1 {
        t[m]
    } else {
        0.5 * (t[m - 1] + t[m])
    })
}

#[derive(Debug)]
struct Row {
    model: String,
    params: usize,
    batch: usize,
    gflop: f64,
    /// FLOPs of the products `gemm_only` runs (no input gradient of the first layer).
    gemm_gflop: f64,
    step_ms: f64,
    gemm_ms: f64,
    batch_ms: f64,
    htod_ms: f64,
    /// The weights uploaded from the device's pinned staging memory.
    pinned_ms: f64,
    dtoh_ms: f64,
    full_ms: f64,
    /// A worker's step with the weights pulled into the staging memory through a gate.
    gated_ms: f64,
}

impl Row {
    fn rate(&self, ms: f64) -> f64 {
        self.gflop / (ms * 1e-3)
    }
    fn gemm_rate(&self) -> f64 {
        self.gemm_gflop / (self.gemm_ms * 1e-3)
    }
    fn gbps(&self, ms: f64) -> f64 {
        (4 * self.params) as f64 / (ms * 1e6)
    }
}

fn bench_model(
    b: &mut CudaBackend,
    dims: &[usize],
    batches: &[usize],
    a: &Args,
) -> Result<Vec<Row>, BackendError> {
    let layout = MlpLayout::new(dims);
    let p = layout.num_params();
    let w = layout.init_range(1, 0..p);
    let mut g = vec![0.0f32; p];
    let classes = *dims.last().expect("dims") as u64;
    let macs: usize = dims.windows(2).map(|d| d[0] * d[1]).sum();
    let mut rows = Vec::new();
    for &n in batches {
        let x: Vec<f32> = (0..(n * dims[0]) as u64)
            .map(|i| (splitmix64(i) >> 40) as f32 / (1u64 << 24) as f32)
            .collect();
        let labels: Vec<u8> = (0..n as u64)
            .map(|i| (splitmix64(!i) % classes.min(256)) as u8)
            .collect();
        b.set_weights(&w)?;
        let (warm, steps) = (a.warmup, a.steps);
        b.upload_batch(&x, &labels)?;
        let step_ms = median_ms(warm, steps, || {
            b.compute_uploaded(LossReduction::Mean)?;
            b.sync()
        })?;
        let gemm_ms = median_ms(warm, steps, || {
            b.gemm_only(n)?;
            b.sync()
        })?;
        let batch_ms = median_ms(warm, steps, || {
            b.upload_batch(&x, &labels)?;
            b.sync()
        })?;
        let htod_ms = median_ms(warm, steps, || {
            b.set_weights(&w)?;
            b.sync()
        })?;
        let pinned_ms = {
            let dev = b.device_mut();
            let ptr = dev.staging(p)?.expect("the CUDA device has staging memory");
            // SAFETY: `p` values of pinned memory that stay allocated until the next
            // `staging` call (none below); nothing else writes them
            let host = unsafe { std::slice::from_raw_parts_mut(ptr, p) };
            host.copy_from_slice(&w);
            let mut buf = dev.alloc(p)?;
            median_ms(warm, steps, || {
                dev.upload(host, CudaDevice::view_mut(&mut buf, 0..p))?;
                dev.sync()
            })?
        };
        let dtoh_ms = median_ms(warm, steps, || b.download_gradient(&mut g))?;
        let full_ms = median_ms(warm, steps, || {
            b.set_weights(&w)?;
            b.forward_backward(&x, &labels, LossReduction::Mean, &mut g)
                .map(|_| ())
        })?;
        // the worker's path: the pull writes the staging memory (here at once, one shard) and
        // forward uploads it piece by piece
        let one_shard: Vec<std::ops::Range<usize>> = std::iter::once(0..p).collect();
        let gated_ms = median_ms(warm, steps, || {
            let gate = b
                .open_gate(1, one_shard.clone(), Duration::from_secs(60))
                .expect("the CUDA backend gates a pull");
            gate.deliver(0, &w, p, Duration::ZERO);
            let r = b.forward_backward(&x, &labels, LossReduction::Mean, &mut g);
            b.close_gate();
            r.map(|_| ())
        })?;
        rows.push(Row {
            model: dims
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("-"),
            params: p,
            batch: n,
            gflop: 6.0 * n as f64 * macs as f64 / 1e9,
            gemm_gflop: (6 * macs - 2 * dims[0] * dims[1]) as f64 * n as f64 / 1e9,
            step_ms,
            gemm_ms,
            batch_ms,
            htod_ms,
            pinned_ms,
            dtoh_ms,
            full_ms,
            gated_ms,
        });
    }
    Ok(rows)
}

fn markdown(header: &str, rows: &[Row]) -> String {
    let mut s = format!("{header}\n\n");
    s.push_str(
        "| model | params | batch | fwd+bwd ms | GFLOP/s | sgemm-only ms | sgemm GFLOP/s | sgemm share | \
         batch htod ms | weights htod ms | htod GB/s | pinned htod ms | pinned GB/s | grad dtoh ms | dtoh GB/s | \
         full step ms | gated step ms |\n",
    );
    s.push_str(
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.0} | {:.3} | {:.0} | {:.0}% | {:.3} | {:.3} | {:.1} | {:.3} | {:.1} | {:.3} | {:.1} | {:.3} | {:.3} |\n",
            r.model,
            r.params,
            r.batch,
            r.step_ms,
            r.rate(r.step_ms),
            r.gemm_ms,
            r.gemm_rate(),
            100.0 * r.gemm_ms / r.step_ms,
            r.batch_ms,
            r.htod_ms,
            r.gbps(r.htod_ms),
            r.pinned_ms,
            r.gbps(r.pinned_ms),
            r.dtoh_ms,
            r.gbps(r.dtoh_ms),
            r.full_ms,
            r.gated_ms,
        ));
    }
    s
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn json(device: &str, arch: &str, a: &Args, rows: &[Row], cnns: &[gpu_cnn::CnnRow]) -> String {
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"model\": {}, \"params\": {}, \"batch\": {}, \"gflop_per_step\": {:.6}, \
                 \"step_ms\": {:.6}, \"step_gflops\": {:.3}, \"sgemm_ms\": {:.6}, \"sgemm_gflops\": {:.3}, \"batch_htod_ms\": {:.6}, \
                 \"weights_htod_ms\": {:.6}, \"weights_htod_gbps\": {:.3}, \"pinned_htod_ms\": {:.6}, \
                 \"pinned_htod_gbps\": {:.3}, \"grad_dtoh_ms\": {:.6}, \
                 \"grad_dtoh_gbps\": {:.3}, \"full_step_ms\": {:.6}, \"gated_step_ms\": {:.6}}}",
                json_str(&r.model),
                r.params,
                r.batch,
                r.gflop,
                r.step_ms,
                r.rate(r.step_ms),
                r.gemm_ms,
                r.gemm_rate(),
                r.batch_ms,
                r.htod_ms,
                r.gbps(r.htod_ms),
                r.pinned_ms,
                r.gbps(r.pinned_ms),
                r.dtoh_ms,
                r.gbps(r.dtoh_ms),
                r.full_ms,
                r.gated_ms,
            )
        })
        .collect();
    let cnn_items = gpu_cnn::json_items(cnns, json_str);
    format!(
        "{{\n  \"tool\": \"gpu-bench\",\n  \"device\": {},\n  \"arch\": {},\n  \"precision\": \"fp32 (no TF32)\",\n  \
         \"steps\": {},\n  \"warmup\": {},\n  \"statistic\": \"median\",\n  \"results\": [\n{}\n  ],\n  \
         \"cnn_flops\": \"2*batch*(3*sum(M) - M1), M: multiply-adds per sample of each conv and linear layer\",\n  \
         \"cnn_results\": [\n{}\n  ]\n}}\n",
        json_str(device),
        json_str(arch),
        a.steps,
        a.warmup,
        items.join(",\n"),
        cnn_items.join(",\n")
    )
}

/// Why the benchmarks stopped early: no GPU (said, exit 0) or a failure (exit 1).
enum Stop {
    NoGpu(String),
    Failed(String),
}

impl Stop {
    /// A failed start of a model: `NoGpu` stays itself.
    fn opening(e: BackendError) -> Self {
        match e {
            BackendError::NoGpu(_) => Stop::NoGpu(e.to_string()),
            e => Stop::Failed(e.to_string()),
        }
    }
}

/// The figures of every benchmark, with the device's name and what its kernels loaded as.
#[derive(Default)]
struct Figures {
    mlps: Vec<Row>,
    cnns: Vec<gpu_cnn::CnnRow>,
    device: String,
    arch: String,
}

/// Times every `--models` MLP, then every `--cnns` CNN.
fn run(a: &Args) -> Result<Figures, Stop> {
    let mut f = Figures::default();
    for dims in a.models.iter().filter(|d| !d.is_empty()) {
        let mut b = CudaBackend::new(a.device, MlpLayout::new(dims)).map_err(Stop::opening)?;
        f.device = b.name();
        f.arch = b.arch().to_string();
        let rows = bench_model(&mut b, dims, &a.batches, a)
            .map_err(|e| Stop::Failed(format!("{dims:?}: {e}")))?;
        f.mlps.extend(rows);
    }
    for spec in &a.cnns.0 {
        let (rows, device, arch) = gpu_cnn::bench_cnn(
            spec, a.device, &a.batches, a.warmup, a.steps,
        )
        .map_err(|e| match e {
            BackendError::NoGpu(_) => Stop::opening(e),
            e => Stop::Failed(format!("{}: {e}", spec.text)),
        })?;
        (f.device, f.arch) = (device, arch);
        f.cnns.extend(rows);
    }
    Ok(f)
}

fn main() -> ExitCode {
    let a = <Args as clap::Parser>::parse();
    let f = match run(&a) {
        Ok(f) => f,
        Err(Stop::NoGpu(e)) => {
            println!("{e}");
            return ExitCode::SUCCESS;
        }
        Err(Stop::Failed(e)) => {
            eprintln!("gpu-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (device, arch) = (&f.device, &f.arch);
    let header = format!(
        "gpu-bench on {device} [{arch}], FP32 (no TF32): median of {} steps after {} warm-up steps; \
         MLP FLOPs = 6·batch·Σ(in·out)",
        a.steps, a.warmup
    );
    if f.mlps.is_empty() {
        println!("{header}");
    } else {
        print!("{}", markdown(&header, &f.mlps));
    }
    print!("{}", gpu_cnn::markdown(&f.cnns));
    if let Some(path) = &a.json {
        if let Err(e) = std::fs::write(path, json(device, arch, &a, &f.mlps, &f.cnns)) {
            eprintln!("gpu-bench: writing {path}: {e}");
            return ExitCode::FAILURE;
        }
        eprintln!("gpu-bench: wrote {path}");
    }
    ExitCode::SUCCESS
}
