//! The tensor data connection of a live shard (in this process, `ps_tests::inproc`; as a
//! `ps-server` process where its exit or its port flags are the subject) (`ps_net::datalink`): hellos with a
//! wrong run id, an unknown rank or garbage are refused; a push that names another rank's
//! connection, or whose frame is cut short or of the wrong length, is refused with a precise
//! status; and afterwards pushes and pulls on new connections still make a correct step.
#![allow(clippy::too_many_lines)] // a scenario test reads top to bottom in one function

use ps_launch::bin_dir;
use ps_net::auth::ClientSecurity;
use ps_net::client::{DATA_RANK_KEY, ShardClient};
use ps_net::datalink::{HELLO_NO, HELLO_OK, Hello, PIECES, frame_header, piece_header};
use ps_net::wire::{as_le_bytes, f32_to_bytes};
use ps_proto::pb::{PushChunk, PushHeader};
use ps_tests::{Spec, register_request};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

use ps_tests::push_header as header;

/// Opens a data connection with `hello` and returns the shard's answer byte (None: closed).
async fn hello(addr: &str, hello: &[u8]) -> (tokio::net::TcpStream, Option<u8>) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(hello).await.unwrap();
    let mut b = [0u8; 1];
    let answer = match tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await {
        Ok(Ok(1)) => Some(b[0]),
        _ => None,
    };
    (s, answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_connections_refuse_bad_hellos_and_frames_and_still_step() {
    let spec = Spec {
        shards: 1,
        workers: 2,
        hidden: vec![4],
        steps: 2,
        config: Spec::base().sgd(0.5, 0.0),
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
    let reg = |rank: u32| register_request(rank, 2, n);
    let r0 = c.register(reg(0)).await.unwrap();
    assert!(
        r0.data_port > 0,
        "a shard without TLS offers data connections"
    );
    assert!(c.has_data_link());
    let mut c1 = ShardClient::connect(0, &shards.addrs[0], &sec, Duration::from_secs(10))
        .await
        .unwrap();
    c1.register(reg(1)).await.unwrap();
    let before = {
        let mut w = vec![0f32; n];
        c.pull_into(0, false, None, &mut w).await.unwrap();
        w
    };
    let host = shards.addrs[0].rsplit_once(':').unwrap().0.to_string();
    let data_addr = format!("{host}:{}", r0.data_port);

    // hellos: garbage, a wrong run id, an unknown rank are refused; a good one is accepted
    let (_, a) = hello(&data_addr, b"GET / HTTP/1.1\r\n\r\n").await;
    assert_eq!(a, None, "garbage: closed without an answer");
    let leases = [c.lease(0), c1.lease(1)];
    let h = |rank: u32, run: &str| {
        let lease = leases.get(rank as usize).cloned().flatten();
        Hello {
            rank,
            token: Vec::new(),
            run_id: run.into(),
            generation: lease.as_ref().map_or(0, |l| l.generation),
            lease: lease.map(|l| l.id.to_vec()).unwrap_or_default(),
        }
        .encode()
    };
    assert_eq!(
        hello(&data_addr, &h(0, "other-run")).await.1,
        Some(HELLO_NO)
    );
    assert_eq!(hello(&data_addr, &h(7, "")).await.1, Some(HELLO_NO));
    // raw pushes of rank 1 (whose client has not opened its connection yet)
    let raw_push = |rank_meta: u32, h: PushHeader| {
        let mut req = tonic::Request::new(tokio_stream::iter(vec![PushChunk {
            header: Some(h),
            offset: 0,
            data: bytes::Bytes::new(),
            lease: leases[h.rank as usize].clone(),
        }]));
        req.metadata_mut()
            .insert(DATA_RANK_KEY, rank_meta.to_string().parse().unwrap());
        req
    };
    // another rank's connection
    let e = c
        .rpc()
        .push(raw_push(1, header(0, 0, n)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message()
            .contains("a push of rank 0 asked for the data connection of rank 1"),
        "{e:?}"
    );
    let (mut conn, a) = hello(&data_addr, &h(1, "")).await;
    assert_eq!(a, Some(HELLO_OK));

    let g0: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let g1: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.02).collect();
    // a frame cut short: the connection ends in the middle
    let mut rpc = c.rpc().clone();
    let call = {
        let req = raw_push(1, header(1, 0, n));
        tokio::spawn(async move { rpc.push(req).await })
    };
    conn.write_all(&frame_header(0, 4 * n as u64))
        .await
        .unwrap();
    conn.write_all(&as_le_bytes(&g1)[..4 * n / 2])
        .await
        .unwrap();
    drop(conn);
    let e = call.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains(&format!(
            "the connection ended after {} of {} bytes",
            4 * n / 2,
            4 * n
        )),
        "{e:?}"
    );
    // a frame of the wrong length on a new connection
    let (mut conn, a) = hello(&data_addr, &h(1, "")).await;
    assert_eq!(a, Some(HELLO_OK));
    let mut rpc = c.rpc().clone();
    let call = {
        let req = raw_push(1, header(1, 0, n));
        tokio::spawn(async move { rpc.push(req).await })
    };
    conn.write_all(&frame_header(0, 4 * (n as u64 - 1)))
        .await
        .unwrap();
    let e = call.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message()
            .contains(&format!("expected {n} f32 values, got {}", n - 1)),
        "{e:?}"
    );
    // the refused frame closed the TCP connection (both halves): the client reads its end
    let mut b = [0u8; 16];
    let end = tokio::time::timeout(Duration::from_secs(30), conn.read(&mut b)).await;
    assert!(
        matches!(end, Ok(Ok(0)) | Ok(Err(_))),
        "the connection of a refused frame is still open: {end:?}"
    );
    // a push with no connection open (the failed one was dropped) is retryable
    let e = c
        .rpc()
        .push(raw_push(1, header(1, 0, n)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("has no data connection open"), "{e:?}");

    drop(conn);
    // none of that counted: the clients (rank 1's opens a new connection) make a correct step
    assert_eq!(push_whole(&c, 0, 0, &g0).await, (true, 1));
    assert_eq!(
        push_whole(&c, 0, 0, &g0).await,
        (false, 1),
        "a retry on the data connection"
    );
    assert_eq!(push_whole(&c1, 1, 0, &g1).await, (true, 2));
    let mut after = vec![0f32; n];
    c.pull_into(1, false, None, &mut after).await.unwrap();
    for i in 0..n {
        let want = before[i] - 0.5 * (0.5 * g0[i] + 0.5 * g1[i]);
        assert!(
            (after[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "param {i}: {} vs {want}",
            after[i]
        );
    }
    // the same version through gRPC chunks is the same bits
    let mut grpc = c.clone();
    grpc.use_data_link(0, 0, None);
    let mut again = vec![0f32; n];
    grpc.pull_into(1, false, None, &mut again).await.unwrap();
    assert!(!grpc.has_data_link());
    assert_eq!(
        again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        after.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

/// Two free ports of 127.0.0.1 (bound, then released), the lower first.
fn two_free_ports() -> (u16, u16) {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (pa, pb) = (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    );
    (pa.min(pb), pa.max(pb))
}

/// A shard started on `127.0.0.1:port` with `config` (its data connections as configured);
/// its registration reply for rank 0.
async fn data_port_of(config: ps_config::TestConfig, port: u16) -> u32 {
    let spec = Spec {
        shards: 1,
        workers: 1,
        hidden: vec![4],
        steps: 2,
        config,
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let mut server = std::process::Command::new(bin_dir().join("ps-server"))
        .args([
            "--config",
            path.to_str().unwrap(),
            "--shard",
            "0",
            "--listen",
        ])
        .arg(format!("127.0.0.1:{port}"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut c = ShardClient::connect(
        0,
        &addr,
        &ClientSecurity::default(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let reply = c
        .register_retrying(
            register_request(0, 1, cfg.layout().num_params()),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    if reply.data_port > 0 {
        let data_addr = format!("127.0.0.1:{}", reply.data_port);
        let lease = reply.lease.clone().unwrap();
        let hello_ok = Hello {
            rank: 0,
            token: Vec::new(),
            run_id: String::new(),
            generation: lease.generation,
            lease: lease.id.to_vec(),
        }
        .encode();
        assert_eq!(hello(&data_addr, &hello_ok).await.1, Some(HELLO_OK));
    }
    let _ = server.kill();
    let _ = server.wait();
    reply.data_port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_port_follows_the_config() {
    // gRPC port + [server] data_port_offset, for firewalls that open known ports only
    let (grpc, data) = two_free_ports();
    let offset = u32::from(data - grpc);
    let got = data_port_of(Spec::base().data_connections(true, offset), grpc).await;
    assert_eq!(got, u32::from(data), "gRPC port {grpc} + offset {offset}");
    // off: every value through gRPC
    let (grpc, _) = two_free_ports();
    assert_eq!(
        data_port_of(Spec::base().data_connections(false, 0), grpc).await,
        0
    );
    // an offset past the last port: the shard says so and stops
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 1,
        workers: 1,
        hidden: vec![4],
        steps: 2,
        config: Spec::base().data_connections(true, 65535),
        ..Spec::default()
    };
    let (path, _) = spec.write(dir.path());
    let out = std::process::Command::new(bin_dir().join("ps-server"))
        .args([
            "--config",
            path.to_str().unwrap(),
            "--shard",
            "0",
            "--listen",
        ])
        .arg("127.0.0.1:0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("[server] data_port_offset = 65535: the gRPC port")
            && err.contains("is past 65535"),
        "{err}"
    );
}

/// Pushes all of `g` as `rank`'s gradient of `step` (gRPC or the data connection, as the
/// client has it); returns whether it was counted and how many ranks are in.
async fn push_whole(c: &ShardClient, rank: u32, step: u64, g: &[f32]) -> (bool, u32) {
    let r = c
        .push(header(rank, step, g.len()), &f32_to_bytes(g), 4096)
        .await
        .unwrap();
    (r.counted, r.ranks_in)
}

/// Two steps of a 1-shard, 2-worker cluster, both ranks pushing `g0` (rank 0) and `g1` (rank 1)
/// each step; with `pieces`, rank 1 first sends a push whose pieces overlap (refused, by name),
/// then its gradient of step 0 as raw pieces in reverse order on its data connection, and rank
/// 0 its gradient of step 1 through `push_progressive` in shuffled pieces, then again (a retry
/// checked out of order: in a buffer under a permit when `max_pending` leaves one free, else
/// refused as retryable and pushed again whole). Returns the weights of version 2.
async fn two_steps(pieces: bool, max_pending: usize) -> Vec<u32> {
    let spec = Spec {
        shards: 1,
        workers: 2,
        hidden: vec![4],
        steps: 2,
        config: Spec::base()
            .sgd(0.5, 0.0)
            .max_pending_gradients(max_pending),
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let n = cfg.layout().num_params();
    let shards = ps_tests::inproc::Shards::start(&path);
    let sec = ClientSecurity::default();
    let reg = |rank: u32| register_request(rank, 2, n);
    let connect = || ShardClient::connect(0, &shards.addrs[0], &sec, Duration::from_secs(10));
    let mut c = connect().await.unwrap();
    let r0 = c.register(reg(0)).await.unwrap();
    let mut c1 = connect().await.unwrap();
    c1.register(reg(1)).await.unwrap();
    let host = shards.addrs[0].rsplit_once(':').unwrap().0.to_string();
    let data_addr = format!("{host}:{}", r0.data_port);
    let g0: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let g1: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.02).collect();
    let total = 4 * n as u64;
    let lease1 = c1.lease(1);
    let raw_push = |h: PushHeader| {
        let mut req = tonic::Request::new(tokio_stream::iter(vec![PushChunk {
            header: Some(h),
            offset: 0,
            data: bytes::Bytes::new(),
            lease: lease1.clone(),
        }]));
        req.metadata_mut()
            .insert(DATA_RANK_KEY, "1".parse().unwrap());
        req
    };
    let open_rank1 = || async {
        let hello_1 = Hello {
            rank: 1,
            token: Vec::new(),
            run_id: String::new(),
            generation: 0,
            lease: lease1.as_ref().unwrap().id.to_vec(),
        }
        .encode();
        let (conn, a) = hello(&data_addr, &hello_1).await;
        assert_eq!(a, Some(HELLO_OK));
        conn
    };
    // a frame of byte ranges of `bytes` sent in the given order, as pieces
    let frame = |bytes: &[u8], ranges: &[(usize, usize)]| {
        let mut f = frame_header(0, total | PIECES).to_vec();
        for &(a, b) in ranges {
            f.extend_from_slice(&piece_header(a as u64, (b - a) as u64));
            f.extend_from_slice(&bytes[a..b]);
        }
        f
    };
    let t = total as usize;
    if pieces {
        // overlapping pieces: refused by name, nothing counted
        let mut conn = open_rank1().await;
        let mut rpc = c.rpc().clone();
        let call = {
            let req = raw_push(header(1, 0, n));
            tokio::spawn(async move { rpc.push(req).await })
        };
        conn.write_all(&frame(as_le_bytes(&g1), &[(0, 800), (400, 1200)]))
            .await
            .unwrap();
        let e = call.await.unwrap().unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(
            e.message().contains(&format!(
                "push of step 0 from rank 1 (data connection): piece at byte 400 of {total} overlaps the piece at bytes 0..800"
            )),
            "{e:?}"
        );
        drop(conn);
        // its gradient in reverse order on a new connection: counted
        let mut conn = open_rank1().await;
        let mut rpc = c.rpc().clone();
        let call = {
            let req = raw_push(header(1, 0, n));
            tokio::spawn(async move { rpc.push(req).await })
        };
        let reversed = [(8000, t), (4000, 8000), (0, 4000)];
        conn.write_all(&frame(as_le_bytes(&g1), &reversed))
            .await
            .unwrap();
        let r = call.await.unwrap().unwrap().into_inner();
        assert_eq!((r.counted, r.ranks_in), (true, 1));
    } else {
        assert_eq!(push_whole(&c1, 1, 0, &g1).await, (true, 1));
    }
    assert_eq!(push_whole(&c, 0, 0, &g0).await, (true, 2));
    // step 1
    let mut w = vec![0f32; n];
    c.pull_into(1, false, None, &mut w).await.unwrap();
    if pieces {
        // shuffled value ranges of g0 through the client's progressive push
        let ranges = [(2000, 2500), (0, 700), (2500, n), (700, 2000)];
        for counted in [true, false] {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            for &(a, b) in &ranges {
                tx.send((a, f32_to_bytes(&g0[a..b]))).unwrap();
            }
            drop(tx);
            let (reply, got) = c.push_progressive(header(0, 1, n), rx, 4096).await;
            let r = reply.unwrap();
            assert_eq!(
                (r.counted, r.ranks_in),
                (counted, 1),
                "a retry is recognised"
            );
            assert_eq!(got.len(), ranges.len());
        }
        // pieces that stop short are never sent as a whole
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send((700, f32_to_bytes(&g0[700..]))).unwrap();
        drop(tx);
        let e = c
            .push_progressive(header(0, 1, n), rx, 4096)
            .await
            .0
            .unwrap_err();
        assert!(!e.is_retryable(), "{e}");
        let want = if max_pending > 2 {
            // the shard checked it in a buffer and saw the frame end
            format!(
                "the connection ended with pieces covering {} of {total} bytes: expected a piece for bytes 0..2800",
                total - 2800
            )
        } else {
            // no buffer free to check it: pushed again whole, which it cannot be
            format!("its pieces stopped with bytes 0..2800 of {total} missing")
        };
        assert!(e.to_string().contains(&want), "{e}");
    } else {
        assert_eq!(push_whole(&c, 0, 1, &g0).await, (true, 1));
    }
    assert_eq!(push_whole(&c1, 1, 1, &g1).await, (true, 2));
    let mut w = vec![0f32; n];
    c.pull_into(2, false, None, &mut w).await.unwrap();
    w.iter().map(|v| v.to_bits()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_in_pieces_in_any_order_give_the_whole_range_weights() {
    let whole = two_steps(false, 2).await;
    for max_pending in [2, 4] {
        let pieces = two_steps(true, max_pending).await;
        assert_eq!(
            pieces, whole,
            "the same weights, bit for bit (max_pending_gradients {max_pending})"
        );
    }
}

/// Real workers over data connections (`transport = "grpc"`), on a model whose layers split
/// a shard's range into parts that each go as a piece of their own, give the same weights,
/// bit for bit, as with shared memory (whole ranges read in place).
#[test]
fn progressive_pushes_of_real_workers_give_the_shared_memory_weights() {
    use ps_config::Transport;
    use ps_tests::cluster_weights;
    let mut results = Vec::new();
    for transport in [Transport::Auto, Transport::Grpc] {
        let spec = Spec {
            shards: 2,
            workers: 2,
            hidden: vec![300, 300],
            global_batch: 32,
            steps: 6,
            config: Spec::base().sgd(0.05, 0.5),
            transport,
            ..Spec::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let (path, cfg) = spec.write(dir.path());
        if transport == Transport::Grpc {
            // the last shard's range starts inside the first layer: backward makes the
            // second layer's part final first, then the rest; both parts are big enough to be
            // pieces of their own (the last layer's part waits for the next piece)
            let layout = cfg.layout();
            let r = layout.shard_ranges(2)[1].clone();
            let (w2, _) = layout.mlp().expect("the MLP").layer(1);
            let min = ps_worker::worker::MIN_PIECE_VALUES;
            assert!(
                r.start < w2.start && w2.start - r.start >= min,
                "{r:?} {w2:?}"
            );
            assert!(r.end - w2.start >= min, "{r:?} {w2:?}");
        }
        ps_tests::inproc::run_in_process(&path);
        results.push(cluster_weights(&cfg));
    }
    let bits = |w: &[f32]| w.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&results[0]),
        bits(&results[1]),
        "shared memory and data connections differ"
    );
}

/// Per-bucket apply (clusters in this process): 2 shards, 3 workers on data connections with
/// progressive pushes (`transport = "grpc"`, a buffer for every rank), batches of 11, 11 and
/// 10, weighted aggregation. The final weights equal, bit for bit, those of the same cluster applying the whole range
/// at once (`max_pending_gradients` 2 < 3 workers: folded as they arrive, itself bit-identical
/// to the whole-range update), and the single process to the equivalence tolerance of
/// `cluster.rs` (1e-5); the shards said which path they use, and shard 1 (the last layers,
/// whose pieces come first) logged steps with buckets applied before the barrier completed.
/// Without data connections (gRPC chunks), the same weights.
#[test]
fn bucketed_apply_on_data_connections_equals_whole_range_and_one_process() {
    use ps_config::Transport;
    use ps_tests::{assert_bit_identical, cluster_weights, reference_weights, rel_diff};
    let run = |max_pending: usize, data: bool| {
        let spec = Spec {
            shards: 2,
            workers: 3,
            hidden: vec![300, 300],
            global_batch: 32,
            steps: 10,
            config: Spec::base()
                .sgd(0.05, 0.5)
                .log_every(1)
                .max_pending_gradients(max_pending)
                .data_connections(data, 0),
            transport: Transport::Grpc,
            aggregation: ps_config::Aggregation::Weighted,
            ..Spec::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let (path, cfg) = spec.write(dir.path());
        let logs = ps_tests::inproc::run_in_process(&path).shard_logs;
        (cfg.clone(), cluster_weights(&cfg), logs, dir)
    };
    let (cfg, bucketed, logs, _dir) = run(3, true);
    let (_, whole, whole_logs, _dir2) = run(2, true);
    // without data connections: whole ranges in gRPC chunks, each published as it is decoded
    let (_, chunks, chunk_logs, _dir3) = run(3, false);
    assert!(
        chunk_logs[1].contains("buckets before the barrier"),
        "{}",
        chunk_logs[1]
    );
    assert_bit_identical(
        &chunks,
        &whole,
        "per-bucket over gRPC chunks vs whole-range cluster",
    );
    for (s, log) in logs.iter().enumerate() {
        assert!(
            log.contains(&format!("shard {s}: the update is applied per bucket (")),
            "shard {s}:\n{log}"
        );
    }
    assert!(whole_logs[1].contains("shard 1: the update is applied over the whole range once every gradient is in: [server] max_pending_gradients < workers"), "{}", whole_logs[1]);
    // "shard 1 step 3/10 | ... | apply 0.4 ms | 4/6 buckets before the barrier"
    let early: Vec<u32> = logs[1]
        .lines()
        .filter(|l| l.contains("shard 1 step "))
        .filter_map(|l| {
            let tail = l.split(" | ").last()?;
            let (k, rest) = tail.split_once('/')?;
            rest.ends_with("buckets before the barrier")
                .then(|| k.trim().parse().ok())?
        })
        .collect();
    assert!(!early.is_empty(), "no per-bucket step lines:\n{}", logs[1]);
    assert!(
        early.iter().any(|&k| k > 0),
        "no bucket applied before a barrier: {early:?}"
    );
    assert!(!whole_logs[1].contains("buckets before the barrier"));
    assert_bit_identical(&bucketed, &whole, "per-bucket vs whole-range cluster");
    let d = rel_diff(&cfg, &bucketed, &reference_weights(&cfg));
    assert!(d < 1e-5, "relative difference from one process {d:.3e}");
}
