//! Shared-memory receipt: a push whose gradient is already in the rank's board.

use super::*;

impl ShardService {
    /// A push whose gradient is in the rank's shared-memory board: read there in place, on a
    /// blocking thread (never on the async runtime's threads), bucket by bucket where the
    /// shard applies per bucket ([`crate::shard::Shard::board_push`]). The gradient, its
    /// fingerprint and the bucket intake, kept until the barrier counted or refused the push.
    pub(super) async fn receive_shm(
        &self,
        rank: u32,
        step: u64,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
    ) -> PsResult<(Grad, u64, Option<Intake>)> {
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
        let shard = self.shard.clone();
        tokio::task::spawn_blocking(move || shard.board_push(rank, step))
            .await
            .map_err(|e| PsError::Internal(format!("shared-memory check task failed: {e}")))?
    }
}
