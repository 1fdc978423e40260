//! Rank leases on a live shard (in this process, `ps_tests::inproc`; `ps_server::lease`): a process that never registered,
//! or that forges a lease, is refused on every transport (gRPC pushes and pulls, the data
//! connection's hello, a shared-memory push naming another rank's board), and the honest
//! ranks' step is applied with their own gradients only.
#![allow(clippy::too_many_lines)] // a scenario test reads top to bottom in one function

use ps_config::Transport;
use ps_net::auth::ClientSecurity;
use ps_net::client::{ShardClient, push_chunks, with_lease};
use ps_net::datalink::{HELLO_NO, HELLO_OK, Hello};
use ps_net::shm::{Board, BoardDir, grad_path, shm_root};
use ps_net::wire::f32_to_bytes;
use ps_proto::PROTOCOL_VERSION;
use ps_proto::pb::{Lease, PushHeader, RegisterRequest};
use ps_tests::{Spec, push_header};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

/// The answer byte to `hello` on the data port (None: closed without one).
async fn hello(addr: &str, hello: &Hello) -> Option<u8> {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&hello.encode()).await.unwrap();
    let mut b = [0u8; 1];
    match tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await {
        Ok(Ok(1)) => Some(b[0]),
        _ => None,
    }
}

fn hello_of(rank: u32, lease: Option<&Lease>) -> Hello {
    Hello {
        rank,
        token: Vec::new(),
        run_id: String::new(),
        generation: lease.map_or(0, |l| l.generation),
        lease: lease.map(|l| l.id.to_vec()).unwrap_or_default(),
    }
}

/// A forged copy of `lease`: the same rank and generation, another id.
fn forged(lease: &Lease) -> Lease {
    let mut id = lease.id.to_vec();
    id[0] ^= 0x5a;
    Lease {
        id: id.into(),
        ..lease.clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_rank_lease_holder_acts_for_it_on_every_transport() {
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
    let shards = ps_tests::inproc::Shards::start(&path);
    let sec = ClientSecurity::default();
    let addr = shards.addrs[0].clone();
    let connect = || ShardClient::connect(0, &addr, &sec, Duration::from_secs(10));
    // rank 0 pushes through its shared-memory gradient board, rank 1 on its data connection
    let root = shm_root().expect("/dev/shm on the test machine");
    let board_dir = BoardDir::create(&root, "test-lease-worker0").unwrap();
    let mut board = Board::create(&grad_path(board_dir.path()), board_dir.token(), n, 1).unwrap();
    let reg = |rank: u32| RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        rank,
        world_size: 2,
        num_params: n as u64,
        shard: 0,
        num_shards: 1,
        shared_memory: false,
        grad_file: if rank == 0 {
            board.path().display().to_string()
        } else {
            String::new()
        },
        grad_token: board_dir.token(),
        model: Vec::new(),
    };
    let mut c0 = connect().await.unwrap();
    let r0 = c0.register(reg(0)).await.unwrap();
    assert!(r0.grad_shm, "the shard reads rank 0's board: {r0:?}");
    let mut c1 = connect().await.unwrap();
    let r1 = c1.register(reg(1)).await.unwrap();
    let (l0, l1) = (r0.lease.clone().unwrap(), r1.lease.clone().unwrap());
    assert_eq!((l0.rank, l1.rank, l0.id.len()), (0, 1, 16));
    assert_ne!(l0.id, l1.id);
    let mut before = vec![0f32; n];
    c1.pull_into(0, false, None, &mut before).await.unwrap();

    // an intruder: a process that never registered
    let mut intruder = connect().await.unwrap();
    let rpc = intruder.rpc();
    let bomb = vec![1e30f32; n];
    let push_as = |h: PushHeader, lease: Option<Lease>| {
        with_lease(push_chunks(h, &f32_to_bytes(&bomb), 4096), lease)
    };
    // gRPC: 1e30 as rank 1 without a lease, with a forged one, with rank 0's
    for _ in 0..3 {
        let e = rpc
            .push(tokio_stream::iter(push_as(push_header(1, 0, n), None)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("presents no lease"), "{e:?}");
    }
    let e = rpc
        .push(tokio_stream::iter(push_as(
            push_header(1, 0, n),
            Some(forged(&l1)),
        )))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("is not rank 1's lease"), "{e:?}");
    let e = rpc
        .push(tokio_stream::iter(push_as(
            push_header(1, 0, n),
            Some(forged(&l0)),
        )))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // shared memory: a push saying rank 0's gradient is in its board, by the intruder
    board.slot_mut(0).copy_from_slice(&bomb[..n]);
    let shm_push = PushHeader {
        shm: true,
        ..push_header(0, 0, n)
    };
    for lease in [None, Some(forged(&l0))] {
        let e = rpc
            .push(tokio_stream::iter(with_lease(
                push_chunks(shm_push, &Default::default(), 4096),
                lease,
            )))
            .await
            .unwrap_err();
        assert!(
            matches!(e.code(), Code::FailedPrecondition | Code::PermissionDenied),
            "{e:?}"
        );
    }
    // pulls: none without a lease, none with a forged one
    for lease in [None, Some(forged(&l1))] {
        let e = rpc
            .pull(ps_tests::pull_request(0, lease))
            .await
            .unwrap_err();
        assert!(
            matches!(e.code(), Code::FailedPrecondition | Code::PermissionDenied),
            "{e:?}"
        );
    }
    // the data connection: a second hello for rank 1 (a takeover) without its lease, or with
    // a forged one, is refused; rank 1's own connection stays its
    let data_addr = format!("{}:{}", addr.rsplit_once(':').unwrap().0, r1.data_port);
    assert!(r1.data_port > 0);
    assert_eq!(hello(&data_addr, &hello_of(1, None)).await, Some(HELLO_NO));
    assert_eq!(
        hello(&data_addr, &hello_of(1, Some(&forged(&l1)))).await,
        Some(HELLO_NO)
    );
    assert_eq!(
        hello(&data_addr, &hello_of(1, Some(&l0))).await,
        Some(HELLO_NO),
        "rank 0's lease does not open rank 1's connection"
    );

    // the honest step: rank 0 through its board, rank 1 on its data connection
    let g0: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let g1: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.02).collect();
    board.slot_mut(0).copy_from_slice(&g0);
    let r = c0.push(shm_push, &Default::default(), 4096).await.unwrap();
    assert_eq!((r.counted, r.ranks_in), (true, 1), "{r:?}");
    assert!(c1.has_data_link());
    let r = c1
        .push(push_header(1, 0, n), &f32_to_bytes(&g1), 4096)
        .await
        .unwrap();
    assert_eq!((r.counted, r.ranks_in), (true, 2), "{r:?}");
    // once the legitimate data connection is open, a takeover hello is still refused
    assert_eq!(hello(&data_addr, &hello_of(1, None)).await, Some(HELLO_NO));
    let mut after = vec![0f32; n];
    c1.pull_into(1, false, None, &mut after).await.unwrap();
    for i in 0..n {
        let want = before[i] - 0.5 * (0.5 * g0[i] + 0.5 * g1[i]);
        assert!(
            (after[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "param {i}: {} vs {want}: an intruder's gradient was applied",
            after[i]
        );
    }
    // and a good hello with rank 1's lease is accepted (its holder may reconnect)
    assert_eq!(
        hello(&data_addr, &hello_of(1, Some(&l1))).await,
        Some(HELLO_OK)
    );
    drop(shards);
}

/// A rank registered again gets a new lease; the old one is refused from then on, and the
/// data connection opened with it carries no more frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_registration_of_a_rank_retires_its_old_lease() {
    let spec = Spec {
        shards: 1,
        workers: 1,
        hidden: vec![4],
        steps: 2,
        config: Spec::base().sgd(0.5, 0.0),
        transport: Transport::Grpc,
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let n = cfg.layout().num_params();
    let shards = ps_tests::inproc::Shards::start(&path);
    let sec = ClientSecurity::default();
    let mut c = ShardClient::connect(0, &shards.addrs[0], &sec, Duration::from_secs(10))
        .await
        .unwrap();
    let first = c
        .register(ps_tests::register_request(0, 1, n))
        .await
        .unwrap()
        .lease
        .unwrap();
    let second = c
        .register(ps_tests::register_request(0, 1, n))
        .await
        .unwrap()
        .lease
        .unwrap();
    assert_ne!(first.id, second.id);
    let g = vec![0.01f32; n];
    let e = c
        .rpc()
        .push(tokio_stream::iter(with_lease(
            push_chunks(push_header(0, 0, n), &f32_to_bytes(&g), 4096),
            Some(first),
        )))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // the client presents its latest lease (and opened its data connection with it)
    let r = c
        .push(push_header(0, 0, n), &f32_to_bytes(&g), 4096)
        .await
        .unwrap();
    assert!(r.counted, "{r:?}");
    drop(shards);
}
