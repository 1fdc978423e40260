//! A worker's connection to every shard without the training loop: register (with the model's
//! names and shapes), pull a version, push a gradient, leave. The Python package (`python/`)
//! drives a model that PyTorch computes through it, over the same transport as `ps-worker`
//! (shared-memory boards on one host, gRPC otherwise, token and TLS).

use crate::gate::PullGate;
use crate::peer::{
    Peer, board_file, grad_board, pull_all, pull_gated, pull_jobs, pull_patience, recover_if_lost,
    register_all,
};
use crate::shm::{Board, BoardDir};
use crate::wire::encode_push;
use anyhow::Context;
use bytes::Bytes;
use ps_config::{Config, Transport};
use ps_proto::pb::{LeaveRequest, PushHeader, TensorDesc, UnusedRequest};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Figures of one push or pull (for the speed comparison with `ps-worker`).
#[derive(Debug, Default, Clone, Copy)]
pub struct CommTiming {
    /// Pushes made.
    pub pushes: u64,
    /// Total time in pushes.
    pub push: Duration,
    /// Pulls made.
    pub pulls: u64,
    /// Total time in pulls (for a pull beside the forward pass, [`Session::begin_pull`]: the
    /// time the caller waited for it).
    pub pull: Duration,
}

/// Registered with every shard of a run.
pub struct Session {
    /// This worker's rank.
    pub rank: usize,
    /// The run's steps.
    pub total_steps: u64,
    /// The step to start at (0, or the shards' step when a worker rejoins).
    pub start_step: u64,
    /// Flat parameter count.
    pub num_params: usize,
    /// Values pushed per parameter: 1, or [`crate::exact::LIMBS`] with `[train] exact_sum`
    /// (the push buffer holds the encoded exact partial sum, [`Session::grad_mut`]).
    pub limbs: usize,
    peers: Vec<Peer>,
    board: Option<(BoardDir, Board)>,
    heap_grad: Vec<f32>,
    chunk_bytes: usize,
    /// Time spent communicating.
    pub timing: CommTiming,
    /// The overlapped push under way ([`Session::begin_push`]), if any.
    overlapped: Option<Overlapped>,
    /// The pull under way beside the caller's forward pass ([`Session::begin_pull`]), if any.
    pending: Option<PendingPull>,
    /// The run's config and the model registered, to register again after a lost shard.
    cfg: Config,
    model: Vec<TensorDesc>,
}

/// What the header of every push of a step says (but its length).
#[derive(Debug, Clone, Copy)]
struct StepHeader {
    step: u64,
    samples: u32,
    loss_sum: f64,
    correct: u64,
    eval: (u64, u64),
}

/// A push of one step started shard by shard as backward produces the gradient.
struct Overlapped {
    header: StepHeader,
    /// Values of each shard's range not written yet.
    remaining: Vec<usize>,
    /// The push of each shard started (and not yet awaited).
    started: Vec<Option<PushTask>>,
}

type PushTask = tokio::task::JoinHandle<anyhow::Result<(usize, Bytes)>>;

impl Drop for Session {
    /// A pull under way writes its destination until it ends: it is stopped first.
    fn drop(&mut self) {
        self.abort_pull();
    }
}

/// A pull running beside the caller's forward pass: its gate (the caller waits there for each
/// module's parameters) and its task, or the task's result once it ended.
struct PendingPull {
    gate: Arc<PullGate>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    ended: Option<anyhow::Result<()>>,
    /// Time the caller waited for it.
    waited: Duration,
}

impl PendingPull {
    /// Waits for the pull task to end (it ends within its bounds) and keeps its result: once
    /// this returns, nothing writes the destination any more.
    fn settle(&mut self) {
        if let Some(task) = self.task.take() {
            let ended = futures::executor::block_on(task)
                .map_err(|e| anyhow::anyhow!("the pull task failed: {e}"))
                .and_then(|r| r);
            self.ended = Some(ended);
        }
        // an aborted pull's shard tasks end at their next wait (a board copy under way
        // first): they hold the gate until then
        let t = Instant::now();
        while Arc::strong_count(&self.gate) > 1 {
            if t.elapsed() > SETTLE_BOUND {
                tracing::error!(
                    "a pull's shard tasks did not end within {SETTLE_BOUND:?} of their abort"
                );
                std::process::abort();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Longest an aborted pull's shard tasks may take to end (a board copy under way: a few
/// milliseconds); past it the process stops rather than free memory they may still write.
const SETTLE_BOUND: Duration = Duration::from_secs(60);

impl Session {
    /// Connects and registers with every shard of `servers` as `rank`, describing `model`
    /// (names and shapes in flat order); `train_len` samples make the run's length.
    pub async fn connect(
        cfg: &Config,
        servers: &[String],
        rank: usize,
        model: Vec<TensorDesc>,
        train_len: usize,
    ) -> anyhow::Result<Self> {
        if let Some(n) = cfg.data.train_len
            && n != train_len
        {
            anyhow::bail!(
                "a training set of {train_len} samples: {} says [data] train_len = {n} (every worker must bring the same data set)",
                cfg.path.display()
            );
        }
        let total = cfg.total_steps(train_len)?;
        let num_params: usize = model
            .iter()
            .map(|t| t.shape.iter().product::<u64>() as usize)
            .sum();
        let limbs = match cfg.train.exact_micro_batch {
            Some(_) => crate::exact::LIMBS,
            None => 1,
        };
        let board = match cfg.cluster.transport {
            Transport::Auto => grad_board(
                &ps_config::runid::board_prefix(cfg.cluster.run_id.as_deref()),
                rank,
                limbs * num_params,
            ),
            Transport::Grpc => None,
        };
        let (peers, start_step) =
            register_all(cfg, servers, rank, total, &board_file(&board), &model).await?;
        let heap_grad = if board.is_some() {
            Vec::new()
        } else {
            vec![0.0; limbs * num_params]
        };
        Ok(Self {
            rank,
            total_steps: total,
            start_step,
            num_params,
            limbs,
            peers,
            board,
            heap_grad,
            chunk_bytes: cfg.server.chunk_bytes,
            timing: CommTiming::default(),
            overlapped: None,
            pending: None,
            cfg: cfg.clone(),
            model,
        })
    }

    /// After a push or pull of step `step` failed with `err`: when it looks like a lost shard
    /// (a connection that failed, a shard that rolled back or does not know this worker),
    /// waits (at most `[worker] connect_timeout_secs`) for the cluster to recover, as
    /// `ps-worker` does, and returns the step to redo from: the shards' version, from which
    /// the run goes on bit-identical. None when it is no such failure (the error stands).
    pub async fn recover(&mut self, step: u64, err: &anyhow::Error) -> anyhow::Result<Option<u64>> {
        self.abort_pull();
        if let Some(o) = self.overlapped.take() {
            o.started.into_iter().flatten().for_each(|t| t.abort());
        }
        let grad_file = board_file(&self.board);
        let files = (&grad_file, self.model.as_slice());
        let start = recover_if_lost(
            &self.cfg,
            &mut self.peers,
            self.rank,
            files,
            self.total_steps,
            step,
            err,
        )
        .await?;
        if let Some(s) = start {
            self.start_step = s;
        }
        Ok(start)
    }

    /// How tensors travel to each shard ("shared memory", "gRPC", ...).
    pub fn transport(&self) -> Vec<&'static str> {
        self.peers.iter().map(|p| p.link.describe()).collect()
    }

    /// Where the next push's gradient is written: this worker's shared-memory board (read by
    /// the shards on this host in place) or a heap buffer; [`Session::limbs`] values per
    /// parameter.
    pub fn grad_mut(&mut self) -> &mut [f32] {
        match &mut self.board {
            Some((_, b)) => b.slot_mut(0),
            None => &mut self.heap_grad,
        }
    }

    /// A pull into `len` values can start: they are the model's, and no pull is under way.
    fn check_pull(&self, len: usize) -> anyhow::Result<()> {
        anyhow::ensure!(
            len == self.num_params,
            "pull buffer holds {len} values: expected {}",
            self.num_params
        );
        anyhow::ensure!(
            self.pending.is_none(),
            "a pull is under way beside the forward pass: finish it first"
        );
        Ok(())
    }

    /// Pulls version `version` from every shard, in parallel, into `dst` (the flat vector).
    pub async fn pull(&mut self, version: u64, dst: &mut [f32]) -> anyhow::Result<()> {
        self.check_pull(dst.len())?;
        let t = Instant::now();
        pull_all(&mut self.peers, version, dst).await?;
        self.timing.pulls += 1;
        self.timing.pull += t.elapsed();
        Ok(())
    }

    /// Registers the parameters boards of the shards on this host with `registrar`'s device
    /// for its DMA, each once per mapping (the board owns the registration and drops it before
    /// it is unmapped: at the session's end, or when a lost shard's boards are replaced):
    /// how many parameters boards this session has (0 over gRPC).
    ///
    /// # Errors
    /// The device's refusal, naming the board; all or none: the boards of this session
    /// registered with that device before it are unregistered.
    pub fn register_param_boards(
        &self,
        registrar: &dyn crate::dma::Registrar,
    ) -> Result<usize, crate::shm::RegisterError> {
        let boards: Vec<&Board> = self
            .peers
            .iter()
            .filter_map(|p| p.link.params.as_deref())
            .collect();
        for b in &boards {
            if let Err(e) = b.register(registrar) {
                for b in &boards {
                    b.unregister(registrar.key());
                }
                return Err(e);
            }
        }
        Ok(boards.len())
    }

    /// [`Session::pull`], except that a shard whose parameters board the device of registrar
    /// key `key` registered ([`Session::register_param_boards`]) hands over its slot of
    /// `version` in place, copying nothing: per shard, that slot, or None when the shard's
    /// values were copied into its range of `dst` (gRPC, a shard pulled exactly, a version
    /// that left the board), with the shard's range. The caller reads the slots by its device's DMA and uses what it
    /// read only if [`crate::dma::InPlace::intact`] holds for each after its copies completed.
    pub async fn pull_lent(
        &mut self,
        version: u64,
        dst: &mut [f32],
        key: u64,
    ) -> anyhow::Result<Vec<(Range<usize>, Option<crate::dma::InPlace>)>> {
        self.check_pull(dst.len())?;
        let t = Instant::now();
        let shards: Vec<Range<usize>> = self.peers.iter().map(|p| p.range.clone()).collect();
        let patience = pull_patience(&self.cfg);
        // SAFETY: `dst` is borrowed mutably for this call, and the gate's writers and views
        // end before it returns: `pull_gated` runs to its end here, joining every shard's
        // task (each holds the gate, and so its writer, until it ends).
        let gate = Arc::new(
            unsafe {
                PullGate::new(
                    dst.as_mut_ptr(),
                    dst.len(),
                    version,
                    shards.clone(),
                    Vec::new(),
                    patience,
                )
            }
            .with_in_place(key),
        );
        pull_gated(pull_jobs(&self.peers), gate.clone()).await?;
        let slots = shards
            .into_iter()
            .enumerate()
            .map(|(s, r)| (r, gate.slot(s).cloned()))
            .collect();
        self.timing.pulls += 1;
        self.timing.pull += t.elapsed();
        Ok(slots)
    }

    /// Starts pulling `version` from every shard into the flat vector at `dst`, in the
    /// background (on the current Tokio runtime), as `ps-worker` pulls beside its forward
    /// pass: each shard's values are published as they arrive; [`Session::wait_pulled`] waits
    /// for a range (a module's parameters) before the caller reads it, and
    /// [`Session::finish_pull`] ends the pull with its result. `layers`: the ranges the
    /// caller waits for (where pieces end).
    ///
    /// # Safety
    /// `dst` must point to `num_params` writable `f32` that stay allocated, and that nothing
    /// reads or writes, until [`Session::finish_pull`] or [`Session::abort_pull`] returned
    /// (or the session is dropped), except that a range for which
    /// [`Session::wait_pulled`] returned true may be read.
    pub unsafe fn begin_pull(
        &mut self,
        version: u64,
        dst: *mut f32,
        layers: Vec<Range<usize>>,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.pending.is_none(),
            "a pull is under way: finish it first"
        );
        let shards: Vec<Range<usize>> = self.peers.iter().map(|p| p.range.clone()).collect();
        let patience = pull_patience(&self.cfg);
        // SAFETY: the caller's contract (above) is the gate's.
        let gate = Arc::new(unsafe {
            PullGate::new(dst, self.num_params, version, shards, layers, patience)
        });
        let jobs = pull_jobs(&self.peers);
        let g = gate.clone();
        let task = tokio::spawn(pull_gated(jobs, g));
        self.pending = Some(PendingPull {
            gate,
            task: Some(task),
            ended: None,
            waited: Duration::ZERO,
        });
        Ok(())
    }

    /// Waits (bounded) until the values of `range` of the pull under way are in; true when
    /// they are (or no pull is under way), false when the pull failed: then it has ended
    /// ([`Session::finish_pull`] says why) and the values must not be used.
    pub fn wait_pulled(&mut self, range: Range<usize>) -> bool {
        let Some(p) = self.pending.as_mut() else {
            return true;
        };
        let t = Instant::now();
        let ok = p.gate.wait(range).is_ok();
        if !ok {
            p.settle();
        }
        p.waited += t.elapsed();
        ok
    }

    /// Ends the pull of [`Session::begin_pull`]: waits for all of it; its error, if it failed
    /// (then its values must not be used). Nothing when no pull is under way.
    pub async fn finish_pull(&mut self) -> anyhow::Result<()> {
        let Some(mut p) = self.pending.take() else {
            return Ok(());
        };
        let t = Instant::now();
        let ended = match (p.ended.take(), p.task.take()) {
            (Some(r), _) => r,
            (None, Some(task)) => task
                .await
                .map_err(|e| anyhow::anyhow!("the pull task failed: {e}"))
                .and_then(|r| r),
            (None, None) => Ok(()),
        };
        self.timing.pulls += 1;
        self.timing.pull += p.waited + t.elapsed();
        ended
    }

    /// Stops the pull under way, if any, and returns once nothing writes its destination.
    pub fn abort_pull(&mut self) {
        if let Some(mut p) = self.pending.take() {
            if let Some(task) = &p.task {
                task.abort();
            }
            p.settle();
        }
    }

    /// The step a pull under way ([`Session::begin_pull`]) is of, if any.
    pub fn pulling_version(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.gate.version())
    }

    /// Pushes the gradient in [`Session::grad_mut`] for `step` to every shard in parallel.
    pub async fn push(
        &mut self,
        step: u64,
        samples: u32,
        loss_sum: f64,
        correct: u64,
        eval: (u64, u64),
    ) -> anyhow::Result<()> {
        let t = Instant::now();
        let header = StepHeader {
            step,
            samples,
            loss_sum,
            correct,
            eval,
        };
        let pushes: Vec<PushTask> = (0..self.peers.len())
            .filter_map(|s| self.spawn_push(s, header))
            .collect();
        self.join_pushes(pushes).await?;
        self.timing.pushes += 1;
        self.timing.push += t.elapsed();
        Ok(())
    }

    /// Starts the push of shard `s`'s range of the gradient on the current Tokio runtime; None
    /// when this shard applied the step already (a rejoining worker).
    fn spawn_push(&mut self, s: usize, h: StepHeader) -> Option<PushTask> {
        let (rank, chunk_bytes, wire) = (self.rank as u32, self.chunk_bytes, self.cfg.cluster.wire);
        let grad: &[f32] = match &mut self.board {
            Some((_, b)) => b.slot_mut(0),
            None => &self.heap_grad,
        };
        let peer = &mut self.peers[s];
        if peer.ahead {
            return None;
        }
        let r = self.limbs * peer.range.start..self.limbs * peer.range.end;
        let bytes = if peer.link.grad {
            Bytes::new()
        } else {
            let buf = peer.push_buf.take();
            encode_push(wire, &grad[r.clone()], &mut peer.encoder, buf)
        };
        let header = PushHeader {
            rank,
            step: h.step,
            samples: h.samples,
            loss_sum: h.loss_sum,
            correct: h.correct,
            len: r.len() as u64,
            eval_correct: h.eval.0,
            eval_count: h.eval.1,
            shm: peer.link.grad,
        };
        let client = peer.client.clone();
        Some(tokio::spawn(async move {
            client.push_retrying(header, &bytes, chunk_bytes).await?;
            Ok::<_, anyhow::Error>((s, bytes))
        }))
    }

    /// Waits for the pushes `pushes` (keeping their buffers for the next step's).
    /// On the first that fails, the others are stopped (a push of a step the shards may have
    /// rolled back must not go on behind the worker's back).
    async fn join_pushes(&mut self, pushes: Vec<PushTask>) -> anyhow::Result<()> {
        let mut pushes = pushes.into_iter();
        while let Some(p) = pushes.next() {
            match p.await.context("push task").and_then(|r| r) {
                Ok((s, bytes)) => self.peers[s].push_buf = Some(bytes),
                Err(e) => {
                    pushes.for_each(|t| t.abort());
                    return Err(e);
                }
            }
        }
        self.peers.iter_mut().for_each(|p| p.ahead = false);
        Ok(())
    }

    /// Starts a push of `step` that overlaps backward, as `ps-worker` does: write each
    /// tensor's gradient with [`Session::grad_ready`] as backward produces it; a shard's push
    /// starts as soon as its whole range is written; [`Session::finish_push`] waits for them.
    pub fn begin_push(
        &mut self,
        step: u64,
        samples: u32,
        loss_sum: f64,
        correct: u64,
        eval: (u64, u64),
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.limbs == 1,
            "[train] exact_sum = true: a push carries the whole exact partial sum, encoded, after the last micro-batch; no push overlaps backward"
        );
        anyhow::ensure!(
            self.overlapped.is_none(),
            "a push of step {} is under way: finish it first",
            self.overlapped.as_ref().map_or(0, |o| o.header.step)
        );
        self.overlapped = Some(Overlapped {
            header: StepHeader {
                step,
                samples,
                loss_sum,
                correct,
                eval,
            },
            remaining: self.peers.iter().map(|p| p.range.len()).collect(),
            started: self.peers.iter().map(|_| None).collect(),
        });
        Ok(())
    }

    /// The step of the overlapped push under way, if any.
    pub fn pushing_step(&self) -> Option<u64> {
        self.overlapped.as_ref().map(|o| o.header.step)
    }

    /// Writes `src`, the gradient of the flat values from `offset`, into the push buffer and
    /// starts the push of every shard whose range it completes (on the current Tokio runtime).
    /// Each value must be written once per step.
    pub fn grad_ready(&mut self, offset: usize, src: &[f32]) -> anyhow::Result<()> {
        let end = offset + src.len();
        anyhow::ensure!(
            end <= self.num_params,
            "gradient values {offset}..{end}: the model has {} values",
            self.num_params
        );
        let Some(mut o) = self.overlapped.take() else {
            anyhow::bail!("no push under way: call begin_push first");
        };
        self.grad_mut()[offset..end].copy_from_slice(src);
        let mut done = Vec::new();
        for (s, p) in self.peers.iter().enumerate() {
            let lo = p.range.start.max(offset);
            let hi = p.range.end.min(end);
            if lo < hi {
                let left = o.remaining[s].checked_sub(hi - lo);
                let Some(left) = left else {
                    self.overlapped = Some(o);
                    anyhow::bail!("gradient values {offset}..{end} written twice in one step");
                };
                o.remaining[s] = left;
                if left == 0 {
                    done.push(s);
                }
            }
        }
        for s in done {
            o.started[s] = self.spawn_push(s, o.header);
        }
        self.overlapped = Some(o);
        Ok(())
    }

    /// Waits for the pushes of the overlapped step; the push time counted is this wait (the
    /// part of the communication backward did not hide), as `ps-worker` counts it. Fails,
    /// naming the flat ranges, when some values were never written.
    pub async fn finish_push(&mut self) -> anyhow::Result<()> {
        let t = Instant::now();
        let Some(o) = self.overlapped.take() else {
            anyhow::bail!("no push under way: call begin_push first");
        };
        let mut pushes = Vec::new();
        let mut unwritten = Vec::new();
        for (s, task) in o.started.into_iter().enumerate() {
            match task {
                Some(t) => pushes.push(t),
                None if o.remaining[s] > 0 => unwritten.push(s),
                None => {}
            }
        }
        // the pushes started are awaited even when the step is incomplete
        let joined = self.join_pushes(pushes).await;
        if !unwritten.is_empty() {
            let ranges: Vec<String> = unwritten
                .iter()
                .map(|&s| {
                    let r = &self.peers[s].range;
                    format!(
                        "shard {s} ({}..{}: {} values left)",
                        r.start, r.end, o.remaining[s]
                    )
                })
                .collect();
            anyhow::bail!(
                "step {}: the gradient was not written for {}: expected every value once",
                o.header.step,
                ranges.join(", ")
            );
        }
        joined?;
        self.timing.pushes += 1;
        self.timing.push += t.elapsed();
        Ok(())
    }

    /// Leaves every shard, reporting this rank's share of the final test evaluation.
    pub async fn leave(&mut self, eval_correct: u64, eval_count: u64) -> anyhow::Result<()> {
        for p in &mut self.peers {
            p.client
                .leave(LeaveRequest {
                    rank: self.rank as u32,
                    eval_correct,
                    eval_count,
                    failed: String::new(),
                    evaluating: false,
                    lease: None,
                })
                .await?;
        }
        Ok(())
    }

    /// Tells every shard that this worker stopped on an error (`why`) before the run's end, so
    /// the run fails at once instead of at the barrier timeout. Best effort and bounded: a
    /// shard that cannot be told within `[worker] connect_timeout_secs` is skipped (its
    /// barrier timeout still ends the run).
    pub async fn abandon(&mut self, why: &str) {
        let limit = Duration::from_secs_f64(self.cfg.worker.connect_timeout_secs.min(10.0));
        for p in &mut self.peers {
            let req = LeaveRequest {
                rank: self.rank as u32,
                failed: why.to_string(),
                ..Default::default()
            };
            let told = tokio::time::timeout(limit, p.client.leave(req)).await;
            if !matches!(told, Ok(Ok(()))) {
                tracing::warn!(
                    "rank {}: could not tell shard {:?} that this worker stopped",
                    self.rank,
                    p.range
                );
            }
        }
    }

    /// Has shard 0 check this worker's frozen parameters and buffers (`entries`: names,
    /// shapes, dtypes, fingerprints) against the first worker's; refused with the first entry
    /// that differs.
    pub async fn check_constants(
        &mut self,
        entries: Vec<ps_proto::pb::TensorPrint>,
    ) -> anyhow::Result<()> {
        let rank = self.rank as u32;
        if let Some(p) = self.peers.first_mut() {
            p.client
                .check_constants(ps_proto::pb::ConstantsRequest {
                    rank,
                    entries,
                    lease: None,
                })
                .await?;
        }
        Ok(())
    }

    /// Puts this worker's buffers after the forward pass of `step` to shard 0, which holds the
    /// model's buffers (rank 0 only: its are the model's, as DDP's broadcast_buffers).
    pub async fn put_buffers(&mut self, step: u64, data: bytes::Bytes) -> anyhow::Result<()> {
        let rank = self.rank as u32;
        let p = self
            .peers
            .first_mut()
            .ok_or_else(|| anyhow::anyhow!("no shard"))?;
        p.client
            .put_buffers(ps_proto::pb::BuffersPut {
                rank,
                step,
                data,
                lease: None,
            })
            .await?;
        Ok(())
    }

    /// The model's buffers of `version` from shard 0 (a safetensors serialization).
    pub async fn get_buffers(&mut self, version: u64) -> anyhow::Result<bytes::Bytes> {
        let rank = self.rank as u32;
        let p = self
            .peers
            .first_mut()
            .ok_or_else(|| anyhow::anyhow!("no shard"))?;
        let reply = p
            .client
            .get_buffers(ps_proto::pb::BuffersRequest {
                rank,
                version,
                lease: None,
            })
            .await?;
        Ok(reply.data)
    }

    /// Tells each shard holding part of them which tensors (indices in flat order) this
    /// worker's backward of `step` did not reach; their gradient is pushed as zeros. A tensor
    /// no rank reached is not updated (as torch.optim skips a `.grad` of None).
    pub async fn mark_unused(&mut self, step: u64, tensors: &[u32]) -> anyhow::Result<()> {
        let offsets: Vec<std::ops::Range<usize>> = self
            .model
            .iter()
            .scan(0usize, |off, t| {
                let at = *off;
                *off += t.shape.iter().product::<u64>() as usize;
                Some(at..*off)
            })
            .collect();
        for p in &mut self.peers {
            let mine: Vec<u32> = tensors
                .iter()
                .copied()
                .filter(|&t| {
                    offsets.get(t as usize).is_some_and(|r| {
                        r.start < p.range.end && p.range.start < r.end && !r.is_empty()
                    })
                })
                .collect();
            if mine.is_empty() || p.ahead {
                continue;
            }
            p.client
                .mark_unused(UnusedRequest {
                    rank: self.rank as u32,
                    step,
                    tensors: mine,
                    lease: None,
                })
                .await?;
        }
        Ok(())
    }
}
