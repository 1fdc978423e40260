//! The directories that hold a process's boards: made with an owner lock, found and removed
//! once their owner is gone, and the board paths inside them.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// A directory of boards in `/dev/shm`, removed when dropped. Its owner holds an exclusive
/// `flock` on `<dir>/owner.lock` for as long as it lives: the kernel drops the lock when the
/// process dies (however it dies), and a lock is seen from every PID namespace that shares the
/// tmpfs (Docker `--ipc=host`), where the owner's pid is not.
#[derive(Debug)]
pub struct BoardDir {
    path: PathBuf,
    token: u64,
    /// Holds the owner lock; closed (lock released) when dropped.
    _lock: File,
}

/// The owner lock's name inside a board directory.
pub(super) const OWNER_LOCK: &str = "owner.lock";

/// The tmpfs where boards live: `$PS_SHM_DIR` if set, else `/dev/shm`; None where it is not a
/// directory (then only gRPC is offered).
pub fn shm_root() -> Option<PathBuf> {
    let p = std::env::var_os("PS_SHM_DIR").map_or_else(|| PathBuf::from("/dev/shm"), PathBuf::from);
    p.is_dir().then_some(p)
}

impl BoardDir {
    /// Creates `<root>/ps-<name>-pid<pid>-<token>` (`name` is e.g. `shard0` or `worker3`)
    /// with a fresh random token and takes its owner lock, after removing the directories whose
    /// owner lock nobody holds (their owners died).
    pub fn create(root: &Path, name: &str) -> io::Result<Self> {
        remove_stale(root);
        let token = random_token();
        let path = root.join(format!("ps-{name}-pid{}-{token:016x}", std::process::id()));
        let err =
            |p: &Path, e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", p.display()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| err(&path, e))?;
        // locked under a temporary name, then renamed: `owner.lock` exists only while locked,
        // so another process's `remove_stale` never sees it free while its owner lives
        let tmp = path.join("owner.lock.tmp");
        let lock = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| err(&tmp, e))?;
        try_lock(&lock).map_err(|e| err(&tmp, e))?;
        std::fs::rename(&tmp, path.join(OWNER_LOCK)).map_err(|e| err(&tmp, e))?;
        Ok(Self {
            path,
            token,
            _lock: lock,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The token every board in it carries.
    pub fn token(&self) -> u64 {
        self.token
    }
}

impl Drop for BoardDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The parameters board of a shard in `dir`.
pub fn params_path(dir: &Path) -> PathBuf {
    dir.join("params")
}

/// A worker's gradient board in `dir`.
pub fn grad_path(dir: &Path) -> PathBuf {
    dir.join("grad")
}

/// This process's effective user id (who owns the boards it makes).
pub fn this_user() -> u32 {
    // SAFETY: geteuid(2) cannot fail.
    unsafe { libc::geteuid() }
}

fn random_token() -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    std::process::id().hash(&mut h);
    std::time::SystemTime::now().hash(&mut h);
    h.finish() | 1
}

/// Takes an exclusive `flock` on `f` without waiting; `WouldBlock` when another open file holds it.
pub(super) fn try_lock(f: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock(2) on a file descriptor this `File` owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// How old a board directory without an owner lock must be before it counts as abandoned:
/// creating one takes microseconds; older ones are from a version without owner locks, or from
/// an owner that died between `mkdir` and taking the lock.
pub(super) const UNLOCKED_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes the `ps-*-pid*` board directories under `root` whose owner lock nobody holds: the
/// lock, not the pid in the name, decides, because a process in another PID namespace (a
/// container sharing `/dev/shm`) cannot see the owner's pid but does see its lock.
pub fn remove_stale(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let ours = name
            .to_str()
            .is_some_and(|n| n.starts_with("ps-") && n.contains("-pid"));
        if !ours || !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = e.path();
        match File::open(dir.join(OWNER_LOCK)) {
            // held while we hold it: its owner is gone and cannot come back
            Ok(f) => {
                if try_lock(&f).is_ok() {
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                let old = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > UNLOCKED_GRACE);
                if old {
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
            Err(_) => {}
        }
    }
}
