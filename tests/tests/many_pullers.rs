//! Many gRPC pullers on one live `ps-server` shard: what each costs the shard, against the
//! start-up memory statement (`ps_server::memory`), and the values each gets.

use ps_config::{Config, Transport};
use ps_launch::{LocalCluster, bin_dir};
use ps_proto::pb::PullChunk;
use ps_proto::pb::parameter_server_client::ParameterServerClient;
use ps_server::memory::{MemoryPlan, PULLER_BYTES, PULLERS};
use ps_tests::{RawClient, Spec, register_request};
use std::time::{Duration, Instant};

/// `key` (VmRSS, VmHWM) of `/proc/<pid>/status`, in bytes.
fn status_bytes(pid: u32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = s
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("{key} in /proc/{pid}/status"))
        .parse()
        .unwrap();
    kib << 10
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// 32 workers' pulls on their own connections, each with a 64 KiB HTTP/2 window and taking
/// nothing of its reply for a while (as workers starved of CPU do), on a shard of 0.94 MB
/// (issue 31's model): the shard grows by at most what its start-up statement says pullers
/// cost (32 x `PULLER_BYTES`) plus 4 MiB for the allocator's and the runtime's own, every reply
/// is the shard's version 0, bit for bit the same, and the statement is the plan's. Before the
/// replies shared the version's buffer, tonic's encoder copied each reply's chunk into its own
/// stream: the shard grew by about 30 MB here (one 0.94 MB copy per puller).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_pullers_share_the_version_and_cost_what_the_statement_says() {
    const W: usize = 32;
    const BAND: u64 = 4 << 20;
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 1,
        workers: W,
        hidden: vec![256, 128],
        global_batch: W,
        transport: Transport::Grpc,
        // every value through HTTP/2, as with TLS; replies not ended as idle during the test
        config: Spec::base()
            .data_connections(false, 0)
            .stream_idle_secs(60.0),
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir.path());
    let n = cfg.layout().num_params();
    assert_eq!(n * 4, 940_584);
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap();
    let pid = cluster.servers[0].child.id();
    let url = format!("http://{}", cluster.addrs[0]);

    let plan = MemoryPlan::of(&Config::load(&dir.path().join("config.toml")).unwrap(), n);
    assert_eq!(plan.part(PULLERS), W as u64 * PULLER_BYTES);

    let mut pullers = Vec::with_capacity(W);
    for r in 0..W as u32 {
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .initial_stream_window_size(64 << 10)
            .initial_connection_window_size(64 << 10)
            .connect()
            .await
            .unwrap();
        let mut c = RawClient::connect(url.clone()).await.unwrap();
        c.rpc = ParameterServerClient::new(channel);
        c.register(register_request(r, W as u32, n)).await.unwrap();
        pullers.push(c);
    }
    let rss = status_bytes(pid, "VmRSS:");
    // VmHWM from here on: the peak of the pulls alone
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();

    let mut replies = Vec::with_capacity(W);
    for c in &mut pullers {
        let lease = c.any_lease();
        let reply = c
            .rpc
            .pull(ps_tests::pull_request(0, lease))
            .await
            .unwrap()
            .into_inner();
        replies.push(reply);
    }
    // the shard has answered every pull and sent what the windows take; the rest waits
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held = status_bytes(pid, "VmRSS:");
    let mut values = Vec::with_capacity(W);
    let read = Instant::now();
    for mut reply in replies {
        let mut chunks: Vec<PullChunk> = Vec::new();
        while let Some(c) = tokio::time::timeout(Duration::from_secs(30), reply.message())
            .await
            .expect("a reply chunk within 30 s")
            .unwrap()
        {
            chunks.push(c);
        }
        let header = chunks[0].header.expect("a header on the first chunk");
        assert_eq!((header.version, header.start, header.len), (0, 0, n as u64));
        let mut bytes = Vec::with_capacity(n * 4);
        for c in &chunks {
            assert_eq!(c.offset, bytes.len() as u64, "chunks in order");
            bytes.extend_from_slice(&c.data);
        }
        values.push(bytes);
    }
    let read_ms = read.elapsed().as_secs_f64() * 1e3;
    let peak = status_bytes(pid, "VmHWM:");
    cluster.kill_all();

    assert_eq!(values[0].len(), n * 4);
    assert!(
        values.iter().all(|v| *v == values[0]),
        "every puller got the same bytes"
    );
    let grew = peak.saturating_sub(rss);
    let stated = plan.part(PULLERS);
    eprintln!(
        "{W} stalled pullers of {:.2} MB: RSS {:.1} MiB before, {:.1} MiB while held, peak {:.1} MiB: grew {:.2} MiB ({:.1} KiB per puller); stated {:.2} MiB ({} KiB per puller); replies read in {read_ms:.0} ms",
        (n * 4) as f64 / 1e6,
        mib(rss),
        mib(held),
        mib(peak),
        mib(grew),
        grew as f64 / W as f64 / 1024.0,
        mib(stated),
        PULLER_BYTES >> 10
    );
    assert!(
        grew <= stated + BAND,
        "the shard grew by {:.1} MiB with {W} pullers holding their replies: more than the {:.1} MiB its statement gives them + {:.0} MiB",
        mib(grew),
        mib(stated),
        mib(BAND)
    );
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    assert!(
        log.contains(&format!("expected peak memory {}", plan.describe())),
        "the start-up statement is the plan {}:\n{log}",
        plan.describe()
    );
}

/// A puller that takes nothing of its reply (64 KiB windows, 15 chunks of 64 KiB) for longer
/// than `stream_idle_secs` (1 s) gets the chunk it had begun, then DEADLINE_EXCEEDED naming the
/// key: the shared reply body ends with the idle status in its trailers, as tonic's did, and
/// the shard's log says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_pull_ends_with_the_idle_status() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 1,
        workers: 1,
        hidden: vec![256, 128],
        global_batch: 1,
        transport: Transport::Grpc,
        config: Spec::base()
            .data_connections(false, 0)
            .stream_idle_secs(1.0)
            .chunk_bytes(64 << 10),
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir.path());
    let n = cfg.layout().num_params();
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap();
    let url = format!("http://{}", cluster.addrs[0]);
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .unwrap()
        .initial_stream_window_size(64 << 10)
        .initial_connection_window_size(64 << 10)
        .connect()
        .await
        .unwrap();
    let mut c = RawClient::connect(url).await.unwrap();
    c.rpc = ParameterServerClient::new(channel);
    c.register(register_request(0, 1, n)).await.unwrap();
    let lease = c.any_lease();
    let mut reply = c
        .rpc
        .pull(ps_tests::pull_request(0, lease))
        .await
        .unwrap()
        .into_inner();
    // nothing taken: the shard ends the reply once idle past stream_idle_secs, and says so
    let shard_log = dir.path().join("logs/shard-0.log");
    tokio::task::spawn_blocking(move || {
        ps_tests::wait_for_log(&shard_log, "pull stream idle for", Duration::from_secs(60))
    })
    .await
    .unwrap();
    let mut chunks = 0;
    let e = loop {
        match tokio::time::timeout(Duration::from_secs(30), reply.message())
            .await
            .expect("the reply goes on or ends within 30 s")
        {
            Ok(Some(_)) => chunks += 1,
            Ok(None) => panic!("the whole reply after {chunks} chunks: expected it ended as idle"),
            Err(e) => break e,
        }
    };
    cluster.kill_all();
    assert!(
        chunks < n * 4 / (64 << 10),
        "{chunks} chunks before the end"
    );
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    assert!(e.message().contains("stream_idle_secs"), "{e:?}");
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    assert!(log.contains("pull stream idle for"), "{log}");
}
