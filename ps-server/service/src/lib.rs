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

pub mod accept;
pub use ps_shard::checkpoint;
pub mod clip;
pub mod data;
pub mod exporter;
pub mod handshake;
pub mod lease;
pub mod linger;
pub mod memory;
pub mod partial;
pub mod peers;
pub mod recovery;
pub mod report;
pub mod service;
pub use ps_shard as shard;
pub mod tensorboard;

use anyhow::Context;
use checkpoint::{Identity, Saved};
use ps_config::Config;
use ps_net::wire::MAX_MESSAGE_BYTES;
use ps_proto::pb::parameter_server_server::ParameterServerServer;
use report::{Reporter, ReporterConfig};
use service::ShardService;
use shard::Shard;
use shard::barrier::Verdict;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
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
/// stops ([`Shard::request_preempt`] says why every shard then has a common version).
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

/// Serves `/metrics` on `addr` in a task. After a rollback (`generation` > 0) the previous
/// state's exporter may still hold the port a moment: binding is retried for up to 3 s.
async fn serve_metrics(
    addr: &str,
    index: usize,
    generation: u64,
    metrics: Arc<exporter::Metrics>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let mut tries = 0;
    let l = loop {
        match TcpListener::bind(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && generation > 0 && tries < 30 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            r => break r,
        }
    }
    .with_context(|| format!("cannot listen for /metrics on {addr}"))?;
    tracing::info!(
        "shard {index}: Prometheus metrics on http://{}/metrics",
        l.local_addr()?
    );
    Ok(tokio::spawn(exporter::serve(l, metrics)))
}

/// Serves gRPC health (`grpc.health.v1`, plaintext; `health` is its service) on `addr` in a
/// task, through the same accept loop as the gRPC port ([`accept::incoming`]): at most
/// `[server] max_connections` connections, each closed unless it completes the HTTP/2 preface
/// within `[server] handshake_timeout_secs`.
async fn serve_health(
    addr: &str,
    index: usize,
    health: tonic::service::Routes,
    server: &ps_config::ServerConfig,
) -> anyhow::Result<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>> {
    let l = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for gRPC health on {addr}"))?;
    tracing::info!(
        "shard {index}: gRPC health (grpc.health.v1, plaintext) on {}",
        l.local_addr()?
    );
    let incoming = accept::incoming(
        l,
        Default::default(),
        server.max_connections,
        index,
        false,
        Duration::from_secs_f64(server.handshake_timeout_secs),
    );
    Ok(tokio::spawn(
        tonic::transport::Server::builder()
            .add_routes(health)
            .serve_with_incoming(incoming),
    ))
}

/// A generation's side servers, each when asked for: `/metrics` ([`serve_metrics`]) and the
/// plaintext gRPC health port ([`serve_health`]).
type SideServers = (
    Option<tokio::task::JoinHandle<()>>,
    Option<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>>,
);

/// The gRPC server's task and the sender that stops it ([`start_serving`]).
type Serving = (
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    tokio::sync::oneshot::Sender<()>,
);

/// Starts the side servers of a generation: `/metrics` on `metrics.0` (serving `metrics.1`),
/// health on `health.0` (serving `health.1`).
async fn serve_side(
    cfg: &Config,
    index: usize,
    generation: u64,
    metrics: (Option<&str>, &Arc<exporter::Metrics>),
    health: (
        Option<&str>,
        &tonic_health::pb::health_server::HealthServer<
            impl tonic_health::pb::health_server::Health,
        >,
    ),
) -> anyhow::Result<SideServers> {
    let exporter = match metrics.0 {
        Some(addr) => Some(serve_metrics(addr, index, generation, metrics.1.clone()).await?),
        None => None,
    };
    let health_server = match health.0 {
        Some(addr) => Some(
            serve_health(
                addr,
                index,
                tonic::service::Routes::new(health.1.clone()),
                &cfg.server,
            )
            .await?,
        ),
        None => None,
    };
    Ok((exporter, health_server))
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

/// The gRPC service of a shard `opened` (shard `index` of `cfg`, with a test set of
/// `test_len` samples): its peers, its leases, its data connection on `listener`'s host.
async fn build_service(
    cfg: &Config,
    (index, test_len): (usize, Option<usize>),
    listener: &TcpListener,
    cell: &Arc<recovery::Cell>,
    opened: Opened,
) -> anyhow::Result<ShardService> {
    let Opened {
        total_steps: _,
        shard_token,
        shard,
        metrics,
        reporter,
        clip_hub,
    } = opened;
    let peers: Arc<peers::Peers> = Default::default();
    let leases = Arc::new(lease::Leases::new(
        index,
        cfg.cluster.workers,
        cell.generation(),
        peers.clone(),
    ));
    let data = serve_data(cfg, index, listener, &leases).await?;
    Ok(ShardService {
        data,
        shard,
        reporter,
        pull_timeout: Duration::from_secs_f64(cfg.server.pull_timeout_secs),
        chunk_bytes: cfg.server.chunk_bytes,
        all_left: Arc::new(linger::Leaving::default()),
        run_id: cfg.cluster.run_id.clone().unwrap_or_default(),
        metrics,
        peers,
        leases,
        test_slices: test_len.map(|n| {
            ps_model::layout::split_even(n, cfg.cluster.workers)
                .iter()
                .map(|r| r.len() as u64)
                .collect()
        }),
        stream_idle: Duration::from_secs_f64(cfg.server.stream_idle_secs),
        shard_token,
        refusals: Default::default(),
        max_streams: max_streams(cfg, index),
        recovery: cell.clone(),
        wire: cfg.cluster.wire,
        clip_hub,
    })
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

/// What a generation's set-up opens before it serves ([`open_shard`]).
struct Opened {
    total_steps: u64,
    shard_token: Option<ps_config::credential::Token>,
    shard: Arc<Shard>,
    metrics: Arc<exporter::Metrics>,
    reporter: Reporter,
    /// Shard 0's gatherer of the gradient norms (`[optimizer] clip_norm` over several shards).
    clip_hub: Option<Arc<clip::Hub>>,
}

/// The set-up of a generation's state: the steps, the shard credential, the shard (from the
/// checkpoint to resume, whose later step lines shard 0 trims from `metrics.jsonl`), its
/// figures and reporter, the gradient-norm exchange of `[optimizer] clip_norm`, and the
/// memory plan (logged) and descriptor limit it runs with.
fn open_shard(
    cfg: &Config,
    index: usize,
    train_len: usize,
    shard0: &Option<String>,
    resume_from: Option<Saved>,
    generation: u64,
) -> anyhow::Result<Opened> {
    let total_steps = cfg.total_steps(train_len)?;
    let shard_token = ps_net::auth::shard_token(cfg.server.shard_token_file.as_deref())
        .map_err(anyhow::Error::msg)?;
    let resumed = resume_from.is_some();
    let resumed_at = resume_from.as_ref().map(|s| s.version);
    if let (Some(saved), 0) = (&resume_from, index) {
        // every step once in metrics.jsonl: the steps past the checkpoint are redone
        let path = cfg.server.out_dir.join("metrics.jsonl");
        if let Err(e) = report::truncate_metrics(&path, saved.version) {
            tracing::warn!(
                "cannot trim {} to version {}: {e}",
                path.display(),
                saved.version
            );
        }
    }
    let shard = Shard::try_starting_from(cfg, index, total_steps, resume_from)
        .map_err(anyhow::Error::msg)?;
    match shard.apply_mode() {
        shard::bucket::Mode::Buckets => tracing::info!(
            "shard {index}: the update is applied per bucket ({} buckets of at most {} values), each as soon as every rank's gradient for it is in",
            shard.buckets().len(),
            shard::bucket::BUCKET_VALUES
        ),
        shard::bucket::Mode::Whole(why) => tracing::info!(
            "shard {index}: the update is applied over the whole range once every gradient is in: {why}"
        ),
    }
    let metrics = Arc::new(exporter::Metrics::new(index, total_steps, shard.version()));
    let reporter = Reporter::spawn(ReporterConfig {
        noise: report::NoiseSetup::of(cfg, metrics.clone()),
        shard: index,
        num_shards: cfg.num_shards(),
        world: cfg.cluster.workers,
        total_steps,
        log_every: cfg.train.log_every,
        metrics_file: (index == 0).then(|| cfg.server.out_dir.join("metrics.jsonl")),
        append_metrics: resumed,
        shard0: shard0.clone(),
        security: ps_net::auth::ClientSecurity::of(cfg),
        shard_token: shard_token.clone(),
        tensorboard_dir: (index == 0).then(|| cfg.server.out_dir.clone()),
        resumed_at,
    });
    if cfg.num_shards() > 1 && shard_token.is_none() {
        tracing::warn!(
            "shard {index}: no shard credential ([server] shard_token_file, or {} as ps-launch sets it): shard-to-shard calls (step reports, recovery from a lost shard) are refused; set [server] shard_token_file to a token only the shards read",
            ps_net::auth::SHARD_TOKEN_ENV
        );
    }
    // [optimizer] clip_norm over several shards: shard 0 gathers the norms, the others ask it
    let clip_hub = (cfg.clip_norm.is_some() && cfg.num_shards() > 1 && index == 0)
        .then(|| Arc::new(clip::Hub::new(cfg)));
    if let Some(hub) = &clip_hub {
        shard.set_norm_exchange(hub.clone());
    } else if cfg.clip_norm.is_some() && cfg.num_shards() > 1 {
        let shard0 = shard0.clone().unwrap_or_default();
        shard.set_norm_exchange(Arc::new(clip::Spoke::new(
            cfg,
            index,
            shard0,
            shard_token.clone(),
            generation,
        )));
    }
    let bucketed = !shard.buckets().is_empty();
    let plan = memory::MemoryPlan::of_shard(cfg, shard.len(), bucketed);
    memory::log_plan(index, &plan, memory::available());
    metrics.set_expected_memory(plan.total());
    accept::raise_fd_limit(index);
    Ok(Opened {
        total_steps,
        shard_token,
        shard,
        metrics,
        reporter,
        clip_hub,
    })
}

/// The tensor data connections beside gRPC, on the gRPC listener's address plus `[server]
/// data_port_offset` (none with TLS: they are unencrypted; none unless `[server]
/// data_connections`).
async fn serve_data(
    cfg: &Config,
    index: usize,
    listener: &TcpListener,
    leases: &Arc<lease::Leases>,
) -> anyhow::Result<Option<Arc<data::DataConns>>> {
    // tensor data connections beside gRPC, on the same address (not with TLS: unencrypted)
    if cfg.cluster.tls.is_some() || !cfg.server.data_connections {
        return Ok(None);
    }
    let local = listener.local_addr()?;
    let ip = local.ip();
    let port = match cfg.server.data_port_offset {
        0 => 0,
        off => u16::try_from(u32::from(local.port()) + off).map_err(|_| {
            anyhow::anyhow!(
                "[server] data_port_offset = {off}: the gRPC port {} + {off} is past 65535",
                local.port()
            )
        })?,
    };
    let l = TcpListener::bind((ip, port)).await.with_context(|| {
    if port == 0 {
        format!("cannot listen for data connections on {ip}")
    } else {
        format!(
            "cannot listen for data connections on {ip}:{port} (the gRPC port {} + [server] data_port_offset = {})",
            local.port(),
            cfg.server.data_port_offset
        )
    }
})?;
    let expect = data::Expect {
        token: cfg.cluster.token.clone(),
        run_id: cfg.cluster.run_id.clone().unwrap_or_default(),
        shard: index,
    };
    let idle = Duration::from_secs_f64(cfg.server.stream_idle_secs);
    let conns = data::DataConns::serve(l, cfg.cluster.workers, expect, idle, leases.clone())?;
    tracing::info!(
        "shard {index}: tensor data connections on port {}",
        conns.port
    );
    Ok(Some(conns))
}

/// The HTTP/2 streams a connection may carry ([`accept::streams_per_connection`]), logged
/// when that raises `[server] max_streams_per_connection`.
fn max_streams(cfg: &Config, index: usize) -> usize {
    // enough stream slots per connection that ranks sharing one cannot deadlock on it
    let max_streams =
        accept::streams_per_connection(cfg.server.max_streams_per_connection, cfg.cluster.workers);
    if max_streams > cfg.server.max_streams_per_connection {
        tracing::info!(
            "shard {index}: [server] max_streams_per_connection = {} raised to {max_streams} (2 x {} workers + 4), so that ranks sharing a connection cannot fill it with waiting pulls",
            cfg.server.max_streams_per_connection,
            cfg.cluster.workers
        );
    }
    max_streams
}

/// Starts serving gRPC on `listener` in a task (the shard service and health, in the memory
/// budget of partial messages, behind the token check, with TLS when configured) until the
/// sender returned is used or dropped.
fn start_serving(
    cfg: &Config,
    index: usize,
    listener: TcpListener,
    svc: ShardService,
    health_service: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    max_streams: usize,
) -> anyhow::Result<Serving> {
    let svc_peers = svc.peers.clone();
    let server = tonic::service::interceptor::InterceptedService::new(
        service::SharedPulls(
            ParameterServerServer::new(svc)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        ),
        ps_net::auth::CheckToken::new(cfg.cluster.token.as_ref(), index)
            .with_run_id(cfg.cluster.run_id.as_deref()),
    );
    // partial messages of every service on the port count in the memory budget (as the body
    // is read: after the token check)
    let budget = partial::PartialBudget::new(partial::partial_message_budget(cfg), index);
    tokio::spawn(partial::PartialBudget::trim_when_due(Arc::downgrade(
        &budget,
    )));
    let idle = Duration::from_secs_f64(cfg.server.stream_idle_secs);
    let server = partial::Budgeted::new(server, budget.clone(), idle);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // each connection is tracked while open, so that a rank's live holder is known; the
    // accept loop bounds connections and survives running out of descriptors
    let incoming = accept::incoming(
        listener,
        svc_peers.clone(),
        cfg.server.max_connections,
        index,
        cfg.cluster.tls.is_some(),
        Duration::from_secs_f64(cfg.server.handshake_timeout_secs),
    );
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &cfg.cluster.tls {
        builder = builder
            .tls_config(ps_net::auth::server_tls(tls))
            .context("TLS: the certificate or key in [cluster] tls_cert / tls_key")?;
    }
    let serve = builder
        .initial_stream_window_size(cfg.server.stream_window_bytes as u32)
        .initial_connection_window_size(accept::connection_window(
            cfg.server.stream_window_bytes,
            cfg.cluster.workers,
        ))
        .max_concurrent_streams(max_streams as u32)
        .http2_keepalive_interval(Some(Duration::from_secs_f64(cfg.server.keepalive_secs)))
        .http2_keepalive_timeout(Some(Duration::from_secs_f64(cfg.server.keepalive_secs)))
        // frames no larger than the window: what a connection buffers stays near it
        .max_frame_size(
            cfg.server
                .stream_window_bytes
                .clamp(16 << 10, (1 << 20) - 1) as u32,
        )
        .tcp_nodelay(true)
        .add_service(partial::Budgeted::new(health_service, budget, idle))
        .add_service(server)
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop_rx.await;
        });
    Ok((tokio::spawn(serve), stop_tx))
}

/// What the shard does once its run has ended with `outcome`, before it stops serving: the
/// reporter's pending lines out (rollback, preemption), the failure recorded for the requests
/// still to come (and, when a worker stopped, each rank told); returns how long the server may
/// take to stop.
async fn conclude(
    cfg: &Config,
    index: usize,
    shard: &Shard,
    reporter: &Reporter,
    outcome: &Outcome,
) -> Duration {
    let mut stop_wait = Duration::from_secs(5);
    match outcome {
        Outcome::RolledBack { .. } => {
            // the step lines of the state left behind are out before the next state trims them
            reporter.flush().await;
            stop_wait = Duration::from_secs(1);
        }
        Outcome::Finished => {}
        Outcome::Failed(why) => {
            tracing::error!("shard {index}: run failed: {why}");
            shard.fail(why.clone());
            if why.contains(service::WORKER_STOPPED) {
                // the other workers learn the reason from their next request (refused with
                // it) rather than from a connection that is gone: the shard stays up until
                // each rank was refused with it or left
                let bound = Duration::from_secs_f64(cfg.server.linger_secs);
                tracing::info!(
                    "shard {index}: refusing the other workers' requests with the reason until each has been told (at most {:.1} s, [server] linger_secs)",
                    bound.as_secs_f64()
                );
                let untold = shard.wait_all_told(bound).await;
                if !untold.is_empty() {
                    tracing::warn!(
                        "shard {index}: ranks {untold:?} made no request within {:.1} s of the failure ([server] linger_secs): they will find the shard gone",
                        bound.as_secs_f64()
                    );
                }
            }
        }
        Outcome::Preempted { saved } => {
            // the step lines of every version applied are out (shard 0 waits for the others'
            // reports otherwise): a resume trims metrics.jsonl to its version and goes on
            // after it, so a line still waiting here would be lost
            reporter.flush().await;
            let why = match saved {
                Some(v) => format!(
                    "shard {index} was preempted: checkpoint of version {v} written; start the cluster again with --resume"
                ),
                None => format!("shard {index} was preempted without a checkpoint"),
            };
            tracing::warn!("{why}");
            shard.fail(why);
        }
        Outcome::Interrupted => {
            tracing::warn!(
                "shard {index}: interrupted at version {}; stopping",
                shard.version()
            );
            shard.fail("the shard was interrupted".into());
        }
    }
    stop_wait
}

/// Stops the side servers (`/metrics` once scraped after a finished run, within `[server]
/// metrics_linger_secs`; health) and the gRPC server, waiting `stop_wait` for its connections.
async fn stop_serving(
    cfg: &Config,
    index: usize,
    outcome: &Outcome,
    watcher: &ShardService,
    side: SideServers,
    serve: Serving,
    stop_wait: Duration,
) {
    let (exporter, health_server) = side;
    let (serve, stop_tx) = serve;
    if let Some(e) = exporter {
        let linger = cfg.server.metrics_linger_secs;
        if matches!(outcome, Outcome::Finished) && linger > 0.0 {
            // counted before the line that tells a scraper the run has ended
            let seen = watcher.metrics.scrapes();
            tracing::info!(
                "shard {index}: the run has ended; /metrics stays up until it is scraped once more, so the final figures reach Prometheus (at most {linger} s, [server] metrics_linger_secs)"
            );
            if !watcher
                .metrics
                .linger_for_a_scrape(seen, Duration::from_secs_f64(linger))
                .await
            {
                tracing::warn!(
                    "shard {index}: /metrics was not scraped within {linger} s of the run's end ([server] metrics_linger_secs): the scraper has not seen the final figures"
                );
            }
        }
        e.abort();
    }
    if let Some(h) = health_server {
        h.abort();
    }
    let _ = stop_tx.send(());
    let mut serve = serve;
    let stopped = tokio::time::timeout(stop_wait, &mut serve).await;
    if stopped.is_err() {
        // connections of the state left behind must not answer for the next one
        serve.abort();
    }
    match stopped {
        Ok(Ok(Err(e))) => tracing::warn!("shard {index}: server error while stopping: {e}"),
        Err(_) => tracing::warn!(
            "shard {index}: connections still open after {} s; closing anyway",
            stop_wait.as_secs()
        ),
        _ => {}
    }
}

/// What shard `index` of `cfg` cannot do without the shard credential (`has_credential`),
/// refused before it listens, with the step that fixes it: with several shards, `[optimizer]
/// clip_norm` (the shards exchange gradient norms through shard 0 every step) and `--recover`
/// (`recover`: the replacement orders every shard to roll back).
pub fn needs_shard_credential(
    cfg: &Config,
    index: usize,
    has_credential: bool,
    recover: bool,
) -> Result<(), StartRefused> {
    let needs = if has_credential || cfg.num_shards() < 2 {
        None
    } else if cfg.clip_norm.is_some() {
        Some(format!(
            "[optimizer] clip_norm over {} shards (the shards exchange gradient norms every step)",
            cfg.num_shards()
        ))
    } else if recover {
        Some("--recover (the replacement orders the other shards to roll back)".to_string())
    } else {
        None
    };
    match needs {
        None => Ok(()),
        Some(what) => Err(StartRefused::NoShardCredential { index, what }),
    }
}

/// Whether shard `index` may serve on `bound`: outside loopback, a shard with no credential at
/// all (neither the workers' `[cluster] token_file` nor a shard credential) would let anyone who
/// can reach the port register, push, read the weights and order rollbacks, so it refuses to
/// start (the error says what to set) unless `[server] allow_unauthenticated = true`. Ok holds
/// the warning to log, if any: the opt-out taken, or a port with a shard credential but no
/// workers' token.
pub fn check_exposure(
    cfg: &Config,
    index: usize,
    bound: std::net::SocketAddr,
    shard_credential: bool,
) -> Result<Option<String>, StartRefused> {
    // a token without a shard credential is safe: the shard refuses every shard-to-shard call
    if bound.ip().is_loopback() || cfg.cluster.token.is_some() {
        return Ok(None);
    }
    if shard_credential {
        return Ok(Some(format!(
            "shard {index} listens on {bound}, outside loopback, without a token: anyone who can reach this port can register, push gradients and read the weights; set [cluster] token_file (and TLS: tls_cert, tls_key, tls_ca)"
        )));
    }
    if cfg.server.allow_unauthenticated {
        return Ok(Some(format!(
            "shard {index} listens on {bound}, outside loopback, WITHOUT ANY CREDENTIAL ([server] allow_unauthenticated = true): anyone who can reach this port can register, push gradients, read the weights and stop or roll back the run"
        )));
    }
    Err(StartRefused::Unauthenticated { index, bound })
}

/// Why a shard refuses to start ([`needs_shard_credential`], [`check_exposure`]); the message
/// says what to set.
#[derive(Debug, thiserror::Error)]
pub enum StartRefused {
    /// Something the config asks for needs the shard credential, and none is set.
    #[error(
        "shard {index}: {what} needs the shard credential, and none is set ([server] shard_token_file, or {env}): run `ps-server credentials --dir DIR` once for the run, copy DIR to every host, and put the lines it prints in the config (ps-launch makes its own; see deploy/README.md, \"Credentials\")",
        env = ps_net::auth::SHARD_TOKEN_ENV
    )]
    NoShardCredential {
        /// The shard.
        index: usize,
        /// What needs it.
        what: String,
    },
    /// The shard would listen outside loopback with no credential at all.
    #[error(
        "shard {index} would listen on {bound}, outside loopback, without any credential: anyone who can reach this port could register, push gradients, read the weights and stop or roll back the run. Set [cluster] token_file (the workers' token, e.g. `openssl rand -hex 32 > token`) and a shard credential ([server] shard_token_file or PS_SHARD_TOKEN; ps-launch, the Slurm recipe and the Kubernetes manifests set one), or listen on loopback (--listen 127.0.0.1:PORT); on a network where every host is trusted, [server] allow_unauthenticated = true (or --set server.allow_unauthenticated=true) starts it anyway"
    )]
    Unauthenticated {
        /// The shard.
        index: usize,
        /// The address it would listen on.
        bound: std::net::SocketAddr,
    },
}

/// Checks that the output directory (final weights, metrics) and, when the run writes
/// checkpoints, the checkpoint directory can be written: each is created if missing and a probe
/// file is written and removed. `ps-server` calls it before listening, so that a run that
/// could not save its results never starts (and a launcher never sees such a shard ready).
pub fn check_output_dirs(cfg: &Config) -> anyhow::Result<()> {
    let mut dirs = vec![("[server] out_dir", cfg.server.out_dir.clone())];
    if cfg.checkpoint.every > 0 {
        dirs.push(("[checkpoint] dir", cfg.checkpoint_dir()));
    }
    for (what, dir) in dirs {
        check_writable(&dir).with_context(|| {
            format!(
                "{what} {} is not writable: the run could not save its results",
                dir.display()
            )
        })?;
    }
    Ok(())
}

fn check_writable(dir: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(
        ".ps-write-check-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let written = std::fs::File::create(&probe).and_then(|mut f| {
        f.write_all(b"probe")?;
        f.sync_all()
    });
    let _ = std::fs::remove_file(&probe);
    written
}

/// The state shard `index` resumes from: the newest version of which every shard has an
/// intact checkpoint (its checksum verified) in the config's checkpoint directory, the
/// versions skipped named at WARN; the error says what is missing or wrong.
pub fn load_checkpoint(cfg: &Config, index: usize, train_len: usize) -> anyhow::Result<Saved> {
    load_checkpoint_of(cfg, index, train_len, None)
}

/// [`load_checkpoint`] of run `from` (`--resume-from RUN`), instead of this run's own (the
/// config's `[cluster] run_id`); a checkpoint of any other run is refused, naming both.
pub fn load_checkpoint_of(
    cfg: &Config,
    index: usize,
    train_len: usize,
    from: Option<&str>,
) -> anyhow::Result<Saved> {
    let total_steps = cfg.total_steps(train_len)?;
    let dir = cfg.checkpoint_dir();
    let s = cfg.num_shards();
    let (version, skipped) = checkpoint::latest_intact_common(&dir, s);
    let version = version.ok_or_else(|| {
        if !skipped.is_empty() {
            anyhow::anyhow!(
                "--resume: no version that all {s} shards have an intact checkpoint of in {}: {}",
                dir.display(),
                skipped.join("; ")
            )
        } else if checkpoint::any_checkpoint(&dir) {
            anyhow::anyhow!(
                "--resume: no version that all {s} shards have a checkpoint of in {} ({}; files of another shard count do not count)",
                dir.display(),
                checkpoint::describe_versions(&dir, s)
            )
        } else {
            anyhow::anyhow!(
                "--resume: no version that all {s} shards have a checkpoint of in {}: it holds no checkpoint (expected files shard-<i>-of-{s}-v<version>.safetensors; a run writes them when [checkpoint] every is set)",
                dir.display()
            )
        }
    })?;
    if !skipped.is_empty() {
        tracing::warn!(
            "shard {index}: --resume: the newest version every shard holds intact is {version}; skipped: {}",
            skipped.join("; ")
        );
    }
    if version > total_steps {
        anyhow::bail!(
            "--resume: the checkpoints in {} are at version {version}, past the end of this run ({total_steps} steps)",
            dir.display()
        );
    }
    let range = Shard::range_of(cfg, index);
    let fresh = cfg.optimizer.init_state(range.len());
    let mut id = Identity::of(cfg, index, range);
    if let Some(run) = from {
        id.run_id = (!run.is_empty()).then(|| run.to_string());
    }
    let saved = checkpoint::read(&dir, &id, version, &fresh)
        .map_err(|e| anyhow::anyhow!("--resume: {e}"))?;
    tracing::info!(
        "shard {index}: resuming at version {version} from {}",
        checkpoint::file(&dir, index, s, version).display()
    );
    Ok(saved)
}

/// Preemption: checkpoints at the version the shard is at and at the next step boundary
/// (bounded by [`PREEMPT_GRACE`]); a run already at its end finishes as usual instead.
async fn preempted(cfg: &Config, svc: &ShardService) -> Outcome {
    let shard = &svc.shard;
    if shard.version() >= shard.total_steps {
        return watch_run(cfg, svc).await;
    }
    let at = shard.request_preempt();
    tracing::warn!(
        "shard {}: preempted (SIGTERM or SIGUSR1) at version {at}: writing a checkpoint at the next step boundary, then stopping",
        shard.index
    );
    let mut saved = shard.preempt_saved();
    let next = at + 1;
    let _ = tokio::time::timeout(
        PREEMPT_GRACE,
        saved.wait_for(|v| v.is_some_and(|v| v >= next)),
    )
    .await;
    // what the shard says it stopped at stays its newest checkpoint
    let v = shard.close_preempt();
    if v.is_none_or(|v| v < next) {
        tracing::warn!(
            "shard {}: version {next} not reached within {} s of the preemption (the workers stopped)",
            shard.index,
            PREEMPT_GRACE.as_secs()
        );
    }
    Outcome::Preempted { saved: v }
}

/// Waits for the end of the run while acting on the barrier's verdicts (log the missing
/// ranks, fail the run, or go on without them), then writes the final weights and waits
/// (bounded) for the workers to leave. A run the shard failed (an update refused) ends here too.
async fn watch_run(cfg: &Config, svc: &ShardService) -> Outcome {
    match watch_barrier(cfg, svc).await {
        Outcome::Finished => {}
        ended => return ended,
    }
    match write_final(cfg, &svc.shard) {
        Outcome::Finished => {}
        failed => return failed,
    }
    close_run(cfg, svc).await;
    Outcome::Finished
}

/// Acts on the barrier's verdicts until the last step is applied (`Finished`), or the run
/// fails (a barrier past `barrier_timeout_secs`, a failed update).
async fn watch_barrier(cfg: &Config, svc: &ShardService) -> Outcome {
    let shard = &svc.shard;
    let mut versions = shard.subscribe();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while shard.version() < shard.total_steps {
        if let Some(why) = shard.failure() {
            return Outcome::Failed(why);
        }
        tokio::select! {
            _ = versions.changed() => {}
            _ = tick.tick() => match shard.poll_barrier(Instant::now()) {
                Verdict::Idle | Verdict::Waiting { warn: false, .. } | Verdict::Unjoined { warn: false, .. } => {}
                Verdict::Unjoined { step, waited, bound, .. } => tracing::info!(
                    "shard {} step {step}: waiting {:.1} s for the workers to register (0 of {} ranks registered); the barrier clock starts at the first, and the run fails if none has registered after {:.1} s ([worker] connect_timeout_secs + [server] barrier_timeout_secs)",
                    shard.index,
                    waited.as_secs_f64(),
                    shard.world,
                    bound.as_secs_f64()
                ),
                Verdict::NoWorker { step, waited } => {
                    return Outcome::Failed(format!(
                        "step {step}: no worker registered within {:.1} s of the shard's start (0 of {} ranks registered; the bound is [worker] connect_timeout_secs + [server] barrier_timeout_secs = {} + {} s)",
                        waited.as_secs_f64(),
                        shard.world,
                        cfg.worker.connect_timeout_secs,
                        cfg.server.barrier_timeout_secs
                    ));
                }
                Verdict::Waiting { step, missing, waited, warn: true, .. } if !missing.is_empty() => tracing::warn!(
                    "shard {} step {step}: waiting {:.1} s for ranks {missing:?} ({} of {} in)",
                    shard.index,
                    waited.as_secs_f64(),
                    shard.world - missing.len(),
                    shard.world
                ),
                // past barrier_warn_secs, a rank whose push started but does not finish (a
                // partitioned or slow link, any transport) is named at WARN
                Verdict::Waiting { step, awaited: Some(rank), queued, waited, warn: true, .. } => tracing::warn!(
                    "shard {} step {step}: waiting {:.1} s for rank {rank}, whose gradient has started to arrive but not finished (a slow or broken link?); ranks {queued:?} queued behind it ({} of {} gradient buffers held, max_pending_gradients)",
                    shard.index,
                    waited.as_secs_f64(),
                    shard.buffers_held(),
                    cfg.server.max_pending_gradients
                ),
                Verdict::Waiting { step, awaited, queued, waited, .. } => tracing::info!(
                    "shard {} step {step}: {:.1} s; every rank's push is in or under way: receiving rank {}'s gradient, ranks {queued:?} queued ({} of {} gradient buffers held, max_pending_gradients)",
                    shard.index,
                    waited.as_secs_f64(),
                    awaited.map_or("-".to_string(), |a| a.to_string()),
                    shard.buffers_held(),
                    cfg.server.max_pending_gradients
                ),
                Verdict::Fail { step, missing, waited } => {
                    return Outcome::Failed(format!(
                        "step {step}: no gradient from ranks {missing:?} after {:.1} s (barrier_timeout_secs = {})",
                        waited.as_secs_f64(),
                        cfg.server.barrier_timeout_secs
                    ));
                }
                Verdict::Continue { step, slots, left_out, waited } => {
                    tracing::warn!(
                        "shard {} step {step}: no gradient from ranks {left_out:?} after {:.1} s: going on with the {} that pushed (barrier_policy = \"continue\"); they are not waited for until they come back, and the run no longer equals one process",
                        shard.index,
                        waited.as_secs_f64(),
                        slots.len()
                    );
                    if let Err(e) = svc.complete_step(slots).await {
                        return Outcome::Failed(e.to_string());
                    }
                }
            },
        }
    }
    Outcome::Finished
}

/// Writes the final weights (and the model's buffers) into `[server] out_dir`; `Failed` when
/// it cannot.
fn write_final(cfg: &Config, shard: &Shard) -> Outcome {
    let (version, params) = match shard.params() {
        Ok(p) => p,
        Err(e) => return Outcome::Failed(format!("cannot read the final weights: {e}")),
    };
    match ps_model::weights::write_shard(
        &cfg.server.out_dir,
        shard.index,
        shard.range.clone(),
        version,
        &params,
    ) {
        Ok(p) => tracing::info!(
            "shard {}: final weights (version {version}) written to {}",
            shard.index,
            p.display()
        ),
        Err(e) => return Outcome::Failed(format!("cannot write the final weights: {e}")),
    }
    if let Some(buffers) = shard.current_buffers() {
        let path = ps_model::weights::buffers_file(&cfg.server.out_dir);
        let tmp = path.with_extension("safetensors.tmp");
        match std::fs::write(&tmp, &buffers).and_then(|()| std::fs::rename(&tmp, &path)) {
            Ok(()) => tracing::info!(
                "shard {}: the model's buffers (version {version}) written to {}",
                shard.index,
                path.display()
            ),
            Err(e) => {
                return Outcome::Failed(format!(
                    "cannot write the final buffers to {}: {e}",
                    path.display()
                ));
            }
        }
    }
    Outcome::Finished
}

/// The run's end once its weights are written: waits for the workers to leave (each rank at
/// most `[server] linger_secs` after the later of the run's end and its last word, `linger`),
/// flushes the step lines, and on shard 0 logs and records the final test evaluation.
async fn close_run(cfg: &Config, svc: &ShardService) {
    let (shard, all_left, reporter) = (&svc.shard, &*svc.all_left, &svc.reporter);
    let linger = Duration::from_secs_f64(cfg.server.linger_secs);
    let t0 = std::time::Instant::now();
    let left = all_left.wait(linger, || shard.final_eval().1).await;
    if left.is_ok() {
        tracing::info!(
            "shard {}: every rank left {:.2} s after the last step",
            shard.index,
            t0.elapsed().as_secs_f64()
        );
    }
    // every step's line is out (or sent to shard 0) before the closing line
    reporter.flush().await;
    let ((correct, count), missing) = shard.final_eval();
    if left.is_err() {
        tracing::warn!(
            "shard {}: ranks {missing:?} did not leave within {} s of the last step or of their last word ([server] linger_secs): the final evaluation counts {count} test samples",
            shard.index,
            linger.as_secs_f64()
        );
    }
    if count > 0 {
        // every shard's /metrics says the final figure (each rank reports it to every shard)
        svc.metrics
            .final_test_accuracy(correct as f64 / count as f64);
    }
    if shard.index == 0 && count > 0 {
        tracing::info!(
            "training finished: {} steps; final test accuracy {:.2}% ({correct}/{count})",
            shard.total_steps,
            100.0 * correct as f64 / count as f64
        );
        let metrics = cfg.server.out_dir.join("metrics.jsonl");
        if let Err(e) = report::append_final_eval(&metrics, shard.total_steps, correct, count) {
            tracing::warn!(
                "cannot append the final evaluation to {}: {e}",
                metrics.display()
            );
        }
        reporter
            .final_eval(shard.total_steps, correct as f64 / count as f64)
            .await;
    } else if shard.index == 0 {
        tracing::info!("training finished: {} steps", shard.total_steps);
    }
}

/// Loads and checks the config (with the command line's `overrides`) and the training set a
/// shard needs; the error names the file.
pub fn load_setup(
    config: &std::path::Path,
    index: usize,
    shard0: Option<String>,
    overrides: &ps_config::Overrides,
) -> anyhow::Result<ShardSetup> {
    let cfg = Config::load_with(config, overrides)?;
    if index >= cfg.num_shards() {
        anyhow::bail!(
            "--shard {index}: expected a shard index in 0..{} ({} lists {} servers)",
            cfg.num_shards(),
            config.display(),
            cfg.num_shards()
        );
    }
    // where the data directory came from, for an error a person can act on
    let given = overrides
        .sets
        .iter()
        .rev()
        .find(|s| s.key == "data.dir")
        .map(|s| s.source.clone());
    let data_dir = match (&overrides.data_dir, given) {
        (Some(_), _) => format!("[data] dir = {} (from --data-dir)", cfg.data.dir.display()),
        (None, Some(source)) => format!("[data] dir = {} (from {source})", cfg.data.dir.display()),
        (None, None) => format!(
            "[data] dir = {} (in {}; a relative dir is taken from the config file's directory)",
            cfg.data.dir.display(),
            config.display()
        ),
    };
    // the shard needs the number of samples (the data order) but not the images; a declared
    // model's workers may bring their own data ([data] train_len), and their evaluation is
    // theirs too (any test set, any length: no test slices to check)
    let (train_len, test_len) = match cfg.data.train_len {
        Some(n) => (n, None),
        None => idx_lengths(&cfg, &data_dir)?,
    };
    let shard0 = shard0.or_else(|| (index > 0).then(|| cfg.cluster.servers[0].clone()));
    let cfg_metrics = cfg.server.metrics_addrs.get(index).cloned();
    Ok(ShardSetup {
        train_len,
        test_len,
        cfg,
        index,
        shard0,
        resume_from: None,
        metrics_listen: cfg_metrics,
        health_listen: None,
    })
}

/// The training set's length from the IDX directory's header, and, for the built-in model, the
/// test set's (each rank evaluates its slice of it). A declared model's evaluation is the
/// user's own (any test set, any length): no test length to check it against. `data_dir` says
/// where the directory came from, for the error.
fn idx_lengths(cfg: &Config, data_dir: &str) -> anyhow::Result<(usize, Option<usize>)> {
    // a declared model's labels are the user's business: any byte is a label
    let classes = match cfg.model.declared {
        Some(_) => 256,
        None => cfg.model.dims[cfg.model.dims.len() - 1],
    };
    let (train_len, features) =
        ps_data::idx::split_shape(&cfg.data.dir, ps_data::idx::Split::Train, classes)
            .with_context(|| {
                format!("reading the training set's labels and header of {data_dir}")
            })?;
    if cfg.model.declared.is_some() {
        return Ok((train_len, None));
    }
    if features != cfg.model.dims[0] {
        anyhow::bail!(
            "{}: images have {features} pixels but [model] inputs = {}",
            cfg.data.dir.display(),
            cfg.model.dims[0]
        );
    }
    let (test_len, _) =
        ps_data::idx::split_shape(&cfg.data.dir, ps_data::idx::Split::Test, classes)
            .with_context(|| format!("reading the test set's labels and header of {data_dir}"))?;
    Ok((train_len, Some(test_len)))
}
