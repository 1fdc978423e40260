//! `exact-bench`: the cost of `[train] exact_sum` beside the default mode, in one run.
//!
//! For each model (the default job's 784-256-128-10 with batch 128, and the large
//! 784-4096-4096-10), W = 2 workers and 2 shards on 127.0.0.1 over gRPC with data connections
//! (bytes really cross a socket), the two modes run alternately `--repeats` times; each run's
//! step time is the median of the shard's `step_ms` (metrics.jsonl) after the first 5 steps.
//! Bytes per step on the wire are the messages' values: pushes `W x N x 4` bytes (default) or
//! `W x N x 12` (the exact partial sum's three digits per parameter), pulls `W x N x 4` both.
//! Prints a markdown table with the ratio exact / default and the target (<= 1.3 on the
//! default job), the shards' median `apply_ms` of each mode, then where a step's time goes, in
//! process on one thread (`--no-parts` leaves it out): a worker's gradient of its 64 samples in
//! one pass (the default mode), the same in four micro-batches of 16 with no sum, the exact
//! mode's whole work (the micro-batches, each term added to the fixed-point sum, the sum
//! encoded), and a shard's sum of two encoded partial sums of half the model, rounded.
//! Exits 1 when the default job's ratio is above the target.

use anyhow::{Context, bail};
use clap::Parser;
use ps_config::{TestConfig, Transport};
use ps_launch::{LocalCluster, bin_dir};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// The default job's target: exact-mode step time over the default mode's.
const TARGET: f64 = 1.3;
/// Steps skipped at the start of each run (connections, first allocations).
const WARMUP: u64 = 5;

#[derive(Parser, Debug)]
struct Args {
    /// Steps of each default-job run.
    #[arg(long, default_value_t = 80)]
    steps: u64,
    /// Steps of each large-model run.
    #[arg(long, default_value_t = 12)]
    large_steps: u64,
    /// Runs of each mode per model (alternating default and exact).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// `[train] exact_micro_batch` of the exact runs (default: the mode's default).
    #[arg(long)]
    micro_batch: Option<u64>,
    /// Only the default job.
    #[arg(long)]
    no_large: bool,
    /// Leave out the in-process breakdown.
    #[arg(long)]
    no_parts: bool,
    /// The MNIST directory.
    #[arg(long, default_value = "data/mnist")]
    data: PathBuf,
}

/// A model measured.
struct Model {
    name: &'static str,
    hidden: &'static [usize],
    steps: u64,
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("exact-bench: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> anyhow::Result<bool> {
    let models = [
        Model {
            name: "default job 784-256-128-10",
            hidden: &[256, 128],
            steps: args.steps,
        },
        Model {
            name: "large 784-4096-4096-10",
            hidden: &[4096, 4096],
            steps: args.large_steps,
        },
    ];
    println!(
        "| model | params | default step (ms) | exact step (ms) | ratio | apply ms, default / exact | wire per step, default | wire per step, exact |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut within = true;
    let count = if args.no_large { 1 } else { models.len() };
    for (i, m) in models.iter().take(count).enumerate() {
        let (mut times, mut applies) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
        for _ in 0..args.repeats {
            for (k, exact) in [false, true].into_iter().enumerate() {
                let (step, apply) = step_ms(args, m, exact)?;
                times[k].push(step);
                applies[k].push(apply);
            }
        }
        let params = ps_model::layout::MlpLayout::new(&dims(m.hidden))
            .spec
            .num_params();
        let (d, e) = (median(&mut times[0]), median(&mut times[1]));
        let ratio = e / d;
        if i == 0 && ratio > TARGET {
            within = false;
        }
        let mb = |bytes_per_value: usize| (2 * params * (bytes_per_value + 4)) as f64 / 1e6;
        println!(
            "| {} | {params} | {d:.2} | {e:.2} | {ratio:.2}x{} | {:.2} / {:.2} | {:.1} MB | {:.1} MB |",
            m.name,
            if i == 0 {
                format!(" (target <= {TARGET})")
            } else {
                String::new()
            },
            median(&mut applies[0]),
            median(&mut applies[1]),
            mb(4),
            mb(12),
        );
        eprintln!(
            "{}: default runs {:?} ms, exact runs {:?} ms",
            m.name, times[0], times[1]
        );
    }
    if !args.no_parts {
        parts(&[256, 128], 64, 16)?;
    }
    Ok(within)
}

/// The in-process breakdown of a step of the MLP `hidden` for a worker of `n` samples in
/// micro-batches of `m` (one thread, synthetic data): median ms of 30 repeats of each part.
fn parts(hidden: &[usize], n: usize, m: usize) -> anyhow::Result<()> {
    use ps_config::LossReduction::Mean;
    use ps_model::layout::{MlpLayout, ModelLayout};
    let layout: ModelLayout = MlpLayout::new(&dims(hidden)).into();
    let params = layout.num_params();
    let mut backend = ps_worker::cpu::cpu_model(&layout, 1);
    backend.set_weights(&layout.init_range(42, 0..params))?;
    let x: Vec<f32> = (0..n * 784)
        .map(|i| ((i * 37) % 255) as f32 / 255.0)
        .collect();
    let y: Vec<u8> = (0..n).map(|i| (i * 7 % 10) as u8).collect();
    let (mut grad, mut part) = (vec![0f32; params], vec![0f32; params]);
    let mut acc = ps_net::exact::TermSum::default();
    let mut wire = vec![0f32; ps_worker::exact::wire_len(params)];
    let time = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let mut v = Vec::new();
        for _ in 0..30 {
            let t = std::time::Instant::now();
            f()?;
            v.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(median(&mut v))
    };
    let one = time(&mut || {
        Ok(backend
            .forward_backward(&x, &y, Mean, &mut grad)
            .map(drop)?)
    })?;
    let micro = time(&mut || {
        for s in (0..n).step_by(m) {
            backend.forward_backward(&x[s * 784..(s + m) * 784], &y[s..s + m], Mean, &mut part)?;
        }
        Ok(())
    })?;
    let exact = time(&mut || {
        let no_push = &mut |_: usize, _: &[f32], _| {};
        let b = backend.as_mut();
        ps_worker::exact::forward_backward_exact(
            b, &x, &y, Mean, m, &mut acc, &mut part, &mut wire, no_push,
        )?;
        Ok(())
    })?;
    let half = params / 2;
    let mut out = vec![0f32; half];
    let shard = time(&mut || {
        ps_net::exact::sum_encoded(&[&wire, &wire], 0, &mut out).map_err(|(_, e)| e)?;
        Ok(())
    })?;
    println!();
    println!("Where the time goes (in process, one thread, 784-256-128-10, {n} samples):");
    println!();
    println!("| part | ms |");
    println!("|---|---|");
    println!("| worker, default mode: one pass of {n} | {one:.2} |");
    println!(
        "| worker: {} micro-batches of {m}, no sum | {micro:.2} |",
        n / m
    );
    println!(
        "| worker, exact mode: the micro-batches, the fixed-point sum, encoded | {exact:.2} |"
    );
    println!(
        "| shard, exact mode: 2 encoded partial sums of {half} values summed, rounded | {shard:.2} |"
    );
    Ok(())
}

fn dims(hidden: &[usize]) -> Vec<usize> {
    let mut d = vec![784];
    d.extend_from_slice(hidden);
    d.push(10);
    d
}

/// One cluster run of `m` in the mode; the median step time and apply time of its shard 0
/// after the warmup.
fn step_ms(args: &Args, m: &Model, exact: bool) -> anyhow::Result<(f64, f64)> {
    let dir = std::env::temp_dir().join(format!("exact-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let data = std::fs::canonicalize(&args.data).context("--data")?;
    let mut cfg = TestConfig::new()
        .shards(2)
        .workers(2)
        .transport(Transport::Grpc)
        .data_connections(true, 0)
        .hidden(m.hidden)
        .data_dir(data)
        .global_batch(128)
        .steps(m.steps)
        .seed(42)
        .sgd(0.1, 0.9)
        .cosine(10, 0.0)
        .log_every(50)
        .barrier_timeout_secs(600.0)
        .out_dir(dir.join("out"));
    if exact {
        cfg = cfg.exact_sum(args.micro_batch);
    }
    let path = dir.join("config.toml");
    std::fs::write(&path, cfg.toml())?;
    let mut cluster = LocalCluster::new(bin_dir(), path.clone(), Some(dir.join("logs")));
    cluster.start_servers(2, &[], Duration::from_secs(60))?;
    for r in 0..2 {
        cluster.start_worker(r, 2, &[])?;
    }
    cluster.wait(Duration::from_secs(600), &|| false)?;
    let metrics = dir.join("out").join("metrics.jsonl");
    let ms = (
        metrics_median(&metrics, "step_ms")?,
        metrics_median(&metrics, "apply_ms")?,
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ms)
}

/// The median `key` of the steps after [`WARMUP`].
fn metrics_median(path: &Path, key: &str) -> anyhow::Result<f64> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let mut v: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|j| j["step"].as_u64().is_some_and(|s| s > WARMUP))
        .filter_map(|j| j[key].as_f64())
        .collect();
    if v.is_empty() {
        bail!("{}: no steps after the first {WARMUP}", path.display());
    }
    Ok(median(&mut v))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
