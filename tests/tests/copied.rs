//! Host copies on the shard service's side (`ps_net::copied`), counted in a scope that the
//! shard's runtime threads entered (exact whatever the rest of this process copies): a push of
//! n values through gRPC chunks (into the whole-range buffer, `chunks_to_buffer`, or into the
//! per-bucket applier's buffer) or in a frame on the data connection counts exactly 4·n push
//! bytes, once; a retry is checked, not copied; the pulls of the version the update made share
//! its buffer (no copy on a shard without a board; `ps-server/core/tests/board.rs` counts the
//! copy out of a board).

use ps_config::Transport;
use ps_net::auth::ClientSecurity;
use ps_net::client::{ShardClient, push_chunks_of, with_lease};
use ps_net::copied::Scope;
use ps_net::wire::f32_to_bytes;
use ps_tests::{Spec, push_header, register_request};
use std::path::Path;
use std::time::Duration;
use tokio::sync::oneshot;

/// A shard of the config at `path` served on 127.0.0.1:0 by a runtime of its own, every
/// thread of which (the blocking pool's included) counts its copies in `scope`.
struct ScopedShard {
    addr: String,
    stop: Option<oneshot::Sender<()>>,
    done: std::sync::mpsc::Receiver<anyhow::Result<ps_server::Outcome>>,
}

impl ScopedShard {
    fn start(path: &Path, scope: &Scope) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = oneshot::channel::<()>();
        let (tx, done) = std::sync::mpsc::channel();
        let (path, servers, scope) = (path.to_path_buf(), vec![addr.clone()], scope.clone());
        std::thread::spawn(move || {
            let _in = scope.enter();
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .on_thread_start(move || std::mem::forget(scope.enter()))
                .enable_all()
                .build()
                .unwrap();
            let r = rt.block_on(async move {
                let mut setup =
                    ps_server::load_setup(&path, 0, None, &ps_config::Overrides::default())?;
                setup.cfg.cluster.servers = servers;
                ps_server::check_output_dirs(&setup.cfg)?;
                let listener = tokio::net::TcpListener::from_std(listener)?;
                ps_server::run_shard(setup, listener, async {
                    let _ = stopped.await;
                })
                .await
            });
            let _ = tx.send(r);
        });
        Self {
            addr,
            stop: Some(stop),
            done,
        }
    }
}

impl Drop for ScopedShard {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        // bounded: a shard that does not stop fails the test here, not by a hang
        if !std::thread::panicking() {
            let r = self.done.recv_timeout(Duration::from_secs(60));
            assert!(r.is_ok(), "the shard did not stop within 60 s");
        }
    }
}

/// One step of 2 ranks on a 1-shard cluster with `[server] max_pending_gradients = pending`
/// (1: whole-range receipt; 2: per-bucket apply), over the network: the push bytes counted for
/// rank 0's gRPC chunks, its retry's, rank 1's frame, and the pull bytes of two pulls of
/// version 1.
async fn one_step(pending: usize) -> (usize, [u64; 3], [u64; 2]) {
    let run = Spec::small()
        .transport(Transport::Grpc)
        .config(Spec::base().sgd(0.5, 0.0).max_pending_gradients(pending))
        .prepare();
    let n = run.cfg.layout().num_params();
    let scope = Scope::new();
    let shard = ScopedShard::start(&run.path, &scope);
    let sec = ClientSecurity::default();
    let connect = || ShardClient::connect(0, &shard.addr, &sec, Duration::from_secs(10));
    let (mut c0, mut c1) = (connect().await.unwrap(), connect().await.unwrap());
    c0.register(register_request(0, 2, n)).await.unwrap();
    c1.register(register_request(1, 2, n)).await.unwrap();
    assert!(c1.has_data_link(), "rank 1 pushes on its data connection");
    let g = |r: usize| -> Vec<f32> { (0..n).map(|i| ((i + r) % 11) as f32 * 0.01).collect() };
    let (b0, b1) = (f32_to_bytes(&g(0)), f32_to_bytes(&g(1)));
    let push = |c: &mut ShardClient| {
        let msgs = push_chunks_of(push_header(0, 0, n), &b0, 4096, 4);
        let msgs = with_lease(msgs, c.lease(0));
        let mut rpc = c.rpc().clone();
        async move {
            rpc.push(tokio_stream::iter(msgs))
                .await
                .unwrap()
                .into_inner()
        }
    };
    let mut pushed = [0; 3];
    let at = scope.totals();
    let r = push(&mut c0).await;
    assert_eq!((r.counted, r.ranks_in), (true, 1));
    pushed[0] = scope.totals().1 - at.1;
    let at = scope.totals();
    let r = push(&mut c0).await;
    assert_eq!((r.counted, r.ranks_in), (false, 1), "a retry is recognised");
    pushed[1] = scope.totals().1 - at.1;
    let at = scope.totals();
    let r = c1.push(push_header(1, 0, n), &b1, 4096).await.unwrap();
    assert_eq!((r.counted, r.ranks_in), (true, 2));
    pushed[2] = scope.totals().1 - at.1;
    let mut pulled = [0; 2];
    let mut w = vec![0f32; n];
    for (i, c) in [&mut c0, &mut c1].into_iter().enumerate() {
        let at = scope.totals();
        c.pull_into(1, false, None, &mut w).await.unwrap();
        pulled[i] = scope.totals().0 - at.0;
    }
    (n, pushed, pulled)
}

/// One step with `max_pending` gradients held: its push and pull bytes as counted.
async fn assert_counted_once(max_pending: usize) {
    let (n, pushed, pulled) = one_step(max_pending).await;
    let b = 4 * n as u64;
    assert_eq!(
        pushed,
        [b, 0, b],
        "push bytes: chunks, their retry, a frame"
    );
    assert_eq!(
        pulled,
        [0, 0],
        "pull bytes: the update's own buffer is the reply"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_into_the_whole_range_buffer_and_a_frame_count_their_values_once() {
    assert_counted_once(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_and_a_frame_into_the_per_bucket_buffer_count_their_values_once() {
    assert_counted_once(2).await;
}
