//! A shard's figures in the Prometheus text format on `GET /metrics` (`ps-server
//! --metrics-listen ADDR` or `[server] metrics_addrs`): its version, the last step's global
//! loss, accuracy, learning rate, timing and workers, samples and pushes (accepted, and refused
//! by status code). A minimal HTTP/1.1 responder on its own listener: one request per
//! connection, bounded in size and time.

use crate::shard::StepFigures;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What a shard exposes; updated by the service, read by the exporter.
#[derive(Debug)]
pub struct Metrics {
    shard: usize,
    total_steps: u64,
    inner: Mutex<Inner>,
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
        Self {
            shard,
            total_steps,
            inner: Mutex::new(Inner {
                version,
                ..Inner::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A step was applied.
    pub fn step(&self, f: &StepFigures) {
        let mut m = self.lock();
        m.version = f.step + 1;
        m.samples_total += f.samples;
        if f.eval.1 > 0 {
            m.test_accuracy = Some(f.eval.0 as f64 / f.eval.1 as f64);
        }
        m.last = Some(f.clone());
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

    /// The exposition text.
    pub fn render(&self) -> String {
        let m = self.lock();
        let s = self.shard;
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "{name}{{shard=\"{s}\"{labels}}} {v}");
            }
        };
        let one = |v: f64| vec![(String::new(), v)];
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
                "Memory this shard expects to hold at its peak: parameters, optimizer state, snapshot, gradient buffers, receive windows.",
                &one(b as f64),
            );
        }
        metric(
            "ps_samples_total",
            "counter",
            "Training samples of the steps applied by this process.",
            &one(m.samples_total as f64),
        );
        let mut pushes = vec![(",outcome=\"accepted\"".to_string(), m.accepted as f64)];
        pushes.extend(
            m.refused
                .iter()
                .map(|(code, n)| (format!(",outcome=\"refused\",code=\"{code}\""), *n as f64)),
        );
        metric(
            "ps_checkpoints_total",
            "counter",
            "Due checkpoints, written or failed (a failed one was retried once).",
            &[
                (
                    ",outcome=\"written\"".to_string(),
                    m.checkpoints_written as f64,
                ),
                (
                    ",outcome=\"failed\"".to_string(),
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
            let per = |x: f64| {
                if f.samples > 0 {
                    x / f.samples as f64
                } else {
                    0.0
                }
            };
            let gauges = [
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
                    "Aggregation and optimizer time of the last step.",
                    f.apply_ms / 1e3,
                ),
            ];
            for (name, help, v) in gauges {
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
        out
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
            let line = buf[..n].split(|&b| b == b'\r').next().unwrap_or_default();
            let (status, body) = if line.starts_with(b"GET /metrics ") || line == b"GET /metrics" {
                ("200 OK", metrics.render())
            } else {
                (
                    "404 Not Found",
                    "only GET /metrics is served here\n".to_string(),
                )
            };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
