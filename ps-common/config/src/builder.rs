//! [`TestConfig`]: a typed builder of config files, for tests and tools that write configs.
//! It fills the same raw structs the file is read into and writes them with `toml`, so a
//! built file always has the shape [`super::Config`] reads.

use super::cluster::RawCluster;
use super::kinds::{
    Aggregation, BarrierPolicy, LossReduction, OptimizerKind, ScheduleKind, Transport,
};
use super::model::RawModel;
use super::optimizer::{RawOptimizer, RawSchedule, default_beta1, default_beta2, default_eps};
use super::server::{RawCheckpoint, RawServer, RawWorker};
use super::train::{RawData, RawTrain};
use super::{Config, ConfigError, RawConfig};
use std::path::{Path, PathBuf};

/// A config file under construction: `TestConfig::new().workers(4).hidden(&[32]).toml()`.
/// Starts from a small valid run: 2 shards on placeholder ports of 127.0.0.1, 4 workers,
/// hidden [32], global batch 32, 20 steps, mean loss, mean aggregation, seed 7, log every 5,
/// SGD lr 0.1 momentum 0.9, data in `data`, output in `out`.
#[derive(Debug, Clone)]
pub struct TestConfig {
    raw: RawConfig,
}

impl Default for TestConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl TestConfig {
    /// The small valid run described on the type.
    pub fn new() -> Self {
        let raw = RawConfig {
            cluster: RawCluster {
                servers: Vec::new(),
                workers: 4,
                transport: Transport::Auto,
                wire: super::kinds::Wire::F32,
                token_file: None,
                tls_cert: None,
                tls_key: None,
                tls_ca: None,
                tls_domain: None,
                run_id: None,
            },
            model: RawModel {
                hidden: Some(vec![32]),
                ..RawModel::default()
            },
            data: RawData {
                dir: PathBuf::from("data"),
                dir_as_given: false,
                train_len: None,
            },
            train: RawTrain {
                seed: 7,
                global_batch: Some(32),
                per_worker_batch: None,
                steps: Some(20),
                epochs: None,
                keep_last: false,
                loss_reduction: LossReduction::Mean,
                aggregation: Aggregation::Mean,
                log_every: 5,
                eval_every: 0,
                micro_batches: 1,
                exact_sum: false,
                exact_micro_batch: None,
            },
            optimizer: RawOptimizer {
                kind: OptimizerKind::Sgd,
                lr: 0.1,
                momentum: 0.9,
                nesterov: false,
                weight_decay: 0.0,
                beta1: default_beta1(),
                beta2: default_beta2(),
                eps: default_eps(),
                groups: Vec::new(),
                clip_norm: None,
            },
            schedule: RawSchedule::default(),
            server: RawServer {
                out_dir: PathBuf::from("out"),
                ..RawServer::default()
            },
            worker: RawWorker::default(),
            checkpoint: RawCheckpoint::default(),
        };
        Self { raw }.shards(2)
    }

    /// `[cluster] servers`: `n` placeholder addresses `127.0.0.1:1`, `:2`, ... (tests bind
    /// port 0 and pass the real addresses on the command line).
    pub fn shards(mut self, n: usize) -> Self {
        self.raw.cluster.servers = (0..n).map(|i| format!("127.0.0.1:{}", 1 + i)).collect();
        self
    }
    /// `[cluster] servers`.
    pub fn servers(mut self, servers: &[&str]) -> Self {
        self.raw.cluster.servers = servers.iter().map(|s| s.to_string()).collect();
        self
    }
    /// `[cluster] workers`.
    pub fn workers(mut self, w: usize) -> Self {
        self.raw.cluster.workers = w;
        self
    }
    /// `[cluster] wire`.
    pub fn wire(mut self, w: super::kinds::Wire) -> Self {
        self.raw.cluster.wire = w;
        self
    }

    /// `[cluster] transport`.
    pub fn transport(mut self, t: Transport) -> Self {
        self.raw.cluster.transport = t;
        self
    }
    /// `[cluster] token_file`.
    pub fn token_file(mut self, p: impl Into<PathBuf>) -> Self {
        self.raw.cluster.token_file = Some(p.into());
        self
    }
    /// `[cluster] tls_cert`, `tls_key`, `tls_ca`.
    pub fn tls(
        mut self,
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
        ca: impl Into<PathBuf>,
    ) -> Self {
        self.raw.cluster.tls_cert = Some(cert.into());
        self.raw.cluster.tls_key = Some(key.into());
        self.raw.cluster.tls_ca = Some(ca.into());
        self
    }
    /// `[cluster] run_id`.
    pub fn run_id(mut self, id: &str) -> Self {
        self.raw.cluster.run_id = Some(id.into());
        self
    }

    /// `[cluster] tls_domain`.
    pub fn tls_domain(mut self, d: &str) -> Self {
        self.raw.cluster.tls_domain = Some(d.into());
        self
    }
    /// `[model] hidden`.
    pub fn hidden(mut self, h: &[usize]) -> Self {
        self.raw.model.hidden = Some(h.to_vec());
        self
    }
    /// `[model] kind = "cnn"` with these convolution `channels` (kernel 5, stride 1, no
    /// padding, 1 x 28 x 28 images unless set by [`TestConfig::cnn_geometry`]).
    pub fn cnn(mut self, channels: &[usize]) -> Self {
        self.raw.model.kind = Some("cnn".into());
        self.raw.model.channels = Some(channels.to_vec());
        self
    }

    /// `[model] kernel`, `stride`, `padding` of the CNN.
    pub fn cnn_geometry(mut self, kernel: usize, stride: usize, padding: usize) -> Self {
        self.raw.model.kernel = Some(kernel);
        self.raw.model.stride = Some(stride);
        self.raw.model.padding = Some(padding);
        self
    }

    /// `[model] init`: a declared model's safetensors file.
    pub fn model_init(mut self, p: impl Into<PathBuf>) -> Self {
        self.raw.model.init = Some(p.into());
        self.raw.model.hidden = None;
        self
    }
    /// `[data] dir`.
    pub fn data_dir(mut self, d: impl Into<PathBuf>) -> Self {
        self.raw.data.dir = d.into();
        self
    }
    /// `[data] train_len` (the user's own data of a declared model), with no `dir`.
    pub fn train_len(mut self, n: u64) -> Self {
        self.raw.data.dir = PathBuf::new();
        self.raw.data.train_len = Some(n);
        self
    }
    /// `[train] seed`.
    pub fn seed(mut self, s: u64) -> Self {
        self.raw.train.seed = s;
        self
    }
    /// `[train] global_batch` (clears `per_worker_batch`).
    pub fn global_batch(mut self, b: u64) -> Self {
        self.raw.train.global_batch = Some(b);
        self.raw.train.per_worker_batch = None;
        self
    }
    /// `[train] per_worker_batch` (clears `global_batch`).
    pub fn per_worker_batch(mut self, b: u64) -> Self {
        self.raw.train.per_worker_batch = Some(b);
        self.raw.train.global_batch = None;
        self
    }
    /// `[train] steps` (clears `epochs`).
    pub fn steps(mut self, s: u64) -> Self {
        self.raw.train.steps = Some(s);
        self.raw.train.epochs = None;
        self
    }
    /// `[train] epochs` (clears `steps`).
    pub fn epochs(mut self, e: u64) -> Self {
        self.raw.train.epochs = Some(e);
        self.raw.train.steps = None;
        self
    }
    /// `[train] keep_last`.
    pub fn keep_last(mut self, k: bool) -> Self {
        self.raw.train.keep_last = k;
        self
    }
    /// `[train] loss_reduction`.
    pub fn loss_reduction(mut self, l: LossReduction) -> Self {
        self.raw.train.loss_reduction = l;
        self
    }
    /// `[train] aggregation`.
    pub fn aggregation(mut self, a: Aggregation) -> Self {
        self.raw.train.aggregation = a;
        self
    }
    /// `[train] log_every`.
    pub fn log_every(mut self, n: u64) -> Self {
        self.raw.train.log_every = n;
        self
    }
    /// `[train] eval_every`.
    pub fn eval_every(mut self, n: u64) -> Self {
        self.raw.train.eval_every = n;
        self
    }
    /// `[optimizer]`: SGD with `lr` and `momentum` (no Nesterov, no weight decay).
    pub fn sgd(mut self, lr: f64, momentum: f32) -> Self {
        self.raw.optimizer = RawOptimizer {
            kind: OptimizerKind::Sgd,
            lr,
            momentum,
            ..self.raw.optimizer
        };
        self.raw.optimizer.nesterov = false;
        self.raw.optimizer.weight_decay = 0.0;
        self
    }
    /// `[optimizer]`: Adam (`decoupled`: AdamW) with `lr` and `weight_decay`, default betas.
    pub fn adam(mut self, lr: f64, weight_decay: f32, decoupled: bool) -> Self {
        self.raw.optimizer = RawOptimizer {
            kind: if decoupled {
                OptimizerKind::AdamW
            } else {
                OptimizerKind::Adam
            },
            lr,
            momentum: 0.0,
            nesterov: false,
            weight_decay,
            beta1: default_beta1(),
            beta2: default_beta2(),
            eps: default_eps(),
            groups: Vec::new(),
            clip_norm: self.raw.optimizer.clip_norm,
        };
        self
    }
    /// `[optimizer] nesterov`.
    pub fn nesterov(mut self, n: bool) -> Self {
        self.raw.optimizer.nesterov = n;
        self
    }
    /// `[optimizer] clip_norm`.
    pub fn clip_norm(mut self, max_norm: f64) -> Self {
        self.raw.optimizer.clip_norm = Some(max_norm);
        self
    }
    /// `[train] exact_sum` with `exact_micro_batch` (None: the default size).
    pub fn exact_sum(mut self, micro_batch: Option<u64>) -> Self {
        self.raw.train.exact_sum = true;
        self.raw.train.exact_micro_batch = micro_batch;
        self
    }

    /// `[train] micro_batches`.
    pub fn micro_batches(mut self, k: u64) -> Self {
        self.raw.train.micro_batches = k;
        self
    }
    /// `[optimizer] weight_decay`.
    pub fn weight_decay(mut self, wd: f32) -> Self {
        self.raw.optimizer.weight_decay = wd;
        self
    }
    /// `[schedule]`: cosine to `min_lr` after `warmup_steps` of warm-up.
    pub fn cosine(mut self, warmup_steps: u64, min_lr: f64) -> Self {
        self.raw.schedule = RawSchedule {
            kind: ScheduleKind::Cosine,
            warmup_steps,
            step_size: None,
            gamma: None,
            min_lr,
        };
        self
    }
    /// `[schedule]`: times `gamma` every `step_size` steps.
    pub fn step_decay(mut self, step_size: u64, gamma: f64) -> Self {
        self.raw.schedule = RawSchedule {
            kind: ScheduleKind::Step,
            warmup_steps: 0,
            step_size: Some(step_size),
            gamma: Some(gamma),
            min_lr: 0.0,
        };
        self
    }
    /// `[server] out_dir`.
    pub fn out_dir(mut self, d: impl Into<PathBuf>) -> Self {
        self.raw.server.out_dir = d.into();
        self
    }
    /// `[server] barrier_warn_secs`.
    pub fn barrier_warn_secs(mut self, s: f64) -> Self {
        self.raw.server.barrier_warn_secs = s;
        self
    }
    /// `[server] barrier_timeout_secs`.
    pub fn barrier_timeout_secs(mut self, s: f64) -> Self {
        self.raw.server.barrier_timeout_secs = s;
        self
    }
    /// `[server] pull_timeout_secs`.
    pub fn pull_timeout_secs(mut self, s: f64) -> Self {
        self.raw.server.pull_timeout_secs = s;
        self
    }
    /// `[server] linger_secs`.
    pub fn linger_secs(mut self, s: f64) -> Self {
        self.raw.server.linger_secs = s;
        self
    }
    /// `[server] chunk_bytes`.
    pub fn chunk_bytes(mut self, b: usize) -> Self {
        self.raw.server.chunk_bytes = b;
        self
    }
    /// `[server] barrier_policy`.
    pub fn barrier_policy(mut self, p: BarrierPolicy) -> Self {
        self.raw.server.barrier_policy = p;
        self
    }
    /// `[server] max_pending_gradients`.
    pub fn max_pending_gradients(mut self, n: usize) -> Self {
        self.raw.server.max_pending_gradients = n;
        self
    }
    /// `[server] stream_idle_secs`.
    pub fn stream_idle_secs(mut self, s: f64) -> Self {
        self.raw.server.stream_idle_secs = s;
        self
    }
    /// `[server] handshake_timeout_secs`.
    pub fn handshake_timeout_secs(mut self, s: f64) -> Self {
        self.raw.server.handshake_timeout_secs = s;
        self
    }
    /// `[server] max_streams_per_connection`.
    pub fn max_streams_per_connection(mut self, n: usize) -> Self {
        self.raw.server.max_streams_per_connection = n;
        self
    }
    /// `[server] max_connections`.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.raw.server.max_connections = n;
        self
    }
    /// `[server] data_connections` and `data_port_offset`.
    pub fn data_connections(mut self, on: bool, port_offset: u32) -> Self {
        self.raw.server.data_connections = on;
        self.raw.server.data_port_offset = port_offset;
        self
    }
    /// `[server] allow_unauthenticated`.
    pub fn allow_unauthenticated(mut self, on: bool) -> Self {
        self.raw.server.allow_unauthenticated = on;
        self
    }
    /// `[server] shard_token_file`.
    pub fn shard_token_file(mut self, p: &std::path::Path) -> Self {
        self.raw.server.shard_token_file = Some(p.to_path_buf());
        self
    }
    /// `[server] metrics_addrs`.
    pub fn metrics_addrs(mut self, a: &[&str]) -> Self {
        self.raw.server.metrics_addrs = a.iter().map(|s| s.to_string()).collect();
        self
    }
    /// `[worker] device`.
    pub fn device(mut self, d: &str) -> Self {
        self.raw.worker.device = d.into();
        self
    }
    /// `[worker] threads`.
    pub fn threads(mut self, n: usize) -> Self {
        self.raw.worker.threads = n;
        self
    }
    /// `[worker] connect_timeout_secs`.
    pub fn connect_timeout_secs(mut self, s: f64) -> Self {
        self.raw.worker.connect_timeout_secs = s;
        self
    }
    /// `[worker] deadline_margin_secs`.
    pub fn deadline_margin_secs(mut self, s: f64) -> Self {
        self.raw.worker.deadline_margin_secs = s;
        self
    }
    /// `[checkpoint] every` and `keep`.
    pub fn checkpoint(mut self, every: u64, keep: usize) -> Self {
        self.raw.checkpoint.every = every;
        self.raw.checkpoint.keep = keep;
        self
    }
    /// `[checkpoint] max_failures`.
    pub fn checkpoint_max_failures(mut self, n: u32) -> Self {
        self.raw.checkpoint.max_failures = n;
        self
    }
    /// `[checkpoint] dir`.
    pub fn checkpoint_dir(mut self, d: impl Into<PathBuf>) -> Self {
        self.raw.checkpoint.dir = Some(d.into());
        self
    }

    /// The config file's text.
    pub fn toml(&self) -> String {
        toml::to_string(&self.raw).expect("a config of plain values serializes")
    }

    /// Parses [`TestConfig::toml`] as if read from `path` (validated like a file).
    pub fn build(&self, path: &Path) -> Result<Config, ConfigError> {
        Config::parse(&self.toml(), path)
    }
}
