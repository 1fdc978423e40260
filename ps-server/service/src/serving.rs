//! What a generation serves and how it stops: the gRPC port ([`start_serving`]), the side
//! servers (`/metrics`, the plaintext health port: [`serve_side`]), and their stop
//! ([`stop_serving`]).

use crate::service::{self, ShardService};
use crate::{Outcome, accept, exporter, partial};
use anyhow::Context;
use ps_config::Config;
use ps_net::wire::MAX_MESSAGE_BYTES;
use ps_proto::pb::parameter_server_server::ParameterServerServer;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Serves `/metrics` on `addr` in a task. After a rollback (`generation` > 0) the previous
/// state's exporter may still hold the port a moment: binding is retried for up to 3 s.
pub(crate) async fn serve_metrics(
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
pub(crate) async fn serve_health(
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
pub(crate) type SideServers = (
    Option<tokio::task::JoinHandle<()>>,
    Option<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>>,
);

/// The gRPC server's task and the sender that stops it ([`start_serving`]).
pub(crate) type Serving = (
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    tokio::sync::oneshot::Sender<()>,
);

/// Starts the side servers of a generation: `/metrics` on `metrics.0` (serving `metrics.1`),
/// health on `health.0` (serving `health.1`).
pub(crate) async fn serve_side(
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

/// Starts serving gRPC on `listener` in a task (the shard service and health, in the memory
/// budget of partial messages, behind the token check, with TLS when configured) until the
/// sender returned is used or dropped.
pub(crate) fn start_serving(
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

/// Stops the side servers (`/metrics` once scraped after a finished run, within `[server]
/// metrics_linger_secs`; health) and the gRPC server, waiting `stop_wait` for its connections.
pub(crate) async fn stop_serving(
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
