//! The errors of a call to a shard ([`ClientError`]), which of them are worth retrying, and
//! how a refusal's status names a transport failure.

use tonic::{Code, Status};

/// Why a call to a shard did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No connection could be made before the deadline.
    #[error("cannot reach shard at {addr} after {waited_secs:.0} s: {reason}")]
    Unreachable {
        /// The shard's address.
        addr: String,
        /// How long the client kept trying.
        waited_secs: f64,
        /// The last connection error.
        reason: String,
    },
    /// The address (or the TLS set-up for it) is unusable: trying again cannot help.
    #[error("{0}")]
    BadAddress(#[from] crate::auth::EndpointError),
    /// The shard (or the transport) answered a call with an error status.
    #[error("{what}: {}", status.message())]
    Refused {
        /// The shard's index.
        shard: usize,
        /// The failed call, with the shard: "shard 0 refused registration", "pull of version 3
        /// from shard 0 failed", ...
        what: String,
        /// The status, with the code mapped from the server's `PsError`.
        status: Status,
    },
    /// The request could not be completed on this side: the pieces of a progressive push
    /// stopped before they covered its range (the gradient's computation failed).
    #[error("{0}")]
    Incomplete(String),
    /// The shard did not answer a call within the client's deadline ([`call_deadline`]): a
    /// shard that is stopped, frozen or cut off. Not retried: a live shard answers sooner.
    #[error(
        "shard {shard} at {addr} did not answer {what} within {waited_secs:.0} s (the worker's deadline: the longest a live shard holds a call, max([server] pull_timeout_secs, 2 x barrier_timeout_secs), + [worker] deadline_margin_secs = {margin_secs} s)"
    )]
    NoAnswer {
        /// The shard's index.
        shard: usize,
        /// Its address.
        addr: String,
        /// The call ("the pull of version 3").
        what: String,
        /// The deadline, s.
        waited_secs: f64,
        /// The margin in it, s (`[worker] deadline_margin_secs`).
        margin_secs: f64,
    },
    /// A progressive push's deadline ([`call_deadline`]) passed while the backward pass that
    /// feeds it had not handed over the whole range: the worker's computation stalled, not
    /// (necessarily) the shard. Not retried.
    #[error(
        "the push of step {step} to shard {shard}: the backward pass feeding it handed over {got} of {total} bytes within {waited_secs:.0} s (none for the last {idle_secs:.0} s; the worker's deadline: max([server] pull_timeout_secs, 2 x barrier_timeout_secs) + [worker] deadline_margin_secs = {margin_secs} s)"
    )]
    FeedStalled {
        /// The shard's index.
        shard: usize,
        /// The step pushed.
        step: u64,
        /// Bytes of the range handed over.
        got: usize,
        /// Bytes of the range.
        total: usize,
        /// The deadline, s.
        waited_secs: f64,
        /// Time since the last piece, s.
        idle_secs: f64,
        /// The margin in the deadline, s (`[worker] deadline_margin_secs`).
        margin_secs: f64,
    },
    /// The shard answered, but not as the contract says (or not what this client expects).
    #[error("shard {shard}: {message}")]
    BadReply {
        /// The shard's index.
        shard: usize,
        /// What was wrong.
        message: String,
    },
}

pub(super) fn refused(shard: usize, what: String) -> impl FnOnce(Status) -> ClientError {
    move |status| ClientError::Refused {
        shard,
        what,
        status: name_transport_failure(status),
    }
}

/// A transport failure (a status the shard did not send: the connection failed under the call)
/// with its kind in words (`crate::neterr::kind`) before tonic's "transport error"; the code is
/// kept, so retrying decides as before.
fn name_transport_failure(status: Status) -> Status {
    if !is_retryable_code(status.code()) {
        return status;
    }
    let text = crate::neterr::chain(&status);
    match crate::neterr::kind(&text) {
        Some(k) if !status.message().starts_with(k) => {
            Status::new(status.code(), format!("{k} ({})", status.message()))
        }
        _ => status,
    }
}

/// Whether a call that failed with `code` may succeed if made again unchanged: the shard
/// stopping or not yet serving (`Unavailable`, see `PsError::Unavailable`), its memory budget
/// full for now (`ResourceExhausted`, `PsError::OverBudget`) and transport failures that tonic
/// reports as `Unknown` or `Cancelled` (a connection reset mid-stream). Every other code is a
/// refusal of the request itself (`PsError::code`), the same each time.
pub fn is_retryable_code(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::ResourceExhausted | Code::Unknown | Code::Cancelled
    )
}

impl ClientError {
    /// The status code of a refusal (None for the other errors).
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Refused { status, .. } => Some(status.code()),
            _ => None,
        }
    }

    /// Whether the same call may succeed later: an unreachable shard, or a refusal with a
    /// retryable code ([`is_retryable_code`]); never a bad address or a malformed reply.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Unreachable { .. } => true,
            ClientError::Refused { status, .. } => is_retryable_code(status.code()),
            ClientError::BadAddress(_)
            | ClientError::NoAnswer { .. }
            | ClientError::FeedStalled { .. }
            | ClientError::BadReply { .. }
            | ClientError::Incomplete(_) => false,
        }
    }
}
