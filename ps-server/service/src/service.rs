//! The gRPC face of a shard: registration, chunked push and pull, leave, and the step reports
//! that shards send to shard 0. Handlers validate and delegate to [`Shard`]; errors are
//! [`PsError`]s turned into statuses in one place (`ps_proto::error`).
//!
//! This file holds the service's state and the handlers (`impl ParameterServer`); each path
//! behind them has its own module:
//! - `push`: a push's header and lease checked, its gRPC chunks received, handed to the intake;
//! - `frame`: a push's values read from the rank's data connection;
//! - `shm`: a push's values in the rank's shared-memory board;
//! - `step`: the step driver (fold, then complete: apply, report, metrics, checkpoint);
//! - `pull`: a pull checked and streamed as zero-copy chunks with an idle bound;
//! - `peer`: shard-to-shard calls (`Recover`, step reports) and their credential.

use crate::exporter::Metrics;
use crate::report::Reporter;
use crate::shard::bucket::Intake;
use crate::shard::intake::Held;
use crate::shard::{Grad, PushMeta, Shard, Slot};
use bytes::Bytes;
use futures::Stream;
use ps_config::Wire;
use ps_net::datalink;
use ps_net::throttle::ThrottleMap;
use ps_net::wire::{StreamCheck, TensorReceiver, check_and_fingerprint, chunks};
use ps_proto::pb::parameter_server_server::ParameterServer;
use ps_proto::pb::{
    BuffersPut, BuffersPutReply, BuffersReply, BuffersRequest, ClipNormReply, ClipNormRequest,
    ConstantsReply, ConstantsRequest, LeaveReply, LeaveRequest, PullChunk, PullHeader, PullRequest,
    PushChunk, PushReply, RecoverReply, RecoverRequest, RegisterReply, RegisterRequest,
    ReportReply, StepReport, UnusedReply, UnusedRequest,
};
use ps_proto::{PROTOCOL_VERSION, PsError, PsResult};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status, Streaming};

mod frame;
mod peer;
mod plane;
mod pull;
mod push;
mod shm;
mod step;

use plane::{Incoming, Plane};
use pull::{IdlePull, PullStream, pull_response};
pub use pull::{PullBody, SharedPulls, grpc_message, pull_chunks};

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
    /// The workers' leaves and last words after the last step (`crate::linger`).
    pub all_left: Arc<crate::linger::Leaving>,
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
    pub shard_token: Option<ps_net::auth::Token>,
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

/// The wire a registering worker says it pushes with ([`ps_net::client::WIRE_KEY`];
/// absent: f32).
fn worker_wire(meta: &tonic::metadata::MetadataMap) -> PsResult<Wire> {
    let Some(v) = meta.get(ps_net::client::WIRE_KEY) else {
        return Ok(Wire::F32);
    };
    v.to_str().ok().and_then(Wire::from_name).ok_or_else(|| {
        PsError::BadChunk(format!(
            "{} = {:?}: expected \"f32\" or \"bf16\"",
            ps_net::client::WIRE_KEY,
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
        for (what, r) in ps_net::auth::unreported_refusals() {
            tracing::warn!(
                "shard {}: {} more requests {what} refused since the last report, {} in all",
                self.shard.index,
                r.since,
                r.total
            );
        }
    }
}

struct PullState {
    chunks: std::collections::VecDeque<PullChunk>,
    progress: std::time::Instant,
    expired: Option<String>,
    finished: bool,
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
}

impl ShardService {
    /// A registering worker's view of the cluster checked against this shard's: the protocol,
    /// the wire (`theirs`), the world size, the model, the parameter count, the shard's index
    /// and the shard count; a mismatch is refused naming both sides.
    fn check_cluster(&self, r: &RegisterRequest, theirs: ps_config::Wire) -> Result<(), Status> {
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
            if let Some(diff) = ps_model::declared::first_difference(&s.spec, &theirs) {
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
        Ok(())
    }

    /// Opens rank `r`'s gradient board when it names one and its connection (`peer`) is of
    /// this process's user (a board is shared with no other user: that worker pushes through
    /// gRPC); whether it was opened.
    fn attach_board(
        &self,
        r: &RegisterRequest,
        peer: Option<std::net::SocketAddr>,
    ) -> Result<bool, Status> {
        let s = &self.shard;
        // a gradient board is shared only with a worker of this process's user
        let peer_user = peer.and_then(crate::shard::shm::peer_uid);
        let other_user = peer_user.filter(|&u| u != ps_net::shm::this_user());
        if let (Some(uid), false) = (other_user, r.grad_file.is_empty()) {
            tracing::warn!(
                "shard {}: rank {} registered from a connection of uid {uid}, another user: its gradient board is not opened (it pushes through gRPC)",
                s.index,
                r.rank
            );
        }
        Ok(!r.grad_file.is_empty()
            && other_user.is_none()
            && s.attach_grad(r.rank, std::path::Path::new(&r.grad_file), r.grad_token)?)
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
        self.check_cluster(&r, theirs)?;
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
        let grad_shm = self.attach_board(&r, peer)?;
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
        Ok(pull_response(IdlePull::start(
            chunks,
            self.stream_idle,
            self.shard.index,
        )))
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
        if r.evaluating {
            if self.all_left.evaluating(r.rank as usize) {
                tracing::info!(
                    "shard {}: rank {} is evaluating the final weights; waiting for its leave ([server] linger_secs after its last word)",
                    self.shard.index,
                    r.rank
                );
            }
            return Ok(Response::new(LeaveReply {}));
        }
        self.check_eval(r.rank, r.eval_count, true)?;
        let all = self.shard.leave(r.rank, (r.eval_correct, r.eval_count))?;
        tracing::debug!(shard = self.shard.index, rank = r.rank, "worker left");
        if all && self.shard.version() >= self.shard.total_steps {
            self.all_left.all_left();
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
        hub.check(&r)
            .map_err(|e| PsError::BadChunk(e.to_string()))?;
        // a shard applies step t only after every worker pulled version t from every shard:
        // norms for a step past this shard's version are not a shard's of this run
        let version = self.shard.version();
        if r.step > version {
            return Err(Status::failed_precondition(format!(
                "gradient norms of step {} from shard {}: shard 0 is at version {version}; expected a step not past it",
                r.step, r.shard
            )));
        }
        hub.contribute(r.shard as usize, r.step, r.first_tensor, &r.sq);
        let total_norm = hub.wait(r.step, &self.shard).await.map_err(|e| match e {
            crate::shard::NormError::Superseded { .. } => {
                Status::failed_precondition(e.to_string())
            }
            e => PsError::Unavailable(e.to_string()).into(),
        })?;
        Ok(Response::new(ClipNormReply {
            step: r.step,
            total_norm,
        }))
    }
}
