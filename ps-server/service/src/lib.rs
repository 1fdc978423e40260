//! The parameter-server shard: it owns one contiguous range of the model's flat parameter
//! vector and its optimizer state, runs a BSP barrier per step over every worker's gradient,
//! aggregates (`sum`, `mean` or sample-`weighted`) in fixed rank order, applies the optimizer,
//! and serves the new version to pulls (through gRPC, or a shared-memory board for workers on
//! its host). Shard 0 also logs the cluster-wide convergence line. Every shard writes
//! checkpoints, resumes from them, and can serve Prometheus metrics.
//!
//! Where each concept lives:
//! - [`shard`] (the `ps-shard` crate, with no gRPC in it): the shard as a facade (register,
//!   push, step, pull) over [`shard::barrier`] (slots, retries, conflicts, timeout policy),
//!   [`shard::store`] (parameters of two versions, heap or shared memory), [`shard::update`]
//!   (the fused aggregation + optimizer update) and [`shard::shm`] (the shared-memory side);
//! - [`service`]: the gRPC handlers; [`run_shard`] serves them and acts on the barrier's verdicts;
//! - [`report`]: the per-step log line and the reports to shard 0; [`exporter`]: `/metrics`;
//! - [`checkpoint`] (`ps_shard::checkpoint`): writing, pruning and resuming from checkpoints;
//! - [`clip`] and [`recovery`]: the shard-to-shard exchanges over gRPC, behind the core's
//!   traits ([`shard::NormExchange`]).
//! - a run's own steps, in private modules: `open` (a generation's set-up), `serving` (its
//!   ports and their stop), `ending` (watching the run to its end, preemption, the final
//!   weights); `preflight` (what a shard refuses before it listens) and `setup` (the setup and
//!   checkpoint it starts from), their public items re-exported here.

pub mod accept;
pub use ps_shard::checkpoint;
pub mod clip;
pub mod data;
mod ending;
pub mod exporter;
pub mod handshake;
pub mod lease;
pub mod linger;
pub mod memory;
mod open;
pub mod partial;
pub mod peers;
mod preflight;
pub mod recovery;
pub mod report;
pub mod service;
mod serving;
mod setup;
pub use ps_shard as shard;
pub mod tensorboard;

pub use preflight::{StartRefused, check_exposure, check_output_dirs, needs_shard_credential};
pub use setup::{load_checkpoint, load_checkpoint_of, load_setup};

use checkpoint::Saved;
use ending::{conclude, preempted, watch_run};
use open::{build_service, open_shard};
use ps_config::Config;
use service::ShardService;
use serving::{serve_side, start_serving, stop_serving};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// How a shard's run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every step applied (and the workers left, or the linger time ran out).
    Finished,
    /// The barrier timed out or another fatal condition; the message says why.
    Failed(String),
    /// The shutdown future fired (Ctrl-C) before the end.
    Interrupted,
    /// Preempted (SIGTERM, SIGUSR1): the shard wrote a checkpoint at a step boundary (the
    /// newest: `saved`, None if it could not) and stopped; `--resume` continues from it.
    Preempted {
        /// The newest version checkpointed on preemption.
        saved: Option<u64>,
    },
    /// Another shard was lost and its replacement ordered this shard to roll back
    /// ([`recovery`]): [`run_shard_recovering`] serves again from that version.
    RolledBack {
        /// The shard that was lost.
        lost: usize,
        /// The version rolled back to.
        version: u64,
        /// The generation the cluster entered.
        generation: u64,
    },
}

/// How long a preempted shard waits for the step boundary after the version it is at
/// (the workers finishing the step in flight) before it stops with what it has written.
pub const PREEMPT_GRACE: Duration = Duration::from_secs(10);

/// Everything a shard needs to run.
#[derive(Debug)]
pub struct ShardSetup {
    /// The config.
    pub cfg: Config,
    /// Shard index.
    pub index: usize,
    /// Training-set size (decides the number of steps).
    pub train_len: usize,
    /// Test-set size: each rank evaluates its slice of it (`split_even`), so the evaluation
    /// figures a worker reports are checked against that slice; None: checked only for
    /// correct <= count and sums that fit.
    pub test_len: Option<usize>,
    /// Shard 0's address, for shards > 0 to report to.
    pub shard0: Option<String>,
    /// The checkpoint to start from ([`load_checkpoint`]), instead of the initial weights.
    pub resume_from: Option<Saved>,
    /// Serve `GET /metrics` (Prometheus) on this address (`host:0` picks a free port).
    pub metrics_listen: Option<String>,
    /// Also serve gRPC health (`grpc.health.v1`) alone, without TLS or token, on this address
    /// (for probes that cannot speak TLS, such as the kubelet's); the shard's own port serves
    /// it too, beside the shard service.
    pub health_listen: Option<String>,
}

/// The service name a shard reports in `grpc.health.v1`: SERVING while it takes requests
/// (from listening until its run ends), NOT_SERVING once the run finished, failed or was
/// preempted. The empty name ("the server") is SERVING while the process serves.
pub const HEALTH_SERVICE: &str = "ps.v1.ParameterServer";

/// Serves shard `setup.index` on `listener` until the run ends or `shutdown` resolves; writes
/// the final weights into the config's output directory (which the caller checks first, with
/// [`check_output_dirs`], before it listens: `ps-server` does).
pub async fn run_shard(
    setup: ShardSetup,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<Outcome> {
    run_shard_preemptible(setup, listener, shutdown, std::future::pending()).await
}

/// [`run_shard`], and when `preempt` resolves (SIGTERM, SIGUSR1) the shard writes a checkpoint
/// at the version it is at and at the next step boundary (bounded by [`PREEMPT_GRACE`]), then
/// stops ([`Shard::request_preempt`](shard::Shard::request_preempt) says why every shard then has a common version).
pub async fn run_shard_preemptible(
    setup: ShardSetup,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    preempt: impl Future<Output = ()>,
) -> anyhow::Result<Outcome> {
    let cell = Arc::new(recovery::Cell::new(setup.cfg.clone(), setup.index, 0));
    run_generation(setup, listener, cell, shutdown, preempt).await
}

/// [`run_shard_preemptible`] at cluster generation `generation`, and again from the
/// checkpoint each time another shard's replacement orders a rollback ([`recovery`]), on the
/// same listening socket (`listener`, non-blocking), until the run ends otherwise.
pub async fn run_shard_recovering(
    mut setup: ShardSetup,
    listener: std::net::TcpListener,
    mut generation: u64,
    shutdown: impl Future<Output = ()>,
    preempt: impl Future<Output = ()>,
) -> anyhow::Result<Outcome> {
    tokio::pin!(shutdown);
    tokio::pin!(preempt);
    loop {
        let l = TcpListener::from_std(listener.try_clone()?)?;
        let cell = Arc::new(recovery::Cell::new(
            setup.cfg.clone(),
            setup.index,
            generation,
        ));
        let next = ShardSetup {
            cfg: setup.cfg.clone(),
            index: setup.index,
            train_len: setup.train_len,
            test_len: setup.test_len,
            shard0: setup.shard0.clone(),
            resume_from: None,
            metrics_listen: setup.metrics_listen.clone(),
            health_listen: setup.health_listen.clone(),
        };
        let outcome =
            run_generation(setup, l, cell.clone(), shutdown.as_mut(), preempt.as_mut()).await?;
        let Outcome::RolledBack { .. } = outcome else {
            return Ok(outcome);
        };
        let Some(rb) = cell.ordered() else {
            return Ok(outcome);
        };
        setup = next;
        setup.resume_from = rb.saved;
        generation = rb.generation;
        tracing::warn!(
            "shard {}: recovery: serving again from version {} in generation {} (shard {} was lost; this shard was at version {}: steps {}..{} are redone), {:.2} s after the rollback order",
            setup.index,
            rb.version,
            generation,
            rb.lost,
            rb.from,
            rb.version,
            rb.from,
            rb.ordered.elapsed().as_secs_f64()
        );
    }
}

/// One generation of a shard: set-up ([`open_shard`], the side servers, the service), serve
/// until the run ends or is stopped ([`watch_run`]), conclude ([`conclude`]) and stop
/// ([`stop_serving`]).
async fn run_generation(
    setup: ShardSetup,
    listener: TcpListener,
    cell: Arc<recovery::Cell>,
    shutdown: impl Future<Output = ()>,
    preempt: impl Future<Output = ()>,
) -> anyhow::Result<Outcome> {
    let ShardSetup {
        cfg,
        index,
        train_len,
        test_len,
        shard0,
        resume_from,
        metrics_listen,
        health_listen,
    } = setup;
    let opened = open_shard(
        &cfg,
        index,
        train_len,
        &shard0,
        resume_from,
        cell.generation(),
    )?;
    let (total_steps, shard, reporter) = (
        opened.total_steps,
        opened.shard.clone(),
        opened.reporter.clone(),
    );
    let (health, health_service) = tonic_health::server::health_reporter();
    let side = serve_side(
        &cfg,
        index,
        cell.generation(),
        (metrics_listen.as_deref(), &opened.metrics),
        (health_listen.as_deref(), &health_service),
    )
    .await?;
    let svc = build_service(&cfg, (index, test_len), &listener, &cell, opened).await?;
    let max_streams = svc.max_streams;
    tracing::info!(
        "shard {index}/{}: parameters {}..{} ({} values) of {}, {} steps, listening on {}",
        cfg.num_shards(),
        shard.range.start,
        shard.range.end,
        shard.len(),
        cfg.describe_model(),
        total_steps,
        listener.local_addr()?
    );
    let watcher = svc.clone();
    let (serve, stop_tx) = start_serving(&cfg, index, listener, svc, health_service, max_streams)?;
    health
        .set_service_status(HEALTH_SERVICE, tonic_health::ServingStatus::Serving)
        .await;

    let outcome = serve_until_end(&cfg, &watcher, &cell, shutdown, preempt).await;
    let stop_wait = conclude(&cfg, index, &shard, &reporter, &outcome).await;
    health
        .set_service_status(HEALTH_SERVICE, tonic_health::ServingStatus::NotServing)
        .await;
    stop_serving(
        &cfg,
        index,
        &outcome,
        &watcher,
        side,
        (serve, stop_tx),
        stop_wait,
    )
    .await;
    watcher.log_unreported_refusals();
    Ok(outcome)
}

/// Serves until the run ends ([`watch_run`]), `shutdown` or `preempt` fires, or `cell` orders
/// a rollback; what ended it.
async fn serve_until_end(
    cfg: &Config,
    watcher: &ShardService,
    cell: &recovery::Cell,
    shutdown: impl Future<Output = ()>,
    preempt: impl Future<Output = ()>,
) -> Outcome {
    let mut outcome = tokio::select! {
        o = watch_run(cfg, watcher) => o,
        _ = shutdown => Outcome::Interrupted,
        _ = preempt => preempted(cfg, watcher).await,
        rb = cell.wait() => Outcome::RolledBack { lost: rb.lost, version: rb.version, generation: rb.generation },
    };
    // a rollback fails the shard's state first: its watcher may have seen that failure
    if let (Outcome::Failed(_), Some(rb)) = (&outcome, cell.ordered()) {
        outcome = Outcome::RolledBack {
            lost: rb.lost,
            version: rb.version,
            generation: rb.generation,
        };
    }
    outcome
}
