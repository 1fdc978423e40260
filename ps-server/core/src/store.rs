//! Where a shard's parameters live: two versions of them (double buffering), in this
//! process's heap or in the shared-memory board that the workers on the host read (version `v`
//! in slot `v % 2`). An update is begun (the current version to read, the other buffer to
//! write), computed without any lock, and committed (or abandoned, leaving the current version
//! as it was).

use bytes::Bytes;
use ps_net::shm::Board;
use std::sync::Arc;

/// The parameters of the current version and the one before.
#[derive(Debug)]
pub struct Store {
    kind: Kind,
    /// The current version as bytes shared by every gRPC pull without a copy: always there
    /// with heap storage (a view of it), made at the first gRPC pull of a version with a board.
    snapshot: Option<(u64, Bytes)>,
    /// The values behind the last snapshot copied out of a board, taken back as the next
    /// snapshot's buffer once no pull holds them (no allocation, zero-fill or page faults per
    /// version).
    board_snapshot: Option<Arc<Vec<f32>>>,
}

#[derive(Debug)]
enum Kind {
    /// The parameters of the current version, and those of the version before, recycled as the
    /// next update's output once no pull holds them any more.
    Heap {
        params: Arc<Vec<f32>>,
        spare: Option<Arc<Vec<f32>>>,
    },
    /// The shared-memory board.
    Board(Arc<Board>),
}

/// Where to copy a version from, taken under the shard's lock and read without it.
#[derive(Debug)]
pub enum Source {
    /// The heap's current values.
    Values(Arc<Vec<f32>>),
    /// The board (a copy checks that the version is still there).
    Board(Arc<Board>),
}

impl Source {
    /// A copy of `version` (the one this source was taken at); None when a board no longer
    /// holds it complete (two updates completed during the copy).
    pub fn read(&self, version: u64) -> Option<Vec<f32>> {
        let mut values = Vec::new();
        self.read_into(version, &mut values).then_some(values)
    }

    /// [`Source::read`] into `values`, whose allocation is reused when it has the length
    /// already (no zero-fill then: the copy overwrites every value); false when a board no
    /// longer holds `version` complete (`values` then holds a torn copy).
    pub fn read_into(&self, version: u64, values: &mut Vec<f32>) -> bool {
        match self {
            Source::Values(v) => {
                values.clear();
                values.extend_from_slice(v);
                true
            }
            Source::Board(b) => {
                if values.len() != b.len() {
                    *values = vec![0f32; b.len()];
                }
                b.read_version(version, values)
            }
        }
    }
}

/// An update in progress: the buffers it reads and writes, owned until commit.
#[derive(Debug)]
pub struct Update {
    /// The version it makes.
    version: u64,
    kind: UpdateKind,
}

#[derive(Debug)]
enum UpdateKind {
    Heap {
        current: Arc<Vec<f32>>,
        next: Vec<f32>,
    },
    Board(Arc<Board>),
}

impl Update {
    /// True when the update's shared-memory board was found truncated (by another process)
    /// while the update read or wrote it: its contents are lost.
    pub fn faulted(&self) -> bool {
        matches!(&self.kind, UpdateKind::Board(b) if b.faulted())
    }

    /// The current parameters and the buffer of the next version.
    pub fn buffers(&mut self) -> (&[f32], &mut [f32]) {
        match &mut self.kind {
            UpdateKind::Heap { current, next } => (&current[..], &mut next[..]),
            // SAFETY: only one update is begun at a time (the shard's barrier hands out one
            // step at a time), so this is the process's only writer of the board; both slices
            // borrow `self`, which `Store::commit` consumes before it ends the version; every
            // other reader in this process goes through `Board::read_version`.
            UpdateKind::Board(b) => unsafe { b.update_slots(self.version) },
        }
    }
}

/// The parameters of one version as little-endian bytes, owned by the `Bytes` that pulls share.
struct SharedParams(Arc<Vec<f32>>);

impl AsRef<[u8]> for SharedParams {
    fn as_ref(&self) -> &[u8] {
        ps_net::wire::as_le_bytes(&self.0)
    }
}

/// `values` as bytes that pulls share.
pub fn shared_bytes(values: Arc<Vec<f32>>) -> Bytes {
    Bytes::from_owner(SharedParams(values))
}

impl Store {
    /// `params` as version `version`, in the heap.
    pub fn heap(version: u64, params: Vec<f32>) -> Self {
        let params = Arc::new(params);
        Self {
            snapshot: Some((version, shared_bytes(params.clone()))),
            board_snapshot: None,
            kind: Kind::Heap {
                params,
                spare: None,
            },
        }
    }

    /// True when the parameters are in a shared-memory board.
    pub fn is_board(&self) -> bool {
        matches!(self.kind, Kind::Board(_))
    }

    /// Moves the heap's parameters of `version` into `board` (no-op for a board already).
    pub fn move_to_board(&mut self, mut board: Board, version: u64) {
        if let Kind::Heap { params, .. } = &self.kind {
            board.publish(version, params);
            self.kind = Kind::Board(Arc::new(board));
        }
    }

    /// The shared bytes of `version` if they were made.
    pub fn snapshot(&self, version: u64) -> Option<Bytes> {
        match &self.snapshot {
            Some((v, s)) if *v == version => Some(s.clone()),
            _ => None,
        }
    }

    /// Keeps `values`, copied out of the board, as the shared bytes of `version`; returns them.
    pub fn keep_snapshot(&mut self, version: u64, values: Arc<Vec<f32>>) -> Bytes {
        let bytes = shared_bytes(values.clone());
        self.snapshot = Some((version, bytes.clone()));
        self.board_snapshot = Some(values);
        bytes
    }

    /// The buffer of the last board snapshot when no pull holds it any more (and it is not the
    /// current snapshot), to copy the next version into.
    pub fn take_snapshot_buffer(&mut self) -> Option<Vec<f32>> {
        if self.snapshot.is_some() {
            return None;
        }
        self.board_snapshot
            .take()
            .and_then(|v| Arc::try_unwrap(v).ok())
    }

    /// Where to copy the current version from.
    pub fn source(&self) -> Source {
        match &self.kind {
            Kind::Heap { params, .. } => Source::Values(params.clone()),
            Kind::Board(b) => Source::Board(b.clone()),
        }
    }

    /// The version before the current one, where it is still held: the heap's other buffer
    /// as shared bytes, or the board to copy `previous` out of ([`Source::read`]).
    pub fn previous(&self, len: usize) -> Option<Previous> {
        match &self.kind {
            Kind::Heap {
                spare: Some(prev), ..
            } if prev.len() == len => Some(Previous::Bytes(shared_bytes(prev.clone()))),
            Kind::Heap { .. } => None,
            Kind::Board(b) => Some(Previous::Board(b.clone())),
        }
    }

    /// Begins the update that makes `version` from `version - 1`: the heap's spare buffer is
    /// reused when no pull holds it any more (the version before is then gone).
    pub fn begin(&mut self, version: u64) -> Update {
        let kind = match &mut self.kind {
            Kind::Heap { params, spare } => {
                let len = params.len();
                let next = match spare.take().map(Arc::try_unwrap) {
                    Some(Ok(v)) if v.len() == len => v,
                    _ => vec![0f32; len],
                };
                UpdateKind::Heap {
                    current: params.clone(),
                    next,
                }
            }
            Kind::Board(b) => UpdateKind::Board(b.clone()),
        };
        Update { version, kind }
    }

    /// Makes the update's version the current one; the old current one becomes the previous.
    pub fn commit(&mut self, update: Update) {
        let version = update.version;
        match (&mut self.kind, update.kind) {
            (Kind::Heap { params, spare }, UpdateKind::Heap { next, .. }) => {
                let next = Arc::new(next);
                self.snapshot = Some((version, shared_bytes(next.clone())));
                *spare = Some(std::mem::replace(params, next));
            }
            (_, UpdateKind::Board(b)) => {
                b.end_version(version);
                self.snapshot = None;
            }
            (Kind::Board(_), UpdateKind::Heap { .. }) => {
                unreachable!("the parameters move to a board only between updates")
            }
        }
    }

    /// Drops an update: the current version stays as it is; the version before it is gone
    /// (its buffer was being overwritten; a board's slot stays marked "being written").
    pub fn abandon(&mut self, update: Update) {
        drop(update);
    }
}

/// The version before the current one.
#[derive(Debug)]
pub enum Previous {
    /// Its bytes (heap).
    Bytes(Bytes),
    /// The board that may still hold it.
    Board(Arc<Board>),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(u: &mut Update, add: f32) {
        let (cur, next) = u.buffers();
        for (n, c) in next.iter_mut().zip(cur) {
            *n = c + add;
        }
    }

    fn current(s: &Store, version: u64) -> Vec<f32> {
        s.source().read(version).expect("current version readable")
    }

    fn previous(s: &Store, version: u64, len: usize) -> Option<Vec<f32>> {
        match s.previous(len)? {
            Previous::Bytes(b) => Some(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            ),
            Previous::Board(b) => Source::Board(b).read(version),
        }
    }

    fn exercise(mut s: Store) {
        assert_eq!(current(&s, 0), [1.0, 2.0, 3.0]);
        let mut u = s.begin(1);
        write(&mut u, 10.0);
        assert_eq!(
            current(&s, 0),
            [1.0, 2.0, 3.0],
            "nothing visible before commit"
        );
        s.commit(u);
        assert_eq!(current(&s, 1), [11.0, 12.0, 13.0]);
        assert_eq!(previous(&s, 0, 3).unwrap(), [1.0, 2.0, 3.0]);
        let mut u = s.begin(2);
        write(&mut u, 100.0);
        s.commit(u);
        assert_eq!(current(&s, 2), [111.0, 112.0, 113.0]);
        assert_eq!(previous(&s, 1, 3).unwrap(), [11.0, 12.0, 13.0]);
        // an abandoned update leaves the current version; the one before is gone
        let mut u = s.begin(3);
        write(&mut u, f32::NAN);
        s.abandon(u);
        assert_eq!(current(&s, 2), [111.0, 112.0, 113.0]);
        assert_eq!(previous(&s, 1, 3), None);
    }

    #[test]
    fn heap_begin_commit_previous_abandon() {
        let s = Store::heap(0, vec![1.0, 2.0, 3.0]);
        assert!(!s.is_board());
        assert!(s.previous(3).is_none(), "no version before 0");
        let snap = s.snapshot(0).expect("heap snapshot of version 0");
        assert_eq!(snap.len(), 12);
        assert!(s.snapshot(1).is_none());
        exercise(s);
    }

    /// A store of [1, 2, 3] at version 0 moved into a board of a fresh directory under
    /// `<tmp>/<name>-<pid>`, with that directory (remove it with [`remove_board_dir`]).
    fn board_store(name: &str) -> (Store, ps_net::shm::BoardDir, std::path::PathBuf) {
        let root = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let dir = ps_net::shm::BoardDir::create(&root, "store").unwrap();
        let board = Board::create(&dir.path().join("params"), dir.token(), 3, 2).unwrap();
        let mut s = Store::heap(0, vec![1.0, 2.0, 3.0]);
        s.move_to_board(board, 0);
        assert!(s.is_board());
        (s, dir, root)
    }

    fn remove_board_dir(dir: ps_net::shm::BoardDir, root: std::path::PathBuf) {
        drop(dir);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn board_begin_commit_previous_abandon() {
        let (s, dir, root) = board_store("ps-store-test");
        exercise(s);
        remove_board_dir(dir, root);
    }

    #[test]
    fn a_board_snapshot_buffer_comes_back_only_when_no_pull_holds_it() {
        let (mut s, dir, root) = board_store("ps-store-snap");
        let commit = |s: &mut Store, v: u64| {
            let mut u = s.begin(v);
            write(&mut u, 1.0);
            s.commit(u);
        };
        commit(&mut s, 1);
        assert_eq!(s.take_snapshot_buffer(), None, "no board snapshot yet");
        let values = Arc::new(current(&s, 1));
        let held = s.keep_snapshot(1, values);
        assert_eq!(s.snapshot(1).as_deref(), Some(&held[..]));
        assert_eq!(s.take_snapshot_buffer(), None, "it is the current snapshot");
        commit(&mut s, 2);
        assert_eq!(
            s.snapshot(2),
            None,
            "a new version has no snapshot until asked"
        );
        assert_eq!(
            s.take_snapshot_buffer(),
            None,
            "a pull still holds version 1's bytes"
        );
        // ... and the buffer is dropped with that pull, not given back later
        drop(held);
        assert_eq!(s.take_snapshot_buffer(), None);
        let values = Arc::new(current(&s, 2));
        let ptr2 = values.as_ptr();
        drop(s.keep_snapshot(2, values));
        commit(&mut s, 3);
        let mut back = s
            .take_snapshot_buffer()
            .expect("no pull holds version 2's bytes");
        assert_eq!((back.as_ptr(), &back[..]), (ptr2, &[3.0, 4.0, 5.0][..]));
        assert_eq!(s.take_snapshot_buffer(), None, "given back once");
        // the next version is copied into it, without a new allocation
        assert!(s.source().read_into(3, &mut back));
        assert_eq!((back.as_ptr(), &back[..]), (ptr2, &[4.0, 5.0, 6.0][..]));
        remove_board_dir(dir, root);
    }
}
