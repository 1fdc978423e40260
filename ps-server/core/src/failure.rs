//! A failed run: its reason, refusing every later request with it, and knowing which ranks
//! have been told (the shard waits for them before it exits).

use crate::{Shard, State};
use ps_proto::{PsError, PsResult};
use std::time::Duration;

impl Shard {
    /// Marks the run failed: pulls and pushes are refused from now on.
    pub fn fail(&self, why: String) {
        self.lock().failed = Some(why);
        self.wake();
        // wake pulls (and the run's watcher) so they see the failure
        self.version_tx.send_modify(|_| {});
    }

    /// Why the run failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    /// [`PsError::RunFailed`] once the run failed, noting that `rank` (when it is one) has
    /// now been told; changes nothing otherwise.
    pub fn refuse_failed(&self, rank: u32) -> PsResult<()> {
        let mut st = self.lock();
        match st.barrier.rank(rank) {
            Ok(r) => self.refuse_if_failed(&mut st, r),
            Err(_) => st
                .failed
                .clone()
                .map_or(Ok(()), |why| Err(PsError::RunFailed(why))),
        }
    }

    /// Notes that `rank` learned of the run's failure (it said it stopped, or was refused).
    pub fn told(&self, rank: u32) {
        let mut st = self.lock();
        if let Ok(r) = st.barrier.rank(rank) {
            st.told[r] = true;
            drop(st);
            self.told_changed.notify_waiters();
        }
    }

    pub(crate) fn refuse_if_failed(&self, st: &mut State, r: usize) -> PsResult<()> {
        let Some(why) = &st.failed else { return Ok(()) };
        let e = PsError::RunFailed(why.clone());
        if !std::mem::replace(&mut st.told[r], true) {
            self.told_changed.notify_waiters();
        }
        Err(e)
    }

    /// Waits until every rank has learned of the run's failure (a request of its refused with
    /// the reason, or it left), at most `bound`. The ranks that did not, in order.
    pub async fn wait_all_told(&self, bound: Duration) -> Vec<usize> {
        let untold = |st: &State| -> Vec<usize> {
            (0..self.world)
                .filter(|&r| !st.told[r] && st.left[r].is_none())
                .collect()
        };
        let all = async {
            loop {
                let changed = self.told_changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if untold(&self.lock()).is_empty() {
                    return;
                }
                changed.await;
            }
        };
        let _ = tokio::time::timeout(bound, all).await;
        untold(&self.lock())
    }
}
