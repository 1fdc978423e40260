//! The worker's loop: register with every shard (retrying with backoff, so start order does not
//! matter), then for each step pull every shard's version `t` in parallel while computing the
//! gradient of its slice of global batch `t` (forward waits for each layer's parameters at the
//! step's `crate::gate`, so it starts on the first layers while the last ones arrive), and
//! push each shard its part in parallel as backward finishes it. At the end it
//! evaluates the final weights on its slice of the test set and leaves. With shards on the
//! same host, tensors go through shared-memory boards and only headers through gRPC
//! (`ps_net::shm`); each shard and direction falls back to gRPC on its own.

mod boards;

use crate::backend::{Backend, StepStats};
use crate::gate::{GateError, PullGate};
use crate::watch::AbortOnDrop;
pub use crate::watch::{STALL_GRACE, Watch};
use anyhow::Context;
use boards::{DmaBoards, Registration};
use bytes::Bytes;
use ps_config::Config;
use ps_config::{BarrierPolicy, Transport};
use ps_data::idx::Dataset;
use ps_data::order::BatchPlanner;
use ps_model::layout::split_even;
use ps_net::peer::{
    Peer, PullJob, board_file, describe_model, grad_board, pull_all, pull_gated, pull_jobs,
    pull_patience, recover_if_lost, register_all, rejoin,
};
use ps_net::wire::{encode_push, encode_push_part};
use ps_proto::pb::{LeaveRequest, PushHeader};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything a worker needs.
pub struct WorkerSetup {
    /// The config.
    pub cfg: Config,
    /// Shard addresses (the config's, or overridden).
    pub servers: Vec<String>,
    /// Rank.
    pub rank: usize,
    /// Training set.
    pub train: Dataset,
    /// Test set.
    pub test: Dataset,
    /// The device.
    pub backend: Box<dyn Backend>,
}

/// Totals of a run's step phases, for the final log line. The pulls overlap the forward
/// pass: `pull` is the time before forward could start on the first layer (its wait
/// included), `compute` the rest until backward ended (the waits for later layers included),
/// `push` the wait for the pushes after it; `layer_wait` what forward waited for each layer.
#[derive(Debug, Default, Clone)]
pub struct Timing {
    /// Steps run.
    pub steps: u64,
    /// Total time before the forward pass could start.
    pub pull: Duration,
    /// Total compute time.
    pub compute: Duration,
    /// Total push time.
    pub push: Duration,
    /// Total time the forward passes waited for each layer's weights (layer 0's is part of
    /// `pull`, the others' of `compute`).
    pub layer_wait: Vec<Duration>,
    /// On a device with its own memory: what its copies took over the steps counted.
    pub copies: Option<crate::ops::CopyTimes>,
    /// Host bytes the steps counted copied on their pulls and pushes (`ps_net::copied`).
    pub host_copied: (u64, u64),
}

impl Timing {
    /// Counts a step: `before` its compute (the pull until then), `compute` (from there to
    /// the end of backward), `push` (after it), and the forward pass's wait per layer.
    pub fn add_step(
        &mut self,
        before: Duration,
        compute: Duration,
        push: Duration,
        waits: &[Duration],
    ) {
        let first = waits.first().copied().unwrap_or_default();
        self.steps += 1;
        self.pull += before + first;
        self.compute += compute.saturating_sub(first);
        self.push += push;
        if self.layer_wait.len() < waits.len() {
            self.layer_wait.resize(waits.len(), Duration::ZERO);
        }
        for (total, w) in self.layer_wait.iter_mut().zip(waits) {
            *total += *w;
        }
    }

    /// "pull 1.20 ms, compute 10.31 ms, push 0.52 ms; pull wait per layer [0.80, 0.10, 0.00]
    /// ms", then on a device "; device copies: up 1.52 ms (80.2 MB), down 1.49 ms (80.1 MB),
    /// gradient out of pinned memory 3.10 ms" (device times of the copies, which overlap the
    /// pull and the compute; the host's copy out of pinned memory), then "; host bytes copied
    /// per step: pull 40000000, push 40000000" (`ps_net::copied`): the averages per step.
    pub fn describe(&self) -> String {
        let per = |d: &Duration| d.as_secs_f64() * 1e3 / self.steps.max(1) as f64;
        let waits: Vec<String> = self
            .layer_wait
            .iter()
            .map(|w| format!("{:.2}", per(w)))
            .collect();
        let mut s = format!(
            "pull {:.2} ms, compute {:.2} ms, push {:.2} ms; pull wait per layer [{}] ms",
            per(&self.pull),
            per(&self.compute),
            per(&self.push),
            waits.join(", ")
        );
        if let Some(c) = &self.copies {
            let mb = |b: u64| b as f64 / 1e6 / self.steps.max(1) as f64;
            s += &format!(
                "; device copies: up {:.2} ms ({:.1} MB), down {:.2} ms ({:.1} MB), \
                 gradient out of pinned memory {:.2} ms",
                per(&c.up),
                mb(c.up_bytes),
                per(&c.down),
                mb(c.down_bytes),
                per(&c.copy_out)
            );
        }
        let steps = self.steps.max(1);
        s += &format!(
            "; host bytes copied per step: pull {}, push {}",
            self.host_copied.0 / steps,
            self.host_copied.1 / steps
        );
        s
    }
}

/// Set when the worker was told to stop (`ps_net::peer`, read by its recovery waits).
pub use ps_net::peer::STOP_REQUESTED;

/// Fewest values a piece of a progressive push carries, except the last piece of a range: a
/// smaller final part (a bias, a small last layer) waits for the next one, sparing a piece
/// (and an earlier start of the push) that would save almost no time on the link.
pub const MIN_PIECE_VALUES: usize = 1 << 16;

/// Runs the worker to the end of the training run; returns its timing. The run is a task of
/// its own; this returns early, with the error, when a step's backward pass stalls
/// ([`Watch`]: its push's deadline passed with the gradient unfinished, or
/// its grace, `stall_grace`, after a push of the step failed): that thread cannot be stopped, so the
/// caller must not wait for the runtime's threads to end (ps-worker shuts its runtime down
/// with a bound and exits).
pub async fn run_worker(setup: WorkerSetup) -> anyhow::Result<Timing> {
    let watch = Watch::for_run(&setup.cfg);
    let mut task = AbortOnDrop(tokio::spawn(train(setup, watch.clone())));
    tokio::select! {
        r = &mut task.0 => r.context("the worker's task")?,
        e = watch.stalled() => Err(e),
    }
}

/// Where the gradient lives: a shared-memory board that the shards on this host read in place
/// (where /dev/shm allows), else the heap.
enum GradMem {
    /// The board, and its directory (removed when dropped).
    Board {
        _dir: ps_net::shm::BoardDir,
        board: ps_net::shm::Board,
    },
    Heap(Vec<f32>),
}

impl GradMem {
    fn values(&mut self) -> &mut [f32] {
        match self {
            GradMem::Board { board, .. } => board.slot_mut(0),
            GradMem::Heap(v) => v,
        }
    }
}

/// A worker's run: what stays from step to step.
struct Run {
    cfg: Config,
    rank: usize,
    total: u64,
    train: Dataset,
    test: Dataset,
    backend: Box<dyn Backend>,
    grad: GradMem,
    /// The gradient board's file and token, for registration again.
    grad_file: (String, u64),
    model: Vec<ps_proto::pb::TensorDesc>,
    peers: Vec<Peer>,
    planner: BatchPlanner,
    test_idx: Vec<u32>,
    weights: Vec<f32>,
    /// A batch's features and labels.
    x: Vec<f32>,
    y: Vec<u8>,
    /// One micro-batch's gradient, with [train] micro_batches > 1.
    part: Vec<f32>,
    /// The exact partial sum, with [train] exact_sum.
    exact_acc: ps_net::exact::TermSum,
    timing: Timing,
    shard_ranges: Vec<Range<usize>>,
    /// Where each shard's push lies in the gradient: its range, or that of the encoded
    /// partial sum.
    push_ranges: Vec<Range<usize>>,
    /// The next step.
    t: u64,
    /// The board set registered for the device's DMA (refused: every pull and download goes
    /// through the device's staging memory).
    dma: DmaBoards,
}

/// The run: registration, the steps, the end.
async fn train(setup: WorkerSetup, watch: Watch) -> anyhow::Result<Timing> {
    let mut run = Run::start(setup).await?;
    while run.t < run.total {
        run.step(&watch).await?;
    }
    let Run {
        cfg,
        mut peers,
        mut backend,
        rank,
        total,
        test,
        test_idx,
        mut weights,
        timing,
        ..
    } = run;
    finish_run(
        &mut peers,
        backend.as_mut(),
        (rank, total),
        (&test, &test_idx),
        &mut weights,
        (&timing, cfg.server.linger_secs),
    )
    .await?;
    Ok(timing)
}

impl Run {
    /// Creates the gradient's memory and registers with every shard.
    async fn start(setup: WorkerSetup) -> anyhow::Result<Self> {
        let WorkerSetup {
            cfg,
            servers,
            rank,
            train,
            test,
            backend,
        } = setup;
        let layout = cfg.layout();
        let world = cfg.cluster.workers;
        let total = cfg.total_steps(train.len())?;
        // with [train] exact_sum the gradient pushed is the encoded exact partial sum
        let exact = cfg.train.exact_micro_batch;
        let push_len = match exact {
            Some(_) => crate::exact::wire_len(layout.num_params()),
            None => layout.num_params(),
        };
        let board = match cfg.cluster.transport {
            Transport::Auto => grad_board(
                &ps_config::runid::board_prefix(cfg.cluster.run_id.as_deref()),
                rank,
                push_len,
            ),
            Transport::Grpc => None,
        };
        let grad_file = board_file(&board);
        let grad = match board {
            Some((_dir, board)) => GradMem::Board { _dir, board },
            None => GradMem::Heap(vec![0.0; push_len]),
        };
        // what this worker computes: the built-in MLP
        let model = describe_model(&layout);
        let (peers, start_step) =
            register_all(&cfg, &servers, rank, total, &grad_file, &model).await?;
        let via: Vec<&str> = peers.iter().map(|p| p.link.describe()).collect();
        tracing::info!(
            "worker {rank}/{world}: registered with {} shards (tensors via {via:?}), starting at step {start_step} of {total}, device {}, {}",
            servers.len(),
            backend.name(),
            ps_config::runid::show(cfg.cluster.run_id.as_deref())
        );
        let test_slice = split_even(test.len(), world)[rank].clone();
        let shard_ranges: Vec<Range<usize>> = peers.iter().map(|p| p.range.clone()).collect();
        let push_ranges = match exact {
            Some(_) => shard_ranges
                .iter()
                .map(|r| crate::exact::wire_len(r.start)..crate::exact::wire_len(r.end))
                .collect(),
            None => shard_ranges.clone(),
        };
        Ok(Self {
            planner: BatchPlanner::new(cfg.data_order(train.len())),
            test_idx: (test_slice.start as u32..test_slice.end as u32).collect(),
            weights: vec![0f32; layout.num_params()],
            cfg,
            rank,
            total,
            train,
            test,
            backend,
            grad,
            grad_file,
            model,
            peers,
            x: Vec::new(),
            y: Vec::new(),
            part: Vec::new(),
            exact_acc: ps_net::exact::TermSum::default(),
            timing: Timing::default(),
            shard_ranges,
            push_ranges,
            t: start_step,
            dma: DmaBoards::default(),
        })
    }

    /// Step `self.t`: the pulls of version t run while this thread computes (forward waits at
    /// the gate for each layer's parameters, pulled straight into the backend's host weights,
    /// or, on a device with its own memory, into its staging memory, uploaded piece by piece as
    /// it arrives; else into `weights`, uploaded once complete); backward hands each shard its
    /// part as it is final ([`StepPushes`]); then the pushes' answers. A failure goes to
    /// recovery ([`after_failure`]), which says the step to go on from.
    async fn step(&mut self, watch: &Watch) -> anyhow::Result<()> {
        self.register_boards();
        match self.step_once(watch).await {
            Err(e) if torn(&e) => {
                // nothing computed from the torn weights was handed on: the step again, its
                // pulls copying (through gRPC where the version left the board)
                tracing::warn!(
                    "worker {}: {e:#}; step {} again, copying the weights",
                    self.rank,
                    self.t
                );
                self.backend.set_in_place(false);
                let again = self.step_once(watch).await;
                self.backend.set_in_place(true);
                again
            }
            r => r,
        }
    }

    /// Registers the shards' parameters boards and this worker's gradient board for the
    /// device's DMA (a GPU's `cuMemHostRegister`; each board owns its registration and drops it
    /// before it is unmapped), so that the weights are uploaded from where the shards publish
    /// them and the gradient downloaded where they read it: no host copy. Once per board set
    /// ([`boards::DmaBoards`]): a board opened anew (a shard restarted, a rejoin) is registered
    /// then. A refusal leaves no board of the set registered, is said once, and leaves the run
    /// on the staging path.
    fn register_boards(&mut self) {
        let backend = &self.backend;
        let params: Vec<_> = self.peers.iter().map(|p| p.link.params.as_ref()).collect();
        let grad = match &self.grad {
            GradMem::Board { board, .. } => Some(board),
            GradMem::Heap(_) => None,
        };
        match self.dma.update(|| backend.registrar(), &params, grad) {
            Registration::Unchanged | Registration::Registered { new: 0 } => {}
            Registration::Registered { new } => tracing::info!(
                "worker {}: {new} shared-memory boards registered for the device's DMA: weights uploaded from the shards' boards and gradients downloaded into this worker's, no host copy",
                self.rank
            ),
            Registration::Refused { error, dropped } => tracing::warn!(
                "worker {}: {error}; the weights and gradients go through the device's pinned staging memory (a host copy each way), the {dropped} boards registered before it unregistered",
                self.rank
            ),
        }
    }

    async fn step_once(&mut self, watch: &Watch) -> anyhow::Result<()> {
        let t = self.t;
        // the copies counted for this step are its own (not those of a failed one)
        self.backend.take_copy_times()?;
        let copied0 = ps_net::copied::totals();
        let t0 = Instant::now();
        let patience = pull_patience(&self.cfg);
        let (gate, backend_gated) = open_step_gate(
            self.backend.as_mut(),
            &mut self.weights,
            t,
            &self.shard_ranges,
            patience,
        );
        let (pulled, computed, tasks, progressive) =
            self.compute_while_pulling(watch, &gate, backend_gated);
        self.backend.close_gate();
        let waits = gate.waits();
        drop(gate);
        let mut times = (t0, t0);
        let failed = match pulled {
            Err(e) => {
                // forward stopped at the gate: nothing computed with these weights was pushed
                debug_assert!(tasks.is_empty(), "a push after a failed pull");
                Some(e)
            }
            Ok(()) => {
                times = computed?;
                await_pushes(tasks, &progressive, &mut self.peers).await?
            }
        };
        if let Some(e) = failed {
            let elastic = self.cfg.server.barrier_policy == BarrierPolicy::Continue;
            let files = (&self.grad_file, &self.model[..]);
            let (cfg, rank, total) = (&self.cfg, self.rank, self.total);
            self.t = after_failure(elastic, cfg, &mut self.peers, rank, files, total, t, e).await?;
            return Ok(());
        }
        let (t1, t2) = times;
        // only the first step (or the first after a rejoin) can find shards ahead
        self.peers.iter_mut().for_each(|p| p.ahead = false);
        let t3 = Instant::now();
        self.timing.add_step(t1 - t0, t2 - t1, t3 - t2, &waits);
        if let Some(c) = self.backend.take_copy_times()? {
            *self.timing.copies.get_or_insert_default() += c;
        }
        let copied1 = ps_net::copied::totals();
        self.timing.host_copied.0 += copied1.0 - copied0.0;
        self.timing.host_copied.1 += copied1.1 - copied0.1;
        self.t += 1;
        Ok(())
    }

    /// Runs step `self.t`'s computation on this thread while its pulls fill `gate` (the
    /// backend's own when `backend_gated`), the pushes starting as backward hands the gradient
    /// over: the pulls' result, the computation's (when forward began and backward ended),
    /// the push tasks and which shards were pushed piece by piece.
    fn compute_while_pulling(
        &mut self,
        watch: &Watch,
        gate: &Arc<PullGate>,
        backend_gated: bool,
    ) -> StepOutcome {
        let t = self.t;
        let jobs = pull_jobs(&self.peers);
        let runtime = tokio::runtime::Handle::current();
        let Run {
            cfg,
            rank,
            train,
            test,
            backend,
            grad,
            peers,
            planner,
            test_idx,
            x,
            y,
            part,
            exact_acc,
            push_ranges,
            ..
        } = self;
        let mut pushes = StepPushes::new(peers, push_ranges, (cfg, *rank, t), watch, &runtime);
        let mut c = Compute {
            cfg,
            rank: *rank,
            t,
            train,
            test,
            test_idx,
            planner,
            backend: backend.as_mut(),
            x,
            y,
            part,
            exact_acc,
            grad: grad.values(),
        };
        watch.computing(Some(t));
        let (pulled, computed) = pull_while(&runtime, jobs, gate, || {
            c.run(&mut pushes, gate, backend_gated)
        });
        watch.computing(None);
        drop(pushes.senders);
        (pulled, computed, pushes.tasks, pushes.progressive)
    }
}

/// What a step's computation left: the pulls' result, the computation's (when forward began
/// and backward ended), the push tasks and which shards were pushed piece by piece.
type StepOutcome = (
    anyhow::Result<()>,
    anyhow::Result<(Instant, Instant)>,
    Vec<PushTask>,
    Vec<bool>,
);

/// What one step's computation reads and writes.
struct Compute<'a> {
    cfg: &'a Config,
    rank: usize,
    t: u64,
    train: &'a Dataset,
    test: &'a Dataset,
    test_idx: &'a [u32],
    planner: &'a mut BatchPlanner,
    backend: &'a mut dyn Backend,
    x: &'a mut Vec<f32>,
    y: &'a mut Vec<u8>,
    part: &'a mut Vec<f32>,
    exact_acc: &'a mut ps_net::exact::TermSum,
    grad: &'a mut [f32],
}

impl Compute<'_> {
    /// Forward (after the weights it reads, at `gate`), an evaluation when the step asks for
    /// one, and backward, handing the gradient to `pushes` as it becomes final: when forward
    /// began and when backward ended.
    fn run(
        &mut self,
        pushes: &mut StepPushes<'_>,
        gate: &PullGate,
        backend_gated: bool,
    ) -> anyhow::Result<(Instant, Instant)> {
        let (cfg, t) = (self.cfg, self.t);
        if !backend_gated {
            gate.wait_all()?;
            let n = cfg.layout().num_params();
            self.backend.set_weights(gate.published(0..n))?;
        }
        let t1 = Instant::now();
        let eval = if cfg.train.eval_every > 0 && t > 0 && t.is_multiple_of(cfg.train.eval_every) {
            evaluate(self.backend, self.test, self.test_idx, self.x, self.y)?
        } else {
            (0, 0)
        };
        let world = cfg.cluster.workers;
        let batch = self.planner.worker_batch(t, self.rank, world);
        self.train.gather(batch, self.x, self.y);
        // the gradient board is read in place by the shards on this host until they publish
        // version t: backward writes it after forward, which waited for every layer of
        // version t; gradient accumulation and an empty batch write it (zeros) before any
        // forward, so they wait for the whole pull first
        let exact = cfg.train.exact_micro_batch;
        if pushes.grad_shared
            && (cfg.train.micro_batches > 1 || exact.is_some() || self.y.is_empty())
        {
            gate.wait_all()?;
        }
        pushes.base.samples = self.y.len() as u32;
        (pushes.base.eval_correct, pushes.base.eval_count) = eval;
        let mut ready = |start: usize, tail: &[f32], stats: StepStats| {
            pushes.ready(start, tail, stats);
        };
        let reduction = cfg.train.loss_reduction;
        match exact {
            Some(m) => crate::exact::forward_backward_exact(
                self.backend,
                self.x,
                self.y,
                reduction,
                m,
                self.exact_acc,
                self.part,
                self.grad,
                &mut ready,
            )?,
            None => crate::backend::forward_backward_micro(
                self.backend,
                self.x,
                self.y,
                reduction,
                cfg.train.micro_batches,
                self.grad,
                self.part,
                &mut ready,
            )?,
        };
        Ok((t1, Instant::now()))
    }
}

/// One step's pushes, started as backward hands the gradient over, last layer first: a shard
/// on a data connection gets each part of its range as soon as it is final, as a piece of one
/// push; the others get their whole range as soon as all of it is final; both while the
/// earlier layers are still being computed.
struct StepPushes<'a> {
    peers: &'a mut [Peer],
    push_ranges: &'a [Range<usize>],
    /// Per shard: pushed piece by piece.
    progressive: Vec<bool>,
    /// Per shard: the sender of its push's pieces once it is under way.
    senders: Vec<Option<tokio::sync::mpsc::UnboundedSender<(usize, Bytes)>>>,
    tasks: Vec<PushTask>,
    /// Shards `0..unsent` have not been handed their whole range.
    unsent: usize,
    /// Per shard: where its final part starts (its range's end before any).
    final_from: Vec<usize>,
    /// Per shard: the pieces sent this step.
    sent: Vec<usize>,
    /// The header of every push of the step, but the figures of backward and the range.
    base: PushHeader,
    /// A shard reads the gradient in this worker's board.
    grad_shared: bool,
    runtime: tokio::runtime::Handle,
    watch: Watch,
    rank: usize,
    wire: ps_config::Wire,
    chunk_bytes: usize,
}

impl<'a> StepPushes<'a> {
    fn new(
        peers: &'a mut [Peer],
        push_ranges: &'a [Range<usize>],
        (cfg, rank, t): (&Config, usize, u64),
        watch: &Watch,
        runtime: &tokio::runtime::Handle,
    ) -> Self {
        let progressive = peers
            .iter()
            .map(|p| !p.ahead && !p.link.grad && p.client.data_link_usable() && !p.range.is_empty())
            .collect();
        let n = peers.len();
        Self {
            grad_shared: peers.iter().any(|p| p.link.grad),
            peers,
            push_ranges,
            progressive,
            senders: (0..n).map(|_| None).collect(),
            tasks: Vec::with_capacity(n),
            unsent: n,
            final_from: push_ranges.iter().map(|r| r.end).collect(),
            sent: vec![0; n],
            base: PushHeader {
                rank: rank as u32,
                step: t,
                ..PushHeader::default()
            },
            runtime: runtime.clone(),
            watch: watch.clone(),
            rank,
            wire: cfg.cluster.wire,
            chunk_bytes: cfg.server.chunk_bytes,
        }
    }

    /// The step's header for a push of `len` values, with backward's figures.
    fn header(&self, stats: StepStats, len: usize, shm: bool) -> PushHeader {
        PushHeader {
            loss_sum: stats.loss_sum,
            correct: stats.correct,
            len: len as u64,
            shm,
            ..self.base
        }
    }

    /// Backward says the gradient from `start` on (`tail`) is final.
    fn ready(&mut self, start: usize, tail: &[f32], stats: StepStats) {
        for s in 0..self.peers.len() {
            if self.progressive[s] {
                self.send_piece(s, start, tail, stats);
            }
        }
        while self.unsent > 0 && self.push_ranges[self.unsent - 1].start >= start {
            self.unsent -= 1;
            self.push_whole(self.unsent, start, tail, stats);
        }
    }

    /// Shard `s`'s part of `tail` (from `start`) that became final, as a piece of its push
    /// (the push begins with its first piece).
    fn send_piece(&mut self, s: usize, start: usize, tail: &[f32], stats: StepStats) {
        let r = self.push_ranges[s].clone();
        let (lo, hi) = (start.max(r.start), self.final_from[s]);
        if lo >= hi || (hi - lo < MIN_PIECE_VALUES && lo > r.start) {
            // nothing new of this shard's range is final, or too little to be worth a piece
            // of its own: it goes with the next one
            return;
        }
        let header = self.header(stats, r.len(), false);
        let peer = &mut self.peers[s];
        let buf = peer.piece_bufs.get_mut(self.sent[s]).and_then(Option::take);
        let values = &tail[lo - start..hi - start];
        let offset = lo - r.start;
        let bytes = encode_push_part(self.wire, values, offset, r.len(), &mut peer.encoder, buf);
        self.sent[s] += 1;
        self.final_from[s] = lo;
        if self.senders[s].is_none() {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let client = peer.client.clone();
            let (watch, rank, chunk_bytes) = (self.watch.clone(), self.rank, self.chunk_bytes);
            self.tasks.push(self.runtime.spawn(async move {
                let (reply, pieces) = client.push_progressive(header, rx, chunk_bytes).await;
                if let Err(e) = &reply {
                    watch.push_failed(header.step, rank, e);
                }
                reply?;
                let bufs = pieces.into_iter().map(|(_, b)| b).collect();
                Ok::<_, anyhow::Error>((s, bufs))
            }));
            self.senders[s] = Some(tx);
        }
        if let Some(tx) = &self.senders[s] {
            // a push that ended early (refused) no longer takes pieces: its error is what
            // the step reports
            let _ = tx.send((offset, bytes));
        }
        if lo == r.start {
            self.senders[s] = None; // the whole range is on its way
        }
    }

    /// Shard `s`'s whole range, final: pushed (the shard reads it in this worker's gradient
    /// board, or receives a copy through gRPC), unless it goes piece by piece or the shard
    /// applied step t already.
    fn push_whole(&mut self, s: usize, start: usize, tail: &[f32], stats: StepStats) {
        let peer = &self.peers[s];
        if peer.ahead || self.progressive[s] {
            return;
        }
        let r = self.push_ranges[s].clone();
        let shm = peer.link.grad;
        let header = self.header(stats, r.len(), shm);
        let peer = &mut self.peers[s];
        let bytes = if shm {
            Bytes::new()
        } else {
            let values = &tail[r.start - start..r.end - start];
            let buf = peer.push_buf.take();
            encode_push(self.wire, values, &mut peer.encoder, buf)
        };
        let client = peer.client.clone();
        let (watch, rank, chunk_bytes) = (self.watch.clone(), self.rank, self.chunk_bytes);
        self.tasks.push(self.runtime.spawn(async move {
            let r = client.push_retrying(header, &bytes, chunk_bytes).await;
            if let Err(e) = &r {
                watch.push_failed(header.step, rank, e);
            }
            r?;
            Ok::<_, anyhow::Error>((s, vec![bytes]))
        }));
    }
}

/// True when `e` is a pull's version torn under the device's copies out of its board.
fn torn(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<crate::backend::BackendError>(),
            Some(crate::backend::BackendError::Gate(GateError::Torn { .. }))
        ) || matches!(c.downcast_ref::<GateError>(), Some(GateError::Torn { .. }))
    })
}

/// The gate of step `t`'s pull: the backend's own (its host weights or staging memory; `true`),
/// else one over `weights`, uploaded once complete (`false`).
fn open_step_gate(
    backend: &mut dyn Backend,
    weights: &mut [f32],
    t: u64,
    shard_ranges: &[Range<usize>],
    patience: Duration,
) -> (Arc<PullGate>, bool) {
    if let Some(g) = backend.open_gate(t, shard_ranges.to_vec(), patience) {
        return (g, true);
    }
    let layers = backend.layers();
    let (ptr, len) = (weights.as_mut_ptr(), weights.len());
    // SAFETY: `weights` is neither touched nor resized until the gate is dropped at the end of
    // this step, except through it: the writers of the pulling thread (joined by `pull_while`)
    // and `published` after `wait_all`.
    let g =
        Arc::new(unsafe { PullGate::new(ptr, len, t, shard_ranges.to_vec(), layers, patience) });
    (g, false)
}

/// The run's end: pulls the final weights, evaluates this rank's slice of the test set, leaves
/// every shard with that count, and says so. From before the pull until the leave, the shards
/// are told every quarter of `linger_secs` that this rank is evaluating (`crate::evaluating`).
async fn finish_run(
    peers: &mut [Peer],
    backend: &mut dyn Backend,
    (rank, total): (usize, u64),
    (test, test_idx): (&Dataset, &[u32]),
    weights: &mut [f32],
    (timing, linger_secs): (&Timing, f64),
) -> anyhow::Result<()> {
    peers.iter_mut().for_each(|p| p.ahead = false);
    let words = crate::evaluating::say_evaluating(peers, rank, linger_secs);
    let evaluated = async {
        pull_all(peers, total, weights).await?;
        backend.set_weights(weights)?;
        let (mut x, mut y) = (Vec::new(), Vec::new());
        tokio::task::block_in_place(|| evaluate(backend, test, test_idx, &mut x, &mut y))
    }
    .await;
    words.abort();
    let (correct, count) = evaluated?;
    leave_all(peers, rank, (correct, count)).await?;
    tracing::info!(
        "worker {rank}: done after {} steps; per step {}; test accuracy on its slice {:.2}% ({correct}/{count})",
        timing.steps,
        timing.describe(),
        100.0 * correct as f64 / count.max(1) as f64
    );
    Ok(())
}

/// Runs `compute` on this thread while a scoped thread of its own pulls `gate`'s version
/// from every shard ([`pull_gated`], on `runtime`); returns when both are done: the pulls'
/// result and compute's. (`compute` waits at the gate for the weights it reads; the pulls end
/// on their own, within their bounds, whatever `compute` does.)
fn pull_while<R>(
    runtime: &tokio::runtime::Handle,
    jobs: Vec<PullJob>,
    gate: &Arc<PullGate>,
    compute: impl FnOnce() -> R,
) -> (anyhow::Result<()>, R) {
    tokio::task::block_in_place(|| {
        std::thread::scope(|scope| {
            let puller = scope.spawn(|| runtime.block_on(pull_gated(jobs, gate.clone())));
            let computed = compute();
            let pulled = puller
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (pulled, computed)
        })
    })
}

/// A push under way to one shard: its index and the buffers to reuse for the next step.
type PushTask = tokio::task::JoinHandle<anyhow::Result<(usize, Vec<Bytes>)>>;

/// Waits for the step's pushes and takes back their buffers (each shard's whole-range buffer,
/// or its pieces' when it was pushed piece by piece, `progressive`); the first refusal, if any.
async fn await_pushes(
    pushes: Vec<PushTask>,
    progressive: &[bool],
    peers: &mut [Peer],
) -> anyhow::Result<Option<anyhow::Error>> {
    let mut refused = None;
    for p in pushes {
        match p.await.context("push task")? {
            Ok((s, mut bufs)) if !progressive[s] => peers[s].push_buf = bufs.pop(),
            Ok((s, bufs)) => peers[s].piece_bufs = bufs.into_iter().map(Some).collect(),
            Err(e) => {
                refused.get_or_insert(e);
            }
        }
    }
    Ok(refused)
}

/// Leaves every shard at the end of the run, with this rank's test result `(correct, count)`.
async fn leave_all(peers: &mut [Peer], rank: usize, eval: (u64, u64)) -> anyhow::Result<()> {
    for p in peers {
        p.client
            .leave(LeaveRequest {
                rank: rank as u32,
                eval_correct: eval.0,
                eval_count: eval.1,
                failed: String::new(),
                evaluating: false,
                lease: None,
            })
            .await?;
    }
    Ok(())
}

/// After a pull or push of step `t` failed with `err`: when it looks like a lost shard, waits
/// for the cluster to recover ([`await_recovery`]) and returns the step to continue from;
/// otherwise (or when no shard was lost) as [`rejoin`].
#[allow(clippy::too_many_arguments)]
async fn after_failure(
    elastic: bool,
    cfg: &Config,
    peers: &mut [Peer],
    rank: usize,
    files: (&(String, u64), &[ps_proto::pb::TensorDesc]),
    total: u64,
    t: u64,
    err: anyhow::Error,
) -> anyhow::Result<u64> {
    if let Some(start) = recover_if_lost(cfg, peers, rank, files, total, t, &err).await? {
        return Ok(start);
    }
    rejoin(elastic, cfg, peers, rank, files, t, err).await
}

fn evaluate(
    backend: &mut dyn Backend,
    test: &Dataset,
    idx: &[u32],
    x: &mut Vec<f32>,
    y: &mut Vec<u8>,
) -> anyhow::Result<(u64, u64)> {
    test.gather(idx, x, y);
    Ok((backend.evaluate(x, y)?, idx.len() as u64))
}
