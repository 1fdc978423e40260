//! The planes a request's values travel on, seen from the client. The gRPC call is always the
//! control channel (the request, its header, the shard's answer); the values go on one of
//! three planes ([`Plane`]): in the call's own chunks, as one frame on the tensor data
//! connection ([`DataLink`], `crate::datalink`), or through a shared-memory board
//! (`crate::shm`). A pull has one path ([`ShardClient::pull_on`]: ask on a plane, read the
//! values from the plane the shard answered on, fall back to chunks when a plane fails) and a
//! push one ([`ShardClient::open_push_plane`] picks the plane, [`ShardClient::push_on_link`]
//! writes a frame whole or piece by piece, [`ShardClient::push_chunks_call`] the rest).

use super::{ClientError, PieceReceiver, ShardClient, refused, with_lease};
use crate::shm::Board;
use crate::sink::PullSink;
use bytes::Bytes;
use ps_proto::keys::DATA_RANK_KEY;
use ps_proto::pb::{Lease, PullRequest, PushChunk, PushHeader, PushReply};
use std::time::Duration;
use std::time::Instant;
use tonic::Status;

/// Longest a read or write on a data connection may wait for progress before the request is
/// given up (a pull then falls back to gRPC chunks; a push is retried).
pub const DATA_IDLE: Duration = Duration::from_secs(60);

/// How a request's values travel between a client and its shard (the gRPC call carries the
/// request and the answer whatever the plane).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    /// In the gRPC call's own chunks.
    Chunks,
    /// As one frame on the tensor data connection (`crate::datalink`).
    DataLink,
    /// Through shared memory: the shard's parameters board (a pull), this worker's gradient
    /// board (a push, whose call is then the header alone).
    Board,
}

/// Why the values of a push could not be written on the data connection.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The connection failed under the write.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A write made no progress for [`DATA_IDLE`].
    #[error("no progress for {0:?}")]
    Stalled(Duration),
    /// The pieces of a progressive push stopped before they covered the range.
    #[error("the gradient's pieces stopped at {covered} of {total} bytes")]
    PiecesStopped {
        /// Bytes written.
        covered: usize,
        /// Bytes of the range.
        total: usize,
    },
}

/// The values of one push on the data connection: a whole range, or the pieces of a
/// progressive push as they arrive (each kept in `got`, whose buffers the caller reuses).
pub(super) enum Frame<'a> {
    /// The whole range, encoded.
    Whole(&'a Bytes),
    /// The pieces, each its offset in values and its encoded bytes.
    Pieces {
        /// Where they come from.
        pieces: &'a mut Feed,
        /// Those written so far.
        got: &'a mut Vec<(usize, Bytes)>,
    },
}

/// The pieces of a progressive push as the backward pass hands them over, with how far they
/// got: what a push whose deadline passed says of the backward pass that feeds it.
#[derive(Debug)]
pub struct Feed {
    rx: PieceReceiver,
    /// Bytes received so far.
    pub(super) bytes: usize,
    /// The sender is gone: no piece comes any more.
    pub(super) ended: bool,
    /// When the last piece came (or the feed was made).
    pub(super) last: Instant,
}

impl Feed {
    /// A feed of `rx`'s pieces.
    pub fn new(rx: PieceReceiver) -> Self {
        Self {
            rx,
            bytes: 0,
            ended: false,
            last: Instant::now(),
        }
    }

    /// The next piece, None once the sender is gone.
    pub(super) async fn recv(&mut self) -> Option<(usize, Bytes)> {
        let p = self.rx.recv().await;
        match &p {
            Some((_, b)) => {
                self.bytes += b.len();
                self.last = Instant::now();
            }
            None => self.ended = true,
        }
        p
    }
}

/// The plane a push goes on, opened: the data connection (its stream taken), or a gRPC call
/// carrying the values in chunks (or no values: a shared-memory push).
pub(super) enum PushPlane<'a> {
    /// The values as one frame on `link`'s connection `conn`.
    Link(&'a DataLink, tokio::net::TcpStream),
    /// The values (if any) in the call's chunks.
    Call,
}

/// A worker's tensor data connection to one shard (`crate::datalink`), opened on first use
/// and again after a request that failed on it.
#[derive(Debug)]
pub(super) struct DataLink {
    /// `host:port` of the shard's data listener.
    pub(super) target: String,
    /// The hello this worker opens it with.
    pub(super) hello: Vec<u8>,
    /// The rank, as the requests' metadata names it.
    pub(super) rank: tonic::metadata::AsciiMetadataValue,
    /// The same rank as a number.
    pub(super) rank_number: u32,
    pub(super) conn: tokio::sync::Mutex<Option<tokio::net::TcpStream>>,
    /// A connection could not be made (a firewall, a port not forwarded): gRPC chunks from then
    /// on, without waiting for a connect timeout on every request.
    pub(super) unreachable: std::sync::atomic::AtomicBool,
}

impl DataLink {
    /// The open connection, or a new one (hello answered by the shard).
    pub(super) async fn take(&self) -> std::io::Result<tokio::net::TcpStream> {
        use std::sync::atomic::Ordering;
        if let Some(c) = self.conn.lock().await.take() {
            return Ok(c);
        }
        if self.unreachable.load(Ordering::Relaxed) {
            return Err(std::io::Error::other(format!(
                "{} could not be reached before",
                self.target
            )));
        }
        let connected = tokio::time::timeout(
            super::CONNECT_ATTEMPT,
            tokio::net::TcpStream::connect(&self.target),
        )
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))
        .and_then(|r| r);
        let mut c = match connected {
            Ok(c) => c,
            Err(e) => {
                self.unreachable.store(true, Ordering::Relaxed);
                tracing::warn!(
                    "cannot connect to the shard's data port {} ({e}): pushes and pulls go through gRPC chunks",
                    self.target
                );
                return Err(e);
            }
        };
        if let Err(e) = self.hello(&mut c).await {
            self.unreachable.store(true, Ordering::Relaxed);
            tracing::warn!(
                "data connection to {}: {e}: pushes and pulls go through gRPC chunks",
                self.target
            );
            return Err(e);
        }
        Ok(c)
    }

    /// Says this worker's hello on `c` and reads the shard's answer (bounded).
    async fn hello(&self, c: &mut tokio::net::TcpStream) -> std::io::Result<()> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        c.set_nodelay(true)?;
        c.write_all(&self.hello).await?;
        let mut answer = [0u8; 1];
        tokio::time::timeout(super::CONNECT_ATTEMPT, c.read_exact(&mut answer))
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer to the hello")
            })??;
        if answer[0] != crate::datalink::HELLO_OK {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "the shard refused the hello (token, run id or rank; see its log)",
            ));
        }
        Ok(())
    }

    /// Keeps a connection whose last frame went through in full.
    pub(super) async fn put(&self, c: tokio::net::TcpStream) {
        *self.conn.lock().await = Some(c);
    }
}

/// The gRPC half of a push whose values go on `link`: `header` alone, naming the connection's
/// rank so that the shard reads the frame from it.
fn header_on_link(
    link: &DataLink,
    header: PushHeader,
    lease: Option<Lease>,
) -> tonic::Request<tokio_stream::Iter<std::vec::IntoIter<PushChunk>>> {
    let mut request = tonic::Request::new(tokio_stream::iter(vec![PushChunk {
        header: Some(header),
        offset: 0,
        data: Bytes::new(),
        lease,
    }]));
    request
        .metadata_mut()
        .insert(DATA_RANK_KEY, link.rank.clone());
    request
}

/// `step`'s values (`total` bytes, `vb` per value) written as one frame on `conn`: whole
/// (bounded by [`DATA_IDLE`]), or as the pieces arrive (each write bounded by it), ending at the last byte of the range, not at the
/// sender's end (the shard may answer as soon as it has the last piece).
async fn write_frame(
    conn: &mut tokio::net::TcpStream,
    step: u64,
    (total, vb): (usize, usize),
    frame: Frame<'_>,
) -> Result<(), FrameError> {
    async fn idle<T>(
        w: impl std::future::Future<Output = std::io::Result<T>>,
    ) -> Result<T, FrameError> {
        Ok(tokio::time::timeout(DATA_IDLE, w)
            .await
            .map_err(|_| FrameError::Stalled(DATA_IDLE))??)
    }
    let (pieces, got) = match frame {
        Frame::Whole(bytes) => {
            return idle(crate::datalink::write_frame(conn, step, bytes)).await;
        }
        Frame::Pieces { pieces, got } => (pieces, got),
    };
    idle(crate::datalink::write_pieces_header(
        conn,
        step,
        total as u64,
    ))
    .await?;
    let mut covered = 0;
    while covered < total
        && let Some((at, b)) = pieces.recv().await
    {
        idle(crate::datalink::write_piece(conn, (at * vb) as u64, &b)).await?;
        covered += b.len();
        got.push((at, b));
    }
    if covered != total {
        // the shard must not wait for the rest: it sees the frame end here
        let _ = tokio::io::AsyncWriteExt::shutdown(conn).await;
        return Err(FrameError::PiecesStopped { covered, total });
    }
    idle(tokio::io::AsyncWriteExt::flush(conn)).await
}

impl ShardClient {
    /// The one pull path: asks for `version` with its values on `plane` (the data connection
    /// is opened before the shard is asked to write on it; one that cannot be means chunks),
    /// then reads them from the plane the shard answered on, into `sink`. Ok(false): the plane
    /// failed under the copy (the version left the board, the connection dropped); what was
    /// published is of `version`, and the caller asks again on chunks.
    pub(super) async fn pull_on(
        &mut self,
        plane: Plane,
        (version, exact): (u64, bool),
        board: Option<&Board>,
        sink: &mut dyn PullSink,
    ) -> Result<bool, ClientError> {
        let s = self.shard;
        let what = format!("pull of version {version} from shard {s} failed");
        let mut conn = None;
        if plane == Plane::DataLink
            && let Some(link) = self.data.clone()
        {
            match link.take().await {
                Ok(c) => conn = Some((link, c)),
                Err(e) => tracing::debug!(
                    "shard {s}: cannot open the data connection ({e}); pulling version {version} through gRPC"
                ),
            }
        }
        let mut request = tonic::Request::new(PullRequest {
            min_version: version,
            shm: plane == Plane::Board,
            exact,
            lease: self.leases.latest(),
        });
        if let Some((link, _)) = &conn {
            request
                .metadata_mut()
                .insert(DATA_RANK_KEY, link.rank.clone());
        }
        let mut stream = self
            .rpc
            .pull(request)
            .await
            .map_err(refused(s, what.clone()))?
            .into_inner();
        let first = stream
            .message()
            .await
            .map_err(refused(s, what.clone()))?
            .ok_or_else(|| self.bad("empty pull reply".into()))?;
        let h = self.pull_header(&first, version, sink.len())?;
        if h.data_tcp {
            let Some((link, c)) = conn else {
                return Err(self.bad(
                    "answered on the data connection, which this pull did not ask for".into(),
                ));
            };
            return Ok(self.pull_frame(&link, c, version, sink).await);
        }
        if let Some((link, c)) = conn {
            link.put(c).await; // answered with chunks: the connection is unused
        }
        if h.shm {
            let board = board.filter(|_| plane == Plane::Board).ok_or_else(|| {
                self.bad("answered through shared memory, which this pull did not ask for".into())
            })?;
            return Ok(self.pull_board(board, version, sink));
        }
        self.pull_chunks(first, &mut stream, sink, &what)
            .await
            .map(|()| true)
    }

    /// Reads version `version`'s frame from the data connection `c` into `sink` (empty: the
    /// data connection is only ever a pull's first try); false, the connection dropped, when
    /// it fails.
    async fn pull_frame(
        &self,
        link: &DataLink,
        mut c: tokio::net::TcpStream,
        version: u64,
        sink: &mut dyn PullSink,
    ) -> bool {
        let s = self.shard;
        let what = format!("pull of version {version} from shard {s}");
        let read = async {
            crate::datalink::read_frame_header(
                &mut c,
                version,
                4 * sink.len() as u64,
                &what,
                DATA_IDLE,
            )
            .await?;
            debug_assert_eq!(sink.filled(), 0, "a data frame after a partial pull");
            while sink.filled() < sink.len() {
                let n = sink.piece_end().max(sink.filled() + 1) - sink.filled();
                crate::datalink::read_values(&mut c, sink.next(n), &what, DATA_IDLE).await?;
                sink.publish(n);
            }
            Ok::<_, ps_proto::PsError>(())
        };
        match read.await {
            Ok(()) => {
                link.put(c).await;
                true
            }
            Err(e) => {
                tracing::warn!(
                    "shard {s}: {e}; data connection dropped, pulling version {version} through gRPC"
                );
                false
            }
        }
    }

    /// Copies version `version` out of the shard's parameters `board` into `sink` (a large
    /// range on several threads, `Board::read_version_into`), off the async runtime's
    /// worker where the runtime has several (so that the shards' copies of one pull run at
    /// once); false when the version left the board during the copy. A sink that reads the
    /// slot in place (a device that registered the board: [`PullSink::in_place`]) takes it
    /// without a copy.
    fn pull_board(&self, board: &Board, version: u64, sink: &mut dyn PullSink) -> bool {
        if sink.filled() == 0
            && let Some(slot) = board.in_place(version)
            && sink.in_place(&slot)
        {
            return true;
        }
        let mut copy = || board.read_version_into(version, sink);
        let copied = match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(copy)
            }
            _ => copy(),
        };
        if !copied {
            tracing::warn!(
                "shard {}: version {version} left the shared-memory board during the copy; pulling it through gRPC",
                self.shard
            );
        }
        copied
    }

    /// The data connection a push of `header` goes on, when it has one: the connection speaks
    /// for the rank registered last (a client pushing for several ranks, in tests, sends the
    /// others' through gRPC chunks), and a shared-memory push or one without values
    /// (`has_values` false) has nothing to send on it.
    pub(super) fn link_for(&self, header: &PushHeader, has_values: bool) -> Option<&DataLink> {
        self.data
            .as_deref()
            .filter(|l| l.rank_number == header.rank && !header.shm && has_values)
    }

    /// The plane a push of `header` goes on, opened: the data connection where it has one and
    /// it opens, else the gRPC call (chunks, or the header alone for a shared-memory push).
    pub(super) async fn open_push_plane(
        &self,
        header: &PushHeader,
        has_values: bool,
    ) -> PushPlane<'_> {
        let Some(link) = self.link_for(header, has_values) else {
            return PushPlane::Call;
        };
        match link.take().await {
            Ok(conn) => PushPlane::Link(link, conn),
            Err(e) => {
                tracing::debug!(
                    "shard {}: cannot open the data connection ({e}); pushing step {} through gRPC",
                    self.shard,
                    header.step
                );
                PushPlane::Call
            }
        }
    }

    /// A push whose values go in the gRPC call's chunks (`bytes`; empty when `header.shm` says
    /// the gradient is in this worker's board).
    pub(super) async fn push_chunks_call(
        &self,
        header: PushHeader,
        bytes: &Bytes,
        chunk_bytes: usize,
    ) -> Result<PushReply, ClientError> {
        let msgs = with_lease(
            super::push_messages_of(header, bytes, chunk_bytes, self.wire.value_bytes()),
            self.leases.of(header.rank),
        );
        self.rpc
            .clone()
            .push(tokio_stream::iter(msgs))
            .await
            .map(tonic::Response::into_inner)
            .map_err(refused(self.shard, self.refused_push(header.step)))
    }

    /// A push whose values go as one frame (`frame`: whole or piece by piece) on the data
    /// connection `conn`, the header on gRPC: the frame is written while the call waits for
    /// the shard's answer. Any failure drops the connection (a retry opens a new one); one
    /// that is not the shard's refusal is said as `Unavailable`, which a retry may overcome.
    pub(super) async fn push_on_link(
        &self,
        link: &DataLink,
        mut conn: tokio::net::TcpStream,
        header: PushHeader,
        frame: Frame<'_>,
    ) -> Result<PushReply, ClientError> {
        let vb = self.wire.value_bytes();
        let total = header.len as usize * vb;
        let mut rpc = self.rpc.clone();
        let call = rpc.push(header_on_link(link, header, self.leases.of(header.rank)));
        tokio::pin!(call);
        let (reply, written) = {
            let write = write_frame(&mut conn, header.step, (total, vb), frame);
            tokio::pin!(write);
            let mut written: Option<Result<(), FrameError>> = None;
            let reply = loop {
                tokio::select! {
                    biased;
                    w = &mut write, if written.is_none() => written = Some(w),
                    r = &mut call => break r,
                }
            };
            if written.is_none() && reply.is_ok() {
                // accepted: the last byte is written; let the writer say so
                let w = tokio::time::timeout(DATA_IDLE, &mut write).await;
                written = Some(w.unwrap_or(Err(FrameError::Stalled(DATA_IDLE))));
            }
            (reply, written)
        };
        self.settle_link_push(link, conn, header.step, reply, written)
            .await
    }

    /// What a refusal of this client's push of `step` says it was.
    pub(super) fn refused_push(&self, step: u64) -> String {
        format!("shard {} refused the gradient of step {step}", self.shard)
    }

    /// The outcome of a push on a data connection from the shard's `reply` and what became of
    /// its frame (`written`, None when the reply came first): the connection goes back to
    /// `link` when both succeeded; a retryable refusal whose frame failed says why the frame
    /// failed.
    async fn settle_link_push(
        &self,
        link: &DataLink,
        conn: tokio::net::TcpStream,
        step: u64,
        reply: Result<tonic::Response<PushReply>, Status>,
        written: Option<Result<(), FrameError>>,
    ) -> Result<PushReply, ClientError> {
        match (reply, written) {
            (Ok(r), Some(Ok(()))) => {
                link.put(conn).await;
                Ok(r.into_inner())
            }
            (Ok(_), _) => Err(self.bad(format!(
                "accepted the gradient of step {step} before its frame was written"
            ))),
            (Err(st), Some(Err(e))) if super::is_retryable_code(st.code()) => {
                Err(ClientError::Refused {
                    shard: self.shard,
                    what: self.refused_push(step),
                    status: Status::unavailable(format!("data connection: {e}")),
                })
            }
            (Err(st), _) => Err(refused(self.shard, self.refused_push(step))(st)),
        }
    }
}
