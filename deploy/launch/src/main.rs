//! `ps-launch --config FILE`: runs a whole cluster on this machine (S shards and W workers as
//! processes on 127.0.0.1), shows the servers' convergence log, and stops everything at the end
//! or on Ctrl-C. At the end it merges the shards' weights into `model.safetensors` (PyTorch
//! names and shapes) and draws the loss and accuracy curves into `curves.svg`. `--resume` continues from the newest common checkpoint;
//! `--check-reference` then compares with the single-process reference (see [`check`]);
//! `--export` only merges the shards of a run that ran elsewhere. The summary (where the
//! weights, the curves and the reference result are) goes to stdout; logs go to stderr.

mod check;

use anyhow::Context;
use clap::Parser;
use ps_config::Config;
use ps_launch::launch::{Ended, LocalCluster, Stop, bin_dir, tidy};
use ps_launch::outdir::move_previous_run;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(version, about = "Run a parameter-server cluster on this machine")]
struct Cli {
    /// The cluster's TOML config.
    #[arg(long)]
    config: PathBuf,
    /// Write final weights, metrics and worker logs here instead of `[server] out_dir`.
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Dataset directory instead of the config's `[data] dir`, for servers and workers.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// After training, run the single-process reference and compare the weights.
    #[arg(long)]
    check_reference: bool,
    /// Stop everything if the run has not ended after this many seconds.
    #[arg(long, default_value_t = 6 * 3600)]
    timeout_secs: u64,
    /// Extra arguments for every worker (e.g. `--device=auto`).
    #[arg(long, allow_hyphen_values = true)]
    worker_arg: Vec<String>,
    /// Continue from the newest checkpoint that every shard has (`[checkpoint]`): this run's
    /// (the run id in `<out_dir>/run_id`) only.
    #[arg(long)]
    resume: bool,
    /// Start from the checkpoints of run RUN (another run's; see `--resume`).
    #[arg(long, value_name = "RUN", conflicts_with = "resume")]
    resume_from: Option<String>,
    /// Override a config key for every process: `--set section.key=value` (repeatable; the
    /// environment's `PS_SET_<SECTION>_<KEY>` reach them too), checked and logged.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The run id given to every shard and worker (default: PS_RUN_ID, `[cluster] run_id`,
    /// SLURM_JOB_ID, PS_K8S_JOB_UID; with `--resume` the id in `<out_dir>/run_id`; else a new
    /// one). Shards refuse the requests of another run's processes.
    #[arg(long)]
    run_id: Option<String>,
    /// Serve each shard's Prometheus metrics on a free 127.0.0.1 port (logged by each shard);
    /// after the run each stays up until scraped once more (at most 120 s, or the config's
    /// `[server] metrics_linger_secs`), so a scraper sees the final figures.
    #[arg(long)]
    metrics: bool,
    /// Start a failed worker again, up to this many times in all, instead of stopping the run
    /// (it rejoins at the shards' step; the result is the same as without the failure).
    #[arg(long, default_value_t = 0)]
    restart_workers: usize,
    /// Start a lost shard (killed, crashed) again, up to this many times in all, instead of
    /// stopping the run: it starts from the newest version every shard has a checkpoint of
    /// (`[checkpoint] every`; version 0 when none), the other shards roll back with it and the
    /// workers redo the steps since; the result is the same as without the loss, bit for bit.
    #[arg(long, default_value_t = 0)]
    restart_shards: usize,
    /// The GPUs (CUDA ids, comma-separated) the local workers share round robin: worker `r`
    /// uses the `r % n`-th (default: CUDA_VISIBLE_DEVICES, else every GPU the driver sees).
    #[arg(long, value_name = "IDS")]
    gpus: Option<String>,
    /// Do not train: merge the shard files of the output directory into `model.safetensors`
    /// and draw `curves.svg` from its `metrics.jsonl`.
    #[arg(long, conflicts_with_all = ["resume", "check_reference", "metrics"])]
    export: bool,
}

/// How the model's inputs are made from image bytes (`ps_data::idx::Dataset::gather`), stored
/// in `model.safetensors` so whoever loads the weights feeds them the same numbers.
pub const INPUT_SCALING: &str = "x = pixel / 255 (uint8 image bytes to float32 in [0, 1], the image flattened row by row, no mean/std normalisation)";

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static PREEMPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    if sig == libc::SIGINT {
        INTERRUPTED.store(true, Ordering::SeqCst);
    } else {
        PREEMPTED.store(true, Ordering::SeqCst);
    }
}

/// How the launcher ends besides success: exit 130 after Ctrl-C, 143 after a preemption.
#[derive(Debug, thiserror::Error)]
enum Exit {
    #[error("{0}")]
    Interrupted(String),
    #[error("{0}")]
    Preempted(String),
}

/// How long `--metrics` keeps each shard's `/metrics` up after the run for one more scrape,
/// when the config says nothing (`[server] metrics_linger_secs`): two default Prometheus
/// scrape intervals.
const METRICS_LINGER_SECS: u32 = 120;

fn main() -> std::process::ExitCode {
    ps_process::init_logging();
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<Exit>() {
            Some(Exit::Interrupted(why)) => {
                eprintln!("ps-launch: {why}");
                std::process::ExitCode::from(130)
            }
            Some(Exit::Preempted(why)) => {
                eprintln!("ps-launch: {why}");
                std::process::ExitCode::from(143)
            }
            // a config refused at start (missing, unreadable or invalid, a bad `--set`):
            // exit 2, as ps-server and ps-worker say it
            None if e.chain().any(|c| c.is::<ps_config::ConfigError>()) => {
                eprintln!("error: {e:#}");
                std::process::ExitCode::from(2)
            }
            None => {
                eprintln!("error: {e:#}");
                std::process::ExitCode::from(1)
            }
        },
    }
}

/// The launcher: the config and the run id, the output folder claimed and tidied, the shards
/// and workers started and watched, then the weights exported and (`--check-reference`)
/// compared with one process.
fn run(cli: Cli) -> anyhow::Result<()> {
    install_signal_handlers();
    let env: std::collections::HashMap<String, String> = std::env::vars().collect();
    let overrides = ps_config::Overrides::from_env_and_cli(&env, &cli.set, &cli.config)?;
    let mut cfg = Config::load_with(&cli.config, &overrides)?;
    for line in overrides.describe().lines() {
        eprintln!("ps-launch: {line}");
    }
    if let Some(d) = &cli.data_dir {
        cfg.data.dir = d.clone();
    }
    let out_dir = tidy(
        &cli.out_dir
            .clone()
            .unwrap_or_else(|| cfg.server.out_dir.clone()),
    );
    if cli.export {
        return export(&cfg, &out_dir);
    }
    refuse_declared_model(&cfg, &cli.config)?;
    // the run id: given, else (on --resume) the one of the run in out_dir, else a new one
    let id_file = out_dir.join("run_id");
    let run = run_id_of(&mut cfg, &cli, &env, &id_file)?;
    let run_id = run.id.clone().unwrap_or_default();
    // before anything in the folder moves: no other live run may be using it
    let mut claim = ps_launch::outdir::claim(&out_dir, &run_id)?;
    let logs = out_dir.join("logs");
    let (s, w) = (cfg.num_shards(), cfg.cluster.workers);
    let (server_args, worker_args) = child_args(&cli, &cfg, &out_dir);
    let mut cluster = LocalCluster::new(bin_dir(), cli.config.clone(), None);
    cluster.run_id = run.id.clone();
    // the shards' own start-up checks (config, data set) before the previous run moves: a run
    // that cannot start leaves the folder as it found it
    if let Err(e) = cluster.preflight(&server_args) {
        // refused before anything was written: the folder is left as it was found
        claim.release_untouched();
        return Err(e.into());
    }
    // a new run's folder tells one story: the previous run's files move aside (not on --resume,
    // which continues that run, nor on --resume-from, which starts from its checkpoints)
    if !cli.resume
        && cli.resume_from.is_none()
        && let Some(prev) = move_previous_run(&out_dir).context("moving the previous run aside")?
    {
        println!(
            "ps-launch: the previous run's files in {} moved to {}",
            out_dir.display(),
            prev.display()
        );
    }
    std::fs::write(&id_file, format!("{run_id}\n"))
        .with_context(|| id_file.display().to_string())?;
    eprintln!("ps-launch: {} (run id from {})", run.show(), run.source);
    eprintln!(
        "ps-launch: {s} shards and {w} workers on 127.0.0.1; worker logs in {}",
        logs.display()
    );
    let started = Instant::now();
    cluster.worker_logs = Some(logs);
    cluster.worker_restarts = cli.restart_workers;
    cluster.shard_restarts = cli.restart_shards;
    cluster.elastic = cfg.server.barrier_policy == ps_config::BarrierPolicy::Continue;
    cluster.start_servers(s, &server_args, Duration::from_secs(60))?;
    eprintln!(
        "ps-launch: the config's server addresses ({}) replaced by free ports on this machine: {}",
        cfg.cluster.servers.join(", "),
        cluster.addrs.join(", ")
    );
    assign_gpus(&cli, &env, w, &mut cluster);
    for r in 0..w {
        cluster.start_worker(r, w, &worker_args)?;
    }
    let pids = |p: &[ps_launch::Proc]| p.iter().map(|p| p.child.id()).collect::<Vec<_>>();
    claim.record(&run_id, &pids(&cluster.servers), &pids(&cluster.workers));
    let signal = || {
        if INTERRUPTED.load(Ordering::SeqCst) {
            Some(Stop::Interrupt)
        } else {
            PREEMPTED.load(Ordering::SeqCst).then_some(Stop::Preempt)
        }
    };
    let ended = cluster.wait_signals(Duration::from_secs(cli.timeout_secs), &signal)?;
    stopped_early(&cfg, &out_dir, s, ended)?;
    println!(
        "ps-launch: cluster finished in {:.1} s; outputs in {}",
        started.elapsed().as_secs_f64(),
        out_dir.display()
    );
    export(&cfg, &out_dir)?;
    if cli.check_reference {
        check_against_reference(&cli, &cfg, &overrides, &out_dir)?;
    }
    Ok(())
}

/// SIGINT and SIGTERM stop the run (the workers first), SIGUSR1 is a preemption notice.
fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGUSR1, on_signal as *const () as libc::sighandler_t);
    }
}

/// ps-worker trains only the built-in models: a config that declares another one is refused.
fn refuse_declared_model(cfg: &Config, config: &Path) -> anyhow::Result<()> {
    if cfg.model.declared.is_some()
        && cfg.spec().names_and_shapes() != cfg.layout().names_and_shapes()
    {
        anyhow::bail!(
            "{}: [model] init declares a model other than the built-in MLP of [model] inputs/classes or the CNN of kind = \"cnn\" (ps-worker trains only those): start the shards with ps-server and the workers with the Python package (python/), then merge the weights with ps-launch --export",
            config.display()
        );
    }
    Ok(())
}

/// `--check-reference`: the finished run's weights against one process trained the same way.
fn check_against_reference(
    cli: &Cli,
    cfg: &Config,
    overrides: &ps_config::Overrides,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let run = check::RunArgs {
        overrides: Some(overrides),
        data_dir: cli.data_dir.as_deref(),
        worker_args: &cli.worker_arg,
    };
    let report =
        check::check_reference(cfg, &cli.config, out_dir, &run).context("reference check")?;
    print!("{report}");
    if !report.agrees() {
        anyhow::bail!("the cluster run does not agree with the single-process reference");
    }
    Ok(())
}

/// The run id: given (`--run-id`, the config, the environment), else (on `--resume`) the one of
/// the run in the output folder (`id_file`), else a new one.
fn run_id_of(
    cfg: &mut Config,
    cli: &Cli,
    env: &std::collections::HashMap<String, String>,
    id_file: &Path,
) -> anyhow::Result<ps_config::runid::RunId> {
    let mut run = cfg.resolve_run_id(cli.run_id.as_deref(), env)?;
    if run.id.is_none() {
        let previous = std::fs::read_to_string(id_file).ok();
        run = match previous.as_deref().map(str::trim) {
            Some(id) if cli.resume && ps_config::runid::validate(id).is_ok() => {
                ps_config::runid::RunId {
                    id: Some(id.to_string()),
                    source: format!("{} (the run --resume continues)", id_file.display()),
                }
            }
            _ => ps_config::runid::RunId {
                id: Some(ps_config::runid::generate()),
                source: "ps-launch, which generated it".into(),
            },
        };
    }
    Ok(run)
}

/// The arguments every shard and every worker gets from this command line (`out_dir`: the
/// output folder): (shards', workers').
fn child_args(cli: &Cli, cfg: &Config, out_dir: &Path) -> (Vec<String>, Vec<String>) {
    // the shards log an override only for one the user gave
    let mut server_args = Vec::new();
    if cli.out_dir.is_some() {
        server_args.extend(["--out-dir".to_string(), out_dir.display().to_string()]);
    }
    let mut worker_args = cli.worker_arg.clone();
    if let Some(d) = &cli.data_dir {
        for args in [&mut server_args, &mut worker_args] {
            args.push("--data-dir".into());
            args.push(d.display().to_string());
        }
    }
    for set in &cli.set {
        for args in [&mut server_args, &mut worker_args] {
            args.extend(["--set".to_string(), set.clone()]);
        }
    }
    if cli.resume {
        server_args.push("--resume".into());
    }
    if let Some(from) = &cli.resume_from {
        server_args.extend(["--resume-from".into(), from.clone()]);
    }
    if cli.metrics {
        server_args.extend(["--metrics-listen".into(), "127.0.0.1:0".into()]);
        // the endpoints outlive the run until scraped once more, so the final figures reach
        // a scraper (bounded): unless the config says how long itself
        if cfg.server.metrics_linger_secs == 0.0 {
            server_args.extend([
                "--set".into(),
                format!("server.metrics_linger_secs={METRICS_LINGER_SECS}"),
            ]);
            eprintln!(
                "ps-launch: --metrics: each shard's /metrics stays up after the run until it is scraped once more, at most {METRICS_LINGER_SECS} s ([server] metrics_linger_secs sets another bound)"
            );
        }
    }
    (server_args, worker_args)
}

/// The GPUs the CUDA workers use, round robin (`--gpus`, else `CUDA_VISIBLE_DEVICES`, else
/// every device), logged with the workers that share one.
fn assign_gpus(
    cli: &Cli,
    env: &std::collections::HashMap<String, String>,
    w: usize,
    cluster: &mut LocalCluster,
) {
    let visible = ps_launch::launch::visible_gpus(
        cli.gpus.as_deref(),
        env.get("CUDA_VISIBLE_DEVICES").map(String::as_str),
        || ps_worker::cuda::device_count().unwrap_or(0),
    );
    if let Some((gpus, source)) = visible {
        let (plan, shared) = ps_launch::launch::gpu_plan(w, &gpus);
        let each: Vec<String> = plan
            .iter()
            .enumerate()
            .filter_map(|(r, g)| g.as_ref().map(|g| format!("worker {r} -> GPU {g}")))
            .collect();
        eprintln!(
            "ps-launch: GPUs for CUDA workers, round robin over [{}] (from {source}): {}",
            gpus.join(", "),
            if each.is_empty() {
                "none".to_string()
            } else {
                each.join(", ")
            }
        );
        for line in shared {
            eprintln!("ps-launch: warning: {line}: they compete for its memory and compute");
        }
        cluster.gpus = Some(gpus);
    }
}

/// The error a run that `ended` before its end exits with: interrupted, or preempted (naming
/// the newest common checkpoint of the `s` shards and the command that resumes from it).
fn stopped_early(cfg: &Config, out_dir: &Path, s: usize, ended: Ended) -> anyhow::Result<()> {
    match ended {
        Ended::Finished => {}
        Ended::Interrupted => {
            return Err(Exit::Interrupted(
                "interrupted (Ctrl-C): stopped every shard and worker; --resume continues from the last periodic checkpoint, if any".into(),
            )
            .into());
        }
        Ended::Preempted => {
            let dir = cfg
                .checkpoint
                .dir
                .clone()
                .unwrap_or_else(|| out_dir.join("checkpoints"));
            let why = match ps_server::checkpoint::latest_common(&dir, s) {
                Some(v) => format!(
                    "preempted: every shard has a checkpoint of version {v} in {}; continue the run with: {}",
                    dir.display(),
                    resume_command()
                ),
                None => format!(
                    "preempted, but the shards have no common checkpoint in {} (see the shards' logs in {})",
                    dir.display(),
                    out_dir.join("logs").display()
                ),
            };
            return Err(Exit::Preempted(why).into());
        }
    }
    Ok(())
}

/// This launcher's command line with `--resume` (instead of `--resume-from RUN`, whose
/// preempted continuation is this run's own checkpoints), for a person to paste.
fn resume_command() -> String {
    let mut words = vec!["ps-launch".to_string()];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--resume" => {}
            "--resume-from" => {
                args.next();
            }
            _ if a.starts_with("--resume-from=") => {}
            _ => words.push(a),
        }
    }
    words.push("--resume".into());
    words
        .iter()
        .map(|w| {
            if w.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_=./,:@".contains(c))
            {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Merges the final shard files of `out_dir` into `out_dir/model.safetensors`, with the
/// PyTorch names and shapes (`fc1.weight [out, in]`, ...), which `torch`/`safetensors` load
/// (a declared model's whole `state_dict`: with its buffers, frozen and tied entries),
/// and draws the loss and accuracy curves of its `metrics.jsonl` into `curves.svg`.
fn export(cfg: &Config, out_dir: &std::path::Path) -> anyhow::Result<()> {
    // the model the run trained: the built-in MLP or a declared one ([model] init)
    let spec = cfg.spec();
    let model = cfg.describe_model();
    let (flat, version) =
        ps_model::weights::read_shards(out_dir, cfg.num_shards(), spec.num_params())?;
    let path = out_dir.join("model.safetensors");
    let mut meta: std::collections::BTreeMap<String, String> = [
        ("version".to_string(), version.to_string()),
        ("model".to_string(), model.clone()),
        (
            ps_model::declared::ORDER_KEY.to_string(),
            serde_json::to_string(&spec.tensors.iter().map(|t| &t.name).collect::<Vec<_>>())?,
        ),
    ]
    .into();
    match &cfg.model.declared {
        None => {
            meta.insert("input_scaling".to_string(), INPUT_SCALING.to_string());
            ps_model::weights::write_model(&path, &spec, &flat, &meta)?;
        }
        // the whole state_dict: parameters, buffers (shard 0's final ones), frozen and tied
        // entries (from the init file)
        Some(d) => {
            let buffers_path = ps_model::weights::buffers_file(out_dir);
            let buffers = if d.buffers.is_empty() {
                None
            } else {
                Some(std::fs::read(&buffers_path).with_context(|| {
                    format!(
                        "{}: the model's buffers (shard 0 writes them at the run's end)",
                        buffers_path.display()
                    )
                })?)
            };
            ps_model::declared::write_full_model(&path, d, &flat, buffers.as_deref(), &meta)
                .map_err(anyhow::Error::msg)?;
        }
    }
    println!(
        "ps-launch: weights ({model}, version {version}) in {}",
        path.display()
    );
    let metrics = out_dir.join("metrics.jsonl");
    match std::fs::read_to_string(&metrics) {
        Ok(text) => {
            let title = format!("{}: {}", cfg.path.display(), cfg.describe_model());
            let svg = ps_launch::plot::curves_svg(&text, &title)
                .map_err(|e| anyhow::anyhow!("{}: {e}", metrics.display()))?;
            let plot = out_dir.join("curves.svg");
            std::fs::write(&plot, svg).with_context(|| plot.display().to_string())?;
            println!("ps-launch: loss and accuracy curves in {}", plot.display());
        }
        Err(e) => eprintln!(
            "ps-launch: no curves: cannot read {} ({e})",
            metrics.display()
        ),
    }
    Ok(())
}
