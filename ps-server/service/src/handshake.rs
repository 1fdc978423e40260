//! The handshake an accepted connection must complete in time (`[server]
//! handshake_timeout_secs`): the HTTP/2 preface, or the TLS handshake up to the client's first
//! application-data record. Below both the accept loop (`crate::accept`) and the connection
//! records (`crate::peers`), which hold one per connection until it completes.

use ps_net::throttle::{Repeats, SharedThrottle};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// What a new connection must deliver within `[server] handshake_timeout_secs` of being
/// accepted, else it is closed (logged at most once per [`LOG_EVERY`](ps_net::throttle::LOG_EVERY), with counts): without
/// TLS, the 24-byte HTTP/2 connection preface; with TLS, every record of the TLS handshake up
/// to the client's first application-data record (in TLS 1.3 its encrypted `Finished`, in
/// TLS 1.2 the first HTTP/2 bytes). A connection that sends nothing, or stalls half-way, holds
/// a descriptor no longer than that. After it, HTTP/2 keepalive (`[server] keepalive_secs`)
/// closes a connection that stops answering.
#[derive(Debug)]
pub struct Handshake {
    deadline: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
    tls: bool,
    /// Bytes seen (without TLS).
    seen: usize,
    /// The TLS record header being read, and how much of it.
    header: [u8; 5],
    header_len: usize,
    /// Bytes of the current TLS record's body still to come.
    body_left: usize,
}

/// The HTTP/2 connection preface's length (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE_LEN: usize = 24;
/// The TLS record type of application data.
const TLS_APPLICATION_DATA: u8 = 23;

/// Connections closed for not completing their handshake in time, logged once per interval.
static STALLED: SharedThrottle = SharedThrottle::new();

impl Handshake {
    /// A handshake that must complete within `timeout` from now; `tls` when the shard serves
    /// TLS.
    pub fn new(tls: bool, timeout: Duration) -> Self {
        Self {
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timeout,
            tls,
            seen: 0,
            header: [0; 5],
            header_len: 0,
            body_left: 0,
        }
    }

    /// Takes in `bytes` read from the connection; true once the handshake is complete.
    pub fn observe(&mut self, mut bytes: &[u8]) -> bool {
        if !self.tls {
            self.seen += bytes.len();
            return self.seen >= PREFACE_LEN;
        }
        while !bytes.is_empty() {
            if self.body_left == 0 && self.header_len < 5 {
                let n = (5 - self.header_len).min(bytes.len());
                self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
                self.header_len += n;
                bytes = &bytes[n..];
                if self.header_len < 5 {
                    return false;
                }
                self.body_left = u16::from_be_bytes([self.header[3], self.header[4]]) as usize;
            }
            let n = self.body_left.min(bytes.len());
            self.body_left -= n;
            bytes = &bytes[n..];
            if self.body_left == 0 {
                if self.header[0] == TLS_APPLICATION_DATA {
                    return true;
                }
                self.header_len = 0;
            }
        }
        false
    }

    /// An error once the deadline has passed (the connection is then closed), logged.
    pub fn poll_expired(
        &mut self,
        cx: &mut Context<'_>,
        peer: Option<SocketAddr>,
    ) -> Poll<io::Error> {
        if self.deadline.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        let what = if self.tls {
            "the TLS handshake"
        } else {
            "the HTTP/2 connection preface"
        };
        if let Some(Repeats { since: n, total }) = STALLED.hit() {
            tracing::warn!(
                "closed {n} connection(s) that did not complete {what} within {:?} ([server] handshake_timeout_secs; the latest from {}; {total} in all)",
                self.timeout,
                peer.map_or("an unknown address".to_string(), |a| a.to_string())
            );
        }
        Poll::Ready(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{what} not completed within {:?}", self.timeout),
        ))
    }
}
