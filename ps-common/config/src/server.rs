//! `[server]`, `[worker]` and `[checkpoint]`: per-process settings.

use super::Resolve;
use super::kinds::BarrierPolicy;
use super::limits::{MAX_CHECKPOINT_FAILURES, MAX_KEEP, MAX_STEPS, MAX_THREADS, at_most, secs};
use crate::error::Invalid;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawServer {
    pub out_dir: PathBuf,
    /// Set by a command-line override: taken as given, not relative to the file.
    #[serde(skip)]
    pub out_dir_as_given: bool,
    pub barrier_warn_secs: f64,
    pub barrier_timeout_secs: f64,
    pub pull_timeout_secs: f64,
    pub linger_secs: f64,
    pub chunk_bytes: usize,
    pub metrics_addrs: Vec<String>,
    pub metrics_linger_secs: f64,
    pub barrier_policy: BarrierPolicy,
    pub max_pending_gradients: usize,
    pub stream_idle_secs: f64,
    pub keepalive_secs: f64,
    pub handshake_timeout_secs: f64,
    pub max_streams_per_connection: usize,
    pub max_connections: usize,
    pub stream_window_bytes: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard_token_file: Option<PathBuf>,
    pub data_connections: bool,
    pub data_port_offset: u32,
    pub allow_unauthenticated: bool,
}

/// The default of `[server] max_pending_gradients`.
pub const DEFAULT_MAX_PENDING_GRADIENTS: usize = 2;
/// Most gRPC gradients a shard may hold at once (`[server] max_pending_gradients`).
pub const MAX_PENDING_GRADIENTS: usize = super::limits::MAX_WORKERS;
/// Most concurrent streams per connection (`[server] max_streams_per_connection`).
pub const MAX_STREAMS_PER_CONNECTION: usize = 1 << 16;
/// Most connections per shard (`[server] max_connections`).
pub const MAX_CONNECTIONS: usize = 1 << 20;
/// Smallest and largest HTTP/2 stream window of a shard (`[server] stream_window_bytes`).
pub const MIN_STREAM_WINDOW_BYTES: usize = 65_535;
/// See [`MIN_STREAM_WINDOW_BYTES`].
pub const MAX_STREAM_WINDOW_BYTES: usize = 64 << 20;

impl Default for RawServer {
    fn default() -> Self {
        Self {
            out_dir: PathBuf::from("runs/default"),
            out_dir_as_given: false,
            barrier_warn_secs: 5.0,
            barrier_timeout_secs: 300.0,
            pull_timeout_secs: 600.0,
            linger_secs: 30.0,
            chunk_bytes: crate::limits::DEFAULT_CHUNK_BYTES,
            metrics_addrs: Vec::new(),
            metrics_linger_secs: 0.0,
            barrier_policy: BarrierPolicy::Fail,
            max_pending_gradients: DEFAULT_MAX_PENDING_GRADIENTS,
            stream_idle_secs: 60.0,
            keepalive_secs: 30.0,
            handshake_timeout_secs: 10.0,
            max_streams_per_connection: 64,
            max_connections: 4 * super::limits::MAX_WORKERS,
            stream_window_bytes: 256 << 10,
            shard_token_file: None,
            data_connections: true,
            data_port_offset: 0,
            allow_unauthenticated: false,
        }
    }
}

/// Per-shard server settings (`[server]`).
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// Where shards write final weights and the metrics file.
    pub out_dir: PathBuf,
    /// After this long with some but not all gradients of a step in, log the missing ranks.
    pub barrier_warn_secs: f64,
    /// After this long, fail the run loudly (the barrier policy).
    pub barrier_timeout_secs: f64,
    /// Longest a pull waits for its version.
    pub pull_timeout_secs: f64,
    /// After the last step, how long a shard waits for every worker to leave.
    pub linger_secs: f64,
    /// Payload bytes per streamed chunk.
    pub chunk_bytes: usize,
    /// Where shard `i` serves Prometheus metrics (`GET /metrics`): none, or one per shard.
    pub metrics_addrs: Vec<String>,
    /// After the run, how long a shard that serves `/metrics` keeps serving it until the
    /// first scrape since the end (so the final version, loss and accuracy reach the scraper;
    /// set it to the scrape interval or more); 0: it stops with the run.
    pub metrics_linger_secs: f64,
    /// What a shard does when a step's barrier times out.
    pub barrier_policy: BarrierPolicy,
    /// Most gRPC gradients (shard-sized receive buffers) a shard holds at once; pushes beyond
    /// wait under HTTP/2 flow control. With the accumulator, the shard's receive memory is
    /// `(max_pending_gradients + 1) x` its slice.
    pub max_pending_gradients: usize,
    /// A push or pull stream that makes no progress for this long is ended with a status.
    pub stream_idle_secs: f64,
    /// HTTP/2 keepalive: a ping after this long without traffic; no answer within it closes
    /// the connection.
    pub keepalive_secs: f64,
    /// A new connection that has not completed the HTTP/2 preface (or, with TLS, the TLS
    /// handshake) this long after it was accepted is closed.
    pub handshake_timeout_secs: f64,
    /// Most concurrent streams (calls) per connection.
    pub max_streams_per_connection: usize,
    /// Most open connections per shard; more are closed at once.
    pub max_connections: usize,
    /// HTTP/2 stream window the shard grants: what a sender may have in flight on a stream
    /// the shard has not read yet (a push waiting for its turn).
    pub stream_window_bytes: usize,
    /// The file holding the token shards present on their step reports to shard 0; only
    /// shards read it (workers need not have it). None: reports are checked but not
    /// authenticated.
    pub shard_token_file: Option<PathBuf>,
    /// Tensor values move on a plain TCP data connection per shard beside gRPC (without TLS
    /// only); false: every value goes through gRPC.
    pub data_connections: bool,
    /// Where a shard listens for data connections: 0, a free port chosen at start (told to
    /// workers at registration); N, the shard's gRPC port + N (for firewalls that open known
    /// ports only).
    pub data_port_offset: u32,
    /// A shard that listens outside loopback with no credential at all (neither `[cluster]
    /// token_file` nor a shard credential) refuses to start unless this is true (then it
    /// warns loudly): only for a network where every host that can reach it is trusted.
    pub allow_unauthenticated: bool,
}

impl RawServer {
    pub(super) fn validate(&self, resolve: &Resolve) -> Result<ServerConfig, Invalid> {
        for (key, v) in [
            ("[server] barrier_warn_secs", self.barrier_warn_secs),
            ("[server] barrier_timeout_secs", self.barrier_timeout_secs),
            ("[server] pull_timeout_secs", self.pull_timeout_secs),
            ("[server] linger_secs", self.linger_secs),
        ] {
            secs(key, v)?;
        }
        // 0: no linger
        if self.metrics_linger_secs != 0.0 {
            secs("[server] metrics_linger_secs", self.metrics_linger_secs)?;
        }
        secs("[server] stream_idle_secs", self.stream_idle_secs)?;
        secs("[server] keepalive_secs", self.keepalive_secs)?;
        secs(
            "[server] handshake_timeout_secs",
            self.handshake_timeout_secs,
        )?;
        for (key, v, max) in [
            (
                "[server] max_pending_gradients",
                self.max_pending_gradients,
                MAX_PENDING_GRADIENTS,
            ),
            (
                "[server] max_streams_per_connection",
                self.max_streams_per_connection,
                MAX_STREAMS_PER_CONNECTION,
            ),
            (
                "[server] max_connections",
                self.max_connections,
                MAX_CONNECTIONS,
            ),
        ] {
            if v == 0 {
                return Err(invalid!("{key} = 0: expected at least 1"));
            }
            at_most(key, v, max)?;
        }
        if !(MIN_STREAM_WINDOW_BYTES..=MAX_STREAM_WINDOW_BYTES).contains(&self.stream_window_bytes)
        {
            return Err(invalid!(
                "[server] stream_window_bytes = {}: expected {MIN_STREAM_WINDOW_BYTES} to {MAX_STREAM_WINDOW_BYTES}",
                self.stream_window_bytes
            ));
        }

        if self.data_port_offset > u32::from(u16::MAX) {
            return Err(invalid!(
                "[server] data_port_offset = {}: expected 0 (a free port) to 65535 (added to the shard's gRPC port)",
                self.data_port_offset
            ));
        }
        let max_chunk = crate::limits::MAX_MESSAGE_BYTES / 2;
        if !(1024..=max_chunk).contains(&self.chunk_bytes) {
            return Err(invalid!(
                "[server] chunk_bytes = {}: expected 1024 to {max_chunk}",
                self.chunk_bytes
            ));
        }
        Ok(ServerConfig {
            out_dir: if self.out_dir_as_given {
                self.out_dir.clone()
            } else {
                resolve.path(&self.out_dir)
            },
            barrier_warn_secs: self.barrier_warn_secs,
            barrier_timeout_secs: self.barrier_timeout_secs,
            pull_timeout_secs: self.pull_timeout_secs,
            linger_secs: self.linger_secs,
            chunk_bytes: self.chunk_bytes,
            metrics_addrs: self.metrics_addrs.clone(),
            metrics_linger_secs: self.metrics_linger_secs,
            barrier_policy: self.barrier_policy,
            max_pending_gradients: self.max_pending_gradients,
            stream_idle_secs: self.stream_idle_secs,
            keepalive_secs: self.keepalive_secs,
            handshake_timeout_secs: self.handshake_timeout_secs,
            max_streams_per_connection: self.max_streams_per_connection,
            max_connections: self.max_connections,
            stream_window_bytes: self.stream_window_bytes,
            shard_token_file: self.shard_token_file.as_deref().map(|f| resolve.path(f)),
            data_connections: self.data_connections,
            data_port_offset: self.data_port_offset,
            allow_unauthenticated: self.allow_unauthenticated,
        })
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawWorker {
    pub device: String,
    pub threads: usize,
    pub connect_timeout_secs: f64,
    pub deadline_margin_secs: f64,
}

impl Default for RawWorker {
    fn default() -> Self {
        Self {
            device: "cpu".into(),
            threads: 0,
            connect_timeout_secs: 60.0,
            deadline_margin_secs: 30.0,
        }
    }
}

/// Per-worker settings (`[worker]`).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// `cpu`, `cuda`, `cuda:N` or `auto`.
    pub device: String,
    /// Compute threads per worker; 0 = the cores available divided among the workers.
    pub threads: usize,
    /// How long a worker keeps retrying to reach a shard.
    pub connect_timeout_secs: f64,
    /// What a worker's call deadline allows beyond the longest a live shard holds a call
    /// (`ps_net::client::call_deadline`): a call unanswered that much longer has a shard that
    /// stopped answering.
    pub deadline_margin_secs: f64,
}

impl RawWorker {
    pub(super) fn validate(&self) -> Result<WorkerConfig, Invalid> {
        let device_ok = matches!(self.device.as_str(), "cpu" | "cuda" | "auto")
            || self
                .device
                .strip_prefix("cuda:")
                .is_some_and(|n| n.parse::<usize>().is_ok());
        if !device_ok {
            return Err(invalid!(
                "[worker] device = {:?}: expected \"cpu\", \"cuda\", \"cuda:N\" or \"auto\"",
                self.device
            ));
        }
        at_most("[worker] threads", self.threads, MAX_THREADS)?;
        secs("[worker] connect_timeout_secs", self.connect_timeout_secs)?;
        secs("[worker] deadline_margin_secs", self.deadline_margin_secs)?;
        Ok(WorkerConfig {
            device: self.device.clone(),
            threads: self.threads,
            connect_timeout_secs: self.connect_timeout_secs,
            deadline_margin_secs: self.deadline_margin_secs,
        })
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawCheckpoint {
    pub every: u64,
    pub keep: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    pub max_failures: u32,
}

impl Default for RawCheckpoint {
    fn default() -> Self {
        Self {
            every: 0,
            keep: 2,
            dir: None,
            max_failures: 3,
        }
    }
}

/// Checkpoints: every shard writes its parameters and optimizer state every `every` steps.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointConfig {
    /// Steps between checkpoints; 0 writes none (the final weights are always written).
    pub every: u64,
    /// Checkpoints kept per shard (older ones are deleted once a newer one is complete).
    pub keep: usize,
    /// Where they go; None: `<out_dir>/checkpoints` (following an `--out-dir` override).
    pub dir: Option<PathBuf>,
    /// Consecutive checkpoints that may fail (each write retried once) before the run fails.
    pub max_failures: u32,
}

impl RawCheckpoint {
    pub(super) fn validate(&self, resolve: &Resolve) -> Result<CheckpointConfig, Invalid> {
        if self.keep == 0 {
            return Err(
                "[checkpoint] keep = 0: expected at least 1 (the newest checkpoint is what a resume needs)"
                    .into(),
            );
        }
        at_most("[checkpoint] keep", self.keep, MAX_KEEP)?;
        at_most("[checkpoint] every", self.every, MAX_STEPS)?;
        if self.max_failures == 0 {
            return Err(
                "[checkpoint] max_failures = 0: expected at least 1 (consecutive failed checkpoints before the run fails)"
                    .into(),
            );
        }
        at_most(
            "[checkpoint] max_failures",
            self.max_failures,
            MAX_CHECKPOINT_FAILURES,
        )?;
        Ok(CheckpointConfig {
            every: self.every,
            keep: self.keep,
            dir: self.dir.as_deref().map(|d| resolve.path(d)),
            max_failures: self.max_failures,
        })
    }
}
