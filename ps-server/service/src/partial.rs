//! Partial gRPC messages in the shard's memory budget. tonic's decoder buffers each request
//! message whole before a handler sees it: on a message's 5-byte gRPC header it reserves the
//! length the header declares, and it keeps reading the stream until that many bytes are in.
//! A client that declares large messages and stalls half-way would hold that memory outside
//! every other bound (HTTP/2 flow control does not help: the decoder keeps granting window).
//!
//! [`Budgeted`] wraps the shard's gRPC service so that every request body is a [`Counted`]
//! body: it reads the gRPC framing as the bytes arrive, and from the header of a stream's
//! largest message until the stream ends, the stream holds that many bytes of the shard's
//! [`PartialBudget`] ([`partial_message_budget`], a part of the shard's memory plan). A message whose header would
//! take the budget past its limit is refused with RESOURCE_EXHAUSTED, naming the budget,
//! before any of its bytes are buffered; a partial message that makes no progress for
//! `[server] stream_idle_secs` is ended with DEADLINE_EXCEEDED. When a stream ends (its body
//! is dropped: the call returned, failed or was reset) its bytes go back to the budget.

use bytes::{Buf, Bytes};
use http_body::Frame;
use ps_config::Config;
use ps_proto::PsError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;

/// What a push chunk's message carries beside its `[server] chunk_bytes` of values (lease,
/// header, offset, framing), rounded up generously.
pub const CHUNK_OVERHEAD: u64 = 4 << 10;

/// The most bytes of partial gRPC messages (received in part; tonic buffers a message whole
/// before a handler sees it) a shard holds at once: one push chunk per rank, `[cluster]
/// workers x ([server] chunk_bytes + CHUNK_OVERHEAD)`, and one message of the largest size
/// a shard accepts (`MAX_MESSAGE_BYTES`: rank 0's buffers). Enforced by [`Budgeted`].
pub fn partial_message_budget(cfg: &Config) -> u64 {
    cfg.cluster.workers as u64 * (cfg.server.chunk_bytes as u64 + CHUNK_OVERHEAD)
        + ps_net::wire::MAX_MESSAGE_BYTES as u64
}

/// The gRPC message header: a compression flag and a big-endian u32 length.
const HEADER: usize = 5;

/// Bytes of partial gRPC messages a shard may hold at once, and how many it holds.
#[derive(Debug)]
pub struct PartialBudget {
    limit: u64,
    held: AtomicU64,
    shard: usize,
    /// A stream that held [`TRIM_AT`] or more has ended: trims still to make.
    trim_due: AtomicU32,
}

impl PartialBudget {
    /// A budget of `limit` bytes for shard `shard`.
    pub fn new(limit: u64, shard: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            held: AtomicU64::new(0),
            shard,
            trim_due: AtomicU32::new(0),
        })
    }

    /// Until the budget is dropped: every [`TRIM_EVERY`], after a stream that held
    /// [`TRIM_AT`] or more has ended, returns free heap memory to the system. glibc keeps a
    /// large buffer freed inside a thread's arena as part of the process until `malloc_trim`
    /// (measured: a 60 MiB partial message left the shard's RSS 60 MiB higher after its
    /// stream ended). Not at the drop itself: the decoder's buffer is freed after its body.
    pub async fn trim_when_due(budget: std::sync::Weak<Self>) {
        loop {
            tokio::time::sleep(TRIM_EVERY).await;
            let Some(b) = budget.upgrade() else { return };
            let due = b.trim_due.load(Ordering::Acquire);
            if due > 0 {
                let _ =
                    b.trim_due
                        .compare_exchange(due, due - 1, Ordering::AcqRel, Ordering::Acquire);
                #[cfg(all(target_os = "linux", target_env = "gnu"))]
                let _ = tokio::task::spawn_blocking(|| {
                    // SAFETY: malloc_trim has no preconditions.
                    unsafe { libc::malloc_trim(0) };
                })
                .await;
                tracing::debug!(
                    "shard {}: freed memory returned to the system after a partial message of {} bytes or more ended",
                    b.shard,
                    TRIM_AT
                );
            }
        }
    }

    /// Bytes held now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// Takes `n` more bytes for a message of `len` bytes, or refuses when that would pass the
    /// limit (nothing is taken then).
    fn take(&self, n: u64, len: u64) -> Result<(), Status> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                (h + n <= self.limit).then_some(h + n)
            })
            .map(drop)
            .map_err(|held| {
                Status::from(PsError::OverBudget(format!(
                    "a gRPC message of {len} bytes would take shard {}'s budget for partial messages past its {} bytes ({held} held by other messages under way; the budget is [cluster] workers x ([server] chunk_bytes + {}) + {} bytes): send it again later, or in smaller pieces",
                    self.shard,
                    self.limit,
                    CHUNK_OVERHEAD,
                    ps_net::wire::MAX_MESSAGE_BYTES,
                )))
            })
    }

    fn give(&self, n: u64) {
        self.held.fetch_sub(n, Ordering::AcqRel);
    }
}

/// A request body whose partial messages count in a [`PartialBudget`] (see the module).
pub struct Counted {
    inner: Body,
    budget: Arc<PartialBudget>,
    /// The header being read, and how much of it.
    header: [u8; HEADER],
    header_len: usize,
    /// Bytes of the current message still to come.
    left: u64,
    /// Bytes of the budget this stream holds (its largest message so far).
    holding: u64,
    /// How long a partial message may make no progress.
    idle: Duration,
    /// Armed while a partial message waits for bytes.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Counted {
    /// `inner`, counted in `budget`; a partial message idle for `idle` is ended.
    pub fn new(inner: Body, budget: Arc<PartialBudget>, idle: Duration) -> Self {
        Self {
            inner,
            budget,
            header: [0; HEADER],
            header_len: 0,
            left: 0,
            holding: 0,
            idle,
            stalled: None,
        }
    }

    /// Reads the framing of `data`; takes from the budget on each header larger than what
    /// the stream holds.
    fn scan(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.left > 0 {
                let n = (self.left as usize).min(data.len());
                self.left -= n as u64;
                data.advance(n);
                continue;
            }
            let n = (HEADER - self.header_len).min(data.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&data[..n]);
            self.header_len += n;
            data.advance(n);
            if self.header_len == HEADER {
                self.header_len = 0;
                let len = u64::from(u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]));
                if len > self.holding {
                    self.budget.take(len - self.holding, len)?;
                    self.holding = len;
                }
                self.left = len;
            }
        }
        Ok(())
    }

    /// Whether a message has begun and not ended.
    fn partial(&self) -> bool {
        self.left > 0 || self.header_len > 0
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.budget.give(self.holding);
        if self.holding >= TRIM_AT {
            self.budget.trim_due.store(TRIMS, Ordering::Release);
        }
    }
}

/// A stream that held at least this much has its freed memory returned to the system after it
/// ends ([`PartialBudget::trim_when_due`]); honest pushes (one `[server] chunk_bytes` chunk at
/// a time) stay below it.
pub const TRIM_AT: u64 = 16 << 20;

/// How many times [`PartialBudget::trim_when_due`] trims after such a stream ends.
const TRIMS: u32 = 4;

/// How often [`PartialBudget::trim_when_due`] looks.
const TRIM_EVERY: Duration = Duration::from_millis(500);

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => {
                if this.partial() {
                    let idle = this.idle;
                    let timer = this
                        .stalled
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                    if timer.as_mut().poll(cx).is_ready() {
                        this.stalled = None;
                        return Poll::Ready(Some(Err(PsError::Timeout(format!(
                            "a gRPC message stalled part-way: no bytes for {idle:?} ([server] stream_idle_secs)"
                        ))
                        .into())));
                    }
                }
                Poll::Pending
            }
            Poll::Ready(Some(Ok(frame))) => {
                this.stalled = None;
                if let Some(data) = frame.data_ref()
                    && let Err(e) = this.scan(data)
                {
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A gRPC service whose request bodies are [`Counted`] in one [`PartialBudget`].
#[derive(Debug, Clone)]
pub struct Budgeted<S> {
    inner: S,
    budget: Arc<PartialBudget>,
    idle: Duration,
}

impl<S> Budgeted<S> {
    /// `inner`, its requests counted in `budget`; a partial message idle for `idle` is ended.
    pub fn new(inner: S, budget: Arc<PartialBudget>, idle: Duration) -> Self {
        Self {
            inner,
            budget,
            idle,
        }
    }
}

impl<S> Service<http::Request<Body>> for Budgeted<S>
where
    S: Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let (budget, idle) = (self.budget.clone(), self.idle);
        self.inner
            .call(req.map(|b| Body::new(Counted::new(b, budget, idle))))
    }
}

impl<S: NamedService> NamedService for Budgeted<S> {
    const NAME: &'static str = S::NAME;
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn framed(len: u32, sent: usize) -> Bytes {
        let mut b = vec![0u8];
        b.extend_from_slice(&len.to_be_bytes());
        b.resize(HEADER + sent, 7);
        Bytes::from(b)
    }

    /// A body whose frames are `chunks`, counted in `budget`.
    fn counted(chunks: Vec<Bytes>, budget: &Arc<PartialBudget>) -> Counted {
        counted_then_stalled(chunks, budget, false, Duration::from_secs(60))
    }

    /// [`counted`], which then never sends again when `stall` (instead of ending), with
    /// `idle`.
    fn counted_then_stalled(
        chunks: Vec<Bytes>,
        budget: &Arc<PartialBudget>,
        stall: bool,
        idle: Duration,
    ) -> Counted {
        use futures::StreamExt;
        let s = futures::stream::iter(chunks.into_iter().map(|c| Ok::<_, Status>(Frame::data(c))));
        let s = if stall {
            s.chain(futures::stream::pending()).boxed()
        } else {
            s.boxed()
        };
        Counted::new(
            Body::new(http_body_util::StreamBody::new(s)),
            budget.clone(),
            idle,
        )
    }

    #[tokio::test]
    async fn a_partial_message_that_stalls_is_ended_after_the_idle_time() {
        let budget = PartialBudget::new(1000, 0);
        let idle = Duration::from_millis(50);
        let mut a = counted_then_stalled(vec![framed(500, 10)], &budget, true, idle);
        a.frame().await.unwrap().unwrap();
        let e = tokio::time::timeout(Duration::from_secs(10), a.frame())
            .await
            .expect("ended, not left waiting")
            .unwrap()
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        assert!(e.message().contains("stream_idle_secs"), "{e:?}");
        drop(a);
        assert_eq!(budget.held(), 0);
        // between messages a stream may wait as long as it likes
        let mut b = counted_then_stalled(vec![framed(10, 10)], &budget, true, idle);
        b.frame().await.unwrap().unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(300), b.frame())
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn streams_hold_their_largest_message_until_dropped_and_excess_is_refused() {
        let budget = PartialBudget::new(1000, 3);
        // two messages of 300 and 600 bytes, the second split across frames: holds 600
        let mut a = counted(
            vec![
                framed(300, 300),
                framed(600, 100),
                Bytes::from(vec![1; 500]),
            ],
            &budget,
        );
        while let Some(f) = a.frame().await {
            f.unwrap();
        }
        assert_eq!(budget.held(), 600);
        // 600 + 500 > 1000: refused at the header, nothing more taken
        let mut b = counted(vec![framed(500, 0)], &budget);
        let e = b.frame().await.unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(
            e.message()
                .contains("shard 3's budget for partial messages past its 1000 bytes (600 held"),
            "{e:?}"
        );
        assert_eq!(budget.held(), 600);
        drop(a);
        drop(b);
        assert_eq!(budget.held(), 0);
        let mut c = counted(vec![framed(1000, 10)], &budget);
        c.frame().await.unwrap().unwrap();
        assert_eq!(budget.held(), 1000);
    }
}
