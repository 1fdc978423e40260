//! The tensor data connection: a plain TCP connection per (worker, shard) that carries the
//! values of gRPC pushes and pulls as single frames, while the requests, their answers and
//! every error stay on gRPC. On the gRPC path a tensor is copied into protobuf messages, into
//! HTTP/2 frames and out again on both sides; here the sender writes the values straight from
//! its buffer and the receiver reads them straight into its own (one copy into and one out of
//! the kernel, as raw TCP).
//!
//! - The worker opens it with a [`Hello`]: magic, rank, the token and the run id (the same
//!   credentials as its gRPC calls); the shard answers one byte, [`HELLO_OK`] or [`HELLO_NO`]
//!   (and closes).
//! - A push with `data_tcp` sends its header through gRPC and then one frame worker → shard:
//!   `step: u64, bytes: u64` (little-endian), then the little-endian f32 values.
//! - A pull with `data_tcp` gets a header through gRPC, and one frame shard → worker:
//!   `version: u64, bytes: u64`, then the values.
//!
//! Either side that sees anything unexpected on the connection (or an error in the request it
//! belongs to) drops it; the worker opens a new one for its next request. Not used with TLS:
//! the connection is not encrypted.

use crate::error::PsError;
use std::mem::MaybeUninit;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The first bytes of a hello.
pub const MAGIC: &[u8; 8] = b"PSDATA01";
/// Largest token or run id a hello may carry.
pub const MAX_HELLO_FIELD: usize = 4096;
/// The shard accepted the hello.
pub const HELLO_OK: u8 = 1;
/// The shard refused the hello (wrong token, run, rank or a malformed hello); it closes.
pub const HELLO_NO: u8 = 0;
/// Frame header bytes: a step or version, then the byte count.
pub const FRAME_HEADER: usize = 16;

/// What a worker says when it opens a data connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The worker's rank.
    pub rank: u32,
    /// The token (empty without one).
    pub token: Vec<u8>,
    /// The run id (empty: the unnamed run).
    pub run_id: String,
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
        b
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
        Ok(Self {
            rank,
            token,
            run_id,
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

/// Reads a frame header within `idle`, checking that it is for `tag` and holds `bytes` bytes.
pub async fn read_frame_header<R: AsyncRead + Unpin>(
    r: &mut R,
    tag: u64,
    bytes: u64,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    read_frame_header_on(r, tag, bytes, crate::config::Wire::F32, what, idle).await
}

/// [`read_frame_header`] for a frame of values encoded as `wire` says: a byte count that is
/// not the expected one is said in values for f32 ([`PsError::WrongLength`]) and in bytes,
/// naming the encoding, for bfloat16.
pub async fn read_frame_header_on<R: AsyncRead + Unpin>(
    r: &mut R,
    tag: u64,
    bytes: u64,
    wire: crate::config::Wire,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    let mut h = [0u8; FRAME_HEADER];
    within(idle, what, r.read_exact(&mut h)).await?;
    let got_tag = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
    let got_bytes = u64::from_le_bytes(h[8..].try_into().expect("8 bytes"));
    if got_tag != tag {
        return Err(PsError::BadChunk(format!(
            "{what}: a frame for {got_tag} of {got_bytes} bytes: expected {tag} of {bytes} bytes"
        )));
    }
    if got_bytes != bytes {
        if wire == crate::config::Wire::F32
            && got_bytes.is_multiple_of(4)
            && bytes.is_multiple_of(4)
        {
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

/// Appends exactly `n` values read from `r` to `buf` (its spare capacity is written by the
/// reads, never zeroed first), no read waiting longer than `idle`.
pub async fn read_values_into_vec<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<f32>,
    n: usize,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    buf.reserve_exact(n);
    let at = buf.len();
    let spare = &mut buf.spare_capacity_mut()[..n];
    // SAFETY: MaybeUninit<f32> as MaybeUninit<u8>: same memory, 4 bytes each, alignment 1.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<MaybeUninit<u8>>(), n * 4)
    };
    read_uninit(r, bytes, what, idle).await?;
    // SAFETY: the reads initialised all n * 4 bytes after `at`.
    unsafe { buf.set_len(at + n) };
    Ok(())
}

/// Appends exactly `n` values read from `r` as little-endian bfloat16 (`2 * n` bytes,
/// `[cluster] wire = "bf16"`) to `buf`, widened to f32: the bytes are read into the first half
/// of the values' spare capacity and widened in place from the last value back, so that no
/// value is overwritten before it is read and no second buffer is needed.
pub async fn read_bf16_into_vec<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<f32>,
    n: usize,
    what: &str,
    idle: Duration,
) -> Result<(), PsError> {
    buf.reserve_exact(n);
    let at = buf.len();
    let spare = &mut buf.spare_capacity_mut()[..n];
    // SAFETY: the first 2n of the spare capacity's 4n bytes, viewed as MaybeUninit<u8>.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<MaybeUninit<u8>>(), n * 2)
    };
    read_uninit(r, bytes, what, idle).await?;
    let dst = buf.spare_capacity_mut()[..n].as_mut_ptr().cast::<f32>();
    let src = dst.cast::<u8>();
    for i in (0..n).rev() {
        // SAFETY: bytes 2i, 2i + 1 were initialised by the reads and are read before value i
        // (bytes 4i..4i + 4, at or after them) is written; values after i were written from
        // bytes after 2i + 1, so none of the bytes still to be read has been overwritten.
        // `dst` is aligned: it is the Vec<f32>'s memory.
        unsafe {
            let h = u16::from_le_bytes([src.add(2 * i).read(), src.add(2 * i + 1).read()]);
            dst.add(i).write(crate::wire::bf16_to_f32(h));
        }
    }
    // SAFETY: all n values after `at` were written just above.
    unsafe { buf.set_len(at + n) };
    Ok(())
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
        };
        let bytes = h.encode();
        assert_eq!(Hello::read(&mut &bytes[..]).await.unwrap(), h);
        let mut bad = bytes.clone();
        bad[0] = b'X';
        let e = Hello::read(&mut &bad[..]).await.unwrap_err();
        assert!(e.to_string().contains("expected \"PSDATA01\""), "{e}");
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
        read_values_into_vec(&mut r, &mut got, 1000, "frame", idle)
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
        use crate::config::Wire;
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
        read_bf16_into_vec(&mut r, &mut got, 1001, "frame", idle)
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
        let e = read_bf16_into_vec(&mut r, &mut got, 1001, "frame", idle)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("ended after 100 of 2002 bytes"),
            "{e}"
        );
        assert!(got.is_empty());
    }
}
