//! The worker's loop: register with every shard (retrying with backoff, so start order does not
//! matter), then for each step pull every shard's version `t` in parallel, compute the gradient
//! of its slice of global batch `t`, and push each shard its part in parallel. At the end it
//! evaluates the final weights on its slice of the test set and leaves. With shards on the
//! same host, tensors go through shared-memory boards and only headers through gRPC
//! (`ps_common::shm`); each shard and direction falls back to gRPC on its own.

use crate::backend::{Backend, StepStats};
use anyhow::{Context, bail};
use bytes::Bytes;
use ps_common::PROTOCOL_VERSION;
use ps_common::config::Config;
use ps_common::config::Transport;
use ps_common::idx::Dataset;
use ps_common::layout::{shard_ranges, split_even};
use ps_common::order::BatchPlanner;
use ps_common::pb::parameter_server_client::ParameterServerClient;
use ps_common::pb::{
    LeaveRequest, PullRequest, PushChunk, PushHeader, RegisterReply, RegisterRequest,
};
use ps_common::shm::{Board, BoardDir, grad_path, params_path, shm_root};
use ps_common::wire::{MAX_MESSAGE_BYTES, chunks, decode_chunk_into, f32_to_bytes_reusing};
use std::ops::Range;
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::{Code, Status};

use ps_common::auth::{Client, ClientSecurity};

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

/// Averages of a run's step phases, for the final log line.
#[derive(Debug, Default, Clone, Copy)]
pub struct Timing {
    /// Steps run.
    pub steps: u64,
    /// Total pull time.
    pub pull: Duration,
    /// Total compute time.
    pub compute: Duration,
    /// Total push time.
    pub push: Duration,
}

/// Opens a channel to `addr` with the flow-control windows sized for large tensors, with TLS
/// and the token on every request when the config asks for them.
pub async fn connect(
    addr: &str,
    timeout: Duration,
    security: &ClientSecurity,
) -> anyhow::Result<Client> {
    let endpoint = security
        .endpoint(addr)
        .map_err(anyhow::Error::msg)?
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(16 << 20)
        .tcp_nodelay(true)
        .max_frame_size((1 << 20) - 1)
        .connect_timeout(Duration::from_secs(5));
    let start = Instant::now();
    let mut delay = Duration::from_millis(50);
    loop {
        match endpoint.connect().await {
            Ok(ch) => {
                return Ok(
                    ParameterServerClient::with_interceptor(ch, security.interceptor())
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .max_encoding_message_size(MAX_MESSAGE_BYTES),
                );
            }
            Err(e) if start.elapsed() < timeout => {
                tracing::debug!("connecting to {addr}: {e}; retrying in {delay:?}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(e) => bail!(
                "cannot reach shard at {addr} after {:.0} s: {e}",
                timeout.as_secs_f64()
            ),
        }
    }
}

fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled
    )
}

/// Runs the worker to the end of the training run; returns its timing.
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
    let ranges = shard_ranges(layout.num_params(), servers.len());
    let connect_timeout = Duration::from_secs_f64(cfg.worker.connect_timeout_secs);

    // the gradient lives in a shared-memory board that the shards on this host read in place
    // (where /dev/shm allows), else on the heap
    let mut grad_board = match cfg.cluster.transport {
        Transport::Auto => grad_board(rank, layout.num_params()),
        Transport::Grpc => None,
    };
    let (grad_file, grad_token) = grad_board.as_ref().map_or_else(Default::default, |(d, b)| {
        (b.path().display().to_string(), d.token())
    });

    // connect and register with every shard
    let security = cfg.client_security();
    let mut clients = Vec::with_capacity(servers.len());
    let mut links = Vec::with_capacity(servers.len());
    let mut versions = Vec::with_capacity(servers.len());
    for (s, addr) in servers.iter().enumerate() {
        let mut c = connect(addr, connect_timeout, &security).await?;
        let req = RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            rank: rank as u32,
            world_size: world as u32,
            num_params: layout.num_params() as u64,
            shard: s as u32,
            num_shards: servers.len() as u32,
            shared_memory: cfg.cluster.transport == Transport::Auto,
            grad_file: grad_file.clone(),
            grad_token,
        };
        let begun = Instant::now();
        let reply = loop {
            match c.register(req.clone()).await {
                Ok(r) => break r.into_inner(),
                Err(st) if retryable(&st) && begun.elapsed() < connect_timeout => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                Err(st) => bail!("shard {s} at {addr} refused registration: {}", st.message()),
            }
        };
        if reply.start != ranges[s].start as u64
            || reply.len != ranges[s].len() as u64
            || reply.total_steps != total
        {
            bail!(
                "shard {s} at {addr} holds {}..{} of a {}-step run; this worker expects {:?} of a {total}-step run (same config?)",
                reply.start,
                reply.start + reply.len,
                reply.total_steps,
                ranges[s]
            );
        }
        versions.push(reply.version);
        clients.push(c);
        links.push(ShmLink::open(&reply, s));
    }
    // a worker restarted after pushing step t to some shards but not all finds those shards at
    // version t + 1 (no shard can be further ahead: the others wait for this rank at step t);
    // it redoes step t from version t, which those shards still hold, and pushes only to the
    // shards that have not applied it
    let start_step = versions.iter().copied().min().unwrap_or(0);
    let ahead: Vec<bool> = versions.iter().map(|&v| v > start_step).collect();
    if ahead.iter().any(|&a| a) {
        tracing::warn!(
            "worker {rank}: shards are at versions {versions:?}: redoing step {start_step} from version {start_step}, pushing only to the shards that have not applied it"
        );
    }
    let via: Vec<&str> = links.iter().map(ShmLink::describe).collect();
    tracing::info!(
        "worker {rank}/{world}: registered with {} shards (tensors via {via:?}), starting at step {start_step} of {total}, device {}",
        servers.len(),
        backend.name()
    );

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
    let mut timing = Timing::default();
    let chunk_bytes = cfg.server.chunk_bytes;
    // each shard's push buffer, reused from step to step once its RPC has released it
    let mut push_bufs: Vec<Option<Bytes>> = vec![None; ranges.len()];

    let up_to_date = vec![false; ranges.len()];
    for t in start_step..total {
        let t0 = Instant::now();
        // only the first step can find shards ahead
        let skip = if t == start_step { &ahead } else { &up_to_date };
        if let Some(w) = backend.host_weights() {
            pull_all(&mut clients, &links, &ranges, t, skip, w).await?;
        } else {
            pull_all(&mut clients, &links, &ranges, t, skip, &mut weights).await?;
            backend.set_weights(&weights)?;
        }
        let t1 = Instant::now();
        let eval = if cfg.train.eval_every > 0 && t > 0 && t.is_multiple_of(cfg.train.eval_every) {
            evaluate(backend.as_mut(), &test, &test_idx, &mut x, &mut y)?
        } else {
            (0, 0)
        };
        train.gather(planner.worker_batch(t, rank, world), &mut x, &mut y);
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
        // backward hands over the gradient last layer first: push each shard's range as soon as
        // it is final, while the earlier layers are still being computed
        let runtime = tokio::runtime::Handle::current();
        let mut pushes = Vec::with_capacity(ranges.len());
        let mut unsent = ranges.len();
        tokio::task::block_in_place(|| {
            backend.forward_backward_overlapped(
                &x,
                &y,
                cfg.train.loss_reduction,
                grad,
                &mut |start, tail, stats| {
                    while unsent > 0 && ranges[unsent - 1].start >= start {
                        unsent -= 1;
                        if skip[unsent] {
                            continue; // this shard applied step t already
                        }
                        let r = &ranges[unsent];
                        let values = &tail[r.start - start..r.end - start];
                        // the shard reads the range in this worker's gradient board, or
                        // receives a copy through gRPC
                        let shm = links[unsent].grad;
                        let bytes = if shm {
                            Bytes::new()
                        } else {
                            f32_to_bytes_reusing(values, push_bufs[unsent].take())
                        };
                        let h = PushHeader {
                            len: r.len() as u64,
                            shm,
                            ..header(stats)
                        };
                        pushes.push(runtime.spawn(push_one(
                            clients[unsent].clone(),
                            unsent,
                            h,
                            bytes,
                            chunk_bytes,
                        )));
                    }
                },
            )
        })?;
        let t2 = Instant::now();
        for p in pushes {
            let (shard, bytes) = p.await.context("push task")??;
            push_bufs[shard] = Some(bytes);
        }
        let t3 = Instant::now();
        timing.steps += 1;
        timing.pull += t1 - t0;
        timing.compute += t2 - t1;
        timing.push += t3 - t2;
    }

    // final weights: evaluate this rank's slice of the test set and leave
    pull_all(
        &mut clients,
        &links,
        &ranges,
        total,
        &up_to_date,
        &mut weights,
    )
    .await?;
    backend.set_weights(&weights)?;
    let (correct, count) = evaluate(backend.as_mut(), &test, &test_idx, &mut x, &mut y)?;
    for (s, c) in clients.iter_mut().enumerate() {
        c.leave(LeaveRequest {
            rank: rank as u32,
            eval_correct: correct,
            eval_count: count,
        })
        .await
        .map_err(|st| anyhow::anyhow!("shard {s}: leave refused: {}", st.message()))?;
    }
    let per = |d: Duration| d.as_secs_f64() * 1e3 / timing.steps.max(1) as f64;
    tracing::info!(
        "worker {rank}: done after {} steps; per step pull {:.2} ms, compute {:.2} ms, push {:.2} ms; test accuracy on its slice {:.2}% ({correct}/{count})",
        timing.steps,
        per(timing.pull),
        per(timing.compute),
        per(timing.push),
        100.0 * correct as f64 / count.max(1) as f64
    );
    Ok(timing)
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

/// Creates this worker's gradient board (the whole flat gradient) in `/dev/shm`; None, saying
/// why, where that is not possible (the shards then receive gradients through gRPC).
fn grad_board(rank: usize, len: usize) -> Option<(BoardDir, Board)> {
    let root = shm_root()?;
    let made = BoardDir::create(&root, &format!("worker{rank}")).and_then(|dir| {
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

/// What a worker shares with one shard through memory: the shard's parameters board (pulls)
/// and whether the shard reads this worker's gradient board (pushes).
#[derive(Default)]
pub struct ShmLink {
    params: Option<Board>,
    grad: bool,
}

impl ShmLink {
    /// The link a registration reply offers. The parameters board is opened with the reply's
    /// token; one that cannot be (the shard is on another host) means gRPC pulls, said once.
    pub fn open(reply: &RegisterReply, shard: usize) -> Self {
        let params = (!reply.shm_dir.is_empty())
            .then(|| {
                let path = params_path(Path::new(&reply.shm_dir));
                Board::open(&path, reply.shm_token, reply.len as usize, 2)
                    .map_err(|why| {
                        tracing::info!(
                            "shard {shard}: shared memory not usable from here ({why}); pulling through gRPC"
                        )
                    })
                    .ok()
            })
            .flatten();
        Self {
            params,
            grad: reply.grad_shm,
        }
    }

    /// "shared memory", "gRPC", or which way each direction goes.
    pub fn describe(&self) -> &'static str {
        match (self.params.is_some(), self.grad) {
            (true, true) => "shared memory",
            (false, false) => "gRPC",
            (true, false) => "pull shared memory, push gRPC",
            (false, true) => "pull gRPC, push shared memory",
        }
    }
}

/// Pulls version `version` from every shard in parallel, each straight into its place in
/// `weights`: copied out of the shard's board where there is a link, decoded from the gRPC
/// chunks otherwise. From the shards marked in `previous` (already one version further) it
/// pulls exactly `version`, through gRPC.
pub async fn pull_all(
    clients: &mut [Client],
    links: &[ShmLink],
    ranges: &[Range<usize>],
    version: u64,
    previous: &[bool],
    weights: &mut [f32],
) -> anyhow::Result<()> {
    let mut parts = Vec::with_capacity(ranges.len());
    let mut rest = weights;
    for r in ranges {
        let (part, tail) = rest.split_at_mut(r.len());
        parts.push(part);
        rest = tail;
    }
    let futs = clients
        .iter_mut()
        .zip(parts)
        .enumerate()
        .map(|(s, (c, dst))| {
            let exact = previous.get(s).copied().unwrap_or(false);
            let board = links
                .get(s)
                .and_then(|l| l.params.as_ref())
                .filter(|_| !exact);
            pull_one(c, s, version, dst, board, exact)
        });
    for r in futures::future::join_all(futs).await {
        r?;
    }
    Ok(())
}

/// Pulls version `version` of shard `s` into `dst`, through `board` when given (falling back
/// to gRPC if the version changed during the copy); `exact` asks for that version even if the
/// shard is one further.
async fn pull_one(
    c: &mut Client,
    s: usize,
    version: u64,
    dst: &mut [f32],
    board: Option<&Board>,
    exact: bool,
) -> anyhow::Result<()> {
    let failed = |st: Status| {
        anyhow::anyhow!(
            "pull of version {version} from shard {s} failed: {}",
            st.message()
        )
    };
    let mut via_board = board.is_some();
    loop {
        let mut stream = c
            .pull(PullRequest {
                min_version: version,
                rank: 0,
                shm: via_board,
                exact,
            })
            .await
            .map_err(failed)?
            .into_inner();
        let first = stream
            .message()
            .await
            .map_err(failed)?
            .context("empty pull reply")?;
        let h = first
            .header
            .as_ref()
            .context("pull reply without a header")?;
        if h.version != version {
            bail!(
                "shard {s} is at version {} but this worker needs version {version}",
                h.version
            );
        }
        if h.len != dst.len() as u64 {
            bail!("shard {s} holds {} values: expected {}", h.len, dst.len());
        }
        if h.shm {
            let board = board.filter(|_| via_board).with_context(|| {
                format!("shard {s} answered through shared memory, which this pull did not ask for")
            })?;
            if board.read_version(version, dst) {
                return Ok(());
            }
            tracing::warn!(
                "shard {s}: version {version} left the shared-memory board during the copy; pulling it through gRPC"
            );
            via_board = false;
            continue;
        }
        let mut filled = 0u64;
        let mut chunk = Some(first);
        while let Some(c) = chunk {
            if c.offset != filled {
                bail!("shard {s}: chunk at offset {}, expected {filled}", c.offset);
            }
            decode_chunk_into(dst, c.offset, &c.data)?;
            filled += (c.data.len() / 4) as u64;
            chunk = stream.message().await.map_err(failed)?;
        }
        if filled != dst.len() as u64 {
            bail!("shard {s} sent {filled} values: expected {}", dst.len());
        }
        return Ok(());
    }
}

/// Pushes one shard its gradient slice (`bytes`, little-endian f32) in chunks, retrying
/// transport failures: the server acknowledges a retry of a gradient it already counted
/// without counting it twice. Returns the shard and the buffer, for reuse.
pub async fn push_one(
    mut client: Client,
    shard: usize,
    header: PushHeader,
    bytes: Bytes,
    chunk_bytes: usize,
) -> anyhow::Result<(usize, Bytes)> {
    let mut attempt = 0;
    loop {
        let msgs: Vec<PushChunk> = chunks(&bytes, chunk_bytes)
            .enumerate()
            .map(|(i, (offset, data))| PushChunk {
                header: (i == 0).then_some(header),
                offset,
                data,
            })
            .collect();
        match client.push(tokio_stream::iter(msgs)).await {
            Ok(_) => return Ok((shard, bytes)),
            Err(st) if retryable(&st) && attempt < 5 => {
                attempt += 1;
                tracing::warn!(
                    "push of step {} to shard {shard} failed ({}); retry {attempt}",
                    header.step,
                    st.message()
                );
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
            Err(st) => bail!(
                "shard {shard} refused the gradient of step {}: {}",
                header.step,
                st.message()
            ),
        }
    }
}
