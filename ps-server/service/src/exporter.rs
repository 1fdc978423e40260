//! A shard's figures on `GET /metrics` (`ps-server --metrics-listen ADDR` or `[server]
//! metrics_addrs`), in Prometheus' text format 0.0.4, or in OpenMetrics 1.0 text when the
//! scraper asks for it (`Accept: application/openmetrics-text`): its version, the
//! last step's global loss, accuracy, learning rate, timing and workers, samples and pushes
//! (accepted, and refused by status code); histograms of the step time, the barrier wait and
//! each rank's arrival lag; the process's memory, CPU time and file descriptors. Encoded by
//! the `prometheus-client` crate; every sample but the `process_*` ones carries
//! `shard="<i>"` first. A minimal HTTP/1.1 responder on its own listener: one request per
//! connection, bounded in size and time.

use crate::shard::StepFigures;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The content type of the OpenMetrics 1.0 text exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of Prometheus' text format 0.0.4, served unless the scraper accepts
/// OpenMetrics (`promtool check metrics` reads it).
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The OpenMetrics exposition `om` in Prometheus' text format 0.0.4: a counter family is
/// named after its `_total` samples (in OpenMetrics the family drops the suffix), and the
/// `# UNIT` and `# EOF` lines, which 0.0.4 lacks, are left out.
pub fn text_format(om: &str) -> String {
    let counters: std::collections::HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let tail = if tail == "unknown" { "untyped" } else { tail };
                let suffix = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                out.push_str(&format!("{prefix}{name}{suffix} {tail}\n"));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// Histogram buckets of the timings, in seconds: 0.5 ms doubling to 65 s (and +Inf).
pub fn time_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0005, 2.0, 18)
}

fn time_histogram() -> Histogram {
    Histogram::new(time_buckets())
}

/// A rank's label set.
type RankLabel = Vec<(&'static str, String)>;

/// What a shard exposes; updated by the service, read by the exporter.
#[derive(Debug)]
pub struct Metrics {
    inner: Arc<Mutex<Inner>>,
    step_seconds: Histogram,
    barrier_wait_seconds: Histogram,
    arrival_lag_seconds: Family<RankLabel, Histogram, fn() -> Histogram>,
    registry: Registry,
    /// `GET /metrics` answered so far (for the linger after the run).
    scrapes: tokio::sync::watch::Sender<u64>,
}

/// The figures the service updates, encoded at each scrape ([`Figures`]).
#[derive(Debug)]
struct Figures {
    total_steps: u64,
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    version: u64,
    last: Option<StepFigures>,
    samples_total: u64,
    accepted: u64,
    refused: BTreeMap<String, u64>,
    test_accuracy: Option<f64>,
    checkpoints_written: u64,
    checkpoints_failed: u64,
    checkpoint_attempts_failed: u64,
    expected_memory: Option<u64>,
    noise_scale: Option<f64>,
}

impl Metrics {
    /// Metrics of shard `shard` of a run of `total_steps`, starting at `version`.
    pub fn new(shard: usize, total_steps: u64, version: u64) -> Self {
        let inner = Arc::new(Mutex::new(Inner {
            version,
            ..Inner::default()
        }));
        let step_seconds = time_histogram();
        let barrier_wait_seconds = time_histogram();
        let arrival_lag_seconds: Family<RankLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(time_histogram);
        let mut registry = Registry::default();
        // process metrics carry no shard label (Prometheus' usual names and labels)
        registry.register_collector(Box::new(ProcessCollector));
        let shard_registry =
            registry.sub_registry_with_label(("shard".into(), shard.to_string().into()));
        shard_registry.register_collector(Box::new(Figures {
            total_steps,
            inner: inner.clone(),
        }));
        // `register` ends each help text with a full stop itself
        shard_registry.register(
            "ps_step_duration_seconds",
            "Time between consecutive versions (one training step, as this shard sees it)",
            step_seconds.clone(),
        );
        shard_registry.register(
            "ps_barrier_wait_duration_seconds",
            "Time from the first to the last gradient of a step",
            barrier_wait_seconds.clone(),
        );
        shard_registry.register(
            "ps_arrival_lag_seconds",
            "How long after a step's first gradient each rank's gradient arrived (0 for the first)",
            arrival_lag_seconds.clone(),
        );
        Self {
            inner,
            step_seconds,
            barrier_wait_seconds,
            arrival_lag_seconds,
            registry,
            scrapes: tokio::sync::watch::Sender::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A step was applied.
    pub fn step(&self, f: &StepFigures) {
        self.step_seconds.observe(f.step_ms / 1e3);
        self.barrier_wait_seconds.observe(f.barrier_wait_ms / 1e3);
        for &(rank, lag_ms) in &f.arrival_lag_ms {
            self.arrival_lag_seconds
                .get_or_create(&vec![("rank", rank.to_string())])
                .observe(lag_ms / 1e3);
        }
        let mut m = self.lock();
        m.version = f.step + 1;
        m.samples_total += f.samples;
        if f.eval.1 > 0 {
            m.test_accuracy = Some(f.eval.0 as f64 / f.eval.1 as f64);
        }
        m.last = Some(f.clone());
    }

    /// The final evaluation's test accuracy (shard 0, at the end of the run).
    pub fn final_test_accuracy(&self, accuracy: f64) {
        self.lock().test_accuracy = Some(accuracy);
    }

    /// A due checkpoint was written, or failed (after its retry).
    pub fn checkpoint(&self, a: &crate::checkpoint::Attempted) {
        let mut m = self.lock();
        if a.written {
            m.checkpoints_written += 1;
        } else {
            m.checkpoints_failed += 1;
        }
        m.checkpoint_attempts_failed += u64::from(a.failed_attempts);
    }

    /// The shard's expected peak memory in bytes (stated at start-up).
    pub fn set_expected_memory(&self, bytes: u64) {
        self.lock().expected_memory = Some(bytes);
    }

    /// The smoothed gradient noise scale B_noise (shard 0, from 2 workers on).
    pub fn set_noise_scale(&self, b_noise: f64) {
        self.lock().noise_scale = Some(b_noise);
    }

    /// A push was counted (or acknowledged as a retry).
    pub fn accepted(&self) {
        self.lock().accepted += 1;
    }

    /// A push was refused with `code`.
    pub fn refused(&self, code: tonic::Code) {
        *self.lock().refused.entry(format!("{code:?}")).or_default() += 1;
    }

    /// `GET /metrics` answered so far.
    pub fn scrapes(&self) -> u64 {
        *self.scrapes.borrow()
    }

    /// After the run: waits until `/metrics` has been scraped more than `seen` times (take
    /// [`Metrics::scrapes`] before saying the run ended, so a scrape right after it counts),
    /// at most `linger`. True when it was.
    pub async fn linger_for_a_scrape(&self, seen: u64, linger: Duration) -> bool {
        let mut rx = self.scrapes.subscribe();
        tokio::time::timeout(linger, rx.wait_for(|n| *n > seen))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// The exposition text (OpenMetrics, ending with `# EOF`; see [`text_format`]).
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!("cannot encode the metrics: {e}");
        }
        out
    }
}

/// Labels of one sample, after `shard`.
type Labels = Vec<(String, String)>;

fn label(key: &str, value: &str) -> (String, String) {
    (key.to_string(), value.to_string())
}

/// Encodes one family: `kind` "gauge" or "counter" (a counter's `name` ends in `_total`, which
/// the encoder adds to the samples itself).
fn encode_family(
    encoder: &mut DescriptorEncoder,
    name: &str,
    kind: &str,
    help: &str,
    samples: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    let (base, metric_type) = match kind {
        "counter" => (
            name.strip_suffix("_total").unwrap_or(name),
            MetricType::Counter,
        ),
        _ => (name, MetricType::Gauge),
    };
    let mut family = encoder.encode_descriptor(base, help, None, metric_type)?;
    for (labels, v) in samples {
        let sample = family.encode_family(labels)?;
        match metric_type {
            MetricType::Counter => ConstCounter::new(*v).encode(sample)?,
            _ => ConstGauge::new(*v).encode(sample)?,
        }
    }
    Ok(())
}

impl Collector for Figures {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut result = Ok(());
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(Labels, f64)]| {
            if result.is_ok() {
                result = encode_family(&mut encoder, name, kind, help, samples);
            }
        };
        let one = |v: f64| vec![(Labels::new(), v)];
        metric(
            "ps_version",
            "gauge",
            "Steps this shard has applied.",
            &one(m.version as f64),
        );
        metric(
            "ps_total_steps",
            "gauge",
            "Steps of the run.",
            &one(self.total_steps as f64),
        );
        if let Some(b) = m.expected_memory {
            metric(
                "ps_expected_peak_memory_bytes",
                "gauge",
                "Memory this shard expects to hold at its peak: parameters, optimizer state, snapshot, gradient buffers, receive windows, gRPC pullers.",
                &one(b as f64),
            );
        }
        metric(
            "ps_samples_total",
            "counter",
            "Training samples of the steps applied by this process.",
            &one(m.samples_total as f64),
        );
        let mut pushes = vec![(vec![label("outcome", "accepted")], m.accepted as f64)];
        pushes.extend(m.refused.iter().map(|(code, n)| {
            (
                vec![label("outcome", "refused"), label("code", code)],
                *n as f64,
            )
        }));
        metric(
            "ps_checkpoints_total",
            "counter",
            "Due checkpoints, written or failed (a failed one was retried once).",
            &[
                (
                    vec![label("outcome", "written")],
                    m.checkpoints_written as f64,
                ),
                (
                    vec![label("outcome", "failed")],
                    m.checkpoints_failed as f64,
                ),
            ],
        );
        metric(
            "ps_checkpoint_write_failures_total",
            "counter",
            "Checkpoint write attempts that failed (retries included).",
            &one(m.checkpoint_attempts_failed as f64),
        );
        metric(
            "ps_pushes_total",
            "counter",
            "Gradient pushes, accepted or refused (by gRPC status code).",
            &pushes,
        );
        if let Some(f) = &m.last {
            for (name, help, v) in last_step_gauges(f) {
                metric(name, "gauge", help, &one(v));
            }
        }
        if let Some(b) = m.noise_scale {
            metric(
                "ps_gradient_noise_scale",
                "gauge",
                "Smoothed gradient noise scale B_noise = tr(Sigma)/|G|^2 (the critical batch size, McCandlish et al. 2018), shard 0 only: a noisy estimate.",
                &one(b),
            );
        }
        if let Some(acc) = m.test_accuracy {
            metric(
                "ps_test_accuracy",
                "gauge",
                "Test-set accuracy of the last periodic evaluation.",
                &one(acc),
            );
        }
        result
    }
}

/// The gauges of the last step's figures: (name, help, value).
fn last_step_gauges(f: &StepFigures) -> [(&'static str, &'static str, f64); 9] {
    let per = |x: f64| {
        if f.samples > 0 {
            x / f.samples as f64
        } else {
            0.0
        }
    };
    [
        (
            "ps_loss",
            "Mean training loss of the last step, over every worker's samples.",
            per(f.loss_sum),
        ),
        (
            "ps_train_accuracy",
            "Training accuracy of the last step, over every worker's samples.",
            per(f.correct as f64),
        ),
        ("ps_learning_rate", "Learning rate of the last step.", f.lr),
        (
            "ps_grad_norm_shard",
            "L2 norm of this shard's slice of the last aggregated gradient.",
            f.grad_sq_norm.sqrt(),
        ),
        (
            "ps_workers_in",
            "Workers whose gradient went into the last step.",
            f64::from(f.workers_in),
        ),
        (
            "ps_step_seconds",
            "Time between the last two versions.",
            f.step_ms / 1e3,
        ),
        (
            "ps_barrier_wait_seconds",
            "Time from the first to the last gradient of the last step.",
            f.barrier_wait_ms / 1e3,
        ),
        (
            "ps_apply_seconds",
            "Aggregation and optimizer time of the last step at its barrier's completion.",
            f.apply_ms / 1e3,
        ),
        (
            "ps_buckets_early",
            "Buckets of the last step applied before its barrier completed (0: applied over the whole range at once).",
            f64::from(f.buckets.map_or(0, |(early, _)| early)),
        ),
    ]
}

/// The process's figures from `/proc/self` (Linux; elsewhere none), under Prometheus' usual
/// names: resident and virtual memory, CPU seconds, threads, open and maximum file
/// descriptors, start time.
#[derive(Debug)]
struct ProcessCollector;

/// One reading of `/proc/self`.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessFigures {
    /// Resident set size, bytes.
    pub resident_bytes: f64,
    /// Virtual memory size, bytes.
    pub virtual_bytes: f64,
    /// User + system CPU time, seconds.
    pub cpu_seconds: f64,
    /// Threads.
    pub threads: f64,
    /// Open file descriptors.
    pub open_fds: f64,
    /// The soft limit on file descriptors.
    pub max_fds: f64,
    /// Start time, seconds since the Unix epoch.
    pub start_time_seconds: f64,
}

impl ProcessFigures {
    /// Reads `/proc/self/stat`, `/proc/self/fd` and `/proc/stat`; None where there is no /proc.
    pub fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // the command name (field 2) is in parentheses and may hold spaces: split after it
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        // fields from 3 on: f[0] is field 3 (state)
        let field = |n: usize| -> Option<f64> { f.get(n - 3)?.parse().ok() };
        // SAFETY: sysconf only reads configuration values.
        let (ticks, page) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let ticks = if ticks > 0 { ticks as f64 } else { 100.0 };
        let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<f64>().ok())
        });
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as f64;
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct it is given.
        let max_fds = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            lim.rlim_cur as f64
        } else {
            f64::NAN
        };
        Some(Self {
            cpu_seconds: (field(14)? + field(15)?) / ticks,
            threads: field(20)?,
            start_time_seconds: boot.map_or(f64::NAN, |b| b + field(22).unwrap_or(0.0) / ticks),
            virtual_bytes: field(23)?,
            resident_bytes: field(24)? * page.max(1) as f64,
            open_fds,
            max_fds,
        })
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(p) = ProcessFigures::read() else {
            return Ok(());
        };
        let none = Labels::new();
        let families = [
            (
                "process_resident_memory_bytes",
                "gauge",
                "Resident memory size in bytes.",
                p.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "gauge",
                "Virtual memory size in bytes.",
                p.virtual_bytes,
            ),
            (
                "process_cpu_seconds_total",
                "counter",
                "Total user and system CPU time spent in seconds.",
                p.cpu_seconds,
            ),
            (
                "process_threads",
                "gauge",
                "Number of OS threads in the process.",
                p.threads,
            ),
            (
                "process_open_fds",
                "gauge",
                "Number of open file descriptors.",
                p.open_fds,
            ),
            (
                "process_max_fds",
                "gauge",
                "Maximum number of open file descriptors.",
                p.max_fds,
            ),
            (
                "process_start_time_seconds",
                "gauge",
                "Start time of the process since unix epoch in seconds.",
                p.start_time_seconds,
            ),
        ];
        for (name, kind, help, v) in families {
            if v.is_finite() {
                encode_family(&mut encoder, name, kind, help, &[(none.clone(), v)])?;
            }
        }
        Ok(())
    }
}

/// Answers `GET /metrics` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: std::sync::Arc<Metrics>) {
    loop {
        let mut sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                // e.g. out of file descriptors: do not spin
                tracing::debug!("metrics listener: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut n = 0;
            // the request head: at most 8 KiB, within 5 s
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while n < buf.len() && !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => return false,
                        Ok(k) => n += k,
                    }
                }
                true
            })
            .await;
            if !matches!(read, Ok(true)) {
                return;
            }
            let head_text = String::from_utf8_lossy(&buf[..n]);
            let line = head_text.lines().next().unwrap_or_default();
            // content negotiation: OpenMetrics when the scraper accepts it, else text 0.0.4
            let openmetrics = head_text.lines().any(|l| {
                l.split_once(':').is_some_and(|(k, v)| {
                    k.trim().eq_ignore_ascii_case("accept")
                        && v.contains("application/openmetrics-text")
                })
            });
            let (status, content_type, body) =
                if line.starts_with("GET /metrics ") || line == "GET /metrics" {
                    let om = metrics.render();
                    if openmetrics {
                        ("200 OK", CONTENT_TYPE, om)
                    } else {
                        ("200 OK", TEXT_CONTENT_TYPE, text_format(&om))
                    }
                } else {
                    (
                        "404 Not Found",
                        "text/plain; charset=utf-8",
                        "only GET /metrics is served here\n".to_string(),
                    )
                };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
            if status.starts_with("200") {
                metrics.scrapes.send_modify(|n| *n += 1);
            }
        });
    }
}
