//! The gate between a step's pulls and its forward pass: the pulls write the flat weights of
//! version `t` shard by shard, each in ascending order, publishing how far they got; the
//! forward pass, before it reads a layer's parameters, waits (bounded) until that layer's range
//! is published in this version. So forward starts on the first layers while the last ones are
//! still arriving, and never reads a value of an older version (nor a half-written one).
//!
//! Soundness of the shared buffer: one [`ShardWriter`] per shard (handed out once) is the only
//! writer of its shard's range, and only of the part not yet published: it hands out `&mut`
//! views of values after its cursor alone, and publishing moves the cursor past them for good.
//! A reader makes references to a range only after [`PullGate::wait`] returned for it: every
//! value there is published (a release store read with acquire), so no writer touches it any
//! more in this version.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Why the forward pass could not have a layer's weights.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GateError {
    /// The pull of a shard whose values the layer needs failed (the step fails with the pull's
    /// own error; this is what the forward pass saw).
    #[error("the pull of version {version} from shard {shard} failed: {why}")]
    PullFailed {
        /// The shard.
        shard: usize,
        /// The version pulled.
        version: u64,
        /// The pull's error.
        why: String,
    },
    /// The values did not all arrive within the bound.
    #[error(
        "waited {waited_secs:.1} s for parameters {range:?} of version {version}: shard {shard} has delivered {filled} of the {needed} values of its range needed"
    )]
    Timeout {
        /// The flat range waited for.
        range: Range<usize>,
        /// The version pulled.
        version: u64,
        /// A shard that had not delivered its part.
        shard: usize,
        /// Values of its range it had delivered.
        filled: usize,
        /// Values of its range needed.
        needed: usize,
        /// How long it waited.
        waited_secs: f64,
    },
}

/// What a reader's wait is blocked on, and the per-layer wait times.
#[derive(Debug, Default)]
struct GateState {
    failed: Option<GateError>,
    /// Time [`PullGate::wait`] spent waiting for each layer.
    waits: Vec<Duration>,
}

/// The weights of one step's pull, shared by the pulling task (through [`ShardWriter`]s) and
/// the computing thread (through [`PullGate::wait`] and [`PullGate::published`]).
#[derive(Debug)]
pub struct PullGate {
    ptr: *mut f32,
    len: usize,
    version: u64,
    /// Each shard's range of the flat vector (contiguous, ascending).
    shards: Vec<Range<usize>>,
    /// Values of each shard's range published so far (from its start).
    filled: Vec<AtomicUsize>,
    /// Each shard's pull has ended well: its last values are usable (a pull that failed after
    /// delivering them does not let a step use them).
    done: Vec<AtomicBool>,
    /// Each shard's writer has been handed out.
    taken: Vec<AtomicBool>,
    /// The model's layers (flat ranges, ascending): where pieces end, and what waits count for.
    layers: Vec<Range<usize>>,
    patience: Duration,
    state: Mutex<GateState>,
    published_cv: Condvar,
}

// SAFETY: the pointer is written only by the shard writers, each in the unpublished part of
// its own shard's range (disjoint), and read only in published parts, after an acquire load
// of the counters that the writers store with release after writing: sharing the gate between
// threads creates no data race. The rest is atomics and a mutex.
unsafe impl Send for PullGate {}
// SAFETY: as for Send.
unsafe impl Sync for PullGate {}

impl PullGate {
    /// A gate over the `len` values at `ptr`, pulled as version `version` from the shards of
    /// `shards` (contiguous ranges covering `0..len` in order), read by layers `layers`; a wait
    /// gives up after `patience`.
    ///
    /// # Safety
    /// The `len` values at `ptr` must stay allocated, and be neither read nor written other
    /// than through this gate, for as long as a [`ShardWriter`] of it lives or a
    /// [`PullGate::published`] view is held; except that a range for which
    /// [`PullGate::wait`] returned `Ok` may be read (never written) directly.
    pub unsafe fn new(
        ptr: *mut f32,
        len: usize,
        version: u64,
        shards: Vec<Range<usize>>,
        layers: Vec<Range<usize>>,
        patience: Duration,
    ) -> Self {
        let mut at = 0;
        for r in &shards {
            assert_eq!(r.start, at, "shard ranges must be contiguous from 0");
            at = r.end;
        }
        assert_eq!(at, len, "shard ranges must cover the weights");
        let n = shards.len();
        Self {
            ptr,
            len,
            version,
            filled: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            done: (0..n).map(|_| AtomicBool::new(false)).collect(),
            taken: (0..n).map(|_| AtomicBool::new(false)).collect(),
            state: Mutex::new(GateState {
                failed: None,
                waits: vec![Duration::ZERO; layers.len()],
            }),
            shards,
            layers,
            patience,
            published_cv: Condvar::new(),
        }
    }

    /// The version this gate's pulls deliver.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The writer of shard `shard`'s range. Panics when it was handed out before (one writer
    /// per shard and version is what keeps the writes apart).
    pub fn writer(&self, shard: usize) -> ShardWriter<'_> {
        assert!(
            !self.taken[shard].swap(true, Ordering::AcqRel),
            "shard {shard}'s writer was handed out twice"
        );
        let r = self.shards[shard].clone();
        // where the layers end inside this shard's range: pieces end there
        let mut ends: Vec<usize> = self
            .layers
            .iter()
            .map(|l| l.end)
            .filter(|&e| e > r.start && e < r.end)
            .map(|e| e - r.start)
            .collect();
        ends.push(r.len());
        ShardWriter {
            gate: self,
            shard,
            start: r.start,
            len: r.len(),
            cursor: 0,
            ends,
        }
    }

    /// Marks shard `shard`'s pull failed with `why`: waits for its values end with
    /// [`GateError::PullFailed`]. The first failure stays.
    pub fn fail(&self, shard: usize, why: String) {
        let mut st = self.lock();
        st.failed.get_or_insert(GateError::PullFailed {
            shard,
            version: self.version,
            why,
        });
        drop(st);
        self.published_cv.notify_all();
    }

    /// Waits (at most the gate's patience) until every value of `range` is published in this
    /// version and its shard's pull did not fail; the time waited counts for the layer that
    /// holds `range.start`.
    ///
    /// # Errors
    /// [`GateError::PullFailed`] when a pull failed, [`GateError::Timeout`] past the patience.
    pub fn wait(&self, range: Range<usize>) -> Result<(), GateError> {
        let layer = self
            .layers
            .iter()
            .position(|l| l.start <= range.start && range.start < l.end);
        self.wait_for(range, layer)
    }

    /// Waits for every value, counted for no layer ([`PullGate::wait`]).
    ///
    /// # Errors
    /// As [`PullGate::wait`].
    pub fn wait_all(&self) -> Result<(), GateError> {
        self.wait_for(0..self.len, None)
    }

    fn wait_for(&self, range: Range<usize>, layer: Option<usize>) -> Result<(), GateError> {
        if self.missing(&range).is_none() {
            return Ok(()); // published already: no lock taken
        }
        let began = Instant::now();
        let mut st = self.lock();
        loop {
            let Some((shard, filled, needed)) = self.missing(&range) else {
                break;
            };
            if let Some(e) = &st.failed {
                return Err(e.clone());
            }
            let waited = began.elapsed();
            if waited >= self.patience {
                return Err(GateError::Timeout {
                    range,
                    version: self.version,
                    shard,
                    filled,
                    needed,
                    waited_secs: waited.as_secs_f64(),
                });
            }
            st = self
                .published_cv
                .wait_timeout(st, self.patience - waited)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if let Some(l) = layer {
            st.waits[l] += began.elapsed();
        }
        Ok(())
    }

    /// The first shard that has not published all of `range`'s values of its range (or whose
    /// pull has not ended well, when they include its last): `(shard, filled, needed)`.
    fn missing(&self, range: &Range<usize>) -> Option<(usize, usize, usize)> {
        self.shards.iter().enumerate().find_map(|(s, r)| {
            if r.start >= range.end || range.start >= r.end {
                return None;
            }
            let needed = range.end.min(r.end) - r.start;
            let filled = self.filled[s].load(Ordering::Acquire);
            let ended = needed < r.len() || self.done[s].load(Ordering::Acquire);
            (filled < needed || !ended).then_some((s, filled, needed))
        })
    }

    /// The values of `range`, which [`PullGate::wait`] (or [`PullGate::wait_all`]) returned
    /// `Ok` for. Panics when some are not published.
    pub fn published(&self, range: Range<usize>) -> &[f32] {
        assert!(range.start <= range.end && range.end <= self.len);
        assert!(
            self.missing(&range).is_none(),
            "parameters {range:?} read before they were published"
        );
        // SAFETY: the values lie inside the buffer (checked above) and are published (their
        // writers' release stores were read with acquire by `missing`): no writer touches
        // them again while the gate lives.
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }

    /// The time the forward passes waited for each layer.
    pub fn waits(&self) -> Vec<Duration> {
        self.lock().waits.clone()
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The only writer of one shard's range of a [`PullGate`]: a pull's
/// [`ps_common::sink::PullSink`]. Values are handed out after the cursor only, and published
/// values are behind it for good. Dropped before its pull ended well ([`ShardWriter::finish`]),
/// it fails the gate for its shard, so that no reader waits for values that will not come.
#[derive(Debug)]
pub struct ShardWriter<'g> {
    gate: &'g PullGate,
    shard: usize,
    /// The shard's range in the flat vector.
    start: usize,
    len: usize,
    /// Values published.
    cursor: usize,
    /// Where pieces end (relative to `start`): the layers' ends inside the range, and its end.
    ends: Vec<usize>,
}

impl ShardWriter<'_> {
    /// The pull delivered every value and ended well: the shard's last values are usable.
    pub fn finish(self) {
        assert_eq!(
            self.cursor, self.len,
            "finished before every value was published"
        );
        self.gate.done[self.shard].store(true, Ordering::Release);
        drop(self.gate.lock());
        self.gate.published_cv.notify_all();
    }
}

impl Drop for ShardWriter<'_> {
    fn drop(&mut self) {
        if !self.gate.done[self.shard].load(Ordering::Acquire) {
            self.gate.fail(
                self.shard,
                format!(
                    "the pull ended after {} of {} values",
                    self.cursor, self.len
                ),
            );
        }
    }
}

impl ps_common::sink::PullSink for ShardWriter<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn filled(&self) -> usize {
        self.cursor
    }

    fn next(&mut self, n: usize) -> &mut [f32] {
        assert!(
            n <= self.len - self.cursor,
            "shard {}: {n} values asked after {} of {}",
            self.shard,
            self.cursor,
            self.len
        );
        // SAFETY: the values `start + cursor ..+ n` lie inside this shard's range of the
        // buffer (checked above), which only this writer writes (one per shard); they are not
        // published (at or after the cursor), so no reader holds a reference to them
        // (`PullGate::wait` has not returned for them); the view borrows `self` mutably, so it
        // ends before `publish` moves the cursor past them.
        unsafe { std::slice::from_raw_parts_mut(self.gate.ptr.add(self.start + self.cursor), n) }
    }

    fn publish(&mut self, n: usize) {
        assert!(n <= self.len - self.cursor, "published past the range");
        self.cursor += n;
        self.gate.filled[self.shard].store(self.cursor, Ordering::Release);
        // under the lock, so that a reader between its check and its wait does not miss it
        drop(self.gate.lock());
        self.gate.published_cv.notify_all();
    }

    fn piece_end(&self) -> usize {
        let next_end = self
            .ends
            .iter()
            .copied()
            .find(|&e| e > self.cursor)
            .unwrap_or(self.len);
        next_end.min(self.cursor + ps_common::sink::PIECE_VALUES)
    }
}
