//! The shard's gRPC accept loop, and the descriptor limit it lives within: connections past
//! `[server] max_connections` are closed at once, and running out of file descriptors
//! (EMFILE / ENFILE) makes the loop back off instead of spinning; both are logged at most once
//! per interval, with how often they happened. At start-up the soft descriptor limit is raised
//! to the hard one. A connection that does not complete its handshake (the HTTP/2 preface,
//! or TLS) within `[server] handshake_timeout_secs` is closed ([`Handshake`]).

use crate::handshake::Handshake;
use crate::peers::{Peers, Tracked};
use futures::Stream;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

pub use ps_net::throttle::LOG_EVERY;
use ps_net::throttle::Throttle;

/// Pause after the accept fails for want of a descriptor (a connection waits in the listen
/// backlog meanwhile and is accepted once one is free).
pub const FD_BACKOFF: Duration = Duration::from_millis(20);

/// Raises the soft limit on open descriptors to the hard limit and logs the value.
pub fn raise_fd_limit(index: usize) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        tracing::warn!(
            "shard {index}: cannot read the descriptor limit: {}",
            io::Error::last_os_error()
        );
        return;
    }
    if lim.rlim_cur >= lim.rlim_max {
        tracing::info!("shard {index}: open file descriptor limit {}", lim.rlim_cur);
        return;
    }
    let was = lim.rlim_cur;
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads the struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } == 0 {
        tracing::info!(
            "shard {index}: open file descriptor limit raised from {was} to {} (the hard limit)",
            lim.rlim_max
        );
    } else {
        tracing::warn!(
            "shard {index}: open file descriptor limit {was}; raising it to {} failed: {}",
            lim.rlim_max,
            io::Error::last_os_error()
        );
    }
}

/// The HTTP/2 concurrent-stream limit a shard announces per connection: `[server]
/// max_streams_per_connection`, raised to at least `2 x workers + 4` when smaller. The rule:
/// each rank has at most one pull waiting for the next version and one push under way at a
/// time (plus a registration, leave or check), and a pull waits until every rank's push of
/// the step is in. If every rank of the run shared one connection and the waiting pulls took
/// all its stream slots, the push that completes the step could never start: a deadlock. With
/// `2 x W + 4` slots any number of ranks (at most W) can share a connection.
pub fn streams_per_connection(configured: usize, workers: usize) -> usize {
    configured.max(2 * workers + 4)
}

/// The HTTP/2 connection window a shard grants: `workers x [server] stream_window_bytes` (at
/// least two streams' worth; at most 2^31 - 1, HTTP/2's largest). The rule: a push that waits
/// for its turn is not read, but what its sender already sent (up to one stream window) stays
/// in the connection's receive buffer and counts against the connection window. If every
/// rank shares one connection and the window were smaller than the waiting pushes' data, the
/// push the shard waits for could not send a byte: a deadlock. The shard's memory plan
/// already counts this (`HTTP/2 receive windows`, `crate::memory`).
pub fn connection_window(stream_window: usize, workers: usize) -> u32 {
    (workers.max(2) as u64 * stream_window as u64).min(i32::MAX as u64) as u32
}

struct Loop {
    listener: TcpListener,
    peers: Arc<Peers>,
    max_connections: usize,
    index: usize,
    handshake: (bool, Duration),
    over: Throttle,
    no_fd: Throttle,
    other: Throttle,
}

fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
}

/// The connections accepted on `listener`, each tracked by `peers` while open, with nodelay
/// set, and closed unless it completes its [`Handshake`] (`tls`: the shard serves TLS) within
/// `handshake_timeout`; never yields an error (failures are handled and logged here).
pub fn incoming(
    listener: TcpListener,
    peers: Arc<Peers>,
    max_connections: usize,
    index: usize,
    tls: bool,
    handshake_timeout: Duration,
) -> impl Stream<Item = io::Result<Tracked>> {
    let st = Loop {
        listener,
        peers,
        max_connections,
        index,
        handshake: (tls, handshake_timeout),
        over: Throttle::default(),
        no_fd: Throttle::default(),
        other: Throttle::default(),
    };
    futures::stream::unfold(st, |mut st| async move {
        loop {
            match st.listener.accept().await {
                Ok((sock, addr)) => {
                    let open = st.peers.open_count();
                    if open >= st.max_connections {
                        drop(sock);
                        if let Some(r) = st.over.hit() {
                            tracing::warn!(
                                "shard {}: {open} connections open, the most [server] max_connections allows: closed {} new ones (the latest from {addr}; {} in all)",
                                st.index,
                                r.since,
                                r.total
                            );
                        }
                        continue;
                    }
                    // serve_with_incoming ignores the builder's tcp_nodelay: Nagle plus delayed
                    // ACKs would add ~40 ms to every push reply
                    let _ = sock.set_nodelay(true);
                    let (tls, timeout) = st.handshake;
                    let handshake = Handshake::new(tls, timeout);
                    return Some((Ok(st.peers.track(sock, Some(handshake))), st));
                }
                Err(e) if out_of_descriptors(&e) => {
                    if let Some(r) = st.no_fd.hit() {
                        tracing::warn!(
                            "shard {}: cannot accept connections: {e}{r}; {} connections open: backing off {FD_BACKOFF:?} each time",
                            st.index,
                            st.peers.open_count()
                        );
                    }
                    tokio::time::sleep(FD_BACKOFF).await;
                }
                Err(e) => {
                    if let Some(r) = st.other.hit() {
                        tracing::warn!("shard {}: accept failed: {e}{r}", st.index);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    })
}
