//! The gRPC face of a shard: registration, chunked push and pull, leave, and the step reports
//! that shards send to shard 0. Handlers validate and delegate to [`Shard`]; errors are
//! [`PsError`]s turned into statuses in one place (`ps_common::error`).

use crate::exporter::Metrics;
use crate::report::Reporter;
use crate::shard::{Grad, PushMeta, Shard, Slot};
use bytes::Bytes;
use futures::Stream;
use ps_common::pb::parameter_server_server::ParameterServer;
use ps_common::pb::{
    LeaveReply, LeaveRequest, PullChunk, PullHeader, PullRequest, PushChunk, PushReply,
    RegisterReply, RegisterRequest, ReportReply, StepReport,
};
use ps_common::wire::{TensorReceiver, chunks};
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
    /// Open connections and each rank's holder (a second live worker of a rank is refused).
    pub peers: Arc<crate::peers::Peers>,
    /// The run this shard belongs to (empty: unnamed), told to registering workers.
    pub run_id: String,
}

impl ShardService {
    async fn push_inner(&self, mut stream: Streaming<PushChunk>) -> PsResult<PushReply> {
        let first = stream
            .message()
            .await
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
        self.shard.precheck(h.rank, h.step, h.len)?;
        if h.eval_correct > h.eval_count {
            return Err(PsError::BadChunk(format!(
                "eval_correct {} > eval_count {}: expected at most as many correct as evaluated",
                h.eval_correct, h.eval_count
            )));
        }
        if !h.loss_sum.is_finite() || h.loss_sum < 0.0 || h.correct > u64::from(h.samples) {
            return Err(PsError::BadChunk(format!(
                "loss_sum {} / correct {} for {} samples: expected a finite non-negative loss and correct <= samples",
                h.loss_sum, h.correct, h.samples
            )));
        }
        let (grad, fingerprint) = if h.shm {
            self.receive_shm(h.rank, &first, &mut stream).await?
        } else {
            let mut rx =
                TensorReceiver::with_buffer(self.shard.take_buffer(), self.shard.len(), true);
            let received = receive_rest(&mut rx, first.offset, &first.data, &mut stream).await;
            if let Err(e) = received {
                self.shard.return_buffer(rx.into_buffer());
                return Err(e);
            }
            let (grad, fp) = rx.finish()?;
            (Grad::Owned(grad), fp)
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
            shard.checkpoint_if_due();
            Ok(())
        })
        .await
        .map_err(|e| PsError::Internal(format!("apply task failed: {e}")))?
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

    async fn pull_inner(&self, req: PullRequest) -> PsResult<Vec<PullChunk>> {
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
        if let Some(why) = self.shard.failure() {
            return Err(PsError::Unavailable(why));
        }
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
        if req.exact && req.min_version < self.shard.version() {
            let (version, snapshot) = self.shard.previous(req.min_version)?;
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
                }),
                offset: 0,
                data: Bytes::new(),
            }]);
        }
        let (version, snapshot) = self.shard.snapshot()?;
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
) -> PsResult<()> {
    rx.push(offset, data)?;
    while let Some(c) = stream
        .message()
        .await
        .map_err(|s| PsError::BadChunk(format!("push stream broke: {}", s.message())))?
    {
        if c.header.is_some() {
            return Err(PsError::BadChunk(
                "a second header in one push: expected one header, then data".into(),
            ));
        }
        rx.push(c.offset, &c.data)?;
    }
    Ok(())
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
            }),
            offset,
            data,
        })
        .collect()
}

type PullStream = Pin<Box<dyn Stream<Item = Result<PullChunk, Status>> + Send>>;

#[tonic::async_trait]
impl ParameterServer for ShardService {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterReply>, Status> {
        let peer = request.remote_addr();
        let r = request.into_inner();
        let s = &self.shard;
        if r.protocol_version != PROTOCOL_VERSION {
            return Err(PsError::ProtocolMismatch {
                expected: PROTOCOL_VERSION,
                got: r.protocol_version,
            }
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
        mismatch("parameter count", r.num_params, s.num_params as u64)?;
        mismatch("shard index", u64::from(r.shard), s.index as u64)?;
        mismatch("shard count", u64::from(r.num_shards), s.num_shards as u64)?;
        s.check_rank(r.rank)?;
        if let Some(peer) = peer
            && let Err(holder) = self.peers.claim(r.rank, peer).await
        {
            return Err(PsError::RankTaken {
                rank: r.rank,
                holder: holder.to_string(),
            }
            .into());
        }
        let version = s.register(r.rank)?;
        let (shm_dir, shm_token) = if r.shared_memory {
            s.offer_shm(r.rank)?.unwrap_or_default()
        } else {
            Default::default()
        };
        let grad_shm = !r.grad_file.is_empty()
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
        }))
    }

    async fn push(
        &self,
        request: Request<Streaming<PushChunk>>,
    ) -> Result<Response<PushReply>, Status> {
        match self.push_inner(request.into_inner()).await {
            Ok(r) => {
                self.metrics.accepted();
                Ok(Response::new(r))
            }
            Err(e) => {
                self.metrics.refused(e.code());
                tracing::warn!(shard = self.shard.index, "push refused: {e}");
                Err(e.into())
            }
        }
    }

    type PullStream = PullStream;

    async fn pull(
        &self,
        request: Request<PullRequest>,
    ) -> Result<Response<Self::PullStream>, Status> {
        let chunks = self.pull_inner(request.into_inner()).await?;
        Ok(Response::new(Box::pin(tokio_stream::iter(
            chunks.into_iter().map(Ok),
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
        let all = self.shard.leave(r.rank, (r.eval_correct, r.eval_count))?;
        tracing::debug!(shard = self.shard.index, rank = r.rank, "worker left");
        if all && self.shard.version() >= self.shard.total_steps {
            self.all_left.notify_one();
        }
        Ok(Response::new(LeaveReply {}))
    }

    async fn report_step(
        &self,
        request: Request<StepReport>,
    ) -> Result<Response<ReportReply>, Status> {
        let r = request.into_inner();
        if r.shard as usize >= self.shard.num_shards || r.shard == 0 || !r.grad_sq_norm.is_finite()
        {
            return Err(PsError::BadChunk(format!(
                "step report from shard {} (norm {}): expected a shard in 1..{} and a finite norm",
                r.shard, r.grad_sq_norm, self.shard.num_shards
            ))
            .into());
        }
        self.reporter.remote_report(r);
        Ok(Response::new(ReportReply {}))
    }
}
