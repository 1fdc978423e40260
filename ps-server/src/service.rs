//! The gRPC face of a shard: registration, chunked push and pull, leave, and the step reports
//! that shards send to shard 0. Handlers validate and delegate to [`Shard`]; errors are
//! [`PsError`]s turned into statuses in one place (`ps_common::error`).

use crate::exporter::Metrics;
use crate::report::Reporter;
use crate::shard::intake::Held;
use crate::shard::{Grad, PushMeta, Shard, Slot};
use bytes::Bytes;
use futures::Stream;
use ps_common::config::Wire;
use ps_common::datalink;
use ps_common::pb::parameter_server_server::ParameterServer;
use ps_common::pb::{
    BuffersPut, BuffersPutReply, BuffersReply, BuffersRequest, ClipNormReply, ClipNormRequest,
    ConstantsReply, ConstantsRequest, LeaveReply, LeaveRequest, PullChunk, PullHeader, PullRequest,
    PushChunk, PushReply, RecoverReply, RecoverRequest, RegisterReply, RegisterRequest,
    ReportReply, StepReport, UnusedReply, UnusedRequest,
};
use ps_common::throttle::ThrottleMap;
use ps_common::wire::{StreamCheck, TensorReceiver, check_and_fingerprint, chunks};
use ps_common::{PROTOCOL_VERSION, PsError, PsResult};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tonic::{Request, Response, Status, Streaming};

/// The service of one shard.
#[derive(Debug, Clone)]
pub struct ShardService {
    /// The shard.
    pub shard: Arc<Shard>,
    /// Shard 0's logger (every shard has one; only shard 0's prints the cluster line).
    pub reporter: Reporter,
    /// Longest a pull waits for its version.
    pub pull_timeout: Duration,
    /// Payload bytes per pulled chunk.
    pub chunk_bytes: usize,
    /// Notified when every worker has left after the last step.
    pub all_left: Arc<Notify>,
    /// What `GET /metrics` shows.
    pub metrics: Arc<Metrics>,
    /// Open connections and the calls under way on each.
    pub peers: Arc<crate::peers::Peers>,
    /// Each rank's lease: who may act for it (`crate::lease`), checked by every transport.
    pub leases: Arc<crate::lease::Leases>,
    /// The length of each rank's slice of the test set, which its evaluations cover; None
    /// when the shard does not know the test set.
    pub test_slices: Option<Vec<u64>>,
    /// A push or pull stream that makes no progress for this long is ended
    /// (`[server] stream_idle_secs`).
    pub stream_idle: Duration,
    /// The shard credential step reports must carry (`[server] shard_token_file`).
    pub shard_token: Option<ps_common::auth::Token>,
    /// `[server] max_streams_per_connection` (enforced by HTTP/2; logged here when reached).
    pub max_streams: usize,
    /// Refused requests (pushes by gRPC code, step reports), logged once per
    /// `throttle::LOG_EVERY` for each kind with a count; the rest is said when the shard stops
    /// ([`ShardService::log_unreported_refusals`]).
    pub refusals: Arc<ThrottleMap<(&'static str, String)>>,
    /// The run this shard belongs to (empty: unnamed), told to registering workers.
    pub run_id: String,
    /// The cluster generation this shard serves, and the rollback it may be ordered to make
    /// (`crate::recovery`).
    pub recovery: Arc<crate::recovery::Cell>,
    /// The tensor data connections (None with TLS: they are not encrypted).
    pub data: Option<Arc<crate::data::DataConns>>,
    /// How pushed values arrive over the network (`[cluster] wire`); shared-memory pushes
    /// are f32 whatever it says.
    pub wire: Wire,
    /// Shard 0 with `[optimizer] clip_norm` over several shards: where the other shards'
    /// gradient norms meet (`crate::clip`).
    pub clip_hub: Option<Arc<crate::clip::Hub>>,
}

/// The wire a registering worker says it pushes with ([`ps_common::client::WIRE_KEY`];
/// absent: f32).
fn worker_wire(meta: &tonic::metadata::MetadataMap) -> PsResult<Wire> {
    let Some(v) = meta.get(ps_common::client::WIRE_KEY) else {
        return Ok(Wire::F32);
    };
    v.to_str().ok().and_then(Wire::from_name).ok_or_else(|| {
        PsError::BadChunk(format!(
            "{} = {:?}: expected \"f32\" or \"bf16\"",
            ps_common::client::WIRE_KEY,
            String::from_utf8_lossy(v.as_bytes())
        ))
    })
}

/// The rank named by a request's [`crate::data::DATA_RANK_KEY`] metadata: the request moves
/// its values on that rank's data connection.
fn data_rank(meta: &tonic::metadata::MetadataMap) -> PsResult<Option<u32>> {
    let Some(v) = meta.get(crate::data::DATA_RANK_KEY) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .map(Some)
        .ok_or_else(|| {
            PsError::BadChunk(format!(
                "{}: expected a rank (a number)",
                crate::data::DATA_RANK_KEY
            ))
        })
}

/// What a run's failure says when a worker stopped on an error and told the shards (a
/// `Leave` with `failed`).
pub const WORKER_STOPPED: &str = "stopped on an error";

/// How far (in steps) a step report may be from shard 0's version.
pub const REPORT_WINDOW: u64 = 16;

impl ShardService {
    /// The refusals counted but not logged yet (rate-limited), in one line per kind, so that
    /// the counts in the log add up to every refusal; called when the shard stops.
    pub fn log_unreported_refusals(&self) {
        for ((what, code), r) in self.refusals.unreported() {
            tracing::warn!(
                "shard {}: {} more refused {what} ({code}) since the last report, {} in all",
                self.shard.index,
                r.since,
                r.total
            );
        }
        for (what, r) in ps_common::auth::unreported_refusals() {
            tracing::warn!(
                "shard {}: {} more requests {what} refused since the last report, {} in all",
                self.shard.index,
                r.since,
                r.total
            );
        }
    }

    /// A push; `leased` is set once its header presented the rank's lease (only then may a
    /// failure close the rank's data connection).
    async fn push_inner(
        &self,
        mut stream: Streaming<PushChunk>,
        via_data: Option<u32>,
        leased: &mut bool,
    ) -> PsResult<PushReply> {
        let first = tokio::time::timeout(self.stream_idle, stream.message())
            .await
            .map_err(|_| {
                PsError::Timeout(format!(
                    "push stream sent no header for {:.1} s (stream_idle_secs): ended",
                    self.stream_idle.as_secs_f64()
                ))
            })?
            .map_err(|s| {
                PsError::BadChunk(format!(
                    "push stream broke before its header: {}",
                    s.message()
                ))
            })?
            .ok_or_else(|| {
                PsError::BadChunk("empty push stream: expected a header chunk".into())
            })?;
        let h = first
            .header
            .ok_or_else(|| PsError::BadChunk("first push chunk has no header".into()))?;
        self.leases.check(first.lease.as_ref(), Some(h.rank), || {
            format!("push of step {} from rank {}", h.step, h.rank)
        })?;
        *leased = true;
        if let Some(r) = via_data
            && (r != h.rank || h.shm || self.data.is_none())
        {
            return Err(PsError::BadChunk(format!(
                "a push of rank {} asked for the data connection of rank {r}{}",
                h.rank,
                if h.shm {
                    " with its gradient in shared memory: expected one or the other"
                } else if self.data.is_none() {
                    ": this shard has no data connections (TLS is on)"
                } else {
                    ": expected its own"
                }
            )));
        }
        self.shard.precheck(h.rank, h.step, h.len)?;
        if h.eval_correct > h.eval_count {
            return Err(PsError::BadChunk(format!(
                "eval_correct {} > eval_count {}: expected at most as many correct as evaluated",
                h.eval_correct, h.eval_count
            )));
        }
        self.check_eval(h.rank, h.eval_count, false)?;
        if !h.loss_sum.is_finite() || h.loss_sum < 0.0 || h.correct > u64::from(h.samples) {
            return Err(PsError::BadChunk(format!(
                "loss_sum {} / correct {} for {} samples: expected a finite non-negative loss and correct <= samples",
                h.loss_sum, h.correct, h.samples
            )));
        }
        let (grad, fingerprint) = if h.shm {
            self.receive_shm(h.rank, &first, &mut stream).await?
        } else {
            // the rank is not missing while its push waits for its turn or streams in
            let _under_way = self.shard.announce(h.rank, h.step, h.samples);
            self.fold().await?;
            match self.shard.wait_turn(h.rank, h.step).await? {
                Some(permit) if via_data.is_some() => {
                    let values = self
                        .receive_frame(&first, &mut stream, h.rank, h.step)
                        .await?;
                    let fp = check_and_fingerprint(&values);
                    let fp = match fp {
                        Ok(fp) => fp,
                        Err(e) => {
                            self.shard.return_buffer(values);
                            return Err(e);
                        }
                    };
                    let held = Held {
                        values,
                        permit: Some(permit),
                    };
                    (Grad::Owned(held), fp)
                }
                None if via_data.is_some() => (
                    Grad::Checked,
                    self.check_frame(&first, &mut stream, h.rank, h.step)
                        .await?,
                ),
                Some(permit) => {
                    let mut rx = TensorReceiver::with_buffer(
                        self.shard.take_buffer(),
                        self.shard.len(),
                        true,
                    )
                    .on_wire(self.wire);
                    let received = receive_rest(
                        &mut rx,
                        first.offset,
                        &first.data,
                        &mut stream,
                        self.stream_idle,
                    )
                    .await;
                    if let Err(e) = received {
                        self.shard.return_buffer(rx.into_buffer());
                        return Err(e);
                    }
                    let (values, fp) = match rx.finish() {
                        Ok(r) => r,
                        Err(e) => return Err(e),
                    };
                    let held = Held {
                        values,
                        permit: Some(permit),
                    };
                    (Grad::Owned(held), fp)
                }
                None => {
                    let mut check = StreamCheck::new(self.shard.len()).on_wire(self.wire);
                    let mut sink = |offset: u64, data: &[u8]| check.push(offset, data);
                    receive_with(
                        &mut sink,
                        first.offset,
                        &first.data,
                        &mut stream,
                        self.stream_idle,
                    )
                    .await?;
                    (Grad::Checked, check.finish()?)
                }
            }
        };
        let meta = PushMeta {
            rank: h.rank,
            step: h.step,
            samples: h.samples,
            loss_sum: h.loss_sum,
            correct: h.correct,
            eval: (h.eval_correct, h.eval_count),
        };
        let (outcome, ready) = self.shard.accept(meta, grad, fingerprint)?;
        if let Some(slots) = ready {
            self.complete_step(slots).await?;
        } else if outcome.counted {
            self.fold().await?;
        }
        Ok(PushReply {
            counted: outcome.counted,
            ranks_in: outcome.ranks_in,
        })
    }

    /// Applies a step whose barrier is complete (or given up on), on a blocking thread, then
    /// reports it, updates the metrics and writes a checkpoint when one is due. It runs to the
    /// end even if the caller that triggered it goes away. An update that finds a non-finite
    /// gradient value fails the run ([`Shard::apply`]).
    pub async fn complete_step(&self, slots: Vec<Slot>) -> PsResult<()> {
        let (shard, reporter) = (self.shard.clone(), self.reporter.clone());
        let metrics = self.metrics.clone();
        tokio::task::spawn_blocking(move || {
            let figures = shard.apply(slots)?;
            metrics.step(&figures);
            reporter.step_done(figures);
            if let Some(attempted) = shard.checkpoint_if_due() {
                metrics.checkpoint(&attempted);
                if let Some(why) = attempted.fatal {
                    return Err(PsError::RunFailed(why));
                }
            }
            Ok(())
        })
        .await
        .map_err(|e| PsError::Internal(format!("apply task failed: {e}")))?
    }

    /// Checks an evaluation `count` reported by `rank` (a known rank) against the rank's slice
    /// of the test set: at most its length in a push (0 when the push carries none); when the
    /// worker leaves, exactly its length (it evaluated its whole slice) or 0 (it evaluates
    /// nothing). Only the built-in model has test slices: a declared model's evaluation is
    /// the user's (any test set, any length), checked only for correct <= count.
    fn check_eval(&self, rank: u32, count: u64, leaving: bool) -> PsResult<()> {
        let Some(slice) = self
            .test_slices
            .as_ref()
            .and_then(|s| s.get(rank as usize).copied())
        else {
            return Ok(());
        };
        let fits = if leaving {
            count == slice || count == 0
        } else {
            count <= slice
        };
        if fits {
            return Ok(());
        }
        Err(PsError::BadChunk(format!(
            "eval_count {count} from rank {rank}: expected {} {slice}, the length of rank {rank}'s slice of the test set",
            if leaving {
                "0 (no evaluation) or exactly"
            } else {
                "at most"
            }
        )))
    }

    /// Folds the step's gradients that are in, in rank order, on a blocking thread.
    async fn fold(&self) -> PsResult<()> {
        let shard = self.shard.clone();
        tokio::task::spawn_blocking(move || shard.fold_ready())
            .await
            .map_err(|e| PsError::Internal(format!("fold task failed: {e}")))?
    }

    /// The gradient of a push whose values come on `rank`'s data connection: the gRPC stream
    /// must hold the header alone; the frame is read straight into a receive buffer (given
    /// back to the pool on failure). The connection is kept for the next frame only when this
    /// one was read in full.
    async fn receive_frame(
        &self,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
        rank: u32,
        step: u64,
    ) -> PsResult<Vec<f32>> {
        let (data, mut conn) = self.frame_conn(first, stream, rank).await?;
        let len = self.shard.len();
        let mut values = self.shard.take_buffer();
        values.clear();
        let what = format!("push of step {step} from rank {rank} (data connection)");
        let (wire, idle) = (self.wire, self.stream_idle);
        let read = async {
            let bytes = (wire.value_bytes() * len) as u64;
            let pieces =
                datalink::read_push_header(&mut conn.half, step, bytes, wire, &what, idle).await?;
            datalink::read_push_into_vec(
                &mut conn.half,
                &mut values,
                len,
                wire,
                pieces,
                &what,
                idle,
            )
            .await
        };
        if let Err(e) = read.await {
            self.shard.return_buffer(values);
            return Err(e);
        }
        data.put_read(rank, conn).await;
        Ok(values)
    }

    /// Like [`ShardService::receive_frame`] for a push the shard does not keep (a retry of a
    /// counted gradient): the frame is checked and fingerprinted piece by piece, not stored.
    async fn check_frame(
        &self,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
        rank: u32,
        step: u64,
    ) -> PsResult<u64> {
        let (data, mut conn) = self.frame_conn(first, stream, rank).await?;
        let len = self.shard.len();
        let what = format!("push of step {step} from rank {rank} (data connection)");
        let (wire, idle) = (self.wire, self.stream_idle);
        let vb = wire.value_bytes();
        let total = (vb * len) as u64;
        let pieces =
            datalink::read_push_header(&mut conn.half, step, total, wire, &what, idle).await?;
        let mut check = StreamCheck::new(len).on_wire(wire);
        let mut scratch = vec![0u8; ps_common::wire::DEFAULT_CHUNK_BYTES.min(vb * len.max(1))];
        if !pieces {
            stream_check(
                &mut conn.half,
                &mut check,
                &mut scratch,
                0,
                len,
                vb,
                &what,
                idle,
            )
            .await?;
        } else {
            // pieces in ascending contiguous order stream through the check; from the first
            // one out of order on, the rest is read into a buffer (under a permit, as a kept
            // gradient's is) and checked in order once complete
            let mut cov = datalink::Coverage::new(total, wire);
            let mut held: Option<(Vec<f32>, crate::shard::intake::Permit)> = None;
            let mut streamed = 0usize;
            let read = async {
                while !cov.complete() {
                    let (offset, n) =
                        datalink::read_piece_header(&mut conn.half, &cov, &what, idle).await?;
                    cov.add(offset, n, &what)?;
                    let (v0, count) = ((offset / vb as u64) as usize, (n / vb as u64) as usize);
                    let piece = format!("{what}, piece at bytes {offset}..{}", offset + n);
                    if held.is_none() && v0 == streamed {
                        stream_check(
                            &mut conn.half,
                            &mut check,
                            &mut scratch,
                            v0,
                            count,
                            vb,
                            &piece,
                            idle,
                        )
                        .await?;
                        streamed += count;
                        continue;
                    }
                    if held.is_none() {
                        let permit = self.shard.try_permit(rank, step).ok_or_else(|| {
                            PsError::Unavailable(format!(
                                "{what}: a gradient already counted came again with its pieces out of order, and no gradient buffer is free to check it (max_pending_gradients): push it again"
                            ))
                        })?;
                        let mut buf = self.shard.take_buffer();
                        buf.clear();
                        buf.resize(len, 0.0);
                        held = Some((buf, permit));
                    }
                    let (buf, _) = held.as_mut().expect("held just above");
                    datalink::read_piece_into(
                        &mut conn.half,
                        &mut buf[v0..v0 + count],
                        wire,
                        &piece,
                        idle,
                    )
                    .await?;
                }
                if let Some((buf, _)) = &held {
                    check.push_values(streamed as u64, &buf[streamed..])?;
                }
                Ok::<_, PsError>(())
            };
            let read = read.await;
            if let Some((buf, permit)) = held {
                self.shard.return_buffer(buf);
                drop(permit);
            }
            read?;
        }
        let fp = check.finish()?;
        data.put_read(rank, conn).await;
        Ok(fp)
    }
}

/// Streams `count` values (encoded `vb` bytes each) of a push frame from `conn` through
/// `check`, from value `at`, `scratch` at a time.
#[allow(clippy::too_many_arguments)]
async fn stream_check<R: tokio::io::AsyncRead + Unpin>(
    conn: &mut R,
    check: &mut StreamCheck,
    scratch: &mut [u8],
    mut at: usize,
    count: usize,
    vb: usize,
    what: &str,
    idle: Duration,
) -> PsResult<()> {
    let end = at + count;
    while at < end {
        let n = (end - at).min(scratch.len() / vb);
        datalink::read_all(conn, &mut scratch[..vb * n], what, idle).await?;
        check.push(at as u64, &scratch[..vb * n])?;
        at += n;
    }
    Ok(())
}

impl ShardService {
    /// Checks that a data-connection push's gRPC stream holds its header alone, and takes the
    /// rank's connection.
    async fn frame_conn(
        &self,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
        rank: u32,
    ) -> PsResult<(
        &Arc<crate::data::DataConns>,
        crate::data::Taken<tokio::net::tcp::OwnedReadHalf>,
    )> {
        let extra = !first.data.is_empty()
            || tokio::time::timeout(self.stream_idle, stream.message())
                .await
                .map_err(|_| {
                    PsError::Timeout(format!(
                        "push stream did not end for {:.1} s after its header (stream_idle_secs): ended",
                        self.stream_idle.as_secs_f64()
                    ))
                })?
                .map_err(|s| PsError::BadChunk(format!("push stream broke: {}", s.message())))?
                .is_some();
        if extra {
            return Err(PsError::BadChunk(
                "a push on the data connection carried data chunks: expected the header alone"
                    .into(),
            ));
        }
        let data = self
            .data
            .as_ref()
            .ok_or_else(|| PsError::Internal("no data connections".into()))?;
        let conn = data.take_read(rank).await?;
        Ok((data, conn))
    }

    /// A push whose gradient is in the rank's shared-memory board: checked there in place.
    async fn receive_shm(
        &self,
        rank: u32,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
    ) -> PsResult<(Grad, u64)> {
        let extra = !first.data.is_empty()
            || stream
                .message()
                .await
                .map_err(|s| PsError::BadChunk(format!("push stream broke: {}", s.message())))?
                .is_some();
        if extra {
            return Err(PsError::BadChunk(
                "a shared-memory push carried data chunks: expected the header alone".into(),
            ));
        }
        self.shard.shm_grad(rank)
    }

    async fn pull_inner(
        &self,
        req: PullRequest,
        via_data: Option<u32>,
    ) -> PsResult<Vec<PullChunk>> {
        let puller = self.leases.check(req.lease.as_ref(), via_data, || {
            format!("pull of version {}", req.min_version)
        })?;
        let last = self.shard.total_steps;
        if req.min_version > last {
            return Err(PsError::VersionOutOfRange {
                asked: req.min_version,
                last,
            });
        }
        let mut rx = self.shard.subscribe();
        let shard = &self.shard;
        let ready = rx.wait_for(|&v| v >= req.min_version || shard.failure().is_some());
        let waited = tokio::time::timeout(self.pull_timeout, ready).await;
        self.shard.refuse_failed(puller)?;
        match waited {
            Err(_) => {
                return Err(PsError::Timeout(format!(
                    "waited {:?} for version {}: shard {} is still at version {}",
                    self.pull_timeout,
                    req.min_version,
                    self.shard.index,
                    self.shard.version()
                )));
            }
            Ok(Err(_)) => return Err(PsError::Unavailable("shard is shutting down".into())),
            Ok(Ok(_)) => {}
        }
        drop(waited);
        if req.exact {
            let (version, snapshot) = self.shard.exactly(req.min_version)?;
            return Ok(pull_chunks(
                version,
                self.shard.range.start as u64,
                &snapshot,
                self.chunk_bytes,
            ));
        }
        if req.shm && self.shard.has_board() {
            // the worker copies the version out of the board (and checks it is still there)
            return Ok(vec![PullChunk {
                header: Some(PullHeader {
                    version: self.shard.version(),
                    start: self.shard.range.start as u64,
                    len: self.shard.len() as u64,
                    shm: true,
                    data_tcp: false,
                }),
                offset: 0,
                data: Bytes::new(),
            }]);
        }
        let (version, snapshot) = self.shard.snapshot()?;
        if let (Some(rank), Some(data)) = (via_data.map(|_| puller), &self.data) {
            // the rank's connection, unless another frame is being written on it: chunks then
            if let Some(mut w) = data.try_take_write(rank).await {
                let (data, idle, len) = (data.clone(), self.stream_idle, snapshot.len());
                let shard = self.shard.index;
                tokio::spawn(async move {
                    let write = datalink::write_frame(&mut w.half, version, &snapshot);
                    match tokio::time::timeout(idle, write).await {
                        Ok(Ok(())) => data.put_write(rank, w).await,
                        Ok(Err(e)) => tracing::warn!(
                            "shard {shard}: pull of version {version} by rank {rank} on its data connection failed after its header: {e}; connection dropped"
                        ),
                        Err(_) => tracing::warn!(
                            "shard {shard}: pull of version {version} by rank {rank}: {len} bytes not taken within {:.1} s (stream_idle_secs); data connection dropped",
                            idle.as_secs_f64()
                        ),
                    }
                });
                return Ok(vec![PullChunk {
                    header: Some(PullHeader {
                        version,
                        start: self.shard.range.start as u64,
                        len: self.shard.len() as u64,
                        shm: false,
                        data_tcp: true,
                    }),
                    offset: 0,
                    data: Bytes::new(),
                }]);
            }
        }
        Ok(pull_chunks(
            version,
            self.shard.range.start as u64,
            &snapshot,
            self.chunk_bytes,
        ))
    }
}

/// Receives the first chunk's data and every further chunk of a push into `rx`.
async fn receive_rest(
    rx: &mut TensorReceiver,
    offset: u64,
    data: &[u8],
    stream: &mut Streaming<PushChunk>,
    idle: Duration,
) -> PsResult<()> {
    let mut sink = |offset: u64, data: &[u8]| rx.push(offset, data);
    receive_with(&mut sink, offset, data, stream, idle).await
}

/// Hands the first chunk's data and every further chunk of a push to `sink`; a stream that
/// sends nothing for `idle` is ended with [`PsError::Timeout`].
async fn receive_with(
    sink: &mut (dyn FnMut(u64, &[u8]) -> PsResult<()> + Send),
    offset: u64,
    data: &[u8],
    stream: &mut Streaming<PushChunk>,
    idle: Duration,
) -> PsResult<()> {
    sink(offset, data)?;
    let mut received = data.len() as u64;
    loop {
        let next = tokio::time::timeout(idle, stream.message())
            .await
            .map_err(|_| {
                PsError::Timeout(format!(
                    "push stream idle for {:.1} s after {received} data bytes (stream_idle_secs): ended",
                    idle.as_secs_f64()
                ))
            })?
            .map_err(|s| PsError::BadChunk(format!("push stream broke: {}", s.message())))?;
        let Some(c) = next else {
            return Ok(());
        };
        if c.header.is_some() {
            return Err(PsError::BadChunk(
                "a second header in one push: expected one header, then data".into(),
            ));
        }
        sink(c.offset, &c.data)?;
        received += c.data.len() as u64;
    }
}

/// The chunks of one pull reply: zero-copy slices of the shared snapshot, the header on the first.
pub fn pull_chunks(
    version: u64,
    start: u64,
    snapshot: &Bytes,
    chunk_bytes: usize,
) -> Vec<PullChunk> {
    let len = (snapshot.len() / 4) as u64;
    chunks(snapshot, chunk_bytes)
        .enumerate()
        .map(|(i, (offset, data))| PullChunk {
            header: (i == 0).then_some(PullHeader {
                version,
                start,
                len,
                shm: false,
                data_tcp: false,
            }),
            offset,
            data,
        })
        .collect()
}

type PullStream = Pin<Box<dyn Stream<Item = Result<PullChunk, Status>> + Send>>;

/// A pull reply's chunks, ended with `DEADLINE_EXCEEDED` when the client takes none of them
/// for `idle` (`[server] stream_idle_secs`): a watchdog then drops the chunks (they hold the
/// version's snapshot) and the stream ends with that status as soon as it is polled again.
struct IdlePull {
    state: Arc<std::sync::Mutex<PullState>>,
}

struct PullState {
    chunks: std::collections::VecDeque<PullChunk>,
    progress: std::time::Instant,
    expired: Option<String>,
    finished: bool,
}

impl IdlePull {
    fn start(chunks: Vec<PullChunk>, idle: Duration, shard: usize) -> Self {
        let state = Arc::new(std::sync::Mutex::new(PullState {
            chunks: chunks.into(),
            progress: std::time::Instant::now(),
            expired: None,
            finished: false,
        }));
        let watched = Arc::downgrade(&state);
        tokio::spawn(async move {
            let mut wait = idle;
            loop {
                tokio::time::sleep(wait).await;
                let Some(state) = watched.upgrade() else {
                    return;
                };
                let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                if st.finished {
                    return;
                }
                let quiet = st.progress.elapsed();
                if quiet >= idle {
                    let left: usize = st.chunks.iter().map(|c| c.data.len()).sum();
                    let why = format!(
                        "pull stream idle for {:.1} s with {left} bytes not taken (stream_idle_secs): ended",
                        quiet.as_secs_f64()
                    );
                    tracing::warn!("shard {shard}: {why}");
                    st.chunks.clear();
                    st.expired = Some(why);
                    return;
                }
                wait = idle - quiet;
            }
        });
        Self { state }
    }
}

impl Stream for IdlePull {
    type Item = Result<PullChunk, Status>;

    fn poll_next(
        self: Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.finished {
            return std::task::Poll::Ready(None);
        }
        if let Some(why) = st.expired.take() {
            st.finished = true;
            return std::task::Poll::Ready(Some(Err(PsError::Timeout(why).into())));
        }
        st.progress = std::time::Instant::now();
        let next = st.chunks.pop_front();
        if next.is_none() {
            st.finished = true;
        }
        std::task::Poll::Ready(next.map(Ok))
    }
}

impl ShardService {
    /// A refusal as the worker must see it: once this shard was ordered to roll back, the
    /// failure it answers with meanwhile is [`PsError::RolledBack`] (`ABORTED`), as a request
    /// of an older generation is answered by the next state: the worker registers again.
    fn fence(&self, e: PsError) -> PsError {
        match (e, self.recovery.ordered()) {
            (PsError::Unavailable(why) | PsError::RunFailed(why), Some(o)) => PsError::RolledBack {
                shard: self.shard.index,
                what: format!("this request ({why})"),
                theirs: self.leases.generation(),
                ours: o.generation,
            },
            (e, _) => e,
        }
    }

    /// A shard-to-shard request (`what`) must carry the shard credential (`[server]
    /// shard_token_file`, or `PS_SHARD_TOKEN` as `ps-launch` sets it); a shard without one
    /// refuses them all.
    fn check_shard_credential(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        what: &str,
    ) -> PsResult<()> {
        let Some(t) = &self.shard_token else {
            return Err(PsError::Unauthenticated(format!(
                "{what}: this shard has no shard credential ([server] shard_token_file, or {}): shard-to-shard calls are refused",
                ps_common::auth::SHARD_TOKEN_ENV
            )));
        };
        {
            let got = metadata
                .get(ps_common::auth::SHARD_TOKEN_KEY)
                .map_or(&[][..], |v| v.as_bytes());
            if !t.matches(got) {
                return Err(PsError::Unauthenticated(format!(
                    "{what} {}: expected the shards' credential ({} from [server] shard_token_file); worker credentials cannot send it",
                    if got.is_empty() {
                        "without a shard credential"
                    } else {
                        "with a wrong shard credential"
                    },
                    ps_common::auth::SHARD_TOKEN_KEY
                )));
            }
        }
        Ok(())
    }

    /// The `Recover` call of a lost shard's replacement (`crate::recovery`): report where this
    /// shard is, roll back, or stop the run.
    async fn recover_inner(
        &self,
        request: Request<RecoverRequest>,
    ) -> Result<RecoverReply, Status> {
        self.check_shard_credential(request.metadata(), "recovery request")?;
        let r = request.into_inner();
        let s = &self.shard;
        let lost = r.lost as usize;
        if lost >= s.num_shards || lost == s.index {
            return Err(PsError::BadChunk(format!(
                "recovery request for shard {lost}: expected another shard of 0..{} than this one ({})",
                s.num_shards, s.index
            ))
            .into());
        }
        let version = s.version();
        let cell = self.recovery.clone();
        let checkpoints = tokio::task::spawn_blocking(move || cell.checkpoints(version))
            .await
            .map_err(|e| Status::internal(format!("listing the checkpoints: {e}")))?;
        let reply = RecoverReply {
            shard: s.index as u32,
            version,
            generation: self.recovery.generation(),
            checkpoints,
        };
        if !r.abort.is_empty() {
            let why = format!(
                "shard {lost} was lost and the run cannot go on: {}",
                r.abort
            );
            tracing::error!("shard {}: {why}", s.index);
            s.fail(why);
            return Ok(reply);
        }
        if !r.rollback {
            tracing::warn!(
                "shard {}: shard {lost}'s replacement asks where this shard is: version {version}, generation {}, checkpoints {:?}",
                s.index,
                reply.generation,
                reply.checkpoints
            );
            return Ok(reply);
        }
        if let Some(o) = self.recovery.ordered() {
            if o.generation == r.generation && o.version == r.version {
                return Ok(reply); // the same order again
            }
            return Err(Status::failed_precondition(format!(
                "shard {} is already rolling back to version {} (generation {})",
                s.index, o.version, o.generation
            )));
        }
        if r.generation <= self.recovery.generation() || r.version > version {
            return Err(Status::failed_precondition(format!(
                "rollback to version {} in generation {}: shard {} is at version {version} in generation {}: expected a newer generation and a version not past this shard's",
                r.version,
                r.generation,
                s.index,
                self.recovery.generation()
            )));
        }
        let ordered = std::time::Instant::now();
        let cell = self.recovery.clone();
        let v = r.version;
        let saved = tokio::task::spawn_blocking(move || cell.load(v))
            .await
            .map_err(|e| Status::internal(format!("reading the checkpoint: {e}")))?
            .map_err(|e| {
                Status::failed_precondition(format!(
                    "shard {} cannot roll back to version {v}: {e}",
                    s.index
                ))
            })?;
        tracing::warn!(
            "shard {}: shard {lost} was lost: rolling back from version {version} to version {v} (generation {}); steps {v}..{version} are redone",
            s.index,
            r.generation
        );
        self.recovery.order(crate::recovery::Rollback {
            lost,
            version: v,
            generation: r.generation,
            saved,
            from: version,
            ordered,
        });
        s.fail(format!(
            "rolled back to version {v} (generation {}): shard {lost} was lost; register again",
            r.generation
        ));
        Ok(reply)
    }

    /// A step report must come from a shard (the shard credential, when one is configured),
    /// name another shard of the layout, a step of the run within [`REPORT_WINDOW`] of this
    /// shard's version, and hold finite non-negative figures.
    fn check_report(&self, request: &Request<StepReport>) -> PsResult<()> {
        self.check_shard_credential(request.metadata(), "step report")?;
        let r = request.get_ref();
        let s = self.shard.num_shards;
        if r.shard as usize >= s || r.shard == 0 {
            return Err(PsError::BadChunk(format!(
                "step report from shard {}: expected a shard in 1..{s}",
                r.shard
            )));
        }
        let figures = [r.grad_sq_norm, r.step_ms, r.barrier_wait_ms];
        if figures.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(PsError::BadChunk(format!(
                "step report from shard {} (norm {}, step {} ms, barrier wait {} ms): expected finite non-negative figures",
                r.shard, r.grad_sq_norm, r.step_ms, r.barrier_wait_ms
            )));
        }
        crate::report::check_report_ranks(r, self.shard.world).map_err(PsError::BadChunk)?;
        let v = self.shard.version();
        if r.step >= self.shard.total_steps
            || r.step + REPORT_WINDOW < v
            || r.step > v + REPORT_WINDOW
        {
            return Err(PsError::BadChunk(format!(
                "step report of step {} from shard {}: expected a step of the run (0..{}) within {REPORT_WINDOW} of this shard's version {v}",
                r.step, r.shard, self.shard.total_steps
            )));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl ParameterServer for ShardService {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterReply>, Status> {
        let peer = request.remote_addr();
        let theirs = worker_wire(request.metadata())?;
        let r = request.into_inner();
        let s = &self.shard;
        if r.protocol_version != PROTOCOL_VERSION {
            return Err(PsError::ProtocolMismatch {
                expected: PROTOCOL_VERSION,
                got: r.protocol_version,
            }
            .into());
        }
        if theirs != self.wire {
            return Err(PsError::ClusterMismatch(format!(
                "[cluster] wire mismatch: worker rank {} pushes {:?}, shard {} expects {:?} (do both read the same config?)",
                r.rank,
                theirs.name(),
                s.index,
                self.wire.name()
            ))
            .into());
        }
        let mismatch = |what: &str, theirs: u64, ours: u64| -> Result<(), Status> {
            if theirs == ours {
                Ok(())
            } else {
                Err(PsError::ClusterMismatch(format!(
                    "{what} mismatch: the worker says {theirs}, shard {} has {ours} (do both read the same config?)",
                    s.index
                ))
                .into())
            }
        };
        mismatch("world size", u64::from(r.world_size), s.world as u64)?;
        if !r.model.is_empty() {
            let theirs: Vec<(String, Vec<usize>)> = r
                .model
                .iter()
                .map(|t| {
                    let shape = t.shape.iter().map(|&d| d as usize).collect();
                    (t.name.clone(), shape)
                })
                .collect();
            if let Some(diff) = ps_common::declared::first_difference(&s.spec, &theirs) {
                return Err(PsError::ClusterMismatch(format!(
                    "model mismatch: {diff} (shard {} trains {})",
                    s.index,
                    s.spec.describe()
                ))
                .into());
            }
        }
        mismatch("parameter count", r.num_params, s.num_params as u64)?;
        mismatch("shard index", u64::from(r.shard), s.index as u64)?;
        mismatch("shard count", u64::from(r.num_shards), s.num_shards as u64)?;
        s.check_rank(r.rank)?;
        if let Some(why) = s.failure() {
            // retryable: a rollback fails the shard's state until its new generation serves
            s.told(r.rank);
            return Err(PsError::Unavailable(why).into());
        }
        let lease = self.leases.grant(r.rank, peer).await?;
        let (version, counted) = s.register(r.rank)?;
        let (shm_dir, shm_token) = if r.shared_memory {
            s.offer_shm(r.rank)?.unwrap_or_default()
        } else {
            Default::default()
        };
        // a gradient board is shared only with a worker of this process's user
        let peer_user = peer.and_then(crate::shard::shm::peer_uid);
        let other_user = peer_user.filter(|&u| u != ps_common::shm::this_user());
        if let (Some(uid), false) = (other_user, r.grad_file.is_empty()) {
            tracing::warn!(
                "shard {}: rank {} registered from a connection of uid {uid}, another user: its gradient board is not opened (it pushes through gRPC)",
                s.index,
                r.rank
            );
        }
        let grad_shm = !r.grad_file.is_empty()
            && other_user.is_none()
            && s.attach_grad(r.rank, std::path::Path::new(&r.grad_file), r.grad_token)?;
        tracing::debug!(
            shard = s.index,
            rank = r.rank,
            version,
            shm_dir,
            "worker registered"
        );
        Ok(Response::new(RegisterReply {
            shard: s.index as u32,
            start: s.range.start as u64,
            len: s.len() as u64,
            version,
            total_steps: s.total_steps,
            shm_dir,
            shm_token,
            grad_shm,
            run_id: self.run_id.clone(),
            generation: self.recovery.generation(),
            data_port: self.data.as_ref().map_or(0, |d| u32::from(d.port)),
            counted,
            lease: Some(lease),
        }))
    }

    async fn push(
        &self,
        request: Request<Streaming<PushChunk>>,
    ) -> Result<Response<PushReply>, Status> {
        let _call = self
            .peers
            .stream(request.remote_addr(), self.max_streams, self.shard.index);
        let via_data = data_rank(request.metadata())?;
        let mut leased = false;
        match self
            .push_inner(request.into_inner(), via_data, &mut leased)
            .await
        {
            Ok(r) => {
                self.metrics.accepted();
                Ok(Response::new(r))
            }
            Err(e) => {
                let e = self.fence(e);
                // what is left of the frame must never be read as the next one: the rank's
                // connection is closed (only by its lease holder: anyone else's refused push
                // leaves it alone)
                if let (Some(rank), Some(data), true) = (via_data, &self.data, leased) {
                    data.close(rank).await;
                }
                self.metrics.refused(e.code());
                if let Some(r) = self.refusals.hit(&("pushes", format!("{:?}", e.code()))) {
                    tracing::warn!(shard = self.shard.index, "push refused: {e}{r}");
                }
                Err(e.into())
            }
        }
    }

    type PullStream = PullStream;

    async fn pull(
        &self,
        request: Request<PullRequest>,
    ) -> Result<Response<Self::PullStream>, Status> {
        let _call = self
            .peers
            .stream(request.remote_addr(), self.max_streams, self.shard.index);
        let via_data = data_rank(request.metadata())?;
        let chunks = self
            .pull_inner(request.into_inner(), via_data)
            .await
            .map_err(|e| self.fence(e))?;
        Ok(Response::new(Box::pin(IdlePull::start(
            chunks,
            self.stream_idle,
            self.shard.index,
        ))))
    }

    async fn leave(&self, request: Request<LeaveRequest>) -> Result<Response<LeaveReply>, Status> {
        let r = request.into_inner();
        if r.eval_correct > r.eval_count {
            return Err(PsError::BadChunk(format!(
                "eval_correct {} > eval_count {}: expected at most as many correct as evaluated",
                r.eval_correct, r.eval_count
            ))
            .into());
        }
        self.shard.check_rank(r.rank)?;
        self.leases.check(r.lease.as_ref(), Some(r.rank), || {
            format!("leave of rank {}", r.rank)
        })?;
        if !r.failed.is_empty() {
            // a worker that stopped on an error: the run cannot complete, so it ends now
            // instead of at the barrier timeout
            let why = format!(
                "rank {} {WORKER_STOPPED} at version {}: {}",
                r.rank,
                self.shard.version(),
                r.failed.chars().take(1000).collect::<String>()
            );
            if self.shard.version() < self.shard.total_steps && self.shard.failure().is_none() {
                tracing::error!("shard {}: {why}", self.shard.index);
                self.shard.fail(why);
            }
            self.shard.told(r.rank);
            return Ok(Response::new(LeaveReply {}));
        }
        self.check_eval(r.rank, r.eval_count, true)?;
        let all = self.shard.leave(r.rank, (r.eval_correct, r.eval_count))?;
        tracing::debug!(shard = self.shard.index, rank = r.rank, "worker left");
        if all && self.shard.version() >= self.shard.total_steps {
            self.all_left.notify_one();
        }
        Ok(Response::new(LeaveReply {}))
    }

    async fn check_constants(
        &self,
        request: Request<ConstantsRequest>,
    ) -> Result<Response<ConstantsReply>, Status> {
        let r = request.into_inner();
        self.leases.check(r.lease.as_ref(), Some(r.rank), || {
            format!("constants check of rank {}", r.rank)
        })?;
        self.shard.check_constants(r.rank, r.entries)?;
        Ok(Response::new(ConstantsReply {}))
    }

    async fn put_buffers(
        &self,
        request: Request<BuffersPut>,
    ) -> Result<Response<BuffersPutReply>, Status> {
        let r = request.into_inner();
        self.leases.check(r.lease.as_ref(), Some(r.rank), || {
            format!("buffers of rank {}", r.rank)
        })?;
        self.shard.put_buffers(r.rank, r.step, r.data)?;
        Ok(Response::new(BuffersPutReply {}))
    }

    async fn get_buffers(
        &self,
        request: Request<BuffersRequest>,
    ) -> Result<Response<BuffersReply>, Status> {
        let r = request.into_inner();
        self.leases.check(r.lease.as_ref(), Some(r.rank), || {
            format!("buffers pull of rank {}", r.rank)
        })?;
        let mut versions = self.shard.subscribe();
        let wait = async {
            loop {
                if let Some((version, data)) = self.shard.buffers(r.version)? {
                    return Ok(BuffersReply { version, data });
                }
                if versions.changed().await.is_err() {
                    return Err(PsError::Unavailable("the shard is stopping".into()));
                }
            }
        };
        match tokio::time::timeout(self.pull_timeout, wait).await {
            Ok(reply) => Ok(Response::new(reply?)),
            Err(_) => Err(PsError::Timeout(format!(
                "the buffers of version {} (the shard is at version {}) after {:.1} s",
                r.version,
                self.shard.version(),
                self.pull_timeout.as_secs_f64()
            ))
            .into()),
        }
    }

    async fn mark_unused(
        &self,
        request: Request<UnusedRequest>,
    ) -> Result<Response<UnusedReply>, Status> {
        let r = request.into_inner();
        self.leases.check(r.lease.as_ref(), Some(r.rank), || {
            format!("unused-tensor mark of rank {}", r.rank)
        })?;
        self.shard
            .mark_unused(r.rank, r.step, r.tensors)
            .map_err(|e| self.fence(e))?;
        Ok(Response::new(UnusedReply {}))
    }

    async fn report_step(
        &self,
        request: Request<StepReport>,
    ) -> Result<Response<ReportReply>, Status> {
        let peer = request.remote_addr();
        let checked = self.check_report(&request);
        if let Err(e) = &checked
            && let Some(r) = self
                .refusals
                .hit(&("step reports", format!("{:?}", e.code())))
        {
            tracing::warn!(
                "shard {}: refused a step report from {}: {e}{r}",
                self.shard.index,
                peer.map_or_else(|| "an unknown peer".into(), |a| a.to_string())
            );
        }
        checked?;
        let r = request.into_inner();
        self.reporter.remote_report(r);
        Ok(Response::new(ReportReply {}))
    }

    async fn recover(
        &self,
        request: Request<RecoverRequest>,
    ) -> Result<Response<RecoverReply>, Status> {
        self.recover_inner(request).await.map(Response::new)
    }

    async fn clip_norm(
        &self,
        request: Request<ClipNormRequest>,
    ) -> Result<Response<ClipNormReply>, Status> {
        self.check_shard_credential(request.metadata(), "gradient norms for clipping")?;
        let r = request.into_inner();
        let Some(hub) = &self.clip_hub else {
            return Err(PsError::BadChunk(format!(
                "gradient norms from shard {}: shard {} gathers none (only shard 0 does, with [optimizer] clip_norm)",
                r.shard, self.shard.index
            ))
            .into());
        };
        let ours = self.recovery.generation();
        if r.generation != ours {
            return Err(PsError::Unavailable(format!(
                "gradient norms from shard {} of generation {}: this shard serves generation {ours}",
                r.shard, r.generation
            ))
            .into());
        }
        if r.step >= self.shard.total_steps {
            return Err(PsError::BadChunk(format!(
                "gradient norms of step {} from shard {}: expected a step of the run (0..{})",
                r.step, r.shard, self.shard.total_steps
            ))
            .into());
        }
        hub.check(&r).map_err(PsError::BadChunk)?;
        hub.contribute(r.shard as usize, r.step, r.first_tensor, &r.sq);
        let total_norm = hub
            .wait(r.step, &self.shard)
            .await
            .map_err(PsError::Unavailable)?;
        Ok(Response::new(ClipNormReply {
            step: r.step,
            total_norm,
        }))
    }
}
