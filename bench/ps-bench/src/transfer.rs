//! Section 2, **push and pull through the real gRPC service**: an in-process shard
//! (`run_shard` on its own runtime), clients configured like the worker's, through gRPC and
//! through shared memory, beside raw TCP of the same bytes. The in-process shard and the client
//! calls are shared with the sections and modes that time a shard in this process.

use super::*;
use crate::raw_tcp;

/// Runs `make()`'s future to completion on a new multi-thread runtime of `threads` workers, on
/// its own OS thread (as a separate process would have its own runtime).
pub(crate) fn spawn_runtime<F, Fut>(
    threads: usize,
    make: F,
) -> std::thread::JoinHandle<anyhow::Result<()>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>>,
{
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?;
        rt.block_on(make())
    })
}

/// A shard served by `run_shard` in this process, on its own 2-thread runtime (as ps-server).
pub(crate) struct InProcShard {
    pub(crate) addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl InProcShard {
    pub(crate) fn start(cfg: Config) -> anyhow::Result<Self> {
        Self::start_on(cfg, SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// A shard listening on `bind` (its data connections on the same address, another port).
    pub(crate) fn start_on(cfg: Config, bind: SocketAddr) -> anyhow::Result<Self> {
        let std_listener =
            std::net::TcpListener::bind(bind).with_context(|| format!("listening on {bind}"))?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = spawn_runtime(2, move || async move {
            let listener = tokio::net::TcpListener::from_std(std_listener)?;
            let setup = ShardSetup {
                cfg,
                index: 0,
                train_len: 60_000,
                test_len: None,
                shard0: None,
                resume_from: None,
                metrics_listen: None,
                health_listen: None,
            };
            run_shard(setup, listener, async {
                let _ = rx.await;
            })
            .await?;
            Ok(())
        });
        Ok(Self {
            addr,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    pub(crate) fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join()
                .map_err(|_| anyhow::anyhow!("the in-process shard panicked"))??;
        }
        Ok(())
    }
}

impl Drop for InProcShard {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// The worker's client of the in-process shard (one attempt: the shard is listening already).
pub(crate) async fn connect(addr: SocketAddr) -> anyhow::Result<Client> {
    ShardClient::connect(
        0,
        &addr.to_string(),
        &ClientSecurity::default(),
        Duration::ZERO,
    )
    .await
    .with_context(|| format!("connecting to the in-process shard at {addr}"))
}

/// Registers `rank` (idempotent); returns the shard's version.
pub(crate) async fn register(c: &mut Client, cfg: &Config, rank: usize) -> anyhow::Result<u64> {
    Ok(register_with(c, cfg, rank, None).await?.version)
}

/// Registers `rank`, for shared memory with its gradient board when `board` (and its token)
/// is given, as a worker on the shard's host does.
pub(crate) async fn register_with(
    c: &mut Client,
    cfg: &Config,
    rank: usize,
    board: Option<(&Board, u64)>,
) -> anyhow::Result<ps_proto::pb::RegisterReply> {
    c.register(RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        rank: rank as u32,
        world_size: cfg.cluster.workers as u32,
        num_params: cfg.layout().num_params() as u64,
        shard: 0,
        num_shards: 1,
        shared_memory: board.is_some(),
        grad_file: board.map_or_else(String::new, |(b, _)| b.path().display().to_string()),
        grad_token: board.map_or(0, |(_, t)| t),
        model: Vec::new(),
    })
    .await
    .context("register")
}

/// Waits until the shard has applied `version` steps (polling with registrations, which are
/// idempotent), so that a timed pull never waits for an apply.
pub(crate) async fn wait_version(c: &mut Client, cfg: &Config, version: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while register(c, cfg, 0).await? < version {
        if Instant::now() > deadline {
            bail!("the shard did not reach version {version} in 60 s");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// Pulls version `version` into a new vector through gRPC, as the worker does (chunks checked
/// and decoded in place).
pub(crate) async fn pull(c: &mut Client, version: u64, len: usize) -> anyhow::Result<Vec<f32>> {
    let mut w = vec![0f32; len];
    c.pull_into(version, false, None, &mut w).await?;
    Ok(w)
}

/// Pushes step `step` of `rank` as "in the gradient board", as the worker does.
pub(crate) async fn push_shm(c: &Client, rank: usize, step: u64, len: usize) -> anyhow::Result<()> {
    let header = PushHeader {
        rank: rank as u32,
        step,
        samples: BATCH as u32,
        loss_sum: 1.0,
        correct: 0,
        len: len as u64,
        eval_correct: 0,
        eval_count: 0,
        shm: true,
    };
    c.push_retrying(header, &Bytes::new(), CHUNK_BYTES).await?;
    Ok(())
}

/// Pushes the already-encoded gradient `bytes` as step `step` of `rank`, in 1 MiB chunks,
/// exactly as a worker does (`ShardClient::push_retrying`).
pub(crate) async fn push(
    c: &mut Client,
    rank: usize,
    step: u64,
    bytes: &Bytes,
) -> anyhow::Result<()> {
    let header = PushHeader {
        rank: rank as u32,
        step,
        samples: BATCH as u32,
        loss_sum: 1.0,
        correct: 0,
        len: (bytes.len() / 4) as u64,
        eval_correct: 0,
        eval_count: 0,
        shm: false,
    };
    c.push_retrying(header, bytes, CHUNK_BYTES).await?;
    Ok(())
}

/// Section 2: push and pull of the large model through an in-process shard's gRPC service
/// (and shared memory), against raw TCP on the same loopback.
pub(crate) fn section_transfer(tmp: &Path, plan: &Plan) -> anyhow::Result<Vec<Value>> {
    let reps = plan.net_repeats;
    let m = LARGE;
    let dir1 = tmp.join("grpc-w1");
    let cfg1 = write_config(
        &dir1.join("config.toml"),
        &config_text(1, 1, &m, ENDLESS, &dir1.join("out")),
    )?;
    let dir2 = tmp.join("grpc-w2");
    let cfg2 = write_config(
        &dir2.join("config.toml"),
        &config_text(1, 2, &m, ENDLESS, &dir2.join("out")),
    )?;
    let len = cfg1.layout().num_params();
    let nbytes = len * 4;
    // the gradient, encoded once (the worker encodes every step; that copy is not timed here)
    let grad = f32_to_bytes(&vec![1e-6f32; len]);

    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;

    let (pull_s, push_apply_s) = time_w1(&client_rt, &cfg1, &grad, reps)?;
    let push_s = time_push_w2(&client_rt, &cfg2, &grad, reps)?;
    let (pull_shm_s, push_shm_s) = time_shm_w2(&client_rt, &cfg2, reps)?;
    let tcp_s = tcp_baseline(&client_rt, nbytes, reps)?;
    drop(client_rt);

    let (tcp, pull_m, push_m, push_apply) = (
        median(&tcp_s),
        median(&pull_s),
        median(&push_s),
        median(&push_apply_s),
    );
    let row = |what: &str, how: &str, s: &[f64], med: f64| {
        json!({
            "what": what, "how": how, "model": m.name, "bytes": nbytes,
            "ms": med * 1e3, "gbs": gbs(nbytes, med),
            "tcp_gbs": gbs(nbytes, tcp), "ratio_to_tcp": tcp / med,
            "ms_samples": s.iter().map(|v| v * 1e3).collect::<Vec<_>>(),
        })
    };
    let rows = vec![
        row(
            "pull",
            "version t once the shard has it, W = 1, decoded into a Vec<f32>",
            &pull_s,
            pull_m,
        ),
        row(
            "push",
            "step t of rank 0 of W = 2 (barrier incomplete: no apply), pre-encoded",
            &push_s,
            push_m,
        ),
        row(
            "push + apply",
            "step t, W = 1: the reply comes after the aggregation and SGD update",
            &push_apply_s,
            push_apply,
        ),
        row(
            "pull (shared memory)",
            "as pull, W = 2: header through gRPC, the version copied out of the shard's board",
            &pull_shm_s,
            median(&pull_shm_s),
        ),
        row(
            "push (shared memory)",
            "as push: header through gRPC, the shard checks the worker's board in place",
            &push_shm_s,
            median(&push_shm_s),
        ),
        row(
            "raw TCP",
            "tokio write_all (after a 1-byte command) into a peer reading into a preallocated buffer, 1-byte ack",
            &tcp_s,
            tcp,
        ),
    ];
    for r in &rows {
        eprintln!(
            "  {}: {:.1} ms, {:.2} GB/s",
            r["what"].as_str().unwrap_or("?"),
            f(r, "ms"),
            f(r, "gbs")
        );
    }
    Ok(rows)
}

/// W = 1: (pull, push + apply) seconds per step.
fn time_w1(
    client_rt: &tokio::runtime::Runtime,
    cfg: &Config,
    grad: &Bytes,
    reps: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let len = cfg.layout().num_params();
    // W = 1: pull of version t once available, then push of step t (which includes the apply)
    let shard = InProcShard::start(cfg.clone())?;
    let times = client_rt.block_on(async {
        let mut c = connect(shard.addr).await?;
        register(&mut c, cfg, 0).await?;
        let (mut pull_s, mut push_apply_s) = (Vec::new(), Vec::new());
        for t in 0..=reps as u64 {
            wait_version(&mut c, cfg, t).await?;
            let t0 = Instant::now();
            let w = pull(&mut c, t, len).await?;
            let t1 = Instant::now();
            if w.len() != len {
                bail!("pulled {} values: expected {len}", w.len());
            }
            drop(w);
            let t2 = Instant::now();
            push(&mut c, 0, t, grad).await?;
            let t3 = Instant::now();
            if t > 0 {
                pull_s.push((t1 - t0).as_secs_f64());
                push_apply_s.push((t3 - t2).as_secs_f64());
            }
        }
        Ok::<_, anyhow::Error>((pull_s, push_apply_s))
    })?;
    shard.stop()?;
    Ok(times)
}

/// W = 2: seconds of rank 0's push per step (no apply).
fn time_push_w2(
    client_rt: &tokio::runtime::Runtime,
    cfg: &Config,
    grad: &Bytes,
    reps: usize,
) -> anyhow::Result<Vec<f64>> {
    // W = 2: push of rank 0 alone (barrier incomplete, no apply), then rank 1 untimed
    let shard = InProcShard::start(cfg.clone())?;
    let times = client_rt.block_on(async {
        let mut c0 = connect(shard.addr).await?;
        let mut c1 = connect(shard.addr).await?;
        register(&mut c0, cfg, 0).await?;
        register(&mut c1, cfg, 1).await?;
        let mut push_s = Vec::new();
        for t in 0..=reps as u64 {
            wait_version(&mut c0, cfg, t).await?;
            let t0 = Instant::now();
            push(&mut c0, 0, t, grad).await?;
            let t1 = Instant::now();
            push(&mut c1, 1, t, grad).await?;
            if t > 0 {
                push_s.push((t1 - t0).as_secs_f64());
            }
        }
        Ok::<_, anyhow::Error>(push_s)
    })?;
    shard.stop()?;
    Ok(times)
}

/// W = 2 through shared memory: (pull, push) seconds per step.
fn time_shm_w2(
    client_rt: &tokio::runtime::Runtime,
    cfg: &Config,
    reps: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let len = cfg.layout().num_params();
    // W = 2 again, through shared memory as workers on this host do: the pull answers with a
    // header and the worker copies the version out of the shard's board; the push sends a
    // header and the shard checks the values in place in the worker's gradient board
    let shard = InProcShard::start(cfg.clone())?;
    let root = ps_net::shm::shm_root().context("no /dev/shm for the shared-memory rows")?;
    let times = client_rt.block_on(async {
        let mut links = Vec::new();
        for r in 0..2 {
            let d = BoardDir::create(&root, &format!("bench-worker{r}"))?;
            let mut b = Board::create(&grad_path(d.path()), d.token(), len, 1)?;
            b.slot_mut(0).fill(1e-6);
            let mut c = connect(shard.addr).await?;
            let reply = register_with(&mut c, cfg, r, Some((&b, d.token()))).await?;
            let link = ShmLink::open(&reply, 0);
            if link.describe() != "shared memory" {
                bail!("the in-process shard offered no shared memory: {reply:?}");
            }
            links.push((c, link, d, b));
        }
        let mut w = vec![0f32; len];
        let (mut pull_s, mut push_s) = (Vec::new(), Vec::new());
        for t in 0..=reps as u64 {
            wait_version(&mut links[0].0, cfg, t).await?;
            let t0 = Instant::now();
            let (c, link, _, _) = &mut links[0];
            c.pull_into(t, false, link.params.as_deref(), &mut w)
                .await?;
            let t1 = Instant::now();
            push_shm(&links[0].0, 0, t, len).await?;
            let t2 = Instant::now();
            push_shm(&links[1].0, 1, t, len).await?;
            if t > 0 {
                pull_s.push((t1 - t0).as_secs_f64());
                push_s.push((t2 - t1).as_secs_f64());
            }
        }
        Ok::<_, anyhow::Error>((pull_s, push_s))
    })?;
    shard.stop()?;
    Ok(times)
}

/// Seconds to move `n` bytes over one loopback TCP connection into a preallocated buffer, per
/// repeat (after one untimed transfer): `raw_tcp::send` to a `raw_tcp::peer` on its own
/// single-thread runtime, which answers one byte once it has all `n`; the client writes from
/// its own buffer.
fn tcp_baseline(
    client_rt: &tokio::runtime::Runtime,
    n: usize,
    repeats: usize,
) -> anyhow::Result<Vec<f64>> {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let sink = spawn_runtime(1, move || raw_tcp::peer(std_listener, n));
    let times = client_rt.block_on(async {
        let mut c = raw_tcp::connect(addr).await?;
        let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
        let mut out = Vec::new();
        for rep in 0..=repeats {
            let t = Instant::now();
            raw_tcp::send(&mut c, &data).await?;
            if rep > 0 {
                out.push(t.elapsed().as_secs_f64());
            }
        }
        raw_tcp::end(&mut c).await?;
        Ok::<_, anyhow::Error>(out)
    })?;
    sink.join()
        .map_err(|_| anyhow::anyhow!("the TCP sink panicked"))??;
    Ok(times)
}

pub(crate) fn table_transfer(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 2. Push and pull through the gRPC service (in process, 127.0.0.1, large model, S = 1; the shared-memory rows move only a header through gRPC, so their ratio to TCP is not a like-for-like one)\n\n\
         | transfer | what exactly | bytes | ms | GB/s | raw TCP GB/s (same bytes) | ratio |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} MB | {:.1} | {:.2} | {:.2} | {:.2} |",
            r["what"].as_str().unwrap_or("?"),
            r["how"].as_str().unwrap_or("?"),
            f(r, "bytes") / 1e6,
            f(r, "ms"),
            f(r, "gbs"),
            f(r, "tcp_gbs"),
            f(r, "ratio_to_tcp"),
        );
    }
    s
}
