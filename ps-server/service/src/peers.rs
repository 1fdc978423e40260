//! Which connections are alive: every accepted connection is recorded while it is open (the
//! rank leases read it: a holder whose connection closed is gone), and the calls under
//! way on each.

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Open connections and the calls under way on each.
#[derive(Debug, Default)]
pub struct Peers {
    open: Mutex<HashSet<SocketAddr>>,
    /// Calls under way per connection.
    streams: Mutex<HashMap<SocketAddr, usize>>,
    /// Connections that reached `[server] max_streams_per_connection`, logged once per interval.
    full: Mutex<ps_net::throttle::Throttle>,
}

/// A call under way on a connection ([`Peers::stream`]); counted until dropped.
#[derive(Debug)]
pub struct StreamGuard {
    peers: Arc<Peers>,
    addr: Option<SocketAddr>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if let Some(a) = self.addr {
            let mut m = self.peers.streams.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = m.get_mut(&a) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&a);
                }
            }
        }
    }
}

impl Peers {
    /// Wraps an accepted socket so that it counts as open until it is dropped.
    pub fn track(
        self: &Arc<Self>,
        inner: TcpStream,
        handshake: Option<crate::handshake::Handshake>,
    ) -> Tracked {
        let addr = inner.peer_addr().ok();
        if let Some(a) = addr {
            self.open
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(a);
        }
        Tracked {
            inner,
            addr,
            peers: self.clone(),
            handshake,
        }
    }

    /// Counts a call on the connection from `addr` until the guard is dropped; logs (once per
    /// interval) when the connection reaches `max` concurrent calls, past which HTTP/2 refuses
    /// new streams on it (`[server] max_streams_per_connection`).
    pub fn stream(
        self: &Arc<Self>,
        addr: Option<SocketAddr>,
        max: usize,
        shard: usize,
    ) -> StreamGuard {
        if let Some(a) = addr {
            let n = {
                let mut m = self.streams.lock().unwrap_or_else(|e| e.into_inner());
                let n = m.entry(a).or_insert(0);
                *n += 1;
                *n
            };
            if n >= max
                && let Some(r) = self.full.lock().unwrap_or_else(|e| e.into_inner()).hit()
            {
                tracing::warn!(
                    "shard {shard}: connection {a} has {n} calls under way, the most [server] max_streams_per_connection allows: further streams on it are refused until one ends{r}"
                );
            }
        }
        StreamGuard {
            peers: self.clone(),
            addr,
        }
    }

    /// Connections open now.
    pub fn open_count(&self) -> usize {
        self.open.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether the connection from `addr` is open.
    pub fn is_open(&self, addr: &SocketAddr) -> bool {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(addr)
    }
}

/// An accepted TCP connection that is recorded as open until dropped.
#[derive(Debug)]
pub struct Tracked {
    inner: TcpStream,
    addr: Option<SocketAddr>,
    peers: Arc<Peers>,
    /// Until the connection completes its handshake in time (None after).
    handshake: Option<crate::handshake::Handshake>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(a) = self.addr {
            self.peers
                .open
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&a);
        }
    }
}

impl Connected for Tracked {
    type ConnectInfo = TcpConnectInfo;
    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Some(h) = &mut this.handshake {
            match &r {
                Poll::Ready(Ok(())) => {
                    if h.observe(&buf.filled()[before..]) {
                        this.handshake = None;
                    }
                }
                Poll::Pending => {
                    if let Poll::Ready(e) = h.poll_expired(cx, this.addr) {
                        return Poll::Ready(Err(e));
                    }
                }
                Poll::Ready(Err(_)) => {}
            }
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
