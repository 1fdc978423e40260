//! `ps-worker --config FILE --rank R`: one data-parallel worker.

use anyhow::Context;
use clap::Parser;
use ps_config::Config;
use ps_data::idx::{Dataset, Split, load_split};
use ps_worker::worker::{WorkerSetup, run_worker};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "One data-parallel worker of the parameter-server cluster"
)]
struct Cli {
    /// The cluster's TOML config.
    #[arg(long)]
    config: PathBuf,
    /// This worker's rank (default: from RANK, SLURM_PROCID or JOB_COMPLETION_INDEX).
    #[arg(long)]
    rank: Option<usize>,
    /// World size; must equal `[cluster] workers` (default: from the launcher's environment).
    #[arg(long)]
    world_size: Option<usize>,
    /// Rank on this host, picks the GPU (default: LOCAL_RANK or SLURM_LOCALID, else 0).
    #[arg(long)]
    local_rank: Option<usize>,
    /// Shard addresses, comma-separated, instead of the config's `[cluster] servers`.
    #[arg(long, value_delimiter = ',')]
    servers: Option<Vec<String>>,
    /// `cpu`, `cuda`, `cuda:N` or `auto` (default: the config's `[worker] device`).
    #[arg(long)]
    device: Option<String>,
    /// Dataset directory instead of the config's `[data] dir`.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Override a config key: `--set section.key=value` (repeatable; after the environment's
    /// `PS_SET_<SECTION>_<KEY>`), checked like the file's value and logged.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// This run's id (default: PS_RUN_ID, `[cluster] run_id`, SLURM_JOB_ID, PS_K8S_JOB_UID);
    /// shards of another run refuse this worker.
    #[arg(long)]
    run_id: Option<String>,
}

/// How long a worker told to stop (SIGTERM, SIGUSR1) keeps stepping for the shards' preemption
/// checkpoint before it exits anyway (the shards wait at most `ps_server::PREEMPT_GRACE`).
const PREEMPT_WORKER_GRACE: std::time::Duration = std::time::Duration::from_secs(20);

fn main() -> std::process::ExitCode {
    ps_process::tune_allocator();
    ps_process::init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(if refused_config(&e) { 2 } else { 1 })
        }
    }
}

/// A config refused at start (missing, unreadable or invalid, a bad `--set` or
/// `PS_SET_...`): exit 2, as ps-server and ps-launch say it.
fn refused_config(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<ps_config::ConfigError>())
}

/// The training and test sets of `cfg` (the model it declares must be one ps-worker trains).
fn load_data(config: &std::path::Path, cfg: &Config) -> anyhow::Result<(Dataset, Dataset)> {
    if let Some(d) = &cfg.model.declared
        && cfg.model.cnn.is_none()
        && ps_model::layout::MlpLayout::from_spec(&d.spec).is_none()
    {
        anyhow::bail!(
            "{}: [model] init = {} declares a model other than an MLP (fc1.weight, fc1.bias, ...): ps-worker trains only the built-in MLP and CNN ([model] kind = \"cnn\"); use the Python worker (python/) for this model",
            config.display(),
            d.path.display()
        );
    }
    let classes = cfg.model.dims[cfg.model.dims.len() - 1];
    let train =
        load_split(&cfg.data.dir, Split::Train, classes).context("loading the training set")?;
    let test = load_split(&cfg.data.dir, Split::Test, classes).context("loading the test set")?;
    if train.features() != cfg.model.dims[0] {
        anyhow::bail!(
            "{}: images have {} pixels but [model] inputs = {}",
            cfg.data.dir.display(),
            train.features(),
            cfg.model.dims[0]
        );
    }
    Ok((train, test))
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let env: std::collections::HashMap<String, String> = std::env::vars().collect();
    let overrides = ps_config::Overrides::from_env_and_cli(&env, &cli.set, &cli.config)?;
    let mut cfg = Config::load_with(&cli.config, &overrides)?;
    for line in overrides.describe().lines() {
        tracing::info!("worker: {line}");
    }
    if let Some(d) = cli.data_dir {
        cfg.data.dir = d;
    }
    let run = cfg.resolve_run_id(cli.run_id.as_deref(), &env)?;
    let place = ps_worker::env::resolve(cli.rank, cli.world_size, cli.local_rank, &env)
        .map_err(anyhow::Error::msg)?;
    let world = place.world.unwrap_or(cfg.cluster.workers);
    if world != cfg.cluster.workers {
        anyhow::bail!(
            "world size {world} (from {}) differs from [cluster] workers = {} in {}",
            place.world_source.unwrap_or("the environment"),
            cfg.cluster.workers,
            cli.config.display()
        );
    }
    if place.rank >= world {
        anyhow::bail!(
            "rank {} (from {}): expected a rank in 0..{world}",
            place.rank,
            place.source
        );
    }
    tracing::info!(
        "worker {}: rank {} of {world}, local rank {}, from {}; world size from {}; {} (run id from {})",
        place.rank,
        place.rank,
        place.local_rank,
        place.source,
        place.world_source.unwrap_or("[cluster] workers"),
        run.show(),
        run.source
    );
    let servers = cli.servers.unwrap_or_else(|| cfg.cluster.servers.clone());
    if servers.len() != cfg.num_shards() {
        anyhow::bail!(
            "{} server addresses given: expected {} (one per shard in {})",
            servers.len(),
            cfg.num_shards(),
            cli.config.display()
        );
    }
    let threads =
        ps_worker::cpu_threads(cfg.worker.threads, cfg.cluster.workers + cfg.num_shards());
    // SAFETY: set before any thread of this process exists (the runtime starts below);
    // matrixmultiply reads it once, at its first threaded product.
    unsafe { std::env::set_var("MATMUL_NUM_THREADS", threads.to_string()) };
    let (train, test) = load_data(&cli.config, &cfg)?;
    let device = cli.device.unwrap_or_else(|| cfg.worker.device.clone());
    let (backend, chosen) =
        ps_worker::device::open_backend(&device, place.local_rank, &cfg.layout(), threads)?;
    tracing::info!("worker {}: {chosen}", place.rank);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let rank = place.rank;
    let done = rt.block_on(async {
        tokio::select! {
            done = run_worker(WorkerSetup { cfg, servers, rank, train, test, backend }) => done.map(drop),
            // dropping the run removes this worker's shared-memory board
            _ = tokio::signal::ctrl_c() => {
                anyhow::bail!("worker {rank}: interrupted (SIGINT)")
            }
            // preemption: the shards checkpoint at the next step boundary, which needs this
            // worker's pushes; it goes on until the shards stop (bounded)
            () = async {
                ps_process::preempt_signal().await;
                ps_worker::worker::STOP_REQUESTED.store(true, std::sync::atomic::Ordering::SeqCst);
                tracing::warn!(
                    "worker {rank}: SIGTERM or SIGUSR1: going on until the shards have checkpointed and stopped (at most {} s)",
                    PREEMPT_WORKER_GRACE.as_secs()
                );
                tokio::time::sleep(PREEMPT_WORKER_GRACE).await;
            } => {
                anyhow::bail!("worker {rank}: preempted (SIGTERM or SIGUSR1)")
            }
        }
    });
    // a stalled backward pass (`run_worker`) keeps its thread: do not wait for it
    rt.shutdown_timeout(RUNTIME_SHUTDOWN);
    done
}

/// How long ps-worker waits for its runtime's threads at the end (a thread stalled in a
/// backward pass is left behind: the process exits).
const RUNTIME_SHUTDOWN: std::time::Duration = std::time::Duration::from_secs(5);
