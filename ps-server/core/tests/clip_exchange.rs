//! The norm exchange of `[optimizer] clip_norm` over several shards, seen from the shard core:
//! every way it can fail (refused, timed out, the run failed or rolled back meanwhile, a step
//! settled without this shard, an answer for another step, no exchange at all) ends the step
//! with `PsError::RunFailed` naming it. The shard stays at its version with its parameters
//! untouched, nothing panics, whether the step's gradients were folded as they arrived (W = 2)
//! or summed in the update (W = 1).

use ps_config::{Aggregation, Config, TestConfig, Transport};
use ps_proto::PsError;
use ps_shard::{Grad, NormError, NormExchange, PushMeta, Shard, StepFigures, StepObserver};
use std::path::Path;
use std::sync::Arc;

struct Quiet;

impl StepObserver for Quiet {
    fn step_done(&self, _: StepFigures) {}
    fn checkpointed(&self, _: &ps_shard::checkpoint::Attempted) {}
}

/// An exchange that always fails with `0`, counting its calls.
#[derive(Debug)]
struct Failing(NormError, std::sync::atomic::AtomicUsize);

impl NormExchange for Failing {
    fn total_norm(&self, _: &Shard, _: u64, _: u32, sq: Vec<f64>) -> Result<f32, NormError> {
        assert!(!sq.is_empty(), "the shard's per-tensor sums");
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Err(self.0.clone())
    }
}

/// Shard 0 of 2 of the built-in MLP (784 -> 4 -> 10), `w` workers, clipping at 1.
fn config(dir: &Path, w: usize) -> Config {
    TestConfig::new()
        .shards(2)
        .workers(w)
        .hidden(&[4])
        .transport(Transport::Grpc)
        .aggregation(Aggregation::Mean)
        .sgd(0.1, 0.9)
        .clip_norm(1.0)
        .build(&dir.join("config.toml"))
        .unwrap()
}

/// Pushes every rank's gradient of step 0 as the gRPC handler does; the completing push's
/// result.
fn step0(shard: &Shard, w: u32) -> Result<(), PsError> {
    let n = shard.len();
    for rank in 0..w {
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 7 + rank as usize * 3) % 11) as f32 - 5.0)
            .collect();
        shard.precheck(rank, 0, n as u64)?;
        let fingerprint = ps_net::wire::check_and_fingerprint(&values)?;
        let meta = PushMeta {
            rank,
            step: 0,
            samples: 8,
            loss_sum: 1.0,
            correct: 0,
            eval: (0, 0),
        };
        let held = ps_shard::intake::Held {
            values,
            permit: None,
        };
        let (outcome, ready) = shard.accept(meta, Grad::Owned(held), fingerprint)?;
        match ready {
            Some(slots) => return shard.complete(slots, &Quiet),
            None if outcome.counted => shard.fold_ready()?,
            None => {}
        }
    }
    panic!("the barrier of step 0 did not complete with {w} pushes")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Step 0 with `exchange` (None: none set) ends with the run failed naming `words`.
fn fails_cleanly(w: usize, exchange: Option<NormError>, words: &str) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), w);
    let shard = Shard::new(&cfg, 0, 3);
    let failing = exchange.map(|e| Arc::new(Failing(e, Default::default())));
    if let Some(f) = &failing {
        shard.set_norm_exchange(f.clone());
    }
    for r in 0..w as u32 {
        shard.register(r).unwrap();
    }
    let before = shard.params().unwrap();
    let e = step0(&shard, w as u32).expect_err("the step cannot be applied");
    let PsError::RunFailed(msg) = &e else {
        panic!("expected RunFailed, got {e:?}")
    };
    assert!(
        msg.starts_with("step 0: gradient clipping ([optimizer] clip_norm) needs the gradient norm of every shard: "),
        "{msg}"
    );
    assert!(msg.contains(words), "{msg}\nexpected: {words}");
    assert!(
        msg.ends_with("the step is not applied (the shard stays at version 0) and the run stops"),
        "{msg}"
    );
    if let Some(f) = &failing {
        assert_eq!(f.1.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
    assert_eq!(shard.failure().as_deref(), Some(msg.as_str()));
    let after = shard.params().unwrap();
    assert_eq!((before.0, after.0, shard.version()), (0, 0, 0));
    assert_eq!(
        bits(&after.1),
        bits(&before.1),
        "the parameters are untouched"
    );
}

fn every_kind() -> Vec<(Option<NormError>, &'static str)> {
    vec![
        (
            Some(NormError::Refused {
                step: 0,
                why: "Unauthenticated: no shard credential".into(),
            }),
            "shard 0 refused the gradient norms of step 0: Unauthenticated: no shard credential",
        ),
        (
            Some(NormError::TimedOut {
                step: 0,
                at: "from shard 0 at 127.0.0.1:1".into(),
                secs: 32.0,
                last: ", last: no answer within 1.0 s".into(),
            }),
            "step 0: no total gradient norm from shard 0 at 127.0.0.1:1 within 32 s (twice [server] barrier_timeout_secs + 30 s), last: no answer within 1.0 s",
        ),
        (
            Some(NormError::RunFailed {
                step: 0,
                why: "rolled back to version 0 (generation 1): shard 0 was lost; register again"
                    .into(),
            }),
            "step 0: the run failed meanwhile: rolled back to version 0 (generation 1)",
        ),
        (
            Some(NormError::Superseded { step: 0, at: 1 }),
            "step 0: shard 0 has moved on to step 1",
        ),
        (
            Some(NormError::OtherStep { step: 0, got: 5 }),
            "shard 0 answered the gradient norms of step 0 with step 5's",
        ),
        (
            None,
            "shard 0 of 2 has no way to exchange gradient norms with the other shards",
        ),
    ]
}

#[test]
fn every_failed_norm_exchange_fails_the_step_without_a_panic_when_summed_in_the_update() {
    for (e, words) in every_kind() {
        fails_cleanly(1, e, words);
    }
}

#[test]
fn every_failed_norm_exchange_fails_the_step_without_a_panic_when_folded() {
    for (e, words) in every_kind() {
        fails_cleanly(2, e, words);
    }
}
