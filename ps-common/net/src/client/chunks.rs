//! How one push is cut into the chunks of a `Push` stream: the header on the first, the data
//! in pieces with their offsets, the pushing rank's lease.

use crate::wire::chunks_of;
use bytes::Bytes;
use ps_proto::pb::{Lease, PushChunk, PushHeader};

/// The chunks of one push: `header` on the first, then `bytes` (little-endian f32) in
/// `chunk_bytes` pieces with their offsets; one chunk with no data when `bytes` is empty. The
/// header is not checked against the data: tests build malformed pushes with it.
pub fn push_chunks(header: PushHeader, bytes: &Bytes, chunk_bytes: usize) -> Vec<PushChunk> {
    push_chunks_of(header, bytes, chunk_bytes, 4)
}

/// [`push_chunks`] for values of `value_bytes` bytes each (2 for bfloat16).
pub fn push_chunks_of(
    header: PushHeader,
    bytes: &Bytes,
    chunk_bytes: usize,
    value_bytes: usize,
) -> Vec<PushChunk> {
    let mut msgs: Vec<PushChunk> = chunks_of(bytes, chunk_bytes, value_bytes)
        .enumerate()
        .map(|(i, (offset, data))| PushChunk {
            header: (i == 0).then_some(header),
            offset,
            data,
            lease: None,
        })
        .collect();
    if msgs.is_empty() {
        // no data (a shared-memory push): the header alone
        msgs.push(PushChunk {
            header: Some(header),
            offset: 0,
            data: Bytes::new(),
            lease: None,
        });
    }
    msgs
}

/// The chunks a worker sends for one push: the header alone first, then `bytes` in
/// `chunk_bytes` pieces. A shard reads the header before it is this push's turn, and the data
/// only then: sent apart, none of the data waits in the shard's memory meanwhile.
pub fn push_messages(header: PushHeader, bytes: &Bytes, chunk_bytes: usize) -> Vec<PushChunk> {
    push_messages_of(header, bytes, chunk_bytes, 4)
}

/// [`push_messages`] for values of `value_bytes` bytes each (2 with `[cluster] wire = "bf16"`).
pub fn push_messages_of(
    header: PushHeader,
    bytes: &Bytes,
    chunk_bytes: usize,
    value_bytes: usize,
) -> Vec<PushChunk> {
    let mut msgs = vec![PushChunk {
        header: Some(header),
        offset: 0,
        data: Bytes::new(),
        lease: None,
    }];
    if !bytes.is_empty() {
        msgs.extend(
            chunks_of(bytes, chunk_bytes, value_bytes).map(|(offset, data)| PushChunk {
                header: None,
                offset,
                data,
                lease: None,
            }),
        );
    }
    msgs
}

/// `msgs` (a push's chunks) with `lease` on the first: the lease the pushing rank presents.
pub fn with_lease(mut msgs: Vec<PushChunk>, lease: Option<Lease>) -> Vec<PushChunk> {
    if let Some(first) = msgs.first_mut() {
        first.lease = lease;
    }
    msgs
}
