//! The wait for the workers' leaves after the last step (`[server] linger_secs`).
//!
//! A rank is waited for `linger_secs` after its last word, not after the last step: a worker
//! whose final evaluation is slow (a large model on a loaded CPU) says so before it pulls the
//! final weights and again every quarter of `linger_secs` while it evaluates (a `LeaveRequest` with
//! `evaluating` set), so the shard neither closes the run with its accuracy half counted nor
//! leaves the worker's leave unanswered. A rank that says nothing (it died after the last
//! step) is waited for `linger_secs` from the run's end, as before.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The ranks' leaves and last words, for the shard's closing wait.
#[derive(Debug, Default)]
pub struct Leaving {
    /// Notified when every rank has left, or a rank said it is still evaluating.
    changed: Notify,
    /// When each rank last said it is evaluating the final weights.
    words: Mutex<HashMap<usize, Instant>>,
}

impl Leaving {
    /// Every rank has left after the last step.
    pub fn all_left(&self) {
        self.changed.notify_one();
    }

    /// `rank` says it is alive and evaluating the final weights; true the first time.
    pub fn evaluating(&self, rank: usize) -> bool {
        let first = self
            .words
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(rank, Instant::now())
            .is_none();
        self.changed.notify_one();
        first
    }

    /// When the wait for `missing` ends: `linger` after the later of `end` (the run's end) and
    /// each missing rank's last word, the latest over the ranks.
    pub fn deadline(&self, missing: &[usize], end: Instant, linger: Duration) -> Instant {
        let words = self
            .words
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        missing
            .iter()
            .map(|r| words.get(r).map_or(end, |&w| w.max(end)))
            .max()
            .unwrap_or(end)
            + linger
    }

    /// Waits until `missing()` is empty (Ok), or each rank it names has said nothing for
    /// `linger` since the later of the call and its last word (Err: those ranks).
    pub async fn wait(
        &self,
        linger: Duration,
        missing: impl Fn() -> Vec<usize>,
    ) -> Result<(), Vec<usize>> {
        let end = Instant::now();
        loop {
            let left = missing();
            if left.is_empty() {
                return Ok(());
            }
            let until = self.deadline(&left, end, linger);
            if Instant::now() >= until {
                return Err(left);
            }
            let _ = tokio::time::timeout_at(until, self.changed.notified()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test]
    async fn a_silent_rank_is_waited_for_linger_from_the_end() {
        let l = Leaving::default();
        let t0 = Instant::now();
        let linger = Duration::from_millis(200);
        assert_eq!(l.wait(linger, || vec![1]).await, Err(vec![1]));
        assert!(t0.elapsed() >= linger, "{:?}", t0.elapsed());
    }

    #[tokio::test]
    async fn each_word_of_an_evaluating_rank_extends_its_wait_until_it_leaves() {
        let l = Arc::new(Leaving::default());
        let gone = Arc::new(AtomicBool::new(false));
        let (l2, g2) = (l.clone(), gone.clone());
        // linger 1 s; twenty words 100 ms apart (2 s of evaluation), then the leave
        let linger = Duration::from_secs(1);
        let speaker = tokio::spawn(async move {
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                l2.evaluating(0);
            }
            g2.store(true, Ordering::SeqCst);
            l2.all_left();
        });
        let t0 = Instant::now();
        let g = gone.clone();
        let missing = move || {
            if g.load(Ordering::SeqCst) {
                vec![]
            } else {
                vec![0]
            }
        };
        assert_eq!(l.wait(linger, missing).await, Ok(()));
        assert!(t0.elapsed() >= Duration::from_secs(2), "{:?}", t0.elapsed());
        speaker.await.unwrap();
        // a rank that falls silent is given up linger after its last word, not before
        let t1 = Instant::now();
        assert!(l.evaluating(1));
        assert_eq!(l.wait(linger, || vec![1]).await, Err(vec![1]));
        assert!(t1.elapsed() >= linger, "{:?}", t1.elapsed());
    }

    #[test]
    fn the_first_word_of_a_rank_is_told_apart() {
        let l = Leaving::default();
        assert!(l.evaluating(2));
        assert!(!l.evaluating(2));
        assert!(l.evaluating(0));
    }
}
