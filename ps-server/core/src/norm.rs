//! Why the global gradient norm of a step could not be had (`[optimizer] clip_norm` over
//! several shards, [`crate::NormExchange`]). Every kind ends the step with
//! [`ps_proto::PsError::RunFailed`] naming it (the step is not applied); a rollback ordered
//! meanwhile turns that failure into the rollback ([`NormError::RunFailed`]).

/// One failure of the norm exchange of `step`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NormError {
    /// Shard 0 refused the request (a credential it does not accept, a request it finds
    /// wrong, a step it is not at): retrying would not change its answer.
    #[error("shard 0 refused the gradient norms of step {step}: {why}")]
    Refused {
        /// The step.
        step: u64,
        /// Shard 0's answer.
        why: String,
    },
    /// The norms did not arrive within the bound.
    #[error(
        "step {step}: no total gradient norm {at} within {secs:.0} s (twice [server] barrier_timeout_secs + 30 s){last}"
    )]
    TimedOut {
        /// The step.
        step: u64,
        /// Where it was waited for ("at shard 0", "from shard 0 at ADDR").
        at: String,
        /// The bound, s.
        secs: f64,
        /// The last reason a try failed (", last: ..."), or empty.
        last: String,
    },
    /// The shard's run failed while it waited (a worker that stopped, a rollback order).
    #[error("step {step}: the run failed meanwhile: {why}")]
    RunFailed {
        /// The step.
        step: u64,
        /// Why.
        why: String,
    },
    /// Shard 0 completed a later step's norms: this step was settled without this shard.
    #[error("step {step}: shard 0 has moved on to step {at} (a step settled without this one)")]
    Superseded {
        /// The step.
        step: u64,
        /// Shard 0's newest complete step.
        at: u64,
    },
    /// Shard 0's answer was about another step.
    #[error("shard 0 answered the gradient norms of step {step} with step {got}'s")]
    OtherStep {
        /// The step asked.
        step: u64,
        /// The step answered.
        got: u64,
    },
    /// A shard of several, with clipping, has no exchange set.
    #[error(
        "shard {shard} of {shards} has no way to exchange gradient norms with the other shards"
    )]
    NoExchange {
        /// The shard.
        shard: usize,
        /// The number of shards.
        shards: usize,
    },
}
