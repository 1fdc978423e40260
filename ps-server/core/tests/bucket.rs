//! Per-bucket apply in-process ([`ps_shard::bucket`]): pushes received piece by piece through
//! [`Shard::intake`] (as `ps-server`'s receiving code does), their buckets applied as soon as
//! every rank's part is in, end bit for bit where the whole-range update of the same gradients
//! ends: weights AND optimizer state, for every optimizer and aggregation, uneven batches,
//! bf16 values, unused tensors, parameter groups, pieces in several orders, after a recovery,
//! and when a push whose pieces were used breaks and comes again with other values.

mod common;

use common::{Recorder, W, assert_same, meta, push_whole, shard};
use ps_config::{Aggregation, Config, TestConfig, Transport, Wire};
use ps_shard::Shard;
use ps_shard::checkpoint::{self, Identity};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// 784 -> 800 -> 10 (636,010 parameters: fc1.weight spans three buckets) on 2 shards over gRPC,
/// every rank with a buffer; fc1.bias in a parameter group of its own.
fn config(dir: &Path, opt: &dyn Fn(TestConfig) -> TestConfig, agg: Aggregation) -> Config {
    let t = TestConfig::new()
        .shards(2)
        .workers(W as usize)
        .hidden(&[800])
        .transport(Transport::Grpc)
        .aggregation(agg)
        .max_pending_gradients(W as usize);
    let text = format!(
        "{}\n[[optimizer.groups]]\nparams = [\"fc1.bias\"]\nlr_scale = 0.5\nweight_decay = 0.03\n",
        opt(t).toml()
    );
    Config::parse(&text, &dir.join("config.toml")).unwrap()
}

/// Rank `rank`'s gradient of `step` ([`common::grad`]), rounded to bfloat16 when `bf16` (what
/// the wire carries).
fn grad(n: usize, rank: u32, step: u64, salt: u64, bf16: bool) -> Vec<f32> {
    let g = common::grad(n, rank, step, salt);
    if !bf16 {
        return g;
    }
    g.into_iter()
        .map(|v| ps_net::wire::bf16_to_f32(ps_net::wire::f32_to_bf16(v)))
        .collect()
}

/// Writes `values[r]` into `intake`'s region `r` (f32 as read from a data connection, or
/// bf16 bytes decoded as a gRPC chunk is) and publishes it; runs the applier when told to.
fn piece(
    shard: &Shard,
    intake: &mut ps_shard::bucket::Intake,
    values: &[f32],
    r: Range<usize>,
    wire: Wire,
    apply: bool,
) {
    let run = match wire {
        Wire::F32 => {
            let dst = intake.region(r.clone()).unwrap();
            for (d, &v) in dst.iter_mut().zip(&values[r]) {
                d.write(v);
            }
            // SAFETY: every value of the region was written just above.
            unsafe { intake.publish() }
        }
        Wire::Bf16 => {
            let bytes: Vec<u8> = values[r.clone()]
                .iter()
                .flat_map(|&v| ps_net::wire::f32_to_bf16(v).to_le_bytes())
                .collect();
            intake.decode(r.start, Wire::Bf16, &bytes).unwrap()
        }
    };
    if run && apply {
        shard.run_buckets();
    }
}

/// `n` values cut into `k` pieces of uneven lengths.
fn pieces(n: usize, k: usize, seed: u64) -> Vec<Range<usize>> {
    let mut cuts: Vec<usize> = (1..k)
        .map(|i| (i * n / k + (seed as usize * 7919 * i) % (n / (2 * k))).min(n))
        .collect();
    cuts.push(0);
    cuts.push(n);
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2).map(|w| w[0]..w[1]).collect()
}

/// The order pieces of the ranks come in.
#[derive(Clone, Copy, Debug)]
enum Order {
    /// Last piece first, rank by rank in turn (progressive pushes).
    Backward,
    /// First piece first, ranks interleaved.
    Forward,
    /// Rank 2's all first, then the others interleaved from the back.
    Shuffled,
}

fn events(order: Order, n_pieces: usize) -> Vec<(u32, usize)> {
    let mut ev = Vec::new();
    match order {
        Order::Backward => {
            for p in (0..n_pieces).rev() {
                for r in 0..W {
                    ev.push((r, p));
                }
            }
        }
        Order::Forward => {
            for p in 0..n_pieces {
                for r in (0..W).rev() {
                    ev.push((r, p));
                }
            }
        }
        Order::Shuffled => {
            for p in (0..n_pieces).step_by(2).chain((1..n_pieces).step_by(2)) {
                ev.push((2, p));
            }
            for p in (0..n_pieces).rev() {
                ev.push((1, p));
                ev.push((0, (p + 2) % n_pieces));
            }
        }
    }
    ev
}

/// One step pushed piece by piece by every rank in `order`: each rank's push is counted right
/// after its last piece. The applier runs after every piece but the last one (whose buckets
/// are then the completion's).
#[allow(clippy::too_many_arguments)]
fn bucketed_step(
    shard: &Arc<Shard>,
    obs: &Recorder,
    step: u64,
    grads: &[Vec<f32>],
    samples: &[u32],
    order: Order,
    k: usize,
    wire: Wire,
) {
    let n = shard.len();
    let cuts = pieces(n, k, step);
    let mut intakes: Vec<_> = (0..W)
        .map(|r| {
            shard.precheck(r, step, n as u64).unwrap();
            let announced = shard.announce(r, step, samples[r as usize]);
            (announced, shard.intake(r, step).expect("per-bucket apply"))
        })
        .collect();
    let ev = events(order, cuts.len());
    let mut left: Vec<usize> = vec![cuts.len(); W as usize];
    let last = ev.len() - 1;
    for (i, (r, p)) in ev.into_iter().enumerate() {
        let (_, intake) = &mut intakes[r as usize];
        piece(
            shard,
            intake,
            &grads[r as usize],
            cuts[p].clone(),
            wire,
            i < last,
        );
        left[r as usize] -= 1;
        if left[r as usize] == 0 {
            let (g, fp) = intake.finish(None).unwrap();
            let (out, ready) = shard
                .accept(meta(r, step, samples[r as usize]), g, fp)
                .unwrap();
            assert!(out.counted);
            if let Some(slots) = ready {
                shard.complete(slots, obs).unwrap();
            }
        }
    }
}

type Opt = (&'static str, fn(TestConfig) -> TestConfig);

fn optimizers() -> Vec<Opt> {
    vec![
        ("sgd", |t| t.sgd(0.1, 0.0)),
        ("momentum", |t| t.sgd(0.1, 0.9)),
        ("nesterov", |t| t.sgd(0.1, 0.9).nesterov(true)),
        ("sgd weight decay", |t| t.sgd(0.1, 0.9).weight_decay(1e-3)),
        ("adam", |t| t.adam(0.01, 0.0, false)),
        ("adamw", |t| t.adam(0.01, 0.01, true)),
    ]
}

/// The marks of step `s`: fc2.bias (tensor 3) unreached by every rank at step 1 (skipped:
/// Adam counts its own steps after), fc2.weight by rank 0 only at step 2 (updated).
/// A rank's gradient holds zeros where its backward did not reach (as a worker's does).
fn mark(shard: &Shard, s: u64, grads: &mut [Vec<f32>]) {
    for r in 0..W {
        let unreached = match s {
            1 => vec![3],
            2 if r == 0 => vec![2],
            _ => continue,
        };
        for (_, part) in ps_shard::unused::local_parts(&shard.spec, &shard.range, &unreached) {
            grads[r as usize][part].fill(0.0);
        }
        shard.mark_unused(r, s, unreached).unwrap();
    }
}

/// Step `s` on both shards from gradients `g` (zeroed where unreached, [`mark`]): piece by
/// piece in `order` on `bucketed`, whole on `whole`.
#[allow(clippy::too_many_arguments)]
fn step_both(
    (bucketed, ob): (&Arc<Shard>, &Recorder),
    (whole, ow): (&Arc<Shard>, &Recorder),
    s: u64,
    mut g: Vec<Vec<f32>>,
    samples: &[u32],
    order: Order,
    k: usize,
    wire: Wire,
) {
    mark(bucketed, s, &mut g);
    mark(whole, s, &mut g);
    bucketed_step(bucketed, ob, s, &g, samples, order, k, wire);
    for r in 0..W {
        push_whole(whole, ow, r, s, samples[r as usize], &g[r as usize]);
    }
}

const STEPS: u64 = 4;

/// Every optimizer x aggregation, both shards (shard 1's range starts inside fc1.weight),
/// uneven b_r, bf16 values on some steps, pieces in three orders: the bucketed shard ends
/// every step bit-identical (weights and optimizer state) to the whole-range one, and says
/// that it applied buckets before the barrier completed.
#[test]
fn bucketed_equals_whole_range_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let samples = [5u32, 9, 2];
    for (name, opt) in optimizers() {
        for agg in [Aggregation::Sum, Aggregation::Mean, Aggregation::Weighted] {
            let cfg = config(dir.path(), &opt, agg);
            for index in 0..2 {
                let (bucketed, whole) = (shard(&cfg, index, STEPS), shard(&cfg, index, STEPS));
                let n = bucketed.len();
                assert!(
                    bucketed.buckets().len() >= 2,
                    "{} buckets",
                    bucketed.buckets().len()
                );
                let (ob, ow) = (Recorder::default(), Recorder::default());
                for s in 0..STEPS {
                    let wire = if s % 2 == 1 { Wire::Bf16 } else { Wire::F32 };
                    let grads: Vec<Vec<f32>> = (0..W)
                        .map(|r| grad(n, r, s, index as u64, wire == Wire::Bf16))
                        .collect();
                    let order = [Order::Backward, Order::Forward, Order::Shuffled][s as usize % 3];
                    let (b, w) = ((&bucketed, &ob), (&whole, &ow));
                    step_both(b, w, s, grads, &samples, order, 5, wire);
                    let what = format!("{name}, {agg:?}, shard {index}, step {s}, {order:?}");
                    assert_same(&bucketed, &whole, &what);
                    let fb = ob.steps.lock().unwrap().last().cloned().unwrap();
                    let fw = ow.steps.lock().unwrap().last().cloned().unwrap();
                    let (early, total) = fb.buckets.expect("applied per bucket");
                    assert_eq!(total as usize, bucketed.buckets().len(), "{what}");
                    assert!(
                        early > 0 && early < total,
                        "{what}: {early} of {total} early"
                    );
                    assert_eq!(fw.buckets, None, "{what}");
                    let rel = (fb.grad_sq_norm - fw.grad_sq_norm).abs() / fw.grad_sq_norm;
                    assert!(
                        rel < 1e-9,
                        "{what}: grad norm {} vs {}",
                        fb.grad_sq_norm,
                        fw.grad_sq_norm
                    );
                }
                assert!(bucketed.optimizer_state().skipped.get(3) == Some(&1) || index == 0);
            }
        }
    }
}

/// A shard rebuilt from a checkpoint of a bucketed run goes on bucketed, bit-identical to the
/// run that never stopped.
#[test]
fn a_recovered_shard_goes_on_bucketed_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let opt = |t: TestConfig| {
        t.adam(0.01, 0.01, true)
            .checkpoint(2, 10)
            .checkpoint_dir(&ckpt)
    };
    let cfg = config(dir.path(), &opt, Aggregation::Weighted);
    let samples = [3u32, 8, 5];
    let (bucketed, whole) = (shard(&cfg, 1, 5), shard(&cfg, 1, 5));
    let n = bucketed.len();
    let (ob, ow) = (Recorder::default(), Recorder::default());
    let grads = |s: u64| -> Vec<Vec<f32>> { (0..W).map(|r| grad(n, r, s, 9, false)).collect() };
    for s in 0..2 {
        let (b, w) = ((&bucketed, &ob), (&whole, &ow));
        step_both(b, w, s, grads(s), &samples, Order::Backward, 4, Wire::F32);
    }
    assert_same(&bucketed, &whole, "before the recovery");
    let range = Shard::range_of(&cfg, 1);
    let id = Identity::of(&cfg, 1, range.clone());
    let fresh = cfg.optimizer.init_state(range.len());
    let saved = checkpoint::read(&ckpt, &id, 2, &fresh).unwrap();
    drop(bucketed);
    let recovered = Shard::starting_from(&cfg, 1, 5, Some(saved));
    for r in 0..W {
        recovered.register(r).unwrap();
    }
    let orec = Recorder::default();
    for s in 2..5 {
        let (b, w) = ((&recovered, &orec), (&whole, &ow));
        step_both(b, w, s, grads(s), &samples, Order::Shuffled, 6, Wire::F32);
        assert_same(&recovered, &whole, &format!("recovered, step {s}"));
        let f = orec.steps.lock().unwrap().last().cloned().unwrap();
        assert!(
            f.buckets.is_some_and(|(early, _)| early > 0),
            "step {s}: {:?}",
            f.buckets
        );
    }
}

/// Rank 1's push breaks after buckets used its pieces; it pushes again with other values: the
/// step equals the whole-range update of rank 0's, rank 2's and rank 1's NEW values, and the
/// step says it was applied over the whole range.
#[test]
fn a_broken_push_whose_pieces_were_used_discards_the_work() {
    let dir = tempfile::tempdir().unwrap();
    let opt = |t: TestConfig| t.sgd(0.05, 0.9);
    let cfg = config(dir.path(), &opt, Aggregation::Mean);
    let (bucketed, whole) = (shard(&cfg, 0, 3), shard(&cfg, 0, 3));
    let n = bucketed.len();
    let (ob, ow) = (Recorder::default(), Recorder::default());
    let samples = [4u32, 4, 4];
    // step 0 as usual
    let g0: Vec<Vec<f32>> = (0..W).map(|r| grad(n, r, 0, 1, false)).collect();
    let (b, w) = ((&bucketed, &ob), (&whole, &ow));
    step_both(b, w, 0, g0, &samples, Order::Forward, 3, Wire::F32);
    assert_same(&bucketed, &whole, "step 0");

    // step 1: every rank's first half is in and applied; rank 1's push then breaks
    let step = 1;
    let old: Vec<Vec<f32>> = (0..W).map(|r| grad(n, r, 1, 1, false)).collect();
    let half = bucketed.buckets()[0].range.end;
    let mut intakes: Vec<_> = (0..W)
        .map(|r| {
            bucketed.precheck(r, step, n as u64).unwrap();
            let a = bucketed.announce(r, step, 4);
            (a, bucketed.intake(r, step).unwrap())
        })
        .collect();
    let mut ran = false;
    for r in 0..W {
        let (_, intake) = &mut intakes[r as usize];
        let dst = intake.region(0..half).unwrap();
        for (d, &v) in dst.iter_mut().zip(&old[r as usize][..half]) {
            d.write(v);
        }
        // SAFETY: written just above.
        if unsafe { intake.publish() } {
            bucketed.run_buckets();
            ran = true;
        }
    }
    assert!(ran, "the first bucket was in for every rank and applied");
    let broken = intakes.remove(1);
    drop(broken);
    // rank 1 pushes again, other values, whole; then ranks 0 and 2 finish theirs
    let new1 = grad(n, 1, 1, 77, false);
    {
        bucketed.precheck(1, step, n as u64).unwrap();
        let _a = bucketed.announce(1, step, 4);
        let mut intake = bucketed.intake(1, step).unwrap();
        piece(&bucketed, &mut intake, &new1, 0..n, Wire::F32, true);
        let (g, fp) = intake.finish(None).unwrap();
        bucketed.accept(meta(1, step, 4), g, fp).unwrap();
    }
    for (i, r) in [0u32, 2].into_iter().enumerate() {
        let (_, intake) = &mut intakes[i];
        piece(
            &bucketed,
            intake,
            &old[r as usize],
            half..n,
            Wire::F32,
            true,
        );
        let (g, fp) = intake.finish(None).unwrap();
        let (_, ready) = bucketed.accept(meta(r, step, 4), g, fp).unwrap();
        if let Some(slots) = ready {
            bucketed.complete(slots, &ob).unwrap();
        }
    }
    for (r, v) in [(0, &old[0]), (1, &new1), (2, &old[2])] {
        push_whole(&whole, &ow, r, step, 4, v);
    }
    assert_same(&bucketed, &whole, "after the broken push");
    let f = ob.steps.lock().unwrap().last().cloned().unwrap();
    assert_eq!(f.step, 1);
    assert_eq!(f.buckets, None, "the step fell back to the whole range");

    // the next step is bucketed again
    let g2: Vec<Vec<f32>> = (0..W).map(|r| grad(n, r, 2, 1, false)).collect();
    let (b, w) = ((&bucketed, &ob), (&whole, &ow));
    step_both(b, w, 2, g2, &samples, Order::Backward, 3, Wire::F32);
    assert_same(&bucketed, &whole, "step 2");
    let f = ob.steps.lock().unwrap().last().cloned().unwrap();
    assert!(f.buckets.is_some_and(|(e, _)| e > 0), "{:?}", f.buckets);
}

/// The buckets cover the range exactly, each inside one tensor, none longer than the limit;
/// a shard with clipping, or too few receive buffers, applies the whole range.
#[test]
fn buckets_partition_the_range_and_the_mode_says_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &|t| t.sgd(0.1, 0.0), Aggregation::Sum);
    for index in 0..2 {
        let s = Shard::new(&cfg, index, 1);
        let mut at = 0;
        for b in s.buckets() {
            assert_eq!(b.range.start, at);
            assert!(!b.range.is_empty() && b.range.len() <= ps_shard::bucket::BUCKET_VALUES);
            let t = s.spec.tensors[b.tensor as usize].range();
            assert!(
                t.start <= s.range.start + b.range.start && s.range.start + b.range.end <= t.end
            );
            at = b.range.end;
        }
        assert_eq!(at, s.len());
    }
    let clip = config(
        dir.path(),
        &|t| t.sgd(0.1, 0.0).clip_norm(1.0),
        Aggregation::Sum,
    );
    let s = Shard::new(&clip, 0, 1);
    assert!(s.buckets().is_empty());
    assert!(
        matches!(s.apply_mode(), ps_shard::bucket::Mode::Whole(why) if why.contains("clip_norm"))
    );
    let few = config(
        dir.path(),
        &|t| t.sgd(0.1, 0.0).max_pending_gradients(2),
        Aggregation::Sum,
    );
    let s = Shard::new(&few, 0, 1);
    assert!(s.intake(0, 0).is_none());
    assert!(
        matches!(s.apply_mode(), ps_shard::bucket::Mode::Whole(why) if why.contains("max_pending_gradients"))
    );
}
