//! Logs a person can read, on live processes: a warning that repeats (a flood of refused
//! pushes) is logged a bounded number of times, each line counting the ones not logged, and
//! the counts add up to every refusal; a rank the step waits for is named at WARN after
//! `barrier_warn_secs` whatever its transport (gRPC chunks, the data connection, shared
//! memory), whether it never pushed or its push started and stalled.

use ps_config::Transport;
use ps_launch::{LocalCluster, bin_dir};
use ps_net::client::{DATA_RANK_KEY, push_chunks, with_lease};
use ps_net::datalink::{HELLO_OK, Hello};
use ps_net::throttle::LOG_EVERY;
use ps_net::wire::f32_to_bytes;
use ps_proto::pb::PushChunk;
use ps_tests::{RawClient, Spec, push_header, register_request};
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

/// Waits (bounded) until the log at `path` has a WARN line for which `names` holds; returns it.
fn wait_for_warn(path: &Path, what: &str, names: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let log = std::fs::read_to_string(path).unwrap_or_default();
        if let Some(l) = log.lines().find(|l| l.contains(" WARN ") && names(l)) {
            return l.to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{what}: no such WARN line in {} after 60 s:\n{log}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The number a line says after `before` (e.g. "(" + "N more since").
fn number_after(line: &str, before: &str) -> Option<u64> {
    let at = line.find(before)? + before.len();
    line[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_refused_pushes_is_logged_a_bounded_number_of_times_with_counts() {
    let spec = Spec {
        shards: 1,
        workers: 1,
        hidden: vec![4],
        steps: 2,
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    let n = cfg.layout().num_params();
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap();
    let mut c = RawClient::connect(format!("http://{}", cluster.addrs[0]))
        .await
        .unwrap();
    let g = f32_to_bytes(&vec![0.01f32; n]);
    // 200 pushes without a lease (FAILED_PRECONDITION), 100 of an unknown rank
    // (INVALID_ARGUMENT): two kinds, each rate-limited on its own
    let burst = Instant::now();
    for (count, rank, code) in [
        (200, 0, Code::FailedPrecondition),
        (100, 5, Code::InvalidArgument),
    ] {
        for _ in 0..count {
            let msgs = push_chunks(push_header(rank, 0, n), &g, 1 << 20);
            let e = c
                .rpc
                .push(tokio_stream::iter(msgs))
                .await
                .expect_err("refused");
            assert_eq!(e.code(), code, "{e:?}");
        }
    }
    let took = burst.elapsed();
    // the run then goes on and ends: the shard's closing lines count what was not logged
    cluster.start_worker(0, 1, &[]).unwrap();
    cluster
        .wait(Duration::from_secs(120), &|| false)
        .unwrap_or_else(|e| panic!("{e}"));
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    // at most one line per LOG_EVERY for each kind while the burst lasted
    let bound = 1 + (took.as_secs_f64() / LOG_EVERY.as_secs_f64()).ceil() as usize;
    for (kind, wording, count) in [
        ("FailedPrecondition", "presents no lease", 200u64),
        ("InvalidArgument", "unknown rank 5", 100),
    ] {
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("push refused:") && l.contains(wording))
            .collect();
        assert!(
            !lines.is_empty() && lines.len() <= bound,
            "{kind}: {} lines for {count} refusals in {took:?} (at most {bound}):\n{log}",
            lines.len()
        );
        assert!(lines.iter().all(|l| l.contains(" WARN ")), "{lines:#?}");
        // each line stands for itself and the ones it says were not logged; the closing line
        // for the rest: together every refusal
        let logged: u64 = lines
            .iter()
            .map(|l| {
                1 + number_after(l, "(")
                    .filter(|_| l.contains(" more since"))
                    .unwrap_or(0)
            })
            .sum();
        let closing = log
            .lines()
            .find(|l| {
                l.contains(&format!(
                    "more refused pushes ({kind}) since the last report"
                ))
            })
            .unwrap_or_else(|| panic!("{kind}: no closing count:\n{log}"));
        let rest = number_after(closing, "shard 0: ").unwrap();
        assert_eq!(logged + rest, count, "{kind}: {lines:#?}\n{closing}");
        assert!(closing.contains(&format!(", {count} in all")), "{closing}");
    }
}

/// A shard of `transport` (data connections on or off) with ranks 0 and 1 registered through
/// raw clients; rank 0 has pushed step 0.
async fn shard_with_rank_0_in(
    dir: &Path,
    transport: &str,
) -> (LocalCluster, RawClient, usize, u32) {
    let spec = Spec {
        shards: 1,
        workers: 2,
        hidden: vec![4],
        steps: 2,
        transport: Transport::Grpc,
        config: Spec::base()
            .barrier_warn_secs(0.3)
            .stream_idle_secs(120.0)
            .data_connections(transport == "data connection", 0),
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir);
    let n = cfg.layout().num_params();
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap();
    let mut c = RawClient::connect(format!("http://{}", cluster.addrs[0]))
        .await
        .unwrap();
    c.register(register_request(0, 2, n)).await.unwrap();
    let port = c
        .register(register_request(1, 2, n))
        .await
        .unwrap()
        .into_inner()
        .data_port;
    let g = f32_to_bytes(&vec![0.01f32; n]);
    let r = c
        .push(push_chunks(push_header(0, 0, n), &g, 1 << 20))
        .await
        .unwrap()
        .into_inner();
    assert!(r.counted && r.ranks_in == 1, "{r:?}");
    (cluster, c, n, port)
}

/// A push of rank 1 whose header arrived and whose values never come (a partitioned link):
/// on gRPC chunks and on the data connection, the shard names rank 1 at WARN once
/// `barrier_warn_secs` has passed (not only at INFO as "under way" until the stream times out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_push_is_named_at_warn_on_grpc_and_on_the_data_connection() {
    for transport in ["gRPC chunks", "data connection"] {
        let dir = tempfile::tempdir().unwrap();
        let (mut cluster, c, n, port) = shard_with_rank_0_in(dir.path(), transport).await;
        let lease = c.lease(1);
        let stalled = if transport == "gRPC chunks" {
            // the header chunk with a part of the values, then nothing: the stream stays open
            let mut msgs = with_lease(
                push_chunks(push_header(1, 0, n), &f32_to_bytes(&vec![0.0f32; n]), 16),
                lease,
            );
            msgs.truncate(2);
            let stream = futures::StreamExt::chain(
                tokio_stream::iter(msgs),
                futures::stream::pending::<PushChunk>(),
            );
            let mut rpc = c.rpc.clone();
            tokio::spawn(async move { rpc.push(stream).await.map(|_| ()) })
        } else {
            // the data connection is open (hello accepted); the header goes through gRPC and
            // the frame with the values never comes
            assert!(port > 0, "data connections are on");
            let host = cluster.addrs[0].rsplit_once(':').unwrap().0.to_string();
            let mut conn = tokio::net::TcpStream::connect(format!("{host}:{port}"))
                .await
                .unwrap();
            let l = lease.clone().unwrap();
            let hello = Hello {
                rank: 1,
                token: Vec::new(),
                run_id: String::new(),
                generation: l.generation,
                lease: l.id.to_vec(),
            };
            conn.write_all(&hello.encode()).await.unwrap();
            let mut b = [0u8; 1];
            conn.read_exact(&mut b).await.unwrap();
            assert_eq!(b[0], HELLO_OK);
            let mut req = tonic::Request::new(tokio_stream::iter(with_lease(
                vec![PushChunk {
                    header: Some(push_header(1, 0, n)),
                    offset: 0,
                    data: bytes::Bytes::new(),
                    lease: None,
                }],
                lease,
            )));
            req.metadata_mut()
                .insert(DATA_RANK_KEY, "1".parse().unwrap());
            let mut rpc = c.rpc.clone();
            tokio::spawn(async move {
                let r = rpc.push(req).await.map(|_| ());
                drop(conn);
                r
            })
        };
        let line = wait_for_warn(&dir.path().join("logs/shard-0.log"), transport, |l| {
            l.contains("step 0: waiting")
                && l.contains("for rank 1, whose gradient has started to arrive")
        });
        assert!(
            line.contains("(1 of 2 in)") || line.contains("rank 1"),
            "{line}"
        );
        stalled.abort();
        cluster.kill_all();
    }
}

/// A worker stopped (SIGSTOP) in the middle of a run, on each transport: the step it does not
/// push is waited for, and the shard names it at WARN after `barrier_warn_secs`.
#[test]
fn a_stopped_worker_is_named_at_warn_on_every_transport() {
    for (transport, data) in [
        (Transport::Auto, false), // shared memory
        (Transport::Grpc, true),  // the data connection
        (Transport::Grpc, false), // gRPC chunks
    ] {
        let what = format!("{transport:?}, data connections {data}");
        let spec = Spec {
            shards: 1,
            workers: 2,
            hidden: vec![8],
            steps: 1_000_000,
            transport,
            config: Spec::base()
                .barrier_warn_secs(0.3)
                .data_connections(data, 0),
            ..Spec::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let (path, cfg) = spec.write(dir.path());
        let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
        cluster
            .start_servers(1, &[], Duration::from_secs(60))
            .unwrap();
        cluster.start_worker(0, 2, &[]).unwrap();
        cluster.start_worker(1, 2, &[]).unwrap();
        // training runs: a few step lines are in
        ps_tests::wait_for_lines(
            &cfg.server.out_dir.join("metrics.jsonl"),
            3,
            Duration::from_secs(60),
            &what,
        );
        let pid = cluster.workers[1].child.id() as i32;
        // SAFETY: a signal to a child process this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        let line = wait_for_warn(&dir.path().join("logs/shard-0.log"), &what, |l| {
            l.contains(": waiting")
                && (l.contains("for ranks [1] (1 of 2 in)") || l.contains("for rank 1, whose"))
        });
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        cluster.kill_all();
        let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
        if transport == Transport::Auto {
            assert!(
                log.contains("shared memory"),
                "{what}: the shared-memory path was in use:\n{log}"
            );
        }
        assert!(line.contains("shard 0 step "), "{what}: {line}");
    }
}
