//! Checkpoints at step boundaries: those due every `[checkpoint] every` steps, and the
//! preemption's (SIGTERM, SIGUSR1), written once per version until the shard says where it
//! stopped.

use crate::Shard;
use crate::checkpoint::{self, CheckpointError, Saved};
use bytes::Bytes;
use ps_optim::OptState;
use tokio::sync::watch;

impl Shard {
    /// Writes a checkpoint of the current version if one is due (every `[checkpoint] every`
    /// steps); None when none was due, or when a preemption wrote the step boundary instead
    /// ([`Shard::request_preempt`]). Call it right after [`Shard::apply`], before the
    /// barrier-completing push is answered: the next update cannot start before that push's
    /// worker pushes again, so the state copied here is the version's. A failed write is
    /// retried once; after `[checkpoint] max_failures` consecutive failed checkpoints the run
    /// fails (refused from now on, and the shard exits non-zero), saying why.
    pub fn checkpoint_if_due(&self) -> Option<checkpoint::Attempted> {
        if self.preempt.load(std::sync::atomic::Ordering::SeqCst) {
            // the step boundary a preemption waits for: the same state as below
            let version = self.version();
            let (opt, buffers) = {
                let st = self.lock();
                ((*st.opt).clone(), st.buffers.clone())
            };
            self.write_preempt(version, opt, buffers);
            return None;
        }
        let plan = self.checkpoint.as_ref()?;
        let version = self.version();
        if !plan.due(version) {
            return None;
        }
        let (opt, buffers) = {
            let st = self.lock();
            ((*st.opt).clone(), st.buffers.clone())
        };
        let saved = self
            .params()
            .map(|(version, params)| Saved {
                version,
                params,
                opt,
                buffers,
            })
            .map_err(CheckpointError::from);
        let attempted = plan.write_retrying(version, saved);
        if let Some(why) = &attempted.fatal {
            self.fail(why.clone());
        }
        Some(attempted)
    }

    /// Preemption (SIGTERM, Slurm's `--signal=USR1`): from now on every step boundary writes a
    /// checkpoint; the version the shard is at is written at once, unless an update is running
    /// (its end is the boundary, written by [`Shard::checkpoint_if_due`]). Returns the version
    /// the shard was at. Shards of one run are at most one version apart (a worker pulls
    /// version t from every shard before pushing step t), so each writing the version it is at
    /// and the next gives every shard the newer of the two, which a resume then agrees on.
    pub fn request_preempt(&self) -> u64 {
        self.preempt
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let (version, opt) = {
            let st = self.lock();
            (
                st.barrier.step(),
                (!st.barrier.applying()).then(|| ((*st.opt).clone(), st.buffers.clone())),
            )
        };
        if let Some((opt, buffers)) = opt {
            self.write_preempt(version, opt, buffers);
        }
        version
    }

    /// The preemption checkpoints written: the newest version (None before the first).
    pub fn preempt_saved(&self) -> watch::Receiver<Option<u64>> {
        self.preempt_saved.subscribe()
    }

    /// Ends the preemption's checkpoints and returns the newest written: one being written now
    /// is waited for, none is written after (an update still in flight would otherwise add the
    /// next version after the shard said where it stopped).
    pub fn close_preempt(&self) -> Option<u64> {
        let mut closed = self
            .preempt_closed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *closed = true;
        *self.preempt_saved.borrow()
    }

    /// Writes the preemption checkpoint of `version` with optimizer state `opt` (taken at that
    /// version), once per version; the parameters are read as of `version` (the double buffer
    /// keeps it while the next update writes the other half).
    fn write_preempt(&self, version: u64, opt: OptState, buffers: Option<Bytes>) {
        let closed = self
            .preempt_closed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *closed {
            return;
        }
        // the boundary after an update can be written before the version the preemption
        // found (both race for the disk): an older one adds nothing then
        if self.preempt_saved.borrow().is_some_and(|v| v >= version) {
            return;
        }
        let params = self.lock().store.source();
        let saved = params
            .read(version)
            .map(|params| Saved {
                version,
                params,
                opt,
                buffers,
            })
            .ok_or(CheckpointError::LeftBuffer { version });
        if self.preempt_plan.write_checked(version, saved) {
            self.preempt_saved.send_if_modified(|newest| {
                let newer = newest.is_none_or(|v| v < version);
                if newer {
                    *newest = Some(version);
                }
                newer
            });
        }
    }
}
