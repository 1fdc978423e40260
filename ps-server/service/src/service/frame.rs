//! Data-frame receipt: a push whose values come on the rank's plain-TCP data connection
//! (`ps_net::datalink`), read straight into a receive buffer and checked as it streams.

use super::*;
use ps_net::copied::{self, Side};

impl ShardService {
    /// The gradient of a push whose values come on `rank`'s data connection: the gRPC stream
    /// must hold the header alone; the frame is read straight into a receive buffer (given
    /// back to the pool on failure). The connection is kept for the next frame only when this
    /// one was read in full.
    pub(super) async fn receive_frame(
        &self,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
        rank: u32,
        step: u64,
    ) -> PsResult<Vec<f32>> {
        let (data, mut conn) = self.frame_conn(first, stream, rank).await?;
        let len = self.shard.push_len();
        let mut values = self.shard.take_buffer();
        values.clear();
        let what = format!("push of step {step} from rank {rank} (data connection)");
        let (wire, idle) = (self.wire, self.stream_idle);
        let read = async {
            let bytes = (wire.value_bytes() * len) as u64;
            let pieces =
                datalink::read_push_header(&mut conn.half, step, bytes, wire, &what, idle).await?;
            datalink::read_push_into_vec(
                &mut conn.half,
                &mut values,
                len,
                wire,
                pieces,
                &what,
                idle,
            )
            .await
        };
        if let Err(e) = read.await {
            self.shard.return_buffer(values);
            return Err(e);
        }
        // the frame's values read into the shard's buffer
        copied::count(Side::Push, 4 * values.len());
        data.put_read(rank, conn).await;
        Ok(values)
    }

    /// Like [`ShardService::receive_frame`], into `intake`'s buffer for per-bucket apply: each
    /// piece is read in segments of at most a bucket, each published as soon as it is in
    /// (the applier is started when buckets became ready for every rank).
    pub(super) async fn receive_frame_into(
        &self,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
        rank: u32,
        step: u64,
        intake: &mut Intake,
    ) -> PsResult<()> {
        let (data, mut conn) = self.frame_conn(first, stream, rank).await?;
        let len = self.shard.push_len();
        let what = format!("push of step {step} from rank {rank} (data connection)");
        let (wire, idle) = (self.wire, self.stream_idle);
        let vb = wire.value_bytes() as u64;
        let total = vb * len as u64;
        let pieces =
            datalink::read_push_header(&mut conn.half, step, total, wire, &what, idle).await?;
        if !pieces {
            read_published(
                &mut conn.half,
                intake,
                0..len,
                &self.shard,
                wire,
                &what,
                idle,
            )
            .await?;
        } else {
            let mut cov = datalink::Coverage::new(total, wire);
            while !cov.complete() {
                let (offset, n) =
                    datalink::read_piece_header(&mut conn.half, &cov, &what, idle).await?;
                cov.add(offset, n, &what)?;
                let (v0, count) = ((offset / vb) as usize, (n / vb) as usize);
                let piece = format!("{what}, piece at bytes {offset}..{}", offset + n);
                let r = v0..v0 + count;
                read_published(&mut conn.half, intake, r, &self.shard, wire, &piece, idle).await?;
            }
        }
        data.put_read(rank, conn).await;
        Ok(())
    }

    /// Like [`ShardService::receive_frame`] for a push the shard does not keep (a retry of a
    /// counted gradient): the frame is checked and fingerprinted piece by piece, not stored.
    pub(super) async fn check_frame(
        &self,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
        rank: u32,
        step: u64,
    ) -> PsResult<u64> {
        let (data, mut conn) = self.frame_conn(first, stream, rank).await?;
        let len = self.shard.push_len();
        let what = format!("push of step {step} from rank {rank} (data connection)");
        let (wire, idle) = (self.wire, self.stream_idle);
        let vb = wire.value_bytes();
        let total = (vb * len) as u64;
        let pieces =
            datalink::read_push_header(&mut conn.half, step, total, wire, &what, idle).await?;
        let mut check = StreamCheck::new(len).on_wire(wire);
        let mut scratch = vec![0u8; ps_net::wire::DEFAULT_CHUNK_BYTES.min(vb * len.max(1))];
        if !pieces {
            stream_check(
                &mut conn.half,
                &mut check,
                &mut scratch,
                0,
                len,
                vb,
                &what,
                idle,
            )
            .await?;
        } else {
            // pieces in ascending contiguous order stream through the check; from the first
            // one out of order on, the rest is read into a buffer (under a permit, as a kept
            // gradient's is) and checked in order once complete
            let mut cov = datalink::Coverage::new(total, wire);
            let mut held: Option<(Vec<f32>, crate::shard::intake::Permit)> = None;
            let mut streamed = 0usize;
            let read = async {
                while !cov.complete() {
                    let (offset, n) =
                        datalink::read_piece_header(&mut conn.half, &cov, &what, idle).await?;
                    cov.add(offset, n, &what)?;
                    let (v0, count) = ((offset / vb as u64) as usize, (n / vb as u64) as usize);
                    let piece = format!("{what}, piece at bytes {offset}..{}", offset + n);
                    if held.is_none() && v0 == streamed {
                        stream_check(
                            &mut conn.half,
                            &mut check,
                            &mut scratch,
                            v0,
                            count,
                            vb,
                            &piece,
                            idle,
                        )
                        .await?;
                        streamed += count;
                        continue;
                    }
                    if held.is_none() {
                        let permit = self.shard.try_permit(rank, step).ok_or_else(|| {
                            PsError::Unavailable(format!(
                                "{what}: a gradient already counted came again with its pieces out of order, and no gradient buffer is free to check it (max_pending_gradients): push it again"
                            ))
                        })?;
                        let mut buf = self.shard.take_buffer();
                        buf.clear();
                        buf.resize(len, 0.0);
                        held = Some((buf, permit));
                    }
                    let (buf, _) = held.as_mut().expect("held just above");
                    datalink::read_piece_into(
                        &mut conn.half,
                        &mut buf[v0..v0 + count],
                        wire,
                        &piece,
                        idle,
                    )
                    .await?;
                }
                if let Some((buf, _)) = &held {
                    check.push_values(streamed as u64, &buf[streamed..])?;
                }
                Ok::<_, PsError>(())
            };
            let read = read.await;
            if let Some((buf, permit)) = held {
                self.shard.return_buffer(buf);
                drop(permit);
            }
            read?;
        }
        let fp = check.finish()?;
        data.put_read(rank, conn).await;
        Ok(fp)
    }

    /// Checks that a data-connection push's gRPC stream holds its header alone, and takes the
    /// rank's connection.
    pub(super) async fn frame_conn(
        &self,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
        rank: u32,
    ) -> PsResult<(
        &Arc<crate::data::DataConns>,
        crate::data::Taken<tokio::net::tcp::OwnedReadHalf>,
    )> {
        let extra = !first.data.is_empty()
            || tokio::time::timeout(self.stream_idle, stream.message())
                .await
                .map_err(|_| {
                    PsError::Timeout(format!(
                        "push stream did not end for {:.1} s after its header (stream_idle_secs): ended",
                        self.stream_idle.as_secs_f64()
                    ))
                })?
                .map_err(|s| PsError::BadChunk(format!("push stream broke: {}", s.message())))?
                .is_some();
        if extra {
            return Err(PsError::BadChunk(
                "a push on the data connection carried data chunks: expected the header alone"
                    .into(),
            ));
        }
        let data = self
            .data
            .as_ref()
            .ok_or_else(|| PsError::Internal("no data connections".into()))?;
        let conn = data.take_read(rank).await?;
        Ok((data, conn))
    }
}

/// Reads values `r` of a push frame from `conn` into `intake`'s buffer in segments of at most
/// a bucket, publishing each as soon as it is in (and starting the shard's bucket applier
/// when buckets became ready for every rank).
#[allow(clippy::too_many_arguments)]
async fn read_published<R: tokio::io::AsyncRead + Unpin>(
    conn: &mut R,
    intake: &mut Intake,
    r: std::ops::Range<usize>,
    shard: &Arc<Shard>,
    wire: Wire,
    what: &str,
    idle: Duration,
) -> PsResult<()> {
    for lo in r.clone().step_by(crate::shard::bucket::BUCKET_VALUES) {
        let seg = lo..(lo + crate::shard::bucket::BUCKET_VALUES).min(r.end);
        datalink::read_piece(conn, intake.region(seg.clone())?, wire, what, idle).await?;
        // the segment's values read into the shard's buffer
        copied::count(Side::Push, 4 * seg.len());
        // SAFETY: read_piece returned Ok: it wrote every value of the region
        if unsafe { intake.publish() } {
            super::push::spawn_buckets(shard);
        }
    }
    Ok(())
}

/// Streams `count` values (encoded `vb` bytes each) of a push frame from `conn` through
/// `check`, from value `at`, `scratch` at a time.
#[allow(clippy::too_many_arguments)]
pub(super) async fn stream_check<R: tokio::io::AsyncRead + Unpin>(
    conn: &mut R,
    check: &mut StreamCheck,
    scratch: &mut [u8],
    mut at: usize,
    count: usize,
    vb: usize,
    what: &str,
    idle: Duration,
) -> PsResult<()> {
    let end = at + count;
    while at < end {
        let n = (end - at).min(scratch.len() / vb);
        datalink::read_all(conn, &mut scratch[..vb * n], what, idle).await?;
        check.push(at as u64, &scratch[..vb * n])?;
        at += n;
    }
    Ok(())
}
