//! The one TOML file that describes a cluster and a run, shaped like the file: one module
//! and one validated struct per `[section]`.
//!
//! - `kinds`: the names a file gives (`transport`, `aggregation`, `kind`, ...) as serde enums;
//! - `cluster`, `model`, `train` (with `[data]`), `optimizer` (with `[schedule]`), `server`
//!   (with `[worker]` and `[checkpoint]`): each a private serde `Raw*` mirror of its section
//!   (unknown keys are errors) and the `validate` that turns it into the public struct;
//! - `limits`: the stated maximum of every duration, count and size;
//! - this file: [`Config`], the checks that span sections ([`Config::parse`]), command-line
//!   [`Overrides`] (applied to the raw file before validation, so an override is checked like
//!   a file value), and the resolved-config and equivalence statements;
//! - `builder`: [`TestConfig`], a typed builder of config files for tests.
//!
//! Every error names the file, the key, the value and what was expected. Relative paths in
//! the file are taken relative to the file's own directory.
//!
//! It also answers the question users come with: which single-process run a configuration
//! is equivalent to ([`Config::equivalence`]).
//!
//! Beside the file, what follows from it alone, with nothing of gRPC in this crate (so that
//! `ps-plan` builds without tonic):
//! - `plan`: the planner (`ps-plan`), the config lines that reproduce a single-process run;
//! - `noise`: the gradient noise scale from the ranks' gradient norms, for the config's
//!   aggregation and loss;
//! - `runid`: the run identity (from the flag, the environment or `[cluster] run_id`);
//! - `credential`: the token and TLS files the file names, read and checked.

#[macro_use]
pub mod error;
mod builder;
mod cluster;
pub mod credential;
mod equivalence;
pub mod exact;
mod kinds;
pub mod limits;
mod model;
pub mod noise;
mod optimizer;
pub mod plan;
pub mod runid;
pub use optimizer::{ParamGroup, describe_groups, glob};
mod server;
mod train;

pub use builder::TestConfig;
pub use cluster::ClusterConfig;
pub use equivalence::Equivalence;
use equivalence::batch_statistics_statement;
pub use error::{CredentialError, Invalid};
pub use kinds::{
    Aggregation, BarrierPolicy, LossReduction, OptimizerKind, ScheduleKind, Transport, Wire,
};
pub use model::ModelConfig;
pub use server::{CheckpointConfig, DEFAULT_MAX_PENDING_GRADIENTS, ServerConfig, WorkerConfig};
pub use train::{DataConfig, TrainConfig};

use limits::MAX_STEPS;
use ps_model::layout::{CnnLayout, MlpLayout, ModelLayout, ModelSpec, split_even};
use ps_optim::{Decay, LrSchedule, Optimizer};
use serde::{Deserialize, Serialize};
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

/// The file, section by section, as read (before validation).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    cluster: cluster::RawCluster,
    #[serde(default)]
    model: model::RawModel,
    #[serde(default)]
    data: train::RawData,
    train: train::RawTrain,
    optimizer: optimizer::RawOptimizer,
    #[serde(default)]
    schedule: optimizer::RawSchedule,
    #[serde(default)]
    server: server::RawServer,
    #[serde(default)]
    worker: server::RawWorker,
    #[serde(default)]
    checkpoint: server::RawCheckpoint,
}

/// Resolves the file's relative paths against the file's directory.
struct Resolve<'a> {
    base: &'a Path,
}

impl Resolve<'_> {
    fn path(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base.join(p)
        }
    }
}

/// Command-line settings that replace a file's values (`--data-dir`, `--out-dir` of
/// `ps-server`, `ps-worker` and `ps-launch`). They are applied to the raw file before
/// validation, so an override is checked exactly like the value it replaces; paths are taken
/// as given (relative to the working directory), not relative to the file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    /// `[data] dir`.
    pub data_dir: Option<PathBuf>,
    /// `[server] out_dir`.
    pub out_dir: Option<PathBuf>,
    /// Any `section.key = value`, in order (a later one wins): the environment's
    /// `PS_SET_<SECTION>_<KEY>` ([`Overrides::from_env`]), then `--set section.key=value`
    /// ([`Overrides::set_from_cli`]). A value is read as TOML (`3`, `0.5`, `true`,
    /// `[64, 32]`), else taken as a string.
    pub sets: Vec<Setting>,
}

/// One `section.key = value` override and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// `section.key`, e.g. `train.steps`.
    pub key: String,
    /// The value as given.
    pub value: String,
    /// `--set` or the environment variable's name.
    pub source: String,
}

/// The prefix of the environment variables that override config keys.
pub const ENV_PREFIX: &str = "PS_SET_";

/// The one answer to "D2L sums, DDP averages", word for word wherever it is given: the README,
/// `ps-server --check` and the run's log (with the warning of a mean loss summed over workers),
/// and `ps-plan --data-parallel`.
pub const SUM_OR_MEAN: &str = "D2L sums, DDP averages: both are one process with the global batch and its lr, which aggregation = \"mean\" (or \"weighted\") reproduces at that lr; aggregation = \"sum\" with a mean loss multiplies the lr by the number of workers";

/// Keys that exclude each other, by section: an override that sets one clears the others (a
/// file stating `epochs` takes `--set train.steps=100`, and back).
pub const ALTERNATIVES: [(&str, &[&str]); 2] = [
    ("train", &["steps", "epochs"]),
    ("train", &["global_batch", "per_worker_batch"]),
];

/// The keys `section.key` excludes ([`ALTERNATIVES`]), as `section.other`.
fn alternatives_of(key: &str) -> Vec<String> {
    let Some((section, k)) = key.split_once('.') else {
        return Vec::new();
    };
    ALTERNATIVES
        .iter()
        .filter(|(s, keys)| *s == section && keys.contains(&k))
        .flat_map(|(s, keys)| {
            keys.iter()
                .filter(|o| **o != k)
                .map(move |o| format!("{s}.{o}"))
        })
        .collect()
}

impl Overrides {
    /// The overrides of `env`: `PS_SET_<SECTION>_<KEY>=value` sets `section.key` (the section
    /// is the first word: `PS_SET_SERVER_BARRIER_TIMEOUT_SECS` is `server.barrier_timeout_secs`),
    /// in name order.
    pub fn from_env(env: &std::collections::HashMap<String, String>) -> Self {
        let mut vars: Vec<(&String, &String)> = env
            .iter()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX))
            .collect();
        vars.sort();
        let sets = vars
            .into_iter()
            .filter_map(|(k, v)| {
                let rest = k[ENV_PREFIX.len()..].to_ascii_lowercase();
                let (section, key) = rest.split_once('_')?;
                Some(Setting {
                    key: format!("{section}.{key}"),
                    value: v.clone(),
                    source: k.clone(),
                })
            })
            .collect();
        Self {
            sets,
            ..Self::default()
        }
    }

    /// A program's start-up overrides: `env`'s `PS_SET_*`, then the command line's `sets`
    /// (which win). A malformed `--set` is a refused config of `file` ([`ConfigError`]: exit 2).
    pub fn from_env_and_cli(
        env: &std::collections::HashMap<String, String>,
        sets: &[String],
        file: &Path,
    ) -> Result<Self, ConfigError> {
        let mut overrides = Self::from_env(env);
        overrides.set_from_cli(sets).map_err(|e| ConfigError {
            file: file.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(overrides)
    }

    /// Adds the command line's `--set section.key=value` settings (after the environment's,
    /// so they win); the error names a setting that is not `section.key=value`.
    pub fn set_from_cli(&mut self, sets: &[String]) -> Result<(), Invalid> {
        for s in sets {
            let parsed = s.split_once('=').and_then(|(k, v)| {
                let (section, key) = k.trim().split_once('.')?;
                (!section.is_empty() && !key.is_empty() && !key.contains('.'))
                    .then(|| (format!("{section}.{key}"), v.trim().to_string()))
            });
            let Some((key, value)) = parsed else {
                return Err(invalid!(
                    "--set {s:?}: expected section.key=value (e.g. --set train.steps=100)"
                ));
            };
            self.sets.push(Setting {
                key,
                value,
                source: "--set".into(),
            });
        }
        Ok(())
    }

    /// The overrides in words, one per line, for the start-up log (empty when none).
    pub fn describe(&self) -> String {
        let mut lines: Vec<String> = self
            .sets
            .iter()
            .map(|s| {
                let cleared = alternatives_of(&s.key);
                let clears = if cleared.is_empty() {
                    String::new()
                } else {
                    format!("; clears {}, which it excludes", cleared.join(" and "))
                };
                format!(
                    "config override: {} = {} (from {}{clears})",
                    s.key, s.value, s.source
                )
            })
            .collect();
        if let Some(d) = &self.data_dir {
            lines.push(format!(
                "config override: data.dir = {} (from --data-dir)",
                d.display()
            ));
        }
        if let Some(d) = &self.out_dir {
            lines.push(format!(
                "config override: server.out_dir = {} (from --out-dir)",
                d.display()
            ));
        }
        lines.join("\n")
    }

    /// The file's text with [`Overrides::sets`] applied, as a TOML table (what
    /// [`Config::load_with`] validates; `ps-launch --check-reference` writes its early config
    /// from it).
    pub fn apply_sets(&self, text: &str) -> Result<toml::Table, Invalid> {
        let mut table: toml::Table = toml::from_str(text).map_err(|e| one_line(&e.to_string()))?;
        for s in &self.sets {
            let (section, key) = s.key.split_once('.').expect("checked when added");
            let value = toml::from_str::<toml::Table>(&format!("v = {}", s.value))
                .ok()
                .and_then(|mut t| t.remove("v"))
                .unwrap_or_else(|| toml::Value::String(s.value.clone()));
            let entry = table
                .entry(section.to_string())
                .or_insert_with(|| toml::Value::Table(Default::default()));
            let toml::Value::Table(sec) = entry else {
                return Err(invalid!(
                    "{} {}={}: {section} is not a [section]",
                    s.source,
                    s.key,
                    s.value
                ));
            };
            for other in alternatives_of(&s.key) {
                if let Some((_, k)) = other.split_once('.') {
                    sec.remove(k);
                }
            }
            sec.insert(key.to_string(), value);
        }
        Ok(table)
    }

    fn apply(&self, raw: &mut RawConfig) {
        if let Some(d) = &self.data_dir {
            raw.data.dir = d.clone();
            raw.data.dir_as_given = true;
        }
        if let Some(d) = &self.out_dir {
            raw.server.out_dir = d.clone();
            raw.server.out_dir_as_given = true;
        }
    }
}

/// What the host can give a process, for the memory check (tests pass their own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Host {
    /// Bytes available (`MemAvailable`), None when unknown (then no check).
    pub available_bytes: Option<u64>,
}

impl Host {
    /// This machine.
    pub fn this() -> Self {
        Self {
            available_bytes: limits::host_available_bytes(),
        }
    }
}

/// A validated configuration: one struct per section of the file.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file it came from.
    pub path: PathBuf,
    /// `[cluster]`: shards, workers, transport, token and TLS.
    pub cluster: ClusterConfig,
    /// `[model]`: layer widths.
    pub model: ModelConfig,
    /// `[data]`: the data set.
    pub data: DataConfig,
    /// `[train]`: batch, length, reduction and aggregation.
    pub train: TrainConfig,
    /// `[optimizer]`: the optimizer.
    pub optimizer: Optimizer,
    /// `[schedule]` (with `[optimizer] lr` as its base): the learning-rate schedule.
    pub schedule: LrSchedule,
    /// `[[optimizer.groups]]`: parameter groups with their own settings (resolved against
    /// the model's tensor names); empty when none.
    pub groups: Vec<optimizer::ParamGroup>,
    /// `[optimizer] clip_norm`: the aggregated gradient of every step is clipped to this
    /// global L2 norm over the whole model (across the shards), as
    /// `torch.nn.utils.clip_grad_norm_(params, max_norm)`; None: no clipping.
    pub clip_norm: Option<f32>,
    /// `[server]`: shard settings.
    pub server: ServerConfig,
    /// `[worker]`: worker settings.
    pub worker: WorkerConfig,
    /// `[checkpoint]`: checkpoint settings.
    pub checkpoint: CheckpointConfig,
}

impl Config {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::load_with(path, &Overrides::default())
    }

    /// Reads `path`, applies the command-line `overrides`, and validates the result.
    pub fn load_with(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
        let text = read_config_text(path).map_err(|e| ConfigError {
            file: path.into(),
            message: e.to_string(),
        })?;
        Self::parse_with(&text, path, overrides, &Host::this())
    }

    /// Parses and validates `text` as if read from `path` (relative paths resolve against its directory).
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        Self::parse_with(text, path, &Overrides::default(), &Host::this())
    }

    /// [`Config::parse`] with command-line overrides, and the host whose memory the model
    /// must fit in.
    pub fn parse_with(
        text: &str,
        path: &Path,
        overrides: &Overrides,
        host: &Host,
    ) -> Result<Config, ConfigError> {
        let err = |message: String| ConfigError {
            file: path.into(),
            message,
        };
        let mut raw: RawConfig = if overrides.sets.is_empty() {
            toml::from_str(text).map_err(|e| err(one_line(&e.to_string())))?
        } else {
            let table = overrides.apply_sets(text).map_err(|e| err(e.to_string()))?;
            table.try_into().map_err(|e: toml::de::Error| {
                let given: Vec<String> = overrides
                    .sets
                    .iter()
                    .map(|s| format!("{} {}={}", s.source, s.key, s.value))
                    .collect();
                err(format!(
                    "{} (with the overrides {})",
                    one_line(&e.to_string()),
                    given.join(", ")
                ))
            })?
        };
        overrides.apply(&mut raw);
        let resolve = Resolve {
            base: path.parent().unwrap_or(Path::new(".")),
        };
        Self::validate(raw, path, &resolve, host).map_err(|e| err(e.to_string()))
    }

    /// Each section validates itself; then the checks that span sections.
    fn validate(
        raw: RawConfig,
        path: &Path,
        resolve: &Resolve,
        host: &Host,
    ) -> Result<Config, Invalid> {
        let cluster = raw.cluster.validate(resolve)?;
        let model = raw.model.validate(resolve)?;
        let mut train = raw.train.validate()?;
        let optimizer = raw.optimizer.validate()?;
        let clip_norm = raw.optimizer.clip_norm()?;
        let schedule = raw.schedule.validate(raw.optimizer.lr)?;
        let server = raw.server.validate(resolve)?;
        let worker = raw.worker.validate()?;
        let checkpoint = raw.checkpoint.validate(resolve)?;
        let w = cluster.workers;
        let data = raw.data.validate(resolve)?;
        if model.declared.is_none() && data.dir.as_os_str().is_empty() {
            return Err("[data] dir: required for the built-in model (its workers read the IDX files); train_len alone is for a declared model ([model] init), whose workers bring their own data".into());
        }

        // [train] x [cluster]: the global batch
        if train.batch_from_per_worker {
            let b = train.global_batch;
            train.global_batch = b
                .checked_mul(w)
                .filter(|&g| g as u64 <= limits::MAX_BATCH)
                .ok_or_else(|| {
                    format!(
                        "[train] per_worker_batch = {b} x [cluster] workers = {w}: expected a global batch of at most {}",
                        limits::MAX_BATCH
                    )
                })?;
        }
        if train.global_batch < w {
            return Err(invalid!(
                "[train] global_batch = {} is smaller than [cluster] workers = {w}: expected every worker to get at least one sample",
                train.global_batch
            ));
        }
        exact::resolve(&mut train, w, cluster.wire)?;
        // [train] micro_batches x the per-worker batches
        let k = train.micro_batches;
        if k > 1 {
            let b: Vec<usize> = split_even(train.global_batch, w)
                .iter()
                .map(|r| r.len())
                .collect();
            if let Some(bad) = b.iter().find(|&&b| b % k != 0) {
                return Err(invalid!(
                    "[train] micro_batches = {k} does not divide the per-worker batch {bad} (global batch {} over {w} workers: {b:?}): expected every worker's batch to split into {k} equal micro-batches",
                    train.global_batch
                ));
            }
        }
        // [server] x [cluster]: one metrics address per shard
        if !server.metrics_addrs.is_empty() && server.metrics_addrs.len() != cluster.servers.len() {
            return Err(invalid!(
                "[server] metrics_addrs has {} addresses: expected none or one per shard ({})",
                server.metrics_addrs.len(),
                cluster.servers.len()
            ));
        }
        let spec = match &model.declared {
            Some(d) => d.spec.clone(),
            None => MlpLayout::new(&model.dims).spec,
        };
        let names: Vec<String> = spec.tensors.iter().map(|t| t.name.clone()).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let groups = optimizer::resolve_groups(&raw.optimizer.groups, &names, &optimizer)?;
        let cfg = Config {
            path: path.to_path_buf(),
            cluster,
            model,
            data,
            train,
            optimizer,
            schedule,
            groups,
            clip_norm,
            server,
            worker,
            checkpoint,
        };
        // [model] x [train] x [optimizer] x [cluster]: the memory of the largest process
        cfg.check_memory(host)?;
        Ok(cfg)
    }

    /// Bytes the largest process of this run needs for the model (an estimate from below):
    /// a worker holds the parameters, its gradient and a pull buffer, plus the activations
    /// and their gradients of its batch; a shard holds its slice of the parameters, the
    /// previous version, an aggregated gradient and the optimizer's state (f32 throughout).
    /// None if it overflows u64.
    pub fn model_memory_bytes(&self) -> Option<u64> {
        let p = self.model.num_params();
        let b = *self.worker_batches().iter().max()? as u64;
        // a declared model's activations are unknown here (its worker is the user's code)
        let units: u64 = match (&self.model.declared, &self.model.cnn) {
            (_, Some(_)) => self.model.activation_units(),
            (Some(_), None) => 0,
            (None, None) => self.model.dims.iter().map(|&d| d as u64).sum(),
        };
        let worker = p
            .checked_mul(3)?
            .checked_add(b.checked_mul(units)?.checked_mul(2)?)?;
        let slots = match self.optimizer {
            Optimizer::Sgd { momentum, .. } => u64::from(momentum != 0.0),
            Optimizer::Adam { .. } => 2,
        };
        let slice = p.div_ceil(self.num_shards() as u64);
        let shard = slice.checked_mul(3 + slots)?;
        worker.max(shard).checked_mul(4)
    }

    fn check_memory(&self, host: &Host) -> Result<(), Invalid> {
        let need = self.model_memory_bytes();
        let Some(avail) = host.available_bytes else {
            return Ok(());
        };
        match need {
            Some(n) if n <= avail => Ok(()),
            _ => Err(invalid!(
                "[model] {} ({} parameters) with a per-worker batch of up to {}: needs about {} per process for parameters, optimizer state and gradient buffers, but this host has {} available (MemAvailable)",
                match &self.model.declared {
                    Some(d) => format!("init = {}", d.path.display()),
                    None => format!(
                        "hidden = {:?}",
                        &self.model.dims[1..self.model.dims.len() - 1]
                    ),
                },
                self.model.num_params(),
                self.worker_batches().iter().max().copied().unwrap_or(0),
                need.map_or("more than 16 EiB".to_string(), show_bytes),
                show_bytes(avail)
            )),
        }
    }

    /// Resolves this process's run id (`crate::runid::resolve`: `flag`, then `PS_RUN_ID` in
    /// `env`, then `[cluster] run_id`, then the scheduler's job id) and keeps it in
    /// `cluster.run_id`, where every request and checkpoint of this process takes it from.
    pub fn resolve_run_id(
        &mut self,
        flag: Option<&str>,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<crate::runid::RunId, ConfigError> {
        let r = crate::runid::resolve(flag, self.cluster.run_id.as_deref(), env).map_err(|e| {
            ConfigError {
                file: self.path.clone(),
                message: e.to_string(),
            }
        })?;
        self.cluster.run_id = r.id.clone();
        Ok(r)
    }

    /// The directory of the shards' checkpoints.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint
            .dir
            .clone()
            .unwrap_or_else(|| self.server.out_dir.join("checkpoints"))
    }

    /// The built-in model's layout: the CNN of `[model] kind = "cnn"`, else the MLP of
    /// `[model] hidden` (see [`Config::spec`] for the model the run trains, which may be
    /// declared instead).
    pub fn layout(&self) -> ModelLayout {
        match &self.model.cnn {
            Some(shape) => {
                ModelLayout::Cnn(CnnLayout::new(shape.clone()).expect("[model] was validated"))
            }
            None => ModelLayout::Mlp(MlpLayout::new(&self.model.dims)),
        }
    }

    /// The model the run trains: the declared one (`[model] init`) or the built-in model.
    pub fn spec(&self) -> ModelSpec {
        match &self.model.declared {
            Some(d) => d.spec.clone(),
            None => self.layout().into_spec(),
        }
    }

    /// The model in words: the MLP's widths, or the declared model's tensors and file.
    pub fn describe_model(&self) -> String {
        match &self.model.declared {
            Some(d) if self.model.cnn.is_some() => {
                format!(
                    "{}, initial weights from {}",
                    self.layout().describe(),
                    d.path.display()
                )
            }
            Some(d) => format!(
                "declared model of {} from {}",
                d.spec.describe(),
                d.path.display()
            ),
            None => self.layout().describe(),
        }
    }

    /// The initial values of `range` of the flat vector: from the seed for the MLP, read from
    /// the init file (that range only) for a declared model.
    pub fn initial_range(
        &self,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, ps_model::declared::DeclaredError> {
        match &self.model.declared {
            Some(d) => d.read_range(range),
            None => Ok(self.layout().init_range(self.train.seed, range)),
        }
    }

    /// Number of shards `S`.
    pub fn num_shards(&self) -> usize {
        self.cluster.servers.len()
    }

    /// The data order for a training set of `n` samples.
    pub fn data_order(&self, n: usize) -> ps_data::order::DataOrder {
        ps_data::order::DataOrder {
            seed: self.train.seed,
            n,
            global_batch: self.train.global_batch,
            keep_last: self.train.keep_last,
            micro_batch: self.train.exact_micro_batch.unwrap_or(1),
        }
    }

    /// Where the training data comes from, in words: the IDX directory, or the user's own
    /// data of `[data] train_len` samples.
    pub fn data_source(&self) -> String {
        match self.data.train_len {
            Some(n) => format!("the user's own ({n} samples, [data] train_len)"),
            None => self.data.dir.display().to_string(),
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
                    self.train.global_batch,
                    self.data_source()
                ),
            });
        }
        match (self.train.steps, self.train.epochs) {
            (Some(s), _) => Ok(s),
            (None, e) => {
                let e = e.unwrap_or(1);
                e.checked_mul(spe)
                    .filter(|&t| t <= MAX_STEPS)
                    .ok_or_else(|| ConfigError {
                        file: self.path.clone(),
                        message: format!(
                            "[train] epochs = {e} x {spe} steps per epoch ({n} samples in {}, global batch {}): expected at most {MAX_STEPS} steps",
                            self.data_source(),
                            self.train.global_batch
                        ),
                    })
            }
        }
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
        (0..self.cluster.workers)
            .map(|r| self.worker_slice(r).len())
            .collect()
    }

    /// Worker `rank`'s contiguous slice of a full global batch (positions in it): as even as
    /// possible, or, with `exact_sum`, whole micro-batches as even as possible.
    pub fn worker_slice(&self, rank: usize) -> std::ops::Range<usize> {
        let (b, w) = (self.train.global_batch, self.cluster.workers);
        match self.train.exact_micro_batch {
            Some(m) => {
                let r = split_even(b / m, w)[rank].clone();
                r.start * m..r.end * m
            }
            None => split_even(b, w)[rank].clone(),
        }
    }

    /// The optimizer in words, with its groups and gradient clipping: what the start-up line
    /// says and what a checkpoint's identity holds (a resume with other settings is refused).
    pub fn describe_optimizer(&self) -> String {
        let clip = match self.clip_norm {
            Some(c) => format!("; gradient clipped to global norm {c} (clip_grad_norm_)"),
            None => String::new(),
        };
        self.optimizer.describe() + &optimizer::describe_groups(&self.groups) + &clip
    }

    /// The single-process run this configuration is equivalent to: the sum-or-mean table of the README.
    pub fn equivalence(&self) -> Equivalence {
        let w = self.cluster.workers as f64;
        let b = self.worker_batches();
        let uneven = b.iter().any(|&x| x != b[0]);
        let mut warnings = Vec::new();
        let mut mean_of_means = false;
        let (grad_scale, exact) = match (self.train.loss_reduction, self.train.aggregation) {
            (LossReduction::Mean, Aggregation::Mean) if self.train.exact_micro_batch.is_some() => {
                (1.0, true)
            }
            (LossReduction::Mean, Aggregation::Mean) => {
                if uneven {
                    warnings.push(format!(
                        "aggregation \"mean\" with uneven per-worker batches {b:?} weights every worker equally, so samples on smaller workers count more: the result is NOT exactly the single-process run (it is exactly the mean of the workers' mean gradients); use aggregation = \"weighted\""
                    ));
                }
                if self.train.keep_last {
                    warnings.push("aggregation \"mean\" with keep_last = true: the short last batch of each epoch is split unevenly, and mean of means is biased there; use aggregation = \"weighted\"".into());
                }
                mean_of_means = uneven || self.train.keep_last;
                (1.0, !mean_of_means)
            }
            (LossReduction::Mean, Aggregation::Weighted) => (1.0, true),
            (LossReduction::Mean, Aggregation::Sum) => {
                warnings.push(format!(
                    "loss_reduction \"mean\" with aggregation \"sum\" makes the gradient {w} times the single-process mean gradient: this is the learning rate times {w} (use aggregation = \"mean\" or \"weighted\" to keep the lr you set). {SUM_OR_MEAN}."
                ));
                // uneven parts: the sum of the workers' mean gradients is W times their mean
                // of means, not W times the global-batch mean
                mean_of_means = uneven;
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
        let mut exact = exact;
        if self.cluster.wire == Wire::Bf16 {
            warnings.push("wire \"bf16\": gradients pushed over the network travel as bfloat16 with error feedback on each worker (shared-memory pushes and pulls stay f32): the run no longer equals the single-process one exactly".into());
            exact = false;
        }
        // clipping looks at the gradient's size: a scaled gradient is not a scaled lr then
        let lr_is_scale = self.clip_norm.is_none()
            && matches!(self.optimizer, Optimizer::Sgd { weight_decay, .. } if weight_decay == 0.0);
        Equivalence {
            global_batch: self.train.global_batch,
            loss_reduction: self.train.loss_reduction,
            grad_scale,
            lr: self.schedule.base_lr * grad_scale,
            lr_is_scale,
            exact,
            mean_of_means,
            workers: self.cluster.workers,
            warnings,
            clip_norm: self.clip_norm,
            micro_batches: self.train.micro_batches,
            exact_sum: exact::statement(&self.train, self.clip_norm.is_some()),
            buffers: self.model.declared.as_ref().and_then(|d| {
                if !d.buffers.is_empty() {
                    Some(format!(
                        "; the model's {} buffers (BatchNorm statistics, ...) as DDP's broadcast_buffers: each worker's forward pass, BatchNorm included, sees only its own samples of a step (per-worker batch statistics: batch norm over b_r = {b:?}, ghost batch norm, not over {}), and every worker starts each step from rank 0's buffers, which are the model's",
                        d.buffers.len(),
                        self.train.global_batch
                    ))
                } else {
                    batch_statistics_statement(&d.batch_statistics, &b, self.train.global_batch)
                }
            }),
        }
    }

    /// The resolved configuration, printed at start-up.
    pub fn describe(&self) -> String {
        let b = self.worker_batches();
        let stop = match (self.train.steps, self.train.epochs) {
            (Some(s), _) => format!("{s} steps"),
            (_, Some(e)) => format!("{e} epochs"),
            _ => unreachable!(),
        };
        format!(
            "config {}: {} shards {:?}, {} workers, transport {}{}, {}; {}; data {}; seed {}; global batch {} ({}), per-worker batches {:?}; {stop}{}; loss reduction {}, aggregation {}; optimizer {}; lr {}; log every {} steps, eval every {}; {}",
            self.path.display(),
            self.num_shards(),
            self.cluster.servers,
            self.cluster.workers,
            self.cluster.transport,
            match self.cluster.wire {
                Wire::F32 => "",
                Wire::Bf16 => {
                    ", wire bf16 (gradients over the network as bfloat16 with error feedback: NOT exactly one process)"
                }
            },
            match (self.cluster.token.is_some(), self.cluster.tls.is_some()) {
                (true, true) => "TLS, shared token required",
                (true, false) => "shared token required, no TLS",
                (false, true) => "TLS, no token",
                (false, false) => "no authentication, no TLS",
            },
            self.describe_model(),
            self.data_source(),
            self.train.seed,
            self.train.global_batch,
            if self.train.batch_from_per_worker {
                "from per_worker_batch"
            } else {
                "as stated"
            },
            b,
            if self.train.keep_last {
                ", short last batch kept"
            } else {
                ", short last batch dropped"
            },
            self.train.loss_reduction,
            self.train.aggregation,
            self.describe_optimizer(),
            self.schedule.describe(),
            self.train.log_every,
            if self.train.eval_every == 0 {
                "run (at the end only)".to_string()
            } else {
                format!("{} steps", self.train.eval_every)
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

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn show_bytes(b: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    if b as f64 >= GIB {
        format!("{:.1} GiB", b as f64 / GIB)
    } else {
        format!("{:.1} MiB", b as f64 / MIB)
    }
}

/// The config file's text; bounded like every file a config names (a config is never
/// near 1 MiB).
fn read_config_text(path: &Path) -> Result<String, Invalid> {
    let bytes = limits::read_bounded(path, limits::MAX_CONFIG_FILE_BYTES)
        .map_err(|e| invalid!("cannot read the config file: {e}"))?;
    String::from_utf8(bytes).map_err(|_| "cannot read the config file: not UTF-8".into())
}

#[cfg(test)]
mod tests;
