//! The typed errors of the parameter server and the one place that maps them to gRPC status
//! codes. Handlers return `PsResult` and use `?`; every message says what was expected.

#[cfg(feature = "grpc")]
use tonic::{Code, Status};

/// Result with a [`PsError`].
pub type PsResult<T> = Result<T, PsError>;

/// Everything a request can be refused for.
#[derive(Debug, thiserror::Error)]
pub enum PsError {
    /// The peer speaks another protocol version.
    #[error(
        "protocol version {got} is not supported: this server speaks protocol version {expected} (the worker and the shard come from different releases: run the same build on both)"
    )]
    ProtocolMismatch {
        /// Ours.
        expected: u32,
        /// Theirs.
        got: u32,
    },
    /// The worker's view of the cluster or model differs from the server's.
    #[error("{0}")]
    ClusterMismatch(String),
    /// A rank outside `0..world_size`.
    #[error("unknown rank {rank}: expected a rank in 0..{world}")]
    UnknownRank {
        /// The rank asked for.
        rank: u32,
        /// World size.
        world: u32,
    },
    /// A push from a rank that never registered.
    #[error("rank {0} has not registered with this shard: call Register first")]
    NotRegistered(u32),
    /// A push for a step the shard has already completed.
    #[error("stale step {step}: this shard already applied it and expects step {expected}")]
    StaleStep {
        /// The step pushed.
        step: u64,
        /// The step the shard expects.
        expected: u64,
    },
    /// A push for a step the shard has not reached.
    #[error(
        "future step {step}: this shard expects step {expected} (pull version {step} before pushing step {step})"
    )]
    FutureStep {
        /// The step pushed.
        step: u64,
        /// The step the shard expects.
        expected: u64,
    },
    /// A push for a step that is not a step of the run (`0..total_steps`).
    #[error(
        "step {step} is not a step of this run: expected a step in 0..{total_steps} (the run has {total_steps} steps)"
    )]
    StepOutOfRange {
        /// The step pushed.
        step: u64,
        /// Steps of the run.
        total_steps: u64,
    },
    /// A rank registered by a second worker while the first is still connected.
    #[error(
        "rank {rank} is held by a live worker (connected from {holder}): two workers cannot share a rank; give this one another --rank, or stop the other first"
    )]
    RankTaken {
        /// The rank.
        rank: u32,
        /// The address the live holder connected from.
        holder: String,
    },
    /// A second, different gradient for a step from the same rank.
    #[error(
        "rank {rank} already pushed a different gradient for step {step}: a retry must resend the same values"
    )]
    Conflict {
        /// The rank.
        rank: u32,
        /// The step.
        step: u64,
    },
    /// A tensor of the wrong length.
    #[error("wrong length: expected {expected} f32 values, got {got}")]
    WrongLength {
        /// Expected values.
        expected: u64,
        /// Values received.
        got: u64,
    },
    /// NaN or infinity in a gradient.
    #[error(
        "non-finite value {value} at index {index} of the gradient: expected finite f32 values"
    )]
    NonFinite {
        /// Index in the shard's slice.
        index: u64,
        /// The value.
        value: f32,
    },
    /// A malformed stream: missing header, misplaced chunk, bad field.
    #[error("{0}")]
    BadChunk(String),
    /// A version beyond the last step of the run.
    #[error("version {asked} will never exist: the run ends at version {last}")]
    VersionOutOfRange {
        /// Asked for.
        asked: u64,
        /// Last version of the run.
        last: u64,
    },
    /// A bounded wait ran out.
    #[error("{0}")]
    Timeout(String),
    /// The shard is stopping or not yet serving: a retry may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// A request would take a shard's memory budget past its limit (partial gRPC messages:
    /// `ps-server`'s `partial`): a retry may succeed once others end.
    #[error("{0}")]
    OverBudget(String),
    /// The run failed (a worker stopped on an error, a barrier timed out, a gradient went bad):
    /// every later request is refused with the reason, and no retry can succeed.
    #[error("the run failed: {0}")]
    RunFailed(String),
    /// A bug or an I/O failure on the server side.
    #[error("internal error: {0}")]
    Internal(String),
    /// An exact pull of a version the shard no longer holds.
    #[error(
        "version {asked} is gone: shard {shard} is at version {current} and holds only it and the one before"
    )]
    VersionGone {
        /// The version asked for.
        asked: u64,
        /// The shard.
        shard: usize,
        /// Its current version.
        current: u64,
    },
    /// The request lacks the cluster's shared token, or carries another.
    #[error("unauthenticated {0}")]
    Unauthenticated(String),
    /// A request without a lease (a process that never registered with this shard).
    #[error(
        "{what} presents no lease: register this rank with the shard first (Register grants the rank's lease, which every push, pull and data connection presents)"
    )]
    NoLease {
        /// The request, in words.
        what: String,
    },
    /// A request whose lease is not the one the rank holds on this shard.
    #[error(
        "{what}: its lease is not rank {rank}'s lease on this shard (the rank registered again since, from this or another process, or the lease is forged): only the rank's latest registration may act for it"
    )]
    LeaseRefused {
        /// The rank the request acts for.
        rank: u32,
        /// The request, in words.
        what: String,
    },
    /// A request of an older cluster generation: the cluster rolled back since.
    #[error(
        "rolled back: {what} is of cluster generation {theirs}, shard {shard} is at generation {ours} (a shard was lost and the cluster rolled back since): register again and redo the steps from the version it rolled back to"
    )]
    RolledBack {
        /// The shard.
        shard: usize,
        /// The request, in words.
        what: String,
        /// The request's generation.
        theirs: u64,
        /// The shard's.
        ours: u64,
    },
    /// The request comes from a process of another run (`ps_config::runid`).
    #[error(
        "shard {shard} belongs to {ours}, but this request comes from {theirs}: a process of another run cannot join (two jobs on the same ports or folders? give each job its own ports and run id)"
    )]
    RunMismatch {
        /// The shard.
        shard: usize,
        /// The shard's run, in words (`run 7`).
        ours: String,
        /// The requester's run, in words.
        theirs: String,
    },
}

#[cfg(feature = "grpc")]
impl PsError {
    /// The gRPC status code of this error: the single table of the project.
    pub fn code(&self) -> Code {
        match self {
            PsError::ProtocolMismatch { .. }
            | PsError::RunMismatch { .. }
            | PsError::ClusterMismatch(_)
            | PsError::NotRegistered(_) => Code::FailedPrecondition,
            PsError::StaleStep { .. } | PsError::FutureStep { .. } => Code::FailedPrecondition,
            PsError::UnknownRank { .. }
            | PsError::WrongLength { .. }
            | PsError::NonFinite { .. }
            | PsError::BadChunk(_) => Code::InvalidArgument,
            PsError::Conflict { .. } | PsError::RankTaken { .. } => Code::AlreadyExists,
            PsError::VersionOutOfRange { .. }
            | PsError::VersionGone { .. }
            | PsError::StepOutOfRange { .. } => Code::OutOfRange,
            PsError::Timeout(_) => Code::DeadlineExceeded,
            PsError::Unavailable(_) => Code::Unavailable,
            PsError::OverBudget(_) => Code::ResourceExhausted,
            PsError::RunFailed(_) => Code::FailedPrecondition,
            PsError::Internal(_) => Code::Internal,
            PsError::Unauthenticated(_) => Code::Unauthenticated,
            PsError::NoLease { .. } => Code::FailedPrecondition,
            PsError::LeaseRefused { .. } => Code::PermissionDenied,
            PsError::RolledBack { .. } => Code::Aborted,
        }
    }
}

#[cfg(feature = "grpc")]
impl From<PsError> for Status {
    fn from(e: PsError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}
