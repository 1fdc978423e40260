//! The step driver: folding the gradients that are in, and completing a step whose barrier
//! is complete (apply, report, metrics, checkpoint).

use super::*;
use crate::checkpoint;
use crate::shard::{StepFigures, StepObserver};

impl ShardService {
    /// Completes a step whose barrier is complete (or given up on) on a blocking thread
    /// ([`Shard::complete`]: apply, then the report and metrics, then a checkpoint when one is
    /// due). It runs to the end even if the caller that triggered it goes away.
    pub async fn complete_step(&self, slots: Vec<Slot>) -> PsResult<()> {
        let shard = self.shard.clone();
        let observer = Observer {
            reporter: self.reporter.clone(),
            metrics: self.metrics.clone(),
        };
        let watched = self.shard.clone();
        match tokio::task::spawn_blocking(move || shard.complete(slots, &observer)).await {
            Ok(done) => done,
            // a bug, never an input: the step cannot complete, so the run fails (the shard
            // then stops like any failed run) rather than wait on a barrier that never ends
            Err(e) => {
                let why = format!(
                    "step {}: the update stopped unexpectedly ({e}); the run stops",
                    watched.version()
                );
                tracing::error!("shard {}: {why}", watched.index);
                watched.fail(why.clone());
                Err(PsError::RunFailed(why))
            }
        }
    }

    /// Folds the step's gradients that are in, in rank order, on a blocking thread.
    pub(super) async fn fold(&self) -> PsResult<()> {
        let shard = self.shard.clone();
        tokio::task::spawn_blocking(move || shard.fold_ready())
            .await
            .map_err(|e| PsError::Internal(format!("fold task failed: {e}")))?
    }
}

/// The process's side of a completed step: the report to shard 0 (and its log line) and the
/// metrics.
struct Observer {
    reporter: Reporter,
    metrics: Arc<Metrics>,
}

impl StepObserver for Observer {
    fn step_done(&self, figures: StepFigures) {
        self.metrics.step(&figures);
        self.reporter.step_done(figures);
    }

    fn checkpointed(&self, attempted: &checkpoint::Attempted) {
        self.metrics.checkpoint(attempted);
    }
}
