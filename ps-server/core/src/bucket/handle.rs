//! [`Intake`]: the receiving task's handle on a push received for per-bucket apply: it hands
//! out the regions of the receive buffer to write, publishes them, and discards the step's work
//! when dropped before the push is counted.

use super::{Received, RecvBuf};
use crate::{Grad, Shard};
use ps_config::Wire;
use ps_net::copied::{self, Side};
use ps_proto::{PsError, PsResult};
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The receiving task's handle on a push received for per-bucket apply ([`Shard::intake`]).
/// Dropped before the push is counted, it discards the step's work that used its values.
#[derive(Debug)]
pub struct Intake {
    pub(super) shard: Arc<Shard>,
    pub(super) rank: u32,
    pub(super) step: u64,
    pub(super) buf: Option<Arc<RecvBuf>>,
    /// Regions handed out for writing (never twice the same value).
    pub(super) given: Vec<Range<usize>>,
    /// The region handed out last, not yet published.
    pub(super) last: Option<Range<usize>>,
}

impl Intake {
    pub(super) fn buf(&self) -> &Arc<RecvBuf> {
        self.buf.as_ref().expect("held until finished")
    }

    /// Values `r` of the buffer, to be written once (by a read from the connection) and then
    /// published ([`Intake::publish`]). A region overlapping one handed out before, or
    /// outside the buffer, is refused.
    pub fn region(&mut self, r: Range<usize>) -> PsResult<&mut [MaybeUninit<f32>]> {
        let len = self.buf().len();
        let overlaps = self
            .given
            .iter()
            .any(|g| g.start < r.end && r.start < g.end);
        let done = self.buf().complete.load(Ordering::Acquire);
        if r.start > r.end || r.end > len || overlaps || done {
            return Err(PsError::Internal(format!(
                "receive region {r:?} of {len} values overlaps one received already"
            )));
        }
        self.given.push(r.clone());
        self.last = Some(r.clone());
        let ptr = self.buf().ptr.as_ptr();
        // SAFETY: in bounds; never handed out before (checked above), so this is the only
        // reference to it; not published, so the applier does not read it.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(ptr.add(r.start).cast::<MaybeUninit<f32>>(), r.len())
        })
    }

    /// Records values `r` as handed out (never written: a board view's), as
    /// [`Intake::region`] does; refused in the same cases.
    pub(super) fn mark(&mut self, r: Range<usize>) -> PsResult<()> {
        let len = self.buf().len();
        let overlaps = self
            .given
            .iter()
            .any(|g| g.start < r.end && r.start < g.end);
        if r.start > r.end || r.end > len || overlaps {
            return Err(PsError::Internal(format!(
                "board region {r:?} of {len} values overlaps one read already"
            )));
        }
        self.given.push(r.clone());
        self.last = Some(r);
        Ok(())
    }

    /// Publishes the region handed out last as received; true when an applier should run
    /// ([`Shard::run_buckets`], on a blocking thread).
    ///
    /// # Safety
    /// Every value of that region was written.
    pub unsafe fn publish(&mut self) -> bool {
        let Some(r) = self.last.take() else {
            return false;
        };
        self.shard.published(self.rank, self.step, self.buf(), r)
    }

    /// Decodes one gRPC chunk's `data` (values encoded as `wire` says) into values from `at`,
    /// and publishes them; true when an applier should run. Refused when the chunk does not
    /// hold whole values or goes past the buffer.
    pub fn decode(&mut self, at: usize, wire: Wire, data: &[u8]) -> PsResult<bool> {
        let vb = wire.value_bytes();
        if !data.len().is_multiple_of(vb) {
            return Err(ps_net::wire::not_whole(at as u64, data.len(), wire));
        }
        let n = data.len() / vb;
        if at + n > self.buf().len() {
            return Err(PsError::WrongLength {
                expected: self.buf().len() as u64,
                got: (at + n) as u64,
            });
        }
        let dst = self.region(at..at + n)?;
        match wire {
            Wire::F32 => dst.iter_mut().zip(data.chunks_exact(4)).for_each(|(d, c)| {
                d.write(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            }),
            Wire::Bf16 => dst.iter_mut().zip(data.chunks_exact(2)).for_each(|(d, c)| {
                d.write(ps_net::wire::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])));
            }),
        }
        // a received chunk's values decoded into the shard's buffer
        copied::count(Side::Push, 4 * n);
        // SAFETY: every value of the region was written just above.
        Ok(unsafe { self.publish() })
    }

    /// Every value is in: the gradient (checked for finiteness) and its fingerprint, for
    /// [`Shard::accept`]; keep the handle until that answered. Refused when some value was not
    /// received, or one is not finite.
    pub fn finish(&mut self, permit: Option<crate::intake::Permit>) -> PsResult<(Grad, u64)> {
        let len = self.buf().len();
        let mut given = self.given.clone();
        given.sort_by_key(|r| r.start);
        let covered = given.iter().map(Range::len).sum::<usize>() == len;
        if !covered || self.last.is_some() {
            return Err(PsError::WrongLength {
                expected: len as u64,
                got: given.iter().map(Range::len).sum::<usize>() as u64,
            });
        }
        self.buf().complete.store(true, Ordering::Release);
        let fp = ps_net::wire::check_and_fingerprint(self.buf().values().expect("complete"))?;
        // the handle lives on until the push is counted or refused ([`Shard::accept`]): its
        // drop discards the step's work if the push was not counted
        let grad = Grad::Received(Received {
            buf: self.buf().clone(),
            permit,
        });
        Ok((grad, fp))
    }
}

impl Drop for Intake {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.shard.intake_ended(self.rank, self.step, &buf);
            if let Some(v) = RecvBuf::into_vec(buf) {
                self.shard.return_buffer(v);
            }
        }
    }
}
