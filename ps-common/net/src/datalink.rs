//! The tensor data connection: a plain TCP connection per (worker, shard) that carries the
//! values of gRPC pushes and pulls as single frames, while the requests, their answers and
//! every error stay on gRPC. On the gRPC path a tensor is copied into protobuf messages, into
//! HTTP/2 frames and out again on both sides; here the sender writes the values straight from
//! its buffer and the receiver reads them straight into its own (one copy into and one out of
//! the kernel, as raw TCP).
//!
//! - The worker opens it with a [`Hello`]: magic, rank, the token and the run id (the same
//!   credentials as its gRPC calls), and the rank's lease (its generation and id, from the
//!   registration reply); the shard answers one byte, [`HELLO_OK`] or [`HELLO_NO`] (and
//!   closes). The connection is bound to that lease: once the rank holds another, the shard
//!   refuses the connection's next frame and closes it.
//! - A push with `data_tcp` sends its header through gRPC and then one frame worker → shard:
//!   `step: u64, bytes: u64` (little-endian; `bytes`: the value bytes of the shard's whole
//!   range), then the values (little-endian f32, or bfloat16 with `[cluster] wire = "bf16"`).
//!   With [`PIECES`] set in `bytes`, the values come as one or more *pieces*, each
//!   `offset: u64, n: u64` (bytes, from the start of the range) then `n` bytes of values, so
//!   that a worker can send each part of its gradient as soon as backward has made it final.
//!   Pieces may come in any order; each must be non-empty, start and end on whole values and
//!   lie inside the range; no two may overlap; together they cover the range exactly
//!   ([`Coverage`]). Without the flag the values follow the header as one piece at offset 0
//!   (a whole-range push: retries, the Python worker).
//! - A pull with `data_tcp` gets a header through gRPC, and one frame shard → worker:
//!   `version: u64, bytes: u64`, then the values.
//!
//! Either side that sees anything unexpected on the connection (or an error in the request it
//! belongs to) drops it; the worker opens a new one for its next request. Not used with TLS:
//! the connection is not encrypted.

use ps_config::Wire;
use ps_proto::PsError;
use std::mem::MaybeUninit;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The first bytes of a hello.
pub const MAGIC: &[u8; 8] = b"PSDATA02";
/// Largest token or run id a hello may carry.
pub const MAX_HELLO_FIELD: usize = 4096;
/// The shard accepted the hello.
pub const HELLO_OK: u8 = 1;
/// The shard refused the hello (wrong token, run, rank or a malformed hello); it closes.
pub const HELLO_NO: u8 = 0;
/// Frame header bytes: a step or version, then the byte count.
pub const FRAME_HEADER: usize = 16;
/// Set in a push frame's byte count: the values come as pieces (`offset: u64, n: u64`, then
/// `n` bytes), in any order ([`Coverage`]).
pub const PIECES: u64 = 1 << 63;
/// Piece header bytes: the offset, then the byte count.
pub const PIECE_HEADER: usize = 16;
/// Most pieces one push may come in.
pub const MAX_PIECES: usize = 4096;

/// What a worker says when it opens a data connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The worker's rank.
    pub rank: u32,
    /// The token (empty without one).
    pub token: Vec<u8>,
    /// The run id (empty: the unnamed run).
    pub run_id: String,
    /// The cluster generation of the rank's lease.
    pub generation: u64,
    /// The id of the rank's lease (the registration reply's).
    pub lease: Vec<u8>,
}

impl Hello {
    /// The hello's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(24 + self.token.len() + self.run_id.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&(self.token.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.token);
        b.extend_from_slice(&(self.run_id.len() as u32).to_le_bytes());
        b.extend_from_slice(self.run_id.as_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&(self.lease.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.lease);
        b
    }

    /// The lease this hello presents.
    pub fn lease(&self) -> ps_proto::pb::Lease {
        ps_proto::pb::Lease {
            rank: self.rank,
            generation: self.generation,
            id: self.lease.clone().into(),
        }
    }

    /// Reads a hello, refusing a wrong magic or an oversized field with a precise error.
    pub async fn read<R: AsyncRead + Unpin>(r: &mut R) -> Result<Self, PsError> {
        let io = |e: std::io::Error| PsError::BadChunk(format!("data connection hello: {e}"));
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic).await.map_err(io)?;
        if &magic != MAGIC {
            return Err(PsError::BadChunk(format!(
                "data connection hello starts with {magic:02x?}: expected {:?}",
                std::str::from_utf8(MAGIC).unwrap_or_default()
            )));
        }
        let rank = r.read_u32_le().await.map_err(io)?;
        let token = read_field(r, "token").await?;
        let run = read_field(r, "run id").await?;
        let run_id = String::from_utf8(run)
            .map_err(|_| PsError::BadChunk("data connection hello: run id is not UTF-8".into()))?;
        let generation = r.read_u64_le().await.map_err(io)?;
        let lease = read_field(r, "lease").await?;
        Ok(Self {
            rank,
            token,
            run_id,
            generation,
            lease,
        })
    }
}

async fn read_field<R: AsyncRead + Unpin>(r: &mut R, what: &str) -> Result<Vec<u8>, PsError> {
    let io = |e: std::io::Error| PsError::BadChunk(format!("data connection hello: {e}"));
    let n = r.read_u32_le().await.map_err(io)? as usize;
    if n > MAX_HELLO_FIELD {
        return Err(PsError::BadChunk(format!(
            "data connection hello: {what} of {n} bytes: expected at most {MAX_HELLO_FIELD}"
        )));
    }
    let mut v = vec![0u8; n];
    r.read_exact(&mut v).await.map_err(io)?;
    Ok(v)
}

/// The header of a frame: `tag` (step or version) and the number of value bytes.
pub fn frame_header(tag: u64, bytes: u64) -> [u8; FRAME_HEADER] {
    let mut h = [0u8; FRAME_HEADER];
    h[..8].copy_from_slice(&tag.to_le_bytes());
    h[8..].copy_from_slice(&bytes.to_le_bytes());
    h
}

/// Writes one frame: the header, then `values` (little-endian f32, written from `values`).
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    tag: u64,
    values: &[u8],
) -> std::io::Result<()> {
    w.write_all(&frame_header(tag, values.len() as u64)).await?;
    w.write_all(values).await?;
    w.flush().await
}

/// Writes the header of a push frame whose values follow as pieces ([`PIECES`]): `step`, and
/// `bytes`, the value bytes of the whole range.
pub async fn write_pieces_header<W: AsyncWrite + Unpin>(
    w: &mut W,
    step: u64,
    bytes: u64,
) -> std::io::Result<()> {
    w.write_all(&frame_header(step, bytes | PIECES)).await
}

/// Writes one piece of a push frame: its header (`offset` in bytes from the start of the
/// range, the byte count), then `values`.
pub async fn write_piece<W: AsyncWrite + Unpin>(
    w: &mut W,
    offset: u64,
    values: &[u8],
) -> std::io::Result<()> {
    w.write_all(&piece_header(offset, values.len() as u64))
        .await?;
    w.write_all(values).await
}

/// Reads a frame header within `idle`, checking that it is for `tag` and holds `bytes` bytes.
pub async fn read_frame_header<R: AsyncRead + Unpin>(
    r: &mut R,
    tag: u64,
    bytes: u64,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    read_frame_header_on(r, tag, bytes, ps_config::Wire::F32, what, idle).await
}

/// [`read_frame_header`] for a frame of values encoded as `wire` says: a byte count that is
/// not the expected one is said in values for f32 ([`PsError::WrongLength`]) and in bytes,
/// naming the encoding, for bfloat16.
pub async fn read_frame_header_on<R: AsyncRead + Unpin>(
    r: &mut R,
    tag: u64,
    bytes: u64,
    wire: ps_config::Wire,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    let (got_tag, got_bytes) = read_u64_pair(r, what, idle).await?;
    check_frame_header(got_tag, got_bytes, tag, bytes, wire, what)
}

/// Reads a push frame's header within `idle` ([`read_frame_header_on`]'s checks, the byte
/// count without [`PIECES`]); true when the values come as pieces.
pub async fn read_push_header<R: AsyncRead + Unpin>(
    r: &mut R,
    step: u64,
    bytes: u64,
    wire: ps_config::Wire,
    what: &str,
    idle: Duration,
) -> Result<bool, PsError> {
    let (got_step, got_bytes) = read_u64_pair(r, what, idle).await?;
    check_frame_header(got_step, got_bytes & !PIECES, step, bytes, wire, what)?;
    Ok(got_bytes & PIECES != 0)
}

/// Two little-endian u64 (a frame or piece header), within `idle`.
async fn read_u64_pair<R: AsyncRead + Unpin>(
    r: &mut R,
    what: &str,
    idle: Duration,
) -> Result<(u64, u64), PsError> {
    let mut h = [0u8; FRAME_HEADER];
    within(idle, what, r.read_exact(&mut h)).await?;
    Ok((
        u64::from_le_bytes(h[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(h[8..].try_into().expect("8 bytes")),
    ))
}

fn check_frame_header(
    got_tag: u64,
    got_bytes: u64,
    tag: u64,
    bytes: u64,
    wire: ps_config::Wire,
    what: &str,
) -> Result<(), PsError> {
    if got_tag != tag {
        return Err(PsError::BadChunk(format!(
            "{what}: a frame for {got_tag} of {got_bytes} bytes: expected {tag} of {bytes} bytes"
        )));
    }
    if got_bytes != bytes {
        if wire == ps_config::Wire::F32 && got_bytes.is_multiple_of(4) && bytes.is_multiple_of(4) {
            return Err(PsError::WrongLength {
                expected: bytes / 4,
                got: got_bytes / 4,
            });
        }
        return Err(PsError::BadChunk(format!(
            "{what}: a frame of {got_bytes} bytes: expected {bytes} bytes ({} values, {})",
            bytes / wire.value_bytes() as u64,
            crate::wire::describe_wire(wire)
        )));
    }
    Ok(())
}

/// Reads exactly `dst.len()` values (little-endian f32) into `dst`, no read waiting longer than
/// `idle`.
pub async fn read_values<R: AsyncRead + Unpin>(
    r: &mut R,
    dst: &mut [f32],
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    // SAFETY: any bytes form a valid f32; the view has the slice's length and lifetime.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(dst))
    };
    read_all(r, bytes, what, idle).await
}

/// Fills `bytes` (not initialised before) from `r`, no read waiting longer than `idle`; an
/// end of the connection before it is full is an error naming `what`.
async fn read_uninit<R: AsyncRead + Unpin>(
    r: &mut R,
    bytes: &mut [MaybeUninit<u8>],
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    let total = bytes.len();
    let mut rb = tokio::io::ReadBuf::uninit(bytes);
    while rb.remaining() > 0 {
        let before = rb.filled().len();
        within(idle, what, r.read_buf(&mut rb)).await?;
        if rb.filled().len() == before {
            return Err(PsError::BadChunk(format!(
                "{what}: the connection ended after {before} of {total} bytes"
            )));
        }
    }
    Ok(())
}

/// Appends exactly `n` values read from `r`, encoded as `wire` says, to `buf` (its spare
/// capacity is written by the reads, never zeroed first), no read waiting longer than `idle`.
/// bfloat16 bytes are read into the first half of the values' spare capacity and widened in
/// place from the last value back, so that no value is overwritten before it is read and no
/// second buffer is needed.
pub async fn read_values_into_vec<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<f32>,
    n: usize,
    wire: Wire,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    buf.reserve_exact(n);
    let at = buf.len();
    read_piece(r, &mut buf.spare_capacity_mut()[..n], wire, what, idle).await?;
    // SAFETY: the read initialised all n values after `at`.
    unsafe { buf.set_len(at + n) };
    Ok(())
}

/// Appends the `n` values of a push frame (after its header, [`read_push_header`]) to `buf`,
/// encoded as `wire` says: one piece at offset 0 when `pieces` is false, else pieces in any
/// order, each read straight into its place in `buf`'s spare capacity (and widened there for
/// bfloat16). `buf`'s length grows only once the pieces are proven to cover the range exactly;
/// a piece that is empty, not whole values, past the range or overlapping another is refused
/// before any of its bytes is read. No read waits longer than `idle`.
pub async fn read_push_into_vec<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<f32>,
    n: usize,
    wire: Wire,
    pieces: bool,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    buf.reserve_exact(n);
    let at = buf.len();
    let spare = &mut buf.spare_capacity_mut()[..n];
    if !pieces {
        read_piece(r, spare, wire, what, idle).await?;
    } else {
        let vb = wire.value_bytes() as u64;
        let mut cov = Coverage::new((n as u64) * vb, wire);
        while !cov.complete() {
            let (offset, len) = read_piece_header(r, &cov, what, idle).await?;
            cov.add(offset, len, what)?;
            let (v0, count) = ((offset / vb) as usize, (len / vb) as usize);
            let piece = format!("{what}, piece at bytes {offset}..{}", offset + len);
            read_piece(r, &mut spare[v0..v0 + count], wire, &piece, idle).await?;
        }
    }
    // SAFETY: the pieces initialised every one of the n values after `at` (full coverage).
    unsafe { buf.set_len(at + n) };
    Ok(())
}

/// Reads `dst.len()` values encoded as `wire` says into `dst` (initialised or not): f32
/// straight into it; bfloat16 into its first half, then widened in place from the last value
/// back. No read waits longer than `idle`.
pub async fn read_piece<R: AsyncRead + Unpin>(
    r: &mut R,
    dst: &mut [MaybeUninit<f32>],
    wire: Wire,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    let n = dst.len();
    let vb = wire.value_bytes();
    // SAFETY: MaybeUninit<f32> as MaybeUninit<u8>: the first vb * n of the 4n bytes of `dst`,
    // alignment 1, within its lifetime.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<MaybeUninit<u8>>(), vb * n)
    };
    read_uninit(r, bytes, what, idle).await?;
    if wire == Wire::Bf16 {
        let dst = dst.as_mut_ptr().cast::<f32>();
        let src = dst.cast::<u8>();
        for i in (0..n).rev() {
            // SAFETY: bytes 2i, 2i + 1 were initialised by the reads and are read before value
            // i (bytes 4i..4i + 4, at or after them) is written; values after i were written
            // from bytes after 2i + 1, so none of the bytes still to be read has been
            // overwritten. `dst` is aligned: it is f32 memory.
            unsafe {
                let h = u16::from_le_bytes([src.add(2 * i).read(), src.add(2 * i + 1).read()]);
                dst.add(i).write(crate::wire::bf16_to_f32(h));
            }
        }
    }
    Ok(())
}

/// [`read_piece`] into initialised values.
pub async fn read_piece_into<R: AsyncRead + Unpin>(
    r: &mut R,
    dst: &mut [f32],
    wire: Wire,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    // SAFETY: f32 as MaybeUninit<f32> (same layout); read_piece writes only valid f32 values
    // (whole little-endian f32 or widened bfloat16), so `dst` stays initialised.
    let dst = unsafe {
        std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<MaybeUninit<f32>>(), dst.len())
    };
    read_piece(r, dst, wire, what, idle).await
}

/// The pieces of a push frame received so far, each checked against the range and the others
/// as its header arrives (pieces are few: a sorted list of byte ranges, at most
/// [`MAX_PIECES`]).
#[derive(Debug, Clone)]
pub struct Coverage {
    total: u64,
    wire: Wire,
    /// Disjoint `[start, end)` byte ranges, sorted.
    pieces: Vec<(u64, u64)>,
    covered: u64,
}

impl Coverage {
    /// Nothing received yet of a range of `total` bytes of values encoded as `wire` says.
    pub fn new(total: u64, wire: Wire) -> Self {
        Self {
            total,
            wire,
            pieces: Vec::new(),
            covered: 0,
        }
    }

    /// Takes a piece of `n` bytes at byte `offset`, or says (prefixed by `what`) why it cannot
    /// be one: empty, past the end of the range, not whole values, overlapping a piece already
    /// taken, or one too many.
    pub fn add(&mut self, offset: u64, n: u64, what: &str) -> Result<(), PsError> {
        let total = self.total;
        let vb = self.wire.value_bytes() as u64;
        let bad = |m: String| Err(PsError::BadChunk(format!("{what}: {m}")));
        if n == 0 {
            return bad(format!(
                "piece at byte {offset} of {total} is empty: expected at least one value ({vb} bytes)"
            ));
        }
        let end = match offset.checked_add(n) {
            Some(end) if end <= total => end,
            _ => {
                return bad(format!(
                    "piece of {n} bytes at byte {offset} of {total} ends past the range: expected it to end by byte {total}"
                ));
            }
        };
        if !offset.is_multiple_of(vb) || !n.is_multiple_of(vb) {
            return bad(format!(
                "piece at bytes {offset}..{end} of {total} does not start and end on whole values: expected multiples of {vb} bytes ({})",
                crate::wire::describe_wire(self.wire)
            ));
        }
        let i = self.pieces.partition_point(|&(a, _)| a < offset);
        let before = i.checked_sub(1).map(|j| self.pieces[j]);
        let clash = before
            .filter(|&(_, b)| b > offset)
            .or_else(|| self.pieces.get(i).copied().filter(|&(a, _)| a < end));
        if let Some((a, b)) = clash {
            return bad(format!(
                "piece at byte {offset} of {total} overlaps the piece at bytes {a}..{b}"
            ));
        }
        if self.pieces.len() >= MAX_PIECES {
            return bad(format!(
                "piece at byte {offset} of {total} is one piece too many: expected at most {MAX_PIECES} pieces"
            ));
        }
        self.pieces.insert(i, (offset, end));
        self.covered += n;
        Ok(())
    }

    /// True when the pieces cover the range exactly.
    pub fn complete(&self) -> bool {
        self.covered == self.total
    }

    /// Bytes covered so far.
    pub fn covered(&self) -> u64 {
        self.covered
    }

    /// The range's length in bytes.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The first byte range not covered yet (None when complete).
    pub fn first_gap(&self) -> Option<(u64, u64)> {
        let mut at = 0;
        for &(a, b) in &self.pieces {
            if a > at {
                return Some((at, a));
            }
            at = b;
        }
        (at < self.total).then_some((at, self.total))
    }
}

/// Reads the header of the next piece of a push frame (`offset`, `n`) within `idle`; an end of
/// the connection before it names the bytes still missing from `cov`.
pub async fn read_piece_header<R: AsyncRead + Unpin>(
    r: &mut R,
    cov: &Coverage,
    what: &str,
    idle: Duration,
) -> Result<(u64, u64), PsError> {
    let mut h = [0u8; PIECE_HEADER];
    let mut at = 0;
    while at < h.len() {
        let n = within(idle, what, r.read(&mut h[at..])).await?;
        if n == 0 {
            let (a, b) = cov.first_gap().unwrap_or((cov.total, cov.total));
            return Err(PsError::BadChunk(format!(
                "{what}: the connection ended with pieces covering {} of {} bytes: expected a piece for bytes {a}..{b}",
                cov.covered, cov.total
            )));
        }
        at += n;
    }
    Ok((
        u64::from_le_bytes(h[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(h[8..].try_into().expect("8 bytes")),
    ))
}

/// The header of a piece: its byte offset in the range, then its byte count.
pub fn piece_header(offset: u64, bytes: u64) -> [u8; PIECE_HEADER] {
    frame_header(offset, bytes)
}

/// Fills `bytes` from `r`, no read waiting longer than `idle`.
pub async fn read_all<R: AsyncRead + Unpin>(
    r: &mut R,
    bytes: &mut [u8],
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    let mut at = 0;
    while at < bytes.len() {
        let n = within(idle, what, r.read(&mut bytes[at..])).await?;
        if n == 0 {
            return Err(PsError::BadChunk(format!(
                "{what}: the connection ended after {at} of {} bytes",
                bytes.len()
            )));
        }
        at += n;
    }
    Ok(())
}

async fn within<T>(
    idle: Duration,
    what: &str,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, PsError> {
    match tokio::time::timeout(idle, f).await {
        Err(_) => Err(PsError::Timeout(format!(
            "{what}: nothing arrived for {:.1} s (stream_idle_secs): ended",
            idle.as_secs_f64()
        ))),
        Ok(Err(e)) => Err(PsError::BadChunk(format!("{what}: {e}"))),
        Ok(Ok(v)) => Ok(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hello_and_frames_round_trip_and_bad_ones_are_named() {
        let h = Hello {
            rank: 3,
            token: b"0123456789abcdef".to_vec(),
            run_id: "run-7".into(),
            generation: 2,
            lease: vec![9; 16],
        };
        let bytes = h.encode();
        assert_eq!(Hello::read(&mut &bytes[..]).await.unwrap(), h);
        let mut bad = bytes.clone();
        bad[0] = b'X';
        let e = Hello::read(&mut &bad[..]).await.unwrap_err();
        assert!(e.to_string().contains("expected \"PSDATA02\""), "{e}");
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&1u32.to_le_bytes());
        huge.extend_from_slice(&(1u32 << 30).to_le_bytes());
        let e = Hello::read(&mut &huge[..]).await.unwrap_err();
        assert!(e.to_string().contains("expected at most 4096"), "{e}");
        let e = Hello::read(&mut &bytes[..10]).await.unwrap_err();
        assert!(matches!(e, PsError::BadChunk(_)), "{e}");

        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut wire = Vec::new();
        write_frame(&mut wire, 9, crate::wire::as_le_bytes(&values))
            .await
            .unwrap();
        let idle = Duration::from_secs(1);
        let mut r = &wire[..];
        read_frame_header(&mut r, 9, 4000, "frame", idle)
            .await
            .unwrap();
        let mut got = vec![1.5f32];
        read_values_into_vec(&mut r, &mut got, 1000, Wire::F32, "frame", idle)
            .await
            .unwrap();
        assert_eq!(got[0], 1.5);
        assert_eq!(&got[1..], &values[..]);
        let mut r = &wire[..];
        let e = read_frame_header(&mut r, 8, 4000, "push of step 8", idle)
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("a frame for 9 of 4000 bytes: expected 8 of 4000 bytes"),
            "{e}"
        );
        let mut r = &wire[..FRAME_HEADER + 400];
        read_frame_header(&mut r, 9, 4000, "frame", idle)
            .await
            .unwrap();
        let mut dst = vec![0f32; 1000];
        let e = read_values(&mut r, &mut dst, "frame", idle)
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("the connection ended after 400 of 4000 bytes"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn bf16_frames_widen_in_place_and_wrong_sizes_are_named() {
        let values: Vec<f32> = (0..1001).map(|i| i as f32 * 0.5 - 3.0).collect();
        let bytes = crate::wire::Bf16Encoder::new().encode_reusing(&values, None);
        let mut wire = Vec::new();
        write_frame(&mut wire, 4, &bytes).await.unwrap();
        let idle = Duration::from_secs(1);
        let mut r = &wire[..];
        read_frame_header_on(&mut r, 4, 2002, Wire::Bf16, "frame", idle)
            .await
            .unwrap();
        let mut got = vec![7.0f32];
        read_values_into_vec(&mut r, &mut got, 1001, Wire::Bf16, "frame", idle)
            .await
            .unwrap();
        assert_eq!(got[0], 7.0);
        let mut want = vec![0f32; 1001];
        crate::wire::decode_bf16(&mut want, &bytes);
        assert_eq!(&got[1..], &want[..]);
        assert_eq!(
            &got[1..201],
            &values[..200],
            "values exact in bfloat16 come back exactly"
        );
        let mut r = &wire[..];
        let e = read_frame_header_on(&mut r, 4, 4004, Wire::Bf16, "push of step 4", idle)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "a frame of 2002 bytes: expected 4004 bytes (2002 values, little-endian bfloat16"
            ),
            "{e}"
        );
        let mut r = &wire[..FRAME_HEADER + 100];
        read_frame_header_on(&mut r, 4, 2002, Wire::Bf16, "frame", idle)
            .await
            .unwrap();
        let mut got = Vec::new();
        let e = read_values_into_vec(&mut r, &mut got, 1001, Wire::Bf16, "frame", idle)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("ended after 100 of 2002 bytes"),
            "{e}"
        );
        assert!(got.is_empty());
    }

    /// A push frame of `values` (as `wire` encodes them) in pieces of the given byte ranges,
    /// sent in the given order.
    fn pieced(step: u64, bytes: &[u8], pieces: &[(usize, usize)]) -> Vec<u8> {
        let mut f = frame_header(step, bytes.len() as u64 | PIECES).to_vec();
        for &(a, b) in pieces {
            f.extend_from_slice(&piece_header(a as u64, (b - a) as u64));
            f.extend_from_slice(&bytes[a..b]);
        }
        f
    }

    async fn read_pieced(
        frame: &[u8],
        n: usize,
        wire: Wire,
        buf: &mut Vec<f32>,
    ) -> Result<(), PsError> {
        let idle = Duration::from_secs(1);
        let mut r = frame;
        let bytes = (n * wire.value_bytes()) as u64;
        let pieces = read_push_header(&mut r, 5, bytes, wire, "push", idle).await?;
        assert!(pieces, "the frame says it comes in pieces");
        read_push_into_vec(&mut r, buf, n, wire, pieces, "push", idle).await?;
        assert!(r.is_empty(), "{} bytes left unread", r.len());
        Ok(())
    }

    #[tokio::test]
    async fn pieces_in_any_order_read_back_bit_identical() {
        let values: Vec<f32> = (0..1000)
            .map(|i| (i as f32 * 0.37).sin() * 1e-3 - i as f32)
            .collect();
        let bytes = crate::wire::as_le_bytes(&values);
        let whole = [(0, 4000)];
        let reversed = [(2400, 4000), (800, 2400), (0, 800)];
        let shuffled = [
            (1200, 1204),
            (3996, 4000),
            (0, 400),
            (2000, 3996),
            (400, 1200),
            (1204, 2000),
        ];
        for order in [&whole[..], &reversed[..], &shuffled[..]] {
            let frame = pieced(5, bytes, order);
            let mut got = vec![9.5f32];
            read_pieced(&frame, 1000, Wire::F32, &mut got)
                .await
                .unwrap();
            assert_eq!(got[0], 9.5, "what the buffer held stays");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got[1..]), bits(&values), "pieces {order:?}");
        }
        // bfloat16: 2 bytes a value, widened in place piece by piece
        let values: Vec<f32> = (0..1001).map(|i| i as f32 * 0.25 - 100.0).collect();
        let enc = crate::wire::Bf16Encoder::new().encode_reusing(&values, None);
        let mut want = vec![0f32; 1001];
        crate::wire::decode_bf16(&mut want, &enc);
        let reversed = [(1600, 2002), (2, 1600), (0, 2)];
        let shuffled = [(1000, 1002), (0, 998), (1002, 2002), (998, 1000)];
        for order in [&reversed[..], &shuffled[..]] {
            let frame = pieced(5, &enc, order);
            let mut got = Vec::new();
            read_pieced(&frame, 1001, Wire::Bf16, &mut got)
                .await
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "bf16 pieces {order:?}");
        }
        // a frame without the flag is the whole range at offset 0, as before
        let mut plain = Vec::new();
        write_frame(&mut plain, 5, &enc).await.unwrap();
        let mut r = &plain[..];
        let idle = Duration::from_secs(1);
        let pieces = read_push_header(&mut r, 5, 2002, Wire::Bf16, "push", idle)
            .await
            .unwrap();
        assert!(!pieces);
        let mut got = Vec::new();
        read_push_into_vec(&mut r, &mut got, 1001, Wire::Bf16, false, "push", idle)
            .await
            .unwrap();
        assert_eq!(got, want);
        // the flag does not hide a wrong length
        let frame = pieced(5, &enc[..2000], &[(0, 2000)]);
        let e = read_push_header(&mut &frame[..], 5, 2002, Wire::Bf16, "push", idle)
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("a frame of 2000 bytes: expected 2002 bytes"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn bad_pieces_are_refused_by_name_and_leave_the_buffer_as_it_was() {
        let values: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let bytes = crate::wire::as_le_bytes(&values);
        let raw = |pieces: &[(u64, u64)]| {
            let mut f = frame_header(5, 4000 | PIECES).to_vec();
            for &(o, n) in pieces {
                f.extend_from_slice(&piece_header(o, n));
                let (a, b) = (o as usize, (o + n) as usize);
                f.extend_from_slice(&bytes[a.min(4000)..b.min(4000)]);
            }
            f
        };
        // (pieces as (offset, len), what the error says)
        let cases: Vec<(Vec<(u64, u64)>, &str)> = vec![
            (
                vec![(0, 800), (400, 800)],
                "push: piece at byte 400 of 4000 overlaps the piece at bytes 0..800",
            ),
            (
                vec![(800, 800), (0, 1200)],
                "push: piece at byte 0 of 4000 overlaps the piece at bytes 800..1600",
            ),
            (
                vec![(0, 800), (1600, 2400)],
                "push: the connection ended with pieces covering 3200 of 4000 bytes: expected a piece for bytes 800..1600",
            ),
            (
                vec![(3600, 800)],
                "push: piece of 800 bytes at byte 3600 of 4000 ends past the range: expected it to end by byte 4000",
            ),
            (
                vec![(800, 0)],
                "push: piece at byte 800 of 4000 is empty: expected at least one value (4 bytes)",
            ),
            (
                vec![(402, 400)],
                "push: piece at bytes 402..802 of 4000 does not start and end on whole values: expected multiples of 4 bytes (little-endian f32)",
            ),
            (
                vec![(400, 402)],
                "push: piece at bytes 400..802 of 4000 does not start and end on whole values",
            ),
        ];
        for (pieces, want) in cases {
            let frame = raw(&pieces);
            let mut got = vec![1.0f32, 2.0];
            let e = read_pieced(&frame, 1000, Wire::F32, &mut got)
                .await
                .unwrap_err();
            assert!(matches!(e, PsError::BadChunk(_)), "{pieces:?}: {e:?}");
            assert!(e.to_string().contains(want), "{pieces:?}: {e}");
            assert_eq!(
                got,
                [1.0, 2.0],
                "{pieces:?}: the buffer's length is untouched"
            );
        }
        // a piece's header past the end, checked before a byte of it is read
        let mut frame = frame_header(5, 4000 | PIECES).to_vec();
        frame.extend_from_slice(&piece_header(u64::MAX - 3, 8));
        let mut got = Vec::new();
        let e = read_pieced(&frame, 1000, Wire::F32, &mut got)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("ends past the range"), "{e}");
        // bfloat16 values are 2 bytes: an odd offset is half a value
        let mut frame = frame_header(5, 2000 | PIECES).to_vec();
        frame.extend_from_slice(&piece_header(401, 2));
        let e = read_pieced(&frame, 1000, Wire::Bf16, &mut got)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains(
                "piece at bytes 401..403 of 2000 does not start and end on whole values: expected multiples of 2 bytes (little-endian bfloat16"
            ),
            "{e}"
        );
        // a piece cut short names its bytes
        let mut frame = frame_header(5, 4000 | PIECES).to_vec();
        frame.extend_from_slice(&piece_header(800, 800));
        frame.extend_from_slice(&bytes[800..1000]);
        let e = read_pieced(&frame, 1000, Wire::F32, &mut got)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains(
                "push, piece at bytes 800..1600: the connection ended after 200 of 800 bytes"
            ),
            "{e}"
        );
        // too many pieces
        let mut cov = Coverage::new(4 * (MAX_PIECES as u64 + 1), Wire::F32);
        for i in 0..MAX_PIECES as u64 {
            cov.add(4 * i, 4, "push").unwrap();
        }
        let e = cov.add(4 * MAX_PIECES as u64, 4, "push").unwrap_err();
        assert!(
            e.to_string().contains("expected at most 4096 pieces"),
            "{e}"
        );
        assert!(!cov.complete());
        assert_eq!(
            cov.first_gap(),
            Some((4 * MAX_PIECES as u64, 4 * (MAX_PIECES as u64 + 1)))
        );
    }
}
