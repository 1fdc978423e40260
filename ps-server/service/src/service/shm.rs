//! Shared-memory receipt: a push whose gradient is already in the rank's board.

use super::*;

impl ShardService {
    /// A push whose gradient is in the rank's shared-memory board: checked there in place, on
    /// a blocking thread (a whole-range read: never on the async runtime's threads).
    pub(super) async fn receive_shm(
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
        let shard = self.shard.clone();
        tokio::task::spawn_blocking(move || shard.shm_grad(rank))
            .await
            .map_err(|e| PsError::Internal(format!("shared-memory check task failed: {e}")))?
    }
}
