//! A live `ps-server` process guards what advances its version: a push for a step past the
//! end of the run is refused on the gRPC and the shared-memory paths and changes nothing, and
//! a shared-memory gradient that its worker overwrites with NaN after the push was accepted is
//! caught by the update that reads it: the step is not applied and the run stops loudly. A
//! board truncated by another process cannot kill the shard (SIGBUS): truncated before the
//! push, the push is refused and the shard goes on; truncated under the update, the step is
//! refused and the run stops loudly. A board of another user, or outside the shared-memory
//! board directories, is never opened.

use ps_config::Transport;
use ps_launch::{LocalCluster, bin_dir};
use ps_net::client::push_chunks;
use ps_net::shm::{Board, BoardDir, grad_path, params_path, shm_root};
use ps_net::wire::{TensorReceiver, f32_to_bytes};
use ps_proto::PROTOCOL_VERSION;
use ps_proto::pb::{PushHeader, PushReply, RegisterRequest};
use ps_tests::Spec;
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::Code;

type Client = ps_tests::RawClient;

fn header(rank: u32, step: u64, len: usize, shm: bool) -> PushHeader {
    PushHeader {
        rank,
        step,
        samples: 8,
        loss_sum: 10.0,
        correct: 3,
        len: len as u64,
        eval_correct: 0,
        eval_count: 0,
        shm,
    }
}

async fn push(c: &mut Client, h: PushHeader, values: &[f32]) -> Result<PushReply, tonic::Status> {
    let msgs = push_chunks(h, &f32_to_bytes(values), 4096);
    c.push(msgs).await.map(|r| r.into_inner())
}

async fn pull(c: &mut Client, version: u64) -> Result<(u64, Vec<f32>), tonic::Status> {
    let lease = c.any_lease();
    let mut s = c
        .rpc
        .pull(ps_tests::pull_request(version, lease))
        .await?
        .into_inner();
    let first = s.message().await?.expect("a chunk");
    let h = first.header.expect("header");
    let mut rx = TensorReceiver::new(h.len as usize, false);
    rx.push(first.offset, &first.data).unwrap();
    while let Some(c) = s.message().await? {
        rx.push(c.offset, &c.data).unwrap();
    }
    Ok((h.version, rx.finish().unwrap().0))
}

fn expect_err<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, words: &str) {
    let e = r.expect_err("expected a refusal");
    assert_eq!(e.code(), code, "{e:?}");
    assert!(
        e.message().contains(words),
        "message {:?} lacks {words:?}",
        e.message()
    );
}

/// A live one-shard server for W = 2 and 2 steps (plain SGD, lr 0.5); rank 0 registered with a
/// shared-memory gradient board (returned) and the shard's parameters board, rank 1 through
/// gRPC only.
struct Live {
    _dir: tempfile::TempDir,
    cluster: LocalCluster,
    c: Client,
    n: usize,
    _board_dir: BoardDir,
    grad: Board,
    params: Board,
}

async fn live() -> Live {
    let spec = Spec {
        shards: 1,
        workers: 2,
        hidden: vec![4],
        steps: 2,
        config: Spec::base().sgd(0.5, 0.0),
        transport: Transport::Auto,
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let n = cfg.layout().num_params();
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap();
    let mut c = Client::connect(format!("http://{}", cluster.addrs[0]))
        .await
        .unwrap();
    let root = shm_root().expect("/dev/shm on the test machine");
    let board_dir = BoardDir::create(&root, "test-guard-worker0").unwrap();
    let grad = Board::create(&grad_path(board_dir.path()), board_dir.token(), n, 1).unwrap();
    let reg = |rank: u32| RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        rank,
        world_size: 2,
        num_params: n as u64,
        shard: 0,
        num_shards: 1,
        shared_memory: rank == 0,
        grad_file: if rank == 0 {
            grad.path().display().to_string()
        } else {
            String::new()
        },
        grad_token: board_dir.token(),
        model: Vec::new(),
    };
    let r0 = c.register(reg(0)).await.unwrap().into_inner();
    assert!(r0.grad_shm && !r0.shm_dir.is_empty(), "{r0:?}");
    c.register(reg(1)).await.unwrap();
    let params = Board::open(&params_path(Path::new(&r0.shm_dir)), r0.shm_token, n, 2).unwrap();
    Live {
        _dir: dir,
        cluster,
        c,
        n,
        _board_dir: board_dir,
        grad,
        params,
    }
}

fn grads(n: usize, step: u64) -> (Vec<f32>, Vec<f32>) {
    let s = step as f32;
    (
        (0..n)
            .map(|i| ((i % 13) as f32 - 6.0) * 0.01 + s * 1e-3)
            .collect(),
        (0..n)
            .map(|i| ((i % 7) as f32 - 3.0) * 0.02 - s * 1e-3)
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_past_the_end_of_the_run_are_refused_on_both_paths() {
    let Live {
        cluster: _cluster,
        mut c,
        n,
        mut grad,
        params,
        _dir: _keep_dir,
        _board_dir: _keep_board_dir,
    } = live().await;
    for step in 0..2 {
        let (g0, g1) = grads(n, step);
        grad.slot_mut(0).copy_from_slice(&g0);
        let r = push(&mut c, header(0, step, n, true), &[]).await.unwrap();
        assert!(r.counted, "{r:?}");
        let r = push(&mut c, header(1, step, n, false), &g1).await.unwrap();
        assert!(r.counted && r.ranks_in == 2, "{r:?}");
    }
    let (version, last) = pull(&mut c, 2).await.unwrap();
    assert_eq!(version, 2, "the run's 2 steps are applied");
    // step 2 of a 2-step run: refused through gRPC and through shared memory
    let (g0, g1) = grads(n, 2);
    grad.slot_mut(0).copy_from_slice(&g0);
    for _ in 0..2 {
        expect_err(
            push(&mut c, header(1, 2, n, false), &g1).await,
            Code::OutOfRange,
            "step 2 is not a step of this run: expected a step in 0..2",
        );
        expect_err(
            push(&mut c, header(0, 2, n, true), &[]).await,
            Code::OutOfRange,
            "step 2 is not a step of this run",
        );
    }
    // nothing changed: still version 2, same values, no version 3 in the board
    let (version, again) = pull(&mut c, 2).await.unwrap();
    assert_eq!((version, &again), (2, &last));
    let mut copy = vec![0f32; n];
    assert!(params.read_version(2, &mut copy));
    assert_eq!(copy, last);
    assert!(!params.read_version(3, &mut copy), "no version 3");
    expect_err(pull(&mut c, 3).await, Code::OutOfRange, "will never exist");
    // a retry of the last step is still acknowledged, not counted
    let (_, g1) = grads(n, 1);
    let r = push(&mut c, header(1, 1, n, false), &g1).await.unwrap();
    assert!(!r.counted, "{r:?}");
    assert_eq!(pull(&mut c, 2).await.unwrap().0, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gradient_board_written_after_its_push_never_reaches_the_weights() {
    let Live {
        mut cluster,
        mut c,
        n,
        mut grad,
        params,
        _dir: _keep_dir,
        _board_dir: _keep_board_dir,
    } = live().await;
    let (_, before) = pull(&mut c, 0).await.unwrap();
    let (g0, g1) = grads(n, 0);
    grad.slot_mut(0).copy_from_slice(&g0);
    let r = push(&mut c, header(0, 0, n, true), &[]).await.unwrap();
    assert!(r.counted, "checked and accepted with finite values: {r:?}");
    // against the protocol: the worker writes its board before the step is applied
    grad.slot_mut(0)[5] = f32::NAN;
    // rank 1's push completes the barrier; the update finds the NaN where it reads it
    expect_err(
        push(&mut c, header(1, 0, n, false), &g1).await,
        Code::FailedPrecondition,
        "rank 0's gradient holds NaN at index 5",
    );
    // the step was not applied: version 0 is intact and finite in the board, no version 1
    let mut copy = vec![0f32; n];
    assert!(
        params.read_version(0, &mut copy),
        "version 0 still complete"
    );
    assert_eq!(copy, before);
    assert!(copy.iter().all(|v| v.is_finite()));
    assert!(
        !params.read_version(1, &mut copy),
        "version 1 never published"
    );
    // the run stops loudly: refused pulls, exit status 1, the reason in the log
    if let Ok(r) = pull(&mut c, 1).await {
        panic!("version {} served after a refused step", r.0);
    }
    let shard = &mut cluster.servers[0];
    let started = Instant::now();
    let status = loop {
        if let Some(s) = shard.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the shard did not stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(1), "{}", shard.log_tail(20));
    let log = std::fs::read_to_string(shard.log.as_ref().unwrap()).unwrap();
    assert!(
        log.contains("the step is not applied (the shard stays at version 0)")
            && !log.contains("final weights"),
        "{log}"
    );
}

/// Waits (at most 30 s) for the shard to exit and returns its exit code and log.
fn exit_of(cluster: &mut LocalCluster) -> (Option<i32>, String) {
    let shard = &mut cluster.servers[0];
    let started = Instant::now();
    let status = loop {
        if let Some(s) = shard.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the shard did not stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = std::fs::read_to_string(shard.log.as_ref().unwrap()).unwrap();
    (status.code(), log)
}

fn truncate(board: &Board) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(board.path())
        .unwrap()
        .set_len(0)
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gradient_board_truncated_during_the_update_is_refused_and_the_shard_survives() {
    let Live {
        mut cluster,
        mut c,
        n,
        mut grad,
        params,
        _dir: _keep_dir,
        _board_dir: _keep_board_dir,
    } = live().await;
    let (_, before) = pull(&mut c, 0).await.unwrap();
    let (g0, g1) = grads(n, 0);
    grad.slot_mut(0).copy_from_slice(&g0);
    let r = push(&mut c, header(0, 0, n, true), &[]).await.unwrap();
    assert!(r.counted, "{r:?}");
    // against the protocol: the board shrinks before the update reads it
    truncate(&grad);
    expect_err(
        push(&mut c, header(1, 0, n, false), &g1).await,
        Code::FailedPrecondition,
        "rank 0's shared-memory gradient board was truncated while the update read it",
    );
    let mut copy = vec![0f32; n];
    assert!(params.read_version(0, &mut copy), "version 0 intact");
    assert_eq!(copy, before);
    assert!(!params.read_version(1, &mut copy), "no version 1");
    // the shard was not killed by SIGBUS: it stops the run itself, exit status 1, said why
    let (code, log) = exit_of(&mut cluster);
    assert_eq!(code, Some(1), "{log}");
    assert!(
        log.contains("the step is not applied (the shard stays at version 0)")
            && !log.contains("final weights"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_foreign_and_misplaced_boards_are_refused_and_the_shard_goes_on() {
    let Live {
        mut cluster,
        mut c,
        n,
        grad,
        params: _params,
        _dir: keep_dir,
        _board_dir: board_dir,
    } = live().await;
    // truncated before the push: refused at the push, the board is dropped
    truncate(&grad);
    expect_err(
        push(&mut c, header(0, 0, n, true), &[]).await,
        Code::InvalidArgument,
        "was truncated (another process shrank the file): push refused",
    );
    expect_err(
        push(&mut c, header(0, 0, n, true), &[]).await,
        Code::InvalidArgument,
        "has no gradient board of it",
    );
    let reg = |file: &Path, token: u64| RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        rank: 0,
        world_size: 2,
        num_params: n as u64,
        shard: 0,
        num_shards: 1,
        shared_memory: true,
        grad_file: file.display().to_string(),
        grad_token: token,
        model: Vec::new(),
    };
    // a valid board outside the shared-memory board directories: never opened
    let elsewhere = keep_dir.path().join("ps-worker0-pid1-0000000000000001");
    std::fs::create_dir(&elsewhere).unwrap();
    let outside = Board::create(&elsewhere.join("grad"), board_dir.token(), n, 1).unwrap();
    let r = c
        .register(reg(outside.path(), board_dir.token()))
        .await
        .unwrap();
    assert!(!r.into_inner().grad_shm, "a board outside the shm root");
    // a valid board of another user (only root can make one here)
    let root = shm_root().unwrap();
    let other_dir = BoardDir::create(&root, "test-other-user-worker0").unwrap();
    let other = Board::create(&grad_path(other_dir.path()), other_dir.token(), n, 1).unwrap();
    // SAFETY: geteuid(2) cannot fail.
    let as_root = unsafe { libc::geteuid() } == 0;
    if as_root {
        std::os::unix::fs::chown(other.path(), Some(65534), Some(65534)).unwrap();
        let r = c
            .register(reg(other.path(), other_dir.token()))
            .await
            .unwrap();
        assert!(!r.into_inner().grad_shm, "another user's board");
    }
    // the shard goes on: rank 0 pushes through gRPC, the step is applied
    let (g0, g1) = grads(n, 0);
    c.register(RegisterRequest {
        grad_file: String::new(),
        ..reg(Path::new(""), 0)
    })
    .await
    .unwrap();
    push(&mut c, header(0, 0, n, false), &g0).await.unwrap();
    let r = push(&mut c, header(1, 0, n, false), &g1).await.unwrap();
    assert!(r.counted && r.ranks_in == 2, "{r:?}");
    assert_eq!(pull(&mut c, 1).await.unwrap().0, 1, "version 1 applied");
    assert!(
        cluster.servers[0].child.try_wait().unwrap().is_none(),
        "the shard lives"
    );
    let log = std::fs::read_to_string(cluster.servers[0].log.as_ref().unwrap()).unwrap();
    assert!(
        log.contains("expected a board directory ps-<name>-pid<pid>-<token> directly under"),
        "{log}"
    );
    if as_root {
        assert!(log.contains("of uid 65534"), "{log}");
    }
}
