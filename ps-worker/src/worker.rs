//! The worker's loop: register with every shard (retrying with backoff, so start order does not
//! matter), then for each step pull every shard's version `t` in parallel while computing the
//! gradient of its slice of global batch `t` (forward waits for each layer's parameters at the
//! step's `crate::gate`, so it starts on the first layers while the last ones arrive), and
//! push each shard its part in parallel as backward finishes it. At the end it
//! evaluates the final weights on its slice of the test set and leaves. With shards on the
//! same host, tensors go through shared-memory boards and only headers through gRPC
//! (`ps_net::shm`); each shard and direction falls back to gRPC on its own.

use crate::backend::{Backend, StepStats};
use crate::gate::PullGate;
use anyhow::{Context, bail};
use bytes::Bytes;
use ps_config::Config;
use ps_config::{BarrierPolicy, Transport};
use ps_data::idx::Dataset;
use ps_data::order::BatchPlanner;
use ps_model::layout::{shard_ranges, split_even};
use ps_net::client::{ShardClient, ShmLink};
use ps_net::shm::{Board, BoardDir, grad_path, shm_root};
use ps_net::wire::{Bf16Encoder, encode_push, encode_push_part};
use ps_proto::PROTOCOL_VERSION;
use ps_proto::pb::{LeaveRequest, PushHeader, RegisterReply, RegisterRequest};
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
    /// pull and the compute; the host's copy out of pinned memory): the averages per step.
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
        s
    }
}

/// One shard as this worker sees it: the connection, the shard's range of the flat parameter
/// vector, what goes through shared memory, and the push buffer.
pub(crate) struct Peer {
    pub(crate) client: ShardClient,
    pub(crate) range: Range<usize>,
    pub(crate) link: ShmLink,
    /// The shard had already applied the step this worker starts at (this worker replaces one
    /// that died between its pushes): it is pulled exactly that version and not pushed to.
    pub(crate) ahead: bool,
    /// The gradient bytes of the last push through gRPC, reused once its RPC has released them.
    pub(crate) push_buf: Option<Bytes>,
    /// The pieces of the last progressive push, in the order they were sent (each step sends
    /// the same pieces in the same order), reused likewise.
    pub(crate) piece_bufs: Vec<Option<Bytes>>,
    /// With `[cluster] wire = "bf16"`: the rounding error this worker carries into its next
    /// push to this shard (error feedback). It survives across steps and is reset to zero when
    /// the worker rejoins or recovers from a lost shard (the steps redone start afresh: a
    /// small, documented difference, the run being inexact with bf16 anyway).
    pub(crate) encoder: Bf16Encoder,
    /// The cluster generation the shard answered registration with (one more after every
    /// recovery from a lost shard).
    pub(crate) generation: u64,
}

/// Fewest values a piece of a progressive push carries, except the last piece of a range: a
/// smaller final part (a bias, a small last layer) waits for the next one, sparing a piece
/// (and an earlier start of the push) that would save almost no time on the link.
pub const MIN_PIECE_VALUES: usize = 1 << 16;

/// Runs the worker to the end of the training run; returns its timing.
#[allow(clippy::too_many_lines)] // the step's loop: its pull/push lines are being changed by others (issue 39)
pub async fn run_worker(setup: WorkerSetup) -> anyhow::Result<Timing> {
    let WorkerSetup {
        cfg,
        servers,
        rank,
        train,
        test,
        mut backend,
    } = setup;
    let layout = cfg.layout();
    let world = cfg.cluster.workers;
    let total = cfg.total_steps(train.len())?;

    let JoinedRun {
        mut grad_board,
        grad_file,
        model,
        mut peers,
        start_step,
    } = join_run(&cfg, &servers, rank, total, &backend.name()).await?;

    let mut planner = BatchPlanner::new(cfg.data_order(train.len()));
    let test_slice = split_even(test.len(), world)[rank].clone();
    let test_idx: Vec<u32> = (test_slice.start as u32..test_slice.end as u32).collect();
    let mut weights = vec![0f32; layout.num_params()];
    let mut heap_grad = Vec::new();
    let grad: &mut [f32] = match &mut grad_board {
        Some((_, board)) => board.slot_mut(0),
        None => {
            heap_grad.resize(layout.num_params(), 0.0);
            &mut heap_grad
        }
    };
    let (mut x, mut y) = (Vec::new(), Vec::new());
    // one micro-batch's gradient, with [train] micro_batches > 1
    let mut part = Vec::new();
    let mut timing = Timing::default();
    let chunk_bytes = cfg.server.chunk_bytes;
    let wire = cfg.cluster.wire;

    let elastic = cfg.server.barrier_policy == BarrierPolicy::Continue;
    let shard_ranges: Vec<Range<usize>> = peers.iter().map(|p| p.range.clone()).collect();
    let patience = pull_patience(&cfg);
    let mut t = start_step;
    while t < total {
        // the copies counted for this step are its own (not those of a failed one)
        backend.take_copy_times()?;
        let t0 = Instant::now();
        // the pulls of version t run while this thread computes: forward waits at the gate
        // for each layer's parameters (pulled straight into the backend's host weights, or,
        // on a device with its own memory, into its staging memory, uploaded piece by piece
        // as it arrives; else into `weights`, uploaded once complete)
        let (gate, backend_gated) =
            step_gate(backend.as_mut(), &mut weights, t, &shard_ranges, patience);
        let jobs = pull_jobs(&peers);
        let runtime = tokio::runtime::Handle::current();
        let (mut t1, mut t2) = (t0, t0);
        let mut pushes = Vec::with_capacity(peers.len());
        let progressive: Vec<bool> = peers
            .iter()
            .map(|p| !p.ahead && !p.link.grad && p.client.data_link_usable() && !p.range.is_empty())
            .collect();
        // per shard: the sender of its push's pieces once it is under way
        let mut senders: Vec<Option<tokio::sync::mpsc::UnboundedSender<(usize, Bytes)>>> =
            (0..peers.len()).map(|_| None).collect();
        // the gradient board is read in place by the shards on this host until they publish
        // version t: backward writes it after forward, which waited for every layer of
        // version t; gradient accumulation and an empty batch write it (zeros) before any
        // forward, so they wait for the whole pull first
        let grad_shared = peers.iter().any(|p| p.link.grad);
        let (pulled, computed) = pull_while(&runtime, jobs, &gate, || -> anyhow::Result<()> {
            if !backend_gated {
                gate.wait_all()?;
                backend.set_weights(gate.published(0..layout.num_params()))?;
            }
            t1 = Instant::now();
            let eval =
                if cfg.train.eval_every > 0 && t > 0 && t.is_multiple_of(cfg.train.eval_every) {
                    evaluate(backend.as_mut(), &test, &test_idx, &mut x, &mut y)?
                } else {
                    (0, 0)
                };
            train.gather(planner.worker_batch(t, rank, world), &mut x, &mut y);
            if grad_shared && (cfg.train.micro_batches > 1 || y.is_empty()) {
                gate.wait_all()?;
            }
            let header = |stats: StepStats| PushHeader {
                rank: rank as u32,
                step: t,
                samples: y.len() as u32,
                loss_sum: stats.loss_sum,
                correct: stats.correct,
                len: 0,
                eval_correct: eval.0,
                eval_count: eval.1,
                shm: false,
            };
            // backward hands over the gradient last layer first: a shard on a data connection gets
            // each part of its range as soon as it is final, as a piece of one push; the others get
            // their whole range as soon as all of it is final; both while the earlier layers are
            // still being computed
            let mut pusher = Pusher {
                unsent: peers.len(),
                final_from: peers.iter().map(|p| p.range.end).collect(),
                sent: vec![0usize; peers.len()],
                peers: &mut peers,
                progressive: &progressive,
                senders: &mut senders,
                pushes: &mut pushes,
                runtime: &runtime,
                wire,
                chunk_bytes,
            };
            crate::backend::forward_backward_micro(
                backend.as_mut(),
                &x,
                &y,
                cfg.train.loss_reduction,
                cfg.train.micro_batches,
                grad,
                &mut part,
                &mut |start, tail, stats| {
                    pusher.pieces(start, tail, &header, stats);
                    pusher.whole(start, tail, &header, stats);
                },
            )?;
            t2 = Instant::now();
            Ok(())
        });
        backend.close_gate();
        drop(senders);
        let waits = gate.waits();
        drop(gate);
        let failed = match pulled {
            Err(e) => {
                // forward stopped at the gate: nothing computed with these weights was pushed
                debug_assert!(pushes.is_empty(), "a push after a failed pull");
                Some(e)
            }
            Ok(()) => {
                computed?;
                await_pushes(pushes, &progressive, &mut peers).await?
            }
        };
        if let Some(e) = failed {
            t = after_failure(
                elastic,
                &cfg,
                &mut peers,
                rank,
                (&grad_file, &model),
                total,
                t,
                e,
            )
            .await?;
            continue;
        }
        // only the first step (or the first after a rejoin) can find shards ahead
        peers.iter_mut().for_each(|p| p.ahead = false);
        let t3 = Instant::now();
        timing.add_step(t1 - t0, t2 - t1, t3 - t2, &waits);
        if let Some(c) = backend.take_copy_times()? {
            *timing.copies.get_or_insert_default() += c;
        }
        t += 1;
    }

    finish_run(
        &mut peers,
        backend.as_mut(),
        &mut weights,
        (&test, &test_idx),
        total,
        rank,
        &timing,
    )
    .await?;
    Ok(timing)
}

/// What a worker holds once it has joined the run ([`join_run`]).
struct JoinedRun {
    /// The gradient's shared-memory board (None: on the heap).
    grad_board: Option<(BoardDir, Board)>,
    /// The board's file and token, as registration names them.
    grad_file: (String, u64),
    /// The tensors this worker computes.
    model: Vec<ps_proto::pb::TensorDesc>,
    /// Every shard.
    peers: Vec<Peer>,
    /// The step it starts at.
    start_step: u64,
}

/// Joins the run: the gradient's board, the registration with every shard (logged, with the
/// device `backend` names), the step to start at.
async fn join_run(
    cfg: &Config,
    servers: &[String],
    rank: usize,
    total: u64,
    backend: &str,
) -> anyhow::Result<JoinedRun> {
    let layout = cfg.layout();
    let world = cfg.cluster.workers;
    // the gradient lives in a shared-memory board that the shards on this host read in place
    // (where /dev/shm allows), else on the heap
    let grad_board = match cfg.cluster.transport {
        Transport::Auto => grad_board(
            &ps_config::runid::board_prefix(cfg.cluster.run_id.as_deref()),
            rank,
            layout.num_params(),
        ),
        Transport::Grpc => None,
    };
    let grad_file = board_file(&grad_board);
    // what this worker computes: the built-in MLP
    let model = describe_model(&layout);
    let (peers, start_step) = register_all(cfg, servers, rank, total, &grad_file, &model).await?;
    let via: Vec<&str> = peers.iter().map(|p| p.link.describe()).collect();
    tracing::info!(
        "worker {rank}/{world}: registered with {} shards (tensors via {via:?}), starting at step {start_step} of {total}, device {}, {}",
        servers.len(),
        backend,
        ps_config::runid::show(cfg.cluster.run_id.as_deref())
    );
    Ok(JoinedRun {
        grad_board,
        grad_file,
        model,
        peers,
        start_step,
    })
}

/// The gate of step `t`'s pull from the shards holding `shard_ranges` ([`PullGate`]): the
/// backend's own (true: forward reads its weights as they arrive), else one over `weights`
/// (false: uploaded once complete).
fn step_gate(
    backend: &mut dyn Backend,
    weights: &mut [f32],
    t: u64,
    shard_ranges: &[Range<usize>],
    patience: Duration,
) -> (Arc<PullGate>, bool) {
    match backend.open_gate(t, shard_ranges.to_vec(), patience) {
        Some(g) => (g, true),
        None => {
            let layers = backend.layers();
            let (ptr, len) = (weights.as_mut_ptr(), weights.len());
            // SAFETY: `weights` is neither touched nor resized until the gate is dropped
            // at the end of this step, except through it: the writers of the pulling
            // thread (joined by `pull_while`) and `published` after `wait_all`.
            let g = Arc::new(unsafe {
                PullGate::new(ptr, len, t, shard_ranges.to_vec(), layers, patience)
            });
            (g, false)
        }
    }
}

/// The run's end: pulls the final weights (into `weights`), evaluates this rank's slice of the test set
/// (`test`: the set and the slice's indices), leaves every shard with it and logs the
/// worker's figures.
async fn finish_run(
    peers: &mut [Peer],
    backend: &mut dyn Backend,
    weights: &mut [f32],
    test: (&Dataset, &[u32]),
    total: u64,
    rank: usize,
    timing: &Timing,
) -> anyhow::Result<()> {
    // final weights: evaluate this rank's slice of the test set and leave
    peers.iter_mut().for_each(|p| p.ahead = false);
    pull_all(peers, total, weights).await?;
    backend.set_weights(weights)?;
    let (correct, count) = evaluate(backend, test.0, test.1, &mut Vec::new(), &mut Vec::new())?;
    leave_all(peers, rank, (correct, count)).await?;
    tracing::info!(
        "worker {rank}: done after {} steps; per step {}; test accuracy on its slice {:.2}% ({correct}/{count})",
        timing.steps,
        timing.describe(),
        100.0 * correct as f64 / count.max(1) as f64
    );
    Ok(())
}

/// The pushes of one step, sent while backward hands over the gradient last layer first: a
/// shard on a data connection gets each part of its range as soon as it is final, as a piece
/// of one push ([`Pusher::pieces`]); the others get their whole range as soon as all of it
/// is final ([`Pusher::whole`]).
struct Pusher<'a> {
    /// The shards whose range is not yet on its way whole (those before it, by range).
    unsent: usize,
    /// Per shard: where its final part starts (its range's end before any).
    final_from: Vec<usize>,
    /// Per shard: the pieces sent this step.
    sent: Vec<usize>,
    peers: &'a mut [Peer],
    /// Per shard: pushed piece by piece.
    progressive: &'a [bool],
    /// Per shard: the sender of its push's pieces once it is under way.
    senders: &'a mut Vec<Option<tokio::sync::mpsc::UnboundedSender<(usize, Bytes)>>>,
    pushes: &'a mut Vec<PushTask>,
    runtime: &'a tokio::runtime::Handle,
    wire: ps_config::Wire,
    chunk_bytes: usize,
}

impl Pusher<'_> {
    /// Sends the pieces of the progressive shards' ranges that the gradient from flat index
    /// `start` (`tail`) made final; `header(stats)` is the step's push header.
    fn pieces(
        &mut self,
        start: usize,
        tail: &[f32],
        header: &dyn Fn(StepStats) -> PushHeader,
        stats: StepStats,
    ) {
        let (wire, chunk_bytes, runtime) = (self.wire, self.chunk_bytes, self.runtime);
        let Pusher {
            final_from,
            sent,
            peers,
            progressive,
            senders,
            pushes,
            ..
        } = self;
        for s in (0..peers.len()).filter(|&s| progressive[s]) {
            let peer = &mut peers[s];
            let r = peer.range.clone();
            let (lo, hi) = (start.max(r.start), final_from[s]);
            if lo >= hi || (hi - lo < MIN_PIECE_VALUES && lo > r.start) {
                // nothing new of this shard's range is final, or too little to be
                // worth a piece of its own: it goes with the next one
                continue;
            }
            let buf = peer.piece_bufs.get_mut(sent[s]).and_then(Option::take);
            let values = &tail[lo - start..hi - start];
            let offset = lo - r.start;
            let bytes = encode_push_part(wire, values, offset, r.len(), &mut peer.encoder, buf);
            sent[s] += 1;
            final_from[s] = lo;
            let tx = senders[s].get_or_insert_with(|| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let h = PushHeader {
                    len: r.len() as u64,
                    ..header(stats)
                };
                let client = peer.client.clone();
                pushes.push(runtime.spawn(async move {
                    let (reply, pieces) = client.push_progressive(h, rx, chunk_bytes).await;
                    reply?;
                    let bufs = pieces.into_iter().map(|(_, b)| b).collect();
                    Ok::<_, anyhow::Error>((s, bufs))
                }));
                tx
            });
            // a push that ended early (refused) no longer takes pieces: its
            // error is what the step reports
            let _ = tx.send((offset, bytes));
            if lo == r.start {
                senders[s] = None; // the whole range is on its way
            }
        }
    }

    /// Pushes the whole range of each other shard whose range the gradient from flat index
    /// `start` (`tail`) made final, through gRPC or (`link.grad`) read in place by the shard.
    fn whole(
        &mut self,
        start: usize,
        tail: &[f32],
        header: &dyn Fn(StepStats) -> PushHeader,
        stats: StepStats,
    ) {
        let (wire, chunk_bytes, runtime) = (self.wire, self.chunk_bytes, self.runtime);
        let Pusher {
            unsent,
            peers,
            progressive,
            pushes,
            ..
        } = self;
        while *unsent > 0 && peers[*unsent - 1].range.start >= start {
            *unsent -= 1;
            let s = *unsent;
            let peer = &mut peers[s];
            if peer.ahead || progressive[s] {
                // applied step t already, or pushed piece by piece
                continue;
            }
            let r = &peer.range;
            // the shard reads the range in this worker's gradient board, or
            // receives a copy through gRPC
            let bytes = if peer.link.grad {
                Bytes::new()
            } else {
                let values = &tail[r.start - start..r.end - start];
                let buf = peer.push_buf.take();
                encode_push(wire, values, &mut peer.encoder, buf)
            };
            let h = PushHeader {
                len: r.len() as u64,
                shm: peer.link.grad,
                ..header(stats)
            };
            let client = peer.client.clone();
            pushes.push(runtime.spawn(async move {
                client.push_retrying(h, &bytes, chunk_bytes).await?;
                Ok::<_, anyhow::Error>((s, vec![bytes]))
            }));
        }
    }
}

/// Runs `compute` on this thread while a scoped thread of its own pulls `gate`'s version
/// from every shard ([`pull_gated`], on `runtime`); returns when both are done: the pulls'
/// result and compute's. (`compute` waits at the gate for the weights it reads; the pulls end
/// on their own, within their bounds, whatever `compute` does.)
fn pull_while<R>(
    runtime: &tokio::runtime::Handle,
    jobs: Vec<PullJob>,
    gate: &PullGate,
    compute: impl FnOnce() -> R,
) -> (anyhow::Result<()>, R) {
    tokio::task::block_in_place(|| {
        std::thread::scope(|scope| {
            let puller = scope.spawn(|| runtime.block_on(pull_gated(jobs, gate)));
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
                lease: None,
            })
            .await?;
    }
    Ok(())
}

/// Connects and registers with every shard (each retrying for `[worker] connect_timeout_secs`,
/// so that start order does not matter), checks that each holds the range and run length this
/// worker expects, and returns the shards with the step to start at.
///
/// A worker restarted after pushing step t to some shards but not all finds those shards at
/// version t + 1 (no shard can be further ahead: the others wait for this rank at step t); it
/// redoes step t from version t, which those shards still hold, and pushes only to the shards
/// that have not applied it: they are marked `ahead`.
pub(crate) async fn register_all(
    cfg: &Config,
    servers: &[String],
    rank: usize,
    total: u64,
    grad_file: &(String, u64),
    model: &[ps_proto::pb::TensorDesc],
) -> anyhow::Result<(Vec<Peer>, u64)> {
    let num_params: usize = model
        .iter()
        .map(|t| t.shape.iter().product::<u64>() as usize)
        .sum();
    let ranges = shard_ranges(num_params, servers.len());
    let connect_timeout = Duration::from_secs_f64(cfg.worker.connect_timeout_secs);
    let security = ps_net::auth::ClientSecurity::of(cfg);
    let mut peers = Vec::with_capacity(servers.len());
    for ((s, addr), range) in servers.iter().enumerate().zip(ranges) {
        let mut client = ShardClient::connect(s, addr, &security, connect_timeout).await?;
        client.set_wire(cfg.cluster.wire);
        peers.push(Peer {
            client,
            range,
            link: ShmLink::default(),
            ahead: false,
            push_buf: None,
            piece_bufs: Vec::new(),
            encoder: Bf16Encoder::new(),
            generation: 0,
        });
    }
    // the shards agree on a generation, except while they recover from a lost shard: then
    // register again until they do
    let begun = Instant::now();
    loop {
        let joined = register_round(cfg, &mut peers, rank, total, grad_file, model).await?;
        let gens: Vec<u64> = peers.iter().map(|p| p.generation).collect();
        if gens.iter().all(|&g| g == gens[0]) {
            let start_step = mark_ahead(&mut peers, &joined, rank);
            return Ok((peers, start_step));
        }
        if begun.elapsed() > connect_timeout {
            bail!(
                "the shards answer with different cluster generations {gens:?} after {:.0} s: a recovery from a lost shard did not finish ([worker] connect_timeout_secs)",
                begun.elapsed().as_secs_f64()
            );
        }
        tracing::info!(
            "worker {rank}: the shards are at generations {gens:?} (a recovery is under way); registering again"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Registers with every shard once (each retrying for `[worker] connect_timeout_secs` while the
/// refusal is retryable), checks the range and run length, opens the shared-memory links and
/// records each shard's generation; returns where each shard says this worker joins.
async fn register_round(
    cfg: &Config,
    peers: &mut [Peer],
    rank: usize,
    total: u64,
    grad_file: &(String, u64),
    model: &[ps_proto::pb::TensorDesc],
) -> anyhow::Result<Vec<Joined>> {
    let connect_timeout = Duration::from_secs_f64(cfg.worker.connect_timeout_secs);
    let num_shards = peers.len();
    let mut joined = Vec::with_capacity(num_shards);
    for (s, p) in peers.iter_mut().enumerate() {
        let req = register_request(cfg, num_shards, s, rank, grad_file, model);
        let addr = p.client.addr().to_string();
        let reply = p
            .client
            .register_retrying(req, connect_timeout)
            .await
            .with_context(|| format!("registering with shard {s} at {addr}"))?;
        let range = &p.range;
        if reply.start != range.start as u64
            || reply.len != range.len() as u64
            || reply.total_steps != total
        {
            bail!(
                "shard {s} at {addr} holds {}..{} of a {}-step run; this worker expects {range:?} of a {total}-step run (same config?)",
                reply.start,
                reply.start + reply.len,
                reply.total_steps,
            );
        }
        joined.push(Joined::from(&reply));
        p.link = ShmLink::open(&reply, s);
        p.generation = reply.generation;
    }
    Ok(joined)
}

/// After a pull or push failed with `err` in a way a lost shard causes (its connection
/// failed, or a shard said it rolled back), waits (at most `[worker] connect_timeout_secs`)
/// for the cluster to recover: registers again with every shard until all answer with one
/// generation newer than `known`, and returns the step to continue from (the shards'
/// version). None when the shards answer at generation `known` (no shard was lost).
#[allow(clippy::too_many_arguments)]
async fn await_recovery(
    cfg: &Config,
    peers: &mut [Peer],
    rank: usize,
    (grad_file, model): (&(String, u64), &[ps_proto::pb::TensorDesc]),
    known: u64,
    total: u64,
    t: u64,
    err: &anyhow::Error,
) -> anyhow::Result<Option<u64>> {
    let began = Instant::now();
    let patience = Duration::from_secs_f64(cfg.worker.connect_timeout_secs);
    tracing::warn!(
        "worker {rank}: step {t} failed ({err:#}); a shard may have been lost: waiting up to {:.0} s for the cluster to recover",
        patience.as_secs_f64()
    );
    let mut said = Instant::now();
    loop {
        let round = register_round(cfg, peers, rank, total, grad_file, model).await;
        let why = match round {
            Ok(joined) => {
                let gens: Vec<u64> = peers.iter().map(|p| p.generation).collect();
                let g = gens[0];
                if gens.iter().all(|&x| x == g) {
                    if g == known {
                        return Ok(None);
                    }
                    let start = mark_ahead(peers, &joined, rank);
                    tracing::warn!(
                        "worker {rank}: recovered: the cluster rolled back to version {start} (generation {g}) after step {t} failed; steps {start}..{t} are redone; {:.2} s after the failure",
                        began.elapsed().as_secs_f64()
                    );
                    return Ok(Some(start));
                }
                format!("the shards are at generations {gens:?}")
            }
            Err(e) => format!("{e:#}"),
        };
        if began.elapsed() > patience {
            bail!(
                "step {t} failed ({err:#}) and the cluster did not recover within {:.0} s ([worker] connect_timeout_secs): {why}",
                patience.as_secs_f64()
            );
        }
        if said.elapsed() > Duration::from_secs(5) {
            tracing::warn!(
                "worker {rank}: still waiting for the cluster to recover ({:.0} s): {why}",
                began.elapsed().as_secs_f64()
            );
            said = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Whether `err` looks like a lost shard: a connection that failed, a shard that says it
/// rolled back (`ABORTED`: the request's lease is of an older generation, or the shard's
/// state is being rolled back), or one that does not know this worker's registration (a
/// replacement); every other refusal stands as it is.
fn lost_shard_symptom(err: &anyhow::Error) -> bool {
    use ps_net::client::ClientError;
    err.chain().any(|e| match e.downcast_ref::<ClientError>() {
        Some(ClientError::Unreachable { .. }) => true,
        Some(ClientError::Refused { status, .. }) => {
            let text = ps_net::neterr::chain(status);
            match status.code() {
                ps_proto::tonic::Code::Unknown
                | ps_proto::tonic::Code::Cancelled
                | ps_proto::tonic::Code::Aborted => true,
                ps_proto::tonic::Code::FailedPrecondition => status
                    .message()
                    .contains("has not registered with this shard"),
                ps_proto::tonic::Code::Unavailable => {
                    status.message().contains("rolled back")
                        || text.contains("transport error")
                        || ps_net::neterr::kind(&text).is_some()
                }
                _ => false,
            }
        }
        _ => false,
    })
}

/// The registration of `rank` with shard `shard` of `num_shards`.
fn register_request(
    cfg: &Config,
    num_shards: usize,
    shard: usize,
    rank: usize,
    (grad_file, grad_token): &(String, u64),
    model: &[ps_proto::pb::TensorDesc],
) -> RegisterRequest {
    RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        rank: rank as u32,
        world_size: cfg.cluster.workers as u32,
        num_params: model.iter().map(|t| t.shape.iter().product::<u64>()).sum(),
        shard: shard as u32,
        num_shards: num_shards as u32,
        shared_memory: cfg.cluster.transport == Transport::Auto,
        grad_file: grad_file.clone(),
        grad_token: *grad_token,
        model: model.to_vec(),
    }
}

/// The board's path and token as registration sends them (empty without a board).
pub(crate) fn board_file(grad_board: &Option<(BoardDir, Board)>) -> (String, u64) {
    grad_board.as_ref().map_or_else(Default::default, |(d, b)| {
        (b.path().display().to_string(), d.token())
    })
}

/// Where a shard's registration reply says this worker joins.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Joined {
    /// The step (the shard's version) it joins at.
    version: u64,
    /// That step already counts this rank's gradient: a predecessor pushed it and died.
    counted: bool,
}

impl From<&RegisterReply> for Joined {
    fn from(r: &RegisterReply) -> Self {
        Self {
            version: r.version,
            counted: r.counted,
        }
    }
}

/// The step to start at, given where each shard says this worker joins (the lowest version);
/// the shards already one further, and those whose step already counts this rank's gradient,
/// are marked `ahead` (pulled exactly that version, not pushed to): a shard that counts the
/// gradient may apply the step before this worker pulls.
fn mark_ahead(peers: &mut [Peer], joined: &[Joined], rank: usize) -> u64 {
    let start_step = joined.iter().map(|j| j.version).min().unwrap_or(0);
    for (p, j) in peers.iter_mut().zip(joined) {
        p.ahead = j.version > start_step || j.counted;
    }
    let versions: Vec<u64> = joined.iter().map(|j| j.version).collect();
    if versions.iter().any(|&v| v > start_step) {
        tracing::warn!(
            "worker {rank}: shards are at versions {versions:?}: redoing step {start_step} from version {start_step}, pushing only to the shards that have not applied it"
        );
    }
    let counted: Vec<usize> = (0..joined.len())
        .filter(|&s| joined[s].counted && joined[s].version == start_step)
        .collect();
    if !counted.is_empty() {
        tracing::warn!(
            "worker {rank}: shards {counted:?} already count this rank's gradient of step {start_step} (pushed before a restart): step {start_step} is redone from version {start_step} without pushing to them"
        );
    }
    start_step
}

/// Set when the worker was told to stop (SIGTERM, SIGUSR1): it then does not wait for a
/// recovery from a lost shard (the shards are stopping too).
pub static STOP_REQUESTED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

async fn stop_requested() {
    while !STOP_REQUESTED.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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

/// After a pull or push of step `t` failed with `err`: when it looks like a lost shard, waits
/// for the cluster to recover ([`await_recovery`]) and returns the step to continue from; None
/// when it does not look like one, no shard was lost, or this worker is asked to stop.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn recover_if_lost(
    cfg: &Config,
    peers: &mut [Peer],
    rank: usize,
    files: (&(String, u64), &[ps_proto::pb::TensorDesc]),
    total: u64,
    t: u64,
    err: &anyhow::Error,
) -> anyhow::Result<Option<u64>> {
    if !lost_shard_symptom(err) || STOP_REQUESTED.load(std::sync::atomic::Ordering::SeqCst) {
        return Ok(None);
    }
    // steps are redone from the version rolled back to: the residuals start again at zero
    peers.iter_mut().for_each(|p| p.encoder.reset());
    let known = peers.first().map_or(0, |p| p.generation);
    tokio::select! {
        r = await_recovery(cfg, peers, rank, files, known, total, t, err) => r,
        () = stop_requested() => Ok(None),
    }
}

/// After a pull or push of step `t` failed with `err`: under `barrier_policy = "continue"` the
/// shards may have gone on without this worker (it was paused, or cut off, past the barrier
/// timeout), so it registers again with every shard, on the same connections; when they are
/// past step `t`, it rejoins at their step (or, after the last step, goes on to its final
/// evaluation and leaves). Otherwise (policy "fail", or the shards are not past `t`) the
/// error stands.
async fn rejoin(
    elastic: bool,
    cfg: &Config,
    peers: &mut [Peer],
    rank: usize,
    (grad_file, model): (&(String, u64), &[ps_proto::pb::TensorDesc]),
    t: u64,
    err: anyhow::Error,
) -> anyhow::Result<u64> {
    if !elastic {
        return Err(err);
    }
    // a worker left behind rejoins at the shards' step: its residuals start again at zero
    peers.iter_mut().for_each(|p| p.encoder.reset());
    let patience = Duration::from_secs_f64(cfg.worker.connect_timeout_secs);
    let mut joined = Vec::with_capacity(peers.len());
    let mut replies = Vec::with_capacity(peers.len());
    let num_shards = peers.len();
    for (s, p) in peers.iter_mut().enumerate() {
        let req = register_request(cfg, num_shards, s, rank, grad_file, model);
        match p.client.register_retrying(req, patience).await {
            Ok(reply) => {
                joined.push(Joined::from(&reply));
                replies.push(reply);
            }
            Err(e) => {
                return Err(err.context(format!(
                    "registering again with shard {s} after step {t} failed: {e}"
                )));
            }
        }
    }
    let start = joined.iter().map(|j| j.version).min().unwrap_or(0);
    if start <= t {
        return Err(err);
    }
    tracing::warn!(
        "worker {rank}: left behind at step {t} (the shards went on without it: {err:#}); rejoining at step {start} of {}",
        replies[0].total_steps
    );
    for ((s, p), reply) in peers.iter_mut().enumerate().zip(&replies) {
        p.link = ShmLink::open(reply, s);
    }
    Ok(mark_ahead(peers, &joined, rank))
}

/// What one shard's pull of a step needs: a client (a clone: the pushes keep theirs), its
/// board unless it is pulled `exact`ly (it is `ahead`), and whether it is.
pub(crate) struct PullJob {
    client: ShardClient,
    board: Option<Arc<Board>>,
    exact: bool,
}

pub(crate) fn pull_jobs(peers: &[Peer]) -> Vec<PullJob> {
    peers
        .iter()
        .map(|p| PullJob {
            client: p.client.clone(),
            board: p.link.params.clone().filter(|_| !p.ahead),
            exact: p.ahead,
        })
        .collect()
}

/// How long the forward pass waits at the gate for a layer: the shard's own bound on a pull
/// (`[server] pull_timeout_secs`, after which it answers the pull with an error) and half a
/// minute for the values to travel.
pub(crate) fn pull_patience(cfg: &Config) -> Duration {
    Duration::from_secs_f64(cfg.server.pull_timeout_secs + 30.0)
}

/// Pulls `gate`'s version from every shard, all side by side, each shard's values published
/// into the gate as they arrive; the requests go out in shard order (shard 0, the first
/// layers, first). A failed pull fails the gate (the forward pass stops at the next layer it
/// lacks) and is returned. (Pulling the shards of one host one after the other, so that the
/// first layers come at the link's whole speed, was measured slower on one host: the wait is
/// mostly the shards' barrier and update, and the later layers then waited for whole
/// round trips: see PERFORMANCE.md.)
pub(crate) async fn pull_gated(jobs: Vec<PullJob>, gate: &PullGate) -> anyhow::Result<()> {
    let futs = jobs.into_iter().enumerate().map(|(s, mut job)| async move {
        let mut writer = gate.writer(s);
        let pulled = job
            .client
            .pull_to(gate.version(), job.exact, job.board.as_deref(), &mut writer)
            .await;
        if let Err(e) = pulled {
            gate.fail(s, e.to_string());
            return Err(e);
        }
        writer.finish();
        Ok(())
    });
    for r in futures::future::join_all(futs).await {
        r?;
    }
    Ok(())
}

/// Pulls version `version` from every shard in parallel, each straight into its range of
/// `weights`: copied out of the shard's board where there is a link, decoded from the gRPC
/// chunks otherwise. From the shards marked `ahead` (already one version further) it pulls
/// exactly `version`, through gRPC.
pub(crate) async fn pull_all(
    peers: &mut [Peer],
    version: u64,
    weights: &mut [f32],
) -> anyhow::Result<()> {
    let mut rest = weights;
    let mut futs = Vec::with_capacity(peers.len());
    for p in peers.iter_mut() {
        let (dst, tail) = rest.split_at_mut(p.range.len());
        rest = tail;
        let board = p.link.params.as_deref().filter(|_| !p.ahead);
        futs.push(p.client.pull_into(version, p.ahead, board, dst));
    }
    for r in futures::future::join_all(futs).await {
        r?;
    }
    Ok(())
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

/// Creates this worker's gradient board (the whole flat gradient) in `/dev/shm`, in a directory
/// named after the run (`run`) and the rank; None, saying
/// why, where that is not possible (the shards then receive gradients through gRPC).
pub(crate) fn grad_board(run: &str, rank: usize, len: usize) -> Option<(BoardDir, Board)> {
    let root = shm_root()?;
    let made = BoardDir::create(&root, &format!("{run}-worker{rank}")).and_then(|dir| {
        let board = Board::create(&grad_path(dir.path()), dir.token(), len, 1)?;
        Ok((dir, board))
    });
    match made {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::info!(
                "worker {rank}: no shared-memory gradient board ({e}); pushing through gRPC"
            );
            None
        }
    }
}

/// A model's names and shapes in flat order, as registration carries them.
pub fn describe_model(spec: &ps_model::layout::ModelSpec) -> Vec<ps_proto::pb::TensorDesc> {
    spec.tensors
        .iter()
        .map(|t| ps_proto::pb::TensorDesc {
            name: t.name.clone(),
            shape: t.shape.iter().map(|&d| d as u64).collect(),
        })
        .collect()
}
