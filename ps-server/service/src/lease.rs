//! Who may act for a rank: the one place every transport asks.
//!
//! `Register` grants the rank a *lease* ([`Leases::grant`]): the rank, the cluster generation
//! the shard serves, and a random 128-bit id that only the registering worker learns (in its
//! `RegisterReply`). Every later request for the rank presents it, and [`Leases::check`]
//! decides for all of them:
//! - gRPC pushes (`PushHeader.lease`, also for pushes whose values are in the worker's
//!   shared-memory gradient board or come on the data connection), pulls (`PullRequest.lease`,
//!   also for pulls answered through the parameters board or the data connection) and leaves;
//! - the data connection's hello (`ps_net::datalink::Hello`), and every frame read from or
//!   written to a data connection: the connection is bound to the lease its hello presented,
//!   and a frame is refused (the connection closed) once the rank holds another lease.
//!
//! A second worker registering a rank whose holder is still connected is refused (the holder
//! keeps the rank); once the holder's connection is closed (the process died), the next
//! registration gets a new lease and the old one is refused everywhere. A request of an older
//! generation is answered [`PsError::RolledBack`] (`ABORTED`): the cluster rolled back since,
//! and the worker registers again. Each generation of a shard has its own `Leases` (a rollback
//! restarts the shard's service), so leases of a generation left behind are never honoured.

use crate::peers::Peers;
use ps_proto::pb::Lease;
use ps_proto::{PsError, PsResult};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a registration waits for a rank's previous holder to disconnect before refusing:
/// a worker killed and restarted at once may register before its old connection is seen closed.
pub const HOLDER_GRACE: Duration = Duration::from_secs(10);

/// Bytes of a lease id.
pub const LEASE_ID_BYTES: usize = 16;

/// The lease each rank holds on this shard (in this generation).
#[derive(Debug)]
pub struct Leases {
    shard: usize,
    generation: u64,
    held: Mutex<Vec<Option<Held>>>,
    peers: Arc<Peers>,
}

#[derive(Debug, Clone)]
struct Held {
    id: [u8; LEASE_ID_BYTES],
    /// The connection the rank registered from (None: unknown, e.g. in-process).
    peer: Option<SocketAddr>,
}

impl Leases {
    /// No rank leased yet, for ranks `0..world` of shard `shard` at `generation`; `peers`
    /// says which connections are open (a holder whose connection closed is gone).
    pub fn new(shard: usize, world: usize, generation: u64, peers: Arc<Peers>) -> Self {
        Self {
            shard,
            generation,
            held: Mutex::new(vec![None; world]),
            peers,
        }
    }

    /// The generation this shard serves.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<Held>>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Grants `rank` a new lease for the worker registering from `peer`, replacing the one it
    /// held. A holder on another connection that is still open keeps the rank: this waits up
    /// to [`HOLDER_GRACE`] for it to close, then refuses with [`PsError::RankTaken`].
    pub async fn grant(&self, rank: u32, peer: Option<SocketAddr>) -> PsResult<Lease> {
        let world = self.lock().len();
        if rank as usize >= world {
            return Err(PsError::UnknownRank {
                rank,
                world: world as u32,
            });
        }
        let start = Instant::now();
        loop {
            let holder = self.lock()[rank as usize].as_ref().and_then(|h| h.peer);
            match (holder, peer) {
                (Some(h), Some(p)) if h != p && self.peers.is_open(&h) => {
                    if start.elapsed() >= HOLDER_GRACE {
                        return Err(PsError::RankTaken {
                            rank,
                            holder: h.to_string(),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ => break,
            }
        }
        let id = ps_net::auth::random_bytes::<LEASE_ID_BYTES>();
        self.lock()[rank as usize] = Some(Held { id, peer });
        Ok(Lease {
            rank,
            generation: self.generation,
            id: id.to_vec().into(),
        })
    }

    /// The check of every transport: `presented` must be the lease `rank` holds now on this
    /// shard, of this generation (`rank` None: any rank's lease, e.g. a pull). Returns the
    /// lease's rank. `what` names the request in the error.
    pub fn check(
        &self,
        presented: Option<&Lease>,
        rank: Option<u32>,
        what: impl Fn() -> String,
    ) -> PsResult<u32> {
        let world = self.lock().len();
        if let Some(r) = rank
            && r as usize >= world
        {
            return Err(PsError::UnknownRank {
                rank: r,
                world: world as u32,
            });
        }
        let Some(l) = presented else {
            return Err(PsError::NoLease { what: what() });
        };
        if let Some(r) = rank
            && r != l.rank
        {
            return Err(PsError::BadChunk(format!(
                "{} acts for rank {r} with rank {}'s lease: expected its own",
                what(),
                l.rank
            )));
        }
        let held = self.lock();
        let Some(slot) = held.get(l.rank as usize) else {
            return Err(PsError::UnknownRank {
                rank: l.rank,
                world: held.len() as u32,
            });
        };
        if l.generation < self.generation {
            return Err(PsError::RolledBack {
                shard: self.shard,
                what: what(),
                theirs: l.generation,
                ours: self.generation,
            });
        }
        if l.generation > self.generation {
            return Err(PsError::Unavailable(format!(
                "{} is of cluster generation {}, shard {} is still at generation {}: it has not rolled back yet; try again",
                what(),
                l.generation,
                self.shard,
                self.generation
            )));
        }
        match slot {
            None => Err(PsError::NotRegistered(l.rank)),
            Some(h) if ps_net::auth::constant_time_eq(&l.id, &h.id) => Ok(l.rank),
            Some(_) => Err(PsError::LeaseRefused {
                rank: l.rank,
                what: what(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(rank: u32, generation: u64, id: &[u8]) -> Lease {
        Lease {
            rank,
            generation,
            id: id.to_vec().into(),
        }
    }

    #[tokio::test]
    async fn only_the_latest_lease_of_the_generation_passes() {
        let leases = Leases::new(0, 2, 3, Arc::default());
        let what = || "push".to_string();
        // nothing granted: no lease, or an invented one, is refused
        let e = leases.check(None, Some(1), what).unwrap_err();
        assert!(matches!(e, PsError::NoLease { .. }), "{e}");
        let e = leases
            .check(Some(&lease(1, 3, &[7; 16])), Some(1), what)
            .unwrap_err();
        assert!(matches!(e, PsError::NotRegistered(1)), "{e}");
        let first = leases.grant(1, None).await.unwrap();
        assert_eq!((first.rank, first.generation, first.id.len()), (1, 3, 16));
        assert_eq!(leases.check(Some(&first), Some(1), what).unwrap(), 1);
        assert_eq!(leases.check(Some(&first), None, what).unwrap(), 1);
        // another rank's lease, a forged id, an older and a newer generation
        let e = leases.check(Some(&first), Some(0), what).unwrap_err();
        assert!(matches!(e, PsError::BadChunk(_)), "{e}");
        let mut id = first.id.to_vec();
        id[0] ^= 1;
        let forged = lease(1, 3, &id);
        let e = leases.check(Some(&forged), Some(1), what).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        let old = lease(1, 2, &first.id);
        let e = leases.check(Some(&old), Some(1), what).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Aborted, "{e}");
        assert!(e.to_string().starts_with("rolled back"), "{e}");
        let newer = lease(1, 4, &first.id);
        let e = leases.check(Some(&newer), Some(1), what).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        // a new registration replaces the lease: the first is refused from then on
        let second = leases.grant(1, None).await.unwrap();
        assert_ne!(first.id, second.id);
        assert!(leases.check(Some(&first), Some(1), what).is_err());
        assert!(leases.check(Some(&second), Some(1), what).is_ok());
        let e = leases.grant(2, None).await.unwrap_err();
        assert!(matches!(e, PsError::UnknownRank { rank: 2, .. }), "{e}");
    }
}
