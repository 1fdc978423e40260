//! Building a shard: from the seed or a declared model's init file (version 0), or from a
//! checkpoint; the shared-memory host, the barrier's rules and the per-bucket plan are chosen
//! here.

use crate::barrier::{Barrier, Rules};
use crate::checkpoint::{self, Saved};
use crate::intake::{Acc, Gate};
use crate::shm::ShmHost;
use crate::store::Store;
use crate::{Shard, State, bucket, unused};
use bytes::Bytes;
use ps_config::{Config, Transport};
use ps_net::shm::shm_root;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Why a shard cannot start from its initial weights or a checkpoint
/// ([`Shard::try_starting_from`]).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The declared model's init file cannot be read.
    #[error(transparent)]
    Init(#[from] ps_model::declared::DeclaredError),
    /// A checkpoint without buffers for a model that has them.
    #[error(
        "the checkpoint of version {version} holds no buffers, but the run's model has buffers ([model] init names them): a checkpoint of another model"
    )]
    NoBuffers {
        /// The checkpoint's version.
        version: u64,
    },
}

impl Shard {
    /// Builds shard `index` of `cfg` for a run of `total_steps`, with initial weights from the
    /// seed (or, for a declared model, from its init file: see [`Shard::try_starting_from`]).
    pub fn new(cfg: &Config, index: usize, total_steps: u64) -> Arc<Self> {
        Self::starting_from(cfg, index, total_steps, None)
    }

    /// The range of the flat vector that shard `index` of `cfg` holds.
    pub fn range_of(cfg: &Config, index: usize) -> Range<usize> {
        ps_model::layout::shard_ranges(cfg.spec().num_params(), cfg.num_shards())[index].clone()
    }

    /// Like [`Shard::new`], but from `saved` (a checkpoint) when given: its version, parameters
    /// and optimizer state. A declared model's init file that cannot be read (it changed
    /// after the config was loaded) leaves NaN weights: use [`Shard::try_starting_from`].
    pub fn starting_from(
        cfg: &Config,
        index: usize,
        total_steps: u64,
        saved: Option<Saved>,
    ) -> Arc<Self> {
        let saved = saved.or_else(|| {
            let range = Self::range_of(cfg, index);
            let init = cfg
                .initial_range(range.clone())
                .unwrap_or_else(|_| vec![f32::NAN; range.len()]);
            let opt = cfg.optimizer.init_state(init.len());
            let buffers = Self::initial_buffers(cfg, index).ok().flatten();
            Some(Saved {
                version: 0,
                params: init,
                opt,
                buffers,
            })
        });
        Self::build(cfg, index, total_steps, saved.expect("filled in"))
    }

    /// [`Shard::starting_from`], with the error of an unreadable init file (declared models).
    pub fn try_starting_from(
        cfg: &Config,
        index: usize,
        total_steps: u64,
        saved: Option<Saved>,
    ) -> Result<Arc<Self>, StartError> {
        let saved = match saved {
            Some(s) => s,
            None => {
                let init = cfg.initial_range(Self::range_of(cfg, index))?;
                let opt = cfg.optimizer.init_state(init.len());
                Saved {
                    version: 0,
                    params: init,
                    opt,
                    buffers: Self::initial_buffers(cfg, index)?,
                }
            }
        };
        if saved.buffers.is_none() && Self::buffer_model(cfg, index).is_some() {
            return Err(StartError::NoBuffers {
                version: saved.version,
            });
        }
        Ok(Self::build(cfg, index, total_steps, saved))
    }

    /// The declared model when shard `index` holds its buffers (shard 0, a model with buffers).
    fn buffer_model(cfg: &Config, index: usize) -> Option<ps_model::declared::Declared> {
        cfg.model
            .declared
            .as_ref()
            .filter(|d| index == 0 && !d.buffers.is_empty())
            .cloned()
    }

    /// The buffers of version 0 on shard `index` (from the init file), None when it holds none.
    fn initial_buffers(
        cfg: &Config,
        index: usize,
    ) -> Result<Option<Bytes>, ps_model::declared::DeclaredError> {
        match Self::buffer_model(cfg, index) {
            Some(d) => Ok(d.initial_buffers()?.map(Bytes::from)),
            None => Ok(None),
        }
    }

    fn build(cfg: &Config, index: usize, total_steps: u64, saved: Saved) -> Arc<Self> {
        let spec = cfg.spec();
        let range = Self::range_of(cfg, index);
        let (version, init, opt, buffers) = (saved.version, saved.params, saved.opt, saved.buffers);
        let w = cfg.cluster.workers;
        let shm = match (cfg.cluster.transport, shm_root()) {
            (Transport::Auto, Some(root)) => {
                let run = ps_config::runid::board_prefix(cfg.cluster.run_id.as_deref());
                ShmHost::create(&root, &run, index, w)
            }
            _ => None,
        };
        let rules = Rules {
            warn: Duration::from_secs_f64(cfg.server.barrier_warn_secs),
            timeout: Duration::from_secs_f64(cfg.server.barrier_timeout_secs),
            first_worker: Duration::from_secs_f64(
                cfg.worker.connect_timeout_secs + cfg.server.barrier_timeout_secs,
            ),
            policy: cfg.server.barrier_policy,
        };
        let exact = cfg.train.exact_micro_batch;
        let mode = if exact.is_some() {
            bucket::Mode::Whole("the exact sum (exact_sum) adds the workers' whole partial sums")
        } else {
            bucket::Mode::of(cfg.clip_norm.is_some(), cfg.server.max_pending_gradients, w)
        };
        let buckets = match &mode {
            bucket::Mode::Buckets => bucket::plan(&spec, &range),
            bucket::Mode::Whole(_) => Vec::new(),
        };
        let state = State {
            barrier: Barrier::new(w, version, total_steps, rules, Instant::now()),
            store: Store::heap(version, init),
            opt: Arc::new(opt),
            track: Default::default(),
            spare: Vec::new(),
            left: vec![None; w],
            failed: None,
            told: vec![false; w],
            unused: unused::Unused::new(w, spec.tensors.len()),
            constants: Default::default(),
            buffers,
            next_buffers: None,
        };
        Arc::new(Self {
            index,
            range,
            world: w,
            num_params: spec.num_params(),
            spec,
            num_shards: cfg.num_shards(),
            total_steps,
            aggregation: cfg.train.aggregation,
            exact,
            optimizer: cfg.optimizer.clone(),
            group_of: {
                let mut of = vec![None; cfg.spec().tensors.len()];
                for (g, group) in cfg.groups.iter().enumerate() {
                    for &t in &group.tensors {
                        of[t as usize] = Some(g);
                    }
                }
                of
            },
            groups: cfg.groups.clone(),
            clip_norm: cfg.clip_norm,
            exchange: std::sync::OnceLock::new(),
            schedule: cfg.schedule_for(total_steps),
            state: Mutex::new(state),
            // the exact sum holds every rank's partial sum until the barrier (it does not fold)
            gate: Gate::new(if exact.is_some() {
                cfg.server.max_pending_gradients.max(w)
            } else {
                cfg.server.max_pending_gradients
            }),
            acc: Mutex::new(Acc::default()),
            buckets,
            mode,
            work: Mutex::default(),
            version_tx: watch::Sender::new(version),
            told_changed: tokio::sync::Notify::new(),
            shm,
            checkpoint: checkpoint::Plan::of(cfg, index, Self::range_of(cfg, index)),
            preempt: Default::default(),
            preempt_plan: checkpoint::Plan::for_preemption(cfg, index, Self::range_of(cfg, index)),
            buffer_model: Self::buffer_model(cfg, index),
            preempt_saved: watch::Sender::new(None),
            preempt_closed: std::sync::Mutex::new(false),
        })
    }
}
