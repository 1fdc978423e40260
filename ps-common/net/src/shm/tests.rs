//! Tests of the shared-memory slots and boards: torn-free reads at any length and into sinks,
//! board headers, owner staleness, truncated files, trusted opens.

use super::dir::{OWNER_LOCK, UNLOCKED_GRACE, try_lock};
use super::*;

#[test]
fn a_read_copies_exactly_the_slot_at_any_length() {
    let root = std::env::temp_dir().join(format!("ps-shm-len-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let dir = BoardDir::create(&root, "shard0").unwrap();
    for len in [1usize, 2, 7, 1001, 4096, 65_537] {
        let path = dir.path().join(format!("len{len}"));
        let mut w = Board::create(&path, dir.token(), len, 2).unwrap();
        let v0: Vec<f32> = (0..len).map(|i| i as f32 + 0.5).collect();
        let v1: Vec<f32> = (0..len).map(|i| -(i as f32) - 0.25).collect();
        w.publish(0, &v0);
        w.publish(1, &v1);
        // read into the middle of a larger buffer: the sentinels on both sides stay
        let mut out = vec![f32::MAX; len + 2];
        assert!(w.read_version(1, &mut out[1..=len]));
        assert_eq!(&out[1..=len], &v1[..], "len {len}");
        assert!(w.read_version(0, &mut out[1..=len]));
        assert_eq!(&out[1..=len], &v0[..], "len {len}");
        assert_eq!((out[0], out[len + 1]), (f32::MAX, f32::MAX), "len {len}");
    }
    drop(dir);
    let _ = std::fs::remove_dir_all(&root);
}

/// A sink whose pieces end at `ends`, recording them; when its second piece is about to
/// be copied it can have the shard begin writing another version into the same slot
/// (`tear`).
struct PieceSink<'b> {
    dst: Vec<f32>,
    filled: usize,
    ends: Vec<usize>,
    pieces: Vec<(usize, usize)>,
    tear: Option<&'b mut Board>,
}

impl PullSink for PieceSink<'_> {
    fn len(&self) -> usize {
        self.dst.len()
    }
    fn filled(&self) -> usize {
        self.filled
    }
    fn next(&mut self, n: usize) -> &mut [f32] {
        if self.filled > 0
            && let Some(b) = self.tear.take()
        {
            b.begin_version(3)[0] = -1.0; // version 3 goes into version 1's slot
        }
        &mut self.dst[self.filled..self.filled + n]
    }
    fn publish(&mut self, n: usize) {
        self.pieces.push((self.filled, self.filled + n));
        self.filled += n;
    }
    fn piece_end(&self) -> usize {
        self.ends
            .iter()
            .copied()
            .find(|&e| e > self.filled)
            .unwrap()
    }
}

#[test]
fn a_read_into_a_sink_publishes_checked_pieces_up_to_a_torn_version() {
    let root = std::env::temp_dir().join(format!("ps-shm-sink-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let dir = BoardDir::create(&root, "shard0").unwrap();
    let path = params_path(dir.path());
    let mut w = Board::create(&path, dir.token(), 1000, 2).unwrap();
    let r = Board::open(&path, dir.token(), 1000, 2).unwrap();
    let v: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    w.publish(1, &v);
    let sink = |tear| PieceSink {
        dst: vec![0.0; 1000],
        filled: 0,
        ends: vec![300, 700, 1000],
        pieces: Vec::new(),
        tear,
    };
    let mut whole = sink(None);
    assert!(r.read_version_into(1, &mut whole));
    assert_eq!(whole.pieces, [(0, 300), (300, 700), (700, 1000)]);
    assert_eq!(whole.dst, v);
    // the slot is rewritten while the second piece is copied: its check fails, and only
    // the checked first piece is published
    let mut torn = sink(Some(&mut w));
    assert!(!r.read_version_into(1, &mut torn));
    assert_eq!(torn.pieces, [(0, 300)]);
    assert_eq!(&torn.dst[..300], &v[..300]);
    drop(dir);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_large_read_by_several_threads_publishes_the_exact_slot_in_order_or_nothing_torn() {
    let root = std::env::temp_dir().join(format!("ps-shm-par-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let dir = BoardDir::create(&root, "shard0").unwrap();
    let path = params_path(dir.path());
    let len = 5 * COPY_BLOCK + 123;
    let mut w = Board::create(&path, dir.token(), len, 2).unwrap();
    let r = Board::open(&path, dir.token(), len, 2).unwrap();
    let v: Vec<f32> = (0..len).map(|i| (i as f32).sin() * 1e3).collect();
    w.publish(1, &v);
    let sink = |filled, tear| PieceSink {
        dst: vec![0.0; len],
        filled,
        ends: vec![len],
        pieces: Vec::new(),
        tear,
    };
    let mut whole = sink(0, None);
    assert!(r.read_version_into(1, &mut whole));
    assert_eq!(
        whole.dst.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    // published in ascending, contiguous pieces covering the slot
    assert_eq!(whole.pieces.first().map(|p| p.0), Some(0));
    assert_eq!(whole.pieces.last().map(|p| p.1), Some(len));
    assert!(
        whole
            .pieces
            .windows(2)
            .all(|p| p[0].1 == p[1].0 && p[0].0 < p[0].1)
    );
    if copy_threads(len) > 1 {
        // block boundaries, not the sink's single piece
        assert!(
            whole.pieces.iter().all(|p| p.0 % COPY_BLOCK == 0),
            "{:?}",
            whole.pieces
        );
    }
    // a retried read from the middle (its start published before) whose slot is rewritten
    // as the copy begins: nothing more is published
    let mut torn = sink(COPY_BLOCK, Some(&mut w));
    assert!(!r.read_version_into(1, &mut torn));
    assert_eq!(torn.pieces, []);
    drop(dir);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn boards_roundtrip_and_check_their_header() {
    let root = std::env::temp_dir().join(format!("ps-shm-test-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let dir = BoardDir::create(&root, "shard3").unwrap();
    let path = params_path(dir.path());
    let mut w = Board::create(&path, dir.token(), 1000, 2).unwrap();
    let r = Board::open(&path, dir.token(), 1000, 2).unwrap();
    let v: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let mut out = vec![0f32; 1000];
    assert!(!r.read_version(0, &mut out), "nothing published yet");
    w.publish(0, &v);
    assert!(r.read_version(0, &mut out));
    assert_eq!(out, v);
    assert!(
        !r.read_version(2, &mut out),
        "slot 0 holds version 0, not 2"
    );
    let s = w.begin_version(2);
    s[0] = 7.0;
    assert!(!r.read_version(2, &mut out), "being written");
    assert!(
        !r.read_version(0, &mut out),
        "version 0 is being overwritten"
    );
    w.end_version(2);
    assert!(r.read_version(2, &mut out));
    assert_eq!(out[0], 7.0);
    // wrong token, length or slot count: refused with the reason
    let e = Board::open(&path, dir.token() ^ 2, 1000, 2).unwrap_err();
    assert!(matches!(e, BoardError::NotThisBoard { .. }), "{e}");
    let e = e.to_string();
    assert!(e.contains("not this shard's board"), "{e}");
    let e = Board::open(&path, dir.token(), 999, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected"), "{e}");
    assert!(Board::open(&grad_path(dir.path()), dir.token(), 10, 1).is_err());
    // a gradient board: written by one side, read by the other
    let mut g = Board::create(&grad_path(dir.path()), dir.token(), 5, 1).unwrap();
    let g2 = Board::open(g.path(), dir.token(), 5, 1).unwrap();
    g.slot_mut(0)[2..].copy_from_slice(&[1.0, 2.0, 3.0]);
    let mut back = [0f32; 5];
    g2.read(0, &mut back);
    assert_eq!(back, [0.0, 0.0, 1.0, 2.0, 3.0]);
    // SAFETY: nothing writes the board meanwhile.
    assert_eq!(unsafe { g2.slot(0) }, &back);
    let p = dir.path().to_path_buf();
    drop((w, r, g, g2, dir));
    assert!(!p.exists(), "the directory goes with its owner");
    // a directory of a process that no longer exists is removed by the next creation
    // (an old one without an owner lock, after the grace period)
    let stale = root.join("ps-shard0-pid4294967294-00000000000000ff");
    std::fs::create_dir(&stale).unwrap();
    let d = BoardDir::create(&root, "worker0").unwrap();
    assert!(
        stale.exists(),
        "a fresh directory without a lock may be being created"
    );
    let old = std::time::SystemTime::now() - 2 * UNLOCKED_GRACE;
    File::open(&stale).unwrap().set_modified(old).unwrap();
    remove_stale(&root);
    assert!(!stale.exists());
    drop(d);
    std::fs::remove_dir_all(&root).unwrap();
}

/// The owner lock decides, not the pid in the name: a directory named after a pid this
/// process cannot see (as from another PID namespace) survives while its lock is held by a
/// live process, and goes once that process has died.
#[test]
fn staleness_follows_the_owner_lock_across_pid_namespaces() {
    let root = std::env::temp_dir().join(format!("ps-shm-lock-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let foreign = root.join("ps-shard1-pid4294967293-00000000000000aa");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("params"), b"board").unwrap();
    let lock_path = foreign.join(OWNER_LOCK);
    std::fs::write(&lock_path, b"").unwrap();
    // a live owner in another process: flock(1) holds the lock while it sleeps
    let mut owner = std::process::Command::new("flock")
        .args(["-x", "-o"])
        .arg(&lock_path)
        .args(["sleep", "30"])
        .spawn()
        .expect("flock(1) from util-linux");
    let held = std::time::Instant::now();
    while try_lock(&File::open(&lock_path).unwrap()).is_ok() {
        assert!(
            held.elapsed().as_secs() < 10,
            "flock(1) never took the lock"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let mine = BoardDir::create(&root, "worker1").unwrap();
    assert!(foreign.join("params").exists(), "live owner: kept");
    remove_stale(&root);
    assert!(foreign.exists(), "live owner: kept");
    assert!(mine.path().exists(), "our own directory is locked by us");
    // the owner dies: the kernel releases its lock, the next creation removes the directory
    owner.kill().unwrap();
    owner.wait().unwrap();
    let other = BoardDir::create(&root, "worker2").unwrap();
    assert!(!foreign.exists(), "dead owner: removed");
    assert!(mine.path().exists() && other.path().exists());
    drop((mine, other));
    std::fs::remove_dir_all(&root).unwrap();
}

/// Truncating a board under a reader cannot kill it: the access reads zeros, the board says
/// it faulted, and other boards (and other SIGBUS causes) are unaffected.
#[test]
fn a_truncated_board_reads_as_zeros_and_says_so_instead_of_sigbus() {
    let root = std::env::temp_dir().join(format!("ps-shm-trunc-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let dir = BoardDir::create(&root, "worker0").unwrap();
    let path = grad_path(dir.path());
    let mut w = Board::create(&path, dir.token(), 5000, 1).unwrap();
    w.slot_mut(0).fill(2.5);
    let r = Board::open(&path, dir.token(), 5000, 1).unwrap();
    let other_path = dir.path().join("other");
    let mut other = Board::create(&other_path, dir.token(), 10, 1).unwrap();
    other.slot_mut(0).fill(1.0);
    assert!(!r.faulted());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    let mut out = vec![9f32; 5000];
    r.read(0, &mut out);
    assert!(r.faulted(), "the truncation was seen");
    assert!(out.iter().all(|v| *v == 0.0), "zeros, not the old values");
    // SAFETY: nothing writes the slot meanwhile.
    assert_eq!(unsafe { r.slot(0) }[4999], 0.0);
    let mut o = [0f32; 10];
    other.read(0, &mut o);
    assert!(
        !other.faulted() && o == [1.0; 10],
        "another board is untouched"
    );
    drop((w, r, other, dir));
    std::fs::remove_dir_all(&root).unwrap();
}

/// A gradient board is opened only from a board directory under the root, of this user,
/// closed to others; anything else is refused with the reason.
#[test]
fn open_trusted_refuses_files_of_other_users_and_places() {
    use std::os::unix::fs::PermissionsExt;
    let root = std::env::temp_dir().join(format!("ps-shm-trust-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let dir = BoardDir::create(&root, "worker0").unwrap();
    let path = grad_path(dir.path());
    let _w = Board::create(&path, dir.token(), 10, 1).unwrap();
    Board::open_trusted(&root, &path, dir.token(), 10, 1).expect("our own worker's board");
    // outside the root (a copy elsewhere), or not in a board directory
    let elsewhere = std::env::temp_dir().join(format!("ps-shm-else-{}", std::process::id()));
    let fake_dir = elsewhere.join("ps-worker0-pid1-00");
    std::fs::create_dir_all(&fake_dir).unwrap();
    std::fs::copy(&path, fake_dir.join("grad")).unwrap();
    let e = Board::open_trusted(&root, &fake_dir.join("grad"), dir.token(), 10, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected a board directory"), "{e}");
    let plain = root.join("grad");
    std::fs::copy(&path, &plain).unwrap();
    let e = Board::open_trusted(&root, &plain, dir.token(), 10, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected a board directory"), "{e}");
    // a symbolic link in a board directory
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&plain, &link).unwrap();
    let e = Board::open_trusted(&root, &link, dir.token(), 10, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("without following links"), "{e}");
    // readable by others
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = Board::open_trusted(&root, &path, dir.token(), 10, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("mode 644") && e.contains("expected a regular file of uid"),
        "{e}"
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    // another user's file (only root can make one here)
    // SAFETY: geteuid(2) cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        let e = Board::open_trusted(&root, &path, dir.token(), 10, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("of uid 65534"), "{e}");
        std::os::unix::fs::chown(&path, Some(0), Some(0)).unwrap();
        std::os::unix::fs::chown(dir.path(), Some(65534), None).unwrap();
        let e = Board::open_trusted(&root, &path, dir.token(), 10, 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("its directory") && e.contains("of uid 65534"),
            "{e}"
        );
        std::os::unix::fs::chown(dir.path(), Some(0), None).unwrap();
    }
    Board::open_trusted(&root, &path, dir.token(), 10, 1).expect("fine again");
    drop(dir);
    std::fs::remove_dir_all(&root).unwrap();
    std::fs::remove_dir_all(&elsewhere).unwrap();
}
