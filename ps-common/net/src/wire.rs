//! Tensors on the wire: little-endian `f32` in `bytes` fields, split into chunks well under
//! the gRPC message limit, and the checks every received tensor goes through.
//!
//! With `[cluster] wire = "bf16"` ([`Wire::Bf16`]) the gradients a worker pushes over the
//! network are little-endian bfloat16 instead (2 bytes a value, the upper half of the f32,
//! rounded to nearest even), with error feedback on the worker ([`Bf16Encoder`]); the shard
//! widens them back to f32 as they arrive ([`TensorReceiver::on_wire`],
//! [`StreamCheck::on_wire`]). Pulls are always f32.

use ps_config::Wire;
use ps_proto::PsError;

#[cfg(target_endian = "big")]
compile_error!(
    "the wire format is little-endian f32 and is decoded by plain copies: big-endian hosts are not supported"
);
use bytes::{Bytes, BytesMut};

/// The chunk sizes, stated with the config's limits (a config default and maximum).
pub use ps_config::limits::{DEFAULT_CHUNK_BYTES, MAX_MESSAGE_BYTES};

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

/// Splits `[0, bytes.len())` into chunk-sized sub-slices (zero-copy: each is a view of `bytes`).
/// Yields `(offset in f32 values, data)`; an empty tensor yields one empty chunk so that a
/// header is always sent.
pub fn chunks(bytes: &Bytes, chunk_bytes: usize) -> impl Iterator<Item = (u64, Bytes)> + '_ {
    chunks_of(bytes, chunk_bytes, 4)
}

/// [`chunks`] for values of `value_bytes` bytes each (2 for bfloat16): offsets count values.
pub fn chunks_of(
    bytes: &Bytes,
    chunk_bytes: usize,
    value_bytes: usize,
) -> impl Iterator<Item = (u64, Bytes)> + '_ {
    let step = (chunk_bytes / value_bytes).max(1) * value_bytes;
    let n = bytes.len().div_ceil(step).max(1);
    (0..n).map(move |i| {
        let lo = i * step;
        let hi = (lo + step).min(bytes.len());
        ((lo / value_bytes) as u64, bytes.slice(lo..hi))
    })
}

/// The bfloat16 bits of `x`, rounded to nearest, ties to even. A NaN stays a (quiet) NaN with
/// its sign, infinities stay infinities, and a finite value beyond bfloat16's largest
/// (about 3.39e38) rounds to infinity as IEEE rounding does: a non-finite gradient is still
/// caught by the shard's non-finite check. Subnormals round like any other value.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    // no overflow: the largest non-NaN pattern is 0xff80_0000 (negative infinity)
    let round = 0x7fff + ((b >> 16) & 1);
    ((b + round) >> 16) as u16
}

/// The f32 that bfloat16 bits `h` stand for (exact: bfloat16 is the upper half of an f32).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Widens little-endian bfloat16 bytes into `dst` (`data.len() == 2 * dst.len()`).
pub fn decode_bf16(dst: &mut [f32], data: &[u8]) {
    assert_eq!(data.len(), dst.len() * 2, "decode_bf16: length mismatch");
    for (d, b) in dst.iter_mut().zip(data.chunks_exact(2)) {
        *d = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Decodes `data` (values on `wire`) into `dst`, which holds `data.len() / wire.value_bytes()`.
pub fn decode_wire(wire: Wire, dst: &mut [f32], data: &[u8]) {
    match wire {
        Wire::F32 => decode_le(dst, data),
        Wire::Bf16 => decode_bf16(dst, data),
    }
}

/// A worker's bfloat16 encoder for one range of the gradient, with error feedback: it sends
/// `q = bf16(g + r)` and keeps `r = (g + r) - q`, so that what rounding takes from one step
/// is given back in the next and the sum of what is sent tracks the sum of the gradients.
/// The residual lives as long as the encoder (across steps); a worker that rejoins or redoes
/// steps after a recovery starts a new one at zero. A non-finite `g + r` is sent as is (the
/// shard refuses it) and leaves a zero residual, never a NaN one.
#[derive(Debug, Default, Clone)]
pub struct Bf16Encoder {
    residual: Vec<f32>,
}

impl Bf16Encoder {
    /// An encoder with a zero residual.
    pub fn new() -> Self {
        Self::default()
    }

    /// The residual carried into the next push (empty before the first).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Forgets the residual (after a rejoin or a rollback: the steps are redone from scratch).
    pub fn reset(&mut self) {
        self.residual.clear();
    }

    /// Appends the bfloat16 bytes of `values` plus the residual to `out`, updating the
    /// residual. A residual of another length (the first push, or a new range) starts at zero.
    pub fn encode_into(&mut self, values: &[f32], out: &mut BytesMut) {
        self.encode_part_into(values, 0, values.len(), out);
    }

    /// [`Bf16Encoder::encode_into`] for the part of a range of `range_len` values that starts
    /// at value `offset` (the pieces of a push sent as backward makes them final): the part
    /// uses and updates its own values of the range's residual, so that encoding a range in
    /// parts, in any order, gives the same bytes and residual as encoding it whole. A residual
    /// of another length starts at zero.
    pub fn encode_part_into(
        &mut self,
        values: &[f32],
        offset: usize,
        range_len: usize,
        out: &mut BytesMut,
    ) {
        assert!(
            offset + values.len() <= range_len,
            "a part at {offset} of {} values inside a range of {range_len}",
            values.len()
        );
        if self.residual.len() != range_len {
            self.residual.clear();
            self.residual.resize(range_len, 0.0);
        }
        let residual = &mut self.residual[offset..offset + values.len()];
        let at = out.len();
        out.resize(at + values.len() * 2, 0);
        let dst = &mut out[at..];
        // branch-free per value (the compiler vectorises it): the same results as
        // `f32_to_bf16`, and a zero residual where `g + r` is not finite
        for ((&g, r), o) in values
            .iter()
            .zip(residual.iter_mut())
            .zip(dst.chunks_exact_mut(2))
        {
            let v = g + *r;
            let b = v.to_bits();
            let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
            let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
            let q = if nan { (b >> 16) | 0x0040 } else { rounded } as u16;
            let back = f32::from_bits(u32::from(q) << 16);
            let finite = (b & 0x7f80_0000) != 0x7f80_0000;
            *r = if finite { v - back } else { 0.0 };
            o.copy_from_slice(&q.to_le_bytes());
        }
    }

    /// Encodes `values` into `buf`, reusing its allocation when nobody else holds it (as
    /// [`f32_to_bytes_reusing`]).
    pub fn encode_reusing(&mut self, values: &[f32], buf: Option<Bytes>) -> Bytes {
        self.encode_part_reusing(values, 0, values.len(), buf)
    }

    /// [`Bf16Encoder::encode_part_into`] into `buf`, reusing its allocation when nobody else
    /// holds it.
    pub fn encode_part_reusing(
        &mut self,
        values: &[f32],
        offset: usize,
        range_len: usize,
        buf: Option<Bytes>,
    ) -> Bytes {
        let mut b = match buf.map(Bytes::try_into_mut) {
            Some(Ok(mut b)) => {
                b.clear();
                b
            }
            _ => BytesMut::with_capacity(values.len() * 2),
        };
        self.encode_part_into(values, offset, range_len, &mut b);
        b.freeze()
    }
}

/// What a worker sends for one range of its gradient on `wire`: f32 bytes, or bfloat16 bytes
/// through `encoder` (error feedback). Reuses `buf` when it can.
pub fn encode_push(
    wire: Wire,
    values: &[f32],
    encoder: &mut Bf16Encoder,
    buf: Option<Bytes>,
) -> Bytes {
    match wire {
        Wire::F32 => f32_to_bytes_reusing(values, buf),
        Wire::Bf16 => encoder.encode_reusing(values, buf),
    }
}

/// [`encode_push`] for the part of a range of `range_len` values that starts at value
/// `offset` (a piece of a progressive push): bfloat16 parts use their own values of the
/// range's residual ([`Bf16Encoder::encode_part_into`]).
pub fn encode_push_part(
    wire: Wire,
    values: &[f32],
    offset: usize,
    range_len: usize,
    encoder: &mut Bf16Encoder,
    buf: Option<Bytes>,
) -> Bytes {
    match wire {
        Wire::F32 => f32_to_bytes_reusing(values, buf),
        Wire::Bf16 => encoder.encode_part_reusing(values, offset, range_len, buf),
    }
}

/// The "multiple of" error of a chunk that is not whole values on `wire`.
pub fn not_whole(offset: u64, got: usize, wire: Wire) -> PsError {
    PsError::BadChunk(format!(
        "chunk at offset {offset} holds {got} bytes: expected a multiple of {} ({})",
        wire.value_bytes(),
        describe_wire(wire)
    ))
}

/// The values' encoding on `wire`, in words.
pub fn describe_wire(wire: Wire) -> &'static str {
    match wire {
        Wire::F32 => "little-endian f32",
        Wire::Bf16 => "little-endian bfloat16: [cluster] wire = \"bf16\"",
    }
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
    wire: Wire,
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
            wire: Wire::F32,
        }
    }

    /// Expects the values encoded as `wire` says (f32 unless told).
    pub fn on_wire(mut self, wire: Wire) -> Self {
        self.wire = wire;
        self
    }

    /// Appends one chunk that claims to start at value `offset` (a plain copy).
    pub fn push(&mut self, offset: u64, data: &[u8]) -> Result<(), PsError> {
        let at = self.values.len();
        if offset != at as u64 {
            return Err(PsError::BadChunk(format!(
                "chunk at offset {offset}: expected offset {at} (chunks must be contiguous and in order)"
            )));
        }
        let vb = self.wire.value_bytes();
        if !data.len().is_multiple_of(vb) {
            return Err(not_whole(offset, data.len(), self.wire));
        }
        let end = at.saturating_add(data.len() / vb);
        if end > self.filled {
            return Err(PsError::WrongLength {
                expected: self.filled as u64,
                got: end as u64,
            });
        }
        self.values.resize(end, 0.0);
        decode_wire(self.wire, &mut self.values[at..end], data);
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
    lanes: [u32; FP_LANES],
    bad: Option<(u64, f32)>,
    wire: Wire,
}

/// The fingerprint of a tensor: value `i`'s bits go into lane `i % FP_LANES`, a 32-bit
/// multiplicative hash (`lane = (lane ^ bits) * FP_K32`: a bijection of the lane for each value
/// and of the value for each lane, so two tensors that differ in one value always differ in
/// that lane), and the lanes are folded into 64 bits with the length (bijective in each lane
/// too). Thirty-two 32-bit lanes vectorise (eight per AVX2 multiply): the check runs at memory
/// speed, where 64-bit lanes needed a scalar multiply per value.
const FP_LANES: usize = 32;
const FP_K32: u32 = 0x9E37_79B1;
const FP_SEED32: u32 = 0x811C_9DC5;
const FP_K: u64 = 0x9E37_79B9_7F4A_7C15;
const NON_FINITE_EXP: u32 = 0x7f80_0000;

/// Folds the lanes of a fingerprint of `len` values into 64 bits.
fn fp_finish(len: usize, lanes: &[u32; FP_LANES]) -> u64 {
    lanes.iter().fold(len as u64, |h, &l| {
        (h ^ u64::from(l)).wrapping_mul(FP_K).rotate_left(29)
    })
}

/// Absorbs whole blocks of `FP_LANES` values (value `j` of a block into lane `j`); returns
/// whether any of them is NaN or infinite. Straight-line lanes, so that it vectorises.
#[inline(always)]
fn fp_blocks_portable(lanes: &mut [u32; FP_LANES], values: &[f32]) -> bool {
    let mut bad = 0u32;
    for block in values.chunks_exact(FP_LANES) {
        for (lane, v) in lanes.iter_mut().zip(block) {
            let bits = v.to_bits();
            bad |= u32::from(bits & NON_FINITE_EXP == NON_FINITE_EXP);
            *lane = (*lane ^ bits).wrapping_mul(FP_K32);
        }
    }
    bad != 0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fp_blocks_avx2(lanes: &mut [u32; FP_LANES], values: &[f32]) -> bool {
    fp_blocks_portable(lanes, values)
}

/// [`fp_blocks_portable`] with AVX2 where the CPU has it (the same lanes, the same result).
fn fp_blocks(lanes: &mut [u32; FP_LANES], values: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { fp_blocks_avx2(lanes, values) };
    }
    fp_blocks_portable(lanes, values)
}

impl StreamCheck {
    /// Expects `len` values.
    pub fn new(len: usize) -> Self {
        Self {
            len,
            at: 0,
            lanes: [FP_SEED32; FP_LANES],
            bad: None,
            wire: Wire::F32,
        }
    }

    /// Expects the values encoded as `wire` says (f32 unless told); the fingerprint is that
    /// of the widened f32 values, as a [`TensorReceiver`] on the same wire computes it.
    pub fn on_wire(mut self, wire: Wire) -> Self {
        self.wire = wire;
        self
    }

    /// Takes one chunk that claims to start at value `offset`.
    pub fn push(&mut self, offset: u64, data: &[u8]) -> Result<(), PsError> {
        if offset != self.at as u64 {
            return Err(PsError::BadChunk(format!(
                "chunk at offset {offset}: expected offset {} (chunks must be contiguous and in order)",
                self.at
            )));
        }
        let vb = self.wire.value_bytes();
        if !data.len().is_multiple_of(vb) {
            return Err(not_whole(offset, data.len(), self.wire));
        }
        let end = self.at.saturating_add(data.len() / vb);
        if end > self.len {
            return Err(PsError::WrongLength {
                expected: self.len as u64,
                got: end as u64,
            });
        }
        for (i, b) in data.chunks_exact(vb).enumerate() {
            let bits = match self.wire {
                Wire::F32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                Wire::Bf16 => u32::from(u16::from_le_bytes([b[0], b[1]])) << 16,
            };
            let idx = self.at + i;
            if bits & NON_FINITE_EXP == NON_FINITE_EXP && self.bad.is_none() {
                self.bad = Some((idx as u64, f32::from_bits(bits)));
            }
            let lane = &mut self.lanes[idx % FP_LANES];
            *lane = (*lane ^ bits).wrapping_mul(FP_K32);
        }
        self.at = end;
        Ok(())
    }

    /// Takes values already decoded (widened from bfloat16 on that wire) that claim to start
    /// at value `offset`: the same as [`StreamCheck::push`] of their encoded bytes.
    /// The values whose lanes line up with blocks of `FP_LANES` go through the vectorised
    /// [`fp_blocks`] (as [`check_and_fingerprint`] does), the others one by one.
    pub fn push_values(&mut self, offset: u64, values: &[f32]) -> Result<(), PsError> {
        let head = ((FP_LANES - self.at % FP_LANES) % FP_LANES).min(values.len());
        self.push_f32(offset, &values[..head])?;
        let body = (values.len() - head) / FP_LANES * FP_LANES;
        if body > 0 {
            let end = self.at + body;
            if end > self.len {
                return Err(PsError::WrongLength {
                    expected: self.len as u64,
                    got: end as u64,
                });
            }
            let blocks = &values[head..head + body];
            // self.at is a multiple of FP_LANES here: value j of each block goes to lane j
            if fp_blocks(&mut self.lanes, blocks) && self.bad.is_none() {
                self.bad = blocks
                    .iter()
                    .position(|v| !v.is_finite())
                    .map(|i| ((self.at + i) as u64, blocks[i]));
            }
            self.at = end;
        }
        self.push_f32(self.at as u64, &values[head + body..])
    }

    /// [`StreamCheck::push`] of `values` as f32 bytes.
    fn push_f32(&mut self, offset: u64, values: &[f32]) -> Result<(), PsError> {
        let saved = self.wire;
        self.wire = Wire::F32;
        let r = self.push(offset, as_le_bytes(values));
        self.wire = saved;
        r
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
        Ok(fp_finish(self.len, &self.lanes))
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

/// Rejects NaN and infinities and returns a 64-bit fingerprint of the values' bits (see
/// [`FP_LANES`]), in one vectorised pass (near memory speed).
pub fn check_and_fingerprint(values: &[f32]) -> Result<u64, PsError> {
    let mut lanes = [FP_SEED32; FP_LANES];
    let whole = values.len() - values.len() % FP_LANES;
    let mut bad = fp_blocks(&mut lanes, &values[..whole]);
    for (lane, v) in lanes.iter_mut().zip(&values[whole..]) {
        let bits = v.to_bits();
        bad |= bits & NON_FINITE_EXP == NON_FINITE_EXP;
        *lane = (*lane ^ bits).wrapping_mul(FP_K32);
    }
    if bad {
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
    Ok(fp_finish(values.len(), &lanes))
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
    fn the_vectorised_fingerprint_sees_every_value_and_every_non_finite() {
        let v: Vec<f32> = (0..4099).map(|i| (i as f32 * 0.37).sin()).collect();
        let whole = v.len() - v.len() % FP_LANES;
        let (mut a, mut b) = ([FP_SEED32; FP_LANES], [FP_SEED32; FP_LANES]);
        assert!(!fp_blocks(&mut a, &v[..whole]));
        assert!(!fp_blocks_portable(&mut b, &v[..whole]));
        assert_eq!(a, b, "the dispatched and the portable pass agree");
        let fp = check_and_fingerprint(&v).unwrap();
        for i in [0, 31, 32, 2047, whole - 1, whole, v.len() - 1] {
            let mut w = v.clone();
            w[i] = f32::from_bits(w[i].to_bits() ^ 1);
            assert_ne!(check_and_fingerprint(&w).unwrap(), fp, "value {i} counts");
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                w[i] = bad;
                match check_and_fingerprint(&w) {
                    Err(PsError::NonFinite { index, .. }) => assert_eq!(index, i as u64),
                    other => panic!("{bad} at {i}: {other:?}"),
                }
            }
        }
        assert_ne!(
            check_and_fingerprint(&v[..v.len() - 1]).unwrap(),
            check_and_fingerprint(&v).unwrap(),
            "the length counts"
        );
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

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // exact values pass unchanged
        for x in [0.0f32, -0.0, 1.0, -2.5, 0.15625, 3.0e38, -1.0e-30] {
            let h = f32_to_bf16(x);
            if x.to_bits() & 0xffff == 0 {
                assert_eq!(bf16_to_f32(h).to_bits(), x.to_bits(), "{x}");
            }
        }
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0)
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        // just above and below a tie
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_7fff)), 0x3f81);
        // negative ties are symmetric
        assert_eq!(f32_to_bf16(f32::from_bits(0xbf80_8000)), 0xbf80);
        assert_eq!(f32_to_bf16(f32::from_bits(0xbf81_8000)), 0xbf82);
        // a carry into the exponent: the largest mantissa rounds up to the next power of two
        assert_eq!(f32_to_bf16(f32::from_bits(0x3fff_ff00)), 0x4000);
        // nearest, not truncation: 1.0078125 - tiny rounds to 1.0078125
        let x = 1.0078125f32 - 1e-6;
        assert_eq!(bf16_to_f32(f32_to_bf16(x)), 1.0078125);
    }

    #[test]
    fn bf16_subnormals_infinities_and_nan() {
        // the smallest f32 subnormal is below half the smallest bf16 subnormal: to zero, signed
        assert_eq!(f32_to_bf16(f32::from_bits(1)), 0x0000);
        assert_eq!(f32_to_bf16(f32::from_bits(0x8000_0001)), 0x8000);
        // a bf16 subnormal is exact; a halfway subnormal ties to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x0001_0000)), 0x0001);
        assert_eq!(bf16_to_f32(0x0001).to_bits(), 0x0001_0000);
        assert_eq!(f32_to_bf16(f32::from_bits(0x0001_8000)), 0x0002);
        assert_eq!(f32_to_bf16(f32::from_bits(0x0000_8000)), 0x0000);
        // the largest subnormal rounds up to the smallest normal
        assert_eq!(f32_to_bf16(f32::from_bits(0x007f_ffff)), 0x0080);
        assert!(bf16_to_f32(0x0080).is_normal());
        // infinities stay; the largest finite f32 rounds to infinity (beyond bf16's range)
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16(f32::NEG_INFINITY), 0xff80);
        assert_eq!(bf16_to_f32(f32_to_bf16(f32::MAX)), f32::INFINITY);
        assert_eq!(bf16_to_f32(f32_to_bf16(-f32::MAX)), f32::NEG_INFINITY);
        // bf16's largest finite value stays finite
        assert_eq!(
            bf16_to_f32(f32_to_bf16(f32::from_bits(0x7f7f_0000))),
            f32::from_bits(0x7f7f_0000)
        );
        // every NaN stays a NaN, even one whose payload is only in the low half (truncation
        // would make it an infinity), and keeps its sign
        for bits in [
            0x7fc0_0000u32,
            0x7f80_0001,
            0xff80_0001,
            0x7fff_ffff,
            0xffff_ffff,
        ] {
            let h = f32_to_bf16(f32::from_bits(bits));
            let back = bf16_to_f32(h);
            assert!(back.is_nan(), "{bits:#x} -> {h:#x}");
            assert_eq!(back.is_sign_negative(), bits >> 31 == 1);
        }
    }

    #[test]
    fn bf16_parts_in_any_order_encode_as_the_whole_range() {
        let mut whole = Bf16Encoder::new();
        let mut parts = Bf16Encoder::new();
        for step in 0..3 {
            let g: Vec<f32> = (0..1000)
                .map(|i| ((i * (step + 1)) as f32 * 0.37).sin() * 1e-3 + 1.0)
                .collect();
            let want = whole.encode_reusing(&g, None);
            // last part first, as backward makes them final
            let mut got = vec![0u8; 2000];
            for (a, b) in [(700, 1000), (300, 700), (0, 300)] {
                let p = encode_push_part(Wire::Bf16, &g[a..b], a, 1000, &mut parts, None);
                got[2 * a..2 * b].copy_from_slice(&p);
            }
            assert_eq!(&got[..], &want[..], "step {step}");
            assert_eq!(parts.residual(), whole.residual(), "step {step}");
            // the check of decoded values is the check of the bytes
            let mut decoded = vec![0f32; 1000];
            decode_bf16(&mut decoded, &want);
            let mut a = StreamCheck::new(1000).on_wire(Wire::Bf16);
            a.push(0, &want[..600]).unwrap();
            a.push(300, &want[600..]).unwrap();
            let mut b = StreamCheck::new(1000).on_wire(Wire::Bf16);
            b.push(0, &want[..600]).unwrap();
            b.push_values(300, &decoded[300..]).unwrap();
            let fp = a.finish().unwrap();
            assert_eq!(b.finish().unwrap(), fp);
            assert_eq!(check_and_fingerprint(&decoded).unwrap(), fp);
        }
        let f = encode_push_part(Wire::F32, &[1.5, -2.0], 7, 9, &mut parts, None);
        assert_eq!(&f[..], as_le_bytes(&[1.5, -2.0]));
    }

    #[test]
    fn bf16_error_feedback_carries_the_rounding() {
        let g: Vec<f32> = (0..1000)
            .map(|i| ((i as f32) * 0.37).sin() * 1e-3 + 1.0)
            .collect();
        let mut enc = Bf16Encoder::new();
        let mut sent_sum = vec![0f64; g.len()];
        let steps = 50;
        for _ in 0..steps {
            let b = enc.encode_reusing(&g, None);
            assert_eq!(b.len(), 2 * g.len(), "2 bytes a value");
            let mut q = vec![0f32; g.len()];
            decode_bf16(&mut q, &b);
            for (s, v) in sent_sum.iter_mut().zip(&q) {
                *s += f64::from(*v);
            }
        }
        // without feedback each step would lose up to 2^-9 of 1.0; with it, the sum of what was
        // sent differs from the sum of the gradients by at most one residual (half a unit)
        for ((s, &v), r) in sent_sum.iter().zip(&g).zip(enc.residual()) {
            let want = f64::from(v) * steps as f64;
            assert!((s - want).abs() <= 2f64.powi(-8), "{s} vs {want}");
            assert!(
                (s + f64::from(*r) - want).abs() < 1e-4,
                "sum + residual = sum of g"
            );
            assert!(r.abs() <= 2f32.powi(-8));
        }
        // a buffer nobody else holds is reused
        let b = enc.encode_reusing(&g, None);
        let ptr = b.as_ptr();
        let again = enc.encode_reusing(&g, Some(b));
        assert_eq!(again.as_ptr(), ptr);
        // a non-finite value goes out non-finite and leaves a zero residual
        let mut bad = g.clone();
        bad[3] = f32::NAN;
        bad[4] = f32::INFINITY;
        let b = enc.encode_reusing(&bad, None);
        let mut q = vec![0f32; g.len()];
        decode_bf16(&mut q, &b);
        assert!(q[3].is_nan() && q[4] == f32::INFINITY);
        // the encoder's rounding is f32_to_bf16's, specials included
        let specials = [
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x0001_8000),
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xff80_0001),
            f32::MAX,
            f32::NEG_INFINITY,
            -1.5,
        ];
        let b = Bf16Encoder::new().encode_reusing(&specials, None);
        for (i, x) in specials.iter().enumerate() {
            assert_eq!(
                u16::from_le_bytes([b[2 * i], b[2 * i + 1]]),
                f32_to_bf16(*x),
                "{x}"
            );
        }
        assert_eq!(enc.residual()[3], 0.0);
        assert_eq!(enc.residual()[4], 0.0);
        enc.reset();
        assert!(enc.residual().is_empty());
    }

    #[test]
    fn bf16_receivers_widen_check_and_fingerprint_alike() {
        let v: Vec<f32> = (0..1003).map(|i| i as f32 * 0.25 - 9.0).collect();
        let mut enc = Bf16Encoder::new();
        let b = enc.encode_reusing(&v, None);
        let mut want = vec![0f32; v.len()];
        decode_bf16(&mut want, &b);
        let fp = check_and_fingerprint(&want).unwrap();
        for chunk in [2, 6, 100, 4096] {
            let mut rx = TensorReceiver::new(v.len(), true).on_wire(Wire::Bf16);
            let mut s = StreamCheck::new(v.len()).on_wire(Wire::Bf16);
            for (off, data) in chunks_of(&b, chunk, 2) {
                rx.push(off, &data).unwrap();
                s.push(off, &data).unwrap();
            }
            let (got, rfp) = rx.finish().unwrap();
            assert_eq!(got, want);
            assert_eq!(rfp, fp, "chunks of {chunk} bytes");
            assert_eq!(s.finish().unwrap(), fp, "chunks of {chunk} bytes");
        }
        // f32 bytes where bf16 is expected: twice the values, said as a wrong length
        let f = f32_to_bytes(&v);
        let mut rx = TensorReceiver::new(v.len(), true).on_wire(Wire::Bf16);
        assert!(matches!(
            rx.push(0, &f),
            Err(PsError::WrongLength {
                expected: 1003,
                got: 2006
            })
        ));
        let mut s = StreamCheck::new(v.len()).on_wire(Wire::Bf16);
        assert!(matches!(s.push(0, &f), Err(PsError::WrongLength { .. })));
        // an odd byte count names the encoding
        let mut rx = TensorReceiver::new(v.len(), true).on_wire(Wire::Bf16);
        let e = rx.push(0, &b[..5]).unwrap_err().to_string();
        assert!(
            e.contains("expected a multiple of 2") && e.contains("bfloat16"),
            "{e}"
        );
        // a NaN sent as bf16 is caught with its index
        let mut bad = v.clone();
        bad[700] = f32::NAN;
        let b = Bf16Encoder::new().encode_reusing(&bad, None);
        let mut rx = TensorReceiver::new(v.len(), true).on_wire(Wire::Bf16);
        rx.push(0, &b).unwrap();
        assert!(matches!(
            rx.finish(),
            Err(PsError::NonFinite { index: 700, .. })
        ));
        let mut s = StreamCheck::new(v.len()).on_wire(Wire::Bf16);
        s.push(0, &b).unwrap();
        assert!(matches!(
            s.finish(),
            Err(PsError::NonFinite { index: 700, .. })
        ));
    }
}
