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
use anyhow::Context;
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

/// Set when the worker was told to stop (`ps_net::peer`, read by its recovery waits).
pub use ps_net::peer::STOP_REQUESTED;

/// Fewest values a piece of a progressive push carries, except the last piece of a range: a
/// smaller final part (a bias, a small last layer) waits for the next one, sparing a piece
/// (and an earlier start of the push) that would save almost no time on the link.
pub const MIN_PIECE_VALUES: usize = 1 << 16;

/// Runs the worker to the end of the training run; returns its timing.
#[allow(clippy::too_many_lines)] // split next (issue 39)
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

    // the gradient lives in a shared-memory board that the shards on this host read in place
    // (where /dev/shm allows), else on the heap
    // with [train] exact_sum the gradient pushed is the encoded exact partial sum
    let exact = cfg.train.exact_micro_batch;
    let push_len = match exact {
        Some(_) => crate::exact::wire_len(layout.num_params()),
        None => layout.num_params(),
    };
    let mut grad_board = match cfg.cluster.transport {
        Transport::Auto => grad_board(
            &ps_config::runid::board_prefix(cfg.cluster.run_id.as_deref()),
            rank,
            push_len,
        ),
        Transport::Grpc => None,
    };
    let grad_file = board_file(&grad_board);
    // what this worker computes: the built-in MLP
    let model = describe_model(&layout);
    let (mut peers, start_step) =
        register_all(&cfg, &servers, rank, total, &grad_file, &model).await?;
    let via: Vec<&str> = peers.iter().map(|p| p.link.describe()).collect();
    tracing::info!(
        "worker {rank}/{world}: registered with {} shards (tensors via {via:?}), starting at step {start_step} of {total}, device {}, {}",
        servers.len(),
        backend.name(),
        ps_config::runid::show(cfg.cluster.run_id.as_deref())
    );

    let mut planner = BatchPlanner::new(cfg.data_order(train.len()));
    let test_slice = split_even(test.len(), world)[rank].clone();
    let test_idx: Vec<u32> = (test_slice.start as u32..test_slice.end as u32).collect();
    let mut weights = vec![0f32; layout.num_params()];
    let mut heap_grad = Vec::new();
    let grad: &mut [f32] = match &mut grad_board {
        Some((_, board)) => board.slot_mut(0),
        None => {
            heap_grad.resize(push_len, 0.0);
            &mut heap_grad
        }
    };
    let (mut x, mut y) = (Vec::new(), Vec::new());
    // one micro-batch's gradient, with [train] micro_batches > 1
    let mut part = Vec::new();
    // the exact partial sum, with [train] exact_sum
    let mut exact_acc = ps_net::exact::TermSum::default();
    let mut timing = Timing::default();
    let chunk_bytes = cfg.server.chunk_bytes;
    let wire = cfg.cluster.wire;

    let elastic = cfg.server.barrier_policy == BarrierPolicy::Continue;
    let shard_ranges: Vec<Range<usize>> = peers.iter().map(|p| p.range.clone()).collect();
    // where each shard's push lies in `grad`: its range, or that of the encoded partial sum
    let push_ranges: Vec<Range<usize>> = match exact {
        Some(_) => shard_ranges
            .iter()
            .map(|r| crate::exact::wire_len(r.start)..crate::exact::wire_len(r.end))
            .collect(),
        None => shard_ranges.clone(),
    };
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
            open_step_gate(backend.as_mut(), &mut weights, t, &shard_ranges, patience);
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
            if grad_shared && (cfg.train.micro_batches > 1 || exact.is_some() || y.is_empty()) {
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
            let mut unsent = peers.len();
            // per shard: where its final part starts (its range's end before any), and the
            // pieces sent this step
            let mut final_from: Vec<usize> = push_ranges.iter().map(|r| r.end).collect();
            let mut sent = vec![0usize; peers.len()];
            let mut ready = |start: usize, tail: &[f32], stats: StepStats| {
                for s in (0..peers.len()).filter(|&s| progressive[s]) {
                    let peer = &mut peers[s];
                    let r = push_ranges[s].clone();
                    let (lo, hi) = (start.max(r.start), final_from[s]);
                    if lo >= hi || (hi - lo < MIN_PIECE_VALUES && lo > r.start) {
                        // nothing new of this shard's range is final, or too little to be
                        // worth a piece of its own: it goes with the next one
                        continue;
                    }
                    let buf = peer.piece_bufs.get_mut(sent[s]).and_then(Option::take);
                    let values = &tail[lo - start..hi - start];
                    let offset = lo - r.start;
                    let bytes =
                        encode_push_part(wire, values, offset, r.len(), &mut peer.encoder, buf);
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
                while unsent > 0 && push_ranges[unsent - 1].start >= start {
                    unsent -= 1;
                    let s = unsent;
                    let peer = &mut peers[s];
                    if peer.ahead || progressive[s] {
                        // applied step t already, or pushed piece by piece
                        continue;
                    }
                    let r = &push_ranges[s];
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
            };
            match exact {
                Some(m) => crate::exact::forward_backward_exact(
                    backend.as_mut(),
                    &x,
                    &y,
                    cfg.train.loss_reduction,
                    m,
                    &mut exact_acc,
                    &mut part,
                    grad,
                    &mut ready,
                )?,
                None => crate::backend::forward_backward_micro(
                    backend.as_mut(),
                    &x,
                    &y,
                    cfg.train.loss_reduction,
                    cfg.train.micro_batches,
                    grad,
                    &mut part,
                    &mut ready,
                )?,
            };
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
        (rank, total),
        (&test, &test_idx),
        &mut weights,
        &timing,
    )
    .await?;
    Ok(timing)
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
/// every shard with that count, and says so.
async fn finish_run(
    peers: &mut [Peer],
    backend: &mut dyn Backend,
    (rank, total): (usize, u64),
    (test, test_idx): (&Dataset, &[u32]),
    weights: &mut [f32],
    timing: &Timing,
) -> anyhow::Result<()> {
    peers.iter_mut().for_each(|p| p.ahead = false);
    pull_all(peers, total, weights).await?;
    backend.set_weights(weights)?;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let (correct, count) = evaluate(backend, test, test_idx, &mut x, &mut y)?;
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
