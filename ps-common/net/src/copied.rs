//! Host bytes copied by this process's data path, counted where the copy happens: the figure
//! the data-plane benchmark reports per step and the tests assert (a CUDA worker whose device
//! reads and writes the boards directly copies nothing on the host).
//!
//! A copy is one pass that reads `n` bytes from one host buffer and writes them into another
//! (a pull out of a board or a received message, a gradient out of a staging buffer, a
//! received chunk into a shard buffer). Reads that are not copies (the update reading a
//! gradient in place, a check pass) are not counted here. Process-wide ([`totals`]), relaxed
//! atomics: a figure, not a synchronisation point. A [`Scope`] counts besides only the copies
//! made on the threads that entered it (a test's thread, a shard's runtime threads), exact
//! whatever else the process copies meanwhile.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Which side of the data path made a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A pull: weights copied out of a board, a frame or a message into the puller's memory.
    Pull,
    /// A push: gradient values copied between host buffers on their way to the shard (a
    /// staging buffer into a board, a frame into a shard buffer).
    Push,
}

static PULL: AtomicU64 = AtomicU64::new(0);
static PUSH: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The scopes this thread entered, innermost last.
    static ENTERED: RefCell<Vec<Scope>> = const { RefCell::new(Vec::new()) };
}

/// Counts a host copy of `bytes` bytes on `side`: in the process's totals and in every
/// [`Scope`] this thread entered.
pub fn count(side: Side, bytes: usize) {
    let i = side as usize;
    [&PULL, &PUSH][i].fetch_add(bytes as u64, Ordering::Relaxed);
    // a thread being torn down has no scopes left to count in
    let _ = ENTERED.try_with(|e| {
        for s in e.borrow().iter() {
            s.0[i].fetch_add(bytes as u64, Ordering::Relaxed);
        }
    });
}

/// The bytes copied so far in this process: (pull, push).
pub fn totals() -> (u64, u64) {
    (PULL.load(Ordering::Relaxed), PUSH.load(Ordering::Relaxed))
}

/// The host copies made on the threads that entered it ([`Scope::enter`]) while they were in
/// it: a figure of one part of a process (a test, one in-process shard) that other threads'
/// copies do not move. Clones count into the same figures.
#[derive(Debug, Clone, Default)]
pub struct Scope(Arc<[AtomicU64; 2]>);

/// A thread's stay in a [`Scope`]: its copies count there until this is dropped, on the
/// thread that entered (it cannot be sent to another).
#[derive(Debug)]
#[must_use = "the thread leaves the scope when this is dropped"]
pub struct Entered {
    scope: Scope,
    _this_thread: PhantomData<*const ()>,
}

impl Scope {
    /// A scope no thread has entered yet, at 0 bytes.
    pub fn new() -> Self {
        Self::default()
    }

    /// This thread's copies count in this scope too, until the result is dropped (scopes
    /// nest: a copy counts in every scope its thread is in).
    pub fn enter(&self) -> Entered {
        ENTERED.with(|e| e.borrow_mut().push(self.clone()));
        Entered {
            scope: self.clone(),
            _this_thread: PhantomData,
        }
    }

    /// The bytes copied in this scope so far: (pull, push).
    pub fn totals(&self) -> (u64, u64) {
        (
            self.0[0].load(Ordering::Relaxed),
            self.0[1].load(Ordering::Relaxed),
        )
    }
}

/// A scope entered by the current thread, for the rest of the block: [`Scope::new`] and
/// [`Scope::enter`] in one.
pub fn scoped() -> (Scope, Entered) {
    let s = Scope::new();
    let e = s.enter();
    (s, e)
}

impl Drop for Entered {
    fn drop(&mut self) {
        let _ = ENTERED.try_with(|e| {
            let mut e = e.borrow_mut();
            if let Some(i) = e.iter().rposition(|s| Arc::ptr_eq(&s.0, &self.scope.0)) {
                e.remove(i);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_side() {
        let (p0, q0) = totals();
        count(Side::Pull, 40);
        count(Side::Push, 8);
        count(Side::Pull, 2);
        let (p1, q1) = totals();
        // other tests of this binary may count at the same time: at least ours
        assert!(p1 - p0 >= 42 && q1 - q0 >= 8, "{p0} {p1} {q0} {q1}");
    }

    #[test]
    fn a_scope_counts_the_copies_of_the_threads_in_it_alone() {
        let (outer, on) = scoped();
        count(Side::Pull, 40);
        let inner = Scope::new();
        let t = std::thread::scope(|s| {
            // another thread's copies count in the scopes it entered only
            s.spawn(|| count(Side::Push, 1000)).join().unwrap();
            s.spawn(|| {
                let _in = inner.enter();
                count(Side::Push, 7);
            })
            .join()
            .unwrap();
            s.spawn(|| {
                let (mine, _in) = scoped();
                count(Side::Pull, 3);
                mine.totals()
            })
            .join()
            .unwrap()
        });
        assert_eq!(t, (3, 0));
        assert_eq!(inner.totals(), (0, 7));
        {
            let _in = inner.enter();
            count(Side::Push, 5);
            count(Side::Pull, 2);
        }
        // left: no longer counted in `inner`; `outer` saw everything of this thread
        count(Side::Push, 100);
        assert_eq!(inner.totals(), (2, 12));
        assert_eq!(outer.totals(), (42, 105));
        drop(on);
        count(Side::Pull, 1);
        assert_eq!(outer.totals(), (42, 105), "left");
        // a clone counts into the same figures
        let again = outer.clone();
        let _in = again.enter();
        count(Side::Pull, 8);
        assert_eq!(outer.totals(), (50, 105));
    }
}
