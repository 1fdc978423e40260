//! Where a pull puts the values it receives: [`PullSink`], written in ascending order, piece
//! by piece, each piece published once written. A pull into a plain slice ([`SliceSink`])
//! publishes nothing to anyone; the worker's gated pull (`crate::gate`) lets its forward
//! pass start on the first layers while the later ones are still arriving. Every transport
//! fills a sink the same way: gRPC chunks as they arrive, the data connection's frame in
//! pieces, a shared-memory board in pieces that end at the sink's layer boundaries.

/// The most values a pull writes before it publishes them (1 MiB of f32) when the transport
/// hands them over in larger runs (a data connection's frame, a board's slot).
pub const PIECE_VALUES: usize = 1 << 18;

/// The destination of one shard's pull: `len()` values, written in ascending order. Values
/// handed out by [`PullSink::next`] are written, then [`PullSink::publish`]ed; a published
/// value is never handed out again (a retried pull skips what is published: it is of the same
/// version). A writer may keep the memory of one `next(n)` (as a pointer) and publish it in
/// several ascending parts, each once written, writing no part after it published it (a
/// board read by several threads does: `Board::read_parallel`).
pub trait PullSink: Send {
    /// Values the pull delivers (the shard's range).
    fn len(&self) -> usize;
    /// True when the range is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Values written and published so far.
    fn filled(&self) -> usize;
    /// The next `n` values after [`PullSink::filled`], to write (`filled() + n <= len()`).
    fn next(&mut self, n: usize) -> &mut [f32];
    /// Publishes the `n` values after [`PullSink::filled`] (written through
    /// [`PullSink::next`]): from here on they are read, never written, in this version.
    fn publish(&mut self, n: usize);
    /// Where the next piece should end, at most [`PIECE_VALUES`] after `filled()`: a boundary
    /// a reader waits for (a layer's end) when there is one sooner, else `len()` or the cap.
    fn piece_end(&self) -> usize {
        self.len().min(self.filled() + PIECE_VALUES)
    }
    /// The pull's values lie complete in `slot` (a shard's parameters board, this version):
    /// a sink whose reader can use them there (a device that registered the board reads them
    /// by DMA, checking [`crate::dma::InPlace::intact`] afterwards) takes them and returns
    /// true: nothing is copied. False (the default): the pull copies them into the sink.
    fn in_place(&mut self, _slot: &crate::dma::InPlace) -> bool {
        false
    }
}

/// A pull straight into a slice, with no reader waiting on it.
#[derive(Debug)]
pub struct SliceSink<'a> {
    dst: &'a mut [f32],
    filled: usize,
}

impl<'a> SliceSink<'a> {
    /// A sink filling `dst` from its start.
    pub fn new(dst: &'a mut [f32]) -> Self {
        Self { dst, filled: 0 }
    }
}

impl PullSink for SliceSink<'_> {
    fn len(&self) -> usize {
        self.dst.len()
    }
    fn filled(&self) -> usize {
        self.filled
    }
    fn next(&mut self, n: usize) -> &mut [f32] {
        &mut self.dst[self.filled..self.filled + n]
    }
    fn publish(&mut self, n: usize) {
        assert!(self.filled + n <= self.dst.len(), "published past the end");
        self.filled += n;
    }
    fn piece_end(&self) -> usize {
        // nobody waits on a piece: one copy of the whole rest
        self.dst.len()
    }
}

/// Writes one received chunk, `data` (little-endian f32 bytes, whole values) that starts at
/// value `offset` of the pull, into `sink` and publishes it, checking that it is whole values
/// and fits: the building block of pulls that decode straight into the weights. The part
/// before [`PullSink::filled`] (a retried pull's, already published) is skipped; a gap
/// before it is an error.
pub fn write_chunk(
    sink: &mut dyn PullSink,
    offset: u64,
    data: &[u8],
) -> Result<(), ps_proto::PsError> {
    use ps_proto::PsError;
    if !data.len().is_multiple_of(4) {
        return Err(PsError::BadChunk(format!(
            "chunk at offset {offset} holds {} bytes: expected a multiple of 4 (little-endian f32)",
            data.len()
        )));
    }
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    let end = start.saturating_add(data.len() / 4);
    let filled = sink.filled();
    if start > filled {
        return Err(PsError::BadChunk(format!(
            "chunk at offset {offset}, expected {filled}"
        )));
    }
    if end > sink.len() {
        return Err(PsError::WrongLength {
            expected: sink.len() as u64,
            got: end as u64,
        });
    }
    if end > filled {
        let n = end - filled;
        crate::wire::decode_le(sink.next(n), &data[(filled - start) * 4..]);
        sink.publish(n);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_fill_in_order_and_a_retry_skips_what_is_published() {
        let mut dst = vec![0f32; 5];
        let mut sink = SliceSink::new(&mut dst);
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        write_chunk(&mut sink, 0, &bytes(&[1.0, 2.0])).unwrap();
        // a gap is refused
        assert!(write_chunk(&mut sink, 3, &bytes(&[9.0])).is_err());
        // a retried pull resends from 0: the published part is kept, the rest written
        write_chunk(&mut sink, 0, &bytes(&[7.0, 7.0, 3.0])).unwrap();
        assert_eq!(sink.filled(), 3);
        // past the end
        assert!(write_chunk(&mut sink, 3, &bytes(&[4.0, 5.0, 6.0])).is_err());
        write_chunk(&mut sink, 3, &bytes(&[4.0, 5.0])).unwrap();
        assert_eq!(dst, [1.0, 2.0, 3.0, 4.0, 5.0]);
    }
}
