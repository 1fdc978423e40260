//! A live shard (in this process, `ps_tests::inproc`) refuses every bad request with the expected status and a message
//! that says what was expected, leaves its state untouched, and still completes a correct step.
#![allow(clippy::too_many_lines)] // a scenario test reads top to bottom in one function

use ps_net::auth::ClientSecurity;
use ps_net::client::{ClientError, ShardClient};
use ps_net::wire::{TensorReceiver, f32_to_bytes};
use ps_proto::PROTOCOL_VERSION;
use ps_proto::pb::{PullRequest, PushHeader, PushReply, RegisterRequest};
use ps_tests::inproc::Shards;
use ps_tests::{Prepared, Spec, register_request};
use std::time::Duration;
use tonic::Code;

type Client = ShardClient;

use ps_tests::push_header as header;

/// Pushes `values` under header `h` whatever they are (the header's length is not checked
/// against them: the shard must refuse the mismatches), in 4 KiB chunks, once.
async fn push(c: &mut Client, h: PushHeader, values: &[f32]) -> Result<PushReply, ClientError> {
    c.push(h, &f32_to_bytes(values), 4096).await
}

/// Pulls through the raw stream, checking every chunk with a `TensorReceiver`.
async fn pull(c: &mut Client, version: u64) -> Result<Vec<f32>, tonic::Status> {
    let lease = c.lease(0);
    let mut s = c
        .rpc()
        .pull(ps_tests::pull_request(version, lease))
        .await?
        .into_inner();
    let first = s.message().await?.expect("a chunk");
    let h = first.header.expect("header");
    assert_eq!(h.version, version);
    let mut rx = TensorReceiver::new(h.len as usize, false);
    rx.push(first.offset, &first.data).unwrap();
    while let Some(c) = s.message().await? {
        rx.push(c.offset, &c.data).unwrap();
    }
    Ok(rx.finish().unwrap().0)
}

/// A live one-shard server for W = 2 (plain SGD, lr 0.5), a client, and the parameter count;
/// keep the set-up and the shards alive while testing.
async fn one_shard() -> (Prepared, Shards, Client, usize) {
    one_shard_with(|_| Ok(())).await
}

/// [`one_shard`], the shard's setup changed by `tweak`.
async fn one_shard_with(tweak: impl ps_tests::inproc::Tweak) -> (Prepared, Shards, Client, usize) {
    let run = Spec::small().prepare();
    let n = run.cfg.layout().num_params();
    let shards = Shards::start_with(&run.path, tweak);
    let c = Client::connect(
        0,
        &shards.addrs[0],
        &ClientSecurity::default(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    (run, shards, c, n)
}

/// A refusal: a raw status or a [`ClientError::Refused`], with `code` and `words` in the
/// shard's message.
fn expect_err<T: std::fmt::Debug, E: Into<Refusal>>(r: Result<T, E>, code: Code, words: &str) {
    let Refusal(e) = r.map_err(Into::into).expect_err("expected a refusal");
    assert_eq!(e.code(), code, "{e:?}");
    assert!(
        e.message().contains(words),
        "message {:?} lacks {words:?}",
        e.message()
    );
}

/// The status of a refusal, whichever way it came.
struct Refusal(tonic::Status);

impl From<tonic::Status> for Refusal {
    fn from(s: tonic::Status) -> Self {
        Refusal(s)
    }
}

impl From<ClientError> for Refusal {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Refused { status, .. } => Refusal(status),
            other => panic!("expected a refusal from the shard, got {other}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_server_refuses_bad_pushes_and_still_steps() {
    let (_run, _shards, mut c, n) = one_shard().await;

    let reg = |rank: u32| register_request(rank, 2, n);
    expect_err(
        c.register(RegisterRequest {
            protocol_version: 99,
            ..reg(0)
        })
        .await,
        Code::FailedPrecondition,
        "protocol version 99",
    );
    // a worker of protocol version 1 (before rank leases and generations) is refused, naming
    // both versions
    expect_err(
        c.register(RegisterRequest {
            protocol_version: 1,
            ..reg(0)
        })
        .await,
        Code::FailedPrecondition,
        "protocol version 1 is not supported: this server speaks protocol version 2",
    );
    expect_err(
        c.register(reg(5)).await,
        Code::InvalidArgument,
        "unknown rank 5: expected a rank in 0..2",
    );
    expect_err(
        c.register(RegisterRequest {
            world_size: 3,
            ..reg(0)
        })
        .await,
        Code::FailedPrecondition,
        "world size mismatch",
    );
    expect_err(
        c.register(RegisterRequest {
            num_params: 5,
            ..reg(0)
        })
        .await,
        Code::FailedPrecondition,
        "parameter count",
    );
    let g0: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let g1: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.02).collect();
    expect_err(
        push(&mut c, header(0, 0, n), &g0).await,
        Code::FailedPrecondition,
        "presents no lease",
    );

    let r = c.register(reg(0)).await.unwrap();
    assert_eq!(
        (r.start, r.len, r.version, r.total_steps),
        (0, n as u64, 0, 2)
    );
    c.register(reg(1)).await.unwrap();
    let before = pull(&mut c, 0).await.unwrap();

    expect_err(
        push(&mut c, header(0, 0, 10), &g0[..10]).await,
        Code::InvalidArgument,
        &format!("expected {n} f32 values, got 10"),
    );
    expect_err(
        push(&mut c, header(0, 0, n), &g0[..n - 1]).await,
        Code::InvalidArgument,
        &format!("expected {n} f32 values, got {}", n - 1),
    );
    let mut nan = g0.clone();
    nan[17] = f32::NAN;
    expect_err(
        push(&mut c, header(0, 0, n), &nan).await,
        Code::InvalidArgument,
        "non-finite value NaN at index 17",
    );
    let mut inf = g0.clone();
    inf[n - 1] = f32::INFINITY;
    expect_err(
        push(&mut c, header(0, 0, n), &inf).await,
        Code::InvalidArgument,
        "non-finite value inf",
    );
    expect_err(
        push(&mut c, header(0, 3, n), &g0).await,
        Code::FailedPrecondition,
        "future step 3: this shard expects step 0",
    );
    expect_err(
        push(&mut c, header(7, 0, n), &g0).await,
        Code::InvalidArgument,
        "unknown rank 7",
    );
    expect_err(
        pull(&mut c, 9).await,
        Code::OutOfRange,
        "the run ends at version 2",
    );
    let bad_meta = PushHeader {
        correct: 100,
        ..header(0, 0, n)
    };
    expect_err(
        push(&mut c, bad_meta, &g0).await,
        Code::InvalidArgument,
        "correct <= samples",
    );

    // none of that changed anything: a correct step still works
    let r = push(&mut c, header(0, 0, n), &g0).await.unwrap();
    assert_eq!((r.counted, r.ranks_in), (true, 1));
    let r = push(&mut c, header(0, 0, n), &g0).await.unwrap();
    assert_eq!(
        (r.counted, r.ranks_in),
        (false, 1),
        "a retry is acknowledged, not counted twice"
    );
    expect_err(
        push(&mut c, header(0, 0, n), &g1).await,
        Code::AlreadyExists,
        "rank 0 already pushed a different gradient for step 0",
    );
    let r = push(&mut c, header(1, 0, n), &g1).await.unwrap();
    assert_eq!((r.counted, r.ranks_in), (true, 2));

    let after = pull(&mut c, 1).await.unwrap();
    for i in 0..n {
        // mean aggregation of two ranks, then plain SGD with lr 0.5
        let want = before[i] - 0.5 * (0.5 * g0[i] + 0.5 * g1[i]);
        assert!(
            (after[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "param {i}: {} vs {want}",
            after[i]
        );
    }
    expect_err(
        push(&mut c, header(0, 0, n), &g1).await,
        Code::FailedPrecondition,
        "stale step 0: this shard already applied it and expects step 1",
    );
    let r = push(&mut c, header(0, 0, n), &g0).await.unwrap();
    assert!(
        !r.counted,
        "a late retry of a counted gradient is acknowledged"
    );
    assert_eq!(
        pull(&mut c, 1).await.unwrap(),
        after,
        "refusals and retries left the weights alone"
    );
}

/// The shared-memory path against a live `ps-server`, with this test as the worker: it makes
/// its gradient board, registers it, writes its gradient there and pushes the header alone; the
/// shard checks the values in place exactly as a gRPC push (NaN, stray data chunks, boards it
/// does not have and boards with the wrong token are refused), and a pull answered through the
/// shard's parameters board gives the same numbers as one through gRPC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_pushes_are_validated_like_grpc_ones() {
    use ps_net::shm::{Board, BoardDir, grad_path, params_path, shm_root};
    use std::path::Path;
    let (_run, _shards, mut c, n) = one_shard().await;
    let root = shm_root().expect("/dev/shm on the test machine");
    let board_dir = BoardDir::create(&root, "test-worker0").unwrap();
    let mut grad = Board::create(&grad_path(board_dir.path()), board_dir.token(), n, 1).unwrap();
    let reg = |rank: u32, token: u64| RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        rank,
        world_size: 2,
        num_params: n as u64,
        shard: 0,
        num_shards: 1,
        shared_memory: token != 0,
        grad_file: grad.path().display().to_string(),
        grad_token: token,
        model: Vec::new(),
    };
    let r = c.register(reg(0, board_dir.token() ^ 4)).await.unwrap();
    assert!(
        !r.grad_shm,
        "a board with another token (another host's) is not used"
    );
    let r0 = c.register(reg(0, board_dir.token())).await.unwrap();
    assert!(r0.grad_shm && !r0.shm_dir.is_empty(), "{r0:?}");
    let r1 = c
        .register(RegisterRequest {
            grad_file: String::new(),
            ..reg(1, 0)
        })
        .await
        .unwrap();
    assert!(
        r1.shm_dir.is_empty() && !r1.grad_shm,
        "not offered when not asked for"
    );
    let params = Board::open(&params_path(Path::new(&r0.shm_dir)), r0.shm_token, n, 2).unwrap();
    let shm_header = |rank: u32| PushHeader {
        shm: true,
        ..header(rank, 0, n)
    };
    let before = pull(&mut c, 0).await.unwrap();
    let mut board_copy = vec![0f32; n];
    assert!(params.read_version(0, &mut board_copy));
    assert_eq!(
        board_copy, before,
        "version 0 in the board and through gRPC"
    );

    let g0: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let g1: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.02).collect();
    grad.slot_mut(0).copy_from_slice(&g0);
    grad.slot_mut(0)[5] = f32::NAN;
    expect_err(
        push(&mut c, shm_header(0), &[]).await,
        Code::InvalidArgument,
        "non-finite value NaN at index 5",
    );
    grad.slot_mut(0).copy_from_slice(&g0);
    expect_err(
        push(&mut c, shm_header(0), &g0).await,
        Code::InvalidArgument,
        "expected the header alone",
    );
    expect_err(
        push(&mut c, shm_header(1), &[]).await,
        Code::InvalidArgument,
        "rank 1 pushed through shared memory but shard 0 has no gradient board of it",
    );
    let r = push(&mut c, shm_header(0), &[]).await.unwrap();
    assert_eq!((r.counted, r.ranks_in), (true, 1));
    let r = push(&mut c, shm_header(0), &[]).await.unwrap();
    assert_eq!(
        (r.counted, r.ranks_in),
        (false, 1),
        "a retry is acknowledged"
    );
    let r = push(&mut c, header(1, 0, n), &g1).await.unwrap();
    assert_eq!((r.counted, r.ranks_in), (true, 2));

    let lease = c.lease(0);
    let mut s = c
        .rpc()
        .pull(PullRequest {
            min_version: 1,
            shm: true,
            exact: false,
            lease,
        })
        .await
        .unwrap()
        .into_inner();
    let h = s.message().await.unwrap().unwrap().header.unwrap();
    assert!(h.shm && h.version == 1 && h.len == n as u64, "{h:?}");
    assert!(
        s.message().await.unwrap().is_none(),
        "no data chunks follow"
    );
    assert!(params.read_version(1, &mut board_copy));
    let after = pull(&mut c, 1).await.unwrap();
    assert_eq!(
        board_copy, after,
        "the board and gRPC serve the same version 1"
    );
    for i in 0..n {
        let want = before[i] - 0.5 * (0.5 * g0[i] + 0.5 * g1[i]);
        assert!(
            (after[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "param {i}: {} vs {want}",
            after[i]
        );
    }
    assert!(
        !params.read_version(2, &mut board_copy),
        "version 2 does not exist yet"
    );
}

/// `GET path` on `addr`; the status line and the body.
async fn http_get(addr: &str, path: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    sock.read_to_string(&mut text).await.unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// The value of the sample `name{shard="0"<labels>}` in a Prometheus text exposition.
fn sample(body: &str, name_and_labels: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {name_and_labels} in:\n{body}"))
}

/// The shard's Prometheus endpoint: version, last step's loss and accuracy, accepted and
/// refused pushes by code, as a live shard applies a step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_metrics_follow_the_shard() {
    let (_run, shards, mut c, n) = one_shard_with(|s| {
        s.metrics_listen = Some("127.0.0.1:0".into());
        Ok(())
    })
    .await;
    let addr = shards.nodes[0]
        .log
        .addr_after("Prometheus metrics on http://", Duration::from_secs(20));
    let (status, body) = http_get(&addr, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(sample(&body, "ps_version{shard=\"0\"}"), 0.0);
    assert_eq!(sample(&body, "ps_total_steps{shard=\"0\"}"), 2.0);
    assert!(!body.contains("ps_loss"), "no step yet:\n{body}");
    assert_eq!(http_get(&addr, "/").await.0, "HTTP/1.1 404 Not Found");

    for rank in 0..2 {
        c.register(RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            rank,
            world_size: 2,
            num_params: n as u64,
            shard: 0,
            num_shards: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let g = vec![0.01f32; n];
    let mut nan = g.clone();
    nan[3] = f32::NAN;
    expect_err(
        push(&mut c, header(0, 0, n), &nan).await,
        Code::InvalidArgument,
        "non-finite",
    );
    expect_err(
        push(&mut c, header(0, 4, n), &g).await,
        Code::FailedPrecondition,
        "future step",
    );
    push(&mut c, header(0, 0, n), &g).await.unwrap();
    push(&mut c, header(1, 0, n), &g).await.unwrap();
    pull(&mut c, 1).await.unwrap();
    let (_, body) = http_get(&addr, "/metrics").await;
    assert_eq!(sample(&body, "ps_version{shard=\"0\"}"), 1.0);
    // each push says 8 samples, loss sum 10 and 3 correct (see `header`)
    assert_eq!(sample(&body, "ps_loss{shard=\"0\"}"), 20.0 / 16.0);
    assert_eq!(sample(&body, "ps_train_accuracy{shard=\"0\"}"), 6.0 / 16.0);
    assert_eq!(sample(&body, "ps_samples_total{shard=\"0\"}"), 16.0);
    assert_eq!(sample(&body, "ps_workers_in{shard=\"0\"}"), 2.0);
    assert_eq!(
        sample(&body, "ps_pushes_total{shard=\"0\",outcome=\"accepted\"}"),
        2.0
    );
    for code in ["InvalidArgument", "FailedPrecondition"] {
        let key = format!("ps_pushes_total{{shard=\"0\",outcome=\"refused\",code=\"{code}\"}}");
        assert_eq!(sample(&body, &key), 1.0, "{body}");
    }
}

/// Evaluation figures are checked against the rank's slice of the test set (10,000 MNIST test
/// images, 2 ranks: 5,000 each): a `Leave` must cover exactly the slice (or nothing: a worker
/// that does not evaluate), a push at most it; a forged `Leave` cannot overflow the final sum;
/// the shard still takes correct ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluation_figures_are_checked_against_the_rank_slice_of_the_test_set() {
    use ps_proto::pb::LeaveRequest;
    let (_run, _shards, mut c, n) = one_shard().await;
    let reg = |rank: u32| register_request(rank, 2, n);
    c.register(reg(0)).await.unwrap();
    c.register(reg(1)).await.unwrap();
    let leases = [c.lease(0), c.lease(1)];
    let leave = |rank: u32, correct: u64, count: u64| LeaveRequest {
        rank,
        eval_correct: correct,
        eval_count: count,
        failed: String::new(),
        evaluating: false,
        lease: leases.get(rank as usize).cloned().flatten(),
    };
    for (correct, count) in [(2, 4), (u64::MAX - 1, u64::MAX), (0, 5001)] {
        expect_err(
            c.rpc().leave(leave(0, correct, count)).await,
            Code::InvalidArgument,
            &format!(
                "eval_count {count} from rank 0: expected 0 (no evaluation) or exactly 5000, the length of rank 0's slice of the test set"
            ),
        );
    }
    expect_err(
        c.rpc().leave(leave(7, 1, 5000)).await,
        Code::InvalidArgument,
        "unknown rank 7",
    );
    let h = PushHeader {
        eval_correct: 3,
        eval_count: 5001,
        ..header(1, 0, n)
    };
    expect_err(
        push(&mut c, h, &vec![0.01; n]).await,
        Code::InvalidArgument,
        "eval_count 5001 from rank 1: expected at most 5000",
    );
    // a correct step, with an evaluation of the slice, and correct leaves
    for rank in 0..2 {
        let h = PushHeader {
            eval_correct: 4000,
            eval_count: 5000,
            ..header(rank, 0, n)
        };
        push(&mut c, h, &vec![0.01; n]).await.unwrap();
    }
    c.rpc().leave(leave(0, 4500, 5000)).await.unwrap();
    // a worker that evaluates nothing (a Python worker of the user's own model) leaves with 0
    c.rpc().leave(leave(1, 0, 0)).await.unwrap();
}
