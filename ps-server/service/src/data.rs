//! The shard's end of the tensor data connections (`ps_net::datalink`): a listener beside
//! the gRPC one, the hello check (token, run id, and the rank's lease: `crate::lease`), and one
//! connection per rank, split into the half pushes read and the half pulls write. Each
//! connection is bound to the lease its hello presented: taking a half checks that lease again,
//! so a connection of a lease the rank no longer holds carries no frame. A newer hello of the
//! rank's holder replaces its connection; a request refused or failed on a connection closes
//! it (both halves).

use crate::lease::Leases;
use ps_net::auth::Token;
use ps_net::datalink::{HELLO_NO, HELLO_OK, Hello};
use ps_proto::pb::Lease;
use ps_proto::{PsError, PsResult};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Mutex;

pub use ps_proto::keys::DATA_RANK_KEY;

/// Every rank's data connection.
#[derive(Debug)]
pub struct DataConns {
    /// The port the listener is bound to.
    pub port: u16,
    reads: Vec<Mutex<Option<OwnedReadHalf>>>,
    writes: Vec<Mutex<Option<OwnedWriteHalf>>>,
    /// Each rank's connection: the lease its hello presented, and a number that changes with
    /// every new or closed connection (a half taken out goes back only to the same one).
    bound: std::sync::Mutex<Vec<(Option<Lease>, u64)>>,
    leases: Arc<Leases>,
}

/// A half of a rank's data connection, taken out for one frame; `epoch` names the connection.
#[derive(Debug)]
pub struct Taken<H> {
    /// The half.
    pub half: H,
    epoch: u64,
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
        leases: Arc<Leases>,
    ) -> std::io::Result<Arc<Self>> {
        let port = listener.local_addr()?.port();
        let conns = Arc::new(Self {
            port,
            reads: (0..world).map(|_| Mutex::new(None)).collect(),
            writes: (0..world).map(|_| Mutex::new(None)).collect(),
            bound: std::sync::Mutex::new(vec![(None, 0); world]),
            leases,
        });
        let weak = Arc::downgrade(&conns);
        tokio::spawn(async move {
            let mut failed = ps_net::throttle::Throttle::default();
            let refused = Arc::new(ps_net::throttle::SharedThrottle::new());
            loop {
                let (sock, peer) = match listener.accept().await {
                    Ok(s) => s,
                    Err(e) => {
                        // out of descriptors and the like: wait, then go on accepting; said
                        // once per throttle::LOG_EVERY with a count, not every 100 ms
                        if let Some(r) = failed.hit() {
                            tracing::warn!(
                                "shard {}: cannot accept data connections: {e}{r}: retrying every 100 ms",
                                expect.shard
                            );
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Some(conns) = weak.upgrade() else { return };
                let expect = expect.clone();
                let refused = refused.clone();
                tokio::spawn(async move {
                    if let Err(e) = conns.hello(sock, &expect, idle).await
                        && let Some(r) = refused.hit()
                    {
                        tracing::warn!(
                            "shard {}: data connection from {peer} refused: {e}{r}",
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
            self.leases
                .check(Some(&h.lease()), Some(h.rank), || {
                    format!("data connection of rank {}", h.rank)
                })
                .err()
        };
        if let Some(e) = refusal {
            let _ = sock.write_all(&[HELLO_NO]).await;
            return Err(e);
        }
        // the halves are in place before the client hears "ok": a push or pull it sends at
        // once must find them (a pull waits on the write half's lock until then)
        let (r, mut w) = sock.into_split();
        let rank = h.rank as usize;
        let mut read_slot = self.reads[rank].lock().await;
        let mut write_slot = self.writes[rank].lock().await;
        {
            let mut bound = self.bound();
            bound[rank].0 = Some(h.lease());
            bound[rank].1 += 1;
        }
        *read_slot = Some(r);
        // the previous connection's write half closes here (a half taken out by a frame
        // under way is not given back: its epoch is past)
        write_slot.take();
        drop(read_slot);
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

    fn bound(&self) -> std::sync::MutexGuard<'_, Vec<(Option<Lease>, u64)>> {
        self.bound.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `rank`'s connection's lease and epoch, checked against the lease the rank holds now
    /// (`crate::lease`); a connection of a lease the rank no longer holds is closed.
    async fn check_bound(&self, rank: u32, what: &str) -> PsResult<u64> {
        let (lease, epoch) = self
            .bound()
            .get(rank as usize)
            .cloned()
            .unwrap_or((None, 0));
        if lease.is_none() {
            return Err(PsError::Unavailable(format!(
                "rank {rank} has no data connection open (never opened, or closed after a failed request): open one and push again"
            )));
        }
        let checked = self.leases.check(lease.as_ref(), Some(rank), || {
            format!("{what} of rank {rank}")
        });
        if let Err(e) = checked {
            self.close(rank).await;
            return Err(e);
        }
        Ok(epoch)
    }

    /// Takes `rank`'s read half (a push's frame is read from it): refused when it has none or
    /// its connection's lease is not the rank's any more.
    pub async fn take_read(&self, rank: u32) -> PsResult<Taken<OwnedReadHalf>> {
        let epoch = self
            .check_bound(rank, "data connection frame (push)")
            .await?;
        let half = self
            .reads
            .get(rank as usize)
            .ok_or_else(|| PsError::Internal(format!("no data connection slot for rank {rank}")))?
            .lock()
            .await
            .take()
            .ok_or_else(|| {
                PsError::Unavailable(format!(
                    "rank {rank}'s data connection is in use by another push: push again"
                ))
            })?;
        Ok(Taken { half, epoch })
    }

    /// Gives a read half back after a frame was read in full, unless its connection was
    /// replaced or closed meanwhile.
    pub async fn put_read(&self, rank: u32, r: Taken<OwnedReadHalf>) {
        if let Some(slot) = self.reads.get(rank as usize) {
            let mut s = slot.lock().await;
            if s.is_none() && self.current(rank, r.epoch) {
                *s = Some(r.half);
            }
        }
    }

    fn current(&self, rank: u32, epoch: u64) -> bool {
        self.bound()
            .get(rank as usize)
            .is_some_and(|b| b.1 == epoch)
    }

    /// Closes `rank`'s connection (both halves; a half taken out is not given back): a push
    /// that was refused or failed before its frame was read in full, since what is left of the
    /// frame must never be taken for the next one.
    pub async fn close(&self, rank: u32) {
        let (Some(r), Some(w)) = (
            self.reads.get(rank as usize),
            self.writes.get(rank as usize),
        ) else {
            return;
        };
        let mut r = r.lock().await;
        let mut w = w.lock().await;
        {
            let mut bound = self.bound();
            bound[rank as usize].0 = None;
            bound[rank as usize].1 += 1;
        }
        r.take();
        w.take();
    }

    /// Takes `rank`'s write half now if nobody is writing on it and its connection's lease is
    /// the rank's (a pull answered on it); None otherwise (the pull is answered in chunks).
    pub async fn try_take_write(&self, rank: u32) -> Option<Taken<OwnedWriteHalf>> {
        let epoch = self
            .check_bound(rank, "data connection frame (pull)")
            .await
            .ok()?;
        let half = self.writes.get(rank as usize)?.try_lock().ok()?.take()?;
        Some(Taken { half, epoch })
    }

    /// Gives a write half back after a frame was written in full, unless its connection was
    /// replaced or closed meanwhile.
    pub async fn put_write(&self, rank: u32, w: Taken<OwnedWriteHalf>) {
        if let Some(slot) = self.writes.get(rank as usize) {
            let mut s = slot.lock().await;
            if s.is_none() && self.current(rank, w.epoch) {
                *s = Some(w.half);
            }
        }
    }
}
