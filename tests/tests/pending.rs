//! Bounded pending gRPC gradients (`[server] max_pending_gradients`) on live shards (in this process, `ps_tests::inproc`): the
//! weights are bit-identical whatever the limit and the arrival order, pushes that wait for
//! their turn neither deadlock nor count as missing for the barrier timeout, and retries and
//! conflicts are still recognised while other pushes wait.

use ps_config::{Aggregation, Transport};
use ps_net::client::{push_chunks, with_lease};
use ps_net::wire::{TensorReceiver, f32_to_bytes};
use ps_proto::pb::parameter_server_client::ParameterServerClient;
use ps_proto::pb::{Lease, PushChunk, PushHeader, PushReply};
use ps_tests::{
    Spec, assert_bit_identical, cluster_weights, reference_weights, register_request, rel_diff,
};
use std::time::Duration;
use tonic::Code;
use tonic::transport::Channel;

type Client = ParameterServerClient<Channel>;

const W: usize = 4;

fn header(rank: u32, step: u64, len: usize) -> PushHeader {
    PushHeader {
        rank,
        step,
        samples: 5 + rank,
        loss_sum: 10.0,
        correct: 3,
        len: len as u64,
        eval_correct: 0,
        eval_count: 0,
        shm: false,
    }
}

fn grad(n: usize, rank: u32, step: u64) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 31 + rank as usize * 7 + step as usize) % 97) as f32 - 48.0) * 1e-3 / 3.0)
        .collect()
}

async fn push(
    c: &mut Client,
    lease: &Option<Lease>,
    h: PushHeader,
    values: &[f32],
) -> Result<PushReply, tonic::Status> {
    let msgs = with_lease(
        push_chunks(h, &f32_to_bytes(values), 16 << 10),
        lease.clone(),
    );
    c.push(tokio_stream::iter(msgs))
        .await
        .map(|r| r.into_inner())
}

/// A push whose header goes out at once and whose data follows after `pause`.
async fn slow_push(
    c: &mut Client,
    lease: &Option<Lease>,
    h: PushHeader,
    values: &[f32],
    pause: Duration,
) -> Result<PushReply, tonic::Status> {
    let mut msgs = with_lease(
        push_chunks(h, &f32_to_bytes(values), 16 << 10),
        lease.clone(),
    );
    let rest: Vec<PushChunk> = msgs.split_off(1);
    let head = tokio_stream::iter(msgs);
    let tail = futures::StreamExt::then(tokio_stream::iter(rest), move |c| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        c
    });
    let tail = futures::StreamExt::skip_while(
        futures::StreamExt::chain(
            futures::stream::once(async move {
                tokio::time::sleep(pause).await;
                None
            }),
            futures::StreamExt::map(tail, Some),
        ),
        |c: &Option<PushChunk>| futures::future::ready(c.is_none()),
    );
    let all = futures::StreamExt::chain(head, futures::StreamExt::map(tail, |c| c.unwrap()));
    c.push(all).await.map(|r| r.into_inner())
}

async fn pull(c: &mut Client, lease: &Option<Lease>, version: u64) -> (u64, Vec<f32>) {
    let mut s = c
        .pull(ps_tests::pull_request(version, lease.clone()))
        .await
        .unwrap()
        .into_inner();
    let first = s.message().await.unwrap().expect("a chunk");
    let h = first.header.expect("header");
    let mut rx = TensorReceiver::new(h.len as usize, false);
    rx.push(first.offset, &first.data).unwrap();
    while let Some(c) = s.message().await.unwrap() {
        rx.push(c.offset, &c.data).unwrap();
    }
    (h.version, rx.finish().unwrap().0)
}

/// How a run of [`two_steps`] pushes.
#[derive(Clone, Copy, PartialEq)]
enum Pushes {
    /// The last rank of the order sends its data 3.5 s after its header, and during step 1,
    /// while the others wait for their turn, a retry and a conflict of step 0 are pushed.
    Slow,
    /// Every push whole at once: the reference weights.
    Whole,
}

/// Runs two steps on a live one-shard server of W = 4 with `limit` pending gradients,
/// pushing in `order` (each push starting 150 ms after the previous one, and with
/// [`Pushes::Slow`] the last rank of the order sending its data 3.5 s after its header);
/// returns the weights of versions 0, 1 and 2 and the shard's log.
///
/// The barrier timeout (2.5 s) must be shorter than that pause, to show that pushes waiting
/// for their turn do not count as missing, and longer than the time from a step's start to
/// the last header: for step 0 that is from the first registration (the barrier's clock
/// restarts there), through the four registrations and the first pull, to the last push's
/// header. Once every header is in, no rank is missing and the timeout cannot fire whatever
/// the load. Step 0's clock used to run from the shard's start, so the shard's own start-up
/// counted too, and under load (two suites at once, load 10-25) the shard failed at step 0.
async fn two_steps(
    limit: usize,
    order: [u32; W],
    aggregation: Aggregation,
    pushes: Pushes,
) -> (Vec<Vec<f32>>, String) {
    let spec = Spec {
        shards: 1,
        workers: W,
        hidden: vec![64],
        steps: 3,
        aggregation,
        transport: Transport::Grpc,
        config: Spec::base()
            .sgd(0.5, 0.9)
            .max_pending_gradients(limit)
            .barrier_warn_secs(0.3)
            .barrier_timeout_secs(2.5),
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let n = cfg.layout().num_params();
    let shards = ps_tests::inproc::Shards::start(&path);
    let url = shards.url(0);
    let (mut clients, mut leases) = (Vec::new(), Vec::new());
    for rank in 0..W as u32 {
        let mut c = Client::connect(url.clone()).await.unwrap();
        let r = c
            .register(register_request(rank, W as u32, n))
            .await
            .unwrap();
        leases.push(r.into_inner().lease);
        clients.push(c);
    }
    let mut versions = vec![pull(&mut clients[0], &leases[0], 0).await.1];
    for step in 0..2u64 {
        let mut tasks = Vec::new();
        for (i, &rank) in order.iter().enumerate() {
            let mut c = clients[rank as usize].clone();
            let g = grad(n, rank, step);
            let lease = leases[rank as usize].clone();
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(150 * i as u64)).await;
                let h = header(rank, step, n);
                if i == W - 1 && pushes == Pushes::Slow {
                    slow_push(&mut c, &lease, h, &g, Duration::from_millis(3500)).await
                } else {
                    push(&mut c, &lease, h, &g).await
                }
            }));
        }
        if step == 1 && pushes == Pushes::Slow {
            // while the others wait for their turn (the shard says so: every header of step 1
            // is in, the last rank's data not): a retry of step 0 is acknowledged, not
            // counted, and a different gradient for step 0 is refused
            every_header_in(&shards, 1).await;
            let mut c = clients[2].clone();
            let r = push(&mut c, &leases[2], header(2, 0, n), &grad(n, 2, 0))
                .await
                .unwrap();
            assert!(!r.counted, "a retry of step 0 is not counted again: {r:?}");
            let e = push(&mut c, &leases[2], header(2, 0, n), &grad(n, 3, 0))
                .await
                .expect_err("a different gradient for a step applied");
            assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        }
        for t in tasks {
            let r = tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("every push is answered (no deadlock)")
                .unwrap()
                .unwrap_or_else(|e| panic!("limit {limit}, order {order:?}: {e:?}"));
            assert!(r.counted, "{r:?}");
        }
        let (v, w) = pull(&mut clients[0], &leases[0], step + 1).await;
        assert_eq!(v, step + 1);
        versions.push(w);
    }
    // a retry of step 1's rank 1 after the step: recognised
    let r = push(&mut clients[1], &leases[1], header(1, 1, n), &grad(n, 1, 1))
        .await
        .unwrap();
    assert!(!r.counted);
    (versions, shards.log(0))
}

/// Waits (at most 60 s) until shard 0 logs that every rank's push of `step` is in or under
/// way: its barrier's word, past `barrier_warn_secs`, for a step whose last rank's data has not
/// all arrived.
async fn every_header_in(shards: &ps_tests::inproc::Shards, step: u64) {
    let said = format!("shard 0 step {step}: ");
    let t0 = std::time::Instant::now();
    loop {
        let log = shards.log(0);
        if log.lines().any(|l| {
            l.contains(&said)
                && (l.contains("every rank's push is in or under way")
                    || l.contains("whose gradient has started to arrive"))
        }) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "shard 0 never said every push of step {step} is in or under way:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Limit 1 in reverse rank order, rank 0 last and slow, against the reference (every
/// gradient at once, in rank order): the same bits, and the log's account of the wait.
async fn reverse_order_equals_all_at_once(aggregation: Aggregation) {
    let (reverse, log) = two_steps(1, [3, 2, 1, 0], aggregation, Pushes::Slow).await;
    let (forward, _) = two_steps(W, [0, 1, 2, 3], aggregation, Pushes::Whole).await;
    assert!(
        reverse[0].iter().zip(&reverse[2]).any(|(a, b)| a != b),
        "the steps moved the weights"
    );
    for v in 1..3 {
        assert_bit_identical(
            &reverse[v],
            &forward[v],
            &format!("{aggregation}: version {v}"),
        );
    }
    // waiting for their turn did not make ranks "missing" (the barrier timeout is 2.5 s,
    // rank 0, pushed last, sent its data 3.5 s after its header while ranks 3, 2 and 1
    // waited), and the log said who was awaited
    assert!(!log.contains("run failed"), "{log}");
    assert!(
        (log.contains("for rank 0, whose gradient has started to arrive but not finished")
            || log.contains("receiving rank 0's gradient"))
            && log.contains("ranks [1, 2, 3] queued"),
        "the log names the awaited and the queued ranks:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reverse_rank_order_with_one_pending_gradient_equals_all_at_once_weighted() {
    reverse_order_equals_all_at_once(Aggregation::Weighted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reverse_rank_order_with_one_pending_gradient_equals_all_at_once_mean() {
    reverse_order_equals_all_at_once(Aggregation::Mean).await;
}

/// W = 16 through gRPC with 2 pending gradients gives the weights of 16 (every gradient at
/// once), bit for bit, and equals the single process.
#[test]
fn sixteen_workers_with_two_pending_gradients_equal_sixteen() {
    let run = |limit: usize| {
        let spec = Spec {
            shards: 2,
            workers: 16,
            hidden: vec![16],
            global_batch: 60,
            steps: 8,
            aggregation: Aggregation::Weighted,
            transport: Transport::Grpc,
            config: Spec::base().max_pending_gradients(limit),
            ..Spec::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let (path, cfg) = spec.write(dir.path());
        ps_tests::inproc::run_in_process(&path);
        let w = cluster_weights(&cfg);
        let d = rel_diff(&cfg, &w, &reference_weights(&cfg));
        assert!(
            d < 1e-5,
            "limit {limit}: relative difference {d:.3e} from one process"
        );
        w
    };
    let two = run(2);
    let sixteen = run(16);
    assert_bit_identical(&two, &sixteen, "max_pending_gradients 2 vs 16");
}
