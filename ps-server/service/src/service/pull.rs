//! The pull path: a pull's lease and version checked, the reply cut into zero-copy chunks of
//! the shared snapshot, and streamed with an idle bound. [`SharedPulls`] sends those chunks
//! to HTTP/2 as they are, so that every pull of a version shares the version's one buffer down
//! to the socket (tonic's encoder would copy each chunk into each stream's own buffer: about
//! one chunk per puller, 1.4 MB each with 0.94 MB of parameters, issue 31).

use super::*;
use bytes::{BufMut, BytesMut};
use prost::Message;
use tonic::codegen::http;
use tonic::server::NamedService;

impl ShardService {
    pub(super) async fn pull_inner(
        &self,
        req: PullRequest,
        via_data: Option<u32>,
    ) -> PsResult<Vec<PullChunk>> {
        let puller = self.leases.check(req.lease.as_ref(), via_data, || {
            format!("pull of version {}", req.min_version)
        })?;
        let last = self.shard.total_steps;
        if req.min_version > last {
            return Err(PsError::VersionOutOfRange {
                asked: req.min_version,
                last,
            });
        }
        let mut rx = self.shard.subscribe();
        let shard = &self.shard;
        let ready = rx.wait_for(|&v| v >= req.min_version || shard.failure().is_some());
        let waited = tokio::time::timeout(self.pull_timeout, ready).await;
        self.shard.refuse_failed(puller)?;
        match waited {
            Err(_) => {
                return Err(PsError::Timeout(format!(
                    "waited {:?} for version {}: shard {} is still at version {}",
                    self.pull_timeout,
                    req.min_version,
                    self.shard.index,
                    self.shard.version()
                )));
            }
            Ok(Err(_)) => return Err(PsError::Unavailable("shard is shutting down".into())),
            Ok(Ok(_)) => {}
        }
        drop(waited);
        if req.exact {
            let (version, snapshot) = self.shard.exactly(req.min_version)?;
            return Ok(pull_chunks(
                version,
                self.shard.range.start as u64,
                &snapshot,
                self.chunk_bytes,
            ));
        }
        if req.shm && self.shard.has_board() {
            // the worker copies the version out of the board (and checks it is still there)
            return Ok(vec![PullChunk {
                header: Some(PullHeader {
                    version: self.shard.version(),
                    start: self.shard.range.start as u64,
                    len: self.shard.len() as u64,
                    shm: true,
                    data_tcp: false,
                }),
                offset: 0,
                data: Bytes::new(),
            }]);
        }
        let (version, snapshot) = self.shard.snapshot()?;
        if let (Some(rank), Some(data)) = (via_data.map(|_| puller), &self.data) {
            // the rank's connection, unless another frame is being written on it: chunks then
            if let Some(mut w) = data.try_take_write(rank).await {
                let (data, idle, len) = (data.clone(), self.stream_idle, snapshot.len());
                let shard = self.shard.index;
                tokio::spawn(async move {
                    let write = datalink::write_frame(&mut w.half, version, &snapshot);
                    match tokio::time::timeout(idle, write).await {
                        Ok(Ok(())) => data.put_write(rank, w).await,
                        Ok(Err(e)) => tracing::warn!(
                            "shard {shard}: pull of version {version} by rank {rank} on its data connection failed after its header: {e}; connection dropped"
                        ),
                        Err(_) => tracing::warn!(
                            "shard {shard}: pull of version {version} by rank {rank}: {len} bytes not taken within {:.1} s (stream_idle_secs); data connection dropped",
                            idle.as_secs_f64()
                        ),
                    }
                });
                return Ok(vec![PullChunk {
                    header: Some(PullHeader {
                        version,
                        start: self.shard.range.start as u64,
                        len: self.shard.len() as u64,
                        shm: false,
                        data_tcp: true,
                    }),
                    offset: 0,
                    data: Bytes::new(),
                }]);
            }
        }
        Ok(pull_chunks(
            version,
            self.shard.range.start as u64,
            &snapshot,
            self.chunk_bytes,
        ))
    }
}

/// The chunks of one pull reply: zero-copy slices of the shared snapshot, the header on the first.
pub fn pull_chunks(
    version: u64,
    start: u64,
    snapshot: &Bytes,
    chunk_bytes: usize,
) -> Vec<PullChunk> {
    let len = (snapshot.len() / 4) as u64;
    chunks(snapshot, chunk_bytes)
        .enumerate()
        .map(|(i, (offset, data))| PullChunk {
            header: (i == 0).then_some(PullHeader {
                version,
                start,
                len,
                shm: false,
                data_tcp: false,
            }),
            offset,
            data,
        })
        .collect()
}

pub(super) type PullStream = Pin<Box<dyn Stream<Item = Result<PullChunk, Status>> + Send>>;

/// A pull reply's chunks, ended with `DEADLINE_EXCEEDED` when the client takes none of them
/// for `idle` (`[server] stream_idle_secs`): a watchdog then drops the chunks (they hold the
/// version's snapshot) and the stream ends with that status as soon as it is polled again.
/// The handler returns it as the stream tonic encodes, and a clone of it in the response's
/// extensions, which [`SharedPulls`] serves instead without a copy.
#[derive(Clone)]
pub(super) struct IdlePull {
    state: Arc<std::sync::Mutex<PullState>>,
}

impl IdlePull {
    pub(super) fn start(chunks: Vec<PullChunk>, idle: Duration, shard: usize) -> Self {
        let state = Arc::new(std::sync::Mutex::new(PullState {
            chunks: chunks.into(),
            progress: std::time::Instant::now(),
            expired: None,
            finished: false,
        }));
        let watched = Arc::downgrade(&state);
        tokio::spawn(async move {
            let mut wait = idle;
            loop {
                tokio::time::sleep(wait).await;
                let Some(state) = watched.upgrade() else {
                    return;
                };
                let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                if st.finished {
                    return;
                }
                let quiet = st.progress.elapsed();
                if quiet >= idle {
                    let left: usize = st.chunks.iter().map(|c| c.data.len()).sum();
                    let why = format!(
                        "pull stream idle for {:.1} s with {left} bytes not taken (stream_idle_secs): ended",
                        quiet.as_secs_f64()
                    );
                    tracing::warn!("shard {shard}: {why}");
                    st.chunks.clear();
                    st.expired = Some(why);
                    return;
                }
                wait = idle - quiet;
            }
        });
        Self { state }
    }
}

impl IdlePull {
    /// The next chunk (the client took the one before: progress), the idle status once the
    /// watchdog ended the reply, or None at the end.
    fn next_chunk(&self) -> Option<Result<PullChunk, Status>> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.finished {
            return None;
        }
        if let Some(why) = st.expired.take() {
            st.finished = true;
            return Some(Err(PsError::Timeout(why).into()));
        }
        st.progress = std::time::Instant::now();
        let next = st.chunks.pop_front();
        if next.is_none() {
            st.finished = true;
        }
        next.map(Ok)
    }
}

impl Stream for IdlePull {
    type Item = Result<PullChunk, Status>;

    fn poll_next(
        self: Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::task::Poll::Ready(self.next_chunk())
    }
}

/// The response of a pull handler: `pull` as the stream, and in the extensions for
/// [`SharedPulls`].
pub(super) fn pull_response(pull: IdlePull) -> Response<PullStream> {
    let mut response = Response::new(Box::pin(pull.clone()) as PullStream);
    response.extensions_mut().insert(pull);
    response
}

/// The gRPC message of `chunk` as two pieces of the HTTP/2 body: the 5-byte gRPC prefix with
/// the protobuf fields before the values (header, offset, the values' key and length), then
/// the values themselves, a view of the version's shared snapshot. The two together are the
/// bytes prost encodes (`data` is the last field).
pub fn grpc_message(mut chunk: PullChunk) -> (Bytes, Bytes) {
    use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
    let data = std::mem::take(&mut chunk.data);
    let fields = chunk.encoded_len();
    let data_field = if data.is_empty() {
        0
    } else {
        key_len(3) + encoded_len_varint(data.len() as u64)
    };
    let mut head = BytesMut::with_capacity(5 + fields + data_field);
    head.put_u8(0); // not compressed
    // chunk_bytes is at most MAX_MESSAGE_BYTES (checked at load): the length fits
    head.put_u32((fields + data_field + data.len()) as u32);
    chunk.encode_raw(&mut head);
    if !data.is_empty() {
        encode_key(3, WireType::LengthDelimited, &mut head);
        encode_varint(data.len() as u64, &mut head);
    }
    (head.freeze(), data)
}

/// The HTTP/2 body of a pull reply served by [`SharedPulls`]: each chunk as its gRPC prefix
/// and its shared values ([`grpc_message`]), then the status trailers (OK, or the idle
/// status). h2 keeps the values by reference until the socket takes them.
pub struct PullBody {
    pull: IdlePull,
    values: Option<Bytes>,
    ended: bool,
}

impl http_body::Body for PullBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        use std::task::Poll::Ready;
        let this = self.get_mut();
        if let Some(values) = this.values.take() {
            return Ready(Some(Ok(http_body::Frame::data(values))));
        }
        if this.ended {
            return Ready(None);
        }
        let status = match this.pull.next_chunk() {
            Some(Ok(chunk)) => {
                let (head, values) = grpc_message(chunk);
                this.values = (!values.is_empty()).then_some(values);
                return Ready(Some(Ok(http_body::Frame::data(head))));
            }
            Some(Err(status)) => status,
            None => Status::ok(""),
        };
        this.ended = true;
        let mut trailers = http::HeaderMap::new();
        if status.add_header(&mut trailers).is_err() {
            // only a message that is no valid header value fails: the code alone then
            let _ = Status::new(status.code(), "").add_header(&mut trailers);
        }
        Ready(Some(Ok(http_body::Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.values.is_none()
    }
}

/// The shard's gRPC service with pull replies served by [`PullBody`]: each response that
/// carries an [`IdlePull`] (a pull's) gets its body replaced by one that sends the snapshot's
/// bytes without a copy; every other response, and a compressed one, is tonic's.
#[derive(Debug, Clone)]
pub struct SharedPulls<S>(pub S);

impl<S: NamedService> NamedService for SharedPulls<S> {
    const NAME: &'static str = S::NAME;
}

type HttpResponse = http::Response<tonic::body::Body>;

impl<S, B> tonic::codegen::Service<http::Request<B>> for SharedPulls<S>
where
    S: tonic::codegen::Service<http::Request<B>, Response = HttpResponse>,
{
    type Response = HttpResponse;
    type Error = S::Error;
    type Future = futures::future::MapOk<S::Future, fn(HttpResponse) -> HttpResponse>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        use futures::TryFutureExt;
        self.0.call(request).map_ok(shared_pull_body)
    }
}

fn shared_pull_body(response: HttpResponse) -> HttpResponse {
    let (mut parts, body) = response.into_parts();
    match parts.extensions.remove::<IdlePull>() {
        Some(pull) if !parts.headers.contains_key("grpc-encoding") => {
            drop(body);
            let body = PullBody {
                pull,
                values: None,
                ended: false,
            };
            http::Response::from_parts(parts, tonic::body::Body::new(body))
        }
        _ => http::Response::from_parts(parts, body),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two pieces of a chunk are the gRPC frame of prost's encoding of it: values after
    /// a header, values alone, and a header alone.
    #[test]
    fn a_chunk_in_two_pieces_is_the_grpc_frame_of_its_encoding() {
        let header = PullHeader {
            version: 7,
            start: 300,
            len: 1000,
            shm: false,
            data_tcp: false,
        };
        let values = Bytes::from((0..4000u32).map(|i| i as u8).collect::<Vec<u8>>());
        for chunk in [
            PullChunk {
                header: Some(header),
                offset: 0,
                data: values.slice(..1000),
            },
            PullChunk {
                header: None,
                offset: 1000,
                data: values.slice(1000..),
            },
            PullChunk {
                header: Some(PullHeader {
                    data_tcp: true,
                    ..header
                }),
                offset: 0,
                data: Bytes::new(),
            },
        ] {
            let message = chunk.encode_to_vec();
            let mut want = vec![0u8];
            want.extend_from_slice(&(message.len() as u32).to_be_bytes());
            want.extend_from_slice(&message);
            let (head, data) = grpc_message(chunk.clone());
            assert_eq!([&head[..], &data[..]].concat(), want, "{chunk:?}");
            if !chunk.data.is_empty() {
                assert_eq!(
                    data.as_ptr(),
                    chunk.data.as_ptr(),
                    "the values are not copied"
                );
            }
        }
    }
}
