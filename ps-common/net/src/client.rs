//! The client half of the wire contract, written once for the worker, the tests and ps-bench:
//! [`ShardClient`] connects to one shard (flow-control windows and frame size sized for large
//! tensors, TLS and the token as `[cluster]` asks), registers, pulls a version straight into a
//! buffer (through the shard's shared-memory board or gRPC chunks), pushes a gradient (chunked
//! through gRPC, or a header alone when the gradient is in shared memory) and leaves. A refusal
//! is a [`ClientError`] that says whether trying again can help.
//!
//! Tests that send malformed messages on purpose use the lower level: [`ShardClient::rpc`] (the
//! generated client) and [`push_chunks`] (any header over any bytes).

use crate::auth::{Client, ClientSecurity};
use crate::shm::{Board, params_path};
use crate::sink::{PullSink, SliceSink, write_chunk};
use crate::wire::MAX_MESSAGE_BYTES;
pub use plane::{DATA_IDLE, Feed, FrameError, Plane};
use plane::{Frame, PushPlane};

mod chunks;
mod error;
mod plane;
pub use chunks::{push_chunks, push_chunks_of, push_messages, push_messages_of, with_lease};
use error::refused;
pub use error::{ClientError, is_retryable_code};
use ps_proto::pb::parameter_server_client::ParameterServerClient;
use ps_proto::pb::{
    ConstantsRequest, Lease, LeaveRequest, PullChunk, PullHeader, PushHeader, PushReply,
    RegisterReply, RegisterRequest, UnusedRequest,
};

use bytes::Bytes;
pub use ps_proto::keys::{DATA_RANK_KEY, WIRE_KEY};
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::Status;
use tonic::transport::Endpoint;

/// HTTP/2 stream window: a whole 1 MiB chunk, several times over, is in flight per stream.
pub const STREAM_WINDOW_BYTES: u32 = 8 << 20;
/// HTTP/2 connection window: two streams' windows (a pull and a push may overlap).
pub const CONNECTION_WINDOW_BYTES: u32 = 16 << 20;
/// Largest HTTP/2 frame (the protocol's maximum is 2^24 - 1; 1 MiB - 1 carries a chunk in one).
pub const MAX_FRAME_BYTES: u32 = (1 << 20) - 1;
/// Bound on one TCP (and TLS) connection attempt.
pub const CONNECT_ATTEMPT: Duration = Duration::from_secs(5);
/// How often a client still trying to connect says so.
pub const CONNECT_LOG_EVERY: Duration = Duration::from_secs(3);
/// Transport failures a push survives before it gives up (backoff 200 ms, 400 ms, ... 3.2 s).
pub const PUSH_RETRIES: u32 = 5;

/// What a call's deadline allows beyond the longest a live shard holds it (the transfer of
/// the values after the wait, a loaded machine) by default: `[worker] deadline_margin_secs`'s
/// default, and the margin of a client whose deadline was not set.
pub const DEADLINE_MARGIN: Duration = Duration::from_secs(30);

/// The margin of a worker of `cfg`: `[worker] deadline_margin_secs`.
pub fn deadline_margin(cfg: &ps_config::Config) -> Duration {
    // validated: positive, finite, at most 7 days
    Duration::try_from_secs_f64(cfg.worker.deadline_margin_secs).unwrap_or(DEADLINE_MARGIN)
}

/// The deadline of every call a worker of `cfg` makes to a shard (register, pull, push, leave,
/// on gRPC or the data connection): a live shard answers a pull within `[server]
/// pull_timeout_secs` (it says `DEADLINE_EXCEEDED` then) and holds a step at most twice
/// `barrier_timeout_secs` (`barrier_policy = "continue"`), so a call still unanswered
/// [`deadline_margin`] (`[worker] deadline_margin_secs`) after the longer of the two has a
/// shard that stopped answering.
pub fn call_deadline(cfg: &ps_config::Config) -> Duration {
    let longest = cfg
        .server
        .pull_timeout_secs
        .max(2.0 * cfg.server.barrier_timeout_secs);
    Duration::from_secs_f64(longest) + deadline_margin(cfg)
}

/// A client's bound on each call: the whole deadline, and the margin in it (for the error).
#[derive(Debug, Clone, Copy)]
struct Deadline {
    total: Duration,
    margin: Duration,
}

/// `call` bounded by `deadline`; [`ClientError::NoAnswer`] naming the shard and `what` when
/// it passes.
async fn bounded<T>(
    (shard, addr, deadline): (usize, &str, Deadline),
    what: impl FnOnce() -> String,
    call: impl std::future::Future<Output = Result<T, ClientError>>,
) -> Result<T, ClientError> {
    match tokio::time::timeout(deadline.total, call).await {
        Ok(r) => r,
        Err(_) => Err(ClientError::NoAnswer {
            shard,
            addr: addr.to_string(),
            what: what(),
            waited_secs: deadline.total.as_secs_f64(),
            margin_secs: deadline.margin.as_secs_f64(),
        }),
    }
}

/// The endpoint of the shard at `addr` with the flow-control windows and frame size used by
/// every client of the project, TLS when `security` has it.
pub fn endpoint(
    addr: &str,
    security: &ClientSecurity,
) -> Result<Endpoint, crate::auth::EndpointError> {
    Ok(security
        .endpoint(addr)?
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .tcp_nodelay(true)
        .max_frame_size(MAX_FRAME_BYTES)
        .connect_timeout(CONNECT_ATTEMPT))
}

/// The pieces of a progressive push ([`ShardClient::push_progressive`]): each its offset in
/// values from the start of the shard's range, and its bytes as the client's wire encodes them.
pub type PieceReceiver = tokio::sync::mpsc::UnboundedReceiver<(usize, Bytes)>;

/// A connection to one shard (cheap to clone: clones share the HTTP/2 connection).
#[derive(Clone)]
pub struct ShardClient {
    shard: usize,
    addr: String,
    rpc: Client,
    /// Whether this client speaks TLS (to word a TLS mismatch).
    tls: bool,
    /// The tensor data connection, once a registration reply offered one.
    data: Option<std::sync::Arc<plane::DataLink>>,
    /// The credentials, for the data connection's hello.
    security: ClientSecurity,
    /// How this client's pushes encode their values over the network (`[cluster] wire`):
    /// registration says it ([`WIRE_KEY`]) and pushes chunk their bytes by it.
    wire: ps_config::Wire,
    /// The leases registration granted (shared by clones).
    leases: HeldLeases,
    /// The deadline of each call ([`call_deadline`]) and its margin.
    deadline: Deadline,
}

/// The leases a client's registrations were granted (`ps_server::lease`), presented by its
/// pushes, pulls and leaves: each rank's, and the latest (a pull's).
#[derive(Debug, Clone, Default)]
struct HeldLeases(std::sync::Arc<std::sync::Mutex<LeaseTable>>);

/// Each rank's lease, and the latest granted.
type LeaseTable = (HashMap<u32, Lease>, Option<Lease>);

impl HeldLeases {
    fn lock(&self) -> std::sync::MutexGuard<'_, LeaseTable> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, rank: u32, lease: Option<Lease>) {
        let mut l = self.lock();
        match &lease {
            Some(x) => l.0.insert(rank, x.clone()),
            None => l.0.remove(&rank),
        };
        l.1 = lease;
    }

    fn of(&self, rank: u32) -> Option<Lease> {
        self.lock().0.get(&rank).cloned()
    }

    fn latest(&self) -> Option<Lease> {
        self.lock().1.clone()
    }
}

impl std::fmt::Debug for ShardClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardClient")
            .field("shard", &self.shard)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ShardClient {
    /// Connects to shard `shard` at `addr` (`host:port`), retrying with backoff (50 ms doubling
    /// to 2 s) for up to `patience`, so that workers may start before their shards.
    pub async fn connect(
        shard: usize,
        addr: &str,
        security: &ClientSecurity,
        patience: Duration,
    ) -> Result<Self, ClientError> {
        let unreachable = |reason: String, start: Instant| ClientError::Unreachable {
            addr: addr.to_string(),
            waited_secs: start.elapsed().as_secs_f64().max(patience.as_secs_f64()),
            reason,
        };
        let start = Instant::now();
        let endpoint = endpoint(addr, security)?;
        let mut delay = Duration::from_millis(50);
        let (mut tries, mut said) = (0u32, Instant::now());
        loop {
            tries += 1;
            match endpoint.connect().await {
                Ok(ch) => {
                    let rpc = ParameterServerClient::with_interceptor(ch, security.interceptor())
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .max_encoding_message_size(MAX_MESSAGE_BYTES);
                    return Ok(Self {
                        shard,
                        addr: addr.to_string(),
                        rpc,
                        tls: security.uses_tls(),
                        data: None,
                        security: security.clone(),
                        wire: ps_config::Wire::F32,
                        leases: HeldLeases::default(),
                        deadline: Deadline {
                            total: Duration::from_secs(600) + DEADLINE_MARGIN,
                            margin: DEADLINE_MARGIN,
                        },
                    });
                }
                Err(e) if start.elapsed() < patience => {
                    // loud while it lasts: what was tried and what failed, every few seconds
                    if said.elapsed() >= CONNECT_LOG_EVERY {
                        said = Instant::now();
                        tracing::warn!(
                            "cannot reach shard {shard} at {addr} yet: {}; tried {tries} times in {:.0} s, trying until {:.0} s ([worker] connect_timeout_secs)",
                            crate::neterr::explain(&e, security.uses_tls()),
                            start.elapsed().as_secs_f64(),
                            patience.as_secs_f64()
                        );
                    } else {
                        tracing::debug!("connecting to {addr}: {e}; retrying in {delay:?}");
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    let reason = crate::neterr::explain(&e, security.uses_tls());
                    return Err(unreachable(reason, start));
                }
            }
        }
    }

    /// The lease `rank`'s registration through this client was granted (None: not
    /// registered through it).
    pub fn lease(&self, rank: u32) -> Option<Lease> {
        self.leases.of(rank)
    }

    /// The shard's index.
    pub fn shard(&self) -> usize {
        self.shard
    }

    /// The shard's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The generated gRPC client, for requests this type does not make (malformed ones, in
    /// tests).
    pub fn rpc(&mut self) -> &mut Client {
        &mut self.rpc
    }

    fn bad(&self, message: String) -> ClientError {
        ClientError::BadReply {
            shard: self.shard,
            message,
        }
    }

    /// Moves the values of this client's later pushes and pulls on a data connection to the
    /// port the shard's registration reply named (`data_port`, 0: none), as `rank`, with this
    /// client's credentials; [`ShardClient::register`] calls it with each reply. Without TLS
    /// only: the connection is not encrypted.
    pub fn use_data_link(&mut self, port: u32, rank: u32, lease: Option<&Lease>) {
        let security = &self.security;
        if port == 0 || port > u32::from(u16::MAX) || security.uses_tls() {
            self.data = None;
            return;
        }
        let host = match self.addr.rsplit_once(':') {
            Some((h, _)) => h.to_string(),
            None => return,
        };
        let hello = crate::datalink::Hello {
            rank,
            token: security.token_bytes().to_vec(),
            run_id: security.run_id().to_string(),
            generation: lease.map_or(0, |l| l.generation),
            lease: lease.map(|l| l.id.to_vec()).unwrap_or_default(),
        }
        .encode();
        let target = format!("{host}:{port}");
        // a registration again: a new lease, so a new connection (the shard refuses frames on
        // the old one); one found unreachable stays so
        let unreachable = self
            .data
            .as_ref()
            .filter(|d| d.target == target)
            .is_some_and(|d| d.unreachable.load(std::sync::atomic::Ordering::Relaxed));
        self.data = Some(std::sync::Arc::new(plane::DataLink {
            target,
            hello,
            rank: rank.to_string().parse().expect("digits"),
            rank_number: rank,
            conn: Default::default(),
            unreachable: unreachable.into(),
        }));
    }

    /// Whether pushes and pulls go through a data connection.
    pub fn has_data_link(&self) -> bool {
        self.data.is_some()
    }

    /// Whether a data connection is offered and was not found unreachable (where it was,
    /// requests go through gRPC chunks: a progressive push would only be assembled whole).
    pub fn data_link_usable(&self) -> bool {
        self.data
            .as_ref()
            .is_some_and(|d| !d.unreachable.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Sets how this client's pushes encode their values over the network: registration then
    /// says it, and the bytes given to [`ShardClient::push`] must be encoded so
    /// (`crate::wire::encode_push`).
    pub fn set_wire(&mut self, wire: ps_config::Wire) {
        self.wire = wire;
    }

    /// How this client's pushes encode their values over the network.
    pub fn wire(&self) -> ps_config::Wire {
        self.wire
    }

    /// Sets the deadline of every call of this client (and its clones made after) to `cfg`'s,
    /// [`call_deadline`], with its margin [`deadline_margin`]; 630 s (the defaults') until set.
    pub fn set_deadline(&mut self, cfg: &ps_config::Config) {
        self.deadline = Deadline {
            total: call_deadline(cfg),
            margin: deadline_margin(cfg),
        };
    }

    fn bound(&self) -> (usize, &str, Deadline) {
        (self.shard, &self.addr, self.deadline)
    }

    /// Registers once (registration is idempotent: it also tells the shard's version), within
    /// the client's deadline.
    pub async fn register(&mut self, req: RegisterRequest) -> Result<RegisterReply, ClientError> {
        let (shard, addr, deadline) = self.bound();
        let addr = addr.to_string();
        bounded(
            (shard, &addr, deadline),
            || "registration".into(),
            self.register_once(req),
        )
        .await
    }

    async fn register_once(&mut self, req: RegisterRequest) -> Result<RegisterReply, ClientError> {
        let refused = refused(
            self.shard,
            format!("shard {} refused registration", self.shard),
        );
        let tls = self.tls;
        let rank = req.rank;
        let mut req = tonic::Request::new(req);
        if self.wire != ps_config::Wire::F32 {
            req.metadata_mut().insert(
                WIRE_KEY,
                tonic::metadata::AsciiMetadataValue::from_static(self.wire.name()),
            );
        }
        let reply = match self.rpc.register(req).await {
            Ok(r) => r.into_inner(),
            // A TLS mismatch shows up here as an h2 protocol error, or as a reset when the
            // TLS shard closed before its alert was read: say "TLS expected" instead.
            Err(st) => {
                let mut words = crate::neterr::explain(&st, tls);
                if !tls
                    && !words.contains("TLS expected")
                    && crate::neterr::kind(&words)
                        .is_some_and(|k| k.starts_with("connection reset"))
                    && crate::neterr::speaks_tls(&self.addr).await
                {
                    words.push_str(" (TLS expected by the shard: it answers a TLS handshake; give this client the same [cluster] TLS settings (tls_ca))");
                }
                return Err(refused(Status::new(st.code(), words)));
            }
        };
        self.use_data_link(reply.data_port, rank, reply.lease.as_ref());
        self.leases.record(rank, reply.lease.clone());
        Ok(reply)
    }

    /// Registers, trying again every 200 ms for up to `patience` while the refusal is
    /// retryable (a shard still starting up).
    pub async fn register_retrying(
        &mut self,
        req: RegisterRequest,
        patience: Duration,
    ) -> Result<RegisterReply, ClientError> {
        let begun = Instant::now();
        loop {
            match self.register(req.clone()).await {
                Err(e) if e.is_retryable() && begun.elapsed() < patience => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                r => return r,
            }
        }
    }

    /// Pulls version `version` into `dst` (exactly the shard's length), through `board` (the
    /// shard's parameters board) when given, falling back to gRPC if the version left the board
    /// during the copy; through gRPC chunks, decoded in place, otherwise. `exact` asks for that
    /// version even if the shard is one further (a restarted worker redoing a step).
    pub async fn pull_into(
        &mut self,
        version: u64,
        exact: bool,
        board: Option<&Board>,
        dst: &mut [f32],
    ) -> Result<(), ClientError> {
        self.pull_to(version, exact, board, &mut SliceSink::new(dst))
            .await
    }

    /// [`ShardClient::pull_into`] into `sink`: the values are written in ascending order and
    /// published piece by piece as they arrive (gRPC chunks as they come, the data
    /// connection's frame and the board's slot in pieces), so that a reader can use the first
    /// ones while the rest are on their way. A fallback to gRPC after a failed board copy or
    /// data connection skips what was published (the same version's values).
    pub async fn pull_to(
        &mut self,
        version: u64,
        exact: bool,
        board: Option<&Board>,
        sink: &mut dyn PullSink,
    ) -> Result<(), ClientError> {
        let (shard, addr, deadline) = self.bound();
        let addr = addr.to_string();
        bounded(
            (shard, &addr, deadline),
            || format!("the pull of version {version}"),
            self.pull_to_unbounded(version, exact, board, sink),
        )
        .await
    }

    async fn pull_to_unbounded(
        &mut self,
        version: u64,
        exact: bool,
        board: Option<&Board>,
        sink: &mut dyn PullSink,
    ) -> Result<(), ClientError> {
        let mut plane = match (board, &self.data) {
            (Some(_), _) => Plane::Board,
            (None, Some(_)) if !exact => Plane::DataLink,
            _ => Plane::Chunks,
        };
        // a plane that fails under the copy leaves the rest to chunks
        while !self.pull_on(plane, (version, exact), board, sink).await? {
            plane = Plane::Chunks;
        }
        Ok(())
    }

    /// The header of a pull reply's first chunk, checked against the `version` and `len`
    /// asked for.
    fn pull_header<'a>(
        &self,
        first: &'a PullChunk,
        version: u64,
        len: usize,
    ) -> Result<&'a PullHeader, ClientError> {
        let h = first
            .header
            .as_ref()
            .ok_or_else(|| self.bad("pull reply without a header".into()))?;
        if h.version != version {
            return Err(self.bad(format!(
                "at version {} but this worker needs version {version}",
                h.version
            )));
        }
        if h.len != len as u64 {
            return Err(self.bad(format!("holds {} values: expected {len}", h.len)));
        }
        Ok(h)
    }

    /// Decodes a pull reply's gRPC chunks, `first` and the rest of `stream`, in place into
    /// `sink`, checking that they are in order and fill it exactly; each chunk is published
    /// as it is decoded (what `sink` already holds is skipped).
    async fn pull_chunks(
        &self,
        first: PullChunk,
        stream: &mut tonic::Streaming<PullChunk>,
        sink: &mut dyn PullSink,
        what: &str,
    ) -> Result<(), ClientError> {
        let mut sent = 0u64;
        let mut chunk = Some(first);
        while let Some(c) = chunk {
            if c.offset != sent {
                return Err(self.bad(format!("chunk at offset {}, expected {sent}", c.offset)));
            }
            write_chunk(sink, c.offset, &c.data).map_err(|e| self.bad(e.to_string()))?;
            sent += (c.data.len() / 4) as u64;
            chunk = stream
                .message()
                .await
                .map_err(refused(self.shard, what.to_string()))?;
        }
        if sent != sink.len() as u64 {
            return Err(self.bad(format!("sent {sent} values: expected {}", sink.len())));
        }
        Ok(())
    }

    /// Pushes once: `header`, then `bytes` (the gradient slice, little-endian f32; empty when
    /// `header.shm` says the gradient is in this worker's board) in `chunk_bytes` chunks.
    pub async fn push(
        &self,
        header: PushHeader,
        bytes: &Bytes,
        chunk_bytes: usize,
    ) -> Result<PushReply, ClientError> {
        bounded(
            self.bound(),
            || format!("the push of step {}", header.step),
            self.push_once(header, bytes, chunk_bytes),
        )
        .await
    }

    async fn push_once(
        &self,
        header: PushHeader,
        bytes: &Bytes,
        chunk_bytes: usize,
    ) -> Result<PushReply, ClientError> {
        match self.open_push_plane(&header, !bytes.is_empty()).await {
            PushPlane::Link(link, conn) => {
                self.push_on_link(link, conn, header, Frame::Whole(bytes))
                    .await
            }
            PushPlane::Call => self.push_chunks_call(header, bytes, chunk_bytes).await,
        }
    }

    /// A push whose values come from `pieces` as they become final (each: its offset in
    /// values from the start of the range, and its bytes encoded for this client's wire; the
    /// sender is dropped once they cover `header.len` values): on the data connection, the
    /// frame's header goes at once and each piece as it arrives, while the gRPC call waits
    /// for the shard's answer. Where that is not possible (no data connection, or it cannot
    /// be opened) or fails in a way a retry may overcome, the range is assembled from the
    /// pieces and pushed whole by [`ShardClient::push_retrying`]. Returns the answer and the
    /// pieces received, whose buffers the caller may reuse.
    pub async fn push_progressive(
        &self,
        header: PushHeader,
        pieces: PieceReceiver,
        chunk_bytes: usize,
    ) -> (Result<PushReply, ClientError>, Vec<(usize, Bytes)>) {
        let mut feed = Feed::new(pieces);
        let call = async {
            Ok(self
                .push_progressive_unbounded(header, &mut feed, chunk_bytes)
                .await)
        };
        let what = || format!("the push of step {}", header.step);
        match bounded(self.bound(), what, call).await {
            Ok(done) => done,
            Err(ClientError::NoAnswer {
                waited_secs,
                margin_secs,
                ..
            }) if !feed.ended && feed.bytes < header.len as usize * self.wire.value_bytes() => {
                // the deadline covers the backward pass that feeds the push: say which stalled
                let e = ClientError::FeedStalled {
                    shard: self.shard,
                    step: header.step,
                    got: feed.bytes,
                    total: header.len as usize * self.wire.value_bytes(),
                    waited_secs,
                    idle_secs: feed.last.elapsed().as_secs_f64(),
                    margin_secs,
                };
                (Err(e), Vec::new())
            }
            Err(e) => (Err(e), Vec::new()),
        }
    }

    async fn push_progressive_unbounded(
        &self,
        header: PushHeader,
        pieces: &mut Feed,
        chunk_bytes: usize,
    ) -> (Result<PushReply, ClientError>, Vec<(usize, Bytes)>) {
        let mut got = Vec::new();
        if let PushPlane::Link(link, conn) = self.open_push_plane(&header, header.len > 0).await {
            let frame = Frame::Pieces {
                pieces,
                got: &mut got,
            };
            match self.push_on_link(link, conn, header, frame).await {
                Err(e) if e.is_retryable() => {
                    tracing::warn!(
                        "push of step {} to shard {} failed ({e}); pushing it again whole",
                        header.step,
                        self.shard
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                r => return (r, got),
            }
        }
        while let Some(p) = pieces.recv().await {
            got.push(p);
        }
        let bytes = match self.assemble(header, &got) {
            Ok(b) => b,
            Err(e) => return (Err(e), got),
        };
        (self.push_retrying(header, &bytes, chunk_bytes).await, got)
    }

    /// The whole range of a progressive push from its `pieces`, which must cover it exactly.
    fn assemble(
        &self,
        header: PushHeader,
        pieces: &[(usize, Bytes)],
    ) -> Result<Bytes, ClientError> {
        let vb = self.wire.value_bytes();
        let total = header.len as usize * vb;
        let what = format!("push of step {} to shard {}", header.step, self.shard);
        let mut cov = crate::datalink::Coverage::new(total as u64, self.wire);
        let mut whole = bytes::BytesMut::zeroed(total);
        for (at, b) in pieces {
            let at = at * vb;
            cov.add(at as u64, b.len() as u64, &what)
                .map_err(|e| ClientError::Incomplete(e.to_string()))?;
            whole[at..at + b.len()].copy_from_slice(b);
        }
        if let Some((a, b)) = cov.first_gap() {
            return Err(ClientError::Incomplete(format!(
                "{what}: its pieces stopped with bytes {a}..{b} of {total} missing (the gradient was not computed to the end)"
            )));
        }
        Ok(whole.freeze())
    }

    /// [`ShardClient::push`], made again after a retryable failure (up to [`PUSH_RETRIES`]
    /// times, with backoff): the shard acknowledges a retry of a gradient it already counted
    /// without counting it twice.
    pub async fn push_retrying(
        &self,
        header: PushHeader,
        bytes: &Bytes,
        chunk_bytes: usize,
    ) -> Result<PushReply, ClientError> {
        let mut attempt = 0;
        loop {
            match self.push(header, bytes, chunk_bytes).await {
                Err(e) if e.is_retryable() && attempt < PUSH_RETRIES => {
                    attempt += 1;
                    tracing::warn!(
                        "push of step {} to shard {} failed ({e}); retry {attempt}",
                        header.step,
                        self.shard
                    );
                    tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                }
                r => return r,
            }
        }
    }

    /// Leaves, reporting this rank's share of the final evaluation.
    pub async fn leave(&mut self, mut req: LeaveRequest) -> Result<(), ClientError> {
        if req.lease.is_none() {
            req.lease = self.leases.of(req.rank);
        }
        let refused = refused(self.shard, format!("shard {}: leave refused", self.shard));
        let (shard, addr, deadline) = self.bound();
        let addr = addr.to_string();
        let call = async { self.rpc.leave(req).await.map(drop).map_err(refused) };
        bounded((shard, &addr, deadline), || "the leave".into(), call).await
    }

    /// Sends this worker's frozen parameters and buffers (fingerprints) to be checked against
    /// the first worker's.
    pub async fn check_constants(&mut self, mut req: ConstantsRequest) -> Result<(), ClientError> {
        if req.lease.is_none() {
            req.lease = self.leases.of(req.rank);
        }
        let what = format!(
            "shard {}: frozen parameters and buffers refused",
            self.shard
        );
        let refused = refused(self.shard, what);
        let (shard, addr, deadline) = self.bound();
        let addr = addr.to_string();
        let call = async {
            self.rpc
                .check_constants(req)
                .await
                .map(drop)
                .map_err(refused)
        };
        bounded(
            (shard, &addr, deadline),
            || "the check of the frozen parameters".into(),
            call,
        )
        .await
    }

    /// Puts rank 0's buffers after the forward pass of a step (the shard holding them).
    pub async fn put_buffers(
        &mut self,
        mut req: ps_proto::pb::BuffersPut,
    ) -> Result<(), ClientError> {
        if req.lease.is_none() {
            req.lease = self.leases.of(req.rank);
        }
        let what = format!("shard {}: buffers of step {} refused", self.shard, req.step);
        let refused = refused(self.shard, what);
        let (shard, addr, deadline) = self.bound();
        let addr = addr.to_string();
        let call = async { self.rpc.put_buffers(req).await.map(drop).map_err(refused) };
        bounded((shard, &addr, deadline), || "the buffers put".into(), call).await
    }

    /// The buffers of a version (the shard waits for the version, bounded by its pull timeout).
    pub async fn get_buffers(
        &mut self,
        mut req: ps_proto::pb::BuffersRequest,
    ) -> Result<ps_proto::pb::BuffersReply, ClientError> {
        if req.lease.is_none() {
            req.lease = self.leases.of(req.rank);
        }
        let what = format!(
            "shard {}: buffers of version {} refused",
            self.shard, req.version
        );
        let refused = refused(self.shard, what);
        let (shard, addr, deadline) = self.bound();
        let addr = addr.to_string();
        let call = async {
            self.rpc
                .get_buffers(req)
                .await
                .map(tonic::Response::into_inner)
                .map_err(refused)
        };
        bounded(
            (shard, &addr, deadline),
            || "the buffers asked".into(),
            call,
        )
        .await
    }

    /// Marks the tensors this worker's backward of a step did not reach, before its push.
    pub async fn mark_unused(&mut self, mut req: UnusedRequest) -> Result<(), ClientError> {
        if req.lease.is_none() {
            req.lease = self.leases.of(req.rank);
        }
        let what = format!("shard {}: unused-tensor mark refused", self.shard);
        let refused = refused(self.shard, what);
        let (shard, addr, deadline) = self.bound();
        let addr = addr.to_string();
        let call = async { self.rpc.mark_unused(req).await.map(drop).map_err(refused) };
        bounded(
            (shard, &addr, deadline),
            || "the unused-tensor mark".into(),
            call,
        )
        .await
    }
}

/// What a worker shares with one shard through memory: the shard's parameters board (pulls)
/// and whether the shard reads this worker's gradient board (pushes).
#[derive(Debug, Default)]
pub struct ShmLink {
    /// The shard's parameters board, where this process can open it (shared with the task
    /// that pulls a step's weights while the step computes).
    pub params: Option<std::sync::Arc<Board>>,
    /// The shard reads this worker's gradient board: pushes send the header alone.
    pub grad: bool,
}

impl ShmLink {
    /// The link a registration reply offers. The parameters board is opened with the reply's
    /// token; one that cannot be (the shard is on another host) means gRPC pulls, said once.
    pub fn open(reply: &RegisterReply, shard: usize) -> Self {
        let params = (!reply.shm_dir.is_empty())
            .then(|| {
                let path = params_path(Path::new(&reply.shm_dir));
                Board::open(&path, reply.shm_token, reply.len as usize, 2)
                    .map_err(|why| {
                        tracing::info!(
                            "shard {shard}: shared memory not usable from here ({why}); pulling through gRPC"
                        )
                    })
                    .ok()
                    .map(std::sync::Arc::new)
            })
            .flatten();
        Self {
            params,
            grad: reply.grad_shm,
        }
    }

    /// "shared memory", "gRPC", or which way each direction goes.
    pub fn describe(&self) -> &'static str {
        match (self.params.is_some(), self.grad) {
            (true, true) => "shared memory",
            (false, false) => "gRPC",
            (true, false) => "pull shared memory, push gRPC",
            (false, true) => "pull gRPC, push shared memory",
        }
    }
}

#[cfg(test)]
mod tests;
