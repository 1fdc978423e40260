//! The one way a shard reads a push's values, whatever plane carried them: gRPC chunks, a
//! frame on the rank's data connection, or the rank's shared-memory gradient board. The plane
//! is fixed by the rank's registration (a board it attached, a data connection it opened) and
//! named by each push ([`Plane::of`]); the barrier sees a [`Grad`] and a fingerprint, never the
//! plane. The shard takes the values in one of three ways ([`Target`]): into the per-bucket
//! applier's buffer, into a whole-range buffer, or checked and dropped (a push the step does
//! not wait for); every plane serves every way, with the same checks and the same fingerprint:
//! the streaming planes through [`Streamed`] (gRPC chunks, a data-connection frame), a board
//! through the shard core's in-place receipt (`Shard::board_push`).

use super::push::spawn_buckets;
use super::*;
use crate::shard::intake::Permit;
use ps_net::copied::{self, Side};
use ps_proto::pb::PushHeader;

/// How a push's values travel (gRPC is the control channel: the header always comes on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plane {
    /// In the push's gRPC stream, in chunks after the header.
    Chunks,
    /// In one frame on the rank's plain-TCP data connection (`ps_net::datalink`).
    Frame,
    /// Already in the shard's range of the rank's shared-memory gradient board.
    Board,
}

impl Plane {
    /// The plane of a push with header `h` whose gRPC request named `via_data`'s data
    /// connection (`has_data`: this shard accepts data connections); refused when the request
    /// names another rank's connection, or a connection and the board both, or a connection
    /// this shard does not have.
    pub(super) fn of(h: &PushHeader, via_data: Option<u32>, has_data: bool) -> PsResult<Plane> {
        match via_data {
            Some(r) if r != h.rank || h.shm || !has_data => Err(PsError::BadChunk(format!(
                "a push of rank {} asked for the data connection of rank {r}{}",
                h.rank,
                if h.shm {
                    " with its gradient in shared memory: expected one or the other"
                } else if !has_data {
                    ": this shard has no data connections (TLS is on)"
                } else {
                    ": expected its own"
                }
            ))),
            Some(_) => Ok(Plane::Frame),
            None if h.shm => Ok(Plane::Board),
            None => Ok(Plane::Chunks),
        }
    }
}

/// A push's values, not yet read: the header's chunk and the rest of its gRPC stream, and the
/// plane its values come on.
pub(super) struct Incoming<'a> {
    /// The plane.
    pub(super) plane: Plane,
    /// The first chunk (the header; gRPC chunks may carry data in it too).
    pub(super) first: &'a PushChunk,
    /// The rest of the push's gRPC stream.
    pub(super) stream: &'a mut Streaming<PushChunk>,
    /// The pushing rank.
    pub(super) rank: u32,
    /// The step pushed.
    pub(super) step: u64,
}

/// How the shard takes a push's values.
enum Target<'i> {
    /// Into the per-bucket applier's buffer, each bucket published as it is complete.
    Buckets(&'i mut Intake),
    /// Into a whole-range receive buffer (with the permit to hold it).
    Buffer(Permit),
    /// Read, checked and fingerprinted, not kept: the step does not wait for this push (a
    /// retry of a counted gradient, a rank it went on without).
    Check,
}

/// A plane whose values stream in after the header (gRPC chunks, a data-connection frame):
/// how they come into the shard's memory, for each way the shard takes them ([`Target`]).
/// Once in, the shard reads them through the same [`ps_net::source::PushSource`] as a board's.
trait Streamed {
    /// Into the per-bucket applier's buffer, each bucket published as soon as it is in.
    async fn into_intake(self, svc: &ShardService, intake: &mut Intake) -> PsResult<()>;
    /// Into a whole-range receive buffer from the pool (given back on failure): the values
    /// and their fingerprint.
    async fn into_buffer(self, svc: &ShardService) -> PsResult<(Vec<f32>, u64)>;
    /// Read, checked and fingerprinted, not kept: the fingerprint.
    async fn check(self, svc: &ShardService) -> PsResult<u64>;
}

/// gRPC chunks after the header (the header's chunk may carry data too).
struct Chunks<'a> {
    first: &'a PushChunk,
    stream: &'a mut Streaming<PushChunk>,
}

impl Streamed for Chunks<'_> {
    async fn into_intake(self, svc: &ShardService, intake: &mut Intake) -> PsResult<()> {
        svc.chunks_into(self.first, self.stream, intake).await
    }

    async fn into_buffer(self, svc: &ShardService) -> PsResult<(Vec<f32>, u64)> {
        svc.chunks_to_buffer(self.first, self.stream).await
    }

    async fn check(self, svc: &ShardService) -> PsResult<u64> {
        let mut check = StreamCheck::new(svc.shard.push_len()).on_wire(svc.wire);
        let mut sink = |offset: u64, data: &[u8]| check.push(offset, data);
        svc.receive_chunks(&mut sink, self.first, self.stream)
            .await?;
        check.finish()
    }
}

/// One frame on the rank's data connection (the gRPC stream holds the header alone).
struct Frame<'a> {
    first: &'a PushChunk,
    stream: &'a mut Streaming<PushChunk>,
    rank: u32,
    step: u64,
}

impl Streamed for Frame<'_> {
    async fn into_intake(self, svc: &ShardService, intake: &mut Intake) -> PsResult<()> {
        svc.receive_frame_into(self.first, self.stream, self.rank, self.step, intake)
            .await
    }

    async fn into_buffer(self, svc: &ShardService) -> PsResult<(Vec<f32>, u64)> {
        let values = svc
            .receive_frame(self.first, self.stream, self.rank, self.step)
            .await?;
        match check_and_fingerprint(&values) {
            Ok(fp) => Ok((values, fp)),
            Err(e) => {
                svc.shard.return_buffer(values);
                Err(e)
            }
        }
    }

    async fn check(self, svc: &ShardService) -> PsResult<u64> {
        svc.check_frame(self.first, self.stream, self.rank, self.step)
            .await
    }
}

impl ShardService {
    /// Receives the values of the push `src` (of `samples` samples) through its plane, as the
    /// shard takes them: a board's in place; otherwise, once the rank's turn came (under the
    /// flow control of held gradients), into the bucket applier's buffer where per-bucket
    /// apply is on, into a receive buffer where not, or checked only when the step does not
    /// wait for it. Returns the gradient, its fingerprint and the bucket intake, which the
    /// caller keeps until the barrier counted or refused the push.
    pub(super) async fn receive_push(
        &self,
        src: Incoming<'_>,
        samples: u32,
    ) -> PsResult<(Grad, u64, Option<Intake>)> {
        // the rank is not missing while its push waits for its turn, streams in or is read
        // from its board
        let _under_way = self.shard.announce(src.rank, src.step, samples);
        if src.plane == Plane::Board {
            return self
                .receive_shm(src.rank, src.step, src.first, src.stream)
                .await;
        }
        self.fold().await?;
        let Some(permit) = self.shard.wait_turn(src.rank, src.step).await? else {
            let (grad, fp) = self.read_into(src, Target::Check).await?;
            return Ok((grad, fp, None));
        };
        let Some(mut intake) = self.shard.intake(src.rank, src.step) else {
            let (grad, fp) = self.read_into(src, Target::Buffer(permit)).await?;
            return Ok((grad, fp, None));
        };
        self.read_into(src, Target::Buckets(&mut intake)).await?;
        let (grad, fp) = intake.finish(Some(permit))?;
        Ok((grad, fp, Some(intake)))
    }

    /// Reads the values of `src` (gRPC chunks or a data-connection frame) into `target`.
    /// For [`Target::Buckets`] the returned gradient is [`Grad::Checked`]: the intake's
    /// `finish` makes the real one.
    async fn read_into(&self, src: Incoming<'_>, target: Target<'_>) -> PsResult<(Grad, u64)> {
        let Incoming {
            plane,
            first,
            stream,
            rank,
            step,
        } = src;
        match plane {
            Plane::Frame => {
                let frame = Frame {
                    first,
                    stream,
                    rank,
                    step,
                };
                self.take(frame, target).await
            }
            Plane::Chunks | Plane::Board => self.take(Chunks { first, stream }, target).await,
        }
    }

    /// Takes the values `from` brings as `target` says: the gradient and its fingerprint.
    async fn take(&self, from: impl Streamed, target: Target<'_>) -> PsResult<(Grad, u64)> {
        match target {
            Target::Buckets(intake) => {
                from.into_intake(self, intake).await?;
                Ok((Grad::Checked, 0))
            }
            Target::Buffer(permit) => {
                let (values, fp) = from.into_buffer(self).await?;
                let held = Held {
                    values,
                    permit: Some(permit),
                };
                Ok((Grad::Owned(held), fp))
            }
            Target::Check => Ok((Grad::Checked, from.check(self).await?)),
        }
    }

    /// Receives a push's gRPC chunks into `intake`'s buffer, contiguous and in order, starting
    /// the bucket applier whenever buckets became ready for every rank.
    async fn chunks_into(
        &self,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
        intake: &mut Intake,
    ) -> PsResult<()> {
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
        self.receive_chunks(&mut sink, first, stream).await
    }

    /// Receives a push's gRPC chunks into a receive buffer from the pool (given back on
    /// failure); returns the values and their fingerprint.
    async fn chunks_to_buffer(
        &self,
        first: &PushChunk,
        stream: &mut Streaming<PushChunk>,
    ) -> PsResult<(Vec<f32>, u64)> {
        let mut rx =
            TensorReceiver::with_buffer(self.shard.take_buffer(), self.shard.push_len(), true)
                .on_wire(self.wire);
        let wire = self.wire;
        let mut sink = |offset: u64, data: &[u8]| -> PsResult<()> {
            rx.push(offset, data)?;
            // the chunk's values decoded into the shard's buffer
            copied::count(Side::Push, data.len() / wire.value_bytes() * 4);
            Ok(())
        };
        let received = self.receive_chunks(&mut sink, first, stream).await;
        if let Err(e) = received {
            self.shard.return_buffer(rx.into_buffer());
            return Err(e);
        }
        rx.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(rank: u32, shm: bool) -> PushHeader {
        PushHeader {
            rank,
            shm,
            ..Default::default()
        }
    }

    #[test]
    fn a_push_names_one_plane_and_only_its_own_data_connection() {
        assert_eq!(
            Plane::of(&header(1, false), None, true).ok(),
            Some(Plane::Chunks)
        );
        assert_eq!(
            Plane::of(&header(1, true), None, true).ok(),
            Some(Plane::Board)
        );
        assert_eq!(
            Plane::of(&header(1, false), Some(1), true).ok(),
            Some(Plane::Frame)
        );
        let msg = |h, via, has| match Plane::of(&h, via, has) {
            Err(PsError::BadChunk(m)) => m,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            msg(header(1, false), Some(2), true),
            "a push of rank 1 asked for the data connection of rank 2: expected its own"
        );
        assert_eq!(
            msg(header(1, true), Some(1), true),
            "a push of rank 1 asked for the data connection of rank 1 with its gradient in shared memory: expected one or the other"
        );
        assert_eq!(
            msg(header(1, false), Some(1), false),
            "a push of rank 1 asked for the data connection of rank 1: this shard has no data connections (TLS is on)"
        );
    }
}
