//! A generation's set-up before it serves: the shard (fresh or from a checkpoint), its figures,
//! reporter and gradient-norm exchange ([`open_shard`]), then the gRPC service over it with its
//! peers, leases and tensor data connections ([`build_service`]).

use crate::checkpoint::Saved;
use crate::report::{self, Reporter, ReporterConfig};
use crate::service::ShardService;
use crate::shard::{self, Shard};
use crate::{accept, clip, data, exporter, lease, linger, memory, peers, recovery};
use anyhow::Context;
use ps_config::Config;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// The gRPC service of a shard `opened` (shard `index` of `cfg`, with a test set of
/// `test_len` samples): its peers, its leases, its data connection on `listener`'s host.
pub(crate) async fn build_service(
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

/// What a generation's set-up opens before it serves ([`open_shard`]).
pub(crate) struct Opened {
    pub(crate) total_steps: u64,
    pub(crate) shard_token: Option<ps_config::credential::Token>,
    pub(crate) shard: Arc<Shard>,
    pub(crate) metrics: Arc<exporter::Metrics>,
    pub(crate) reporter: Reporter,
    /// Shard 0's gatherer of the gradient norms (`[optimizer] clip_norm` over several shards).
    pub(crate) clip_hub: Option<Arc<clip::Hub>>,
}

/// The set-up of a generation's state: the steps, the shard credential, the shard (from the
/// checkpoint to resume, whose later step lines shard 0 trims from `metrics.jsonl`), its
/// figures and reporter, the gradient-norm exchange of `[optimizer] clip_norm`, and the
/// memory plan (logged) and descriptor limit it runs with.
pub(crate) fn open_shard(
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
pub(crate) async fn serve_data(
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
pub(crate) fn max_streams(cfg: &Config, index: usize) -> usize {
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
