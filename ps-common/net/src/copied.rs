//! Host bytes copied by this process's data path, counted where the copy happens: the figure
//! the data-plane benchmark reports per step and the tests assert (a CUDA worker whose device
//! reads and writes the boards directly copies nothing on the host).
//!
//! A copy is one pass that reads `n` bytes from one host buffer and writes them into another
//! (a pull out of a board or a received message, a gradient out of a staging buffer, a
//! received chunk into a shard buffer). Reads that are not copies (the update reading a
//! gradient in place, a check pass) are not counted here. Process-wide, relaxed atomics: a
//! figure, not a synchronisation point.

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

/// Counts a host copy of `bytes` bytes on `side`.
pub fn count(side: Side, bytes: usize) {
    let c = match side {
        Side::Pull => &PULL,
        Side::Push => &PUSH,
    };
    c.fetch_add(bytes as u64, Ordering::Relaxed);
}

/// The bytes copied so far in this process: (pull, push).
pub fn totals() -> (u64, u64) {
    (PULL.load(Ordering::Relaxed), PUSH.load(Ordering::Relaxed))
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
}
