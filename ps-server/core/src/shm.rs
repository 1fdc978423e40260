//! The shard's side of the shared-memory data path (`ps_net::shm`): the directory where it
//! offers its parameters board to the workers on its host, and the workers' gradient boards it
//! reads pushes from, each push's range as a [`BoardSource`] (the rest of the shard reads it
//! through [`PushSource`], as any plane's values).

use super::{Grad, Shard};
use crate::bucket::Intake;
use ps_net::shm::{Board, BoardDir, params_path};
use ps_net::source::{BoardSource, PushSource};
use ps_proto::{PsError, PsResult};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Why a board of the shared-memory data path is not usable (the tensors then go through
/// gRPC).
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// The parameters board could not be made.
    #[error("cannot create {}: {source}", path.display())]
    Create {
        /// Its file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// This shard's board directory has no parent (no shared-memory root to open boards in).
    #[error("this shard's board directory has no parent")]
    NoRoot,
    /// A worker's gradient board refused by [`Board::open_trusted`] (its reason).
    #[error(transparent)]
    Refused(#[from] ps_net::shm::BoardError),
}

/// The shared-memory side of one shard.
#[derive(Debug)]
pub struct ShmHost {
    /// The directory of the parameters board.
    dir: BoardDir,
    /// Each rank's gradient board (the worker's file), once opened.
    grads: Mutex<Vec<Option<Arc<Board>>>>,
}

impl ShmHost {
    /// The directory `<root>/ps-<run>-shard<index>-...` for `world` ranks (`run`: the run id,
    /// `ps_config::runid::board_prefix`); None (logged) when it cannot be made: tensors then go
    /// through gRPC.
    pub fn create(root: &Path, run: &str, index: usize, world: usize) -> Option<Self> {
        match BoardDir::create(root, &format!("{run}-shard{index}")) {
            Ok(dir) => Some(Self {
                dir,
                grads: Mutex::new(vec![None; world]),
            }),
            Err(e) => {
                tracing::warn!(
                    "shard {index}: no shared-memory data path ({e}); tensors go through gRPC"
                );
                None
            }
        }
    }

    /// The directory offered to workers.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The token of its boards.
    pub fn token(&self) -> u64 {
        self.dir.token()
    }

    /// Creates the parameters board (two slots of `len` values); the error is logged by the
    /// caller, which then serves pulls through gRPC.
    pub fn create_params_board(&self, len: usize) -> Result<Board, ShmError> {
        let path = params_path(self.dir.path());
        Board::create(&path, self.token(), len, 2)
            .map_err(|source| ShmError::Create { path, source })
    }

    /// Opens `rank`'s gradient board: `file`, of `num_params` values, made with `token`, in a
    /// worker's board directory under the same shared-memory root as this shard's, belonging
    /// to this process's user ([`Board::open_trusted`]): never a file another user made or
    /// one elsewhere. The error says why it is not usable (then the rank pushes through gRPC).
    pub fn attach(
        &self,
        rank: usize,
        file: &Path,
        token: u64,
        num_params: usize,
    ) -> Result<(), ShmError> {
        let root = self.dir.path().parent().ok_or(ShmError::NoRoot)?;
        let board =
            Board::open_trusted(root, file, token, num_params, 1).map_err(ShmError::Refused)?;
        self.grads.lock().unwrap_or_else(|p| p.into_inner())[rank] = Some(Arc::new(board));
        Ok(())
    }

    /// `rank`'s gradient board, if attached. One found truncated (a read met the fault) is
    /// forgotten: it is never read again; the rank must register again with a new one, or
    /// push through gRPC.
    pub fn grad(&self, rank: usize) -> Option<Arc<Board>> {
        let mut grads = self.grads.lock().unwrap_or_else(|p| p.into_inner());
        if grads[rank].as_ref().is_some_and(|b| b.faulted()) {
            grads[rank] = None;
        }
        grads[rank].clone()
    }
}

/// The user id owning the local end `peer` of a TCP connection to this process, when that end
/// is a socket of this host's network namespace (a worker on this host): read from
/// `/proc/net/tcp` and `/proc/net/tcp6`, the TCP counterpart of `SO_PEERCRED`. None when it is
/// not found there (another host, another network namespace).
pub fn peer_uid(peer: std::net::SocketAddr) -> Option<u32> {
    let want = std::net::SocketAddr::new(peer.ip().to_canonical(), peer.port());
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| {
            let text = std::fs::read_to_string(table).ok()?;
            text.lines().skip(1).find_map(|line| {
                let cols: Vec<&str> = line.split_whitespace().collect();
                let local = parse_proc_addr(cols.get(1)?)?;
                (local == want).then(|| cols.get(7)?.parse().ok()).flatten()
            })
        })
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6), as the kernel prints them: each
/// 32-bit word of the address in host byte order.
fn parse_proc_addr(s: &str) -> Option<std::net::SocketAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        let w = u32::from_str_radix(ip.get(8 * i..8 * i + 8)?, 16).ok()?;
        Some(w.to_ne_bytes())
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[4 * i..4 * i + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip.to_canonical(), port))
}

/// The shared-memory side of the facade.
impl Shard {
    /// The shared-memory directory and token to offer `rank` on registration for its pulls,
    /// or None when this shard serves through gRPC only. The first offer moves the parameters
    /// into the shared-memory board (updates then read and write them there).
    pub fn offer_shm(&self, rank: u32) -> PsResult<Option<(String, u64)>> {
        // the lock order: `work` before `state`; a step's per-bucket work begun on the heap
        // is dropped before the parameters move (its update would commit into the heap)
        let mut work = self.work.lock().unwrap_or_else(|p| p.into_inner());
        let mut st = self.lock();
        st.barrier.rank(rank)?;
        let Some(host) = &self.shm else {
            return Ok(None);
        };
        if !st.store.is_board() {
            if st.barrier.applying() {
                tracing::info!(
                    "shard {}: rank {rank} registered during an update; it pulls through gRPC",
                    self.index
                );
                return Ok(None);
            }
            let board = match host.create_params_board(self.len()) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!("shard {}: {e}; workers pull through gRPC", self.index);
                    return Ok(None);
                }
            };
            let version = st.barrier.step();
            self.drop_work(
                &mut st,
                &mut work,
                "the parameters moved into a shared-memory board",
            );
            st.store.move_to_board(board, version);
            tracing::info!(
                "shard {}: parameters in shared memory for the workers on this host ({})",
                self.index,
                host.dir().display()
            );
        }
        Ok(Some((host.dir().display().to_string(), host.token())))
    }

    /// Opens `rank`'s gradient board (a file it made, of the whole model's length, with
    /// `token` in its header); true when this shard will read the rank's pushes there. A file
    /// this shard cannot open (the worker is on another host) means gRPC pushes.
    pub fn attach_grad(&self, rank: u32, file: &Path, token: u64) -> PsResult<bool> {
        let r = self.lock().barrier.rank(rank)?;
        let Some(host) = &self.shm else {
            return Ok(false);
        };
        match host.attach(r, file, token, self.push_values()) {
            Ok(()) => Ok(true),
            Err(why) => {
                tracing::info!(
                    "shard {}: rank {rank} pushes through gRPC: its gradient board is not usable here ({why})",
                    self.index
                );
                Ok(false)
            }
        }
    }

    /// This shard's range of `rank`'s gradient board, read in place, for a push that says it
    /// is in shared memory; refused when the rank registered none here.
    pub fn grad_source(&self, rank: u32) -> PsResult<Arc<dyn PushSource>> {
        let r = self.lock().barrier.rank(rank)?;
        let board = self.shm.as_ref().and_then(|h| h.grad(r));
        let board = board.ok_or_else(|| {
            PsError::BadChunk(format!(
                "rank {rank} pushed through shared memory but shard {} has no gradient board of it: expected a registration with a grad_file first",
                self.index
            ))
        })?;
        // SAFETY: the worker does not write its board between its push and the update of the
        // version the push is for (ps_net::shm); one that does only changes the values read,
        // which the update checks again where it uses them. The board was opened with the
        // whole model's length (`attach_grad`), so the push's range lies in its slot.
        Ok(Arc::new(unsafe {
            BoardSource::new(board, self.push_range())
        }))
    }

    /// True when pulls can be answered through the shared-memory board.
    pub fn has_board(&self) -> bool {
        self.lock().store.is_board()
    }

    /// `rank`'s gradient for a push that says it is in shared memory: the rank's board, once
    /// its range is checked in place (finite values) and fingerprinted like a received one.
    pub fn shm_grad(&self, rank: u32) -> PsResult<(Grad, u64)> {
        self.check_in_place(rank, self.grad_source(rank)?)
    }

    /// A push in `rank`'s gradient board for `step`, as the shard takes it: read in place
    /// bucket by bucket where it applies per bucket ([`Shard::receive_in_place`]), else checked
    /// over the whole range ([`Shard::shm_grad`]). The gradient, its fingerprint and the
    /// bucket intake to keep until [`Shard::accept`] answered. Blocking: call it from a
    /// blocking thread.
    pub fn board_push(
        self: &Arc<Self>,
        rank: u32,
        step: u64,
    ) -> PsResult<(Grad, u64, Option<Intake>)> {
        let src = self.grad_source(rank)?;
        match self.receive_in_place(rank, step, src.clone()) {
            Some(got) => got.map(|(grad, fp, intake)| (grad, fp, Some(intake))),
            None => self
                .check_in_place(rank, src)
                .map(|(grad, fp)| (grad, fp, None)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The owner of a connection's local end is found for this process's own connection and
    /// for one made by a process of another user (when the test runs as root).
    #[test]
    fn peer_uid_names_the_user_of_a_local_connection() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (_s, peer) = l.accept().unwrap();
        assert_eq!(peer, c.local_addr().unwrap());
        let me = ps_net::shm::this_user();
        assert_eq!(peer_uid(peer), Some(me));
        assert_eq!(
            parse_proc_addr("0100007F:1F90"),
            Some("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(peer_uid("127.0.0.1:1".parse().unwrap()), None);
        if me == 0 {
            use std::os::unix::process::CommandExt;
            let mut child = std::process::Command::new("bash")
                .arg("-c")
                .arg(format!("exec 3<>/dev/tcp/127.0.0.1/{port}; sleep 5"))
                .uid(65534)
                .gid(65534)
                .spawn()
                .unwrap();
            let (_s, other) = l.accept().unwrap();
            assert_eq!(peer_uid(other), Some(65534));
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
}
