//! How a run ends: watching the barrier's verdicts until the last step or a failure
//! ([`watch_run`]), preemption ([`preempted`]), the final weights and the run's close, and what
//! the shard does once it has ended, before it stops serving ([`conclude`]).

use crate::report::{self, Reporter};
use crate::service::{self, ShardService};
use crate::shard::Shard;
use crate::shard::barrier::Verdict;
use crate::{Outcome, PREEMPT_GRACE};
use ps_config::Config;
use std::time::{Duration, Instant};

/// What the shard does once its run has ended with `outcome`, before it stops serving: the
/// reporter's pending lines out (rollback, preemption), the failure recorded for the requests
/// still to come (and, when a worker stopped, each rank told); returns how long the server may
/// take to stop.
pub(crate) async fn conclude(
    cfg: &Config,
    index: usize,
    shard: &Shard,
    reporter: &Reporter,
    outcome: &Outcome,
) -> Duration {
    let mut stop_wait = Duration::from_secs(5);
    match outcome {
        Outcome::RolledBack { .. } => {
            // the step lines of the state left behind are out before the next state trims them
            reporter.flush().await;
            stop_wait = Duration::from_secs(1);
        }
        Outcome::Finished => {}
        Outcome::Failed(why) => {
            tracing::error!("shard {index}: run failed: {why}");
            shard.fail(why.clone());
            if why.contains(service::WORKER_STOPPED) {
                // the other workers learn the reason from their next request (refused with
                // it) rather than from a connection that is gone: the shard stays up until
                // each rank was refused with it or left
                let bound = Duration::from_secs_f64(cfg.server.linger_secs);
                tracing::info!(
                    "shard {index}: refusing the other workers' requests with the reason until each has been told (at most {:.1} s, [server] linger_secs)",
                    bound.as_secs_f64()
                );
                let untold = shard.wait_all_told(bound).await;
                if !untold.is_empty() {
                    tracing::warn!(
                        "shard {index}: ranks {untold:?} made no request within {:.1} s of the failure ([server] linger_secs): they will find the shard gone",
                        bound.as_secs_f64()
                    );
                }
            }
        }
        Outcome::Preempted { saved } => {
            // the step lines of every version applied are out (shard 0 waits for the others'
            // reports otherwise): a resume trims metrics.jsonl to its version and goes on
            // after it, so a line still waiting here would be lost
            reporter.flush().await;
            let why = match saved {
                Some(v) => format!(
                    "shard {index} was preempted: checkpoint of version {v} written; start the cluster again with --resume"
                ),
                None => format!("shard {index} was preempted without a checkpoint"),
            };
            tracing::warn!("{why}");
            shard.fail(why);
        }
        Outcome::Interrupted => {
            tracing::warn!(
                "shard {index}: interrupted at version {}; stopping",
                shard.version()
            );
            shard.fail("the shard was interrupted".into());
        }
    }
    stop_wait
}

/// Preemption: checkpoints at the version the shard is at and at the next step boundary
/// (bounded by [`PREEMPT_GRACE`]); a run already at its end finishes as usual instead.
pub(crate) async fn preempted(cfg: &Config, svc: &ShardService) -> Outcome {
    let shard = &svc.shard;
    if shard.version() >= shard.total_steps {
        return watch_run(cfg, svc).await;
    }
    let at = shard.request_preempt();
    tracing::warn!(
        "shard {}: preempted (SIGTERM or SIGUSR1) at version {at}: writing a checkpoint at the next step boundary, then stopping",
        shard.index
    );
    let mut saved = shard.preempt_saved();
    let next = at + 1;
    let _ = tokio::time::timeout(
        PREEMPT_GRACE,
        saved.wait_for(|v| v.is_some_and(|v| v >= next)),
    )
    .await;
    // what the shard says it stopped at stays its newest checkpoint
    let v = shard.close_preempt();
    if v.is_none_or(|v| v < next) {
        tracing::warn!(
            "shard {}: version {next} not reached within {} s of the preemption (the workers stopped)",
            shard.index,
            PREEMPT_GRACE.as_secs()
        );
    }
    Outcome::Preempted { saved: v }
}

/// Waits for the end of the run while acting on the barrier's verdicts (log the missing
/// ranks, fail the run, or go on without them), then writes the final weights and waits
/// (bounded) for the workers to leave. A run the shard failed (an update refused) ends here too.
pub(crate) async fn watch_run(cfg: &Config, svc: &ShardService) -> Outcome {
    match watch_barrier(cfg, svc).await {
        Outcome::Finished => {}
        ended => return ended,
    }
    match write_final(cfg, &svc.shard) {
        Outcome::Finished => {}
        failed => return failed,
    }
    close_run(cfg, svc).await;
    Outcome::Finished
}

/// Acts on the barrier's verdicts until the last step is applied (`Finished`), or the run
/// fails (a barrier past `barrier_timeout_secs`, a failed update).
pub(crate) async fn watch_barrier(cfg: &Config, svc: &ShardService) -> Outcome {
    let shard = &svc.shard;
    let mut versions = shard.subscribe();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while shard.version() < shard.total_steps {
        if let Some(why) = shard.failure() {
            return Outcome::Failed(why);
        }
        tokio::select! {
            _ = versions.changed() => {}
            _ = tick.tick() => match shard.poll_barrier(Instant::now()) {
                Verdict::Idle | Verdict::Waiting { warn: false, .. } | Verdict::Unjoined { warn: false, .. } => {}
                Verdict::Unjoined { step, waited, bound, .. } => tracing::info!(
                    "shard {} step {step}: waiting {:.1} s for the workers to register (0 of {} ranks registered); the barrier clock starts at the first, and the run fails if none has registered after {:.1} s ([worker] connect_timeout_secs + [server] barrier_timeout_secs)",
                    shard.index,
                    waited.as_secs_f64(),
                    shard.world,
                    bound.as_secs_f64()
                ),
                Verdict::NoWorker { step, waited } => {
                    return Outcome::Failed(format!(
                        "step {step}: no worker registered within {:.1} s of the shard's start (0 of {} ranks registered; the bound is [worker] connect_timeout_secs + [server] barrier_timeout_secs = {} + {} s)",
                        waited.as_secs_f64(),
                        shard.world,
                        cfg.worker.connect_timeout_secs,
                        cfg.server.barrier_timeout_secs
                    ));
                }
                Verdict::Waiting { step, missing, waited, warn: true, .. } if !missing.is_empty() => tracing::warn!(
                    "shard {} step {step}: waiting {:.1} s for ranks {missing:?} ({} of {} in)",
                    shard.index,
                    waited.as_secs_f64(),
                    shard.world - missing.len(),
                    shard.world
                ),
                // past barrier_warn_secs, a rank whose push started but does not finish (a
                // partitioned or slow link, any transport) is named at WARN
                Verdict::Waiting { step, awaited: Some(rank), queued, waited, warn: true, .. } => tracing::warn!(
                    "shard {} step {step}: waiting {:.1} s for rank {rank}, whose gradient has started to arrive but not finished (a slow or broken link?); ranks {queued:?} queued behind it ({} of {} gradient buffers held, max_pending_gradients)",
                    shard.index,
                    waited.as_secs_f64(),
                    shard.buffers_held(),
                    cfg.server.max_pending_gradients
                ),
                Verdict::Waiting { step, awaited, queued, waited, .. } => tracing::info!(
                    "shard {} step {step}: {:.1} s; every rank's push is in or under way: receiving rank {}'s gradient, ranks {queued:?} queued ({} of {} gradient buffers held, max_pending_gradients)",
                    shard.index,
                    waited.as_secs_f64(),
                    awaited.map_or("-".to_string(), |a| a.to_string()),
                    shard.buffers_held(),
                    cfg.server.max_pending_gradients
                ),
                Verdict::Fail { step, missing, waited } => {
                    return Outcome::Failed(format!(
                        "step {step}: no gradient from ranks {missing:?} after {:.1} s (barrier_timeout_secs = {})",
                        waited.as_secs_f64(),
                        cfg.server.barrier_timeout_secs
                    ));
                }
                Verdict::Continue { step, slots, left_out, waited } => {
                    tracing::warn!(
                        "shard {} step {step}: no gradient from ranks {left_out:?} after {:.1} s: going on with the {} that pushed (barrier_policy = \"continue\"); they are not waited for until they come back, and the run no longer equals one process",
                        shard.index,
                        waited.as_secs_f64(),
                        slots.len()
                    );
                    if let Err(e) = svc.complete_step(slots).await {
                        return Outcome::Failed(e.to_string());
                    }
                }
            },
        }
    }
    Outcome::Finished
}

/// Writes the final weights (and the model's buffers) into `[server] out_dir`; `Failed` when
/// it cannot.
pub(crate) fn write_final(cfg: &Config, shard: &Shard) -> Outcome {
    let (version, params) = match shard.params() {
        Ok(p) => p,
        Err(e) => return Outcome::Failed(format!("cannot read the final weights: {e}")),
    };
    match ps_model::weights::write_shard(
        &cfg.server.out_dir,
        shard.index,
        shard.range.clone(),
        version,
        &params,
    ) {
        Ok(p) => tracing::info!(
            "shard {}: final weights (version {version}) written to {}",
            shard.index,
            p.display()
        ),
        Err(e) => return Outcome::Failed(format!("cannot write the final weights: {e}")),
    }
    if let Some(buffers) = shard.current_buffers() {
        let path = ps_model::weights::buffers_file(&cfg.server.out_dir);
        let tmp = path.with_extension("safetensors.tmp");
        match std::fs::write(&tmp, &buffers).and_then(|()| std::fs::rename(&tmp, &path)) {
            Ok(()) => tracing::info!(
                "shard {}: the model's buffers (version {version}) written to {}",
                shard.index,
                path.display()
            ),
            Err(e) => {
                return Outcome::Failed(format!(
                    "cannot write the final buffers to {}: {e}",
                    path.display()
                ));
            }
        }
    }
    Outcome::Finished
}

/// The run's end once its weights are written: waits for the workers to leave (each rank at
/// most `[server] linger_secs` after the later of the run's end and its last word, `linger`),
/// flushes the step lines, and on shard 0 logs and records the final test evaluation.
pub(crate) async fn close_run(cfg: &Config, svc: &ShardService) {
    let (shard, all_left, reporter) = (&svc.shard, &*svc.all_left, &svc.reporter);
    let linger = Duration::from_secs_f64(cfg.server.linger_secs);
    let t0 = std::time::Instant::now();
    let left = all_left.wait(linger, || shard.final_eval().1).await;
    if left.is_ok() {
        tracing::info!(
            "shard {}: every rank left {:.2} s after the last step",
            shard.index,
            t0.elapsed().as_secs_f64()
        );
    }
    // every step's line is out (or sent to shard 0) before the closing line
    reporter.flush().await;
    let ((correct, count), missing) = shard.final_eval();
    if left.is_err() {
        tracing::warn!(
            "shard {}: ranks {missing:?} did not leave within {} s of the last step or of their last word ([server] linger_secs): the final evaluation counts {count} test samples",
            shard.index,
            linger.as_secs_f64()
        );
    }
    if count > 0 {
        // every shard's /metrics says the final figure (each rank reports it to every shard)
        svc.metrics
            .final_test_accuracy(correct as f64 / count as f64);
    }
    if shard.index == 0 && count > 0 {
        tracing::info!(
            "training finished: {} steps; final test accuracy {:.2}% ({correct}/{count})",
            shard.total_steps,
            100.0 * correct as f64 / count as f64
        );
        let metrics = cfg.server.out_dir.join("metrics.jsonl");
        if let Err(e) = report::append_final_eval(&metrics, shard.total_steps, correct, count) {
            tracing::warn!(
                "cannot append the final evaluation to {}: {e}",
                metrics.display()
            );
        }
        reporter
            .final_eval(shard.total_steps, correct as f64 / count as f64)
            .await;
    } else if shard.index == 0 {
        tracing::info!("training finished: {} steps", shard.total_steps);
    }
}
