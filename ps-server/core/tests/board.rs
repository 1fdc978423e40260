//! Per-bucket apply of shared-memory pushes in-process: a worker's gradient board read in place
//! bucket by bucket ([`Shard::board_push`]), checked (finiteness, fingerprint) in the pass that
//! publishes each bucket to the applier, with the parameters in the shard's board: weights and
//! optimizer state bit-identical to the whole-range update of the same gradients, and a push
//! refused halfway (a value that is not finite in its board) then retried with other values
//! bit-identical to a run that only saw the retry's.

mod common;

use common::{Recorder, W, assert_same, grad, meta, push_whole};
use ps_config::{Aggregation, Config, TestConfig, Transport, Wire};
use ps_net::shm::{Board, BoardDir, grad_path, shm_root};
use ps_proto::PsError;
use ps_shard::Shard;
use std::path::Path;
use std::sync::Arc;

impl Recorder {
    /// The per-bucket figure of the last step: (buckets applied early, buckets), or None
    /// when it was applied over the whole range.
    fn last_buckets(&self) -> Option<(u32, u32)> {
        self.steps.lock().unwrap().last().expect("a step").buckets
    }
}

/// 784 -> 1600 -> 10 on 2 shards (fc1.weight spans several buckets on each), every rank with a
/// buffer, AdamW (its state is compared too), on `transport`.
fn config(dir: &Path, transport: Transport) -> Config {
    let t = TestConfig::new()
        .shards(2)
        .workers(W as usize)
        .hidden(&[1600])
        .transport(transport)
        .aggregation(Aggregation::Mean)
        .max_pending_gradients(W as usize)
        .adam(0.01, 0.01, true);
    Config::parse(&t.toml(), &dir.join("config.toml")).unwrap()
}

/// A shard on a shared-memory host with its parameters in its board, and each rank's
/// gradient board (a worker's, made as ps-worker makes it) attached.
struct BoardShard {
    shard: Arc<Shard>,
    /// Each rank's board directory (removed on drop) and board (this test writes it).
    boards: Vec<(BoardDir, Board)>,
}

impl BoardShard {
    fn new(cfg: &Config, index: usize, steps: u64) -> Self {
        let root = shm_root().expect("a shared-memory root (/dev/shm)");
        let shard = Shard::new(cfg, index, steps);
        let mut boards = Vec::new();
        for r in 0..W {
            shard.register(r).unwrap();
            let dir = BoardDir::create(&root, &format!("boardtest-w{r}")).unwrap();
            let path = grad_path(dir.path());
            let board = Board::create(&path, dir.token(), shard.push_values(), 1).unwrap();
            assert!(
                shard.attach_grad(r, &path, dir.token()).unwrap(),
                "rank {r}'s board"
            );
            boards.push((dir, board));
        }
        assert!(shard.offer_shm(0).unwrap().is_some());
        assert!(shard.has_board(), "the parameters are in the shard's board");
        assert_eq!(shard.apply_mode(), &ps_shard::bucket::Mode::Buckets);
        Self { shard, boards }
    }

    /// Writes rank `rank`'s gradient of this shard's range into its board.
    fn write(&mut self, rank: u32, values: &[f32]) {
        let range = self.shard.range.clone();
        self.boards[rank as usize].1.slot_mut(0)[range].copy_from_slice(values);
    }

    /// Rank `rank`'s push of `step` from its board, as ps-server takes it; its fingerprint.
    fn push(&self, obs: &Recorder, rank: u32, step: u64, samples: u32) -> Result<u64, PsError> {
        let s = &self.shard;
        s.precheck(rank, step, s.len() as u64)?;
        // as ps-server: the rank is not missing while its push is read from its board
        let _under_way = s.announce(rank, step, samples);
        let (grad, fp, intake) = s.board_push(rank, step)?;
        assert!(intake.is_some(), "rank {rank}: read per bucket");
        let (outcome, ready) = s.accept(meta(rank, step, samples), grad, fp)?;
        assert!(outcome.counted);
        if let Some(slots) = ready {
            s.complete(slots, obs)?;
        }
        drop(intake);
        Ok(fp)
    }
}

const SAMPLES: [u32; 3] = [5, 3, 4];

/// Both shards of the run, four steps: every board push is read per bucket, its fingerprint
/// is the whole range's, every step is applied per bucket (those the applier beside the last
/// push's pass did not reach by the completion are applied then), and weights and AdamW state
/// end every step bit-identical to the whole-range update of the same gradients.
#[test]
fn board_pushes_apply_per_bucket_bit_identical_to_the_whole_range_update() {
    let dir = tempfile::tempdir().unwrap();
    let shm = config(dir.path(), Transport::Auto);
    let grpc = config(dir.path(), Transport::Grpc);
    for index in 0..2 {
        let (ob, ow) = (Recorder::default(), Recorder::default());
        let mut boards = BoardShard::new(&shm, index, 4);
        let whole = common::shard(&grpc, index, 4);
        let n = boards.shard.len();
        let buckets = boards.shard.buckets().len() as u32;
        assert!(buckets > 1, "shard {index}: several buckets");
        for step in 0..4 {
            for r in 0..W {
                let g = grad(n, r, step, u64::from(index as u32));
                boards.write(r, &g);
                let fp = boards
                    .push(&ob, r, step, SAMPLES[r as usize])
                    .unwrap_or_else(|e| panic!("shard {index} step {step} rank {r}: {e}"));
                assert_eq!(fp, ps_net::wire::check_and_fingerprint(&g).unwrap());
                push_whole(&whole, &ow, r, step, SAMPLES[r as usize], &g);
            }
            let (early, of) = ob.last_buckets().expect("applied per bucket");
            assert_eq!(of, buckets, "step {step}");
            assert!(early <= buckets, "step {step}");
            assert_eq!(ow.last_buckets(), None);
            assert_same(&boards.shard, &whole, &format!("shard {index} step {step}"));
        }
    }
}

/// Step 1: ranks 0 and 1 push, rank 2's board holds a NaN in its second bucket: its push is
/// refused naming that value (the work that used its buckets is discarded), then rank 2 writes
/// other values and pushes again. The step is applied over the whole range and ends
/// bit-identical to a run that only saw the retry's values; the next step is per bucket again.
#[test]
fn a_board_push_refused_halfway_then_retried_with_other_values_is_the_retry_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let shm = config(dir.path(), Transport::Auto);
    let grpc = config(dir.path(), Transport::Grpc);
    let (ob, ow) = (Recorder::default(), Recorder::default());
    let mut boards = BoardShard::new(&shm, 0, 3);
    let whole = common::shard(&grpc, 0, 3);
    let n = boards.shard.len();
    let buckets = boards.shard.buckets().len() as u32;
    assert!(buckets > 2);
    for step in 0..3 {
        for r in 0..W {
            let g = grad(n, r, step, 0);
            if step == 1 && r == 2 {
                let mut bad = g.clone();
                let at = boards.shard.buckets()[1].range.start + 17;
                bad[at] = f32::NAN;
                boards.write(r, &bad);
                match boards.push(&ob, r, step, SAMPLES[2]) {
                    Err(PsError::NonFinite { index, value }) => {
                        assert_eq!(index, at as u64);
                        assert!(value.is_nan());
                    }
                    other => panic!("expected the NaN refused, got {other:?}"),
                }
                assert_eq!(boards.shard.version(), 1, "nothing applied");
                // the retry, with other values
                let retry = grad(n, r, step, 99);
                boards.write(r, &retry);
                boards.push(&ob, r, step, SAMPLES[2]).unwrap();
                push_whole(&whole, &ow, r, step, SAMPLES[2], &retry);
                continue;
            }
            boards.write(r, &g);
            boards.push(&ob, r, step, SAMPLES[r as usize]).unwrap();
            push_whole(&whole, &ow, r, step, SAMPLES[r as usize], &g);
        }
        match ob.last_buckets() {
            None => assert_eq!(step, 1, "only the step of the refused push is whole-range"),
            Some((early, of)) => {
                assert_ne!(step, 1, "the refused push's buckets were discarded");
                assert!(of == buckets && early <= buckets, "step {step}");
            }
        }
        assert_same(&boards.shard, &whole, &format!("step {step}"));
    }
}

/// A board truncated before its push is read (another process shrank the file: the pass reads
/// zeros under the SIGBUS guard) refuses the push naming the rank and the file, through the
/// push's source; the shard forgets the board, so the rank's next shared-memory push is
/// refused as one with no board, and nothing is applied.
#[test]
fn a_board_truncated_under_its_push_is_refused_and_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let shm = config(dir.path(), Transport::Auto);
    let ob = Recorder::default();
    let mut boards = BoardShard::new(&shm, 0, 2);
    let n = boards.shard.len();
    boards.write(0, &grad(n, 0, 0, 0));
    boards.push(&ob, 0, 0, SAMPLES[0]).unwrap();
    boards.write(1, &grad(n, 1, 0, 0));
    let path = grad_path(boards.boards[1].0.path());
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(0).unwrap();
    let refusal = |got: Result<u64, PsError>| match got {
        Err(PsError::BadChunk(m)) => m,
        other => panic!("expected the push refused, got {other:?}"),
    };
    assert_eq!(
        refusal(boards.push(&ob, 1, 0, SAMPLES[1])),
        format!(
            "rank 1's shared-memory gradient board {} was truncated (another process shrank the file): push refused; register again with a new board, or push through gRPC",
            path.display()
        )
    );
    assert_eq!(
        refusal(boards.push(&ob, 1, 0, SAMPLES[1])),
        "rank 1 pushed through shared memory but shard 0 has no gradient board of it: expected a registration with a grad_file first"
    );
    assert_eq!(boards.shard.version(), 0, "nothing applied");
}

/// Host copies on the shard's side (`ps_net::copied`): one step's board pushes, read in place,
/// copy no push byte; the same gradients received as gRPC chunks (decoded into the per-bucket
/// buffer, as ps-server's receipt does) copy exactly their range, rank by rank, and end
/// bit-identical; a version's first reply copies the weights out of the board once, and the
/// next pull shares it. Counted in a scope of this test's thread (`copied::scoped`), where
/// the shard core receives, reads in place and snapshots: exact whatever the other tests of
/// this binary copy meanwhile.
#[test]
fn board_pushes_copy_nothing_and_chunked_pushes_copy_their_range() {
    let (scope, _on_this_thread) = ps_net::copied::scoped();
    let totals = || scope.totals();
    let dir = tempfile::tempdir().unwrap();
    let shm = config(dir.path(), Transport::Auto);
    let grpc = config(dir.path(), Transport::Grpc);
    let (ob, oc) = (Recorder::default(), Recorder::default());
    let mut boards = BoardShard::new(&shm, 1, 2);
    let chunked = common::shard(&grpc, 1, 2);
    let n = boards.shard.len();
    let before = totals().1;
    for r in 0..W {
        boards.write(r, &grad(n, r, 0, 5));
        boards.push(&ob, r, 0, SAMPLES[r as usize]).unwrap();
    }
    assert_eq!(totals().1, before, "board pushes are read in place");
    for r in 0..W {
        let bytes: Vec<u8> = grad(n, r, 0, 5)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let before = totals().1;
        chunked_push(&chunked, &oc, r, SAMPLES[r as usize], &bytes);
        assert_eq!(totals().1 - before, 4 * n as u64, "rank {r}: its range");
    }
    assert_same(&boards.shard, &chunked, "step 0");
    let before = totals().0;
    let (version, reply) = boards.shard.snapshot().unwrap();
    assert_eq!((version, reply.len()), (1, 4 * n));
    assert_eq!(totals().0 - before, 4 * n as u64, "the weights, once");
    boards.shard.snapshot().unwrap();
    assert_eq!(totals().0 - before, 4 * n as u64, "shared by the next pull");
}

/// Rank `rank`'s push of step 0, its f32 `bytes` received in 1 MiB gRPC chunks into the
/// per-bucket buffer (the applier run whenever buckets became ready), then counted.
fn chunked_push(shard: &Arc<Shard>, obs: &Recorder, rank: u32, samples: u32, bytes: &[u8]) {
    shard.precheck(rank, 0, (bytes.len() / 4) as u64).unwrap();
    let _under_way = shard.announce(rank, 0, samples);
    let mut intake = shard.intake(rank, 0).expect("per-bucket apply");
    for (i, chunk) in bytes.chunks(1 << 20).enumerate() {
        if intake.decode(i << 18, Wire::F32, chunk).unwrap() {
            shard.run_buckets();
        }
    }
    let (grad, fp) = intake.finish(None).unwrap();
    let (_, ready) = shard.accept(meta(rank, 0, samples), grad, fp).unwrap();
    if let Some(slots) = ready {
        shard.complete(slots, obs).unwrap();
    }
}

/// The pass of a board push fingerprints bucket by bucket, at offsets that do not line up with
/// the fingerprint's lanes: the same fingerprint as the whole range's, and the first value
/// that is not finite named as the whole range's check names it.
#[test]
fn the_fingerprint_taken_piece_by_piece_is_the_whole_ranges() {
    let g = grad(10_007, 1, 2, 3);
    let cuts = [0, 5, 37, 64, 1000, 1031, 9000, 10_007];
    let whole = ps_net::wire::check_and_fingerprint(&g).unwrap();
    let mut check = ps_net::wire::StreamCheck::new(g.len());
    for w in cuts.windows(2) {
        check.push_values(w[0] as u64, &g[w[0]..w[1]]).unwrap();
    }
    assert_eq!(check.finish().unwrap(), whole);
    let mut bad = g.clone();
    bad[1040] = f32::INFINITY;
    bad[9500] = f32::NAN;
    let mut check = ps_net::wire::StreamCheck::new(g.len());
    for w in cuts.windows(2) {
        check.push_values(w[0] as u64, &bad[w[0]..w[1]]).unwrap();
    }
    match (check.finish(), ps_net::wire::check_and_fingerprint(&bad)) {
        (
            Err(PsError::NonFinite { index, value }),
            Err(PsError::NonFinite {
                index: i2,
                value: v2,
            }),
        ) => {
            assert_eq!((index, i2), (1040, 1040));
            assert_eq!((value, v2), (f32::INFINITY, f32::INFINITY));
        }
        other => panic!("expected both to name index 1040, got {other:?}"),
    }
}
