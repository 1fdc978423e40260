//! What pulls read: the current version's parameters (a snapshot shared by the version's
//! gRPC pulls), the previous version, the optimizer state. Each copy of the weights into a
//! reply is counted (`ps_net::copied`, [`Side::Pull`]).

use crate::Shard;
use crate::store::{self, Previous, Source};
use bytes::Bytes;
use ps_net::copied::{self, Side};
use ps_optim::OptState;
use ps_proto::{PsError, PsResult};
use std::sync::Arc;

impl Shard {
    /// The current parameters as bytes for gRPC pulls, and their version: shared by every
    /// pull of the version (with a board, copied out of it at the version's first gRPC pull).
    pub fn snapshot(&self) -> PsResult<(u64, Bytes)> {
        let reuse = {
            let mut st = self.lock();
            if let Some(why) = &st.failed {
                return Err(PsError::RunFailed(why.clone()));
            }
            if let Some(snap) = st.store.snapshot(st.barrier.step()) {
                return Ok((st.barrier.step(), snap));
            }
            st.store.take_snapshot_buffer()
        };
        let (version, values) = self.params_into(reuse.unwrap_or_default())?;
        // the weights copied into the version's reply (shared by its pulls)
        copied::count(Side::Pull, 4 * values.len());
        let values = Arc::new(values);
        let mut st = self.lock();
        if st.barrier.step() == version {
            return Ok((version, st.store.keep_snapshot(version, values)));
        }
        Ok((version, store::shared_bytes(values)))
    }

    /// The parameters of `version` when it is the one before the current version and this
    /// shard still holds it (the other half of its double buffer), for a restarted worker that
    /// redoes that step; [`PsError::VersionGone`] otherwise.
    pub fn previous(&self, version: u64) -> PsResult<(u64, Bytes)> {
        let gone = |current| PsError::VersionGone {
            asked: version,
            shard: self.index,
            current,
        };
        let st = self.lock();
        if version + 1 != st.barrier.step() || st.barrier.applying() {
            return Err(gone(st.barrier.step()));
        }
        match st.store.previous(self.len()) {
            Some(Previous::Bytes(b)) => Ok((version, b)),
            None => Err(gone(st.barrier.step())),
            Some(Previous::Board(b)) => {
                drop(st);
                match Source::Board(b).read(version) {
                    Some(values) => {
                        // the weights copied out of the board into the reply
                        copied::count(Side::Pull, 4 * values.len());
                        Ok((version, store::shared_bytes(Arc::new(values))))
                    }
                    None => Err(gone(self.version())),
                }
            }
        }
    }

    /// The parameters of exactly `version`: the current one, or the one before while this
    /// shard still holds it ([`Shard::previous`]); an update that ends between the two looks
    /// is seen, since the current version it made is checked.
    pub fn exactly(&self, version: u64) -> PsResult<(u64, Bytes)> {
        if version < self.version() {
            return self.previous(version);
        }
        match self.snapshot()? {
            (v, snapshot) if v == version => Ok((v, snapshot)),
            _ => self.previous(version),
        }
    }

    /// A copy of the optimizer state of the current version (what a checkpoint saves).
    pub fn optimizer_state(&self) -> OptState {
        (*self.lock().opt).clone()
    }

    /// A copy of the current parameters and their version (final weights, gRPC pulls).
    pub fn params(&self) -> PsResult<(u64, Vec<f32>)> {
        self.params_into(Vec::new())
    }

    /// [`Shard::params`] copied into `values` (its allocation reused when it has the length).
    fn params_into(&self, mut values: Vec<f32>) -> PsResult<(u64, Vec<f32>)> {
        for _ in 0..100 {
            let (version, source) = {
                let st = self.lock();
                (st.barrier.step(), st.store.source())
            };
            // fails only if two updates completed during the copy: then copy the newer one
            if source.read_into(version, &mut values) {
                return Ok((version, values));
            }
        }
        Err(PsError::Unavailable(
            "the parameters kept changing while being copied".into(),
        ))
    }
}
