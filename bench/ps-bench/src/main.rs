//! ps-bench: what the parameter server costs, in absolute figures and as ratios to limits
//! measured in the same run on the same machine.
//!
//! 1. **Aggregation + optimizer update**, in process: `Shard::accept` for W ranks, then
//!    `Shard::apply` (mean of the W gradients in rank order, plain SGD), for one shard (S = 1)
//!    of each model, set up as with workers on the same host: the gradients in the ranks'
//!    shared-memory boards, the parameters in the shard's. Figure: gradient bytes consumed per second,
//!    `W · len · 4 / (time of apply)`, beside a plain `copy_from_slice` of the same number of
//!    bytes between two preallocated `Vec<f32>`.
//! 2. **Push and pull through the real gRPC service**: a shard of the large model served by
//!    `run_shard` on its own tokio runtime in this process (127.0.0.1, OS-chosen port) and a
//!    client configured like the worker's. Pull: version `t`, once the shard has it. Push: step
//!    `t` of rank 0 of a W = 2 shard (the barrier stays incomplete, so no apply runs); rank 1 is
//!    then pushed untimed to complete the step. Also push + apply with W = 1 (what a lone
//!    worker waits for). Beside a raw tokio TCP transfer of the same bytes over 127.0.0.1 into
//!    a preallocated buffer (the sink acknowledges with one byte once it has everything).
//!    Then the same pull and push through shared memory (`[cluster] transport = "auto"` with
//!    workers on the shard's host): gRPC carries the header, the tensor stays in the boards.
//! 3. **End-to-end training** with real `ps-server` and `ps-worker` processes (`LocalCluster`)
//!    on the shipped MNIST, batch 64 per worker, plain SGD: median `step_ms` of shard 0's
//!    `metrics.jsonl` after skipping the first steps, steps/s and samples/s; beside the same
//!    model's single-process step (forward+backward at batch 64, one matmul thread,
//!    plus the SGD update) and the compute bound `single · ceil(W / cores)`.
//! 4. **Server memory**: each shard's peak resident memory (VmHWM, polled from
//!    `/proc/<pid>/status` while the run goes) against its parameter bytes.
//!
//! 6. **The models against PyTorch**: the built-in CNN's and the small and large MLPs' CPU
//!    forward+backward and PyTorch's on one thread each, batch 64, the same geometry, in the
//!    same run, wall and thread CPU time (`--python`, see `vs_torch.rs`).
//!
//! 7. **The host's data path** (`host_path.rs`): the large model's step with W = 2 workers
//!    on one host whose device computes nothing: pull, gradient write, push and update times
//!    beside this machine's memcpy rate, and the bytes each part moves.
//!
//! Across hosts (`xhost.rs`, run by `crosshost.sh` with `PUSHPULL=1`), instead of the
//! sections: `--xhost-serve` on one host, `--xhost-client` on the other time the data
//! connection's pull and push of the large model beside raw TCP of the same bytes.
//!
//! Every figure is the median of several repeats. Needs the `ps-server` and `ps-worker`
//! binaries next to this one: `cargo build --release --bins` first.

mod host_path;
mod vs_torch;
mod xhost;

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use ps_config::{Config, LossReduction};
use ps_launch::{LocalCluster, bin_dir};
use ps_net::auth::ClientSecurity;
use ps_net::client::{ShardClient, ShmLink};
use ps_net::shm::{Board, BoardDir, grad_path};
use ps_net::wire::f32_to_bytes;
use ps_proto::PROTOCOL_VERSION;
use ps_proto::pb::{PushHeader, RegisterRequest};
use ps_server::shard::{PushMeta, Shard};
use ps_server::{ShardSetup, run_shard};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::future::Future;
use std::hint::black_box;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Client = ShardClient;

/// Streamed chunk size, as the worker and the server use by default.
const CHUNK_BYTES: usize = 1 << 20;
/// Batch per worker in the end-to-end runs and in the single-process step.
const BATCH: usize = 64;
/// Steps of the in-process shards of sections 1 and 2: never reached during the bench.
const ENDLESS: u64 = 1_000_000;

#[derive(Parser, Debug)]
#[command(
    name = "ps-bench",
    version,
    about = "Benchmark of the parameter server: aggregation, gRPC transfer, end-to-end steps, memory"
)]
struct Cli {
    /// Fewer repeats and steps, no W = 4 run of the large model (under 2 minutes on 2 cores).
    #[arg(long)]
    quick: bool,
    /// Also write every row as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Sections to run (3 includes 4, the memory of its runs; 5 is the scale section: one
    /// ps-server process, W = 8, 32, 64 in-process clients pushing real gradient bytes; 6 the
    /// CNN's and the two MLPs' CPU forward+backward against PyTorch's, one thread each, batch
    /// 64); 7 the host's data path of the large model, W = 2, no device.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    sections: Vec<u32>,
    /// Section 5: worker counts (default 2, 4, 8, 32, 64).
    #[arg(long, value_delimiter = ',')]
    scale_workers: Vec<usize>,
    /// Section 5: values of `[server] max_pending_gradients` to run each W with (default: the
    /// config's default); 0 leaves the key out, for a `--server-bin-dir` build older than it.
    /// The shard's peak is about (3 + this) x its parameter bytes.
    #[arg(long, value_delimiter = ',')]
    scale_pending: Vec<usize>,
    /// Section 6 (the models' forward+backward against PyTorch's): the Python that imports
    /// torch.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Section 5: the directory of the ps-server binary to measure (default: this build's),
    /// e.g. an older build to compare with.
    #[arg(long)]
    server_bin_dir: Option<PathBuf>,
    /// Section 5: every client also pulls the new version through gRPC after its push, as a
    /// worker without a data connection does (TLS, or `[server] data_connections = false`).
    #[arg(long)]
    scale_pull: bool,
    /// Section 5: real `ps-worker` processes (MNIST, batch 64) instead of in-process clients,
    /// every value through gRPC (`transport = "grpc"`, no data connections, as with TLS); the
    /// server binary's directory (`--server-bin-dir`) must hold a `ps-worker` too.
    #[arg(long)]
    scale_processes: bool,
    /// Section 5 with --scale-processes: lines added to the config's `[server]` table (e.g.
    /// "stream_window_bytes = 65536"), to see what a key changes.
    #[arg(long, default_value = "")]
    scale_server_toml: String,
    /// Section 5: the models to run ("tiny" 784-256-128-10, "small", "large"; default small and
    /// large).
    #[arg(long, value_delimiter = ',')]
    scale_models: Vec<String>,
    /// Section 5: steps per run, the first untimed (default 3, 6 without --quick).
    #[arg(long)]
    scale_steps: Option<u64>,
    /// Across hosts (`crosshost.sh` with `PUSHPULL=1`), instead of the sections: serve the large
    /// model's shard (W = 2) on this address and a raw TCP peer on its port + 1, until the
    /// client is done.
    #[arg(long, conflicts_with = "xhost_client")]
    xhost_serve: Option<SocketAddr>,
    /// Across hosts, instead of the sections: push and pull the large model on the data
    /// connection of the shard served (`--xhost-serve`) at this address, beside raw TCP of the
    /// same bytes to its peer, alternated; prints the table.
    #[arg(long)]
    xhost_client: Option<SocketAddr>,
    /// With --xhost-client: timed repeats (after one untimed).
    #[arg(long, default_value_t = 7)]
    xhost_repeats: usize,
}

#[derive(Debug, Clone, Copy)]
struct Model {
    name: &'static str,
    hidden: [usize; 2],
}

const SMALL: Model = Model {
    name: "784-1024-1024-10",
    hidden: [1024, 1024],
};
/// The model of issue 31's many-worker measurement (0.94 MB of parameters).
const TINY: Model = Model {
    name: "784-256-128-10",
    hidden: [256, 128],
};
const LARGE: Model = Model {
    name: "784-4096-4096-10",
    hidden: [4096, 4096],
};

/// Repeats and run lengths.
#[derive(Debug, Clone, Copy)]
struct Plan {
    agg_repeats: [usize; 2],
    copy_repeats: usize,
    net_repeats: usize,
    single_repeats: [usize; 2],
    e2e_steps: [u64; 2],
    e2e_skip: [usize; 2],
    large_w4: bool,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Plan {
                agg_repeats: [5, 3],
                copy_repeats: 5,
                net_repeats: 4,
                single_repeats: [10, 3],
                e2e_steps: [30, 10],
                e2e_skip: [5, 2],
                large_w4: false,
            }
        } else {
            Plan {
                agg_repeats: [9, 5],
                copy_repeats: 9,
                net_repeats: 7,
                single_repeats: [30, 7],
                e2e_steps: [60, 20],
                e2e_skip: [5, 3],
                large_w4: true,
            }
        }
    }

    /// Index 0 for the small model, 1 for the large one.
    fn idx(m: &Model) -> usize {
        usize::from(m.name == LARGE.name)
    }
}

fn main() -> ExitCode {
    // SAFETY: the first statement of main: no other thread of this process exists yet.
    // matrixmultiply reads it once, at its first threaded product; the single-process step of
    // section 3 is then timed on one thread. Child processes inherit it, and each ps-worker
    // overrides it with its own share of the cores before starting any thread.
    unsafe { std::env::set_var("MATMUL_NUM_THREADS", "1") };
    // the same allocator settings as ps-server and ps-worker (still before any other thread),
    // so that the in-process shard and client of sections 1 and 2 allocate as the real
    // processes do
    ps_process::tune_allocator();
    let cli = Cli::parse();
    match run(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("ps-bench: some runs failed (see the tables)");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("ps-bench: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// The sections the command line asks for, their tables printed and their rows written to
/// `--json`; false when a run of section 3 failed.
fn run(cli: &Cli) -> anyhow::Result<bool> {
    if cli.xhost_serve.is_some() || cli.xhost_client.is_some() {
        return run_xhost(cli).map(|()| true);
    }
    let plan = Plan::new(cli.quick);
    let want = |s: u32| cli.sections.contains(&s);
    let binaries = if want(3) {
        Some(check_binaries()?)
    } else {
        None
    };
    let tmp = std::env::temp_dir().join(format!("ps-bench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let machine = machine_info(cores);
    let load_start = loadavg();
    let started = Instant::now();
    let unix = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    println!("# ps-bench{}\n", if cli.quick { " --quick" } else { "" });
    println!(
        "machine: {}, {cores} cores (nproc), {} memory; unix time {unix}",
        machine["cpu"].as_str().unwrap_or("?"),
        machine["memory"].as_str().unwrap_or("?")
    );
    if let Some(b) = &binaries {
        println!("{b}");
    }
    println!("load average at start: {load_start}\n");

    let mut out = json!({
        "tool": "ps-bench",
        "quick": cli.quick,
        "unix_time": unix,
        "machine": machine,
        "loadavg_start": load_start,
    });
    let mut ok = true;

    if want(1) {
        eprintln!("ps-bench: section 1, aggregation + optimizer update (in process)");
        let rows = section_aggregation(&tmp, &plan)?;
        println!("{}", table_aggregation(&rows));
        println!("load average after section 1: {}\n", loadavg());
        out["aggregation"] = Value::Array(rows);
    }
    if want(2) {
        eprintln!("ps-bench: section 2, push and pull through the gRPC service (in process)");
        let rows = section_transfer(&tmp, &plan)?;
        println!("{}", table_transfer(&rows));
        println!("load average after section 2: {}\n", loadavg());
        out["transfer"] = Value::Array(rows);
    }
    if want(3) {
        eprintln!("ps-bench: section 3, end-to-end training with server and worker processes");
        let (rows, all_ok) = section_e2e(&tmp, &plan, cores)?;
        ok &= all_ok;
        println!("{}", table_e2e(&rows));
        println!("{}", table_memory(&rows));
        out["e2e"] = Value::Array(rows);
    }

    if want(5) {
        eprintln!("ps-bench: section 5, scale: one shard process, many gRPC clients");
        out["scale"] = Value::Array(section_5(cli, &plan, &tmp)?);
    }

    if want(6) {
        eprintln!("ps-bench: section 6, the models' forward+backward against PyTorch's");
        let rows = vs_torch::section_vs_torch(&cli.python, BATCH, if cli.quick { 10 } else { 30 })?;
        println!("{}", vs_torch::table_vs_torch(&rows));
        out["vs_torch"] = Value::Array(rows);
    }

    if want(7) {
        eprintln!("ps-bench: section 7, the host's data path (W = 2, shared memory, no device)");
        let rows = host_path::section_host_path(&tmp, &plan)?;
        println!("{}", host_path::table_host_path(&rows));
        out["host_path"] = Value::Array(rows);
    }

    let load_end = loadavg();
    let total = started.elapsed().as_secs_f64();
    println!("load average at end: {load_end}; total bench time {total:.0} s");
    out["loadavg_end"] = json!(load_end);
    out["total_secs"] = json!(total);
    if let Some(p) = &cli.json {
        std::fs::write(p, serde_json::to_string_pretty(&out)? + "\n")
            .with_context(|| format!("writing {}", p.display()))?;
        eprintln!("ps-bench: rows written to {}", p.display());
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(ok)
}

/// `--xhost-serve` or `--xhost-client` (`xhost.rs`): one side of the cross-host measurement.
fn run_xhost(cli: &Cli) -> anyhow::Result<()> {
    let tmp = std::env::temp_dir().join(format!("ps-bench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let r = match (cli.xhost_serve, cli.xhost_client) {
        (Some(addr), _) => xhost::serve(addr, &tmp),
        (None, Some(addr)) => {
            let load = loadavg();
            xhost::client(addr, cli.xhost_repeats.max(1), &tmp).and_then(|rows| {
                println!("{}", xhost::table(&rows, addr));
                println!("load average before / after: {load} / {}", loadavg());
                if let Some(p) = &cli.json {
                    let out = json!({ "tool": "ps-bench", "xhost": rows });
                    std::fs::write(p, serde_json::to_string_pretty(&out)? + "\n")
                        .with_context(|| format!("writing {}", p.display()))?;
                }
                Ok(())
            })
        }
        (None, None) => Ok(()),
    };
    let _ = std::fs::remove_dir_all(&tmp);
    r
}

/// Section 5 with the command line's settings (the worker counts, the pending-gradient
/// limits, the models, the steps), its table printed: the rows.
fn section_5(cli: &Cli, plan: &Plan, tmp: &Path) -> anyhow::Result<Vec<Value>> {
    let ws = if cli.scale_workers.is_empty() {
        vec![2, 4, 8, 32, 64]
    } else {
        cli.scale_workers.clone()
    };
    let bin = cli.server_bin_dir.clone().unwrap_or_else(bin_dir);
    let pending = if cli.scale_pending.is_empty() {
        vec![ps_config::DEFAULT_MAX_PENDING_GRADIENTS]
    } else {
        cli.scale_pending.clone()
    };
    let scale = Scale {
        processes: cli.scale_processes,
        server_toml: cli.scale_server_toml.clone(),
        pull: cli.scale_pull,
        models: if cli.scale_models.is_empty() {
            vec![SMALL, LARGE]
        } else {
            cli.scale_models
                .iter()
                .map(|m| match m.as_str() {
                    "tiny" => Ok(TINY),
                    "small" => Ok(SMALL),
                    "large" => Ok(LARGE),
                    other => bail!("--scale-models {other}: expected tiny, small or large"),
                })
                .collect::<anyhow::Result<_>>()?
        },
        steps: cli
            .scale_steps
            .unwrap_or(if plan.large_w4 { 6 } else { 3 })
            .max(2),
    };
    let rows = section_scale(tmp, plan, &scale, &ws, &pending, &bin)?;
    if scale.processes {
        println!("{}", table_scale_processes(&rows));
    } else {
        println!("{}", table_scale(&rows));
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------------------------
// helpers

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn gbs(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn machine_info(cores: usize) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown CPU".to_string(), |s| s.trim().to_string());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kb: u64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    json!({
        "cpu": cpu,
        "cores": cores,
        "memory": format!("{:.1} GiB", mem_kb as f64 / (1u64 << 20) as f64),
    })
}

fn mnist_dir() -> PathBuf {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/mnist"));
    p.canonicalize().unwrap_or(p)
}

/// A cluster config: S placeholder addresses (the bench binds port 0), W workers, batch 64 per
/// worker, mean loss, mean aggregation, plain SGD, no periodic log or evaluation.
fn config_text(shards: usize, workers: usize, m: &Model, steps: u64, out_dir: &Path) -> String {
    let servers: Vec<String> = (0..shards)
        .map(|i| format!("\"127.0.0.1:{}\"", 1 + i))
        .collect();
    format!(
        "[cluster]\nservers = [{}]\nworkers = {workers}\n\n[model]\nhidden = [{}, {}]\n\n\
         [data]\ndir = {:?}\n\n[train]\nseed = 1\nper_worker_batch = {BATCH}\nsteps = {steps}\n\
         loss_reduction = \"mean\"\naggregation = \"mean\"\nlog_every = 1000000\neval_every = 0\n\n\
         [optimizer]\nkind = \"sgd\"\nlr = 0.01\n\n\
         [server]\nout_dir = {:?}\nbarrier_timeout_secs = 600\n",
        servers.join(", "),
        m.hidden[0],
        m.hidden[1],
        mnist_dir().display().to_string(),
        out_dir.display().to_string(),
    )
}

fn write_config(path: &Path, text: &str) -> anyhow::Result<Config> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(Config::load(path)?)
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

// ---------------------------------------------------------------------------------------------
// section 1: aggregation + optimizer update

fn section_aggregation(tmp: &Path, plan: &Plan) -> anyhow::Result<Vec<Value>> {
    let mut rows = Vec::new();
    for m in [SMALL, LARGE] {
        for w in [2usize, 4] {
            let repeats = plan.agg_repeats[Plan::idx(&m)];
            rows.push(bench_aggregation(tmp, &m, w, repeats, plan.copy_repeats)?);
        }
    }
    Ok(rows)
}

fn bench_aggregation(
    tmp: &Path,
    m: &Model,
    w: usize,
    repeats: usize,
    copy_repeats: usize,
) -> anyhow::Result<Value> {
    let dir = tmp.join(format!("agg-{}-w{w}", m.name));
    let cfg = write_config(
        &dir.join("config.toml"),
        &config_text(1, w, m, ENDLESS, &dir.join("out")),
    )?;
    let shard = Shard::new(&cfg, 0, ENDLESS);
    // as workers on this host do: each has a gradient board that the shard reads in place,
    // and the shard's parameters move into its shared-memory board
    let root = ps_net::shm::shm_root().context("no /dev/shm: the bench mirrors local runs")?;
    let mut boards = Vec::new();
    for r in 0..w {
        let d = BoardDir::create(&root, &format!("bench-worker{r}"))?;
        let b = Board::create(&grad_path(d.path()), d.token(), shard.num_params, 1)?;
        shard.register(r as u32)?;
        shard
            .offer_shm(r as u32)?
            .context("the shard offers no shared memory")?;
        if !shard.attach_grad(r as u32, b.path(), d.token())? {
            bail!("the shard could not open the gradient board of rank {r}");
        }
        boards.push((d, b));
    }
    let len = shard.len();
    let bytes = w * len * 4;
    let (mut apply_s, mut step_s) = (Vec::new(), Vec::new());
    for rep in 0..=repeats {
        // the workers' backward passes write their gradients
        for (r, (_, b)) in boards.iter_mut().enumerate() {
            b.slot_mut(0)
                .fill(1e-4 * (r + 1) as f32 + rep as f32 * 1e-7);
        }
        let step = shard.version();
        let t0 = Instant::now();
        let mut ready = None;
        for r in 0..w {
            let meta = PushMeta {
                rank: r as u32,
                step,
                samples: BATCH as u32,
                loss_sum: 1.0,
                correct: 0,
                eval: (0, 0),
            };
            let (g, fingerprint) = shard.shm_grad(r as u32)?;
            let (_, slots) = shard.accept(meta, g, fingerprint)?;
            if slots.is_some() {
                ready = slots;
            }
        }
        let slots = ready.context("the last accept did not complete the barrier")?;
        let t1 = Instant::now();
        black_box(shard.apply(slots)?);
        let t2 = Instant::now();
        if rep > 0 {
            apply_s.push((t2 - t1).as_secs_f64());
            step_s.push((t2 - t0).as_secs_f64());
        }
    }
    drop(shard);
    let copy_s = bench_copy(w * len, copy_repeats);
    let (apply, step, copy) = (median(&apply_s), median(&step_s), median(&copy_s));
    let row = json!({
        "model": m.name, "workers": w, "shards": 1, "shard_len": len, "grad_bytes": bytes,
        "apply_ms": apply * 1e3, "accept_apply_ms": step * 1e3,
        "gbs": gbs(bytes, apply), "copy_ms": copy * 1e3, "copy_gbs": gbs(bytes, copy),
        "ratio_to_copy": copy / apply,
        "apply_ms_samples": apply_s.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
        "copy_ms_samples": copy_s.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
    });
    eprintln!(
        "  {} W={w}: apply {:.2} ms ({:.2} GB/s), copy {:.2} ms ({:.2} GB/s)",
        m.name,
        apply * 1e3,
        gbs(bytes, apply),
        copy * 1e3,
        gbs(bytes, copy)
    );
    Ok(row)
}

/// Seconds of `copy_from_slice` of `n` f32 between two preallocated vectors, one per repeat
/// (after one untimed copy).
fn bench_copy(n: usize, repeats: usize) -> Vec<f64> {
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut dst = vec![0f32; n];
    let mut out = Vec::new();
    for rep in 0..=repeats {
        let t = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        if rep > 0 {
            out.push(t.elapsed().as_secs_f64());
        }
    }
    out
}

fn table_aggregation(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 1. Aggregation + optimizer update (in process, one shard, S = 1, mean, plain SGD, parameters and gradients in shared-memory boards as with workers on the same host)\n\n\
         | model | W | shard params | gradient bytes in | apply ms | aggregation+update GB/s | memcpy ms (same bytes) | memcpy GB/s | ratio |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} MB | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r["model"].as_str().unwrap_or("?"),
            r["workers"],
            r["shard_len"],
            f(r, "grad_bytes") / 1e6,
            f(r, "apply_ms"),
            f(r, "gbs"),
            f(r, "copy_ms"),
            f(r, "copy_gbs"),
            f(r, "ratio_to_copy"),
        );
    }
    s
}

// ---------------------------------------------------------------------------------------------
// section 2: push and pull through the gRPC service

/// Runs `make()`'s future to completion on a new multi-thread runtime of `threads` workers, on
/// its own OS thread (as a separate process would have its own runtime).
fn spawn_runtime<F, Fut>(threads: usize, make: F) -> std::thread::JoinHandle<anyhow::Result<()>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>>,
{
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?;
        rt.block_on(make())
    })
}

/// A shard served by `run_shard` in this process, on its own 2-thread runtime (as ps-server).
struct InProcShard {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl InProcShard {
    fn start(cfg: Config) -> anyhow::Result<Self> {
        Self::start_on(cfg, SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// A shard listening on `bind` (its data connections on the same address, another port).
    fn start_on(cfg: Config, bind: SocketAddr) -> anyhow::Result<Self> {
        let std_listener =
            std::net::TcpListener::bind(bind).with_context(|| format!("listening on {bind}"))?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = spawn_runtime(2, move || async move {
            let listener = tokio::net::TcpListener::from_std(std_listener)?;
            let setup = ShardSetup {
                cfg,
                index: 0,
                train_len: 60_000,
                test_len: None,
                shard0: None,
                resume_from: None,
                metrics_listen: None,
                health_listen: None,
            };
            run_shard(setup, listener, async {
                let _ = rx.await;
            })
            .await?;
            Ok(())
        });
        Ok(Self {
            addr,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join()
                .map_err(|_| anyhow::anyhow!("the in-process shard panicked"))??;
        }
        Ok(())
    }
}

impl Drop for InProcShard {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// The worker's client of the in-process shard (one attempt: the shard is listening already).
async fn connect(addr: SocketAddr) -> anyhow::Result<Client> {
    ShardClient::connect(
        0,
        &addr.to_string(),
        &ClientSecurity::default(),
        Duration::ZERO,
    )
    .await
    .with_context(|| format!("connecting to the in-process shard at {addr}"))
}

/// Registers `rank` (idempotent); returns the shard's version.
async fn register(c: &mut Client, cfg: &Config, rank: usize) -> anyhow::Result<u64> {
    Ok(register_with(c, cfg, rank, None).await?.version)
}

/// Registers `rank`, for shared memory with its gradient board when `board` (and its token)
/// is given, as a worker on the shard's host does.
async fn register_with(
    c: &mut Client,
    cfg: &Config,
    rank: usize,
    board: Option<(&Board, u64)>,
) -> anyhow::Result<ps_proto::pb::RegisterReply> {
    c.register(RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        rank: rank as u32,
        world_size: cfg.cluster.workers as u32,
        num_params: cfg.layout().num_params() as u64,
        shard: 0,
        num_shards: 1,
        shared_memory: board.is_some(),
        grad_file: board.map_or_else(String::new, |(b, _)| b.path().display().to_string()),
        grad_token: board.map_or(0, |(_, t)| t),
        model: Vec::new(),
    })
    .await
    .context("register")
}

/// Waits until the shard has applied `version` steps (polling with registrations, which are
/// idempotent), so that a timed pull never waits for an apply.
async fn wait_version(c: &mut Client, cfg: &Config, version: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while register(c, cfg, 0).await? < version {
        if Instant::now() > deadline {
            bail!("the shard did not reach version {version} in 60 s");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// Pulls version `version` into a new vector through gRPC, as the worker does (chunks checked
/// and decoded in place).
async fn pull(c: &mut Client, version: u64, len: usize) -> anyhow::Result<Vec<f32>> {
    let mut w = vec![0f32; len];
    c.pull_into(version, false, None, &mut w).await?;
    Ok(w)
}

/// Pushes step `step` of `rank` as "in the gradient board", as the worker does.
async fn push_shm(c: &Client, rank: usize, step: u64, len: usize) -> anyhow::Result<()> {
    let header = PushHeader {
        rank: rank as u32,
        step,
        samples: BATCH as u32,
        loss_sum: 1.0,
        correct: 0,
        len: len as u64,
        eval_correct: 0,
        eval_count: 0,
        shm: true,
    };
    c.push_retrying(header, &Bytes::new(), CHUNK_BYTES).await?;
    Ok(())
}

/// Pushes the already-encoded gradient `bytes` as step `step` of `rank`, in 1 MiB chunks,
/// exactly as a worker does (`ShardClient::push_retrying`).
async fn push(c: &mut Client, rank: usize, step: u64, bytes: &Bytes) -> anyhow::Result<()> {
    let header = PushHeader {
        rank: rank as u32,
        step,
        samples: BATCH as u32,
        loss_sum: 1.0,
        correct: 0,
        len: (bytes.len() / 4) as u64,
        eval_correct: 0,
        eval_count: 0,
        shm: false,
    };
    c.push_retrying(header, bytes, CHUNK_BYTES).await?;
    Ok(())
}

/// Section 2: push and pull of the large model through an in-process shard's gRPC service
/// (and shared memory), against raw TCP on the same loopback.
fn section_transfer(tmp: &Path, plan: &Plan) -> anyhow::Result<Vec<Value>> {
    let reps = plan.net_repeats;
    let m = LARGE;
    let dir1 = tmp.join("grpc-w1");
    let cfg1 = write_config(
        &dir1.join("config.toml"),
        &config_text(1, 1, &m, ENDLESS, &dir1.join("out")),
    )?;
    let dir2 = tmp.join("grpc-w2");
    let cfg2 = write_config(
        &dir2.join("config.toml"),
        &config_text(1, 2, &m, ENDLESS, &dir2.join("out")),
    )?;
    let len = cfg1.layout().num_params();
    let nbytes = len * 4;
    // the gradient, encoded once (the worker encodes every step; that copy is not timed here)
    let grad = f32_to_bytes(&vec![1e-6f32; len]);

    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;

    let (pull_s, push_apply_s) = time_w1(&client_rt, &cfg1, &grad, reps)?;
    let push_s = time_push_w2(&client_rt, &cfg2, &grad, reps)?;
    let (pull_shm_s, push_shm_s) = time_shm_w2(&client_rt, &cfg2, reps)?;
    let tcp_s = tcp_baseline(&client_rt, nbytes, reps)?;
    drop(client_rt);

    let (tcp, pull_m, push_m, push_apply) = (
        median(&tcp_s),
        median(&pull_s),
        median(&push_s),
        median(&push_apply_s),
    );
    let row = |what: &str, how: &str, s: &[f64], med: f64| {
        json!({
            "what": what, "how": how, "model": m.name, "bytes": nbytes,
            "ms": med * 1e3, "gbs": gbs(nbytes, med),
            "tcp_gbs": gbs(nbytes, tcp), "ratio_to_tcp": tcp / med,
            "ms_samples": s.iter().map(|v| v * 1e3).collect::<Vec<_>>(),
        })
    };
    let rows = vec![
        row(
            "pull",
            "version t once the shard has it, W = 1, decoded into a Vec<f32>",
            &pull_s,
            pull_m,
        ),
        row(
            "push",
            "step t of rank 0 of W = 2 (barrier incomplete: no apply), pre-encoded",
            &push_s,
            push_m,
        ),
        row(
            "push + apply",
            "step t, W = 1: the reply comes after the aggregation and SGD update",
            &push_apply_s,
            push_apply,
        ),
        row(
            "pull (shared memory)",
            "as pull, W = 2: header through gRPC, the version copied out of the shard's board",
            &pull_shm_s,
            median(&pull_shm_s),
        ),
        row(
            "push (shared memory)",
            "as push: header through gRPC, the shard checks the worker's board in place",
            &push_shm_s,
            median(&push_shm_s),
        ),
        row(
            "raw TCP",
            "tokio write_all into a sink reading into a preallocated buffer, 1-byte ack",
            &tcp_s,
            tcp,
        ),
    ];
    for r in &rows {
        eprintln!(
            "  {}: {:.1} ms, {:.2} GB/s",
            r["what"].as_str().unwrap_or("?"),
            f(r, "ms"),
            f(r, "gbs")
        );
    }
    Ok(rows)
}

/// W = 1: (pull, push + apply) seconds per step.
fn time_w1(
    client_rt: &tokio::runtime::Runtime,
    cfg: &Config,
    grad: &Bytes,
    reps: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let len = cfg.layout().num_params();
    // W = 1: pull of version t once available, then push of step t (which includes the apply)
    let shard = InProcShard::start(cfg.clone())?;
    let times = client_rt.block_on(async {
        let mut c = connect(shard.addr).await?;
        register(&mut c, cfg, 0).await?;
        let (mut pull_s, mut push_apply_s) = (Vec::new(), Vec::new());
        for t in 0..=reps as u64 {
            wait_version(&mut c, cfg, t).await?;
            let t0 = Instant::now();
            let w = pull(&mut c, t, len).await?;
            let t1 = Instant::now();
            if w.len() != len {
                bail!("pulled {} values: expected {len}", w.len());
            }
            drop(w);
            let t2 = Instant::now();
            push(&mut c, 0, t, grad).await?;
            let t3 = Instant::now();
            if t > 0 {
                pull_s.push((t1 - t0).as_secs_f64());
                push_apply_s.push((t3 - t2).as_secs_f64());
            }
        }
        Ok::<_, anyhow::Error>((pull_s, push_apply_s))
    })?;
    shard.stop()?;
    Ok(times)
}

/// W = 2: seconds of rank 0's push per step (no apply).
fn time_push_w2(
    client_rt: &tokio::runtime::Runtime,
    cfg: &Config,
    grad: &Bytes,
    reps: usize,
) -> anyhow::Result<Vec<f64>> {
    // W = 2: push of rank 0 alone (barrier incomplete, no apply), then rank 1 untimed
    let shard = InProcShard::start(cfg.clone())?;
    let times = client_rt.block_on(async {
        let mut c0 = connect(shard.addr).await?;
        let mut c1 = connect(shard.addr).await?;
        register(&mut c0, cfg, 0).await?;
        register(&mut c1, cfg, 1).await?;
        let mut push_s = Vec::new();
        for t in 0..=reps as u64 {
            wait_version(&mut c0, cfg, t).await?;
            let t0 = Instant::now();
            push(&mut c0, 0, t, grad).await?;
            let t1 = Instant::now();
            push(&mut c1, 1, t, grad).await?;
            if t > 0 {
                push_s.push((t1 - t0).as_secs_f64());
            }
        }
        Ok::<_, anyhow::Error>(push_s)
    })?;
    shard.stop()?;
    Ok(times)
}

/// W = 2 through shared memory: (pull, push) seconds per step.
fn time_shm_w2(
    client_rt: &tokio::runtime::Runtime,
    cfg: &Config,
    reps: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let len = cfg.layout().num_params();
    // W = 2 again, through shared memory as workers on this host do: the pull answers with a
    // header and the worker copies the version out of the shard's board; the push sends a
    // header and the shard checks the values in place in the worker's gradient board
    let shard = InProcShard::start(cfg.clone())?;
    let root = ps_net::shm::shm_root().context("no /dev/shm for the shared-memory rows")?;
    let times = client_rt.block_on(async {
        let mut links = Vec::new();
        for r in 0..2 {
            let d = BoardDir::create(&root, &format!("bench-worker{r}"))?;
            let mut b = Board::create(&grad_path(d.path()), d.token(), len, 1)?;
            b.slot_mut(0).fill(1e-6);
            let mut c = connect(shard.addr).await?;
            let reply = register_with(&mut c, cfg, r, Some((&b, d.token()))).await?;
            let link = ShmLink::open(&reply, 0);
            if link.describe() != "shared memory" {
                bail!("the in-process shard offered no shared memory: {reply:?}");
            }
            links.push((c, link, d, b));
        }
        let mut w = vec![0f32; len];
        let (mut pull_s, mut push_s) = (Vec::new(), Vec::new());
        for t in 0..=reps as u64 {
            wait_version(&mut links[0].0, cfg, t).await?;
            let t0 = Instant::now();
            let (c, link, _, _) = &mut links[0];
            c.pull_into(t, false, link.params.as_deref(), &mut w)
                .await?;
            let t1 = Instant::now();
            push_shm(&links[0].0, 0, t, len).await?;
            let t2 = Instant::now();
            push_shm(&links[1].0, 1, t, len).await?;
            if t > 0 {
                pull_s.push((t1 - t0).as_secs_f64());
                push_s.push((t2 - t1).as_secs_f64());
            }
        }
        Ok::<_, anyhow::Error>((pull_s, push_s))
    })?;
    shard.stop()?;
    Ok(times)
}

/// Seconds to move `n` bytes over one loopback TCP connection into a preallocated buffer, per
/// repeat (after one untimed transfer). The sink runs on its own single-thread runtime and
/// answers one byte once it has all `n`; the client writes from its own buffer.
fn tcp_baseline(
    client_rt: &tokio::runtime::Runtime,
    n: usize,
    repeats: usize,
) -> anyhow::Result<Vec<f64>> {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let sink = spawn_runtime(1, move || async move {
        let listener = tokio::net::TcpListener::from_std(std_listener)?;
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; n];
        loop {
            match s.read_exact(&mut buf).await {
                Ok(_) => s.write_all(&[1]).await?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(e.into()),
            }
        }
        black_box(&buf);
        Ok(())
    });
    let times = client_rt.block_on(async {
        let mut c = tokio::net::TcpStream::connect(addr).await?;
        c.set_nodelay(true)?;
        let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
        let mut ack = [0u8; 1];
        let mut out = Vec::new();
        for rep in 0..=repeats {
            let t = Instant::now();
            c.write_all(&data).await?;
            c.read_exact(&mut ack).await?;
            if rep > 0 {
                out.push(t.elapsed().as_secs_f64());
            }
        }
        Ok::<_, anyhow::Error>(out)
    })?;
    sink.join()
        .map_err(|_| anyhow::anyhow!("the TCP sink panicked"))??;
    Ok(times)
}

fn table_transfer(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 2. Push and pull through the gRPC service (in process, 127.0.0.1, large model, S = 1; the shared-memory rows move only a header through gRPC, so their ratio to TCP is not a like-for-like one)\n\n\
         | transfer | what exactly | bytes | ms | GB/s | raw TCP GB/s (same bytes) | ratio |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} MB | {:.1} | {:.2} | {:.2} | {:.2} |",
            r["what"].as_str().unwrap_or("?"),
            r["how"].as_str().unwrap_or("?"),
            f(r, "bytes") / 1e6,
            f(r, "ms"),
            f(r, "gbs"),
            f(r, "tcp_gbs"),
            f(r, "ratio_to_tcp"),
        );
    }
    s
}

// ---------------------------------------------------------------------------------------------
// sections 3 and 4: end-to-end runs and server memory

/// Checks that the cluster binaries exist; returns a line saying which ones the runs use and
/// how old they are (the runs measure whatever was last built there).
fn check_binaries() -> anyhow::Result<String> {
    let dir = bin_dir();
    let mut ages = Vec::new();
    for b in ["ps-server", "ps-worker"] {
        let p = dir.join(b);
        let Ok(meta) = std::fs::metadata(&p) else {
            bail!(
                "{} not found: build the binaries first (cargo build --release --bins)",
                p.display()
            );
        };
        let age = meta
            .modified()
            .ok()
            .and_then(|t| t.elapsed().ok())
            .map_or("?".into(), |d| format!("{:.0} min", d.as_secs_f64() / 60.0));
        ages.push(format!("{b} built {age} ago"));
    }
    Ok(format!(
        "cluster binaries: {} ({})",
        dir.display(),
        ages.join(", ")
    ))
}

/// Milliseconds of one single-process training step at batch 64: set the weights,
/// forward+backward on one matmul thread, SGD update. One figure per repeat.
fn single_process(cfg: &Config, repeats: usize, warmup: usize) -> anyhow::Result<Vec<f64>> {
    let layout = cfg.layout();
    let n = layout.num_params();
    let optimizer = &cfg.optimizer;
    let lr = cfg.schedule.lr(0) as f32;
    let mut params = layout.init_range(cfg.train.seed, 0..n);
    let mut state = optimizer.init_state(n);
    let mut backend = ps_worker::cpu::cpu_model(&layout, 1);
    // synthetic pixels in [0, 1] (the cost does not depend on the data)
    let x: Vec<f32> = (0..BATCH * layout.inputs())
        .map(|i| ((i * 7919) % 256) as f32 / 255.0)
        .collect();
    let y: Vec<u8> = (0..BATCH).map(|i| (i % 10) as u8).collect();
    let mut grad = vec![0f32; n];
    let mut out = Vec::new();
    for rep in 0..warmup + repeats {
        let t = Instant::now();
        backend.set_weights(&params)?;
        backend.forward_backward(&x, &y, LossReduction::Mean, &mut grad)?;
        optimizer.step(&mut params, &grad, &mut state, lr);
        if rep >= warmup {
            out.push(ms(t.elapsed()));
        }
    }
    Ok(out)
}

/// Peak resident set (VmHWM) of a live process, in bytes.
fn vm_hwm(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn read_metrics(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn section_e2e(tmp: &Path, plan: &Plan, cores: usize) -> anyhow::Result<(Vec<Value>, bool)> {
    let mut rows = Vec::new();
    let mut ok = true;
    for m in [SMALL, LARGE] {
        let i = Plan::idx(&m);
        let (warmup, repeats) = (if i == 0 { 5 } else { 2 }, plan.single_repeats[i]);
        let dir = tmp.join(format!("single-{}", m.name));
        let cfg = write_config(
            &dir.join("config.toml"),
            &config_text(1, 1, &m, ENDLESS, &dir.join("out")),
        )?;
        let single_s = single_process(&cfg, repeats, warmup)?;
        let single = median(&single_s);
        eprintln!(
            "  {} single process, batch {BATCH}, 1 thread: {single:.1} ms/step",
            m.name
        );
        for w in [1usize, 2, 4] {
            if w == 4 && i == 1 && !plan.large_w4 {
                continue;
            }
            for s in [1usize, 2] {
                let steps = plan.e2e_steps[i];
                let skip = plan.e2e_skip[i];
                let mut row = json!({
                    "model": m.name, "workers": w, "shards": s, "batch_per_worker": BATCH,
                    "steps": steps, "skipped_steps": skip,
                    "single_process_ms": single,
                    "single_process_ms_samples": single_s,
                });
                match e2e_run(tmp, &m, w, s, steps, skip, &Processes::default()) {
                    Ok(r) => {
                        let step = f(&r, "step_ms");
                        let bound = single * w.div_ceil(cores) as f64;
                        if let (Value::Object(dst), Value::Object(src)) = (&mut row, r) {
                            dst.extend(src);
                        }
                        row["steps_per_s"] = json!(1e3 / step);
                        row["samples_per_s"] = json!(1e3 / step * (w * BATCH) as f64);
                        row["overhead_ms"] = json!(step - single);
                        row["compute_bound_ms"] = json!(bound);
                        row["ratio_bound_to_step"] = json!(bound / step);
                        row["loadavg_after"] = json!(loadavg());
                        eprintln!(
                            "  {} W={w} S={s}: {step:.1} ms/step ({:.1} steps/s), server peak {}",
                            m.name,
                            1e3 / step,
                            row["server_hwm_bytes"]
                        );
                    }
                    Err(e) => {
                        ok = false;
                        eprintln!("  {} W={w} S={s}: failed: {e:#}", m.name);
                        row["error"] = json!(format!("{e:#}"));
                    }
                }
                rows.push(row);
            }
        }
    }
    Ok((rows, ok))
}

/// Where a cluster run's binaries come from and how its values move.
#[derive(Debug, Default)]
struct Processes {
    /// The directory of `ps-server` and `ps-worker` (default: this build's).
    bin: Option<PathBuf>,
    /// Every value through gRPC: `transport = "grpc"`, `[server] data_connections = false`
    /// (as with TLS).
    grpc_only: bool,
    /// Lines added to `[server]`.
    server_toml: String,
}

/// One cluster run; returns its figures (step times from shard 0's metrics, memory peaks,
/// shard 0's CPU time per step over the timed steps).
fn e2e_run(
    tmp: &Path,
    m: &Model,
    w: usize,
    s: usize,
    steps: u64,
    skip: usize,
    procs: &Processes,
) -> anyhow::Result<Value> {
    let dir = tmp.join(format!("e2e-{}-w{w}-s{s}", m.name));
    let out_dir = dir.join("out");
    let path = dir.join("config.toml");
    let mut text = config_text(s, w, m, steps, &out_dir);
    if procs.grpc_only {
        text = text.replacen("\n\n[model]", "\ntransport = \"grpc\"\n\n[model]", 1)
            + "data_connections = false\n";
    }
    if !procs.server_toml.is_empty() {
        text = text + &procs.server_toml + "\n";
    }
    let cfg = write_config(&path, &text)?;
    let ranges = ps_model::layout::shard_ranges(cfg.layout().num_params(), cfg.num_shards());
    let bin = procs.bin.clone().unwrap_or_else(bin_dir);
    let mut cluster = LocalCluster::new(bin, path, Some(dir.join("logs")));
    let started = Instant::now();
    cluster.start_servers(s, &[], Duration::from_secs(60))?;
    for r in 0..w {
        cluster.start_worker(r, w, &[])?;
    }
    let metrics_path = out_dir.join("metrics.jsonl");
    let weights: Vec<PathBuf> = (0..s)
        .map(|i| out_dir.join(format!("shard-{i}.safetensors")))
        .collect();
    let Watched {
        server_hwm,
        worker_hwm,
        cpu_from,
        cpu_to,
        ended_early,
    } = watch_e2e(&mut cluster, &metrics_path, &weights, steps, skip)?;
    let wall = started.elapsed().as_secs_f64();
    let metrics = read_metrics(&metrics_path);
    if (metrics.len() as u64) < steps {
        bail!(
            "{} holds {} steps: expected {steps}",
            metrics_path.display(),
            metrics.len()
        );
    }
    let timed = &metrics[skip.min(metrics.len())..];
    let col = |k: &str| -> Vec<f64> { timed.iter().filter_map(|v| v[k].as_f64()).collect() };
    let step_ms = col("step_ms");
    let param_bytes: Vec<u64> = ranges.iter().map(|r| r.len() as u64 * 4).collect();
    let cpu_per_step = match (cpu_from, cpu_to) {
        (Some((c0, n0)), Some((c1, n1))) if n1 > n0 => 1e3 * (c1 - c0) / (n1 - n0) as f64,
        _ => f64::NAN,
    };
    Ok(json!({
        "step_ms": median(&step_ms),
        "shard0_cpu_ms_per_step": cpu_per_step,
        "step_ms_min": step_ms.iter().copied().fold(f64::INFINITY, f64::min),
        "step_ms_max": step_ms.iter().copied().fold(0.0, f64::max),
        "barrier_wait_ms": median(&col("barrier_wait_ms")),
        "apply_ms": median(&col("apply_ms")),
        "timed_steps": step_ms.len(),
        "wall_secs": wall,
        "stopped_after_last_step": ended_early,
        "server_hwm_bytes": server_hwm,
        "server_param_bytes": param_bytes,
        // what each shard stated at start-up it would peak at (`ps_server::memory`)
        "server_stated_bytes": ranges.iter()
            .map(|r| ps_server::memory::MemoryPlan::of(&cfg, r.len()).total())
            .collect::<Vec<_>>(),
        "server_hwm_ratio": server_hwm.iter().zip(&param_bytes)
            .map(|(h, p)| *h as f64 / *p as f64).collect::<Vec<_>>(),
        "worker_hwm_bytes": worker_hwm,
    }))
}

/// What [`watch_e2e`] saw of a cluster run: each process's peak resident memory, shard 0's
/// CPU seconds and applied steps once the skipped steps were done and at the end, and whether
/// it stopped the run after its last step (the workers' final evaluation left out).
struct Watched {
    server_hwm: Vec<u64>,
    worker_hwm: Vec<u64>,
    cpu_from: Option<(f64, usize)>,
    cpu_to: Option<(f64, usize)>,
    ended_early: bool,
}

/// Watches a started cluster until every process has exited, or every step is in
/// `metrics_path` and every shard's `weights` are written (then stops it); an error names a
/// failed process, or the run past 600 s.
fn watch_e2e(
    cluster: &mut LocalCluster,
    metrics_path: &Path,
    weights: &[PathBuf],
    steps: u64,
    skip: usize,
) -> anyhow::Result<Watched> {
    let mut server_hwm = vec![0u64; cluster.servers.len()];
    let mut worker_hwm = vec![0u64; cluster.workers.len()];
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut last_check = Instant::now();
    let mut ended_early = false;
    // shard 0's CPU seconds and applied steps, once the skipped steps are done and at the end
    let mut cpu_from: Option<(f64, usize)> = None;
    let mut cpu_to: Option<(f64, usize)> = None;
    let shard0 = cluster.servers[0].child.id();
    let sample = |c: &LocalCluster, sh: &mut [u64], wh: &mut [u64]| {
        for (h, p) in sh.iter_mut().zip(&c.servers) {
            if p.status.is_none()
                && let Some(v) = vm_hwm(p.child.id())
            {
                *h = (*h).max(v);
            }
        }
        for (h, p) in wh.iter_mut().zip(&c.workers) {
            if p.status.is_none()
                && let Some(v) = vm_hwm(p.child.id())
            {
                *h = (*h).max(v);
            }
        }
    };
    loop {
        sample(cluster, &mut server_hwm, &mut worker_hwm);
        let mut running = 0;
        let mut failure = None;
        for p in cluster.servers.iter_mut().chain(cluster.workers.iter_mut()) {
            if p.status.is_none() {
                match p.child.try_wait()? {
                    Some(st) => p.status = Some(st),
                    None => running += 1,
                }
            }
            if let Some(st) = p.status
                && !st.success()
                && failure.is_none()
            {
                failure = Some(format!("{} failed with {st}{}", p.name, p.log_tail(20)));
            }
        }
        if let Some(msg) = failure {
            cluster.kill_all();
            bail!(msg);
        }
        if running == 0 {
            break;
        }
        // every step applied and every shard's final weights written: the rest of the run is
        // the workers' final test-set evaluation, which nothing here measures; stop it
        if last_check.elapsed() > Duration::from_millis(200) {
            last_check = Instant::now();
            let done = read_metrics(metrics_path).len();
            if cpu_from.is_none()
                && done >= skip
                && let Some(c) = cpu_secs(shard0)
            {
                cpu_from = Some((c, done));
            }
            if done as u64 >= steps && weights.iter().all(|p| p.exists()) {
                cpu_to = cpu_secs(shard0).map(|c| (c, done));
                std::thread::sleep(Duration::from_millis(200));
                sample(cluster, &mut server_hwm, &mut worker_hwm);
                ended_early = true;
                cluster.kill_all();
                break;
            }
        }
        if Instant::now() > deadline {
            cluster.kill_all();
            bail!("still running after 600 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Watched {
        server_hwm,
        worker_hwm,
        cpu_from,
        cpu_to,
        ended_early,
    })
}

fn table_e2e(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 3. End-to-end training (server and worker processes, MNIST, batch 64 per worker, plain SGD)\n\n\
         step = median of shard 0's step_ms after the skipped first steps; single = one process, \
         batch 64, 1 thread; overhead = step − single; bound = single × ceil(W / cores) (the step \
         if communication and the server cost nothing)\n\n\
         | model | W | S | step ms | steps/s | samples/s | barrier wait ms | apply ms | single ms | overhead ms | bound ms | ratio bound/step |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let head = format!(
            "| {} | {} | {} ",
            r["model"].as_str().unwrap_or("?"),
            r["workers"],
            r["shards"]
        );
        if let Some(e) = r["error"].as_str() {
            let _ = writeln!(
                s,
                "{head}| failed: {} | | | | | | | | |",
                e.lines().next().unwrap_or("")
            );
            continue;
        }
        let _ = writeln!(
            s,
            "{head}| {:.1} | {:.1} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
            f(r, "step_ms"),
            f(r, "steps_per_s"),
            f(r, "samples_per_s"),
            f(r, "barrier_wait_ms"),
            f(r, "apply_ms"),
            f(r, "single_process_ms"),
            f(r, "overhead_ms"),
            f(r, "compute_bound_ms"),
            f(r, "ratio_bound_to_step"),
        );
    }
    s
}

fn table_memory(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 4. Server peak memory (VmHWM, polled every 20 ms during the runs of section 3)\n\n\
         | model | W | S | shard | parameter bytes | peak RSS | ratio |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let (Some(h), Some(p)) = (
            r["server_hwm_bytes"].as_array(),
            r["server_param_bytes"].as_array(),
        ) else {
            continue;
        };
        for (i, (h, p)) in h.iter().zip(p).enumerate() {
            let (h, p) = (h.as_f64().unwrap_or(0.0), p.as_f64().unwrap_or(0.0));
            let _ = writeln!(
                s,
                "| {} | {} | {} | {i} | {:.1} MB | {:.1} MB | {:.2} |",
                r["model"].as_str().unwrap_or("?"),
                r["workers"],
                r["shards"],
                p / 1e6,
                h / 1e6,
                h / p,
            );
        }
    }
    s
}

// ---------------------------------------------------------------------------------------------
// section 5: scale

/// One ps-server process (its peak RSS is what is measured), W gRPC clients in this process,
/// each on its own connection, pushing the same real gradient bytes every step, as workers do
/// (1 MiB chunks); a step is timed from the first push to the new version being pullable.
/// What section 5 runs.
struct Scale {
    /// Real worker processes, every value through gRPC.
    processes: bool,
    /// Lines added to `[server]` (real worker processes only).
    server_toml: String,
    /// Every client pulls the new version after its push.
    pull: bool,
    models: Vec<Model>,
    /// Steps per run, the first untimed.
    steps: u64,
}

fn section_scale(
    tmp: &Path,
    plan: &Plan,
    scale: &Scale,
    ws: &[usize],
    pending: &[usize],
    bin: &Path,
) -> anyhow::Result<Vec<Value>> {
    let mut rows = Vec::new();
    for m in &scale.models {
        for &w in ws {
            if m.name == LARGE.name && w > 8 && !plan.large_w4 {
                continue;
            }
            for &p in pending {
                eprintln!(
                    "ps-bench: scale {} W = {w}, max_pending_gradients = {p}{}",
                    m.name,
                    if scale.pull { ", with pulls" } else { "" }
                );
                rows.push(if scale.processes {
                    scale_processes_run(tmp, m, w, p, scale, bin)?
                } else {
                    scale_run(tmp, m, w, p, scale, bin)?
                });
            }
        }
    }
    Ok(rows)
}

fn scale_run(
    tmp: &Path,
    m: &Model,
    w: usize,
    pending: usize,
    scale: &Scale,
    bin: &Path,
) -> anyhow::Result<Value> {
    let dir = tmp.join(format!("scale-{}-w{w}-p{pending}", m.name));
    let path = dir.join("config.toml");
    let mut text = config_text(1, w, m, ENDLESS, &dir.join("out"));
    if pending > 0 {
        text += &format!("max_pending_gradients = {pending}\n");
    }
    let cfg = write_config(&path, &text)?;
    let len = cfg.layout().num_params();
    let mut cluster = LocalCluster::new(bin.to_path_buf(), path, Some(dir.join("logs")));
    cluster.start_servers(1, &[], Duration::from_secs(60))?;
    let pid = cluster.servers[0].child.id();
    let addr: SocketAddr = cluster.addrs[0].parse()?;
    let rss_idle = vm_rss(pid).unwrap_or(0);
    let grad = f32_to_bytes(&vec![1e-6f32; len]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (steps, pulls) = (scale.steps, scale.pull);
    let (times, cpu) = rt.block_on(async {
        let mut clients = Vec::with_capacity(w);
        for r in 0..w {
            let mut c = connect(addr).await?;
            register(&mut c, &cfg, r).await?;
            clients.push(c);
        }
        let mut times = Vec::new();
        let mut cpu_from = 0.0;
        for step in 0..steps {
            if step == 1 {
                cpu_from = cpu_secs(pid).unwrap_or(f64::NAN);
            }
            let t = Instant::now();
            let mut tasks = Vec::with_capacity(w);
            for (r, c) in clients.iter().enumerate() {
                let mut c = c.clone();
                let g = grad.clone();
                tasks.push(tokio::spawn(async move {
                    push(&mut c, r, step, &g).await?;
                    if pulls {
                        pull(&mut c, step + 1, len).await?;
                    }
                    anyhow::Ok(())
                }));
            }
            for t in tasks {
                t.await??;
            }
            if !pulls {
                wait_version(&mut clients[0], &cfg, step + 1).await?;
            }
            times.push(ms(t.elapsed()));
        }
        let cpu = cpu_secs(pid).unwrap_or(f64::NAN) - cpu_from;
        anyhow::Ok((times, cpu))
    })?;
    let hwm = vm_hwm(pid).unwrap_or(0);
    drop(rt);
    cluster.kill_all();
    let bytes = len as u64 * 4;
    let timed = &times[1..];
    Ok(json!({
        "model": m.name,
        "workers": w,
        "pulls": pulls,
        "max_pending_gradients": if pending > 0 { json!(pending) } else { json!("unset") },
        "param_bytes": bytes,
        "step_ms_median": median(timed),
        "shard_cpu_ms_per_step": 1e3 * cpu / timed.len() as f64,
        "rss_idle_bytes": rss_idle,
        "peak_rss_bytes": hwm,
        "peak_over_params": hwm as f64 / bytes as f64,
        "target_bytes": 4 * bytes + (100 << 20),
        "within_target": hwm <= 4 * bytes + (100 << 20),
        "server": bin.display().to_string(),
    }))
}

/// One run of W `ps-worker` processes on one shard, every value through gRPC.
fn scale_processes_run(
    tmp: &Path,
    m: &Model,
    w: usize,
    pending: usize,
    scale: &Scale,
    bin: &Path,
) -> anyhow::Result<Value> {
    if pending != ps_config::DEFAULT_MAX_PENDING_GRADIENTS {
        bail!("--scale-processes runs the default max_pending_gradients only");
    }
    let skip = 3;
    let steps = scale.steps.max(skip as u64 + 2);
    let procs = Processes {
        bin: Some(bin.to_path_buf()),
        grpc_only: true,
        server_toml: scale.server_toml.clone(),
    };
    let mut r = e2e_run(tmp, m, w, 1, steps, skip, &procs)?;
    r["model"] = json!(m.name);
    r["workers"] = json!(w);
    r["steps"] = json!(steps);
    r["server"] = json!(bin.display().to_string());
    r["loadavg_after"] = json!(loadavg());
    eprintln!(
        "  W={w}: {:.1} ms/step, shard CPU {:.1} ms/step, shard peak {:.1} MB (stated {:.1} MB)",
        f(&r, "step_ms"),
        f(&r, "shard0_cpu_ms_per_step"),
        r["server_hwm_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6,
        r["server_stated_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6
    );
    Ok(r)
}

fn table_scale_processes(rows: &[Value]) -> String {
    let mut t = String::from(
        "## 5. Scale: one shard, W ps-worker processes, every value through gRPC\n\n\
         | model | W | step ms (median) | shard CPU ms / step | shard peak RSS MB | stated MB | parameter MB | load after | server |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            t,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
            r["model"].as_str().unwrap_or("?"),
            r["workers"],
            f(r, "step_ms"),
            f(r, "shard0_cpu_ms_per_step"),
            r["server_hwm_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6,
            r["server_stated_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6,
            r["server_param_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6,
            r["loadavg_after"].as_str().unwrap_or("?"),
            r["server"].as_str().unwrap_or("?"),
        );
    }
    t
}

/// User + system CPU time of a live process so far, in seconds.
fn cpu_secs(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // the fields after the command name, which is in parentheses and may hold spaces
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the name
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

/// Resident set (VmRSS) of a live process, in bytes.
fn vm_rss(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn table_scale(rows: &[Value]) -> String {
    let mut t = String::from(
        "## 5. Scale: one shard process, W gRPC clients pushing real gradients\n\n\
         | model | W | pulls | max_pending_gradients | parameter MB | step ms (median) | shard CPU ms / step | shard peak RSS MB | peak / params | target MB (4x params + 100) | within |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let mb = |k: &str| f(r, k) / 1e6;
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
            r["model"].as_str().unwrap_or("?"),
            r["workers"],
            if r["pulls"].as_bool() == Some(true) {
                "gRPC"
            } else {
                "no"
            },
            r["max_pending_gradients"].to_string().trim_matches('"'),
            mb("param_bytes"),
            f(r, "step_ms_median"),
            f(r, "shard_cpu_ms_per_step"),
            mb("peak_rss_bytes"),
            f(r, "peak_over_params"),
            mb("target_bytes"),
            if r["within_target"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            }
        );
    }
    t
}
