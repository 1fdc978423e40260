//! A worker's shards, without the training loop: connect and register with every shard
//! (retrying, so start order does not matter; agreeing on one cluster generation), recover
//! after a lost shard or rejoin after being left behind, and pull a version from every shard
//! side by side (into a flat vector, or into a [`PullGate`] beside the forward pass). Used by
//! the Rust worker's loop (`ps-worker`) and by [`crate::session`] (the Python worker).

use crate::client::{ClientError, ShardClient, ShmLink};
use crate::gate::PullGate;
use crate::shm::{Board, BoardDir, grad_path, shm_root};
use crate::wire::Bf16Encoder;
use anyhow::{Context, bail};
use bytes::Bytes;
use ps_config::{Config, Transport};
use ps_model::layout::shard_ranges;
use ps_proto::PROTOCOL_VERSION;
use ps_proto::pb::{RegisterReply, RegisterRequest};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One shard as this worker sees it: the connection, the shard's range of the flat parameter
/// vector, what goes through shared memory, and the push buffer.
pub struct Peer {
    /// The gRPC connection (control, and the values when no other plane is offered).
    pub client: ShardClient,
    /// The shard's range of the flat parameter vector.
    pub range: Range<usize>,
    /// The shard's shared-memory boards, when it shares this worker's host.
    pub link: ShmLink,
    /// The shard had already applied the step this worker starts at (this worker replaces one
    /// that died between its pushes): it is pulled exactly that version and not pushed to.
    pub ahead: bool,
    /// The gradient bytes of the last push through gRPC, reused once its RPC has released them.
    pub push_buf: Option<Bytes>,
    /// The pieces of the last progressive push, in the order they were sent (each step sends
    /// the same pieces in the same order), reused likewise.
    pub piece_bufs: Vec<Option<Bytes>>,
    /// With `[cluster] wire = "bf16"`: the rounding error this worker carries into its next
    /// push to this shard (error feedback). It survives across steps and is reset to zero when
    /// the worker rejoins or recovers from a lost shard (the steps redone start afresh: a
    /// small, documented difference, the run being inexact with bf16 anyway).
    pub encoder: Bf16Encoder,
    /// The cluster generation the shard answered registration with (one more after every
    /// recovery from a lost shard).
    pub generation: u64,
}

/// Connects and registers with every shard (each retrying for `[worker] connect_timeout_secs`,
/// so that start order does not matter), checks that each holds the range and run length this
/// worker expects, and returns the shards with the step to start at.
///
/// A worker restarted after pushing step t to some shards but not all finds those shards at
/// version t + 1 (no shard can be further ahead: the others wait for this rank at step t); it
/// redoes step t from version t, which those shards still hold, and pushes only to the shards
/// that have not applied it: they are marked `ahead`.
pub async fn register_all(
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
    let security = crate::auth::ClientSecurity::of(cfg);
    let mut peers = Vec::with_capacity(servers.len());
    for ((s, addr), range) in servers.iter().enumerate().zip(ranges) {
        let mut client = ShardClient::connect(s, addr, &security, connect_timeout).await?;
        client.set_wire(cfg.cluster.wire);
        // no call waits on a shard that stopped answering: a frozen or cut-off shard ends
        // this worker with an error naming it, however the worker was started
        client.set_deadline(cfg);
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
pub async fn register_round(
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
pub async fn await_recovery(
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
pub fn lost_shard_symptom(err: &anyhow::Error) -> bool {
    use crate::client::ClientError;
    err.chain().any(|e| match e.downcast_ref::<ClientError>() {
        Some(ClientError::Unreachable { .. }) => true,
        Some(ClientError::Refused { status, .. }) => {
            let text = crate::neterr::chain(status);
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
                        || crate::neterr::kind(&text).is_some()
                }
                _ => false,
            }
        }
        _ => false,
    })
}

/// The registration of `rank` with shard `shard` of `num_shards`.
pub fn register_request(
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
pub fn board_file(grad_board: &Option<(BoardDir, Board)>) -> (String, u64) {
    grad_board.as_ref().map_or_else(Default::default, |(d, b)| {
        (b.path().display().to_string(), d.token())
    })
}

/// Where a shard's registration reply says this worker joins.
#[derive(Debug, Clone, Copy)]
pub struct Joined {
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
pub fn mark_ahead(peers: &mut [Peer], joined: &[Joined], rank: usize) -> u64 {
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

/// Resolves once [`STOP_REQUESTED`] is set (polled every 50 ms).
pub async fn stop_requested() {
    while !STOP_REQUESTED.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// After a pull or push of step `t` failed with `err`: when it looks like a lost shard, waits
/// for the cluster to recover ([`await_recovery`]) and returns the step to continue from; None
/// when it does not look like one, no shard was lost, or this worker is asked to stop.
#[allow(clippy::too_many_arguments)]
pub async fn recover_if_lost(
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
pub async fn rejoin(
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
pub struct PullJob {
    client: ShardClient,
    board: Option<Arc<Board>>,
    exact: bool,
}

/// One [`PullJob`] per shard of `peers`, in shard order.
pub fn pull_jobs(peers: &[Peer]) -> Vec<PullJob> {
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
pub fn pull_patience(cfg: &Config) -> Duration {
    Duration::from_secs_f64(cfg.server.pull_timeout_secs + 30.0)
}

/// Pulls `gate`'s version from every shard, all side by side, each shard's values published
/// into the gate as they arrive: each shard's pull is a task of its own, spawned in shard order
/// (shard 0, the first layers, first), so that the shards' board copies run at once, each on
/// its own threads (`Board::read_version_into`). A failed pull fails the gate (the forward
/// pass stops at the next layer it lacks) and is returned (the first in shard order). The
/// tasks hold `gate` until they end; dropping this future aborts them (a copy under way ends
/// first: wait for `gate`'s other holders to go before freeing its memory). (Pulling the
/// shards of one host one after the other, so that the first layers come at the link's whole
/// speed, was measured slower on one host: the wait is mostly the shards' barrier and update,
/// and the later layers then waited for whole round trips: see PERFORMANCE.md.)
pub async fn pull_gated(jobs: Vec<PullJob>, gate: Arc<PullGate>) -> anyhow::Result<()> {
    let tasks = jobs.into_iter().enumerate().map(|(s, mut job)| {
        let gate = gate.clone();
        tokio::spawn(async move {
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
        })
    });
    let mut tasks = AbortOnDrop(tasks.collect());
    let mut first = None;
    for (s, r) in futures::future::join_all(tasks.0.iter_mut())
        .await
        .into_iter()
        .enumerate()
    {
        let r = r.unwrap_or_else(|e| {
            gate.fail(s, format!("the pull task failed: {e}"));
            Err(ClientError::Incomplete(format!(
                "the pull of shard {s} failed: {e}"
            )))
        });
        if let Err(e) = r {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), |e| Err(e.into()))
}

/// Tasks aborted when dropped ([`pull_gated`]'s, when its future is).
struct AbortOnDrop(Vec<tokio::task::JoinHandle<Result<(), ClientError>>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.iter().for_each(tokio::task::JoinHandle::abort);
    }
}

/// Pulls version `version` from every shard in parallel, each straight into its range of
/// `weights`: copied out of the shard's board where there is a link, decoded from the gRPC
/// chunks otherwise. From the shards marked `ahead` (already one version further) it pulls
/// exactly `version`, through gRPC.
pub async fn pull_all(peers: &mut [Peer], version: u64, weights: &mut [f32]) -> anyhow::Result<()> {
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

/// Creates this worker's gradient board (the whole flat gradient) in `/dev/shm`, in a directory
/// named after the run (`run`) and the rank; None, saying
/// why, where that is not possible (the shards then receive gradients through gRPC).
pub fn grad_board(run: &str, rank: usize, len: usize) -> Option<(BoardDir, Board)> {
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
