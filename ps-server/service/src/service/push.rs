//! The push path of the gRPC face: a push's header, lease and generation checked, its
//! gradient received through its plane (`plane`: gRPC chunks, the data connection or the
//! shared-memory board) and handed to the barrier; the evaluation counts checked.

use super::*;
use ps_proto::pb::PushHeader;

impl ShardService {
    /// A push: its header checked (lease, plane, step, counts), its values received through
    /// its plane ([`ShardService::receive_push`]) and handed to the barrier. `leased` is set
    /// once its header presented the rank's lease (only then may a failure close the rank's
    /// data connection).
    pub(super) async fn push_inner(
        &self,
        mut stream: Streaming<PushChunk>,
        via_data: Option<u32>,
        leased: &mut bool,
    ) -> PsResult<PushReply> {
        let first = self.first_chunk(&mut stream).await?;
        let h = first
            .header
            .ok_or_else(|| PsError::BadChunk("first push chunk has no header".into()))?;
        self.leases.check(first.lease.as_ref(), Some(h.rank), || {
            format!("push of step {} from rank {}", h.step, h.rank)
        })?;
        *leased = true;
        let plane = Plane::of(&h, via_data, self.data.is_some())?;
        self.check_header(&h)?;
        let src = Incoming {
            plane,
            first: &first,
            stream: &mut stream,
            rank: h.rank,
            step: h.step,
        };
        // a push received for per-bucket apply: kept until the barrier counted it or refused
        // it (dropped uncounted, it discards the step's work that used its values)
        let (grad, fingerprint, bucketed) = self.receive_push(src, h.samples).await?;
        let meta = PushMeta {
            rank: h.rank,
            step: h.step,
            samples: h.samples,
            loss_sum: h.loss_sum,
            correct: h.correct,
            eval: (h.eval_correct, h.eval_count),
        };
        let (outcome, ready) = self.shard.accept(meta, grad, fingerprint)?;
        if let Some(slots) = ready {
            self.complete_step(slots).await?;
        } else if outcome.counted {
            self.fold().await?;
        }
        drop(bucketed);
        Ok(PushReply {
            counted: outcome.counted,
            ranks_in: outcome.ranks_in,
        })
    }

    /// The first chunk of a push (its header), waited for at most `stream_idle_secs`.
    async fn first_chunk(&self, stream: &mut Streaming<PushChunk>) -> PsResult<PushChunk> {
        tokio::time::timeout(self.stream_idle, stream.message())
            .await
            .map_err(|_| {
                PsError::Timeout(format!(
                    "push stream sent no header for {:.1} s (stream_idle_secs): ended",
                    self.stream_idle.as_secs_f64()
                ))
            })?
            .map_err(|s| {
                PsError::BadChunk(format!(
                    "push stream broke before its header: {}",
                    s.message()
                ))
            })?
            .ok_or_else(|| PsError::BadChunk("empty push stream: expected a header chunk".into()))
    }

    /// The checks of a push's header against the shard's state (rank, step, length) and
    /// itself (evaluation counts, loss, correct predictions).
    fn check_header(&self, h: &PushHeader) -> PsResult<()> {
        self.shard.precheck(h.rank, h.step, h.len)?;
        if h.eval_correct > h.eval_count {
            return Err(PsError::BadChunk(format!(
                "eval_correct {} > eval_count {}: expected at most as many correct as evaluated",
                h.eval_correct, h.eval_count
            )));
        }
        self.check_eval(h.rank, h.eval_count, false)?;
        if !h.loss_sum.is_finite() || h.loss_sum < 0.0 || h.correct > u64::from(h.samples) {
            return Err(PsError::BadChunk(format!(
                "loss_sum {} / correct {} for {} samples: expected a finite non-negative loss and correct <= samples",
                h.loss_sum, h.correct, h.samples
            )));
        }
        Ok(())
    }

    /// Hands the first chunk's data and every further chunk of a push to `sink`
    /// ([`receive_with`], ended after `stream_idle_secs` without a chunk).
    pub(super) async fn receive_chunks(
        &self,
        sink: &mut (dyn FnMut(u64, &[u8]) -> PsResult<()> + Send),
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
    ) -> PsResult<()> {
        receive_with(sink, first.offset, &first.data, stream, self.stream_idle).await
    }

    /// Checks an evaluation `count` reported by `rank` (a known rank) against the rank's slice
    /// of the test set: at most its length in a push (0 when the push carries none); when the
    /// worker leaves, exactly its length (it evaluated its whole slice) or 0 (it evaluates
    /// nothing). Only the built-in model has test slices: a declared model's evaluation is
    /// the user's (any test set, any length), checked only for correct <= count.
    pub(super) fn check_eval(&self, rank: u32, count: u64, leaving: bool) -> PsResult<()> {
        let Some(slice) = self
            .test_slices
            .as_ref()
            .and_then(|s| s.get(rank as usize).copied())
        else {
            return Ok(());
        };
        let fits = if leaving {
            count == slice || count == 0
        } else {
            count <= slice
        };
        if fits {
            return Ok(());
        }
        Err(PsError::BadChunk(format!(
            "eval_count {count} from rank {rank}: expected {} {slice}, the length of rank {rank}'s slice of the test set",
            if leaving {
                "0 (no evaluation) or exactly"
            } else {
                "at most"
            }
        )))
    }
}

/// Runs the shard's bucket applier on a blocking thread (not waited for: the completion of
/// the step waits for it).
pub(super) fn spawn_buckets(shard: &Arc<Shard>) {
    let shard = shard.clone();
    tokio::task::spawn_blocking(move || shard.run_buckets());
}

/// Hands the first chunk's data and every further chunk of a push to `sink`; a stream that
/// sends nothing for `idle` is ended with [`PsError::Timeout`].
pub(super) async fn receive_with(
    sink: &mut (dyn FnMut(u64, &[u8]) -> PsResult<()> + Send),
    offset: u64,
    data: &[u8],
    stream: &mut Streaming<PushChunk>,
    idle: Duration,
) -> PsResult<()> {
    sink(offset, data)?;
    let mut received = data.len() as u64;
    loop {
        let next = tokio::time::timeout(idle, stream.message())
            .await
            .map_err(|_| {
                PsError::Timeout(format!(
                    "push stream idle for {:.1} s after {received} data bytes (stream_idle_secs): ended",
                    idle.as_secs_f64()
                ))
            })?
            .map_err(|s| PsError::BadChunk(format!("push stream broke: {}", s.message())))?;
        let Some(c) = next else {
            return Ok(());
        };
        if c.header.is_some() {
            return Err(PsError::BadChunk(
                "a second header in one push: expected one header, then data".into(),
            ));
        }
        sink(c.offset, &c.data)?;
        received += c.data.len() as u64;
    }
}
