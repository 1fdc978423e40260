//! The model's buffers (shard 0 of a declared model with buffers): rank 0 puts them after the
//! forward pass of step t ([`Shard::put_buffers`]), they become the buffers of version t + 1
//! when the step is applied ([`Shard::buffers`]), and are checkpointed with it.

use crate::Shard;
use bytes::Bytes;
use ps_proto::{PsError, PsResult};

impl Shard {
    /// Rank 0's buffers after the forward pass of `step` (a safetensors serialization of the
    /// model's buffers, checked against the declared ones): they become the buffers of
    /// version `step + 1` when the step is applied. Only rank 0 puts buffers (its are the
    /// model's, as DDP's broadcast_buffers); a put for a step already applied changes nothing
    /// (a retry); one for a step the shard has not reached, from another rank, or on a shard
    /// that holds no buffers is refused, changing nothing.
    pub fn put_buffers(&self, rank: u32, step: u64, data: Bytes) -> PsResult<()> {
        let Some(model) = &self.buffer_model else {
            return Err(PsError::BadChunk(format!(
                "shard {}: holds no buffers (the run's model declares none, or they are on shard 0)",
                self.index
            )));
        };
        if rank != 0 {
            return Err(PsError::BadChunk(format!(
                "rank {rank} put buffers: only rank 0's buffers are the model's"
            )));
        }
        model
            .check_buffers(&data)
            .map_err(|e| PsError::BadChunk(e.to_string()))?;
        let mut st = self.lock();
        st.barrier.rank(rank)?;
        if let Some(why) = &st.failed {
            return Err(PsError::Unavailable(why.clone()));
        }
        if !st.barrier.registered(rank) {
            return Err(PsError::NotRegistered(rank));
        }
        let at = st.barrier.step();
        if step > at {
            return Err(PsError::BadChunk(format!(
                "rank {rank} put buffers of step {step}: the shard is at step {at}"
            )));
        }
        if step == at && !st.barrier.applying() {
            st.next_buffers = Some((step, data));
        }
        Ok(())
    }

    /// The buffers of the current version when it is `version` (None: not reached yet); a
    /// version already left behind is [`PsError::VersionGone`].
    pub fn buffers(&self, version: u64) -> PsResult<Option<(u64, Bytes)>> {
        if self.buffer_model.is_none() {
            return Err(PsError::BadChunk(format!(
                "shard {}: holds no buffers (the run's model declares none, or they are on shard 0)",
                self.index
            )));
        }
        let st = self.lock();
        if let Some(why) = &st.failed {
            return Err(PsError::Unavailable(why.clone()));
        }
        let at = st.barrier.step();
        if version > at {
            return Ok(None);
        }
        if version < at {
            return Err(PsError::VersionGone {
                asked: version,
                shard: self.index,
                current: at,
            });
        }
        Ok(st.buffers.clone().map(|b| (at, b)))
    }

    /// The buffers of the current version (the final ones at the run's end), if the shard
    /// holds any.
    pub fn current_buffers(&self) -> Option<Bytes> {
        self.lock().buffers.clone()
    }
}
