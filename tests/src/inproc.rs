//! A cluster started in this test process (as mini-redis and Ballista test): every shard is
//! `ps_server::run_shard` on its own 2-thread runtime and every worker `ps_worker::worker::run_worker`
//! on its own 1-thread runtime (as the binaries run them), each on a thread of its own, the
//! shards on listeners bound to 127.0.0.1:0 before anything starts (so every process knows every
//! address). Each node's log (`tracing`, as the binary writes it) is captured into a buffer of
//! its own. For the tests whose subject is the protocol or the math; the tests whose subject is a
//! process (signals, kills, exit codes, the launcher) start the binaries instead.
//!
//! A node's thread sends its result over a channel when it ends, so every wait is bounded; a
//! dropped node is told to stop (its shutdown future resolves), never waited for.

use crate::{mnist_dir, mnist_test, mnist_train};
use ps_config::Config;
use ps_data::idx::{Dataset, Split, load_split};
use ps_server::{Outcome, ShardSetup};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// How long [`run_in_process`] waits for a whole run (a loaded machine included).
pub const RUN_LIMIT: Duration = Duration::from_secs(300);

/// A node's captured log: what its `tracing` events wrote, as the binary writes them to stderr.
#[derive(Clone, Default)]
pub struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl LogBuffer {
    /// The text logged so far.
    pub fn text(&self) -> String {
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Waits (at most `limit`, panicking with the log so far) until the log holds `needle`.
    pub fn wait_for(&self, needle: &str, limit: Duration) -> String {
        let t0 = std::time::Instant::now();
        loop {
            let text = self.text();
            if text.contains(needle) {
                return text;
            }
            assert!(
                t0.elapsed() < limit,
                "no {needle:?} logged within {limit:?}:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The address logged right after `marker` (e.g. "Prometheus metrics on http://"),
    /// waiting for it at most `limit`.
    pub fn addr_after(&self, marker: &str, limit: Duration) -> String {
        let text = self.wait_for(marker, limit);
        let rest = text.split(marker).nth(1).unwrap_or_default();
        rest.split(|c: char| c.is_whitespace() || c == '/')
            .next()
            .unwrap_or_default()
            .to_string()
    }

    /// A dispatcher writing this buffer (ANSI off, no target, level INFO, as the binaries).
    fn dispatch(&self) -> tracing::Dispatch {
        let buf = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_target(false)
            .with_ansi(false)
            .with_writer(move || buf.clone())
            .finish();
        tracing::Dispatch::new(subscriber)
    }
}

impl std::io::Write for LogBuffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A shard or a worker running on a thread of this process.
pub struct Node<T> {
    /// `shard-<i>` or `worker-<r>`.
    pub name: String,
    /// Its log.
    pub log: LogBuffer,
    stop: Option<oneshot::Sender<()>>,
    done: mpsc::Receiver<anyhow::Result<T>>,
}

impl<T: Send + 'static> Node<T> {
    /// Runs `make()`'s future on a runtime of `threads` threads on a new thread, its log into
    /// a buffer of its own, until it ends or `stop` fires.
    fn spawn<F, Fut>(name: String, threads: usize, make: F) -> Self
    where
        F: FnOnce(oneshot::Receiver<()>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = anyhow::Result<T>>,
    {
        let log = LogBuffer::default();
        let dispatch = log.dispatch();
        let (stop, stopped) = oneshot::channel();
        let (tx, done) = mpsc::channel();
        let thread_name = name.clone();
        std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let _log = tracing::dispatcher::set_default(&dispatch);
                let on_start = dispatch.clone();
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(threads)
                    .thread_name(thread_name)
                    .on_thread_start(move || {
                        // the runtime's threads log into the node's buffer for their life
                        std::mem::forget(tracing::dispatcher::set_default(&on_start));
                    })
                    .enable_all()
                    .build();
                let result = match rt {
                    Ok(rt) => rt.block_on(make(stopped)),
                    Err(e) => Err(anyhow::anyhow!("cannot start a runtime: {e}")),
                };
                let _ = tx.send(result);
            })
            .expect("a node's thread starts");
        Self {
            name,
            log,
            stop: Some(stop),
            done,
        }
    }

    /// Waits (at most `limit`) for the node's end; panics with its log if it does not end.
    pub fn join(mut self, limit: Duration) -> anyhow::Result<T> {
        match self.done.recv_timeout(limit) {
            Ok(r) => {
                self.stop.take();
                r
            }
            Err(e) => panic!(
                "{} did not end within {limit:?} ({e}); its log:\n{}",
                self.name,
                self.log.text()
            ),
        }
    }

    /// Tells the node to stop (its shutdown future resolves) and waits for it (at most `limit`).
    pub fn stop(mut self, limit: Duration) -> anyhow::Result<T> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.join(limit)
    }
}

impl<T> Drop for Node<T> {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// The shards of `cfg` (its file at `path`), served in this process on 127.0.0.1:0: their
/// setup is `ps_server::load_setup`'s (as `ps-server` reads the file), their addresses the
/// bound ones.
pub struct Shards {
    /// The config with `[cluster] servers` the bound addresses.
    pub cfg: Config,
    /// The bound addresses, by shard index (`127.0.0.1:port`).
    pub addrs: Vec<String>,
    /// The shards, by index.
    pub nodes: Vec<Node<Outcome>>,
}

impl Shards {
    /// Starts every shard of the config at `path`.
    pub fn start(path: &Path) -> Self {
        Self::start_with(path, |_| Ok(()))
    }

    /// [`Shards::start`], each shard's setup changed by `tweak` first (as a flag of
    /// `ps-server` would: `metrics_listen`, `health_listen`, [`resume`]); an error of `tweak`
    /// is the shard's.
    pub fn start_with(path: &Path, tweak: impl Tweak) -> Self {
        let cfg = Config::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let listeners: Vec<std::net::TcpListener> = (0..cfg.num_shards())
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
                l.set_nonblocking(true).expect("non-blocking listener");
                l
            })
            .collect();
        let addrs: Vec<String> = listeners
            .iter()
            .map(|l| l.local_addr().expect("bound address").to_string())
            .collect();
        let credential = shard_credential(path, &cfg);
        let nodes = listeners
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let tweak = tweak.clone();
                let credential = credential.clone();
                start_shard(path, i, &addrs, l, move |s: &mut ShardSetup| {
                    s.cfg.server.shard_token_file.clone_from(&credential);
                    tweak(s)
                })
            })
            .collect();
        let mut cfg = cfg;
        cfg.cluster.servers = addrs.clone();
        Self { cfg, addrs, nodes }
    }

    /// `http://<address of shard i>`.
    pub fn url(&self, i: usize) -> String {
        format!("http://{}", self.addrs[i])
    }

    /// Shard `i`'s log so far.
    pub fn log(&self, i: usize) -> String {
        self.nodes[i].log.text()
    }

    /// Waits (at most `limit` each) for every shard's end; their outcomes, by index.
    pub fn join(self, limit: Duration) -> Vec<anyhow::Result<Outcome>> {
        self.nodes.into_iter().map(|n| n.join(limit)).collect()
    }
}

/// A change of a shard's setup before it serves (see [`Shards::start_with`]).
pub trait Tweak: Fn(&mut ShardSetup) -> anyhow::Result<()> + Clone + Send + 'static {}

impl<F: Fn(&mut ShardSetup) -> anyhow::Result<()> + Clone + Send + 'static> Tweak for F {}

/// The tweak of `ps-server --resume`: the shard starts from the newest checkpoint version
/// every shard holds intact (`ps_server::load_checkpoint`).
pub fn resume(setup: &mut ShardSetup) -> anyhow::Result<()> {
    setup.resume_from = Some(ps_server::load_checkpoint(
        &setup.cfg,
        setup.index,
        setup.train_len,
    )?);
    Ok(())
}

/// The shard credential of an in-process cluster: the config's `[server] shard_token_file`, or
/// (as `ps-launch` gives its shards a fresh one) a fresh random one written beside the config.
fn shard_credential(path: &Path, cfg: &Config) -> Option<PathBuf> {
    if cfg.server.shard_token_file.is_some() {
        return cfg.server.shard_token_file.clone();
    }
    let file = path.with_file_name("inproc-shard-token");
    let token = ps_config::credential::Token::random();
    std::fs::write(&file, token.secret()).expect("write the shard credential");
    Some(file)
}

/// Shard `index` of the config at `path` on `listener`, every shard's address in `addrs`.
fn start_shard(
    path: &Path,
    index: usize,
    addrs: &[String],
    listener: std::net::TcpListener,
    tweak: impl Tweak,
) -> Node<Outcome> {
    let path = path.to_path_buf();
    let addrs = addrs.to_vec();
    Node::spawn(format!("shard-{index}"), 2, move |stop| async move {
        let shard0 = (index > 0).then(|| addrs[0].clone());
        let mut setup: ShardSetup =
            ps_server::load_setup(&path, index, shard0, &ps_config::Overrides::default())?;
        setup.cfg.cluster.servers = addrs;
        tweak(&mut setup)?;
        // as ps-server: a cosine schedule spans the run, in steps
        let total = setup.cfg.total_steps(setup.train_len)?;
        setup.cfg.schedule = setup.cfg.schedule_for(total);
        ps_server::check_output_dirs(&setup.cfg)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        ps_server::run_shard(setup, listener, async {
            let _ = stop.await;
        })
        .await
    })
}

/// Starts worker `rank` of `cfg` (its `[cluster] servers` the shards' addresses) on the CPU.
pub fn start_worker(cfg: &Config, rank: usize) -> Node<ps_worker::worker::Timing> {
    let cfg = cfg.clone();
    Node::spawn(format!("worker-{rank}"), 1, move |stop| async move {
        let classes = cfg.model.dims[cfg.model.dims.len() - 1];
        let train = dataset(&cfg.data.dir, Split::Train, classes)?;
        let test = dataset(&cfg.data.dir, Split::Test, classes)?;
        let threads =
            ps_worker::cpu_threads(cfg.worker.threads, cfg.cluster.workers + cfg.num_shards());
        let (backend, _) = ps_worker::device::open_backend("cpu", 0, &cfg.layout(), threads)?;
        let servers = cfg.cluster.servers.clone();
        let setup = ps_worker::worker::WorkerSetup {
            cfg,
            servers,
            rank,
            train,
            test,
            backend,
        };
        tokio::select! {
            r = ps_worker::worker::run_worker(setup) => r,
            _ = stop => anyhow::bail!("worker {rank}: stopped by the test"),
        }
    })
}

/// A split of the shipped MNIST (loaded once per test binary) or of another directory.
fn dataset(dir: &Path, split: Split, classes: usize) -> anyhow::Result<Dataset> {
    if dir == mnist_dir() && classes == 10 {
        return Ok(match split {
            Split::Train => mnist_train().clone(),
            Split::Test => mnist_test().clone(),
        });
    }
    load_split(dir, split, classes).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))
}

/// A finished in-process run: the output directory and every node's log.
pub struct Finished {
    /// `[server] out_dir`.
    pub out_dir: PathBuf,
    /// The shards' logs, by index.
    pub shard_logs: Vec<String>,
    /// The workers' logs, by rank.
    pub worker_logs: Vec<String>,
}

/// Runs the whole cluster of the config at `path` in this process to the end (bounded by
/// [`RUN_LIMIT`]): its shards, then its workers in rank order. Panics, with the node's log,
/// unless every worker finished and every shard ended [`Outcome::Finished`].
pub fn run_in_process(path: &Path) -> Finished {
    run_in_process_with(path, |_| Ok(()))
}

/// [`run_in_process`], each shard's setup changed by `tweak` first (e.g. [`resume`]).
pub fn run_in_process_with(path: &Path, tweak: impl Tweak) -> Finished {
    let shards = Shards::start_with(path, tweak);
    let workers: Vec<_> = (0..shards.cfg.cluster.workers)
        .map(|r| start_worker(&shards.cfg, r))
        .collect();
    finish(shards, workers)
}

/// Waits for `workers` then `shards` to end (each bounded by [`RUN_LIMIT`]); panics, with the
/// node's log, unless every worker finished and every shard ended [`Outcome::Finished`].
pub fn finish(shards: Shards, workers: Vec<Node<ps_worker::worker::Timing>>) -> Finished {
    let mut worker_logs = Vec::new();
    for w in workers {
        let (name, log) = (w.name.clone(), w.log.clone());
        if let Err(e) = w.join(RUN_LIMIT) {
            panic!("{name} failed: {e:#}; its log:\n{}", log.text());
        }
        worker_logs.push(log.text());
    }
    let out_dir = shards.cfg.server.out_dir.clone();
    let mut shard_logs = Vec::new();
    for s in shards.nodes {
        let (name, log) = (s.name.clone(), s.log.clone());
        match s.join(RUN_LIMIT) {
            Ok(Outcome::Finished) => {}
            other => panic!("{name} ended {other:?}; its log:\n{}", log.text()),
        }
        shard_logs.push(log.text());
    }
    Finished {
        out_dir,
        shard_logs,
        worker_logs,
    }
}
