//! Helpers for the integration tests: a builder of the run's set-up ([`Spec`]: config, data,
//! cluster shape; [`Spec::small`] the 1-shard, 2-worker set-up of the protocol tests) written
//! into a temporary directory ([`Spec::prepare`]); a cluster in this process ([`inproc`]:
//! shards and workers as tasks on 127.0.0.1:0) for the tests of the protocol and the math,
//! or of real `ps-server` and `ps-worker` processes ([`run_cluster`]) where the process is the
//! subject; the weights the shards wrote, and the single-process reference; the Slurm batch
//! script run here ([`slurm`]).

pub mod inproc;
pub mod slurm;

use ps_config::{Aggregation, Config, LossReduction, TestConfig, Transport};
use ps_data::idx::{Dataset, Split, load_split};
use ps_launch::{LocalCluster, bin_dir};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

/// The shipped MNIST directory (`PS_DATA_DIR` overrides it, for test executables copied to
/// another machine, e.g. by scripts/gpu-check.sh).
pub fn mnist_dir() -> PathBuf {
    std::env::var_os("PS_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/mnist"))
}

/// The MNIST training set, loaded once per test binary.
pub fn mnist_train() -> &'static Dataset {
    static TRAIN: OnceLock<Dataset> = OnceLock::new();
    TRAIN.get_or_init(|| load_split(&mnist_dir(), Split::Train, 10).expect("shipped MNIST loads"))
}

/// The MNIST test set, loaded once per test binary.
pub fn mnist_test() -> &'static Dataset {
    static TEST: OnceLock<Dataset> = OnceLock::new();
    TEST.get_or_init(|| load_split(&mnist_dir(), Split::Test, 10).expect("shipped MNIST loads"))
}

/// What varies between the test configs: the run's shape as typed fields, everything else as
/// a typed [`TestConfig`] (see [`Spec::base`]); written to TOML by `TestConfig`, never by hand.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Shards.
    pub shards: usize,
    /// Workers.
    pub workers: usize,
    /// Hidden widths.
    pub hidden: Vec<usize>,
    /// Global batch.
    pub global_batch: usize,
    /// Steps.
    pub steps: u64,
    /// `[train] loss_reduction`.
    pub loss: LossReduction,
    /// `[train] aggregation`.
    pub aggregation: Aggregation,
    /// `[cluster] transport`.
    pub transport: Transport,
    /// Everything else (optimizer, schedule, `[server]`, `[checkpoint]`, token and TLS): the
    /// fields above, the data set and the output directory are set over it.
    pub config: TestConfig,
}

impl Default for Spec {
    fn default() -> Self {
        Self {
            shards: 2,
            workers: 4,
            hidden: vec![32],
            global_batch: 32,
            steps: 20,
            loss: LossReduction::Mean,
            aggregation: Aggregation::Mean,
            transport: Transport::Auto,
            config: Self::base(),
        }
    }
}

impl Spec {
    /// The default of [`Spec::config`]: SGD with lr 0.1 and momentum 0.9, seed 7, log every
    /// 5 steps, a barrier timeout of 120 s.
    pub fn base() -> TestConfig {
        TestConfig::new().sgd(0.1, 0.9).barrier_timeout_secs(120.0)
    }

    /// The TOML text of this spec (server addresses are placeholders: the tests bind port 0).
    pub fn toml(&self, out_dir: &Path) -> String {
        self.config
            .clone()
            .shards(self.shards)
            .workers(self.workers)
            .transport(self.transport)
            .hidden(&self.hidden)
            .data_dir(mnist_dir())
            .global_batch(self.global_batch as u64)
            .steps(self.steps)
            .loss_reduction(self.loss)
            .aggregation(self.aggregation)
            .out_dir(out_dir)
            .toml()
    }

    /// The set-up of most protocol tests: 1 shard, 2 workers, hidden layer of 4, 2 steps of
    /// global batch 32, SGD at lr 0.5 without momentum (the rest as [`Spec::default`]).
    pub fn small() -> Self {
        Self {
            shards: 1,
            workers: 2,
            hidden: vec![4],
            steps: 2,
            config: Self::base().sgd(0.5, 0.0),
            ..Self::default()
        }
    }

    /// With `n` shards.
    pub fn shards(mut self, n: usize) -> Self {
        self.shards = n;
        self
    }

    /// With `n` workers.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    /// With these hidden widths.
    pub fn hidden(mut self, widths: &[usize]) -> Self {
        self.hidden = widths.to_vec();
        self
    }

    /// With global batch `b`.
    pub fn batch(mut self, b: usize) -> Self {
        self.global_batch = b;
        self
    }

    /// With `n` steps.
    pub fn steps(mut self, n: u64) -> Self {
        self.steps = n;
        self
    }

    /// With this `[cluster] transport`.
    pub fn transport(mut self, t: Transport) -> Self {
        self.transport = t;
        self
    }

    /// With this `[train] aggregation`.
    pub fn aggregation(mut self, a: Aggregation) -> Self {
        self.aggregation = a;
        self
    }

    /// With this `[train] loss_reduction`.
    pub fn loss(mut self, l: LossReduction) -> Self {
        self.loss = l;
        self
    }

    /// With everything else from `config` (see [`Spec::base`]).
    pub fn config(mut self, config: TestConfig) -> Self {
        self.config = config;
        self
    }

    /// Writes the config into a new temporary directory.
    pub fn prepare(&self) -> Prepared {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (path, cfg) = self.write(dir.path());
        Prepared { dir, path, cfg }
    }

    /// Writes the config into `dir/config.toml` and returns its path and parsed form.
    pub fn write(&self, dir: &Path) -> (PathBuf, Config) {
        let path = dir.join("config.toml");
        std::fs::write(&path, self.toml(&dir.join("out"))).expect("write config");
        let cfg = Config::load(&path).unwrap_or_else(|e| panic!("test config is valid: {e}"));
        (path, cfg)
    }
}

/// A [`Spec`] written into a temporary directory (removed when this is dropped).
pub struct Prepared {
    /// The directory: `config.toml`, `out/`, `logs/` of a process cluster.
    pub dir: tempfile::TempDir,
    /// `dir/config.toml`.
    pub path: PathBuf,
    /// Its parsed form (`[cluster] servers` placeholders: clusters bind port 0).
    pub cfg: Config,
}

impl Prepared {
    /// Runs the whole cluster in this process to the end ([`inproc::run_in_process`]).
    pub fn run_in_process(&self) -> inproc::Finished {
        inproc::run_in_process(&self.path)
    }

    /// Runs the whole cluster in this process to the end; the final weights.
    pub fn weights_in_process(&self) -> Vec<f32> {
        self.run_in_process();
        cluster_weights(&self.cfg)
    }

    /// Starts the shards in this process ([`inproc::Shards::start`]).
    pub fn shards_in_process(&self) -> inproc::Shards {
        inproc::Shards::start(&self.path)
    }
}

/// How to start the workers.
#[derive(Debug, Clone, Default)]
pub struct Start {
    /// Worker ranks in start order (default 0..W).
    pub order: Option<Vec<usize>>,
    /// Pause between starting two workers.
    pub delay: Duration,
    /// Extra arguments for every worker (e.g. `--device=cuda`).
    pub worker_args: Vec<String>,
    /// Extra arguments for every server (e.g. `--resume`).
    pub server_args: Vec<String>,
    /// The run id every process is given (`--run-id`), if any.
    pub run_id: Option<String>,
}

/// Runs a whole cluster for the config at `path` to completion; returns its output directory.
/// Panics with the failing process's log on any failure.
pub fn run_cluster(path: &Path, cfg: &Config, start: &Start) -> PathBuf {
    let dir = path.parent().expect("config dir");
    let mut cluster = LocalCluster::new(bin_dir(), path.to_path_buf(), Some(dir.join("logs")));
    cluster.elastic = cfg.server.barrier_policy == ps_config::BarrierPolicy::Continue;
    cluster.run_id = start.run_id.clone();
    cluster
        .start_servers(
            cfg.num_shards(),
            &start.server_args,
            Duration::from_secs(60),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let order = start
        .order
        .clone()
        .unwrap_or_else(|| (0..cfg.cluster.workers).collect());
    for r in order {
        cluster
            .start_worker(r, cfg.cluster.workers, &start.worker_args)
            .unwrap_or_else(|e| panic!("{e}"));
        std::thread::sleep(start.delay);
    }
    cluster
        .wait(Duration::from_secs(300), &|| false)
        .unwrap_or_else(|e| panic!("{e}"));
    cfg.server.out_dir.clone()
}

/// The flat weights a finished cluster wrote.
pub fn cluster_weights(cfg: &Config) -> Vec<f32> {
    let (w, version) = ps_model::weights::read_shards(
        &cfg.server.out_dir,
        cfg.num_shards(),
        cfg.layout().num_params(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        version,
        cfg.total_steps(mnist_train().len()).unwrap(),
        "shards at the last version"
    );
    w
}

/// The single-process reference's final weights for `cfg`.
pub fn reference_weights(cfg: &Config) -> Vec<f32> {
    ps_worker::reference::run_reference(cfg, mnist_train())
        .expect("reference runs")
        .weights
}

/// Largest relative difference (per tensor, see `ps_model::weights::max_rel_diff`).
pub fn rel_diff(cfg: &Config, a: &[f32], b: &[f32]) -> f64 {
    ps_model::weights::max_rel_diff(&cfg.layout(), a, b).0
}

/// The final weights of an uninterrupted run of `spec` (in a temporary directory), run in
/// this process.
pub fn uninterrupted_weights(spec: &Spec) -> Vec<f32> {
    spec.prepare().weights_in_process()
}

/// Panics with `what` unless `a` and `b` hold the same bits.
pub fn assert_bit_identical(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    if let Some(i) = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
    {
        panic!("{what}: first difference at {i}: {} vs {}", a[i], b[i]);
    }
}

/// Panics unless `metrics` (a `metrics.jsonl`) holds steps 1..=`steps` once each, in order, each
/// line with a wall-clock `time` (Unix seconds, not decreasing, within the last day), and one
/// closing `final` line at step `steps` with the test accuracy.
pub fn assert_metrics_steps(metrics: &str, steps: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let mut seen = Vec::new();
    let mut last_time = 0.0;
    let mut finals = 0;
    for line in metrics.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        let time = v["time"]
            .as_f64()
            .unwrap_or_else(|| panic!("no time: {line}"));
        assert!(
            time >= last_time && time <= now + 1.0 && time > now - 86400.0,
            "time {time} after {last_time} (now {now}): {line}"
        );
        last_time = time;
        if v.get("final").is_some() {
            finals += 1;
            assert_eq!(v["step"].as_u64(), Some(steps), "{line}");
            assert!(v["test_acc"].as_f64().is_some(), "{line}");
        } else {
            seen.push(v["step"].as_u64().unwrap());
        }
    }
    assert_eq!(seen, (1..=steps).collect::<Vec<_>>(), "{metrics}");
    assert_eq!(finals, 1, "one closing line: {metrics}");
}

/// The header of a gRPC push of `len` values of `rank` for `step`, sent over the network (not
/// shared memory), announcing 8 samples, a loss sum of 10 and 3 correct.
pub fn push_header(rank: u32, step: u64, len: usize) -> ps_proto::pb::PushHeader {
    ps_proto::pb::PushHeader {
        rank,
        step,
        samples: 8,
        loss_sum: 10.0,
        correct: 3,
        len: len as u64,
        eval_correct: 0,
        eval_count: 0,
        shm: false,
    }
}

/// The registration of `rank` of `world` workers with the only shard of a cluster of
/// `num_params` parameters, over the network (no shared memory) and with the built-in model.
pub fn register_request(rank: u32, world: u32, num_params: usize) -> ps_proto::pb::RegisterRequest {
    ps_proto::pb::RegisterRequest {
        protocol_version: ps_proto::PROTOCOL_VERSION,
        rank,
        world_size: world,
        num_params: num_params as u64,
        shard: 0,
        num_shards: 1,
        shared_memory: false,
        grad_file: String::new(),
        grad_token: 0,
        model: Vec::new(),
    }
}

/// A pull over the network (no shared memory) of the first version `>= min_version`, with
/// `lease`.
pub fn pull_request(
    min_version: u64,
    lease: Option<ps_proto::pb::Lease>,
) -> ps_proto::pb::PullRequest {
    ps_proto::pb::PullRequest {
        min_version,
        shm: false,
        exact: false,
        lease,
    }
}

/// Starts `ps-launch --config <config> <args>` in the background as the leader of its own
/// process group (as a shell job is), stdout and stderr into `<log>.out` / `<log>.err`.
pub fn spawn_launch(config: &Path, args: &[&str], log: &Path) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    let out = std::fs::File::create(log.with_extension("out")).expect("stdout file");
    let err = std::fs::File::create(log.with_extension("err")).expect("stderr file");
    std::process::Command::new(bin_dir().join("ps-launch"))
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .expect("ps-launch starts")
}

/// Waits (at most `limit`, panicking with `what`) until `file` holds at least `lines` lines.
pub fn wait_for_lines(file: &Path, lines: usize, limit: Duration, what: &str) {
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(file).map_or(0, |t| t.lines().count()) < lines {
        assert!(
            t0.elapsed() < limit,
            "{what}: {} has fewer than {lines} lines after {limit:?}",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The pids a live `ps-launch` recorded in its output directory's lock file: (shards, workers).
/// Waits (at most `limit`) until it has recorded both.
pub fn launch_pids(out_dir: &Path, limit: Duration) -> (Vec<i32>, Vec<i32>) {
    let file = out_dir.join(ps_launch::outdir::LAUNCH_LOCK);
    let t0 = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let list = |key: &str| -> Vec<i32> {
            text.split("; ")
                .find_map(|part| part.trim().strip_prefix(key))
                .map(|l| {
                    l.split(", ")
                        .filter_map(|p| p.trim().parse().ok())
                        .collect()
                })
                .unwrap_or_default()
        };
        let (s, w) = (list("shard pids "), list("worker pids "));
        if !s.is_empty() && !w.is_empty() {
            return (s, w);
        }
        assert!(
            t0.elapsed() < limit,
            "no pids recorded in {} after {limit:?}: {text}",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A raw generated gRPC client (for requests `ShardClient` would not send) that keeps the
/// lease each registration through it was granted, as a worker does, so that its pushes,
/// pulls and leaves can present it.
#[derive(Clone)]
pub struct RawClient {
    /// The generated client.
    pub rpc:
        ps_proto::pb::parameter_server_client::ParameterServerClient<tonic::transport::Channel>,
    leases: std::collections::HashMap<u32, ps_proto::pb::Lease>,
}

impl RawClient {
    /// Connects to `url` (`http://host:port`).
    pub async fn connect(url: String) -> Result<Self, tonic::transport::Error> {
        Ok(Self {
            rpc: ps_proto::pb::parameter_server_client::ParameterServerClient::connect(url).await?,
            leases: Default::default(),
        })
    }

    /// Registers, keeping the lease granted.
    pub async fn register(
        &mut self,
        req: ps_proto::pb::RegisterRequest,
    ) -> Result<tonic::Response<ps_proto::pb::RegisterReply>, tonic::Status> {
        let rank = req.rank;
        let r = self.rpc.register(req).await?;
        if let Some(l) = &r.get_ref().lease {
            self.leases.insert(rank, l.clone());
        }
        Ok(r)
    }

    /// The lease `rank` was granted through this client.
    pub fn lease(&self, rank: u32) -> Option<ps_proto::pb::Lease> {
        self.leases.get(&rank).cloned()
    }

    /// Presents `lease` (granted through another client) for its rank from now on.
    pub fn adopt(&mut self, lease: Option<ps_proto::pb::Lease>) {
        if let Some(l) = lease {
            self.leases.insert(l.rank, l);
        }
    }

    /// Any lease this client holds (the lowest rank's): what its pulls present.
    pub fn any_lease(&self) -> Option<ps_proto::pb::Lease> {
        self.leases
            .iter()
            .min_by_key(|(r, _)| **r)
            .map(|(_, l)| l.clone())
    }

    /// Pushes `msgs` (a push's chunks), the first presenting the lease of its header's rank.
    pub async fn push(
        &mut self,
        msgs: Vec<ps_proto::pb::PushChunk>,
    ) -> Result<tonic::Response<ps_proto::pb::PushReply>, tonic::Status> {
        let rank = msgs.first().and_then(|c| c.header.as_ref()).map(|h| h.rank);
        let lease = rank.and_then(|r| self.lease(r));
        let msgs = ps_net::client::with_lease(msgs, lease);
        self.rpc.push(tokio_stream::iter(msgs)).await
    }
}

/// A way to damage a checkpoint file: [`corrupt_first_value`], [`truncate_file`].
pub type Damage = fn(&Path);

/// Damages a checkpoint (a safetensors file) as a bad disk would: adds 0.5 to its first value
/// (the first f32 after the header), leaving its length and header as they are.
pub fn corrupt_first_value(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let at = 8 + n;
    let v = f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) + 0.5;
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

/// Truncates a file to three quarters of its length (a write cut short by a full disk).
pub fn truncate_file(path: &Path) {
    let len = std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len * 3 / 4)
        .unwrap();
}

/// Starts the one shard of `config` with `--health-listen 127.0.0.1:0`, its log under `logs`;
/// returns the cluster and the health port's address, read from the shard's log.
pub fn start_shard_with_health(config: PathBuf, logs: &Path) -> (LocalCluster, String) {
    let mut cluster = LocalCluster::new(bin_dir(), config, Some(logs.to_path_buf()));
    cluster
        .start_servers(
            1,
            &["--health-listen".into(), "127.0.0.1:0".into()],
            Duration::from_secs(60),
        )
        .unwrap();
    let addr = logged_addr(
        &logs.join("shard-0.log"),
        "gRPC health (grpc.health.v1, plaintext) on ",
    );
    (cluster, addr)
}

/// The address a shard logged after `marker` (e.g. "Prometheus metrics on http://"), waiting
/// for it at most 30 s.
pub fn logged_addr(log: &Path, marker: &str) -> String {
    let text = wait_for_log(log, marker, Duration::from_secs(30));
    let rest = text.split(marker).nth(1).unwrap_or_default();
    rest.split(|c: char| c.is_whitespace() || c == '/')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Waits (at most `limit`, panicking with the text so far) until the log file `log` holds
/// `needle`; its text.
pub fn wait_for_log(log: &Path, needle: &str, limit: Duration) -> String {
    let t0 = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(
            t0.elapsed() < limit,
            "no {needle:?} in {} within {limit:?}:\n{text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A TCP proxy on 127.0.0.1 in front of `target` that holds back every read from the target
/// (the replies) for `delay` before passing it on, requests going through at once: a shard
/// whose answers come late. Runs on background threads for the rest of the test process;
/// returns the proxy's address.
pub fn delaying_proxy(target: String, delay: Duration) -> String {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    fn pipe(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    std::thread::sleep(delay);
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("proxy binds");
    let addr = listener.local_addr().expect("proxy address").to_string();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { break };
            let Ok(server) = TcpStream::connect(&target) else {
                continue; // the client sees its connection closed
            };
            let _ = (client.set_nodelay(true), server.set_nodelay(true));
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || pipe(c2, s2, Duration::ZERO));
            std::thread::spawn(move || pipe(server, client, delay));
        }
    });
    addr
}
