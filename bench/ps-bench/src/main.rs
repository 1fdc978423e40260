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

mod aggregation;
mod e2e;
mod host_path;
mod raw_tcp;
mod scale;
mod transfer;
mod vs_torch;
mod xhost;

use aggregation::{section_aggregation, table_aggregation};
use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use e2e::{check_binaries, section_e2e, table_e2e, table_memory};
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
use scale::section_5;
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::future::Future;
use std::hint::black_box;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transfer::{section_transfer, table_transfer};

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
