//! Shard-to-shard calls: the shard credential check, `Recover` and the step reports' checks.

use super::*;

impl ShardService {
    /// A shard-to-shard request (`what`) must carry the shard credential (`[server]
    /// shard_token_file`, or `PS_SHARD_TOKEN` as `ps-launch` sets it); a shard without one
    /// refuses them all.
    pub(super) fn check_shard_credential(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        what: &str,
    ) -> PsResult<()> {
        let Some(t) = &self.shard_token else {
            return Err(PsError::Unauthenticated(format!(
                "{what}: this shard has no shard credential ([server] shard_token_file, or {}): shard-to-shard calls are refused",
                ps_net::auth::SHARD_TOKEN_ENV
            )));
        };
        {
            let got = metadata
                .get(ps_net::auth::SHARD_TOKEN_KEY)
                .map_or(&[][..], |v| v.as_bytes());
            if !t.matches(got) {
                return Err(PsError::Unauthenticated(format!(
                    "{what} {}: expected the shards' credential ({} from [server] shard_token_file); worker credentials cannot send it",
                    if got.is_empty() {
                        "without a shard credential"
                    } else {
                        "with a wrong shard credential"
                    },
                    ps_net::auth::SHARD_TOKEN_KEY
                )));
            }
        }
        Ok(())
    }

    /// The `Recover` call of a lost shard's replacement (`crate::recovery`): report where this
    /// shard is, roll back, or stop the run.
    pub(super) async fn recover_inner(
        &self,
        request: Request<RecoverRequest>,
    ) -> Result<RecoverReply, Status> {
        self.check_shard_credential(request.metadata(), "recovery request")?;
        let r = request.into_inner();
        let s = &self.shard;
        let lost = r.lost as usize;
        if lost >= s.num_shards || lost == s.index {
            return Err(PsError::BadChunk(format!(
                "recovery request for shard {lost}: expected another shard of 0..{} than this one ({})",
                s.num_shards, s.index
            ))
            .into());
        }
        let version = s.version();
        let cell = self.recovery.clone();
        let checkpoints = tokio::task::spawn_blocking(move || cell.checkpoints(version))
            .await
            .map_err(|e| Status::internal(format!("listing the checkpoints: {e}")))?;
        let reply = RecoverReply {
            shard: s.index as u32,
            version,
            generation: self.recovery.generation(),
            checkpoints,
        };
        if !r.abort.is_empty() {
            let why = format!(
                "shard {lost} was lost and the run cannot go on: {}",
                r.abort
            );
            tracing::error!("shard {}: {why}", s.index);
            s.fail(why);
            return Ok(reply);
        }
        if !r.rollback {
            tracing::warn!(
                "shard {}: shard {lost}'s replacement asks where this shard is: version {version}, generation {}, checkpoints {:?}",
                s.index,
                reply.generation,
                reply.checkpoints
            );
            return Ok(reply);
        }
        if let Some(o) = self.recovery.ordered() {
            if o.generation == r.generation && o.version == r.version {
                return Ok(reply); // the same order again
            }
            return Err(Status::failed_precondition(format!(
                "shard {} is already rolling back to version {} (generation {})",
                s.index, o.version, o.generation
            )));
        }
        if r.generation <= self.recovery.generation() || r.version > version {
            return Err(Status::failed_precondition(format!(
                "rollback to version {} in generation {}: shard {} is at version {version} in generation {}: expected a newer generation and a version not past this shard's",
                r.version,
                r.generation,
                s.index,
                self.recovery.generation()
            )));
        }
        let ordered = std::time::Instant::now();
        let cell = self.recovery.clone();
        let v = r.version;
        let saved = tokio::task::spawn_blocking(move || cell.load(v))
            .await
            .map_err(|e| Status::internal(format!("reading the checkpoint: {e}")))?
            .map_err(|e| {
                Status::failed_precondition(format!(
                    "shard {} cannot roll back to version {v}: {e}",
                    s.index
                ))
            })?;
        tracing::warn!(
            "shard {}: shard {lost} was lost: rolling back from version {version} to version {v} (generation {}); steps {v}..{version} are redone",
            s.index,
            r.generation
        );
        self.recovery.order(crate::recovery::Rollback {
            lost,
            version: v,
            generation: r.generation,
            saved,
            from: version,
            ordered,
        });
        s.fail(format!(
            "rolled back to version {v} (generation {}): shard {lost} was lost; register again",
            r.generation
        ));
        Ok(reply)
    }

    /// A step report must come from a shard (the shard credential, when one is configured),
    /// name another shard of the layout, a step of the run within [`REPORT_WINDOW`] of this
    /// shard's version, and hold finite non-negative figures.
    pub(super) fn check_report(&self, request: &Request<StepReport>) -> PsResult<()> {
        self.check_shard_credential(request.metadata(), "step report")?;
        let r = request.get_ref();
        let s = self.shard.num_shards;
        if r.shard as usize >= s || r.shard == 0 {
            return Err(PsError::BadChunk(format!(
                "step report from shard {}: expected a shard in 1..{s}",
                r.shard
            )));
        }
        let figures = [r.grad_sq_norm, r.step_ms, r.barrier_wait_ms];
        if figures.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(PsError::BadChunk(format!(
                "step report from shard {} (norm {}, step {} ms, barrier wait {} ms): expected finite non-negative figures",
                r.shard, r.grad_sq_norm, r.step_ms, r.barrier_wait_ms
            )));
        }
        crate::report::check_report_ranks(r, self.shard.world)
            .map_err(|e| PsError::BadChunk(e.to_string()))?;
        let v = self.shard.version();
        if r.step >= self.shard.total_steps
            || r.step + REPORT_WINDOW < v
            || r.step > v + REPORT_WINDOW
        {
            return Err(PsError::BadChunk(format!(
                "step report of step {} from shard {}: expected a step of the run (0..{}) within {REPORT_WINDOW} of this shard's version {v}",
                r.step, r.shard, self.shard.total_steps
            )));
        }
        Ok(())
    }
}
