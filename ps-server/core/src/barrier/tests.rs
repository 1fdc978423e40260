//! The barrier's unit tests: counting, retries, refusals, the clocks and the policies.

use super::*;

fn rules(policy: BarrierPolicy) -> Rules {
    Rules {
        warn: Duration::from_secs(5),
        timeout: Duration::from_secs(30),
        first_worker: Duration::from_secs(90),
        policy,
    }
}

fn slot(rank: u32, fingerprint: u64, at: Instant) -> Slot {
    Slot {
        rank,
        grad: Grad::Owned(super::super::intake::Held {
            values: vec![rank as f32],
            permit: None,
        }),
        fingerprint,
        samples: 1,
        loss_sum: 0.0,
        correct: 0,
        eval: (0, 0),
        arrived: at,
    }
}

fn barrier(world: usize, policy: BarrierPolicy) -> (Barrier, Instant) {
    let t = Instant::now();
    let mut b = Barrier::new(world, 0, 10, rules(policy), t);
    for r in 0..world as u32 {
        assert_eq!(b.register(r, t).unwrap(), 0);
    }
    (b, t)
}

fn ranks(slots: &[Slot]) -> Vec<u32> {
    slots.iter().map(|s| s.rank).collect()
}

#[test]
fn a_rank_joining_a_step_that_counts_its_gradient_is_told_so() {
    let (mut b, t) = barrier(2, BarrierPolicy::Fail);
    b.accept(0, slot(1, 10, t)).unwrap();
    // rank 1's worker died after its push; its successor registers
    assert_eq!(b.register(1, t).unwrap(), 0);
    assert!(b.counts(1, 0), "rank 1's gradient of step 0 is in");
    assert!(!b.counts(0, 0), "rank 0 has not pushed");
    b.accept(0, slot(0, 0, t)).unwrap();
    assert!(b.applying());
    // while step 0 is applied a rank joins at step 1, which counts nothing yet
    assert_eq!(b.register(1, t).unwrap(), 1);
    assert!(!b.counts(1, 1) && !b.counts(1, 0));
    b.finish(t);
    assert!(!b.counts(1, 1) && !b.counts(0, 1));
}

#[test]
fn counts_then_completes_in_rank_order_then_recognises_retries() {
    let (mut b, t) = barrier(3, BarrierPolicy::Fail);
    let a = b.accept(0, slot(2, 20, t)).unwrap();
    assert!(matches!(a, Accepted::Counted { ranks_in: 1 }), "{a:?}");
    let a = b.accept(0, slot(2, 20, t)).unwrap();
    assert!(
        matches!(a, Accepted::Retry { ranks_in: 1 }) && !a.counted(),
        "{a:?}"
    );
    b.accept(0, slot(0, 0, t)).unwrap();
    let a = b.accept(0, slot(1, 10, t)).unwrap();
    assert!(a.counted() && a.ranks_in() == 3);
    let Accepted::Complete { slots, .. } = a else {
        panic!("{a:?}")
    };
    assert_eq!(ranks(&slots), [0, 1, 2]);
    assert!(b.applying());
    assert!(matches!(b.poll(t + Duration::from_secs(99)), Verdict::Idle));
    // a retry while the step is applied, then after it
    assert!(matches!(
        b.accept(0, slot(1, 10, t)).unwrap(),
        Accepted::Retry { ranks_in: 3 }
    ));
    assert_eq!(
        b.register(0, t).unwrap(),
        1,
        "joins at the step after the one applied"
    );
    b.finish(t);
    assert_eq!(b.step(), 1);
    assert!(matches!(
        b.accept(0, slot(1, 10, t)).unwrap(),
        Accepted::Retry { ranks_in: 3 }
    ));
    // a different gradient for the step just applied is stale
    let e = b.accept(0, slot(1, 11, t)).unwrap_err();
    assert!(
        matches!(
            e,
            PsError::StaleStep {
                step: 0,
                expected: 1
            }
        ),
        "{e}"
    );
}

#[test]
fn refuses_conflicts_unknown_unregistered_and_steps_outside_the_window_or_the_run() {
    let t = Instant::now();
    let mut b = Barrier::new(2, 9, 10, rules(BarrierPolicy::Fail), t);
    assert!(matches!(b.check(0, 9), Err(PsError::NotRegistered(0))));
    assert!(matches!(
        b.register(2, t),
        Err(PsError::UnknownRank { rank: 2, world: 2 })
    ));
    b.register(0, t).unwrap();
    b.register(1, t).unwrap();
    b.accept(9, slot(0, 1, t)).unwrap();
    let e = b.accept(9, slot(0, 2, t)).unwrap_err();
    assert!(matches!(e, PsError::Conflict { rank: 0, step: 9 }), "{e}");
    assert_eq!(b.check(1, 8).unwrap(), 1, "the step before, as a retry");
    assert!(matches!(
        b.check(1, 7),
        Err(PsError::StaleStep {
            step: 7,
            expected: 9
        })
    ));
    let Accepted::Complete { .. } = b.accept(9, slot(1, 3, t)).unwrap() else {
        panic!()
    };
    b.finish(t);
    assert_eq!(b.step(), 10);
    // the run has 10 steps: step 10 never is one, whatever the version
    let e = b.accept(10, slot(1, 3, t)).unwrap_err();
    assert!(
        matches!(
            e,
            PsError::StepOutOfRange {
                step: 10,
                total_steps: 10
            }
        ),
        "{e}"
    );
    assert!(matches!(
        b.check(0, 10),
        Err(PsError::StepOutOfRange { .. })
    ));
    assert!(matches!(
        b.check(0, u64::MAX),
        Err(PsError::FutureStep { .. })
    ));
    assert_eq!(b.step(), 10, "nothing changed");
    // the last step's retry is still acknowledged
    assert!(matches!(
        b.accept(9, slot(1, 3, t)).unwrap(),
        Accepted::Retry { .. }
    ));
    assert!(matches!(b.poll(t), Verdict::Idle), "the run is over");
}

#[test]
fn the_first_step_is_timed_from_the_first_registration_not_the_shards_start() {
    let t = Instant::now();
    let at = |s: u64| t + Duration::from_secs(s);
    // nobody registers: the barrier waits for the first within its own bound (90 s here),
    // saying so every barrier_warn_secs (5 s), then the run fails
    for policy in [BarrierPolicy::Fail, BarrierPolicy::Continue] {
        let mut b = Barrier::new(2, 0, 10, rules(policy), t);
        let v = b.poll(at(30));
        assert!(
            matches!(v, Verdict::Unjoined { step: 0, warn: true, bound, .. } if bound == Duration::from_secs(90)),
            "past barrier_timeout_secs, not past the first worker's bound: {v:?}"
        );
        assert!(matches!(
            b.poll(at(31)),
            Verdict::Unjoined { warn: false, .. }
        ));
        assert!(matches!(
            b.poll(at(35)),
            Verdict::Unjoined { warn: true, .. }
        ));
        assert!(matches!(b.poll(at(89)), Verdict::Unjoined { .. }));
        let v = b.poll(at(90));
        assert!(
            matches!(v, Verdict::NoWorker { step: 0, waited } if waited == Duration::from_secs(90)),
            "{v:?}"
        );
    }
    // workers that came 70 s after the shard started get the whole timeout from then
    let mut b = Barrier::new(2, 0, 10, rules(BarrierPolicy::Fail), t);
    assert!(matches!(b.poll(at(60)), Verdict::Unjoined { .. }));
    b.register(0, at(70)).unwrap();
    b.register(1, at(71)).unwrap();
    let v = b.poll(at(80));
    assert!(
        matches!(&v, Verdict::Waiting { step: 0, missing, .. } if missing == &[0, 1]),
        "{v:?}"
    );
    assert!(matches!(b.poll(at(99)), Verdict::Waiting { .. }));
    let v = b.poll(at(100));
    assert!(
        matches!(&v, Verdict::Fail { step: 0, missing, .. } if missing == &[0, 1]),
        "a later registration does not restart it: {v:?}"
    );
}

#[test]
fn warns_then_fails_after_the_timeout() {
    let (mut b, t) = barrier(3, BarrierPolicy::Fail);
    b.accept(0, slot(1, 1, t)).unwrap();
    let at = |s: u64| t + Duration::from_secs(s);
    let v = b.poll(at(1));
    assert!(
        matches!(&v, Verdict::Waiting { step: 0, missing, warn: false, .. } if missing == &[0, 2]),
        "{v:?}"
    );
    assert!(matches!(b.poll(at(6)), Verdict::Waiting { warn: true, .. }));
    assert!(
        matches!(b.poll(at(7)), Verdict::Waiting { warn: false, .. }),
        "once per interval"
    );
    assert!(matches!(
        b.poll(at(11)),
        Verdict::Waiting { warn: true, .. }
    ));
    let v = b.poll(at(30));
    assert!(
        matches!(&v, Verdict::Fail { step: 0, missing, .. } if missing == &[0, 2]),
        "{v:?}"
    );
    assert_eq!(b.step(), 0);
}

#[test]
fn continue_policy_drops_the_missing_ranks_until_they_come_back() {
    let (mut b, t) = barrier(3, BarrierPolicy::Continue);
    let at = |s: u64| t + Duration::from_secs(s);
    // nobody pushed: nothing to go on with; the run fails after a second timeout (the
    // ranks may be held up by another shard's barrier)
    assert!(matches!(b.poll(at(31)), Verdict::Waiting { step: 0, .. }));
    assert!(matches!(b.poll(at(61)), Verdict::Fail { .. }));
    b.accept(0, slot(1, 1, t)).unwrap();
    let v = b.poll(at(31));
    let Verdict::Continue {
        step: 0,
        slots,
        left_out,
        ..
    } = v
    else {
        panic!("{v:?}")
    };
    assert_eq!((ranks(&slots), left_out), (vec![1], vec![0, 2]));
    b.finish(at(31));
    // step 1 waits for rank 1 only: it completes the step alone
    let v = b.poll(at(32));
    assert!(
        matches!(&v, Verdict::Waiting { step: 1, missing, .. } if missing == &[1]),
        "{v:?}"
    );
    // rank 0's late push of step 0 is acknowledged, not counted, and brings it back
    let a = b.accept(0, slot(0, 7, t)).unwrap();
    assert!(
        matches!(a, Accepted::Late { ranks_in: 0 }) && !a.counted(),
        "{a:?}"
    );
    let v = b.poll(at(32));
    assert!(
        matches!(&v, Verdict::Waiting { missing, .. } if missing == &[0, 1]),
        "{v:?}"
    );
    // rank 2 comes back by registering
    b.register(2, t).unwrap();
    b.accept(1, slot(0, 8, t)).unwrap();
    assert!(matches!(
        b.accept(1, slot(1, 9, t)).unwrap(),
        Accepted::Counted { ranks_in: 2 }
    ));
    let Accepted::Complete { slots, .. } = b.accept(1, slot(2, 9, t)).unwrap() else {
        panic!()
    };
    assert_eq!(ranks(&slots), [0, 1, 2]);
}
