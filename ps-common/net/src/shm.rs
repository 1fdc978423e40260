//! The shared-memory data path between a shard and the workers on its host (`[cluster]
//! transport = "auto"`): gRPC still carries every request, its checks and its reply, but the
//! tensors are not serialised, sent through loopback TCP and parsed; they are read where they
//! lie, in files in `/dev/shm` (`$PS_SHM_DIR`):
//!
//! - the shard's `params` board: two slots of the shard's parameters, which the update reads
//!   and writes in place (double buffering). Version `v` is in slot `v % 2` under a sequence
//!   number (a seqlock): a worker copies the slot and then checks that the sequence still says
//!   "version `v`, complete"; otherwise it pulls that version through gRPC instead.
//! - each worker's `grad` board: one slot of the whole flat gradient, which its backward pass
//!   writes directly. A push names the step and says "in shared memory"; the shard checks its
//!   range in place (finite values, fingerprint) and aggregates from it. The worker writes the
//!   board again only after it has pulled the next version, that is after every shard applied
//!   the step: a worker that breaks this rule corrupts its own gradient, exactly as if it had
//!   pushed wrong values.
//!
//! Every file starts with a header (magic, a random token exchanged on registration, the slot
//! length), so that a process on another host, or one that finds a stale file, falls back to
//! gRPC instead of reading the wrong memory. The owner of a directory holds a `flock` on its
//! `owner.lock` while it lives; a new owner removes the directories whose lock is free (the pid
//! in the name is for people: it means nothing in another PID namespace).
//!
//! A board's memory can be read and written by a device directly (DMA, no host copy): the
//! device registers the mapping through [`Board::register`] ([`registration`]), and the board
//! owns that registration from then on. The lifetime rule is a type rule: a registration lives
//! inside the mapping's owner and is dropped (unregistered) by the mapping's own `Drop`, before
//! the `munmap`; every value that reads the board in place ([`InPlace`]) holds the mapping, so
//! neither the memory nor its registration can go while one is in use.

mod dir;
mod guard;
pub mod registration;

pub use crate::dma::{HostRegistration, InPlace, Registrar};
pub use dir::{BoardDir, grad_path, params_path, remove_stale, shm_root, this_user};
pub use registration::RegisterError;

use crate::sink::PullSink;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering, fence};

/// "PSSHM" + format version.
const MAGIC: u64 = u64::from_le_bytes(*b"PSSHM\0v1");
/// Bytes before the first slot (one page: magic, token, length, slot count, sequences).
const HEADER: usize = 4096;
/// Byte offset of slot `k`'s sequence number in the header.
const fn seq_offset(k: usize) -> usize {
    64 + 64 * k
}
/// Most slots a board has (so that the sequences fit the header page).
const MAX_SLOTS: usize = 8;

/// A file in shared memory mapped into this process, guarded against truncation
/// ([`guard`]): a page that the file no longer backs reads as zeros instead of killing the
/// process with SIGBUS, and the mapping says it [`Mapping::faulted`].
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// Its slot in the SIGBUS guard's table (None: the table was full; unguarded).
    guard: Option<usize>,
    /// The devices' registrations of this mapping for DMA, by registrar key: dropped
    /// (unregistered) by `Drop` before the memory is unmapped.
    registrations: std::sync::Mutex<Vec<(u64, Box<dyn HostRegistration>)>>,
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("guard", &self.guard)
            .finish()
    }
}

// SAFETY: the mapping is plain shared memory; access to the header goes through atomics and
// access to the slots is coordinated by the protocol described in the module docs.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(file: &File, len: usize) -> io::Result<Self> {
        // SAFETY: a fresh shared mapping of `len` bytes of `file`, checked for failure.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(file),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            ptr: NonNull::new(p.cast()).expect("mmap returned a null mapping"),
            len,
            guard: guard::register(p as usize, len),
            registrations: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// True once a page of it was found no longer backed by the file (the file was truncated
    /// by another process): its contents read as zeros from then on.
    fn faulted(&self) -> bool {
        self.guard.is_some_and(guard::faulted)
    }

    fn atomic(&self, offset: usize) -> &AtomicU64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= HEADER.min(self.len));
        // SAFETY: in bounds and 8-byte aligned (mappings are page-aligned); AtomicU64 has the
        // layout of u64 and the memory lives as long as `self`.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // the devices' registrations first: no DMA may reach the memory once it is unmapped
        let registrations = self
            .registrations
            .get_mut()
            .unwrap_or_else(|e| e.into_inner());
        registrations.clear();
        if let Some(g) = self.guard {
            guard::unregister(g);
        }
        // SAFETY: unmaps exactly what `new` mapped; no reference into it outlives `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// A shared-memory file of `slots` slots of `len` f32 values each, behind a checked header.
#[derive(Debug)]
pub struct Board {
    /// Shared with the [`InPlace`] views of its slots, which keep it mapped.
    map: std::sync::Arc<Mapping>,
    len: usize,
    slots: usize,
    path: PathBuf,
}

fn slot_bytes(len: usize) -> usize {
    (len * 4).div_ceil(4096) * 4096
}

impl Board {
    /// Creates the file at `path` (it must not exist; mode 0600) and maps it.
    pub fn create(path: &Path, token: u64, len: usize, slots: usize) -> io::Result<Self> {
        assert!((1..=MAX_SLOTS).contains(&slots));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        let total = HEADER + slots * slot_bytes(len);
        // reserve the pages now: a sparse file on a full tmpfs (Docker's 64 MB /dev/shm) would
        // kill the first process that touches a missing page with SIGBUS; this fails instead
        // SAFETY: plain system call on a file descriptor we own.
        let rc = unsafe {
            libc::posix_fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
                total as libc::off_t,
            )
        };
        if rc != 0 {
            let _ = std::fs::remove_file(path);
            let e = io::Error::from_raw_os_error(rc);
            return Err(io::Error::new(
                e.kind(),
                format!("cannot reserve {total} bytes: {e}"),
            ));
        }
        let map = std::sync::Arc::new(Mapping::new(&file, total)?);
        map.atomic(8).store(token, Ordering::Relaxed);
        map.atomic(16).store(len as u64, Ordering::Relaxed);
        map.atomic(24).store(slots as u64, Ordering::Relaxed);
        // the magic last: a reader that sees it sees the rest of the header
        map.atomic(0).store(MAGIC, Ordering::Release);
        Ok(Self {
            map,
            len,
            slots,
            path: path.to_path_buf(),
        })
    }

    /// Opens and maps the file at `path`, checking that it is a board of `slots` slots of `len`
    /// values created with `token`; the error says what did not match.
    pub fn open(path: &Path, token: u64, len: usize, slots: usize) -> Result<Self, BoardError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| BoardError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        Self::map_file(file, path, token, len, slots)
    }

    /// Opens a board that another process of this user made in its board directory under
    /// `root` (a worker's gradient board, as [`BoardDir::create`] and [`Board::create`] make
    /// it), refusing anything else before mapping it: `path` must be a file directly inside a
    /// `ps-*-pid*` directory directly under `root`; the directory and the file (opened without
    /// following a symbolic link, then checked with fstat) must belong to this process's user
    /// and be closed to every other (modes 0700 and 0600), and the file must be a regular file
    /// with one link. So no other local user can hand this process a file of theirs (which they
    /// could change or truncate at will), nor point it at one outside the board directories.
    pub fn open_trusted(
        root: &Path,
        path: &Path,
        token: u64,
        len: usize,
        slots: usize,
    ) -> Result<Self, BoardError> {
        use std::os::unix::fs::MetadataExt;
        let refuse = |why: String| BoardError::Refused {
            path: path.to_path_buf(),
            why,
        };
        let dir = path
            .parent()
            .filter(|_| path.file_name().is_some())
            .ok_or_else(|| refuse("expected a file in a board directory".into()))?;
        let in_root = dir.parent().map(std::fs::canonicalize).and_then(Result::ok)
            == std::fs::canonicalize(root).ok();
        let named = dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("ps-") && n.contains("-pid"));
        if !in_root || !named {
            return Err(refuse(format!(
                "expected a board directory ps-<name>-pid<pid>-<token> directly under {}",
                root.display()
            )));
        }
        // SAFETY: geteuid(2) cannot fail.
        let me = unsafe { libc::geteuid() };
        let d = std::fs::symlink_metadata(dir)
            .map_err(|e| refuse(format!("cannot stat {}: {e}", dir.display())))?;
        if !d.is_dir() || d.uid() != me || d.mode() & 0o077 != 0 {
            return Err(refuse(format!(
                "its directory {} is {} of uid {} with mode {:o}: expected a directory of uid {me} (this process's user) with mode 700",
                dir.display(),
                if d.is_dir() {
                    "a directory"
                } else {
                    "not a directory"
                },
                d.uid(),
                d.mode() & 0o7777
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| refuse(format!("cannot open it without following links: {e}")))?;
        let m = file
            .metadata()
            .map_err(|e| refuse(format!("cannot stat it: {e}")))?;
        if !m.file_type().is_file() || m.uid() != me || m.mode() & 0o077 != 0 || m.nlink() != 1 {
            return Err(refuse(format!(
                "it is {} of uid {} with mode {:o} and {} link(s): expected a regular file of uid {me} (this process's user) with mode 600 and one link",
                if m.file_type().is_file() {
                    "a file"
                } else {
                    "not a regular file"
                },
                m.uid(),
                m.mode() & 0o7777,
                m.nlink()
            )));
        }
        Self::map_file(file, path, token, len, slots)
    }

    fn map_file(
        file: File,
        path: &Path,
        token: u64,
        len: usize,
        slots: usize,
    ) -> Result<Self, BoardError> {
        let size = file
            .metadata()
            .map_err(|source| BoardError::Stat {
                path: path.to_path_buf(),
                source,
            })?
            .len() as usize;
        let total = HEADER + slots * slot_bytes(len);
        if size != total {
            return Err(BoardError::Size {
                path: path.to_path_buf(),
                size,
                total,
                slots,
                len,
            });
        }
        let map =
            std::sync::Arc::new(
                Mapping::new(&file, total).map_err(|source| BoardError::Map {
                    path: path.to_path_buf(),
                    source,
                })?,
            );
        let got = [0, 8, 16, 24].map(|o| map.atomic(o).load(Ordering::Acquire));
        let expected = [MAGIC, token, len as u64, slots as u64];
        if got != expected {
            return Err(BoardError::NotThisBoard {
                path: path.to_path_buf(),
                got,
                expected,
            });
        }
        Ok(Self {
            map,
            len,
            slots,
            path: path.to_path_buf(),
        })
    }

    /// Values per slot.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True once this process found the file truncated under its mapping (another process
    /// shrank it): what was read from it since is zeros, not the board's values, and the board
    /// must not be used any more.
    pub fn faulted(&self) -> bool {
        self.map.faulted()
    }

    /// True when the slots hold no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn slot_ptr(&self, k: usize) -> *mut f32 {
        assert!(k < self.slots);
        // SAFETY: slot k lies within the mapping (HEADER + slots * slot_bytes), page-aligned.
        unsafe {
            self.map
                .ptr
                .as_ptr()
                .add(HEADER + k * slot_bytes(self.len))
                .cast()
        }
    }

    /// Copies slot `k` into `dst` (`dst.len()` must be the slot length). Another process may
    /// write the slot meanwhile (then [`Board::read_version`] discards the copy by the sequence
    /// number), so a racing write can give a torn copy but must never be undefined behaviour,
    /// as a plain copy's data race would be: see [`Board::read_part`].
    pub fn read(&self, k: usize, dst: &mut [f32]) {
        assert_eq!(dst.len(), self.len, "board read: length mismatch");
        self.read_part(k, 0, dst);
    }

    /// Copies values `from..from + dst.len()` of slot `k` into `dst`. On x86-64 the copy is
    /// one `rep movsb` in inline assembly, which Rust's memory model sees as opaque byte loads
    /// (the seqlock reader's way, at memcpy speed); elsewhere relaxed atomic loads of the
    /// 4-byte values.
    pub fn read_part(&self, k: usize, from: usize, dst: &mut [f32]) {
        assert!(
            from <= self.len && dst.len() <= self.len - from,
            "board read: {from}+{} past the slot's {} values",
            dst.len(),
            self.len
        );
        // SAFETY: `from + dst.len() <= len` (checked above): the values lie inside slot k.
        let src = unsafe { self.slot_ptr(k).add(from) };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the `dst.len()` values at `src` lie inside the mapping, which outlives
        // `&self`, and `dst` holds as many and is borrowed mutably, so the two do not overlap;
        // the direction flag is clear at every Rust call boundary (SysV ABI), so `rep movsb`
        // copies forwards; it touches no stack and no flags.
        unsafe {
            std::arch::asm!(
                "rep movsb",
                inout("rcx") dst.len() * 4 => _,
                inout("rsi") src.cast::<u8>().cast_const() => _,
                inout("rdi") dst.as_mut_ptr().cast::<u8>() => _,
                options(nostack, preserves_flags)
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            // SAFETY: the values lie inside the slot, which starts page-aligned, so each is
            // 4-byte aligned; atomics have the layout of the plain integers, and the mapping
            // outlives `&self`. Only atomic loads read it here.
            let words = unsafe {
                std::slice::from_raw_parts(src.cast::<std::sync::atomic::AtomicU32>(), dst.len())
            };
            for (d, w) in dst.iter_mut().zip(words) {
                *d = f32::from_bits(w.load(Ordering::Relaxed));
            }
        }
    }

    /// Slot `k`, for this process to write (the other processes read it by the protocol).
    pub fn slot_mut(&mut self, k: usize) -> &mut [f32] {
        // SAFETY: the slot's `len` values, borrowed mutably through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(k), self.len) }
    }

    /// Slot `k`, read in place.
    ///
    /// # Safety
    /// No process may write the slot while the slice lives (the protocol in the module docs
    /// says when that holds); a writer that breaks it makes the values change under the reader.
    pub unsafe fn slot(&self, k: usize) -> &[f32] {
        // SAFETY: the slot's `len` values inside the mapping, which outlives `&self`.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(k), self.len) }
    }

    /// Starts publishing `version` in slot `version % 2` and gives the slot to write into;
    /// readers that look now see "being written" and go to gRPC. Needs `&mut self`, so this
    /// process holds no other view of the board while the slice lives.
    pub fn begin_version(&mut self, version: u64) -> &mut [f32] {
        let k = (version % 2) as usize;
        self.map
            .atomic(seq_offset(k))
            .store(2 * version + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        // SAFETY: the slot's `len` values, borrowed mutably through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(k), self.len) }
    }

    /// Starts publishing `version` (as [`Board::begin_version`]) and returns the slot of
    /// `version - 1` to read the current values from, and the slot of `version` to write: a
    /// double-buffered update in place in shared memory.
    ///
    /// # Safety
    /// The caller is this process's only writer of the board, and holds neither slice past
    /// [`Board::end_version`]; other readers in this process use [`Board::read_version`] only
    /// (which detects a concurrent write instead of returning torn values).
    #[allow(clippy::mut_from_ref)] // exclusivity is the caller's contract, as documented
    pub unsafe fn update_slots(&self, version: u64) -> (&[f32], &mut [f32]) {
        assert!(version >= 1 && self.slots >= 2);
        let (src, dst) = (((version - 1) % 2) as usize, (version % 2) as usize);
        self.map
            .atomic(seq_offset(dst))
            .store(2 * version + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        // SAFETY: two distinct slots of `len` values each; exclusivity per the contract above.
        unsafe {
            (
                std::slice::from_raw_parts(self.slot_ptr(src), self.len),
                std::slice::from_raw_parts_mut(self.slot_ptr(dst), self.len),
            )
        }
    }

    /// Marks `version` complete in its slot (after [`Board::begin_version`] and the writes).
    pub fn end_version(&self, version: u64) {
        let k = (version % 2) as usize;
        self.map
            .atomic(seq_offset(k))
            .store(2 * version + 2, Ordering::Release);
    }

    /// Publishes `values` as `version` in one go.
    pub fn publish(&mut self, version: u64, values: &[f32]) {
        self.begin_version(version).copy_from_slice(values);
        self.end_version(version);
    }

    /// Copies version `version` into `dst` if its slot holds that version, complete, before
    /// and after the copy; false otherwise (the caller pulls through gRPC instead).
    pub fn read_version(&self, version: u64, dst: &mut [f32]) -> bool {
        let k = (version % 2) as usize;
        let seq = self.map.atomic(seq_offset(k));
        if seq.load(Ordering::Acquire) != 2 * version + 2 {
            return false;
        }
        self.read(k, dst);
        fence(Ordering::Acquire);
        seq.load(Ordering::Relaxed) == 2 * version + 2
    }

    /// [`Board::read_version`] into `sink`, piece by piece (pieces end where
    /// [`PullSink::piece_end`] says: a layer's end), each piece checked against the sequence
    /// number after its copy and published only then; from `sink.filled()` on. False when
    /// version `version` was not on the board or left it during the copy: the pieces published
    /// before are of `version` (each was checked), the rest is not filled. A large range is
    /// copied by several threads at once ([`copy_threads`]: one alone does not reach the
    /// machine's memory bandwidth), still published in ascending order. The values published
    /// count as a pull's host copy ([`crate::copied`]).
    pub fn read_version_into(&self, version: u64, sink: &mut dyn PullSink) -> bool {
        let before = sink.filled();
        let ok = self.read_version_into_uncounted(version, sink);
        crate::copied::count(crate::copied::Side::Pull, 4 * (sink.filled() - before));
        ok
    }

    fn read_version_into_uncounted(&self, version: u64, sink: &mut dyn PullSink) -> bool {
        assert_eq!(sink.len(), self.len, "board read: length mismatch");
        let k = (version % 2) as usize;
        let seq = self.map.atomic(seq_offset(k));
        if seq.load(Ordering::Acquire) != 2 * version + 2 {
            return false;
        }
        if copy_threads(sink.len() - sink.filled()) > 1 {
            return self.read_parallel(k, 2 * version + 2, sink);
        }
        while sink.filled() < sink.len() {
            let from = sink.filled();
            let n = sink.piece_end().max(from + 1).min(sink.len()) - from;
            self.read_part(k, from, sink.next(n));
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) != 2 * version + 2 {
                return false;
            }
            sink.publish(n);
        }
        true
    }

    /// The rest of slot `k` after `sink.filled()` copied into `sink` by [`copy_threads`]
    /// threads (this one among them), [`COPY_BLOCK`] values at a time, taken in ascending
    /// order; this thread publishes the longest run of copied blocks from the start whenever
    /// it grows, after checking that the slot's sequence number is still `seq_want`. False
    /// when it changed (nothing more is published; the copies under way end on their own).
    fn read_parallel(&self, k: usize, seq_want: u64, sink: &mut dyn PullSink) -> bool {
        use std::sync::atomic::{AtomicBool, AtomicUsize};
        let from = sink.filled();
        let rest = sink.len() - from;
        let blocks = rest.div_ceil(COPY_BLOCK);
        let done: Vec<AtomicBool> = (0..blocks).map(|_| AtomicBool::new(false)).collect();
        let (claimed, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
        // the unpublished rest of the sink, written block by block by the threads below: each
        // block by one thread, never after it was published (PullSink's contract)
        let dst = SendPtr(sink.next(rest).as_mut_ptr());
        let seq = self.map.atomic(seq_offset(k));
        let copy_one = || {
            let b = claimed.fetch_add(1, Ordering::Relaxed);
            if b >= blocks || stop.load(Ordering::Relaxed) {
                return false;
            }
            let at = b * COPY_BLOCK;
            let n = COPY_BLOCK.min(rest - at);
            // SAFETY: block b of the rest handed out by `sink.next` above: in bounds, written
            // by this thread alone (claimed once), not published before `done[b]` is set
            let out = unsafe { std::slice::from_raw_parts_mut(dst.get().add(at), n) };
            self.read_part(k, from + at, out);
            done[b].store(true, Ordering::Release);
            true
        };
        std::thread::scope(|scope| {
            for _ in 1..copy_threads(rest) {
                scope.spawn(|| while copy_one() {});
            }
            let mut published = 0;
            while published < blocks {
                let mut ready = published;
                while ready < blocks && done[ready].load(Ordering::Acquire) {
                    ready += 1;
                }
                if ready == published {
                    if !copy_one() {
                        std::thread::yield_now();
                    }
                    continue;
                }
                fence(Ordering::Acquire);
                if seq.load(Ordering::Relaxed) != seq_want {
                    stop.store(true, Ordering::Relaxed);
                    return false;
                }
                let upto = (ready * COPY_BLOCK).min(rest);
                sink.publish(upto - published * COPY_BLOCK);
                published = ready;
            }
            true
        })
    }
}

/// The values one thread of a parallel board read copies at a time (1 MiB).
pub const COPY_BLOCK: usize = 1 << 18;

/// Threads that copy `values` values out of a board together: one per [`COPY_BLOCK`] (at
/// least two blocks each way), at most the cores this process may use, and at most 8 (about
/// what a socket's memory bandwidth needs).
pub fn copy_threads(values: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (values / (2 * COPY_BLOCK)).clamp(1, cores.min(8))
}

/// A raw destination pointer shared by the threads of a parallel copy (each writes its own
/// blocks).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

// SAFETY: the pointer is only dereferenced for disjoint blocks, one thread each
// (`Board::read_parallel`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Why a board could not be opened ([`Board::open`], [`Board::open_trusted`]).
#[derive(Debug, thiserror::Error)]
pub enum BoardError {
    /// The file could not be opened.
    #[error("cannot open {}: {source}", path.display())]
    Open {
        /// The board's file.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
    /// The file could not be examined.
    #[error("cannot stat {}: {source}", path.display())]
    Stat {
        /// The board's file.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
    /// Another user's file, or one outside the board directories (`Board::open_trusted`).
    #[error("{} refused: {why}", path.display())]
    Refused {
        /// The file named.
        path: PathBuf,
        /// What it is, and what was expected.
        why: String,
    },
    /// The file's size is not that of the board asked for.
    #[error("{} has {size} bytes: expected {total} ({slots} slots of {len} values)", path.display())]
    Size {
        /// The board's file.
        path: PathBuf,
        /// Its size.
        size: usize,
        /// The size expected.
        total: usize,
        /// Slots asked for.
        slots: usize,
        /// Values per slot asked for.
        len: usize,
    },
    /// The file could not be mapped.
    #[error("cannot map {}: {source}", path.display())]
    Map {
        /// The board's file.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
    /// The header is not that of the board asked for.
    #[error("{} is not this shard's board: header (magic, token, length, slots) = {got:x?}, expected {expected:x?} (another host's or a stale file?)", path.display())]
    NotThisBoard {
        /// The board's file.
        path: PathBuf,
        /// Its header.
        got: [u64; 4],
        /// The header expected.
        expected: [u64; 4],
    },
}

#[cfg(test)]
mod tests;
