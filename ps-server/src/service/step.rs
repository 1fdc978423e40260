//! The step driver: folding the gradients that are in, and completing a step whose barrier
//! is complete (apply, report, metrics, checkpoint).

use super::*;

impl ShardService {
    /// Applies a step whose barrier is complete (or given up on), on a blocking thread, then
    /// reports it, updates the metrics and writes a checkpoint when one is due. It runs to the
    /// end even if the caller that triggered it goes away. An update that finds a non-finite
    /// gradient value fails the run ([`Shard::apply`]).
    pub async fn complete_step(&self, slots: Vec<Slot>) -> PsResult<()> {
        let (shard, reporter) = (self.shard.clone(), self.reporter.clone());
        let metrics = self.metrics.clone();
        tokio::task::spawn_blocking(move || {
            let figures = shard.apply(slots)?;
            metrics.step(&figures);
            reporter.step_done(figures);
            if let Some(attempted) = shard.checkpoint_if_due() {
                metrics.checkpoint(&attempted);
                if let Some(why) = attempted.fatal {
                    return Err(PsError::RunFailed(why));
                }
            }
            Ok(())
        })
        .await
        .map_err(|e| PsError::Internal(format!("apply task failed: {e}")))?
    }

    /// Folds the step's gradients that are in, in rank order, on a blocking thread.
    pub(super) async fn fold(&self) -> PsResult<()> {
        let shard = self.shard.clone();
        tokio::task::spawn_blocking(move || shard.fold_ready())
            .await
            .map_err(|e| PsError::Internal(format!("fold task failed: {e}")))?
    }
}
