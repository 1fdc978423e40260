//! The BSP barrier of one shard: which ranks take part, each rank's gradient slot for the step
//! being gathered, the fingerprints that tell an identical retry (acknowledged, not counted)
//! from a conflicting one (refused), and the timeout with its policy (`[server]
//! barrier_policy`: fail the run, or go on without the ranks that did not push).
//!
//! It holds no parameters and does no arithmetic: [`Barrier::accept`] hands the slots out once
//! the step is complete, the caller applies them and calls [`Barrier::finish`]; the caller
//! asks [`Barrier::poll`] what the policy says while a step waits.

use super::{Grad, Slot};
use ps_config::BarrierPolicy;
use ps_proto::{PsError, PsResult};
use std::time::{Duration, Instant};

/// When the barrier warns and gives up, and what it does then.
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    /// Log the missing ranks after this long, and again every this long.
    pub warn: Duration,
    /// Apply the policy after this long.
    pub timeout: Duration,
    /// Before any rank registered, wait this long for the first (the workers' own patience,
    /// `[worker] connect_timeout_secs` + `[server] barrier_timeout_secs`), then fail the run.
    pub first_worker: Duration,
    /// Fail the run, or continue without the missing ranks.
    pub policy: BarrierPolicy,
}

/// What became of an accepted push.
#[derive(Debug)]
pub enum Accepted {
    /// Counted for the step; the barrier waits for more.
    Counted {
        /// Ranks in for the step now.
        ranks_in: u32,
    },
    /// The same gradient again (this step, or the step just applied): acknowledged only.
    Retry {
        /// Ranks in for the step the retry is of.
        ranks_in: u32,
    },
    /// A push of the step that went on without this rank: acknowledged, not counted; the rank
    /// takes part again from now on.
    Late {
        /// Ranks in for the current step.
        ranks_in: u32,
    },
    /// Counted, and it completed the step: the slots to apply, in rank order.
    Complete {
        /// Ranks in.
        ranks_in: u32,
        /// The gradients.
        slots: Vec<Slot>,
    },
}

impl Accepted {
    /// True when the gradient was counted for the step.
    pub fn counted(&self) -> bool {
        matches!(self, Accepted::Counted { .. } | Accepted::Complete { .. })
    }

    /// Ranks in for the step.
    pub fn ranks_in(&self) -> u32 {
        match *self {
            Accepted::Counted { ranks_in }
            | Accepted::Retry { ranks_in }
            | Accepted::Late { ranks_in }
            | Accepted::Complete { ranks_in, .. } => ranks_in,
        }
    }
}

/// What the policy says about the step being gathered.
#[derive(Debug)]
pub enum Verdict {
    /// No step waits (an update runs, the run is over).
    Idle,
    /// Keep waiting for `missing`; `warn` is true when it is time to log them.
    Waiting {
        /// The step.
        step: u64,
        /// Ranks not in yet that have no push under way either (the barrier timeout runs only
        /// while some are).
        missing: Vec<usize>,
        /// The lowest rank whose gradient the step still needs.
        awaited: Option<usize>,
        /// Ranks whose push is under way (received, or waiting for its turn), not counted yet.
        queued: Vec<usize>,
        /// Since the previous step was applied.
        waited: Duration,
        /// Log now.
        warn: bool,
    },
    /// No rank has registered yet (workers still starting: loading their data, a container
    /// image); the step's barrier clock starts at the first registration.
    Unjoined {
        /// The step.
        step: u64,
        /// Since the barrier was created.
        waited: Duration,
        /// The bound: the run fails when it passes with no registration ([`Rules::first_worker`]).
        bound: Duration,
        /// Log now.
        warn: bool,
    },
    /// No rank registered within [`Rules::first_worker`] of the barrier's creation.
    NoWorker {
        /// The step.
        step: u64,
        /// Since the barrier was created.
        waited: Duration,
    },
    /// The timeout passed under `barrier_policy = "fail"`, or twice the timeout under
    /// "continue" with nothing to go on with.
    Fail {
        /// The step.
        step: u64,
        /// Ranks not in.
        missing: Vec<usize>,
        /// Since the previous step was applied.
        waited: Duration,
    },
    /// The timeout passed under `barrier_policy = "continue"`: apply these slots; the ranks
    /// left out are not waited for until they register or push again.
    Continue {
        /// The step.
        step: u64,
        /// The gradients that came in, in rank order.
        slots: Vec<Slot>,
        /// Ranks left out.
        left_out: Vec<usize>,
        /// Since the previous step was applied.
        waited: Duration,
    },
}

/// The barrier of one shard (see the module docs).
#[derive(Debug)]
pub struct Barrier {
    world: usize,
    /// The step being gathered: the shard's version.
    step: u64,
    total_steps: u64,
    rules: Rules,
    registered: Vec<bool>,
    /// Ranks the barrier no longer waits for (dropped by "continue") until they come back.
    absent: Vec<bool>,
    /// Ranks the last step went on without: their late push of it is acknowledged only.
    dropped: Vec<bool>,
    slots: Vec<Option<Slot>>,
    /// Fingerprints of this step's gradients (kept while applying) and of the previous step's.
    current_fp: Vec<Option<u64>>,
    previous_fp: Vec<Option<u64>>,
    applying: bool,
    /// Since when the current step waits.
    waiting_since: Instant,
    /// When (after `waiting_since`) the current step's missing ranks were last logged.
    warned: Option<Duration>,
    /// Pushes of the current step under way per rank (header in, not yet counted or failed).
    queued: Vec<u32>,
    /// The sample count each rank's latest push header of the current step announced.
    announced: Vec<u32>,
    /// The ranks of the current step and their sample counts, fixed once each had a push
    /// under way or counted (the aggregation coefficients follow from them).
    frozen: Option<(Vec<bool>, Vec<u32>)>,
    /// The barrier timeout runs from here: the step's start, or the last moment no rank was
    /// missing (every one counted or on its way).
    clock: Instant,
}

impl Barrier {
    /// A barrier of `world` ranks gathering `step` of a run of `total_steps`.
    pub fn new(world: usize, step: u64, total_steps: u64, rules: Rules, now: Instant) -> Self {
        Self {
            world,
            step,
            total_steps,
            rules,
            registered: vec![false; world],
            absent: vec![false; world],
            dropped: vec![false; world],
            slots: (0..world).map(|_| None).collect(),
            current_fp: vec![None; world],
            previous_fp: vec![None; world],
            applying: false,
            waiting_since: now,
            warned: None,
            queued: vec![0; world],
            announced: vec![0; world],
            frozen: None,
            clock: now,
        }
    }

    /// The ranks the current step aggregates: fixed once frozen, else those not absent.
    pub fn members(&self) -> Vec<bool> {
        match &self.frozen {
            Some((m, _)) => m.clone(),
            None => self.absent.iter().map(|a| !a).collect(),
        }
    }

    /// The members and their sample counts, once fixed.
    pub fn frozen(&self) -> Option<&(Vec<bool>, Vec<u32>)> {
        self.frozen.as_ref()
    }

    /// A push of `rank` for `step` passed [`Barrier::check`] and its data is coming: the rank
    /// is not missing while it is under way. False (nothing recorded) for another step.
    pub fn announce(&mut self, rank: usize, step: u64, samples: u32) -> bool {
        if step != self.step || self.applying {
            return false;
        }
        self.queued[rank] += 1;
        self.announced[rank] = samples;
        true
    }

    /// An announced push of `step` ended (counted, refused or broken).
    pub fn withdraw(&mut self, rank: usize, step: u64) {
        if step == self.step && self.queued[rank] > 0 {
            self.queued[rank] -= 1;
        }
    }

    /// The lowest member whose gradient the step still needs (None while applying).
    pub fn awaited(&self) -> Option<u32> {
        if self.applying || self.step >= self.total_steps {
            return None;
        }
        let members = self.members();
        (0..self.world)
            .find(|&r| members[r] && self.current_fp[r].is_none())
            .map(|r| r as u32)
    }

    /// True when a push of `rank` for `step` would be kept (a gradient the step still needs),
    /// false when it can only be a retry, a conflict, late or refused: those are checked as
    /// they stream in, without a buffer.
    pub fn needs_buffer(&self, rank: usize, step: u64) -> bool {
        step == self.step
            && !self.applying
            && self.current_fp[rank].is_none()
            && self.frozen.as_ref().is_none_or(|(m, _)| m[rank])
    }

    /// Fixes the members of the step and their sample counts once every member has a push
    /// counted or under way; the fixed ones, or None while some member has neither.
    pub fn freeze_if_ready(&mut self) -> Option<&(Vec<bool>, Vec<u32>)> {
        if self.frozen.is_none() && !self.applying {
            let members = self.members();
            let ready = (0..self.world)
                .all(|r| !members[r] || self.current_fp[r].is_some() || self.queued[r] > 0);
            if !ready {
                return None;
            }
            let samples = (0..self.world)
                .map(|r| match &self.slots[r] {
                    Some(s) if self.current_fp[r].is_some() => s.samples,
                    _ => self.announced[r],
                })
                .collect();
            self.frozen = Some((members, samples));
        }
        self.frozen.as_ref()
    }

    /// Takes `rank`'s counted gradient out to fold it (its slot keeps the rest), None when the
    /// rank is not in yet or its gradient was taken already.
    pub fn take_for_fold(&mut self, rank: usize) -> Option<Grad> {
        if self.applying {
            return None;
        }
        let slot = self.slots[rank].as_mut()?;
        // a gradient received for per-bucket apply is read by the update where it is
        let kept = matches!(slot.grad, Grad::Folded | Grad::Checked | Grad::Received(_));
        if self.current_fp[rank].is_none() || kept {
            return None;
        }
        Some(std::mem::replace(&mut slot.grad, Grad::Folded))
    }

    /// The step being gathered (the shard's version).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// True while the slots handed out by a complete step are being applied.
    pub fn applying(&self) -> bool {
        self.applying
    }

    /// Since when the current step waits.
    pub fn waiting_since(&self) -> Instant {
        self.waiting_since
    }

    /// True when `rank` (a known rank) has registered.
    pub fn registered(&self, rank: u32) -> bool {
        self.registered.get(rank as usize).copied().unwrap_or(false)
    }

    /// `rank` as an index, or [`PsError::UnknownRank`].
    pub fn rank(&self, rank: u32) -> PsResult<usize> {
        if (rank as usize) < self.world {
            Ok(rank as usize)
        } else {
            Err(PsError::UnknownRank {
                rank,
                world: self.world as u32,
            })
        }
    }

    /// Records `rank`'s registration at `now` (it takes part again if it was dropped); returns
    /// the step it joins at: the current one, or the next while an update runs.
    ///
    /// The first registration a barrier sees restarts the step's clocks: the time a shard spent
    /// up before any worker came (a scheduler starting shards first, workers loading their data
    /// or a container image) is not a rank lagging behind the others. Until then the barrier
    /// waits for the first with its own bound ([`Rules::first_worker`], [`Verdict::Unjoined`]),
    /// so a run nobody joins fails after it ([`Verdict::NoWorker`]).
    pub fn register(&mut self, rank: u32, now: Instant) -> PsResult<u64> {
        let r = self.rank(rank)?;
        if !self.registered.contains(&true) {
            self.clock = now;
            self.waiting_since = now;
            self.warned = None;
        }
        self.registered[r] = true;
        self.absent[r] = false;
        Ok(self.step + u64::from(self.applying))
    }

    /// True when the step being gathered is `step` and it counts a gradient of `rank` already.
    pub fn counts(&self, rank: u32, step: u64) -> bool {
        step == self.step
            && !self.applying
            && self
                .current_fp
                .get(rank as usize)
                .is_some_and(Option::is_some)
    }

    /// Checks that `rank` may push `step` now: a known, registered rank, the step being
    /// gathered or, as a retry, the one before, and a step of the run (`0..total_steps`).
    pub fn check(&self, rank: u32, step: u64) -> PsResult<usize> {
        let r = self.rank(rank)?;
        if !self.registered[r] {
            return Err(PsError::NotRegistered(rank));
        }
        if step > self.step {
            Err(PsError::FutureStep {
                step,
                expected: self.step,
            })
        } else if step + 1 < self.step {
            Err(PsError::StaleStep {
                step,
                expected: self.step,
            })
        } else if step >= self.total_steps {
            // the version is at most total_steps: this is a push of step total_steps once
            // the run is over, which would make a version past the end
            Err(PsError::StepOutOfRange {
                step,
                total_steps: self.total_steps,
            })
        } else {
            Ok(r)
        }
    }

    fn ranks_in(&self) -> u32 {
        self.current_fp.iter().filter(|f| f.is_some()).count() as u32
    }

    /// Takes `slot`, a complete, validated gradient of `slot.rank` for `step` (checked as in
    /// [`Barrier::check`]): counts it, or recognises a retry or a late push; a different
    /// gradient for a step the rank already pushed is [`PsError::Conflict`].
    pub fn accept(&mut self, step: u64, slot: Slot) -> PsResult<Accepted> {
        let r = self.check(slot.rank, step)?;
        if step + 1 == self.step {
            if self.dropped[r] {
                // the step went on without this rank (barrier timeout, policy "continue")
                self.absent[r] = false;
                return Ok(Accepted::Late {
                    ranks_in: self.ranks_in(),
                });
            }
            // a retry of the step just applied: acknowledged only if it is the same gradient
            return if self.previous_fp[r] == Some(slot.fingerprint) {
                Ok(Accepted::Retry {
                    ranks_in: self.world as u32,
                })
            } else {
                Err(PsError::StaleStep {
                    step,
                    expected: self.step,
                })
            };
        }
        if let Some((members, samples)) = &self.frozen
            && self.current_fp[r].is_none()
        {
            if !members[r] {
                // the step's ranks were fixed without this one (it was dropped, and came back
                // once the step's aggregation had started): it takes part from the next step
                self.absent[r] = false;
                return Ok(Accepted::Late {
                    ranks_in: self.ranks_in(),
                });
            }
            if samples[r] != slot.samples {
                return Err(PsError::BadChunk(format!(
                    "rank {} pushes step {step} computed on {} samples, but its push of this step already under way said {}: expected the same header for one step",
                    slot.rank, slot.samples, samples[r]
                )));
            }
        }
        match self.current_fp[r] {
            Some(fp) if fp == slot.fingerprint => {
                return Ok(Accepted::Retry {
                    ranks_in: self.ranks_in(),
                });
            }
            Some(_) => {
                return Err(PsError::Conflict {
                    rank: slot.rank,
                    step,
                });
            }
            None => {}
        }
        if matches!(slot.grad, Grad::Checked | Grad::Folded) {
            // checked without a buffer because the rank was in, but the barrier moved on
            return Err(PsError::Unavailable(format!(
                "rank {} step {step}: the shard's state changed while the push was received; push again",
                slot.rank
            )));
        }
        self.current_fp[r] = Some(slot.fingerprint);
        self.slots[r] = Some(slot);
        self.absent[r] = false;
        let ranks_in = self.ranks_in();
        let members = self.members();
        let complete = (0..self.world).all(|q| !members[q] || self.current_fp[q].is_some());
        if complete && !self.applying {
            Ok(Accepted::Complete {
                ranks_in,
                slots: self.hand_out(),
            })
        } else {
            Ok(Accepted::Counted { ranks_in })
        }
    }

    /// Starts applying: the slots in rank order; the ranks absent now are those the step goes
    /// on without.
    fn hand_out(&mut self) -> Vec<Slot> {
        if self.frozen.is_none() {
            let samples = self
                .slots
                .iter()
                .map(|s| s.as_ref().map_or(0, |s| s.samples))
                .collect();
            self.frozen = Some((self.members(), samples));
        }
        self.applying = true;
        self.dropped = self.absent.clone();
        self.slots.iter_mut().filter_map(Option::take).collect()
    }

    /// The step handed out was applied: gather the next one from `now`.
    pub fn finish(&mut self, now: Instant) {
        self.step += 1;
        self.previous_fp = std::mem::replace(&mut self.current_fp, vec![None; self.world]);
        self.applying = false;
        self.waiting_since = now;
        self.clock = now;
        self.warned = None;
        self.queued = vec![0; self.world];
        self.frozen = None;
    }

    /// The policy's verdict on the step being gathered at `now`. A "continue" verdict hands the
    /// slots out (as a complete step does): apply them and call [`Barrier::finish`].
    pub fn poll(&mut self, now: Instant) -> Verdict {
        if self.applying || self.step >= self.total_steps {
            return Verdict::Idle;
        }
        let waited = now.saturating_duration_since(self.waiting_since);
        if !self.registered.contains(&true) {
            return self.unjoined(waited);
        }
        let step = self.step;
        let members = self.members();
        let missing: Vec<usize> = (0..self.world)
            .filter(|&r| members[r] && self.current_fp[r].is_none() && self.queued[r] == 0)
            .collect();
        let awaited = self.awaited().map(|r| r as usize);
        let queued: Vec<usize> = (0..self.world)
            .filter(|&r| self.current_fp[r].is_none() && self.queued[r] > 0 && Some(r) != awaited)
            .collect();
        if missing.is_empty() {
            // every rank is in or on its way: the shard itself is the one working
            self.clock = now;
        }
        let continuing = self.rules.policy == BarrierPolicy::Continue;
        let anyone_in = self.slots.iter().any(Option::is_some);
        // Under "continue", a step nobody pushed yet gets a second timeout before the run
        // fails: its ranks may be held up by another shard whose barrier is still waiting out
        // its own timeout for a rank that stopped (the shards time out independently).
        let limit = if continuing && !anyone_in {
            self.rules.timeout.saturating_mul(2)
        } else {
            self.rules.timeout
        };
        if now.saturating_duration_since(self.clock) >= limit {
            if continuing && anyone_in {
                let left_out: Vec<usize> = (0..self.world)
                    .filter(|&r| self.current_fp[r].is_none())
                    .collect();
                for &r in &left_out {
                    self.absent[r] = true;
                }
                return Verdict::Continue {
                    step,
                    slots: self.hand_out(),
                    left_out,
                    waited,
                };
            }
            return Verdict::Fail {
                step,
                missing,
                waited,
            };
        }
        let warn = self.warn_due(waited);
        Verdict::Waiting {
            step,
            missing,
            awaited,
            queued,
            waited,
            warn,
        }
    }
}

impl Barrier {
    /// The verdict while no rank has registered, `waited` after the barrier's creation.
    fn unjoined(&mut self, waited: Duration) -> Verdict {
        let step = self.step;
        if waited >= self.rules.first_worker {
            return Verdict::NoWorker { step, waited };
        }
        Verdict::Unjoined {
            step,
            waited,
            bound: self.rules.first_worker,
            warn: self.warn_due(waited),
        }
    }

    /// True (and noted) when it is time to log the wait again, every [`Rules::warn`].
    fn warn_due(&mut self, waited: Duration) -> bool {
        let warn = match self.warned {
            Some(at) => waited >= at + self.rules.warn,
            None => waited >= self.rules.warn,
        };
        if warn {
            self.warned = Some(waited);
        }
        warn
    }
}

#[cfg(test)]
mod tests;
