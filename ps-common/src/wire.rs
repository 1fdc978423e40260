//! Tensors on the wire: little-endian `f32` in `bytes` fields, split into chunks well under
//! the gRPC message limit, and the checks every received tensor goes through.

use crate::error::PsError;
use bytes::Bytes;

/// Default payload per chunk: 1 MiB streams well over HTTP/2 (DEPENDENCIES.md §3).
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;

/// Largest gRPC message either side accepts; chunks stay far below it.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Encodes `values` as little-endian bytes (one copy).
pub fn f32_to_bytes(values: &[f32]) -> Bytes {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    Bytes::from(out)
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
/// (chunks must arrive in order, without gaps or overlaps), finiteness, and the total; keeps a
/// 64-bit fingerprint of the bytes so that a retried push can be recognised.
#[derive(Debug)]
pub struct TensorReceiver {
    values: Vec<f32>,
    len: usize,
    check_finite: bool,
    fingerprint: u64,
}

impl TensorReceiver {
    /// Expects `len` values; `check_finite` rejects NaN and infinities (gradients).
    pub fn new(len: usize, check_finite: bool) -> Self {
        Self {
            values: Vec::with_capacity(len),
            len,
            check_finite,
            fingerprint: 0xcbf2_9ce4_8422_2325,
        }
    }

    /// Appends one chunk that claims to start at value `offset`.
    pub fn push(&mut self, offset: u64, data: &[u8]) -> Result<(), PsError> {
        let have = self.values.len();
        if offset != have as u64 {
            return Err(PsError::BadChunk(format!(
                "chunk at offset {offset}: expected offset {have} (chunks must be contiguous and in order)"
            )));
        }
        if !data.len().is_multiple_of(4) {
            return Err(PsError::BadChunk(format!(
                "chunk at offset {offset} holds {} bytes: expected a multiple of 4 (little-endian f32)",
                data.len()
            )));
        }
        let count = data.len() / 4;
        if have + count > self.len {
            return Err(PsError::WrongLength {
                expected: self.len as u64,
                got: (have + count) as u64,
            });
        }
        let mut h = self.fingerprint;
        let mut bad = None;
        for (i, w) in data.chunks_exact(4).enumerate() {
            let bits = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            let v = f32::from_bits(bits);
            if self.check_finite && !v.is_finite() && bad.is_none() {
                bad = Some((have + i, v));
            }
            h = (h ^ u64::from(bits)).wrapping_mul(0x0000_0100_0000_01B3);
            self.values.push(v);
        }
        if let Some((index, value)) = bad {
            self.values.truncate(have);
            return Err(PsError::NonFinite {
                index: index as u64,
                value,
            });
        }
        self.fingerprint = h;
        Ok(())
    }

    /// The complete tensor and its fingerprint, or the error saying how short it is.
    pub fn finish(self) -> Result<(Vec<f32>, u64), PsError> {
        if self.values.len() != self.len {
            return Err(PsError::WrongLength {
                expected: self.len as u64,
                got: self.values.len() as u64,
            });
        }
        Ok((self.values, self.fingerprint))
    }
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
        assert!(matches!(
            rx.push(0, &b),
            Err(PsError::NonFinite { index: 1, .. })
        ));
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
}
