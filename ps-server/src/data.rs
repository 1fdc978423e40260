//! The shard's end of the tensor data connections (`ps_common::datalink`): a listener beside
//! the gRPC one, the hello check (token, run id, rank), and one connection per rank, split into
//! the half pushes read and the half pulls write. A newer hello of a rank replaces its
//! connection; a request that fails on a connection drops it.

use ps_common::PsError;
use ps_common::auth::Token;
use ps_common::datalink::{HELLO_NO, HELLO_OK, Hello};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Mutex;

/// Metadata key of a push or pull that moves its values on the data connection of this rank.
pub const DATA_RANK_KEY: &str = "x-ps-data-rank";

/// Every rank's data connection.
#[derive(Debug)]
pub struct DataConns {
    /// The port the listener is bound to.
    pub port: u16,
    reads: Vec<Mutex<Option<OwnedReadHalf>>>,
    writes: Vec<Mutex<Option<OwnedWriteHalf>>>,
}

/// What a hello must carry.
#[derive(Debug, Clone)]
pub struct Expect {
    /// The cluster token, if there is one.
    pub token: Option<Token>,
    /// The run id (empty: unnamed).
    pub run_id: String,
    /// The shard's index (for the log).
    pub shard: usize,
}

impl DataConns {
    /// Serves hellos on `listener` for ranks `0..world` until the task is dropped.
    pub fn serve(
        listener: TcpListener,
        world: usize,
        expect: Expect,
        idle: Duration,
    ) -> std::io::Result<Arc<Self>> {
        let port = listener.local_addr()?.port();
        let conns = Arc::new(Self {
            port,
            reads: (0..world).map(|_| Mutex::new(None)).collect(),
            writes: (0..world).map(|_| Mutex::new(None)).collect(),
        });
        let weak = Arc::downgrade(&conns);
        tokio::spawn(async move {
            let mut failed = crate::accept::Throttle::default();
            loop {
                let (sock, peer) = match listener.accept().await {
                    Ok(s) => s,
                    Err(e) => {
                        // out of descriptors and the like: wait, then go on accepting; said
                        // once per accept::LOG_EVERY with a count, not every 100 ms
                        if let Some((n, total)) = failed.hit() {
                            tracing::warn!(
                                "shard {}: cannot accept data connections: {e} ({n} times since the last report, {total} in all): retrying every 100 ms",
                                expect.shard
                            );
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Some(conns) = weak.upgrade() else { return };
                let expect = expect.clone();
                tokio::spawn(async move {
                    if let Err(e) = conns.hello(sock, &expect, idle).await {
                        tracing::warn!(
                            "shard {}: data connection from {peer} refused: {e}",
                            expect.shard
                        );
                    }
                });
            }
        });
        Ok(conns)
    }

    async fn hello(
        &self,
        mut sock: tokio::net::TcpStream,
        expect: &Expect,
        idle: Duration,
    ) -> Result<(), PsError> {
        let _ = sock.set_nodelay(true);
        let h = match tokio::time::timeout(idle, Hello::read(&mut sock)).await {
            Err(_) => {
                return Err(PsError::Timeout(format!(
                    "no hello within {:.1} s (stream_idle_secs)",
                    idle.as_secs_f64()
                )));
            }
            Ok(h) => h?,
        };
        let refusal = if let Some(t) = &expect.token
            && !t.matches(&h.token)
        {
            Some(PsError::Unauthenticated(format!(
                "data connection of rank {}: {} token",
                h.rank,
                if h.token.is_empty() { "no" } else { "a wrong" }
            )))
        } else if h.run_id != expect.run_id {
            Some(PsError::ClusterMismatch(format!(
                "data connection of rank {} for run {:?}: this shard serves run {:?}",
                h.rank, h.run_id, expect.run_id
            )))
        } else if h.rank as usize >= self.reads.len() {
            Some(PsError::BadChunk(format!(
                "data connection of unknown rank {}: expected a rank in 0..{}",
                h.rank,
                self.reads.len()
            )))
        } else {
            None
        };
        if let Some(e) = refusal {
            let _ = sock.write_all(&[HELLO_NO]).await;
            return Err(e);
        }
        // the halves are in place before the client hears "ok": a push or pull it sends at
        // once must find them (a pull waits on the write half's lock until then)
        let (r, mut w) = sock.into_split();
        let rank = h.rank as usize;
        *self.reads[rank].lock().await = Some(r);
        let mut write_slot = self.writes[rank].lock().await;
        match tokio::time::timeout(idle, w.write_all(&[HELLO_OK])).await {
            Ok(Ok(())) => {}
            // a dead connection: the read half left in place fails its first push, which
            // drops it and makes the client open another
            Ok(Err(e)) => return Err(PsError::BadChunk(format!("data connection: {e}"))),
            Err(_) => {
                return Err(PsError::Timeout(
                    "data connection: the hello's answer was not taken".into(),
                ));
            }
        }
        *write_slot = Some(w);
        drop(write_slot);
        tracing::debug!(shard = expect.shard, rank, "data connection opened");
        Ok(())
    }

    /// Takes `rank`'s read half (a push's frame is read from it), None when it has none.
    pub async fn take_read(&self, rank: u32) -> Option<OwnedReadHalf> {
        self.reads.get(rank as usize)?.lock().await.take()
    }

    /// Gives a read half back after a frame was read in full (unless a newer hello replaced it).
    pub async fn put_read(&self, rank: u32, r: OwnedReadHalf) {
        if let Some(slot) = self.reads.get(rank as usize) {
            let mut s = slot.lock().await;
            if s.is_none() {
                *s = Some(r);
            }
        }
    }

    /// Drops `rank`'s read half (a push that failed before its frame was read in full: what is
    /// left of the frame must never be taken for the next one).
    pub async fn drop_read(&self, rank: u32) {
        if let Some(slot) = self.reads.get(rank as usize) {
            slot.lock().await.take();
        }
    }

    /// Takes `rank`'s write half now if nobody is writing on it.
    pub fn try_take_write(&self, rank: u32) -> Option<OwnedWriteHalf> {
        self.writes.get(rank as usize)?.try_lock().ok()?.take()
    }

    /// Gives a write half back after a frame was written in full.
    pub async fn put_write(&self, rank: u32, w: OwnedWriteHalf) {
        if let Some(slot) = self.writes.get(rank as usize) {
            let mut s = slot.lock().await;
            if s.is_none() {
                *s = Some(w);
            }
        }
    }
}
