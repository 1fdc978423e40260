//! The set-up the per-bucket tests share (`bucket.rs`: pushes received piece by piece;
//! `board.rs`: pushes read in place from shared-memory boards): the step recorder, the ranks'
//! gradients, the whole-range reference push, and the bit-for-bit comparison of two shards.

use ps_optim::OptState;
use ps_shard::checkpoint::Attempted;
use ps_shard::intake::Held;
use ps_shard::{Grad, PushMeta, Shard, StepFigures, StepObserver};
use std::sync::{Arc, Mutex};

/// Ranks of the run.
pub const W: u32 = 3;

/// The figures of every step applied.
#[derive(Default)]
pub struct Recorder {
    pub steps: Mutex<Vec<StepFigures>>,
}

impl StepObserver for Recorder {
    fn step_done(&self, figures: StepFigures) {
        self.steps.lock().unwrap().push(figures);
    }

    fn checkpointed(&self, _: &Attempted) {}
}

/// Rank `rank`'s gradient of `step` (`salt`: another gradient of the same step): `n` values
/// of mixed magnitudes.
pub fn grad(n: usize, rank: u32, step: u64, salt: u64) -> Vec<f32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (u64::from(rank) << 32) ^ (step << 8) ^ (salt << 20) ^ 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * (1 + (x & 0xff)) as f32 / 37.0
        })
        .collect()
}

/// A push's metadata: `samples` samples, loss sum 1, no evaluation.
pub fn meta(rank: u32, step: u64, samples: u32) -> PushMeta {
    PushMeta {
        rank,
        step,
        samples,
        loss_sum: 1.0,
        correct: 0,
        eval: (0, 0),
    }
}

/// The reference: a push received whole into a shard buffer (ps-server's receipt without
/// buckets), and the step completed when it was the last.
pub fn push_whole(
    shard: &Shard,
    obs: &Recorder,
    rank: u32,
    step: u64,
    samples: u32,
    values: &[f32],
) {
    shard.precheck(rank, step, values.len() as u64).unwrap();
    let fp = ps_net::wire::check_and_fingerprint(values).unwrap();
    let held = Held {
        values: values.to_vec(),
        permit: None,
    };
    let (_, ready) = shard
        .accept(meta(rank, step, samples), Grad::Owned(held), fp)
        .unwrap();
    if let Some(slots) = ready {
        shard.complete(slots, obs).unwrap();
    }
}

/// A shard of `cfg` with every rank registered.
pub fn shard(cfg: &ps_config::Config, index: usize, steps: u64) -> Arc<Shard> {
    let s = Shard::new(cfg, index, steps);
    for r in 0..W {
        s.register(r).unwrap();
    }
    s
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `a` and `b` at the same version with the same parameters and optimizer state, bit for bit.
pub fn assert_same(a: &Shard, b: &Shard, what: &str) {
    let (va, pa) = a.params().unwrap();
    let (vb, pb) = b.params().unwrap();
    assert_eq!(va, vb, "{what}: versions");
    assert!(bits(&pa) == bits(&pb), "{what}: parameters differ");
    let (oa, ob): (OptState, OptState) = (a.optimizer_state(), b.optimizer_state());
    assert_eq!(oa.steps, ob.steps, "{what}: steps");
    assert!(bits(&oa.m) == bits(&ob.m), "{what}: m differs");
    assert!(bits(&oa.v) == bits(&ob.v), "{what}: v differs");
    assert_eq!(oa.skipped, ob.skipped, "{what}: skipped");
}
