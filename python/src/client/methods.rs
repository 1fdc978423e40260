//! [`Client`]'s Python methods (one `#[pymethods]` block: pyo3 takes one per class).

use super::Client;
use crate::buffers::f32_buffer;
use crate::errors::{ModelMismatchError, after_failure, runtime_err};
use crate::lent::{NEXT_KEY, PyRegistrar};
use ps_config::Config;
use ps_data::order::BatchPlanner;
use ps_net::session::Session;
use ps_proto::pb::TensorDesc;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::path::Path;
use std::sync::atomic::Ordering;

#[pymethods]
impl Client {
    /// Reads `config`, resolves the rank (the argument, else RANK / SLURM_PROCID /
    /// JOB_COMPLETION_INDEX as ps-worker does) and checks `model` (a list of (name, shape) in
    /// flat order) against the run's model.
    #[new]
    #[pyo3(signature = (config, model, rank=None, servers=None, run_id=None))]
    fn new(
        config: &str,
        model: Vec<(String, Vec<u64>)>,
        rank: Option<usize>,
        servers: Option<Vec<String>>,
        run_id: Option<String>,
    ) -> PyResult<Self> {
        let env: std::collections::HashMap<String, String> = std::env::vars().collect();
        // config keys from the environment (PS_SET_<SECTION>_<KEY>) as ps-worker takes them
        let overrides = ps_config::Overrides::from_env(&env);
        let mut cfg = Config::load_with(Path::new(config), &overrides)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        // the run id as ps-worker resolves it: the argument, PS_RUN_ID, [cluster] run_id, the
        // scheduler's job id
        cfg.resolve_run_id(run_id.as_deref(), &env)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let place = ps_process::env::resolve(rank, None, None, &env)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let world = place.world.unwrap_or(cfg.cluster.workers);
        if world != cfg.cluster.workers {
            return Err(PyValueError::new_err(format!(
                "world size {world} (from {}) differs from [cluster] workers = {} in {config}",
                place.world_source.unwrap_or("the environment"),
                cfg.cluster.workers
            )));
        }
        if place.rank >= world {
            return Err(PyValueError::new_err(format!(
                "rank {} (from {}): expected a rank in 0..{world}",
                place.rank, place.source
            )));
        }
        let servers = servers.unwrap_or_else(|| cfg.cluster.servers.clone());
        if servers.len() != cfg.num_shards() {
            return Err(PyValueError::new_err(format!(
                "{} server addresses given: expected {} (one per shard in {config})",
                servers.len(),
                cfg.num_shards()
            )));
        }
        let theirs: Vec<(String, Vec<usize>)> = model
            .iter()
            .map(|(n, s)| (n.clone(), s.iter().map(|&d| d as usize).collect()))
            .collect();
        let spec = cfg.spec();
        if let Some(diff) = ps_model::declared::first_difference(&spec, &theirs) {
            return Err(ModelMismatchError::new_err(format!(
                "model mismatch: {diff} ({config} trains {})",
                cfg.describe_model()
            )));
        }
        let model: Vec<TensorDesc> = model
            .into_iter()
            .map(|(name, shape)| TensorDesc { name, shape })
            .collect();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let offsets = model
            .iter()
            .scan(0usize, |off, t| {
                let at = *off;
                *off += t.shape.iter().product::<u64>() as usize;
                Some(at)
            })
            .collect();
        Ok(Self {
            rt,
            offsets,
            num_params: spec.num_params(),
            cfg,
            servers,
            rank: place.rank,
            model,
            session: None,
            planner: None,
            pulling: None,
            terms: Default::default(),
            lent: None,
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
            pulled: Vec::new(),
        })
    }

    /// Registers with every shard for a training set of `train_len` samples; returns
    /// (the step to start at, the run's total steps).
    fn connect(&mut self, py: Python<'_>, train_len: usize) -> PyResult<(u64, u64)> {
        self.give_back(py); // a session before this one: its push buffer goes below
        self.pulled.clear();
        let (cfg, servers, rank, model) = (&self.cfg, &self.servers, self.rank, self.model.clone());
        let rt = &self.rt;
        let session = py
            .detach(|| rt.block_on(Session::connect(cfg, servers, rank, model, train_len)))
            .map_err(runtime_err)?;
        let r = (session.start_step, session.total_steps);
        self.planner = Some(BatchPlanner::new(self.cfg.data_order(train_len)));
        self.session = Some(session);
        Ok(r)
    }

    /// Sets up the data order for a training set of `train_len` samples without connecting
    /// (for a single-process reference of the same batches; `connect` does it too).
    fn plan(&mut self, train_len: usize) {
        self.planner = Some(BatchPlanner::new(self.cfg.data_order(train_len)));
    }

    /// The run's total steps for a training set of `n` samples.
    fn total_steps_for(&self, n: usize) -> PyResult<u64> {
        self.cfg
            .total_steps(n)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// This rank's sample indices of step `step`, in order (the data-order contract).
    fn batch(&mut self, step: u64) -> PyResult<Vec<u32>> {
        let (rank, world) = (self.rank, self.cfg.cluster.workers);
        let planner = self.planner.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        Ok(planner.worker_batch(step, rank, world).to_vec())
    }

    /// Pulls version `version` from every shard into `dst` (float32, the whole flat vector).
    fn pull(&mut self, py: Python<'_>, version: u64, dst: &Bound<'_, PyAny>) -> PyResult<()> {
        let addr = f32_buffer(dst, self.num_params, true, "pull destination")?;
        let n = self.num_params;
        self.pulled.clear();
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| {
            // SAFETY: `addr` is a writable, C-contiguous float32 buffer of n values that the
            // caller (holding a reference to it, blocked in this call) keeps alive and does
            // not touch until this returns.
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, n) };
            rt.block_on(session.pull(version, dst))
                .map_err(|e| after_failure(rt, session, version, e))
        })
    }

    /// Registers the parameters boards of the shards on this host for `borrower`'s device
    /// (`ps_torch._device.ParamBoards`): `borrower.register(address, nbytes)` once per board
    /// mapping (it raises to refuse), and `borrower.release(address)` exactly once before that
    /// mapping goes away (`close`, a new `connect`, a lost shard's boards replaced, this
    /// client's end). Returns how many parameters boards the session has (0 over gRPC: pull
    /// with `pull`). A refusal raises RuntimeError naming the board.
    fn register_param_boards(&mut self, borrower: Py<PyAny>) -> PyResult<usize> {
        let registrar = PyRegistrar {
            key: self.key,
            borrower,
        };
        self.session()?
            .register_param_boards(&registrar)
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Pulls version `version` as `pull` does, except that each shard whose parameters board
    /// was registered (`register_param_boards`) lends its slot of the version instead of
    /// copying it into `dst`: per shard, `(lo, hi, address)`, the flat range and where its
    /// values lie, `address` 0 when they were copied into `dst[lo:hi]`. The slot may be
    /// overwritten at any time: read it only by device copies, and use what they read only if
    /// `verify_pulled()` says so once they completed.
    fn pull_lent(
        &mut self,
        py: Python<'_>,
        version: u64,
        dst: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(usize, usize, usize)>> {
        let addr = f32_buffer(dst, self.num_params, true, "pull destination")?;
        let (n, key) = (self.num_params, self.key);
        self.pulled.clear();
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        let slots = py.detach(|| {
            // SAFETY: as in `pull`.
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, n) };
            rt.block_on(session.pull_lent(version, dst, key))
                .map_err(|e| after_failure(rt, session, version, e))
        })?;
        let spans = slots
            .iter()
            .map(|(r, slot)| {
                // SAFETY: only the slot's address is taken, for device copies (see above)
                let at = slot
                    .as_ref()
                    .map_or(0, |s| unsafe { s.values(0..s.len()) }.as_ptr() as usize);
                (r.start, r.end, at)
            })
            .collect();
        self.pulled = slots.into_iter().map(|(_, slot)| slot).collect();
        Ok(spans)
    }

    /// After the device's copies out of the slots of the last `pull_lent` completed: None when
    /// every slot still holds the version pulled (the copies read it alone), else why not
    /// (the shard and version torn: the values read must not be used). The slots are let go.
    fn verify_pulled(&mut self) -> Option<String> {
        let slots = std::mem::take(&mut self.pulled);
        slots.iter().enumerate().find_map(|(shard, slot)| {
            slot.as_ref().filter(|s| !s.intact()).map(|s| {
                ps_net::gate::GateError::Torn {
                    shard,
                    version: s.version(),
                }
                .to_string()
            })
        })
    }

    /// Starts pulling `version` into `dst` (float32, the whole flat vector) in the background,
    /// while the caller's forward pass runs: before reading the parameters in `dst[lo:hi]`
    /// call `wait_pulled(lo, hi)`; end the pull with `finish_pull()` before anything else.
    /// `ranges`: the `(lo, hi)` ranges that will be waited for (the modules' parameters).
    fn begin_pull(
        &mut self,
        version: u64,
        dst: &Bound<'_, PyAny>,
        ranges: Vec<(usize, usize)>,
    ) -> PyResult<()> {
        let addr = f32_buffer(dst, self.num_params, true, "pull destination")?;
        let _runtime = self.rt.enter();
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        let layers = ranges.into_iter().map(|(lo, hi)| lo..hi).collect();
        // SAFETY: `addr` is a writable, C-contiguous float32 buffer of num_params values;
        // this client keeps a reference to it (`pulling`) until the pull has ended
        // (`finish_pull`, `close`, or the session dropped, which stops the pull first), and
        // the Python side (ps_torch.Worker) reads only the ranges `wait_pulled` returned True
        // for, and writes none, until `finish_pull`.
        unsafe { session.begin_pull(version, addr as *mut f32, layers) }.map_err(runtime_err)?;
        self.pulling = Some(dst.clone().unbind());
        Ok(())
    }

    /// Waits (without the GIL, bounded) until `dst[lo:hi]` of the pull under way is in: True,
    /// or False when the pull failed (`finish_pull` raises its error; the values are not to
    /// be used). True when no pull is under way.
    fn wait_pulled(&mut self, py: Python<'_>, lo: usize, hi: usize) -> PyResult<bool> {
        let session = self.session()?;
        Ok(py.detach(|| session.wait_pulled(lo..hi)))
    }

    /// Ends the pull of `begin_pull`, waiting for all of it; raises its error (RolledBack
    /// after a lost shard, once the cluster recovered, as `pull` does).
    fn finish_pull(&mut self, py: Python<'_>) -> PyResult<()> {
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        let version = session.pulling_version();
        let ended = py.detach(|| {
            rt.block_on(session.finish_pull())
                .map_err(|e| after_failure(rt, session, version.unwrap_or_default(), e))
        });
        self.pulling = None;
        ended
    }

    /// Pushes the flat gradient `grad` (float32) of step `step` to every shard.
    #[pyo3(signature = (step, grad, samples, loss_sum, correct, eval_correct=0, eval_count=0))]
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        py: Python<'_>,
        step: u64,
        grad: &Bound<'_, PyAny>,
        samples: u32,
        loss_sum: f64,
        correct: u64,
        eval_correct: u64,
        eval_count: u64,
    ) -> PyResult<()> {
        self.refuse_in_exact("push")?;
        let addr = f32_buffer(grad, self.num_params, false, "gradient")?;
        let n = self.num_params;
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| {
            // SAFETY: as in `pull`, a float32 buffer of n values alive for this call.
            let src = unsafe { std::slice::from_raw_parts(addr as *const f32, n) };
            session.grad_mut().copy_from_slice(src);
            rt.block_on(session.push(step, samples, loss_sum, correct, (eval_correct, eval_count)))
                .map_err(|e| after_failure(rt, session, step, e))
        })
    }

    /// Pushes the gradient of step `step` given as one float32 array per tensor in flat order
    /// (their lengths adding up to the parameter count): each is copied once, straight into
    /// the buffer the shards read (the shared-memory board on one host).
    #[pyo3(signature = (step, grads, samples, loss_sum, correct, eval_correct=0, eval_count=0))]
    #[allow(clippy::too_many_arguments)]
    fn push_parts(
        &mut self,
        py: Python<'_>,
        step: u64,
        grads: Vec<Bound<'_, PyAny>>,
        samples: u32,
        loss_sum: f64,
        correct: u64,
        eval_correct: u64,
        eval_count: u64,
    ) -> PyResult<()> {
        self.refuse_in_exact("push_parts")?;
        self.check_tensor_count(grads.len())?;
        let mut parts = Vec::with_capacity(grads.len());
        for (g, t) in grads.iter().zip(&self.model) {
            let len = t.shape.iter().product::<u64>() as usize;
            parts.push((
                f32_buffer(g, len, false, &format!("gradient of {}", t.name))?,
                len,
            ));
        }
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| {
            let dst = session.grad_mut();
            let mut off = 0;
            for (addr, len) in parts {
                // SAFETY: a float32 buffer of `len` values, alive for this call (the caller
                // holds the arrays and is blocked in it).
                let src = unsafe { std::slice::from_raw_parts(addr as *const f32, len) };
                dst[off..off + len].copy_from_slice(src);
                off += len;
            }
            rt.block_on(session.push(step, samples, loss_sum, correct, (eval_correct, eval_count)))
                .map_err(|e| after_failure(rt, session, step, e))
        })
    }

    /// Starts a push of step `step` that overlaps backward: give each tensor's gradient to
    /// `grad_ready` as backward produces it (a shard's push starts once its range is complete),
    /// then wait with `finish_push`.
    #[pyo3(signature = (step, samples, loss_sum, correct, eval_correct=0, eval_count=0))]
    fn begin_push(
        &mut self,
        step: u64,
        samples: u32,
        loss_sum: f64,
        correct: u64,
        eval_correct: u64,
        eval_count: u64,
    ) -> PyResult<()> {
        self.refuse_in_exact("begin_push")?;
        self.session()?
            .begin_push(step, samples, loss_sum, correct, (eval_correct, eval_count))
            .map_err(runtime_err)
    }

    /// Writes the gradient of tensor `index` (flat order; a float32 array of its length) into
    /// the push buffer, starting the push of every shard whose range it completes.
    fn grad_ready(
        &mut self,
        py: Python<'_>,
        index: usize,
        grad: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let t = self.model.get(index).ok_or_else(|| {
            PyValueError::new_err(format!(
                "tensor index {index}: the model has {} tensors",
                self.model.len()
            ))
        })?;
        let len = t.shape.iter().product::<u64>() as usize;
        let addr = f32_buffer(grad, len, false, &format!("gradient of {}", t.name))?;
        let offset = self.offsets[index];
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| {
            let _in_runtime = rt.enter();
            // SAFETY: a float32 buffer of `len` values, alive for this call (the caller holds
            // the array and is blocked in it).
            let src = unsafe { std::slice::from_raw_parts(addr as *const f32, len) };
            session.grad_ready(offset, src)
        })
        .map_err(runtime_err)
    }

    /// Waits for the pushes of the step begun with `begin_push`.
    fn finish_push(&mut self, py: Python<'_>) -> PyResult<()> {
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        let step = session.pushing_step();
        py.detach(|| {
            rt.block_on(session.finish_push()).map_err(|e| match step {
                Some(t) => after_failure(rt, session, t, e),
                None => runtime_err(e),
            })
        })
    }

    /// Lends the push buffer, the memory the shards read this worker's gradient from (its
    /// shared-memory board on one host, else the buffer the gRPC push encodes from): returns
    /// its (address, float32 values). The caller writes the gradient there in place (a GPU
    /// copies into it once registered for DMA) and pushes it with `push_in_place`. `release`
    /// (a callable with no argument) is called exactly once before the buffer goes away
    /// (`close`, a new `connect`, this client's end): the caller unregisters it there. The
    /// buffer stays at the same address until then (also across a lost shard's recovery).
    fn lend_grad_buffer(&mut self, release: Py<PyAny>) -> PyResult<(usize, usize)> {
        self.refuse_in_exact("lend_grad_buffer")?;
        if self.lent.is_some() {
            return Err(PyRuntimeError::new_err(
                "the push buffer is lent already (one borrower until close)",
            ));
        }
        let grad = self.session()?.grad_mut();
        let lent = (grad.as_mut_ptr() as usize, grad.len());
        self.lent = Some(release);
        Ok(lent)
    }

    /// Pushes the gradient of step `step` as the push buffer holds it (written in place
    /// through `lend_grad_buffer`'s address) to every shard, copying nothing on this side.
    #[pyo3(signature = (step, samples, loss_sum, correct, eval_correct=0, eval_count=0))]
    #[allow(clippy::too_many_arguments)]
    fn push_in_place(
        &mut self,
        py: Python<'_>,
        step: u64,
        samples: u32,
        loss_sum: f64,
        correct: u64,
        eval_correct: u64,
        eval_count: u64,
    ) -> PyResult<()> {
        self.refuse_in_exact("push_in_place")?;
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| {
            rt.block_on(session.push(step, samples, loss_sum, correct, (eval_correct, eval_count)))
                .map_err(|e| after_failure(rt, session, step, e))
        })
    }

    /// Tells each shard holding part of them that this worker's backward of `step` did not
    /// reach `tensors` (indices in flat order), before the step's push (whose gradient holds
    /// zeros there): a tensor no rank reached is not updated, as torch.optim skips it.
    fn mark_unused(&mut self, py: Python<'_>, step: u64, tensors: Vec<u32>) -> PyResult<()> {
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| {
            rt.block_on(session.mark_unused(step, &tensors))
                .map_err(|e| after_failure(rt, session, step, e))
        })
    }

    /// Has shard 0 check this worker's frozen parameters and buffers, given as (name, shape,
    /// dtype, fingerprint, is a buffer), against the first worker's: ModelMismatchError naming
    /// the first entry that differs.
    fn check_constants(
        &mut self,
        py: Python<'_>,
        entries: Vec<(String, Vec<u64>, String, u64, bool)>,
    ) -> PyResult<()> {
        let entries = entries
            .into_iter()
            .map(
                |(name, shape, dtype, fingerprint, buffer)| ps_proto::pb::TensorPrint {
                    name,
                    shape,
                    dtype,
                    fingerprint,
                    buffer,
                },
            )
            .collect();
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| rt.block_on(session.check_constants(entries)))
            .map_err(runtime_err)
    }

    /// Puts this worker's buffers (`data`: a safetensors serialization of every buffer of the
    /// model) after the forward pass of `step`: rank 0 only, before its push of the step.
    fn put_buffers(&mut self, py: Python<'_>, step: u64, data: Vec<u8>) -> PyResult<()> {
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| {
            rt.block_on(session.put_buffers(step, bytes::Bytes::from(data)))
                .map_err(|e| after_failure(rt, session, step, e))
        })
    }

    /// The model's buffers of `version` (a safetensors serialization), from shard 0.
    fn get_buffers<'py>(
        &mut self,
        py: Python<'py>,
        version: u64,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        let data = py.detach(|| {
            rt.block_on(session.get_buffers(version))
                .map_err(|e| after_failure(rt, session, version, e))
        })?;
        Ok(pyo3::types::PyBytes::new(py, &data))
    }

    /// The buffers of the run's model as (name, dtype, shape): the init file's `buffer_order`
    /// (safetensors dtype names: "F32", "I64", ...); empty when it has none.
    #[getter]
    fn buffer_specs(&self) -> Vec<(String, String, Vec<usize>)> {
        self.cfg
            .model
            .declared
            .iter()
            .flat_map(|d| &d.buffers)
            .map(|b| (b.name.clone(), format!("{:?}", b.dtype), b.shape.clone()))
            .collect()
    }

    /// Tells every shard that this worker stopped on an error (`why`) before the run's end,
    /// so the run fails at once instead of at the barrier timeout (best effort, bounded).
    fn abandon(&mut self, py: Python<'_>, why: &str) {
        let rt = &self.rt;
        if let Some(session) = self.session.as_mut() {
            py.detach(|| rt.block_on(session.abandon(why)));
        }
    }

    /// Leaves every shard, reporting this rank's final test evaluation (0/0 when none).
    #[pyo3(signature = (eval_correct=0, eval_count=0))]
    fn leave(&mut self, py: Python<'_>, eval_correct: u64, eval_count: u64) -> PyResult<()> {
        let rt = &self.rt;
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| rt.block_on(session.leave(eval_correct, eval_count)))
            .map_err(runtime_err)
    }

    /// Drops the connections and this worker's shared-memory gradient board (stopping a pull
    /// under way first), after the release callable of the push buffer lent out, if any.
    fn close(&mut self, py: Python<'_>) {
        self.give_back(py);
        self.pulled.clear();
        self.session = None;
        self.pulling = None;
    }

    /// (pushes, seconds in pushes, pulls, seconds in pulls) so far.
    fn timing(&mut self) -> PyResult<(u64, f64, u64, f64)> {
        let t = self.session()?.timing;
        Ok((
            t.pushes,
            t.push.as_secs_f64(),
            t.pulls,
            t.pull.as_secs_f64(),
        ))
    }

    /// How tensors travel to each shard ("shared memory", "gRPC", ...).
    fn transport(&mut self) -> PyResult<Vec<String>> {
        Ok(self
            .session()?
            .transport()
            .iter()
            .map(|s| s.to_string())
            .collect())
    }

    /// `[train] exact_micro_batch`, the samples of a gradient term, when `[train] exact_sum`
    /// is on; None otherwise.
    #[getter]
    fn exact_micro_batch(&self) -> Option<usize> {
        self.cfg.train.exact_micro_batch
    }

    /// `[train] exact_sum`: starts step `step`'s exact partial sum at zero (terms of an
    /// earlier attempt of any step are dropped).
    fn begin_terms(&mut self, step: u64) -> PyResult<()> {
        if self.cfg.train.exact_micro_batch.is_none() {
            return Err(PyValueError::new_err(
                "exact terms: [train] exact_sum is off in this run's config",
            ));
        }
        self.terms.0 = Some(step);
        self.terms.1.reset(self.num_params);
        Ok(())
    }

    /// `[train] exact_sum`: adds one micro-batch's gradient term of step `step` to its exact
    /// partial sum, without rounding: one float32 array per tensor in flat order, None for
    /// a tensor its backward did not reach (zeros).
    fn add_term(
        &mut self,
        py: Python<'_>,
        step: u64,
        grads: Vec<Option<Bound<'_, PyAny>>>,
    ) -> PyResult<()> {
        if self.terms.0 != Some(step) {
            return Err(PyRuntimeError::new_err(format!(
                "a term of step {step}: call begin_terms({step}) first (the sum under way is of step {:?})",
                self.terms.0
            )));
        }
        self.check_tensor_count(grads.len())?;
        let mut parts = Vec::with_capacity(grads.len());
        for ((g, t), &off) in grads.iter().zip(&self.model).zip(&self.offsets) {
            if let Some(g) = g {
                let len = t.shape.iter().product::<u64>() as usize;
                let addr = f32_buffer(g, len, false, &format!("gradient of {}", t.name))?;
                parts.push((off, addr, len));
            }
        }
        let sum = &mut self.terms.1;
        py.detach(|| {
            for (off, addr, len) in parts {
                // SAFETY: a float32 buffer of `len` values, alive for this call (the caller
                // holds the arrays and is blocked in it).
                let src = unsafe { std::slice::from_raw_parts(addr as *const f32, len) };
                sum.add_term_at(off, src)?;
            }
            Ok::<_, ps_net::exact::ExactError>(())
        })
        .map_err(|e| {
            self.terms.0 = None;
            PyValueError::new_err(format!("step {step}: exact sum: {e}"))
        })
    }

    /// `[train] exact_sum`: pushes step `step`'s exact partial sum (its terms added with
    /// `add_term`), encoded, to every shard, which add the workers' sums and round once; the
    /// sum is used up.
    #[pyo3(signature = (step, samples, loss_sum, correct, eval_correct=0, eval_count=0))]
    #[allow(clippy::too_many_arguments)]
    fn push_exact(
        &mut self,
        py: Python<'_>,
        step: u64,
        samples: u32,
        loss_sum: f64,
        correct: u64,
        eval_correct: u64,
        eval_count: u64,
    ) -> PyResult<()> {
        if self.terms.0.take() != Some(step) {
            return Err(PyRuntimeError::new_err(format!(
                "push_exact({step}): no terms of step {step} (begin_terms, then add_term for each micro-batch)"
            )));
        }
        let (rt, sum, n) = (&self.rt, &self.terms.1, self.num_params);
        let session = self.session.as_mut().ok_or_else(|| {
            PyRuntimeError::new_err("not connected: call connect(train_len) first")
        })?;
        py.detach(|| {
            sum.encode(0..n, session.grad_mut())
                .map_err(|e| PyValueError::new_err(format!("step {step}: exact sum: {e}")))?;
            rt.block_on(session.push(step, samples, loss_sum, correct, (eval_correct, eval_count)))
                .map_err(|e| after_failure(rt, session, step, e))
        })
    }

    /// This worker's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }
    /// `[cluster] workers`.
    #[getter]
    fn world(&self) -> usize {
        self.cfg.cluster.workers
    }
    /// The flat parameter count.
    #[getter]
    fn num_params(&self) -> usize {
        self.num_params
    }
    /// `[train] loss_reduction`: "mean" or "sum", the reduction of the loss to differentiate.
    #[getter]
    fn loss_reduction(&self) -> String {
        self.cfg.train.loss_reduction.to_string()
    }
    /// This rank's slice `(start, end)` of a data set of `n` samples as the shards split a
    /// test set among the ranks (`split_even`: the first `n % world` ranks get one more).
    fn slice_of(&self, n: usize) -> (usize, usize) {
        let r = ps_model::layout::split_even(n, self.cfg.cluster.workers)[self.rank].clone();
        (r.start, r.end)
    }
    /// `[data] train_len` (the user's own training set's length), None when the config
    /// names an IDX directory instead.
    #[getter]
    fn train_len(&self) -> Option<usize> {
        self.cfg.data.train_len
    }
    /// `[train] eval_every` (0: at the end only).
    #[getter]
    fn eval_every(&self) -> u64 {
        self.cfg.train.eval_every
    }
    /// The single-process run this configuration equals, in words.
    #[getter]
    fn equivalence(&self) -> String {
        self.cfg.equivalence().to_string()
    }
}
