//! Tensors on the wire: little-endian `f32` in `bytes` fields, split into chunks well under
//! the gRPC message limit, and the checks every received tensor goes through.

use crate::error::PsError;

#[cfg(target_endian = "big")]
compile_error!(
    "the wire format is little-endian f32 and is decoded by plain copies: big-endian hosts are not supported"
);
use bytes::Bytes;

/// Default payload per chunk: 1 MiB streams well over HTTP/2: a chunk is about one frame of
/// [`crate::client::MAX_FRAME_BYTES`], eight fit in the stream window
/// ([`crate::client::STREAM_WINDOW_BYTES`]), and gRPC's per-message cost is negligible beside
/// it, while a whole tensor in one message would be copied and held at once on both sides.
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;

/// Largest gRPC message either side accepts; chunks stay far below it.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Encodes `values` as little-endian bytes (one copy).
pub fn f32_to_bytes(values: &[f32]) -> Bytes {
    Bytes::copy_from_slice(as_le_bytes(values))
}

/// The little-endian bytes of `values`, borrowed (a plain view: hosts are little-endian).
pub fn as_le_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8; the length and the
    // lifetime are those of `values`, and u8 has alignment 1.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// Decodes little-endian `f32` bytes into `dst` (same number of values: `data.len() == 4 * dst.len()`).
pub fn decode_le(dst: &mut [f32], data: &[u8]) {
    assert_eq!(data.len(), dst.len() * 4, "decode_le: length mismatch");
    // SAFETY: as in `as_le_bytes`, viewed mutably: any bytes form a valid f32 bit pattern.
    let out = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), data.len()) };
    out.copy_from_slice(data);
}

/// Writes one received chunk at value `offset` of `dst`, checking that it is whole values and
/// fits: the building block of pulls that decode straight into the weights.
pub fn decode_chunk_into(dst: &mut [f32], offset: u64, data: &[u8]) -> Result<(), PsError> {
    if !data.len().is_multiple_of(4) {
        return Err(PsError::BadChunk(format!(
            "chunk at offset {offset} holds {} bytes: expected a multiple of 4 (little-endian f32)",
            data.len()
        )));
    }
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    let end = start.saturating_add(data.len() / 4);
    if end > dst.len() {
        return Err(PsError::WrongLength {
            expected: dst.len() as u64,
            got: end as u64,
        });
    }
    decode_le(&mut dst[start..end], data);
    Ok(())
}

/// Splits `[0, bytes.len())` into chunk-sized sub-slices (zero-copy: each is a view of `bytes`).
/// Yields `(offset in f32 values, data)`; an empty tensor yields one empty chunk so that a
/// header is always sent.
pub fn chunks(bytes: &Bytes, chunk_bytes: usize) -> impl Iterator<Item = (u64, Bytes)> + '_ {
    let step = (chunk_bytes / 4).max(1) * 4;
    let n = bytes.len().div_ceil(step).max(1);
    (0..n).map(move |i| {
        let lo = i * step;
        let hi = (lo + step).min(bytes.len());
        ((lo / 4) as u64, bytes.slice(lo..hi))
    })
}

/// Receives a tensor of exactly `len` values chunk by chunk, checking each chunk's offset
/// (chunks must arrive in order, without gaps or overlaps) and the total; when validating
/// (gradients), [`TensorReceiver::finish`] also rejects non-finite values and computes a
/// 64-bit fingerprint of the bytes so that a retried push can be recognised.
#[derive(Debug)]
pub struct TensorReceiver {
    values: Vec<f32>,
    /// The expected length.
    filled: usize,
    validate: bool,
}

impl TensorReceiver {
    /// Expects `len` values; `validate` checks finiteness and fingerprints (gradients).
    pub fn new(len: usize, validate: bool) -> Self {
        Self::with_buffer(Vec::new(), len, validate)
    }

    /// Like [`TensorReceiver::new`], decoding into a recycled buffer (no allocation and no
    /// page faults on the hot path when its capacity suffices).
    /// The buffer's memory is reserved as the data arrives: a new buffer's pages are written
    /// (and become resident) chunk by chunk, never before.
    pub fn with_buffer(mut values: Vec<f32>, len: usize, validate: bool) -> Self {
        values.clear();
        values.reserve_exact(len);
        Self {
            values,
            filled: len,
            validate,
        }
    }

    /// Appends one chunk that claims to start at value `offset` (a plain copy).
    pub fn push(&mut self, offset: u64, data: &[u8]) -> Result<(), PsError> {
        let at = self.values.len();
        if offset != at as u64 {
            return Err(PsError::BadChunk(format!(
                "chunk at offset {offset}: expected offset {at} (chunks must be contiguous and in order)"
            )));
        }
        if !data.len().is_multiple_of(4) {
            return Err(PsError::BadChunk(format!(
                "chunk at offset {offset} holds {} bytes: expected a multiple of 4 (little-endian f32)",
                data.len()
            )));
        }
        let end = at.saturating_add(data.len() / 4);
        if end > self.filled {
            return Err(PsError::WrongLength {
                expected: self.filled as u64,
                got: end as u64,
            });
        }
        self.values.resize(end, 0.0);
        decode_le(&mut self.values[at..end], data);
        Ok(())
    }

    /// The complete tensor and its fingerprint (0 when not validating), or the error saying
    /// how short it is or where the first non-finite value is.
    pub fn finish(self) -> Result<(Vec<f32>, u64), PsError> {
        if self.filled != self.values.len() {
            return Err(PsError::WrongLength {
                expected: self.filled as u64,
                got: self.values.len() as u64,
            });
        }
        let fp = if self.validate {
            check_and_fingerprint(&self.values)?
        } else {
            0
        };
        Ok((self.values, fp))
    }

    /// Gives the buffer back (after an error), for reuse.
    pub fn into_buffer(self) -> Vec<f32> {
        self.values
    }
}

/// Checks a gradient as it streams in, keeping nothing: the same offsets, length and
/// finiteness checks as a validating [`TensorReceiver`], and the same fingerprint as
/// [`check_and_fingerprint`] of the whole, so that a push the shard does not need to keep (a
/// retry) is recognised without a buffer.
#[derive(Debug)]
pub struct StreamCheck {
    len: usize,
    at: usize,
    lanes: [u64; 8],
    bad: Option<(u64, f32)>,
}

const FP_K: u64 = 0x9E37_79B9_7F4A_7C15;
const FP_SEED: u64 = 0xcbf2_9ce4_8422_2325;

impl StreamCheck {
    /// Expects `len` values.
    pub fn new(len: usize) -> Self {
        Self {
            len,
            at: 0,
            lanes: [FP_SEED; 8],
            bad: None,
        }
    }

    /// Takes one chunk that claims to start at value `offset`.
    pub fn push(&mut self, offset: u64, data: &[u8]) -> Result<(), PsError> {
        if offset != self.at as u64 {
            return Err(PsError::BadChunk(format!(
                "chunk at offset {offset}: expected offset {} (chunks must be contiguous and in order)",
                self.at
            )));
        }
        if !data.len().is_multiple_of(4) {
            return Err(PsError::BadChunk(format!(
                "chunk at offset {offset} holds {} bytes: expected a multiple of 4 (little-endian f32)",
                data.len()
            )));
        }
        let end = self.at.saturating_add(data.len() / 4);
        if end > self.len {
            return Err(PsError::WrongLength {
                expected: self.len as u64,
                got: end as u64,
            });
        }
        for (i, b) in data.chunks_exact(4).enumerate() {
            let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let idx = self.at + i;
            if bits & 0x7f80_0000 == 0x7f80_0000 && self.bad.is_none() {
                self.bad = Some((idx as u64, f32::from_bits(bits)));
            }
            let lane = &mut self.lanes[idx % 8];
            *lane = (*lane ^ u64::from(bits)).wrapping_mul(FP_K);
        }
        self.at = end;
        Ok(())
    }

    /// The fingerprint, or what is wrong with the whole.
    pub fn finish(self) -> Result<u64, PsError> {
        if self.at != self.len {
            return Err(PsError::WrongLength {
                expected: self.len as u64,
                got: self.at as u64,
            });
        }
        if let Some((index, value)) = self.bad {
            return Err(PsError::NonFinite { index, value });
        }
        Ok(self.lanes.iter().fold(self.len as u64, |h, &l| {
            (h ^ l).wrapping_mul(FP_K).rotate_left(29)
        }))
    }
}

/// Encodes `values` into `buf`, reusing its allocation when nobody else holds it (a push
/// buffer whose RPC has finished), else a fresh allocation.
pub fn f32_to_bytes_reusing(values: &[f32], buf: Option<Bytes>) -> Bytes {
    match buf.map(Bytes::try_into_mut) {
        Some(Ok(mut b)) => {
            b.clear();
            b.extend_from_slice(as_le_bytes(values));
            b.freeze()
        }
        _ => f32_to_bytes(values),
    }
}

/// Rejects NaN and infinities and returns a 64-bit fingerprint of the values' bits, in one
/// pass of eight independent lanes over blocks of eight values (near memory speed).
pub fn check_and_fingerprint(values: &[f32]) -> Result<u64, PsError> {
    const EXP: u32 = 0x7f80_0000;
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut lanes = [0xcbf2_9ce4_8422_2325u64; 8];
    let mut bad = 0u32;
    let mut blocks = values.chunks_exact(8);
    for block in &mut blocks {
        for (lane, v) in lanes.iter_mut().zip(block) {
            let bits = v.to_bits();
            bad |= u32::from(bits & EXP == EXP);
            *lane = (*lane ^ u64::from(bits)).wrapping_mul(K);
        }
    }
    for (lane, v) in lanes.iter_mut().zip(blocks.remainder()) {
        let bits = v.to_bits();
        bad |= u32::from(bits & EXP == EXP);
        *lane = (*lane ^ u64::from(bits)).wrapping_mul(K);
    }
    if bad != 0 {
        let (index, value) = values
            .iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite())
            .expect("a non-finite value");
        return Err(PsError::NonFinite {
            index: index as u64,
            value: *value,
        });
    }
    Ok(lanes.iter().fold(values.len() as u64, |h, &l| {
        (h ^ l).wrapping_mul(K).rotate_left(29)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_through_chunks() {
        let v: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let b = f32_to_bytes(&v);
        let mut rx = TensorReceiver::new(v.len(), true);
        let mut n = 0;
        for (off, data) in chunks(&b, 1000) {
            rx.push(off, &data).unwrap();
            n += 1;
        }
        assert_eq!(n, 4);
        let (back, fp) = rx.finish().unwrap();
        assert_eq!(back, v);
        let mut rx2 = TensorReceiver::new(v.len(), true);
        rx2.push(0, &b).unwrap();
        assert_eq!(
            rx2.finish().unwrap().1,
            fp,
            "fingerprint does not depend on chunking"
        );
    }

    #[test]
    fn rejects_gaps_nan_and_wrong_lengths() {
        let b = f32_to_bytes(&[1.0, f32::NAN, 3.0]);
        let mut rx = TensorReceiver::new(3, true);
        rx.push(0, &b).unwrap();
        assert!(matches!(
            rx.finish(),
            Err(PsError::NonFinite { index: 1, .. })
        ));
        let mut a = vec![1.0f32; 20];
        let fa = check_and_fingerprint(&a).unwrap();
        a[19] = 1.5;
        assert_ne!(check_and_fingerprint(&a).unwrap(), fa, "the tail counts");
        a.swap(0, 19);
        assert_ne!(check_and_fingerprint(&a).unwrap(), fa, "positions count");
        let mut rx = TensorReceiver::new(3, true);
        assert!(matches!(rx.push(1, &b), Err(PsError::BadChunk(_))));
        let mut rx = TensorReceiver::new(2, false);
        assert!(matches!(
            rx.push(0, &b),
            Err(PsError::WrongLength {
                expected: 2,
                got: 3
            })
        ));
        let mut rx = TensorReceiver::new(4, false);
        rx.push(0, &b).unwrap();
        assert!(matches!(
            rx.finish(),
            Err(PsError::WrongLength {
                expected: 4,
                got: 3
            })
        ));
        assert_eq!(chunks(&Bytes::new(), 8).count(), 1);
    }

    #[test]
    fn stream_check_equals_the_whole_tensor_check() {
        let v: Vec<f32> = (0..1003).map(|i| i as f32 * 0.25 - 9.0).collect();
        let b = f32_to_bytes(&v);
        let want = check_and_fingerprint(&v).unwrap();
        for chunk in [4, 12, 28, 400, 4012] {
            let mut s = StreamCheck::new(v.len());
            for (off, data) in chunks(&b, chunk) {
                s.push(off, &data).unwrap();
            }
            assert_eq!(s.finish().unwrap(), want, "chunks of {chunk} bytes");
        }
        let mut bad = v.clone();
        bad[517] = f32::INFINITY;
        let mut s = StreamCheck::new(v.len());
        s.push(0, &f32_to_bytes(&bad)).unwrap();
        assert!(matches!(
            s.finish(),
            Err(PsError::NonFinite { index: 517, .. })
        ));
        let mut s = StreamCheck::new(3);
        assert!(matches!(s.push(1, &b[..4]), Err(PsError::BadChunk(_))));
        s.push(0, &b[..8]).unwrap();
        assert!(matches!(
            s.finish(),
            Err(PsError::WrongLength {
                expected: 3,
                got: 2
            })
        ));
    }
}
