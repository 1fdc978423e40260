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
//!
//! In place: a gate that accepts them ([`PullGate::with_in_place`], for a device that
//! registered the shards' boards for DMA) lets a shard's pull hand over the board's slot itself
//! instead of copying it ([`crate::sink::PullSink::in_place`]); the reader uploads that range
//! straight from the board ([`PullGate::source`]) and, once those uploads completed, checks
//! with [`PullGate::verify`] that no shard overwrote its slot meanwhile (a torn version is
//! refused: [`GateError::Torn`]).

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
    /// A shard's board slot read in place left the version before the device's copies out of
    /// it completed: what was read may mix versions and was not used.
    #[error(
        "shard {shard} overwrote its board slot of version {version} while the device was copying it: the values read are refused"
    )]
    Torn {
        /// The shard.
        shard: usize,
        /// The version pulled.
        version: u64,
    },
}

/// Where a published range of a [`PullGate`] lies.
#[derive(Debug)]
pub enum Source<'a> {
    /// Copied into the gate's memory by the pull.
    Copied(&'a [f32]),
    /// In a shard's board slot: these values of it (a device reads them by DMA; see
    /// [`PullGate::verify`]).
    InPlace(&'a crate::dma::InPlace, Range<usize>),
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
    /// The registrar key of the device whose registered boards a pull may hand over in place.
    in_place_key: Option<u64>,
    /// Each shard's board slot, when its pull handed it over in place.
    sources: Vec<std::sync::OnceLock<crate::dma::InPlace>>,
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
            in_place_key: None,
            sources: (0..n).map(|_| std::sync::OnceLock::new()).collect(),
        }
    }

    /// This gate, taking a shard's values in place ([`ShardWriter`]'s
    /// [`crate::sink::PullSink::in_place`]) from boards that the device of registrar key `key`
    /// registered.
    pub fn with_in_place(mut self, key: u64) -> Self {
        self.in_place_key = Some(key);
        self
    }

    /// Where range `r` (inside one shard's range), which [`PullGate::wait`] returned `Ok` for,
    /// lies: the gate's memory, or the shard's board slot. Panics when some values are not
    /// published or `r` spans shards.
    pub fn source(&self, r: Range<usize>) -> Source<'_> {
        let s = self.shard_of(r.start);
        let sr = &self.shards[s];
        assert!(r.end <= sr.end, "{r:?} spans shards");
        match self.sources[s].get() {
            Some(slot) => {
                assert!(
                    self.missing(&r).is_none(),
                    "parameters {r:?} read before they were published"
                );
                Source::InPlace(slot, r.start - sr.start..r.end - sr.start)
            }
            None => Source::Copied(self.published(r)),
        }
    }

    /// The end of the shard range that holds value `at`.
    pub fn shard_end(&self, at: usize) -> usize {
        self.shards[self.shard_of(at)].end
    }

    fn shard_of(&self, at: usize) -> usize {
        self.shards
            .iter()
            .position(|r| r.contains(&at))
            .unwrap_or(self.shards.len().saturating_sub(1))
    }

    /// Shard `shard`'s board slot, when its pull handed it over in place.
    pub fn slot(&self, shard: usize) -> Option<&crate::dma::InPlace> {
        self.sources[shard].get()
    }

    /// True when some shard's values were handed over in place.
    pub fn any_in_place(&self) -> bool {
        self.sources.iter().any(|s| s.get().is_some())
    }

    /// After the device's copies out of the in-place slots completed: `Ok` when every such
    /// slot still holds this version (the copies read it alone), [`GateError::Torn`] for the
    /// first shard whose slot left it.
    ///
    /// # Errors
    /// [`GateError::Torn`], as above.
    pub fn verify(&self) -> Result<(), GateError> {
        for (shard, s) in self.sources.iter().enumerate() {
            if s.get().is_some_and(|slot| !slot.intact()) {
                return Err(GateError::Torn {
                    shard,
                    version: self.version,
                });
            }
        }
        Ok(())
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

    /// Stands in for shard `shard`'s pull (benchmarks, tests): writes its range of `all` (the
    /// whole flat vector) `piece` values at a time, each after `pause`, then finishes.
    pub fn deliver(&self, shard: usize, all: &[f32], piece: usize, pause: Duration) {
        use crate::sink::PullSink;
        let start = self.shards[shard].start;
        let mut wr = self.writer(shard);
        while wr.filled() < wr.len() {
            std::thread::sleep(pause);
            let n = piece.max(1).min(wr.len() - wr.filled());
            let at = start + wr.filled();
            wr.next(n).copy_from_slice(&all[at..at + n]);
            wr.publish(n);
        }
        wr.finish();
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
        while let Some((shard, filled, needed)) = self.missing(&range) {
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
            self.shards
                .iter()
                .zip(&self.sources)
                .all(|(r, s)| s.get().is_none() || r.start >= range.end || range.start >= r.end),
            "parameters {range:?} lie in a board slot: read them through source()"
        );
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
/// [`crate::sink::PullSink`]. Values are handed out after the cursor only, and published
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

impl crate::sink::PullSink for ShardWriter<'_> {
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

    fn in_place(&mut self, slot: &crate::dma::InPlace) -> bool {
        let usable = self
            .gate
            .in_place_key
            .is_some_and(|k| slot.registered_with(k))
            && self.cursor == 0
            && slot.len() == self.len
            && slot.version() == self.gate.version
            && slot.intact();
        if !usable || self.gate.sources[self.shard].set(slot.clone()).is_err() {
            return false;
        }
        // every value is published: the reader takes them from the slot (`PullGate::source`)
        self.publish(self.len);
        true
    }

    fn piece_end(&self) -> usize {
        let next_end = self
            .ends
            .iter()
            .copied()
            .find(|&e| e > self.cursor)
            .unwrap_or(self.len);
        next_end.min(self.cursor + crate::sink::PIECE_VALUES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::PullSink;

    /// A gate over `buf` for version 1. The test touches `buf` only through the gate while
    /// the gate lives.
    fn gate_over(
        buf: &mut [f32],
        shards: Vec<Range<usize>>,
        layers: Vec<Range<usize>>,
        patience: Duration,
    ) -> PullGate {
        // SAFETY: each test reads and writes `buf` only through the gate while it lives.
        unsafe { PullGate::new(buf.as_mut_ptr(), buf.len(), 1, shards, layers, patience) }
    }

    /// Writes `value(i)` at every flat index `i` of `w`'s shard, `piece` values at a time,
    /// sleeping `pause` before each piece; finishes the pull.
    fn fill(mut w: ShardWriter<'_>, piece: usize, pause: Duration) {
        while w.filled() < w.len() {
            std::thread::sleep(pause);
            let n = piece.min(w.len() - w.filled());
            let at = w.start + w.filled();
            for (k, v) in w.next(n).iter_mut().enumerate() {
                *v = (at + k) as f32;
            }
            w.publish(n);
        }
        w.finish();
    }

    #[test]
    fn a_reader_sees_each_layer_only_once_every_shard_holding_it_published_it() {
        // three shards and three layers, their boundaries apart; the last shard is slow, so
        // the reader reaches the layers it holds before they are published
        let shards = vec![0..1000, 1000..2200, 2200..3000];
        let layers = vec![0..1500, 1500..2500, 2500..3000];
        for _ in 0..20 {
            // the previous version's values: -1 everywhere
            let mut buf = vec![-1f32; 3000];
            let gate = gate_over(
                &mut buf,
                shards.clone(),
                layers.clone(),
                Duration::from_secs(30),
            );
            std::thread::scope(|s| {
                for (i, pause) in [(0, 0), (1, 0), (2, 200)] {
                    let w = gate.writer(i);
                    s.spawn(move || fill(w, 37, Duration::from_micros(pause)));
                }
                for l in &layers {
                    gate.wait(l.clone()).unwrap();
                    let got = gate.published(l.clone());
                    for (k, v) in got.iter().enumerate() {
                        assert_eq!(*v, (l.start + k) as f32, "layer {l:?}, value {k}");
                    }
                }
            });
            assert_eq!(gate.waits().len(), 3);
        }
    }

    #[test]
    fn a_layer_waits_for_every_shard_holding_part_of_it_and_for_the_pull_to_end() {
        let mut buf = vec![0f32; 10];
        let short = Duration::from_millis(1);
        let gate = gate_over(&mut buf, vec![0..4, 4..10], vec![0..6, 6..10], short);
        let mut w0 = gate.writer(0);
        let mut w1 = gate.writer(1);
        w0.next(4).fill(1.0);
        w0.publish(4);
        w0.finish();
        // layer 0 also needs values 4 and 5, shard 1's first two
        let err = gate.wait(0..6).unwrap_err();
        assert!(
            matches!(
                err,
                GateError::Timeout {
                    shard: 1,
                    filled: 0,
                    needed: 2,
                    version: 1,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("parameters 0..6 of version 1: shard 1 has delivered 0 of the 2"),
            "{err}"
        );
        w1.next(2).fill(2.0);
        w1.publish(2);
        gate.wait(0..6).unwrap();
        assert_eq!(gate.published(0..6), [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]);
        // the last values of a shard are usable only once its pull ended well
        w1.next(4).fill(3.0);
        w1.publish(4);
        assert!(gate.wait(6..10).is_err());
        w1.finish();
        gate.wait(6..10).unwrap();
        gate.wait_all().unwrap();
        assert_eq!(gate.published(6..10), [3.0; 4]);
    }

    #[test]
    fn a_published_value_is_never_handed_out_again() {
        let mut buf = vec![0f32; 8];
        let base = buf.as_ptr();
        let gate = gate_over(
            &mut buf,
            vec![0..3, 3..8],
            vec![0..4, 4..8],
            Duration::from_secs(1),
        );
        let mut w = gate.writer(1);
        assert_eq!(w.next(2).as_ptr(), base.wrapping_add(3));
        w.publish(2);
        // after publishing, what is handed out starts after the published values
        let next = w.next(3);
        assert_eq!(next.as_ptr(), base.wrapping_add(5));
        assert_eq!(next.len(), 3);
        // nothing past the shard's range, no second writer for the shard, nothing read that
        // is not published
        let over = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            w.next(4);
        }));
        assert!(over.is_err());
        let twice = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gate.writer(1);
        }));
        assert!(twice.is_err());
        let early = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gate.published(3..6);
        }));
        assert!(early.is_err());
        w.publish(3);
        w.finish();
    }

    #[test]
    fn a_failed_or_abandoned_pull_ends_the_waits_with_its_error() {
        let mut buf = vec![0f32; 6];
        let long = Duration::from_secs(60);
        let gate = gate_over(&mut buf, vec![0..3, 3..6], vec![0..2, 2..6], long);
        let w0 = gate.writer(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                gate.fail(1, "shard 1 at 127.0.0.1:1 is unreachable".into());
            });
            // waits (not the whole minute): the failure wakes it
            let err = gate.wait(2..6).unwrap_err();
            assert_eq!(
                err,
                GateError::PullFailed {
                    shard: 1,
                    version: 1,
                    why: "shard 1 at 127.0.0.1:1 is unreachable".into()
                }
            );
        });
        // a writer dropped before its pull ended fails its shard too
        let mut buf = vec![0f32; 6];
        let gate2 = gate_over(&mut buf, vec![0..3, 3..6], vec![0..2, 2..6], long);
        let mut w = gate2.writer(0);
        w.next(2).fill(1.0);
        w.publish(2);
        drop(w);
        let err = gate2.wait(0..1).and_then(|()| gate2.wait(0..6));
        assert!(
            matches!(&err, Err(GateError::PullFailed { shard: 0, why, .. }) if why == "the pull ended after 2 of 3 values"),
            "{err:?}"
        );
        drop(w0);
    }
}
