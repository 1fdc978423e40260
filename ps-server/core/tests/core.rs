//! The shard core in-process, as mini-redis tests its server: no processes, no sockets. A
//! push here is what `ps-server`'s handler does with a received gradient ([`push`]): the
//! precheck, the fingerprint and finiteness check, [`Shard::accept`], then
//! [`Shard::complete`] when the barrier is complete, or a fold when the push counted.

use ps_config::{Aggregation, BarrierPolicy, Config, TestConfig, Transport};
use ps_proto::PsError;
use ps_shard::barrier::Verdict;
use ps_shard::checkpoint::{self, Attempted, Identity};
use ps_shard::intake::{Announced, Held};
use ps_shard::{Grad, PushMeta, PushOutcome, Shard, StepFigures, StepObserver};
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the process would log and count: every step's figures and checkpoint.
#[derive(Default)]
struct Recorder {
    steps: Mutex<Vec<StepFigures>>,
    checkpoints: Mutex<Vec<(u64, bool, Option<String>)>>,
    /// The version the shard is at when told of a step (the figures come after the commit).
    version_seen: Mutex<Vec<u64>>,
    shard: Mutex<Option<Arc<Shard>>>,
}

impl StepObserver for Recorder {
    fn step_done(&self, figures: StepFigures) {
        if let Some(s) = self.shard.lock().unwrap().as_ref() {
            self.version_seen.lock().unwrap().push(s.version());
        }
        self.steps.lock().unwrap().push(figures);
    }

    fn checkpointed(&self, attempted: &Attempted) {
        let version = self.steps.lock().unwrap().last().map_or(0, |f| f.step + 1);
        self.checkpoints.lock().unwrap().push((
            version,
            attempted.written,
            attempted.fatal.clone(),
        ));
    }
}

/// A run of the built-in MLP (784 -> 4 -> 10: 3,190 parameters) on one shard, over gRPC (no
/// shared-memory boards), with `w` workers, summed gradients, SGD with momentum 0.9, lr 0.1.
fn config(dir: &Path, w: usize, more: impl FnOnce(TestConfig) -> TestConfig) -> Config {
    let t = TestConfig::new()
        .shards(1)
        .workers(w)
        .hidden(&[4])
        .transport(Transport::Grpc)
        .aggregation(Aggregation::Sum)
        .sgd(0.1, 0.9);
    more(t).build(&dir.join("config.toml")).unwrap()
}

/// Rank `rank`'s gradient of `step`: `n` values in about [-7, 7), different for every rank and
/// step.
fn grad(n: usize, rank: u32, step: u64) -> Vec<f32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (u64::from(rank) << 32) ^ (step << 8) ^ 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // full mantissas of varied exponents: sums in another order round differently
            ((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * (1 + (x & 0xff)) as f32 / 37.0
        })
        .collect()
}

/// What the gRPC handler does with a received push of `values` (ps-server's push.rs).
fn push(
    shard: &Shard,
    obs: &Recorder,
    rank: u32,
    step: u64,
    values: &[f32],
) -> Result<PushOutcome, PsError> {
    shard.precheck(rank, step, values.len() as u64)?;
    let fingerprint = ps_net::wire::check_and_fingerprint(values)?;
    let meta = PushMeta {
        rank,
        step,
        samples: 8,
        loss_sum: 1.0 + f64::from(rank),
        correct: u64::from(rank),
        eval: (0, 0),
    };
    let held = Held {
        values: values.to_vec(),
        permit: None,
    };
    let (outcome, ready) = shard.accept(meta, Grad::Owned(held), fingerprint)?;
    match ready {
        Some(slots) => shard.complete(slots, obs)?,
        None if outcome.counted => shard.fold_ready()?,
        None => {}
    }
    Ok(outcome)
}

fn started(cfg: &Config, total_steps: u64) -> (Arc<Shard>, Recorder) {
    let shard = Shard::new(cfg, 0, total_steps);
    for r in 0..cfg.cluster.workers as u32 {
        assert_eq!(shard.register(r).unwrap(), (0, false));
    }
    let obs = Recorder::default();
    *obs.shard.lock().unwrap() = Some(shard.clone());
    (shard, obs)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn params(shard: &Shard) -> (u64, Vec<f32>) {
    shard.params().unwrap()
}

/// `v` summed in rank order, in f32, as the shard sums them.
fn sum(vs: &[Vec<f32>]) -> Vec<f32> {
    let mut s = vs[0].clone();
    for v in &vs[1..] {
        s.iter_mut().zip(v).for_each(|(a, b)| *a += b);
    }
    s
}

/// The shard-local range of tensor `t` (the shard holds the whole model here).
fn tensor(shard: &Shard, t: usize) -> Range<usize> {
    let spec = &shard.spec.tensors[t];
    spec.offset..spec.offset + spec.shape.iter().product::<usize>()
}

/// A step gathered from W = 3 pushes arriving in any order ends bit-identical to one push of
/// their sum on a shard of one worker, step after step (momentum carries the order's effect
/// into later steps if there is one), whether the shard folds them as they arrive or sums them
/// in the update, and the figures handed to the observer add the ranks up.
#[test]
fn w_pushes_in_any_order_equal_one_push_of_their_sum_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (three, obs3) = started(&config(dir.path(), 3, |t| t), 5);
    let (one, obs1) = started(&config(dir.path(), 1, |t| t), 5);
    let n = three.len();
    assert_eq!(n, 3190);
    let init = params(&three).1;
    assert_eq!(bits(&init), bits(&params(&one).1));
    // steps 0 to 2 announce every push before any arrives (as headers do when the pushes
    // stream in together), so the shard folds the gradients in rank order as they arrive;
    // steps 3 and 4 do not, so the update sums them all at once
    let orders = [[2u32, 0, 1], [1, 2, 0], [0, 1, 2], [2, 1, 0], [1, 0, 2]];
    for (step, order) in orders.into_iter().enumerate() {
        let step = step as u64;
        let gs: Vec<Vec<f32>> = (0..3).map(|r| grad(n, r, step)).collect();
        let mut under_way: Vec<Option<Announced>> = (0..3)
            .map(|r| (step < 3).then(|| three.announce(r, step, 8)))
            .collect();
        three.fold_ready().unwrap();
        for (i, &r) in order.iter().enumerate() {
            // the handler's guard ends when its data is in, before the push is counted
            drop(under_way[r as usize].take());
            let out = push(&three, &obs3, r, step, &gs[r as usize]).unwrap();
            assert_eq!(
                out,
                PushOutcome {
                    counted: true,
                    ranks_in: i as u32 + 1
                }
            );
            let expected = if i < 2 { step } else { step + 1 };
            assert_eq!(three.version(), expected, "step {step} after rank {r}");
        }
        push(&one, &obs1, 0, step, &sum(&gs)).unwrap();
        let (v3, p3) = params(&three);
        let (v1, p1) = params(&one);
        assert_eq!((v3, v1), (step + 1, step + 1));
        let differ = p3
            .iter()
            .zip(&p1)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "step {step} (order {order:?}): {differ} of {n} values differ"
        );
    }
    let moved = params(&three)
        .1
        .iter()
        .zip(&init)
        .filter(|(a, b)| a != b)
        .count();
    assert!(moved > 3000, "only {moved} values moved");
    let f3 = obs3.steps.lock().unwrap();
    let f1 = obs1.steps.lock().unwrap();
    assert_eq!(f3.len(), 5);
    assert_eq!(*obs3.version_seen.lock().unwrap(), vec![1, 2, 3, 4, 5]);
    for (a, b) in f3.iter().zip(f1.iter()) {
        assert_eq!(
            (a.workers_in, a.samples, a.loss_sum, a.correct),
            (3, 24, 6.0, 3)
        );
        assert_eq!(a.lr, b.lr);
        assert_eq!(a.grad_sq_norm.to_bits(), b.grad_sq_norm.to_bits());
        assert_eq!(
            a.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
    }
    // no checkpoint is configured: the observer heard of none
    assert!(obs3.checkpoints.lock().unwrap().is_empty());
}

/// Pushes refused with the typed error that names why: unregistered, unknown rank, wrong
/// length, a future step, a non-finite value, a conflicting second gradient, a stale step, a
/// step past the run's last. Each leaves the shard as it was: the run fed only the valid
/// pushes ends bit-identical to one fed both.
#[test]
fn refused_pushes_name_why_and_leave_the_shard_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2, |t| t);
    let shard = Shard::new(&cfg, 0, 2);
    let obs = Recorder::default();
    let n = shard.len();
    let g = |r, s| grad(n, r, s);
    let init = params(&shard);

    let e = push(&shard, &obs, 1, 0, &g(1, 0)).unwrap_err();
    assert!(matches!(e, PsError::NotRegistered(1)), "{e}");
    shard.register(0).unwrap();
    shard.register(1).unwrap();
    let e = push(&shard, &obs, 5, 0, &g(0, 0)).unwrap_err();
    assert!(
        matches!(e, PsError::UnknownRank { rank: 5, world: 2 }),
        "{e}"
    );
    let e = push(&shard, &obs, 0, 0, &g(0, 0)[1..]).unwrap_err();
    assert!(
        matches!(
            e,
            PsError::WrongLength {
                expected: 3190,
                got: 3189
            }
        ),
        "{e}"
    );
    let e = push(&shard, &obs, 0, 1, &g(0, 1)).unwrap_err();
    assert!(
        matches!(
            e,
            PsError::FutureStep {
                step: 1,
                expected: 0
            }
        ),
        "{e}"
    );
    let mut bad = g(0, 0);
    bad[17] = f32::NAN;
    let e = push(&shard, &obs, 0, 0, &bad).unwrap_err();
    assert!(matches!(e, PsError::NonFinite { index: 17, .. }), "{e}");
    assert_eq!(params(&shard).0, 0);
    assert_eq!(bits(&params(&shard).1), bits(&init.1));

    assert!(push(&shard, &obs, 0, 0, &g(0, 0)).unwrap().counted);
    let e = push(&shard, &obs, 0, 0, &g(0, 7)).unwrap_err();
    assert!(matches!(e, PsError::Conflict { rank: 0, step: 0 }), "{e}");
    // a retry of the same gradient is acknowledged, not counted twice
    let again = push(&shard, &obs, 0, 0, &g(0, 0)).unwrap();
    assert_eq!(
        again,
        PushOutcome {
            counted: false,
            ranks_in: 1
        }
    );
    assert_eq!(params(&shard).0, 0);
    push(&shard, &obs, 1, 0, &g(1, 0)).unwrap();
    assert_eq!(params(&shard).0, 1);
    // step 0 again with another gradient, once the shard is at step 1
    let e = push(&shard, &obs, 1, 0, &g(1, 9)).unwrap_err();
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
    push(&shard, &obs, 0, 1, &g(0, 1)).unwrap();
    push(&shard, &obs, 1, 1, &g(1, 1)).unwrap();
    assert_eq!(params(&shard).0, 2);
    let e = push(&shard, &obs, 0, 2, &g(0, 2)).unwrap_err();
    assert!(
        matches!(
            e,
            PsError::StepOutOfRange {
                step: 2,
                total_steps: 2
            }
        ),
        "{e}"
    );

    let (clean, clean_obs) = started(&cfg, 2);
    for s in 0..2 {
        for r in 0..2 {
            push(&clean, &clean_obs, r, s, &g(r, s)).unwrap();
        }
    }
    let (v, p) = params(&shard);
    let (cv, cp) = params(&clean);
    assert_eq!((v, cv), (2, 2));
    assert_eq!(bits(&p), bits(&cp));
    assert_eq!(obs.steps.lock().unwrap().len(), 2);
}

/// A tensor every rank's backward of a step left out gets no update that step, not even the
/// momentum of earlier steps (torch skips a parameter whose grad is None); one only some
/// ranks left out is updated, as is every other tensor.
#[test]
fn a_tensor_no_rank_reached_gets_no_update_not_even_momentum() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 2, |t| t);
    // (tensor 0 marked unused by: both ranks, rank 1 only, none)
    let mut after = Vec::new();
    for marks in [vec![0u32, 1], vec![1], vec![]] {
        let (shard, obs) = started(&cfg, 2);
        let n = shard.len();
        let w0 = tensor(&shard, 0);
        for r in 0..2 {
            push(&shard, &obs, r, 0, &grad(n, r, 0)).unwrap();
        }
        let v1 = params(&shard).1;
        for r in 0..2u32 {
            let mut g = grad(n, r, 1);
            if marks.contains(&r) {
                shard.mark_unused(r, 1, vec![0]).unwrap();
                g[w0.clone()].fill(0.0);
            }
            push(&shard, &obs, r, 1, &g).unwrap();
        }
        let v2 = params(&shard).1;
        assert_eq!(shard.version(), 2);
        let changed = |r: Range<usize>| r.clone().filter(|&i| v1[i] != v2[i]).count();
        after.push((changed(w0.clone()), changed(w0.end..n), w0.len()));
    }
    let (w0_len, rest) = (after[0].2, 3190 - after[0].2);
    assert_eq!(w0_len, 3136);
    assert_eq!(
        after[0].0, 0,
        "no rank reached tensor 0, yet it moved: {after:?}"
    );
    assert!(after[0].1 > rest - 5, "{after:?}");
    // one rank reached it (the other's zeros are summed in) or both: it moves
    assert!(after[1].0 > w0_len - 20, "{after:?}");
    assert!(after[2].0 > w0_len - 20, "{after:?}");
}

/// With `[checkpoint] every = 2` the step's end writes versions 2 and 4 (not 1, 3, 5), the
/// observer hears of each, the file's checksum verifies and it reads back the parameters of
/// its version bit for bit; a shard resumed from it ends the run bit-identical to the one that
/// went on. One flipped value is caught by the checksum.
#[test]
fn a_completed_step_writes_a_checkpoint_at_every_that_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let cfg = config(dir.path(), 2, |t| t.checkpoint(2, 10).checkpoint_dir(&ckpt));
    let (shard, obs) = started(&cfg, 5);
    let n = shard.len();
    let mut at = Vec::new();
    for s in 0..5 {
        for r in 0..2 {
            push(&shard, &obs, r, s, &grad(n, r, s)).unwrap();
        }
        at.push(params(&shard));
    }
    assert_eq!(
        *obs.checkpoints.lock().unwrap(),
        vec![(2, true, None), (4, true, None)]
    );
    assert_eq!(checkpoint::versions(&ckpt, 0, 1), vec![2, 4]);
    let range = Shard::range_of(&cfg, 0);
    let id = Identity::of(&cfg, 0, range.clone());
    let fresh = cfg.optimizer.init_state(range.len());
    let saved = checkpoint::read(&ckpt, &id, 4, &fresh).unwrap();
    assert_eq!(saved.version, 4);
    assert_eq!(at[3].0, 4);
    assert_eq!(bits(&saved.params), bits(&at[3].1));
    checkpoint::check_intact(&ckpt, 0, 1, 2).unwrap();

    // resumed at version 4, the last step gives the same weights as the run that went on
    let resumed = Shard::starting_from(&cfg, 0, 5, Some(saved));
    assert_eq!(resumed.version(), 4);
    for r in 0..2 {
        resumed.register(r).unwrap();
    }
    let quiet = Recorder::default();
    for r in 0..2 {
        push(&resumed, &quiet, r, 4, &grad(n, r, 4)).unwrap();
    }
    assert_eq!(bits(&params(&resumed).1), bits(&at[4].1));

    // one value changed in the newest file: its checksum no longer matches
    let file = checkpoint::file(&ckpt, 0, 1, 4);
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let e = checkpoint::check_intact(&ckpt, 0, 1, 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("checksum"), "{e}");
    assert!(checkpoint::read(&ckpt, &id, 4, &fresh).is_err());
}

/// A barrier whose rank 1 never pushes: waiting (naming rank 1) before the timeout, failing
/// naming rank 1 after it under `barrier_policy = "fail"`; under "continue" it goes on with
/// the ranks that pushed, and the step equals one push of their sum.
#[test]
fn the_barrier_timeout_names_the_missing_rank() {
    let dir = tempfile::tempdir().unwrap();
    let timed = |p| {
        move |t: TestConfig| {
            t.barrier_warn_secs(0.2)
                .barrier_timeout_secs(0.5)
                .barrier_policy(p)
        }
    };
    for policy in [BarrierPolicy::Fail, BarrierPolicy::Continue] {
        let (shard, obs) = started(&config(dir.path(), 3, timed(policy)), 3);
        let n = shard.len();
        let t0 = Instant::now();
        push(&shard, &obs, 0, 0, &grad(n, 0, 0)).unwrap();
        push(&shard, &obs, 2, 0, &grad(n, 2, 0)).unwrap();
        match shard.poll_barrier(t0 + Duration::from_millis(300)) {
            Verdict::Waiting {
                step: 0,
                missing,
                warn: true,
                ..
            } => assert_eq!(missing, vec![1]),
            v => panic!("{policy:?}: expected waiting for rank 1, got {v:?}"),
        }
        let late = t0 + Duration::from_secs(2);
        match (policy, shard.poll_barrier(late)) {
            (
                BarrierPolicy::Fail,
                Verdict::Fail {
                    step: 0, missing, ..
                },
            ) => {
                assert_eq!(missing, vec![1]);
                assert_eq!(shard.version(), 0);
            }
            (
                BarrierPolicy::Continue,
                Verdict::Continue {
                    step: 0,
                    slots,
                    left_out,
                    ..
                },
            ) => {
                assert_eq!(left_out, vec![1]);
                let ranks: Vec<u32> = slots.iter().map(|s| s.rank).collect();
                assert_eq!(ranks, vec![0, 2]);
                shard.complete(slots, &obs).unwrap();
                assert_eq!(shard.version(), 1);
                let (one, one_obs) = started(&config(dir.path(), 1, |t| t), 3);
                let g = sum(&[grad(n, 0, 0), grad(n, 2, 0)]);
                push(&one, &one_obs, 0, 0, &g).unwrap();
                assert_eq!(bits(&params(&shard).1), bits(&params(&one).1));
                assert_eq!(obs.steps.lock().unwrap()[0].workers_in, 2);
            }
            (p, v) => panic!("{p:?}: got {v:?}"),
        }
    }
}
