//! The SIGBUS guard of this process's board mappings. Touching a page of a shared file mapping
//! past the end of the file (another process truncated it) raises SIGBUS, which would kill the
//! process without a word. The guard's handler looks the faulting address up in a table of the
//! mappings; for one of them it maps anonymous zero pages over the whole mapping (so the access
//! goes on, reading zeros) and marks it faulted, which the code that read it checks afterwards.
//! Any other SIGBUS goes to the handler that was there before (Rust's stack-overflow report, or
//! the default action). The handler only does atomic loads and stores and `mmap`.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Mappings guarded at once (a shard holds one per rank plus its own).
const SLOTS: usize = 1024;

struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};
static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
/// The SIGBUS action before ours (installed once, at the first registration).
static PREVIOUS: OnceLock<Option<libc::sigaction>> = OnceLock::new();

/// Guards `len` bytes at `start`; the slot, or None when the table is full or the handler
/// could not be installed (the mapping is then unguarded).
pub(super) fn register(start: usize, len: usize) -> Option<usize> {
    PREVIOUS.get_or_init(install).as_ref()?;
    for (i, slot) in TABLE.iter().enumerate() {
        if slot
            .start
            .compare_exchange(0, start, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            slot.faulted.store(false, Ordering::Relaxed);
            slot.len.store(len, Ordering::Release);
            return Some(i);
        }
    }
    None
}

/// Stops guarding slot `i` (before its mapping is unmapped).
pub(super) fn unregister(i: usize) {
    TABLE[i].len.store(0, Ordering::Release);
    TABLE[i].start.store(0, Ordering::Release);
}

/// True once slot `i`'s mapping took a SIGBUS.
pub(super) fn faulted(i: usize) -> bool {
    TABLE[i].faulted.load(Ordering::Acquire)
}

fn install() -> Option<libc::sigaction> {
    // SAFETY: sigaction(2) with a zeroed, then filled, action; the previous one is kept.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        let mut previous: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, &action, &mut previous) != 0 {
            return None;
        }
        Some(previous)
    }
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in &TABLE {
        let len = slot.len.load(Ordering::Acquire);
        let start = slot.start.load(Ordering::Acquire);
        if len > 0 && (start..start + len).contains(&addr) {
            // SAFETY: replaces exactly this live mapping (registered until it is unmapped)
            // with private zero pages: the faulting access then completes.
            let p = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                slot.faulted.store(true, Ordering::Release);
                return;
            }
        }
    }
    // not a board: what would have happened without the guard
    let previous = PREVIOUS.get().copied().flatten();
    // SAFETY: calls the previous handler as it was installed, or restores the default
    // action (the faulting instruction then raises SIGBUS again and the process dies).
    unsafe {
        match previous {
            Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
                if p.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(p.sa_sigaction);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(p.sa_sigaction);
                    f(sig);
                }
            }
            _ => {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
        }
    }
}
