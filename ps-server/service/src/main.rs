//! `ps-server --config FILE --shard I`: one shard of the parameter server.

use clap::Parser;
use ps_config::Overrides;
use ps_server::{Outcome, load_checkpoint_of, load_setup, run_shard_recovering};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "One shard of the parameter server",
    after_help = "The credentials step of a cluster started without ps-launch: `ps-server credentials --dir DIR` writes the workers' token and the shard credential of a run into DIR and prints the config lines that point at them."
)]
struct Cli {
    /// The cluster's TOML config.
    #[arg(long)]
    config: PathBuf,
    /// This shard's index (its address is `[cluster] servers[I]`).
    #[arg(long)]
    shard: usize,
    /// Listen here instead of the config's address (`127.0.0.1:0` picks a free port).
    #[arg(long)]
    listen: Option<String>,
    /// Write the bound address to this file once listening (for launchers).
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Shard 0's address, when it differs from the config's.
    #[arg(long)]
    shard0: Option<String>,
    /// Write final weights and metrics here instead of the config's `[server] out_dir`.
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Dataset directory instead of the config's `[data] dir` (decides the number of steps).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Start from the newest checkpoint version that every shard has (see `[checkpoint]`);
    /// only this run's checkpoints (see `--run-id`).
    #[arg(long)]
    resume: bool,
    /// Resume (as `--resume`) from the checkpoints of run RUN, another run's.
    #[arg(long, value_name = "RUN")]
    resume_from: Option<String>,
    /// Override a config key: `--set section.key=value` (repeatable; after the environment's
    /// `PS_SET_<SECTION>_<KEY>`), checked like the file's value and logged.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// This run's id (default: PS_RUN_ID, `[cluster] run_id`, SLURM_JOB_ID, PS_K8S_JOB_UID);
    /// requests of another run are refused.
    #[arg(long)]
    run_id: Option<String>,
    /// Serve Prometheus metrics on `GET /metrics` here (instead of `[server] metrics_addrs[I]`;
    /// `127.0.0.1:0` picks a free port, logged).
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Also serve gRPC health (`grpc.health.v1`, service "" and "ps.v1.ParameterServer")
    /// alone on this address, in plaintext and without the token, for probes that cannot
    /// speak TLS (the kubelet's); the shard's own address serves it too.
    #[arg(long)]
    health_listen: Option<String>,
    /// This shard replaces one that was lost (restarted by a launcher, a Slurm loop, a pod's
    /// restart policy): before it listens, every other shard rolls back with it to the newest
    /// version all have a checkpoint of (0 when none), and the run goes on from there.
    #[arg(long, conflicts_with_all = ["resume", "resume_from"])]
    recover: bool,
    /// Every shard's address, by index (comma-separated), for `--recover`, when they differ
    /// from the config's `[cluster] servers`.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Only check: validate the config and the training set's shape, print the resolved
    /// config and its single-process equivalence, and exit (0 valid, 2 refused).
    #[arg(long)]
    check: bool,
}

/// `ps-server credentials --dir DIR`: the credentials step (`deploy/README.md`).
#[derive(Parser, Debug)]
#[command(
    name = "ps-server credentials",
    about = "Write a run's credentials for shards and workers started without ps-launch: DIR/token (the workers' token, [cluster] token_file, for every process) and DIR/shard-token (the shard credential, [server] shard_token_file, for the shards only), each 0600; prints the config lines that point at them"
)]
struct CredentialsCli {
    /// The folder to write them into (created; files already there are never replaced).
    #[arg(long)]
    dir: PathBuf,
}

fn credentials(args: Vec<String>) -> std::process::ExitCode {
    let cli = CredentialsCli::parse_from(args);
    match ps_config::credential::write_credentials(&cli.dir) {
        Ok(lines) => {
            print!("{lines}");
            eprintln!(
                "wrote {0}/token and {0}/shard-token: copy the folder to every host of the run (the shard credential to the shard hosts only) and put the lines above in the config",
                cli.dir.display()
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

fn main() -> std::process::ExitCode {
    ps_process::tune_allocator();
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("credentials") {
        return credentials(args[1..].to_vec());
    }
    ps_process::init_logging();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    match rt.block_on(serve(cli)) {
        Ok(Outcome::Finished) => std::process::ExitCode::SUCCESS,
        Ok(Outcome::Interrupted) => std::process::ExitCode::from(130),
        Ok(Outcome::Preempted { .. }) => std::process::ExitCode::from(143),
        Ok(Outcome::Failed(_)) => std::process::ExitCode::from(1),
        // run_shard_recovering serves again after a rollback: never its result
        Ok(Outcome::RolledBack { .. }) => std::process::ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

async fn serve(mut cli: Cli) -> anyhow::Result<Outcome> {
    let env: std::collections::HashMap<String, String> = std::env::vars().collect();
    let overrides = overrides(&mut cli, &env)?;
    let mut setup = load_setup(&cli.config, cli.shard, cli.shard0.take(), &overrides)?;
    let run = setup.cfg.resolve_run_id(cli.run_id.as_deref(), &env)?;
    tracing::info!(
        "shard {}: {} (run id from {})",
        setup.index,
        run.show(),
        run.source
    );
    if cli.metrics_listen.is_some() {
        setup.metrics_listen = cli.metrics_listen.take();
    }
    setup.health_listen = cli.health_listen.take();
    if cli.check {
        print_check(&mut setup)?;
        return Ok(Outcome::Finished);
    }
    // what cannot work without the shard credential is refused before anything is
    // written or listened on, naming the step (ps-launch's --check has no credential)
    let credential = ps_net::auth::shard_token(setup.cfg.server.shard_token_file.as_deref())
        .map_err(anyhow::Error::msg)?;
    ps_server::needs_shard_credential(&setup.cfg, setup.index, credential.is_some(), cli.recover)
        .map_err(anyhow::Error::msg)?;
    let generation = recover(&cli, &mut setup).await?;
    // before listening: a shard that could not save its results never looks ready
    ps_server::check_output_dirs(&setup.cfg)?;
    // one live cluster per output folder: a second run given the same one fails here, before
    // it listens, writes or prunes anything (the lock is held until this process ends)
    let _out_dir_lock =
        ps_config::runid::lock_out_dir(&setup.cfg.server.out_dir, setup.index, run.id.as_deref())
            .map_err(anyhow::Error::msg)?;
    if cli.resume || cli.resume_from.is_some() {
        // before listening: a shard that cannot resume never looks ready to a launcher
        setup.resume_from = Some(load_checkpoint_of(
            &setup.cfg,
            setup.index,
            setup.train_len,
            cli.resume_from.as_deref(),
        )?);
    }
    // a cosine schedule spans the run, whose length the data set decides: say it in steps
    let total = setup.cfg.total_steps(setup.train_len)?;
    setup.cfg.schedule = setup.cfg.schedule_for(total);
    if setup.index == 0 {
        tracing::info!("{}", setup.cfg.describe());
        let eq = setup.cfg.equivalence();
        tracing::info!("{eq}");
        for w in &eq.warnings {
            tracing::warn!("{w}");
        }
    }
    let listener = listen(&cli, &setup)?;
    // Ctrl-C stops at once; SIGTERM (scancel, a pod's deletion, preemption) and SIGUSR1
    // (Slurm's --signal=USR1@N) checkpoint at the next step boundary first
    run_shard_recovering(
        setup,
        listener,
        generation,
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
        ps_process::preempt_signal(),
    )
    .await
}

/// The overrides of the environment and the command line (`--data-dir`, `--out-dir`,
/// `--set`), each logged.
fn overrides(
    cli: &mut Cli,
    env: &std::collections::HashMap<String, String>,
) -> anyhow::Result<Overrides> {
    let mut overrides = Overrides::from_env(env);
    overrides.data_dir = cli.data_dir.take();
    overrides.out_dir = cli.out_dir.take();
    overrides
        .set_from_cli(&cli.set)
        .map_err(anyhow::Error::msg)?;
    for line in overrides.describe().lines() {
        tracing::info!("shard {}: {line}", cli.shard);
    }
    Ok(overrides)
}

/// `--check`: prints the run's description and its equivalence statement, with the warnings
/// the run logs, word for word.
fn print_check(setup: &mut ps_server::ShardSetup) -> anyhow::Result<()> {
    let total = setup.cfg.total_steps(setup.train_len)?;
    setup.cfg.schedule = setup.cfg.schedule_for(total);
    println!("{}", setup.cfg.describe());
    let eq = setup.cfg.equivalence();
    println!("{eq}");
    // the warnings the run logs, word for word
    for w in &eq.warnings {
        println!("warning: {w}");
    }
    Ok(())
}

/// `--recover`: the replacement's handshake with its peers, before anything is written; the
/// generation it joins (0 without `--recover`), and the state it starts from in `setup`.
async fn recover(cli: &Cli, setup: &mut ps_server::ShardSetup) -> anyhow::Result<u64> {
    if !cli.recover {
        return Ok(0);
    }
    // before anything is written: a replacement whose checkpoint directory is gone must
    // not create an empty one and start from nothing
    let peers = if cli.peers.is_empty() {
        setup.cfg.cluster.servers.clone()
    } else {
        cli.peers.clone()
    };
    let shard_token = ps_net::auth::shard_token(setup.cfg.server.shard_token_file.as_deref())
        .map_err(anyhow::Error::msg)?;
    let r = ps_server::recovery::handshake(&setup.cfg, setup.index, &peers, shard_token.as_ref())
        .await?;
    setup.resume_from = r.saved;
    Ok(r.generation)
}

/// Binds the shard's address (`--listen`, else its entry of `[cluster] servers`), warns when
/// it is exposed without a credential, and writes `--addr-file`.
fn listen(cli: &Cli, setup: &ps_server::ShardSetup) -> anyhow::Result<std::net::TcpListener> {
    let addr = cli
        .listen
        .clone()
        .unwrap_or_else(|| setup.cfg.cluster.servers[setup.index].clone());
    // a std listener: after a rollback the shard serves again on the same socket
    let listener = std::net::TcpListener::bind(&addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    let shard_credential = ps_net::auth::shard_token(setup.cfg.server.shard_token_file.as_deref())
        .map_err(anyhow::Error::msg)?;
    let exposure =
        ps_server::check_exposure(&setup.cfg, setup.index, bound, shard_credential.is_some())
            .map_err(anyhow::Error::msg)?;
    if let Some(w) = exposure {
        tracing::warn!("{w}");
    }
    if let Some(f) = &cli.addr_file {
        let tmp = f.with_extension("tmp");
        std::fs::write(&tmp, format!("{bound}\n"))?;
        std::fs::rename(&tmp, f)?;
    }
    Ok(listener)
}
