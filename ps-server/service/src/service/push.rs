//! The push path of the gRPC face: a push's header, lease and generation checked, its
//! gradient received (gRPC chunks, the data connection or the shared-memory board) and handed
//! to the shard's intake; the evaluation counts checked.

use super::*;

impl ShardService {
    /// A push; `leased` is set once its header presented the rank's lease (only then may a
    /// failure close the rank's data connection).
    pub(super) async fn push_inner(
        &self,
        mut stream: Streaming<PushChunk>,
        via_data: Option<u32>,
        leased: &mut bool,
    ) -> PsResult<PushReply> {
        let first = tokio::time::timeout(self.stream_idle, stream.message())
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
            .ok_or_else(|| {
                PsError::BadChunk("empty push stream: expected a header chunk".into())
            })?;
        let h = first
            .header
            .ok_or_else(|| PsError::BadChunk("first push chunk has no header".into()))?;
        self.leases.check(first.lease.as_ref(), Some(h.rank), || {
            format!("push of step {} from rank {}", h.step, h.rank)
        })?;
        *leased = true;
        if let Some(r) = via_data
            && (r != h.rank || h.shm || self.data.is_none())
        {
            return Err(PsError::BadChunk(format!(
                "a push of rank {} asked for the data connection of rank {r}{}",
                h.rank,
                if h.shm {
                    " with its gradient in shared memory: expected one or the other"
                } else if self.data.is_none() {
                    ": this shard has no data connections (TLS is on)"
                } else {
                    ": expected its own"
                }
            )));
        }
        self.shard.precheck(h.rank, h.step, h.len)?;
        if h.eval_correct > h.eval_count {
            return Err(PsError::BadChunk(format!(
                "eval_correct {} > eval_count {}: expected at most as many correct as evaluated",
                h.eval_correct, h.eval_count
            )));
        }
        self.check_eval(h.rank, h.eval_count, false)?;
        // a push received for per-bucket apply: kept until the barrier counted it or refused
        // it (dropped uncounted, it discards the step's work that used its values)
        let mut bucketed: Option<Intake> = None;
        if !h.loss_sum.is_finite() || h.loss_sum < 0.0 || h.correct > u64::from(h.samples) {
            return Err(PsError::BadChunk(format!(
                "loss_sum {} / correct {} for {} samples: expected a finite non-negative loss and correct <= samples",
                h.loss_sum, h.correct, h.samples
            )));
        }
        let (grad, fingerprint) = if h.shm {
            self.receive_shm(h.rank, &first, &mut stream).await?
        } else {
            // the rank is not missing while its push waits for its turn or streams in
            let _under_way = self.shard.announce(h.rank, h.step, h.samples);
            self.fold().await?;
            let turn = self.shard.wait_turn(h.rank, h.step).await?;
            if turn.is_some() {
                bucketed = self.shard.intake(h.rank, h.step);
            }
            match turn {
                Some(permit) if let Some(intake) = bucketed.as_mut() => {
                    if via_data.is_some() {
                        self.receive_frame_into(&first, &mut stream, h.rank, h.step, intake)
                            .await?;
                    } else {
                        let (shard, wire) = (&self.shard, self.wire);
                        let mut at = 0usize;
                        let mut sink = |offset: u64, data: &[u8]| -> PsResult<()> {
                            if offset != at as u64 {
                                return Err(PsError::BadChunk(format!(
                                    "chunk at offset {offset}: expected offset {at} (chunks must be contiguous and in order)"
                                )));
                            }
                            if intake.decode(at, wire, data)? {
                                spawn_buckets(shard);
                            }
                            at += data.len() / wire.value_bytes();
                            Ok(())
                        };
                        self.receive_chunks(&mut sink, &first, &mut stream).await?;
                    }
                    intake.finish(Some(permit))?
                }
                Some(permit) if via_data.is_some() => {
                    let values = self
                        .receive_frame(&first, &mut stream, h.rank, h.step)
                        .await?;
                    let fp = check_and_fingerprint(&values);
                    let fp = match fp {
                        Ok(fp) => fp,
                        Err(e) => {
                            self.shard.return_buffer(values);
                            return Err(e);
                        }
                    };
                    let held = Held {
                        values,
                        permit: Some(permit),
                    };
                    (Grad::Owned(held), fp)
                }
                None if via_data.is_some() => (
                    Grad::Checked,
                    self.check_frame(&first, &mut stream, h.rank, h.step)
                        .await?,
                ),
                Some(permit) => {
                    let mut rx = TensorReceiver::with_buffer(
                        self.shard.take_buffer(),
                        self.shard.push_len(),
                        true,
                    )
                    .on_wire(self.wire);
                    let received = receive_rest(
                        &mut rx,
                        first.offset,
                        &first.data,
                        &mut stream,
                        self.stream_idle,
                    )
                    .await;
                    if let Err(e) = received {
                        self.shard.return_buffer(rx.into_buffer());
                        return Err(e);
                    }
                    let (values, fp) = match rx.finish() {
                        Ok(r) => r,
                        Err(e) => return Err(e),
                    };
                    let held = Held {
                        values,
                        permit: Some(permit),
                    };
                    (Grad::Owned(held), fp)
                }
                None => {
                    let mut check = StreamCheck::new(self.shard.push_len()).on_wire(self.wire);
                    let mut sink = |offset: u64, data: &[u8]| check.push(offset, data);
                    self.receive_chunks(&mut sink, &first, &mut stream).await?;
                    (Grad::Checked, check.finish()?)
                }
            }
        };
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
        Ok(PushReply {
            counted: outcome.counted,
            ranks_in: outcome.ranks_in,
        })
    }

    /// Hands the first chunk's data and every further chunk of a push to `sink`
    /// ([`receive_with`], ended after `stream_idle_secs` without a chunk).
    async fn receive_chunks(
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

/// Receives the first chunk's data and every further chunk of a push into `rx`.
pub(super) async fn receive_rest(
    rx: &mut TensorReceiver,
    offset: u64,
    data: &[u8],
    stream: &mut Streaming<PushChunk>,
    idle: Duration,
) -> PsResult<()> {
    let mut sink = |offset: u64, data: &[u8]| rx.push(offset, data);
    receive_with(&mut sink, offset, data, stream, idle).await
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
