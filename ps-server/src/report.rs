//! What users watch: shard 0 joins its own step figures with the squared gradient norms the
//! other shards report, then logs one line per step (every `log_every`) with the cluster-wide
//! loss, accuracy, whole-gradient norm, lr, workers, samples, timing and slowest rank, and
//! appends the same as a JSON line to the metrics file. Every other shard logs its own barrier
//! and timing, and reports to shard 0.

use crate::shard::StepFigures;
use ps_common::pb::StepReport;
use ps_common::pb::parameter_server_client::ParameterServerClient;
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How long shard 0 waits for the other shards' reports of a step before logging without them.
const REPORT_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug)]
enum Event {
    Local(StepFigures),
    Remote(StepReport),
    /// Emit everything still pending (the run is ending), then acknowledge.
    Flush(tokio::sync::oneshot::Sender<()>),
    /// The final test evaluation (step, accuracy), for TensorBoard; acknowledged.
    FinalEval(u64, f64, tokio::sync::oneshot::Sender<()>),
}

/// The handle handlers use to hand over step figures.
#[derive(Debug, Clone)]
pub struct Reporter {
    tx: mpsc::UnboundedSender<Event>,
}

/// Settings of the reporter task.
#[derive(Debug, Clone)]
pub struct ReporterConfig {
    /// This shard.
    pub shard: usize,
    /// S.
    pub num_shards: usize,
    /// W.
    pub world: usize,
    /// Steps of the run.
    pub total_steps: u64,
    /// Log every N steps.
    pub log_every: u64,
    /// Shard 0's metrics file.
    pub metrics_file: Option<PathBuf>,
    /// Append to it (a resumed run) instead of starting it afresh.
    pub append_metrics: bool,
    /// Shard 0's address (for shards > 0).
    pub shard0: Option<String>,
    /// How to reach shard 0 (token, TLS).
    pub security: ps_common::auth::ClientSecurity,
    /// The shard credential put on reports (`[server] shard_token_file`).
    pub shard_token: Option<ps_common::auth::Token>,
    /// Shard 0 writes TensorBoard event files here (next to the metrics file).
    pub tensorboard_dir: Option<PathBuf>,
    /// The version a resumed run starts at (its event file says so).
    pub resumed_at: Option<u64>,
}

impl Reporter {
    /// Starts the reporter task and returns its handle.
    pub fn spawn(cfg: ReporterConfig) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(cfg, rx));
        Self { tx }
    }

    /// This shard finished a step.
    pub fn step_done(&self, f: StepFigures) {
        let _ = self.tx.send(Event::Local(f));
    }

    /// Logs whatever is still waiting for other shards' reports, and waits (at most 2 s) until
    /// it is written: called when the run ends.
    pub async fn flush(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Event::Flush(tx)).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(2), rx).await;
        }
    }

    /// The final test evaluation after `step` steps (shard 0: to TensorBoard); waits (at
    /// most 2 s) until it is written.
    pub async fn final_eval(&self, step: u64, accuracy: f64) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Event::FinalEval(step, accuracy, tx)).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(2), rx).await;
        }
    }

    /// Another shard reported a step (shard 0 only).
    pub fn remote_report(&self, r: StepReport) {
        let _ = self.tx.send(Event::Remote(r));
    }
}

#[derive(Default)]
struct Pending {
    local: Option<StepFigures>,
    remote_sq: f64,
    remote: usize,
    first_seen: Option<Instant>,
    /// The shards that reported (a second report of a shard for a step is ignored).
    from: std::collections::BTreeSet<u32>,
}

async fn run(cfg: ReporterConfig, mut rx: mpsc::UnboundedReceiver<Event>) {
    if cfg.shard != 0 {
        forward_to_shard0(cfg, rx).await;
        return;
    }
    let mut metrics = cfg.metrics_file.as_ref().and_then(|p| {
        let open = || -> std::io::Result<std::fs::File> {
            if let Some(d) = p.parent() {
                std::fs::create_dir_all(d)?;
            }
            std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(cfg.append_metrics)
                .truncate(!cfg.append_metrics)
                .open(p)
        };
        open()
            .map_err(|e| tracing::warn!("cannot write metrics file {}: {e}", p.display()))
            .ok()
    });
    let mut tb = cfg.tensorboard_dir.as_ref().and_then(|d| {
        crate::tensorboard::EventWriter::create(d, cfg.resumed_at)
            .map_err(|e| tracing::warn!("cannot write TensorBoard events in {}: {e}", d.display()))
            .ok()
    });
    if let Some(w) = &tb {
        tracing::info!("TensorBoard events in {}", w.path().display());
    }
    let mut pending: BTreeMap<u64, Pending> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let Some(ev) = ev else { break };
                let step = match ev {
                    Event::Flush(done) => {
                        for (_, p) in std::mem::take(&mut pending) {
                            if p.local.is_some() {
                                emit(&cfg, p, metrics.as_mut(), tb.as_mut());
                            }
                        }
                        let _ = done.send(());
                        continue;
                    }
                    Event::FinalEval(step, acc, done) => {
                        if let Some(w) = tb.as_mut() {
                            tensorboard_scalars(w, step, &[("test/accuracy", acc)]);
                        }
                        let _ = done.send(());
                        continue;
                    }
                    Event::Local(f) => {
                        let step = f.step;
                        let p = pending.entry(step).or_default();
                        p.first_seen.get_or_insert_with(Instant::now);
                        p.local = Some(f);
                        step
                    }
                    Event::Remote(r) => {
                        let p = pending.entry(r.step).or_default();
                        p.first_seen.get_or_insert_with(Instant::now);
                        if !p.from.insert(r.shard) {
                            tracing::debug!("step {}: a second report of shard {} ignored", r.step, r.shard);
                            continue;
                        }
                        p.remote_sq += r.grad_sq_norm;
                        p.remote += 1;
                        r.step
                    }
                };
                if let Some(p) = pending.get(&step)
                    && p.local.is_some()
                    && p.remote + 1 == cfg.num_shards
                {
                    let p = pending.remove(&step).expect("present");
                    emit(&cfg, p, metrics.as_mut(), tb.as_mut());
                }
            }
            _ = tick.tick() => {
                let stale: Vec<u64> = pending
                    .iter()
                    .filter(|(_, p)| p.local.is_some() && p.first_seen.is_some_and(|t| t.elapsed() > REPORT_WAIT))
                    .map(|(s, _)| *s)
                    .collect();
                for s in stale {
                    let p = pending.remove(&s).expect("present");
                    tracing::warn!("step {s}: only {} of {} shards reported; the gradient norm covers those", p.remote + 1, cfg.num_shards);
                    emit(&cfg, p, metrics.as_mut(), tb.as_mut());
                }
                // reports of a step this shard never applied (it failed, or they were wrong)
                // are not kept past twice the wait
                pending.retain(|s, p| {
                    let keep = p.local.is_some() || p.first_seen.is_none_or(|t| t.elapsed() <= 2 * REPORT_WAIT);
                    if !keep {
                        tracing::debug!("step {s}: {} reports dropped, this shard never applied the step", p.remote);
                    }
                    keep
                });
            }
        }
    }
}

fn emit(
    cfg: &ReporterConfig,
    p: Pending,
    metrics: Option<&mut std::fs::File>,
    tb: Option<&mut crate::tensorboard::EventWriter>,
) {
    let f = p.local.expect("local figures present");
    let norm = (f.grad_sq_norm + p.remote_sq).sqrt();
    let samples = f.samples.max(1) as f64;
    let loss = f.loss_sum / samples;
    let acc = f.correct as f64 / samples;
    let test_acc = (f.eval.1 > 0).then(|| f.eval.0 as f64 / f.eval.1 as f64);
    let last = f.step + 1 == cfg.total_steps;
    if (f.step + 1).is_multiple_of(cfg.log_every) || f.step == 0 || last {
        tracing::info!(
            "step {}/{} | loss {:.4} | train acc {:.2}% | grad norm {:.4} | lr {:.5} | workers {}/{} | samples {} | step {:.1} ms | barrier wait {:.1} ms (slowest rank {}) | apply {:.1} ms",
            f.step + 1,
            cfg.total_steps,
            loss,
            acc * 100.0,
            norm,
            f.lr,
            f.workers_in,
            cfg.world,
            f.samples,
            f.step_ms,
            f.barrier_wait_ms,
            f.slowest_rank,
            f.apply_ms,
        );
    }
    if let Some(a) = test_acc {
        tracing::info!(
            "eval after {} steps: test accuracy {:.2}% ({}/{})",
            f.step,
            a * 100.0,
            f.eval.0,
            f.eval.1
        );
    }
    if let Some(m) = metrics {
        let mut line = json!({
            "step": f.step + 1, "time": unix_time(), "loss": loss, "train_acc": acc, "grad_norm": norm, "lr": f.lr,
            "workers": f.workers_in, "samples": f.samples, "step_ms": f.step_ms,
            "barrier_wait_ms": f.barrier_wait_ms, "slowest_rank": f.slowest_rank, "apply_ms": f.apply_ms,
        });
        if let Some(a) = test_acc {
            line["test_acc_before_step"] = json!(a);
        }
        if let Err(e) = writeln!(m, "{line}") {
            tracing::warn!("cannot append to the metrics file: {e}");
        }
    }
    if let Some(w) = tb {
        if let Some(a) = test_acc {
            // evaluated on the weights of version `step`, before the step
            tensorboard_scalars(w, f.step, &[("test/accuracy", a)]);
        }
        let values = [
            ("train/loss", loss),
            ("train/accuracy", acc),
            ("train/lr", f.lr),
            ("train/grad_norm", norm),
            ("time/step_ms", f.step_ms),
            ("time/barrier_wait_ms", f.barrier_wait_ms),
            ("time/apply_ms", f.apply_ms),
        ];
        tensorboard_scalars(w, f.step + 1, &values);
    }
}

/// Writes scalars to the event file; a failure is logged, then only every 1000th (a full disk
/// must not flood the log).
fn tensorboard_scalars(w: &mut crate::tensorboard::EventWriter, step: u64, values: &[(&str, f64)]) {
    static FAILURES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    if let Err(e) = w.scalars(step, unix_time(), values) {
        let n = FAILURES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n.is_multiple_of(1000) {
            tracing::warn!("cannot write to {}: {e}", w.path().display());
        }
    }
}

/// Shards > 0: log their own barrier line and send the figures to shard 0 (best effort, in order).
async fn forward_to_shard0(cfg: ReporterConfig, mut rx: mpsc::UnboundedReceiver<Event>) {
    let mut client = None;
    let mut warned = false;
    while let Some(ev) = rx.recv().await {
        let f = match ev {
            Event::Local(f) => f,
            // every earlier report has been sent: acknowledge
            Event::Flush(done) => {
                let _ = done.send(());
                continue;
            }
            Event::Remote(_) => continue,
            Event::FinalEval(_, _, done) => {
                let _ = done.send(());
                continue;
            }
        };
        if (f.step + 1).is_multiple_of(cfg.log_every) || f.step + 1 == cfg.total_steps {
            tracing::info!(
                "shard {} step {}/{} | step {:.1} ms | barrier wait {:.1} ms (slowest rank {}) | apply {:.1} ms",
                cfg.shard,
                f.step + 1,
                cfg.total_steps,
                f.step_ms,
                f.barrier_wait_ms,
                f.slowest_rank,
                f.apply_ms
            );
        }
        let report = StepReport {
            shard: cfg.shard as u32,
            step: f.step,
            grad_sq_norm: f.grad_sq_norm,
            step_ms: f.step_ms,
            barrier_wait_ms: f.barrier_wait_ms,
            slowest_rank: f.slowest_rank,
        };
        let Some(addr) = &cfg.shard0 else { continue };
        if client.is_none() {
            let endpoint = cfg
                .security
                .endpoint(addr)
                .map(|e| e.connect_timeout(Duration::from_secs(5)));
            client = match endpoint {
                Ok(e) => e.connect().await.ok().map(|ch| {
                    ParameterServerClient::with_interceptor(ch, cfg.security.interceptor())
                }),
                Err(e) => {
                    tracing::warn!("shard {}: {e}", cfg.shard);
                    None
                }
            };
        }
        let mut request = tonic::Request::new(report);
        if let Some(t) = &cfg.shard_token {
            request
                .metadata_mut()
                .insert(ps_common::auth::SHARD_TOKEN_KEY, t.metadata_value());
        }
        let sent = match client.as_mut() {
            Some(c) => c
                .report_step(request)
                .await
                .map_err(|s| s.message().to_string()),
            None => Err(format!("cannot connect to shard 0 at {addr}")),
        };
        if let Err(e) = sent {
            client = None;
            if !warned {
                tracing::warn!(
                    "shard {}: step report to shard 0 failed ({e}); its log lines will lack this shard's gradient norm",
                    cfg.shard
                );
                warned = true;
            }
        }
    }
}

/// Wall-clock time in seconds since the Unix epoch (the `time` of every metrics line).
pub fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| (d.as_secs_f64() * 1e3).round() / 1e3)
}

/// Before a run resumed at `version` appends to `metrics.jsonl`: drops the lines of the steps
/// after `version` (the interrupted run went further than its checkpoint; the resumed run
/// redoes them) and the earlier part's closing line, so every step appears once. A missing
/// file is fine; a line that is not JSON is kept.
pub fn truncate_metrics(path: &std::path::Path, version: u64) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut kept = String::with_capacity(text.len());
    for line in text.lines() {
        let keep = match serde_json::from_str::<serde_json::Value>(line) {
            Ok(v) => {
                v.get("final").is_none()
                    && v.get("step")
                        .and_then(|s| s.as_u64())
                        .is_none_or(|s| s <= version)
            }
            Err(_) => true,
        };
        if keep {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept)?;
    std::fs::rename(&tmp, path)
}

/// Appends shard 0's closing line to `metrics.jsonl`: the final test evaluation of the workers
/// that left, `{"step": steps, "final": true, "test_acc": ..., "test_correct": ..., "test_count": ...}`.
pub fn append_final_eval(
    path: &std::path::Path,
    steps: u64,
    correct: u64,
    count: u64,
) -> std::io::Result<()> {
    let line = json!({
        "step": steps, "time": unix_time(), "final": true, "test_acc": correct as f64 / count.max(1) as f64,
        "test_correct": correct, "test_count": count,
    });
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)?;
    writeln!(f, "{line}")
}
