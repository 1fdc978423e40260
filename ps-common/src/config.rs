//! The one TOML file that describes a cluster and a run. A private `Raw*` layer mirrors the
//! file (unknown keys are errors); [`Config::load`] validates it into [`Config`], and every
//! error names the file, the key and what was expected. Relative paths in the file are taken
//! relative to the file's own directory.
//!
//! It also answers the question users come with: which single-process run a configuration
//! is equivalent to ([`Config::equivalence`]).

use crate::layout::{MlpLayout, split_even};
use crate::optim::{Decay, LrSchedule, Optimizer};
use serde::Deserialize;
use std::fmt;
use std::path::{Path, PathBuf};

/// A config error: the file and what is wrong, in one line.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct ConfigError {
    /// The config file.
    pub file: PathBuf,
    /// What is wrong, naming the key.
    pub message: String,
}

/// How a worker reduces the per-sample losses of its slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossReduction {
    /// `g_r = (1/b_r) Σ ∇ℓ_i`
    Mean,
    /// `g_r = Σ ∇ℓ_i`
    Sum,
}

/// How tensors travel between workers and shards (`[cluster] transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Tensors through shared memory (`/dev/shm`) when worker and shard share a host, verified
    /// at registration; through gRPC otherwise. Control messages always go through gRPC.
    Auto,
    /// Every tensor through gRPC.
    Grpc,
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transport::Auto => "auto (shared memory on one host, else gRPC)",
            Transport::Grpc => "gRPC",
        })
    }
}

/// How a shard combines the workers' gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Aggregation {
    /// `G = Σ_r g_r`
    Sum,
    /// `G = (1/W) Σ_r g_r`
    Mean,
    /// `G = Σ_r b_r g_r / Σ_r b_r`
    Weighted,
}

impl fmt::Display for LossReduction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReduction::Mean => "mean",
            LossReduction::Sum => "sum",
        })
    }
}

impl fmt::Display for Aggregation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Aggregation::Sum => "sum",
            Aggregation::Mean => "mean",
            Aggregation::Weighted => "weighted",
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    cluster: RawCluster,
    #[serde(default)]
    model: RawModel,
    data: RawData,
    train: RawTrain,
    optimizer: RawOptimizer,
    #[serde(default)]
    schedule: RawSchedule,
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    worker: RawWorker,
    #[serde(default)]
    checkpoint: RawCheckpoint,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawCheckpoint {
    every: u64,
    keep: usize,
    dir: Option<PathBuf>,
}

impl Default for RawCheckpoint {
    fn default() -> Self {
        Self {
            every: 0,
            keep: 2,
            dir: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    servers: Vec<String>,
    workers: u32,
    #[serde(default = "default_transport")]
    transport: String,
    token_file: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_ca: Option<PathBuf>,
    tls_domain: Option<String>,
}

fn default_transport() -> String {
    "auto".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawModel {
    hidden: Vec<usize>,
    inputs: usize,
    classes: usize,
}

impl Default for RawModel {
    fn default() -> Self {
        Self {
            hidden: vec![256, 128],
            inputs: 784,
            classes: 10,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawData {
    dir: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrain {
    #[serde(default)]
    seed: u64,
    global_batch: Option<usize>,
    per_worker_batch: Option<usize>,
    steps: Option<u64>,
    epochs: Option<u64>,
    #[serde(default)]
    keep_last: bool,
    loss_reduction: LossReduction,
    aggregation: Aggregation,
    #[serde(default = "default_log_every")]
    log_every: u64,
    #[serde(default)]
    eval_every: u64,
}

fn default_log_every() -> u64 {
    10
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOptimizer {
    kind: String,
    lr: f64,
    #[serde(default)]
    momentum: f32,
    #[serde(default)]
    nesterov: bool,
    #[serde(default)]
    weight_decay: f32,
    #[serde(default = "default_beta1")]
    beta1: f32,
    #[serde(default = "default_beta2")]
    beta2: f32,
    #[serde(default = "default_eps")]
    eps: f32,
}

fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.999
}
fn default_eps() -> f32 {
    1e-8
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSchedule {
    #[serde(default = "default_schedule_kind")]
    kind: String,
    #[serde(default)]
    warmup_steps: u64,
    step_size: Option<u64>,
    gamma: Option<f64>,
    #[serde(default)]
    min_lr: f64,
}

fn default_schedule_kind() -> String {
    "constant".into()
}

impl Default for RawSchedule {
    fn default() -> Self {
        Self {
            kind: default_schedule_kind(),
            warmup_steps: 0,
            step_size: None,
            gamma: None,
            min_lr: 0.0,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawServer {
    out_dir: PathBuf,
    barrier_warn_secs: f64,
    barrier_timeout_secs: f64,
    pull_timeout_secs: f64,
    linger_secs: f64,
    chunk_bytes: usize,
    metrics_addrs: Vec<String>,
    barrier_policy: String,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            out_dir: PathBuf::from("runs/default"),
            barrier_warn_secs: 5.0,
            barrier_timeout_secs: 300.0,
            pull_timeout_secs: 600.0,
            linger_secs: 30.0,
            chunk_bytes: crate::wire::DEFAULT_CHUNK_BYTES,
            metrics_addrs: Vec::new(),
            barrier_policy: "fail".into(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawWorker {
    device: String,
    threads: usize,
    connect_timeout_secs: f64,
}

impl Default for RawWorker {
    fn default() -> Self {
        Self {
            device: "cpu".into(),
            threads: 0,
            connect_timeout_secs: 60.0,
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
}

/// Per-shard server settings.
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
    /// What a shard does when a step's barrier times out.
    pub barrier_policy: BarrierPolicy,
}

/// What a shard does when a step's barrier times out (`[server] barrier_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarrierPolicy {
    /// Fail the run loudly (exit 1; waiting workers are told why).
    Fail,
    /// Apply the step with the ranks that pushed and stop waiting for the others until they
    /// register or push again (elastic membership; the run no longer equals one process).
    Continue,
}

/// Per-worker settings.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// `cpu`, `cuda`, `cuda:N` or `auto`.
    pub device: String,
    /// Compute threads per worker; 0 = the cores available divided among the workers.
    pub threads: usize,
    /// How long a worker keeps retrying to reach a shard.
    pub connect_timeout_secs: f64,
}

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file it came from.
    pub path: PathBuf,
    /// Shard addresses, shard `i` at `servers[i]`.
    pub servers: Vec<String>,
    /// How tensors travel between workers and shards.
    pub transport: Transport,
    /// The shared token every request must carry (`[cluster] token_file`), if any.
    pub token: Option<crate::auth::Token>,
    /// TLS between every process (`[cluster] tls_cert`, `tls_key`, `tls_ca`), if set.
    pub tls: Option<crate::auth::TlsFiles>,
    /// `W`.
    pub workers: usize,
    /// Model layer widths, input first.
    pub dims: Vec<usize>,
    /// Dataset directory (IDX files).
    pub data_dir: PathBuf,
    /// Seed of the data order and of the initial weights.
    pub seed: u64,
    /// `B`.
    pub global_batch: usize,
    /// Whether the config stated the per-worker batch (then `B = W * per_worker_batch`).
    pub batch_from_per_worker: bool,
    /// Stop after this many steps, or
    pub steps: Option<u64>,
    /// after this many epochs (exactly one of the two).
    pub epochs: Option<u64>,
    /// Keep the short last batch of each epoch.
    pub keep_last: bool,
    /// Worker loss reduction.
    pub loss_reduction: LossReduction,
    /// Shard aggregation.
    pub aggregation: Aggregation,
    /// Log every N steps (1 = every step).
    pub log_every: u64,
    /// Evaluate on the test set every N steps (0 = only at the end).
    pub eval_every: u64,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// The learning-rate schedule (base lr included).
    pub schedule: LrSchedule,
    /// Server settings.
    pub server: ServerConfig,
    /// Worker settings.
    pub worker: WorkerConfig,
    /// Checkpoint settings.
    pub checkpoint: CheckpointConfig,
}

impl Config {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.into(),
            message: format!("cannot read the config file: {e}"),
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates `text` as if read from `path` (relative paths resolve against its directory).
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let err = |message: String| ConfigError {
            file: path.into(),
            message,
        };
        let raw: RawConfig = toml::from_str(text).map_err(|e| err(one_line(&e.to_string())))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let resolve = |p: &Path| {
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                base.join(p)
            }
        };

        let c = &raw.cluster;
        if c.servers.is_empty() {
            return Err(err(
                "[cluster] servers = []: expected at least one shard address".into(),
            ));
        }
        for (i, s) in c.servers.iter().enumerate() {
            if s.parse::<std::net::SocketAddr>().is_err() && !s.contains(':') {
                return Err(err(format!(
                    "[cluster] servers[{i}] = {s:?}: expected host:port"
                )));
            }
        }
        let transport = match c.transport.as_str() {
            "auto" => Transport::Auto,
            "grpc" => Transport::Grpc,
            other => {
                return Err(err(format!(
                    "[cluster] transport = {other:?}: expected \"auto\" (shared memory between processes on one host, gRPC otherwise) or \"grpc\""
                )));
            }
        };
        let token = match &c.token_file {
            Some(f) => Some(
                crate::auth::Token::read(&resolve(f))
                    .map_err(|e| err(format!("[cluster] token_file: {e}")))?,
            ),
            None => None,
        };
        let tls = match (&c.tls_cert, &c.tls_key, &c.tls_ca) {
            (None, None, None) => {
                if c.tls_domain.is_some() {
                    return Err(err(
                        "[cluster] tls_domain without tls_cert, tls_key and tls_ca".into(),
                    ));
                }
                None
            }
            (Some(cert), Some(key), Some(ca)) => Some(
                crate::auth::TlsFiles::read(
                    &resolve(cert),
                    &resolve(key),
                    &resolve(ca),
                    c.tls_domain.clone(),
                )
                .map_err(|e| err(format!("[cluster] tls: {e}")))?,
            ),
            _ => {
                return Err(err(
                    "[cluster] tls_cert, tls_key, tls_ca: expected all three (every shard presents the certificate, every process checks it against the CA) or none".into(),
                ));
            }
        };
        if c.workers == 0 {
            return Err(err(
                "[cluster] workers = 0: expected at least one worker".into()
            ));
        }
        let w = c.workers as usize;

        let m = &raw.model;
        if m.inputs == 0 || m.classes < 2 || m.hidden.contains(&0) {
            return Err(err(format!(
                "[model] inputs = {}, classes = {}, hidden = {:?}: expected inputs >= 1, classes >= 2 and hidden widths >= 1",
                m.inputs, m.classes, m.hidden
            )));
        }
        let mut dims = vec![m.inputs];
        dims.extend(&m.hidden);
        dims.push(m.classes);

        let t = &raw.train;
        let (global_batch, batch_from_per_worker) = match (t.global_batch, t.per_worker_batch) {
            (Some(b), None) if b > 0 => (b, false),
            (None, Some(b)) if b > 0 => (b * w, true),
            (Some(_), Some(_)) => {
                return Err(err(
                    "[train] global_batch and per_worker_batch are both set: expected exactly one of them".into(),
                ));
            }
            (None, None) => {
                return Err(err(
                    "[train]: expected one of global_batch or per_worker_batch".into(),
                ));
            }
            _ => {
                return Err(err(
                    "[train] batch size 0: expected a positive batch size".into()
                ));
            }
        };
        if global_batch < w {
            return Err(err(format!(
                "[train] global_batch = {global_batch} is smaller than [cluster] workers = {w}: expected every worker to get at least one sample"
            )));
        }
        match (t.steps, t.epochs) {
            (Some(s), None) if s > 0 => {}
            (None, Some(e)) if e > 0 => {}
            (Some(_), Some(_)) => {
                return Err(err(
                    "[train] steps and epochs are both set: expected exactly one of them".into(),
                ));
            }
            (None, None) => return Err(err("[train]: expected one of steps or epochs".into())),
            _ => {
                return Err(err(
                    "[train] steps/epochs = 0: expected a positive number".into()
                ));
            }
        }
        if t.log_every == 0 {
            return Err(err("[train] log_every = 0: expected 1 or more".into()));
        }
        if t.loss_reduction == LossReduction::Sum && t.aggregation == Aggregation::Weighted {
            return Err(err(
                "[train] aggregation = \"weighted\" with loss_reduction = \"sum\": weighted aggregation expects mean-reduced worker gradients; use loss_reduction = \"mean\"".into(),
            ));
        }

        let optimizer = parse_optimizer(&raw.optimizer).map_err(err)?;
        let schedule = parse_schedule(&raw.schedule, raw.optimizer.lr).map_err(err)?;

        let s = &raw.server;
        for (key, v) in [
            ("barrier_warn_secs", s.barrier_warn_secs),
            ("barrier_timeout_secs", s.barrier_timeout_secs),
            ("pull_timeout_secs", s.pull_timeout_secs),
            ("linger_secs", s.linger_secs),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(err(format!(
                    "[server] {key} = {v}: expected a positive number of seconds"
                )));
            }
        }
        if !(1024..=crate::wire::MAX_MESSAGE_BYTES / 2).contains(&s.chunk_bytes) {
            return Err(err(format!(
                "[server] chunk_bytes = {}: expected 1024 to {}",
                s.chunk_bytes,
                crate::wire::MAX_MESSAGE_BYTES / 2
            )));
        }
        let barrier_policy = match s.barrier_policy.as_str() {
            "fail" => BarrierPolicy::Fail,
            "continue" => BarrierPolicy::Continue,
            other => {
                return Err(err(format!(
                    "[server] barrier_policy = {other:?}: expected \"fail\" (stop the run when a step times out) or \"continue\" (go on without the ranks that did not push)"
                )));
            }
        };
        if !s.metrics_addrs.is_empty() && s.metrics_addrs.len() != c.servers.len() {
            return Err(err(format!(
                "[server] metrics_addrs has {} addresses: expected none or one per shard ({})",
                s.metrics_addrs.len(),
                c.servers.len()
            )));
        }
        let wk = &raw.worker;
        let device_ok = matches!(wk.device.as_str(), "cpu" | "cuda" | "auto")
            || wk
                .device
                .strip_prefix("cuda:")
                .is_some_and(|n| n.parse::<usize>().is_ok());
        if !device_ok {
            return Err(err(format!(
                "[worker] device = {:?}: expected \"cpu\", \"cuda\", \"cuda:N\" or \"auto\"",
                wk.device
            )));
        }
        if !(wk.connect_timeout_secs.is_finite() && wk.connect_timeout_secs > 0.0) {
            return Err(err(format!(
                "[worker] connect_timeout_secs = {}: expected a positive number of seconds",
                wk.connect_timeout_secs
            )));
        }

        let ck = &raw.checkpoint;
        if ck.keep == 0 {
            return Err(err(
                "[checkpoint] keep = 0: expected at least 1 (the newest checkpoint is what a resume needs)"
                    .into(),
            ));
        }

        let cfg = Config {
            path: path.to_path_buf(),
            servers: c.servers.clone(),
            workers: w,
            transport,
            token,
            tls,
            dims,
            data_dir: resolve(&raw.data.dir),
            seed: t.seed,
            global_batch,
            batch_from_per_worker,
            steps: t.steps,
            epochs: t.epochs,
            keep_last: t.keep_last,
            loss_reduction: t.loss_reduction,
            aggregation: t.aggregation,
            log_every: t.log_every,
            eval_every: t.eval_every,
            optimizer,
            schedule,
            server: ServerConfig {
                out_dir: resolve(&s.out_dir),
                barrier_warn_secs: s.barrier_warn_secs,
                barrier_timeout_secs: s.barrier_timeout_secs,
                pull_timeout_secs: s.pull_timeout_secs,
                linger_secs: s.linger_secs,
                chunk_bytes: s.chunk_bytes,
                metrics_addrs: s.metrics_addrs.clone(),
                barrier_policy,
            },
            worker: WorkerConfig {
                device: wk.device.clone(),
                threads: wk.threads,
                connect_timeout_secs: wk.connect_timeout_secs,
            },
            checkpoint: CheckpointConfig {
                every: ck.every,
                keep: ck.keep,
                dir: ck.dir.as_deref().map(resolve),
            },
        };
        Ok(cfg)
    }

    /// How this config's processes reach a shard (token and TLS).
    pub fn client_security(&self) -> crate::auth::ClientSecurity {
        crate::auth::ClientSecurity::new(self.token.clone(), self.tls.clone())
    }

    /// The directory of the shards' checkpoints.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint
            .dir
            .clone()
            .unwrap_or_else(|| self.server.out_dir.join("checkpoints"))
    }

    /// The model's layout.
    pub fn layout(&self) -> MlpLayout {
        MlpLayout::new(&self.dims)
    }

    /// Number of shards `S`.
    pub fn num_shards(&self) -> usize {
        self.servers.len()
    }

    /// The data order for a training set of `n` samples.
    pub fn data_order(&self, n: usize) -> crate::order::DataOrder {
        crate::order::DataOrder {
            seed: self.seed,
            n,
            global_batch: self.global_batch,
            keep_last: self.keep_last,
        }
    }

    /// Total steps of the run for a training set of `n` samples, or an error if the set is
    /// smaller than one global batch.
    pub fn total_steps(&self, n: usize) -> Result<u64, ConfigError> {
        let spe = self.data_order(n).steps_per_epoch();
        if spe == 0 {
            return Err(ConfigError {
                file: self.path.clone(),
                message: format!(
                    "[train] global_batch = {} is larger than the training set ({n} samples in {})",
                    self.global_batch,
                    self.data_dir.display()
                ),
            });
        }
        Ok(self.steps.unwrap_or_else(|| self.epochs.unwrap_or(1) * spe))
    }

    /// The schedule with a cosine decay's length filled in from the run's total steps.
    pub fn schedule_for(&self, total_steps: u64) -> LrSchedule {
        let mut s = self.schedule.clone();
        if let Decay::Cosine {
            total_steps: t @ 0, ..
        } = &mut s.decay
        {
            *t = total_steps;
        }
        s
    }

    /// Per-worker batch sizes `b_r` of a full global batch.
    pub fn worker_batches(&self) -> Vec<usize> {
        split_even(self.global_batch, self.workers)
            .iter()
            .map(|r| r.len())
            .collect()
    }

    /// The single-process run this configuration is equivalent to (DESIGN.md §2).
    pub fn equivalence(&self) -> Equivalence {
        let w = self.workers as f64;
        let b = self.worker_batches();
        let uneven = b.iter().any(|&x| x != b[0]);
        let mut warnings = Vec::new();
        let (grad_scale, exact) = match (self.loss_reduction, self.aggregation) {
            (LossReduction::Mean, Aggregation::Mean) => {
                if uneven {
                    warnings.push(format!(
                        "aggregation \"mean\" with uneven per-worker batches {b:?} weights every worker equally, so samples on smaller workers count more: the result is NOT exactly the single-process run; use aggregation = \"weighted\""
                    ));
                }
                if self.keep_last {
                    warnings.push("aggregation \"mean\" with keep_last = true: the short last batch of each epoch is split unevenly, and mean of means is biased there; use aggregation = \"weighted\"".into());
                }
                (1.0, !uneven && !self.keep_last)
            }
            (LossReduction::Mean, Aggregation::Weighted) => (1.0, true),
            (LossReduction::Mean, Aggregation::Sum) => {
                warnings.push(format!(
                    "loss_reduction \"mean\" with aggregation \"sum\" makes the gradient {w} times the single-process mean gradient: this is the learning rate times {w} (use aggregation = \"mean\" or \"weighted\" to keep the lr you set)"
                ));
                (w, !uneven)
            }
            (LossReduction::Sum, Aggregation::Sum) => (1.0, true),
            (LossReduction::Sum, Aggregation::Mean) => {
                warnings.push(format!(
                    "loss_reduction \"sum\" with aggregation \"mean\" divides the summed gradient by {w}: this is the learning rate divided by {w}"
                ));
                (1.0 / w, true)
            }
            (LossReduction::Sum, Aggregation::Weighted) => unreachable!("rejected by validation"),
        };
        if self.server.barrier_policy == BarrierPolicy::Continue {
            warnings.push(format!(
                "barrier_policy \"continue\": a step whose barrier times out ({} s) goes on without the ranks that did not push; from then on the run no longer equals the single-process one",
                self.server.barrier_timeout_secs
            ));
        }
        let lr_is_scale =
            matches!(self.optimizer, Optimizer::Sgd { weight_decay, .. } if weight_decay == 0.0);
        Equivalence {
            global_batch: self.global_batch,
            loss_reduction: self.loss_reduction,
            grad_scale,
            lr: self.schedule.base_lr * grad_scale,
            lr_is_scale,
            exact,
            warnings,
        }
    }

    /// The resolved configuration, printed at start-up.
    pub fn describe(&self) -> String {
        let b = self.worker_batches();
        let stop = match (self.steps, self.epochs) {
            (Some(s), _) => format!("{s} steps"),
            (_, Some(e)) => format!("{e} epochs"),
            _ => unreachable!(),
        };
        format!(
            "config {}: {} shards {:?}, {} workers, transport {}, {}; {}; data {}; seed {}; global batch {} ({}), per-worker batches {:?}; {stop}{}; loss reduction {}, aggregation {}; optimizer {}; lr {}; log every {} steps, eval every {}; {}",
            self.path.display(),
            self.num_shards(),
            self.servers,
            self.workers,
            self.transport,
            match (self.token.is_some(), self.tls.is_some()) {
                (true, true) => "TLS, shared token required",
                (true, false) => "shared token required, no TLS",
                (false, true) => "TLS, no token",
                (false, false) => "no authentication, no TLS",
            },
            self.layout().describe(),
            self.data_dir.display(),
            self.seed,
            self.global_batch,
            if self.batch_from_per_worker {
                "from per_worker_batch"
            } else {
                "as stated"
            },
            b,
            if self.keep_last {
                ", short last batch kept"
            } else {
                ", short last batch dropped"
            },
            self.loss_reduction,
            self.aggregation,
            self.optimizer.describe(),
            self.schedule.describe(),
            self.log_every,
            if self.eval_every == 0 {
                "run (at the end only)".to_string()
            } else {
                format!("{} steps", self.eval_every)
            },
            if self.checkpoint.every == 0 {
                "no checkpoints".to_string()
            } else {
                format!(
                    "checkpoint every {} steps in {} (keep {})",
                    self.checkpoint.every,
                    self.checkpoint_dir().display(),
                    self.checkpoint.keep
                )
            },
        )
    }
}

/// The single-process training run a distributed configuration equals.
#[derive(Debug, Clone, PartialEq)]
pub struct Equivalence {
    /// Batch of the single process: `B`.
    pub global_batch: usize,
    /// Its loss reduction.
    pub loss_reduction: LossReduction,
    /// The cluster's aggregated gradient is this times the single-process gradient.
    pub grad_scale: f64,
    /// The single-process learning rate that gives the same updates when `lr_is_scale`.
    pub lr: f64,
    /// True when scaling the gradient is exactly scaling the lr (plain SGD, no weight decay);
    /// otherwise the equivalent single process scales its gradient by `grad_scale`.
    pub lr_is_scale: bool,
    /// False when the combination is only approximately a single-process run.
    pub exact: bool,
    /// Plain-words warnings (rescaled lr, biased mean).
    pub warnings: Vec<String>,
}

impl fmt::Display for Equivalence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head = if self.exact {
            "equivalent to"
        } else {
            "approximately (not exactly) equivalent to"
        };
        if self.grad_scale == 1.0 || self.lr_is_scale {
            write!(
                f,
                "{head} one process with batch {}, {} loss, lr {}",
                self.global_batch,
                self.loss_reduction,
                fmt_num(self.lr)
            )
        } else {
            write!(
                f,
                "{head} one process with batch {}, {} loss, its gradient multiplied by {} (with this optimizer that is not the same as scaling the lr)",
                self.global_batch,
                self.loss_reduction,
                fmt_num(self.grad_scale)
            )
        }
    }
}

fn fmt_num(x: f64) -> String {
    let s = format!("{x}");
    if s.len() > 10 { format!("{x:.6e}") } else { s }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn parse_optimizer(o: &RawOptimizer) -> Result<Optimizer, String> {
    if !(o.lr.is_finite() && o.lr > 0.0) {
        return Err(format!(
            "[optimizer] lr = {}: expected a positive number",
            o.lr
        ));
    }
    if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
        return Err(format!(
            "[optimizer] weight_decay = {}: expected 0 or more",
            o.weight_decay
        ));
    }
    match o.kind.as_str() {
        "sgd" => {
            if !(0.0..1.0).contains(&o.momentum) {
                return Err(format!(
                    "[optimizer] momentum = {}: expected 0 <= momentum < 1",
                    o.momentum
                ));
            }
            if o.nesterov && o.momentum == 0.0 {
                return Err("[optimizer] nesterov = true needs momentum > 0".into());
            }
            Ok(Optimizer::Sgd {
                momentum: o.momentum,
                nesterov: o.nesterov,
                weight_decay: o.weight_decay,
            })
        }
        "adam" | "adamw" => {
            for (k, v) in [("beta1", o.beta1), ("beta2", o.beta2)] {
                if !(0.0..1.0).contains(&v) {
                    return Err(format!("[optimizer] {k} = {v}: expected 0 <= {k} < 1"));
                }
            }
            if o.eps.is_nan() || o.eps <= 0.0 {
                return Err(format!(
                    "[optimizer] eps = {}: expected a positive number",
                    o.eps
                ));
            }
            if o.momentum != 0.0 || o.nesterov {
                return Err(format!(
                    "[optimizer] momentum/nesterov are SGD settings; kind = {:?} uses beta1/beta2",
                    o.kind
                ));
            }
            Ok(Optimizer::Adam {
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps,
                weight_decay: o.weight_decay,
                decoupled: o.kind == "adamw",
            })
        }
        other => Err(format!(
            "[optimizer] kind = {other:?}: expected \"sgd\", \"adam\" or \"adamw\""
        )),
    }
}

fn parse_schedule(s: &RawSchedule, lr: f64) -> Result<LrSchedule, String> {
    let decay = match s.kind.as_str() {
        "constant" => Decay::Constant,
        "step" => {
            let step_size = s
                .step_size
                .filter(|&n| n > 0)
                .ok_or("[schedule] kind = \"step\" needs step_size >= 1")?;
            let gamma = s.gamma.ok_or(
                "[schedule] kind = \"step\" needs gamma (the factor applied every step_size steps)",
            )?;
            if !(gamma.is_finite() && gamma > 0.0) {
                return Err(format!(
                    "[schedule] gamma = {gamma}: expected a positive number"
                ));
            }
            Decay::Step { step_size, gamma }
        }
        "cosine" => {
            if !(s.min_lr.is_finite() && s.min_lr >= 0.0 && s.min_lr < lr) {
                return Err(format!(
                    "[schedule] min_lr = {}: expected 0 <= min_lr < lr ({lr})",
                    s.min_lr
                ));
            }
            // length filled in from the run's total steps (Config::schedule_for)
            Decay::Cosine {
                total_steps: 0,
                min_lr: s.min_lr,
            }
        }
        other => {
            return Err(format!(
                "[schedule] kind = {other:?}: expected \"constant\", \"step\" or \"cosine\""
            ));
        }
    };
    if s.kind != "step" && (s.step_size.is_some() || s.gamma.is_some()) {
        return Err(format!(
            "[schedule] step_size/gamma only apply to kind = \"step\", not {:?}",
            s.kind
        ));
    }
    Ok(LrSchedule {
        base_lr: lr,
        warmup_steps: s.warmup_steps,
        decay,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[cluster]
servers = ["127.0.0.1:5000", "127.0.0.1:5001"]
workers = 4
[model]
hidden = [32]
[data]
dir = "../data/mnist"
[train]
seed = 3
global_batch = 30
steps = 20
loss_reduction = "mean"
aggregation = "weighted"
[optimizer]
kind = "sgd"
lr = 0.1
"#;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("/etc/ps/run.toml"))
    }

    #[test]
    fn good_config_resolves() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.dims, [784, 32, 10]);
        assert_eq!(c.data_dir, Path::new("/etc/ps/../data/mnist"));
        assert_eq!(c.worker_batches(), [8, 8, 7, 7]);
        let e = c.equivalence();
        assert!(e.exact);
        assert_eq!(
            e.to_string(),
            "equivalent to one process with batch 30, mean loss, lr 0.1"
        );
        assert!(c.describe().contains("per-worker batches [8, 8, 7, 7]"));
    }

    #[test]
    fn equivalences_and_warnings() {
        let c = parse(&GOOD.replace("\"weighted\"", "\"sum\"")).unwrap();
        let e = c.equivalence();
        assert_eq!(e.grad_scale, 4.0);
        assert!((e.lr - 0.4).abs() < 1e-12);
        assert!(e.warnings[0].contains("times 4"), "{:?}", e.warnings);
        let c =
            parse(&GOOD.replace("aggregation = \"weighted\"", "aggregation = \"mean\"")).unwrap();
        let e = c.equivalence();
        assert!(!e.exact);
        assert!(e.warnings[0].contains("uneven"));
        let c = parse(
            &GOOD
                .replace("\"weighted\"", "\"mean\"")
                .replace("\"mean\"\naggregation", "\"sum\"\naggregation"),
        )
        .unwrap();
        assert_eq!(c.equivalence().grad_scale, 0.25);
    }

    #[test]
    fn errors_name_file_key_and_expectation() {
        let e = parse(&GOOD.replace("seed = 3", "seed = 3\nsede = 4"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/etc/ps/run.toml: ") && e.contains("unknown field `sede`"),
            "{e}"
        );
        let e = parse(&GOOD.replace(
            "global_batch = 30",
            "global_batch = 30\nper_worker_batch = 8",
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("exactly one"), "{e}");
        let e = parse(&GOOD.replace("kind = \"sgd\"", "kind = \"rmsprop\""))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[optimizer] kind = \"rmsprop\": expected"),
            "{e}"
        );
        let e = parse(&GOOD.replace("workers = 4", "workers = 0"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("[cluster] workers = 0"), "{e}");
        let e = parse(&GOOD.replace("global_batch = 30", "global_batch = 3"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("smaller than [cluster] workers = 4"), "{e}");
        let e = parse(&GOOD.replace("lr = 0.1", "lr = -1"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("[optimizer] lr = -1"), "{e}");
        let e = parse(&format!("{GOOD}[worker]\ndevice = \"gpu0\"\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("[worker] device = \"gpu0\": expected"), "{e}");
        let e = parse(&format!("{GOOD}[checkpoint]\nevery = 10\nkeep = 0\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[checkpoint] keep = 0: expected at least 1"),
            "{e}"
        );
        let e = parse(&GOOD.replace("workers = 4", "workers = 4\ntransport = \"tcp\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("[cluster] transport = \"tcp\": expected"), "{e}");
        let e = parse(&GOOD.replace("workers = 4", "workers = 4\ntls_cert = \"c.pem\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected all three"), "{e}");
        let e = parse(&GOOD.replace(
            "workers = 4",
            "workers = 4\ntls_cert = \"c\"\ntls_key = \"k\"\ntls_ca = \"a\"",
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("[cluster] tls: cannot read certificate /etc/ps/c"),
            "{e}"
        );
        let c = parse(&format!("{GOOD}[checkpoint]\nevery = 10\n")).unwrap();
        assert_eq!(c.checkpoint_dir(), c.server.out_dir.join("checkpoints"));
        assert!(c.describe().contains("checkpoint every 10 steps"));
        let e = parse("not toml [").unwrap_err().to_string();
        assert!(e.starts_with("/etc/ps/run.toml: "), "{e}");
    }
}
