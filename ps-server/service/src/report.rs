//! What users watch: shard 0 joins its own step figures with the squared gradient norms the
//! other shards report, then logs one line per step (every `log_every`) with the cluster-wide
//! loss, accuracy, whole-gradient norm, lr, workers, samples, timing and slowest rank, and
//! appends the same as a JSON line to the metrics file. Every other shard logs its own barrier
//! and timing, and reports to shard 0.
//!
//! The gradient noise scale: every shard reports each rank's squared gradient norm over its
//! range with the step; shard 0 sums them over the shards (norms are sums over coordinates),
//! estimates tr(Σ) and |G|² ([`ps_config::noise`]), smooths them over steps, and logs
//! B_noise with one line of advice on the global batch every `log_every` steps.

use crate::exporter::Metrics;
use crate::shard::{RankNorm, StepFigures};
pub use crate::tensorboard::unix_time;
use ps_config::noise::{self, NoiseScale};
use ps_config::{Aggregation, Config, LossReduction};
use ps_net::throttle::SharedThrottle;
use ps_proto::pb::parameter_server_client::ParameterServerClient;
use ps_proto::pb::{RankSqNorm, StepReport};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
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
    pub security: ps_net::auth::ClientSecurity,
    /// The shard credential put on reports (`[server] shard_token_file`).
    pub shard_token: Option<ps_net::auth::Token>,
    /// Shard 0 writes TensorBoard event files here (next to the metrics file).
    pub tensorboard_dir: Option<PathBuf>,
    /// The version a resumed run starts at (its event file says so).
    pub resumed_at: Option<u64>,
    /// What the gradient noise scale needs (shard 0).
    pub noise: NoiseSetup,
}

/// Decay per step of the noise scale's moving averages: about the last 20 steps count.
pub const NOISE_DECAY: f64 = 0.95;

/// What shard 0 needs to estimate the gradient noise scale.
#[derive(Debug, Clone)]
pub struct NoiseSetup {
    /// `[train] aggregation`.
    pub aggregation: Aggregation,
    /// `[train] loss_reduction`.
    pub loss: LossReduction,
    /// The shard's `/metrics`, for the gauge.
    pub metrics: Option<Arc<Metrics>>,
}

impl NoiseSetup {
    /// The setup of `cfg`, with the shard's metrics.
    pub fn of(cfg: &Config, metrics: Arc<Metrics>) -> Self {
        Self {
            aggregation: cfg.train.aggregation,
            loss: cfg.train.loss_reduction,
            metrics: Some(metrics),
        }
    }
}

/// What is wrong with the rank norms of a step report ([`check_report_ranks`]).
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// More norms than ranks.
    #[error(
        "step report from shard {shard} holds {count} rank norms: expected at most {world} (one per rank)"
    )]
    TooManyRanks {
        /// The reporting shard.
        shard: u32,
        /// How many norms it holds.
        count: usize,
        /// The world size.
        world: usize,
    },
    /// A rank out of range, repeated, or out of order.
    #[error(
        "step report from shard {shard}: rank norm of rank {rank}: expected ranks below {world}, each once, in increasing order"
    )]
    RankOrder {
        /// The reporting shard.
        shard: u32,
        /// The rank.
        rank: u32,
        /// The world size.
        world: usize,
    },
    /// A squared norm that is not a finite non-negative number.
    #[error(
        "step report from shard {shard}: rank {rank}'s squared norm {sq_norm}: expected a finite non-negative number"
    )]
    BadNorm {
        /// The reporting shard.
        shard: u32,
        /// The rank.
        rank: u32,
        /// The squared norm.
        sq_norm: f64,
    },
}

/// Checks the noise figures of a step report: at most `world` ranks, each below `world`, once,
/// in increasing order, with a finite non-negative squared norm. The message says what is
/// wrong.
pub fn check_report_ranks(r: &StepReport, world: usize) -> Result<(), ReportError> {
    if r.ranks.len() > world {
        return Err(ReportError::TooManyRanks {
            shard: r.shard,
            count: r.ranks.len(),
            world,
        });
    }
    let mut prev: Option<u32> = None;
    for q in &r.ranks {
        if q.rank as usize >= world || prev.is_some_and(|p| p >= q.rank) {
            return Err(ReportError::RankOrder {
                shard: r.shard,
                rank: q.rank,
                world,
            });
        }
        if !q.sq_norm.is_finite() || q.sq_norm < 0.0 {
            return Err(ReportError::BadNorm {
                shard: r.shard,
                rank: q.rank,
                sq_norm: q.sq_norm,
            });
        }
        prev = Some(q.rank);
    }
    Ok(())
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
    /// Each rank's (samples, Σ over the shards so far of |g_r|², shards that gave it).
    ranks: BTreeMap<u32, (u32, f64, usize)>,
    /// A shard's ranks disagreed with another's (or a shard knew none): no noise estimate.
    ranks_differ: bool,
}

impl Pending {
    /// Adds one shard's rank norms.
    fn add_ranks(&mut self, ranks: impl Iterator<Item = RankNorm>) {
        let mut any = false;
        for q in ranks {
            any = true;
            let e = self.ranks.entry(q.rank).or_insert((q.samples, 0.0, 0));
            if e.0 != q.samples {
                self.ranks_differ = true;
            }
            e.1 += q.sq_norm;
            e.2 += 1;
        }
        if !any {
            self.ranks_differ = true;
        }
    }

    /// Each rank's squared norm over the whole model, when every one of `shards` shards gave
    /// the same ranks with the same samples.
    fn rank_norms(&self, shards: usize) -> Option<Vec<RankNorm>> {
        if self.ranks_differ || self.remote + 1 != shards {
            return None;
        }
        self.ranks
            .iter()
            .map(|(&rank, &(samples, sq_norm, n))| {
                (n == shards).then_some(RankNorm {
                    rank,
                    samples,
                    sq_norm,
                })
            })
            .collect()
    }
}

/// Shard 0's gradient noise scale over the run.
struct Noise {
    scale: NoiseScale,
    /// The advice on the global batch, stable against a wobbling estimate.
    advisor: noise::Advisor,
    /// The W = 1 line was logged.
    said_one_worker: bool,
    /// The run's clock, for the step line's elapsed time, rate and ETA.
    progress: Progress,
}

/// Elapsed time, rate and estimated time left of a run, as the step line says them.
#[derive(Debug)]
struct Progress {
    /// When this shard's reporter started (its process, or its state after a rollback).
    started: Instant,
    /// The first step logged here and when: the rate counts from it (a resumed run's steps
    /// before it were not timed here).
    first: Option<(u64, Instant)>,
}

impl Progress {
    fn new(started: Instant) -> Self {
        Self {
            started,
            first: None,
        }
    }

    /// " | elapsed 1m05s | 12.3 steps/s | ETA 2m10s" once step `done` (1-based) of `total` is
    /// applied at `now`; the rate and ETA once two steps were timed.
    fn said(&mut self, done: u64, total: u64, now: Instant) -> String {
        let (first, at) = *self.first.get_or_insert((done, now));
        let mut line = format!(
            " | elapsed {}",
            clock(now.saturating_duration_since(self.started).as_secs_f64())
        );
        let secs = now.saturating_duration_since(at).as_secs_f64();
        if done > first && secs > 0.0 {
            let rate = (done - first) as f64 / secs;
            let left = total.saturating_sub(done) as f64 / rate;
            line += &format!(" | {rate:.3} steps/s | ETA {}", clock(left));
        }
        line
    }
}

/// `secs` as "12.3s", "4m05s" or "2h03m04s".
fn clock(secs: f64) -> String {
    if secs < 60.0 {
        return format!("{secs:.1}s");
    }
    let s = secs.round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, sec) => format!("{h}h{m:02}m{sec:02}s"),
    }
}

/// Shard 0's outputs: the metrics file, the TensorBoard events, and what the steps' figures
/// are turned into (the noise scale, the progress line).
struct Outputs {
    metrics: Option<std::fs::File>,
    tb: Option<crate::tensorboard::EventWriter>,
    noise: Noise,
}

impl Outputs {
    /// Opens the metrics file and the TensorBoard events of `cfg` (each warned about and left
    /// out when it cannot be written).
    fn open(cfg: &ReporterConfig) -> Self {
        let metrics = cfg.metrics_file.as_ref().and_then(|p| {
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
        let tb = cfg.tensorboard_dir.as_ref().and_then(|d| {
            crate::tensorboard::EventWriter::create(d, cfg.resumed_at)
                .map_err(|e| {
                    tracing::warn!("cannot write TensorBoard events in {}: {e}", d.display())
                })
                .ok()
        });
        if let Some(w) = &tb {
            tracing::info!("TensorBoard events in {}", w.path().display());
        }
        let noise = Noise {
            scale: NoiseScale::new(NOISE_DECAY),
            advisor: noise::Advisor::new(),
            said_one_worker: false,
            progress: Progress::new(Instant::now()),
        };
        Self { metrics, tb, noise }
    }

    /// Emits the figures of one step ([`emit`]).
    fn emit(&mut self, cfg: &ReporterConfig, p: Pending) {
        emit(
            cfg,
            p,
            self.metrics.as_mut(),
            self.tb.as_mut(),
            &mut self.noise,
        );
    }
}

async fn run(cfg: ReporterConfig, mut rx: mpsc::UnboundedReceiver<Event>) {
    if cfg.shard != 0 {
        forward_to_shard0(cfg, rx).await;
        return;
    }
    let mut out = Outputs::open(&cfg);
    let mut pending: BTreeMap<u64, Pending> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let Some(ev) = ev else { break };
                let Some(step) = on_event(&cfg, ev, &mut pending, &mut out) else { continue };
                if let Some(p) = pending.get(&step)
                    && p.local.is_some()
                    && p.remote + 1 == cfg.num_shards
                {
                    let p = pending.remove(&step).expect("present");
                    out.emit(&cfg, p);
                }
            }
            _ = tick.tick() => on_tick(&cfg, &mut pending, &mut out),
        }
    }
}

/// Takes one event in: a flush or the final evaluation done at once, a step's figures (this
/// shard's or another's) added to what is pending for the step, whose number is returned.
fn on_event(
    cfg: &ReporterConfig,
    ev: Event,
    pending: &mut BTreeMap<u64, Pending>,
    out: &mut Outputs,
) -> Option<u64> {
    match ev {
        Event::Flush(done) => {
            for (_, p) in std::mem::take(pending) {
                if p.local.is_some() {
                    out.emit(cfg, p);
                }
            }
            let _ = done.send(());
            None
        }
        Event::FinalEval(step, acc, done) => {
            if let Some(w) = out.tb.as_mut() {
                tensorboard_scalars(w, step, &[("test/accuracy", acc)]);
            }
            let _ = done.send(());
            None
        }
        Event::Local(f) => {
            let step = f.step;
            let p = pending.entry(step).or_default();
            p.first_seen.get_or_insert_with(Instant::now);
            p.add_ranks(f.ranks.iter().copied());
            p.local = Some(f);
            Some(step)
        }
        Event::Remote(r) => {
            let p = pending.entry(r.step).or_default();
            p.first_seen.get_or_insert_with(Instant::now);
            if !p.from.insert(r.shard) {
                tracing::debug!(
                    "step {}: a second report of shard {} ignored",
                    r.step,
                    r.shard
                );
                return None;
            }
            p.remote_sq += r.grad_sq_norm;
            p.remote += 1;
            p.add_ranks(r.ranks.iter().map(|q| RankNorm {
                rank: q.rank,
                samples: q.samples,
                sq_norm: q.sq_norm,
            }));
            Some(r.step)
        }
    }
}

/// Once a second: the steps whose other shards' reports did not all come within
/// [`REPORT_WAIT`] are emitted with those that did; reports of a step this shard never applied
/// are dropped after twice the wait.
fn on_tick(cfg: &ReporterConfig, pending: &mut BTreeMap<u64, Pending>, out: &mut Outputs) {
    let stale: Vec<u64> = pending
        .iter()
        .filter(|(_, p)| {
            p.local.is_some() && p.first_seen.is_some_and(|t| t.elapsed() > REPORT_WAIT)
        })
        .map(|(s, _)| *s)
        .collect();
    for s in stale {
        let p = pending.remove(&s).expect("present");
        // a shard whose reports fail does so every step: once per LOG_EVERY
        static PARTIAL: SharedThrottle = SharedThrottle::new();
        if let Some(r) = PARTIAL.hit() {
            tracing::warn!(
                "step {s}: only {} of {} shards reported; the gradient norm covers those{r}",
                p.remote + 1,
                cfg.num_shards
            );
        }
        out.emit(cfg, p);
    }
    // reports of a step this shard never applied (it failed, or they were wrong)
    // are not kept past twice the wait
    pending.retain(|s, p| {
        let keep = p.local.is_some() || p.first_seen.is_none_or(|t| t.elapsed() <= 2 * REPORT_WAIT);
        if !keep {
            tracing::debug!(
                "step {s}: {} reports dropped, this shard never applied the step",
                p.remote
            );
        }
        keep
    });
}

/// Shard 0's output for one step whose figures are all in (`p`): the noise scale's estimate,
/// the log lines, the metrics line and the TensorBoard scalars.
fn emit(
    cfg: &ReporterConfig,
    p: Pending,
    metrics: Option<&mut std::fs::File>,
    tb: Option<&mut crate::tensorboard::EventWriter>,
    noise: &mut Noise,
) {
    let ranks = p.rank_norms(cfg.num_shards);
    let f = p.local.expect("local figures present");
    let agg_sq = f.grad_sq_norm + p.remote_sq;
    let norm = agg_sq.sqrt();
    observe_noise(cfg, ranks.as_deref(), agg_sq, noise);
    let smoothed = noise.scale.get();
    if let (Some(m), Some(b)) = (&cfg.noise.metrics, smoothed.and_then(|s| s.b_noise)) {
        m.set_noise_scale(b);
    }
    let samples = f.samples.max(1) as f64;
    let loss = f.loss_sum / samples;
    let acc = f.correct as f64 / samples;
    let test_acc = (f.eval.1 > 0).then(|| f.eval.0 as f64 / f.eval.1 as f64);
    let last = f.step + 1 == cfg.total_steps;
    if (f.step + 1).is_multiple_of(cfg.log_every) || f.step == 0 || last {
        log_step(cfg, &f, (loss, acc, norm), smoothed.as_ref(), noise);
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
        let figures = (loss, acc, norm, test_acc);
        append_step(m, &f, figures, smoothed.as_ref(), ranks.as_deref());
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

/// Feeds the step's estimate of the gradient noise scale (from each rank's squared gradient
/// norm, `ranks`, and the aggregated gradient's, `agg_sq`) into `noise`'s smoothing.
fn observe_noise(cfg: &ReporterConfig, ranks: Option<&[RankNorm]>, agg_sq: f64, noise: &mut Noise) {
    if let Some(ranks) = ranks {
        let samples: Vec<u32> = ranks.iter().map(|q| q.samples).collect();
        let coeffs = noise::coefficients(cfg.noise.aggregation, &samples);
        let input: Vec<noise::RankNorm> = ranks
            .iter()
            .zip(coeffs)
            .map(|(q, coeff)| noise::RankNorm {
                sq_norm: q.sq_norm,
                samples: q.samples,
                coeff,
            })
            .collect();
        if let Some(e) = noise::estimate(&input, agg_sq, cfg.noise.loss) {
            noise.scale.observe(e);
        }
    }
}

/// The step's log line (`figures`: the loss, train accuracy and gradient norm), and the noise
/// scale's (`smoothed`), or once that one worker cannot estimate it.
fn log_step(
    cfg: &ReporterConfig,
    f: &StepFigures,
    figures: (f64, f64, f64),
    smoothed: Option<&noise::Smoothed>,
    noise: &mut Noise,
) {
    let (loss, acc, norm) = figures;
    tracing::info!(
        "step {}/{} | loss {:.4} | train acc {:.2}% | grad norm {:.4} | lr {:.5} | workers {}/{} | samples {} | step {:.1} ms | barrier wait {:.1} ms (slowest rank {}) | apply {:.1} ms{}{}",
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
        buckets_said(f),
        noise
            .progress
            .said(f.step + 1, cfg.total_steps, Instant::now()),
    );
    if cfg.world < 2 {
        if !noise.said_one_worker {
            tracing::info!(
                "gradient noise scale: cannot be estimated with one worker (it compares each worker's gradient with the aggregated one); run with 2 or more workers to see whether a bigger batch would help"
            );
            noise.said_one_worker = true;
        }
    } else if let Some(s) = smoothed {
        tracing::info!(
            "gradient noise scale: B_noise ≈ {} (tr(Σ) {:.4e}, |G|² {:.4e}; a noisy estimate, smoothed over about the last {:.0} steps, {} so far) | {}",
            s.b_noise.map_or("n/a".into(), |b| format!("{b:.0}")),
            s.trace_sigma,
            s.grad_sq,
            (1.0 / (1.0 - NOISE_DECAY)).min(s.steps as f64),
            s.steps,
            noise.advisor.advise(s.b_noise, f.samples)
        );
    }
}

/// Appends the step's line to `metrics.jsonl` (`figures`: the loss, train accuracy, gradient
/// norm and test accuracy); a failure is logged (throttled).
fn append_step(
    m: &mut std::fs::File,
    f: &StepFigures,
    figures: (f64, f64, f64, Option<f64>),
    smoothed: Option<&noise::Smoothed>,
    ranks: Option<&[RankNorm]>,
) {
    let (loss, acc, norm, test_acc) = figures;
    let mut line = json!({
        "step": f.step + 1, "time": unix_time(), "loss": loss, "train_acc": acc, "grad_norm": norm, "lr": f.lr,
        "workers": f.workers_in, "samples": f.samples, "step_ms": f.step_ms,
        "barrier_wait_ms": f.barrier_wait_ms, "slowest_rank": f.slowest_rank, "apply_ms": f.apply_ms,
        "tail_ms": f.tail_ms,
    });
    if let Some(a) = test_acc {
        line["test_acc_before_step"] = json!(a);
    }
    if let Some((early, buckets)) = f.buckets {
        line["buckets_early"] = json!(early);
        line["buckets"] = json!(buckets);
    }
    if let Some((total, coef)) = f.clip {
        line["clip_total_norm"] = json!(total);
        line["clip_coef"] = json!(coef);
    }
    if let Some(s) = smoothed {
        if let Some(b) = s.b_noise {
            line["b_noise"] = json!(b);
        }
        line["noise_trace_sigma"] = json!(s.trace_sigma);
        line["noise_grad_sq"] = json!(s.grad_sq);
    }
    if let Some(ranks) = &ranks {
        let by_rank: serde_json::Map<String, serde_json::Value> = ranks
            .iter()
            .map(|q| (q.rank.to_string(), json!(q.sq_norm)))
            .collect();
        line["rank_grad_sq_norms"] = serde_json::Value::Object(by_rank);
    }
    if let Err(e) = append_line(m, &line) {
        // a full disk fails every step: said once per throttle::LOG_EVERY, with a count
        static FAILED: SharedThrottle = SharedThrottle::new();
        if let Some(r) = FAILED.hit() {
            tracing::warn!(
                "cannot append step {} to the metrics file: {e}{r}",
                f.step + 1
            );
        }
    }
}

/// A step's per-bucket figure for its log line: the buckets applied before the barrier
/// completed (`apply` is then the completion's own time), or nothing for a whole-range update.
fn buckets_said(f: &StepFigures) -> String {
    f.buckets
        .map(|(early, total)| format!(" | {early}/{total} buckets before the barrier"))
        .unwrap_or_default()
}

/// Writes scalars to the event file; a failure is logged once per `throttle::LOG_EVERY` with a
/// count (a full disk must not flood the log).
fn tensorboard_scalars(w: &mut crate::tensorboard::EventWriter, step: u64, values: &[(&str, f64)]) {
    static FAILED: SharedThrottle = SharedThrottle::new();
    if let Err(e) = w.scalars(step, unix_time(), values)
        && let Some(r) = FAILED.hit()
    {
        tracing::warn!("cannot write to {}: {e}{r}", w.path().display());
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
                "shard {} step {}/{} | step {:.1} ms | barrier wait {:.1} ms (slowest rank {}) | apply {:.1} ms{}",
                cfg.shard,
                f.step + 1,
                cfg.total_steps,
                f.step_ms,
                f.barrier_wait_ms,
                f.slowest_rank,
                f.apply_ms,
                buckets_said(&f)
            );
        }
        let report = StepReport {
            shard: cfg.shard as u32,
            step: f.step,
            grad_sq_norm: f.grad_sq_norm,
            step_ms: f.step_ms,
            barrier_wait_ms: f.barrier_wait_ms,
            slowest_rank: f.slowest_rank,
            ranks: f
                .ranks
                .iter()
                .map(|q| RankSqNorm {
                    rank: q.rank,
                    samples: q.samples,
                    sq_norm: q.sq_norm,
                })
                .collect(),
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
            request.metadata_mut().insert(
                ps_net::auth::SHARD_TOKEN_KEY,
                ps_net::auth::metadata_value(t),
            );
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

/// Appends one line of `metrics.jsonl` with a single `write` call: a process killed (SIGKILL)
/// while appending leaves the whole line or none of it. (`writeln!` on the file wrote each
/// piece of the JSON with its own call, so a kill could leave half a line, which the resumed
/// run kept and `ps-launch` then refused to read.)
fn append_line(f: &mut impl Write, line: &serde_json::Value) -> std::io::Result<()> {
    let mut text = line.to_string();
    text.push('\n');
    f.write_all(text.as_bytes())
}

/// Before a run resumed at `version` appends to `metrics.jsonl`: drops the lines of the steps
/// after `version` (the interrupted run went further than its checkpoint; the resumed run
/// redoes them) and the earlier part's closing line, so every step appears once. A missing
/// file is fine; a line that is not JSON is kept, except a last line without its newline,
/// which is a write the interrupted process did not finish.
pub fn truncate_metrics(path: &std::path::Path, version: u64) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let torn = (!text.ends_with('\n')).then(|| text.lines().count());
    let mut kept = String::with_capacity(text.len());
    for (i, line) in text.lines().enumerate() {
        let keep = match serde_json::from_str::<serde_json::Value>(line) {
            Ok(v) => {
                v.get("final").is_none()
                    && v.get("step")
                        .and_then(|s| s.as_u64())
                        .is_none_or(|s| s <= version)
            }
            Err(_) => torn != Some(i + 1),
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
    append_line(&mut f, &line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_line_says_elapsed_time_rate_and_eta() {
        let t0 = Instant::now();
        let mut p = Progress::new(t0);
        // the first step timed: elapsed only
        assert_eq!(
            p.said(11, 1000, t0 + Duration::from_secs(2)),
            " | elapsed 2.0s"
        );
        // 100 steps in 50 s after it: 2 steps/s, 889 left
        assert_eq!(
            p.said(111, 1000, t0 + Duration::from_secs(52)),
            " | elapsed 52.0s | 2.000 steps/s | ETA 7m25s"
        );
        assert_eq!(
            p.said(112, 100_000, t0 + Duration::from_millis(52_500)),
            " | elapsed 52.5s | 2.000 steps/s | ETA 13h52m24s"
        );
        assert_eq!(
            p.said(1000, 1000, t0 + Duration::from_secs(3725)),
            " | elapsed 1h02m05s | 0.266 steps/s | ETA 0.0s"
        );
    }

    /// Counts the `write` calls it gets.
    #[derive(Default)]
    struct Calls(usize, Vec<u8>);

    impl Write for Calls {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += 1;
            self.1.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_metrics_line_is_one_write_call() {
        let line = json!({"step": 94, "loss": 0.25, "lr": 0.01, "rank_grad_sq_norms": {"0": 1.5, "1": 2.5}});
        let mut w = Calls::default();
        append_line(&mut w, &line).unwrap();
        assert_eq!(w.0, 1, "one write call for the whole line");
        assert_eq!(w.1, format!("{line}\n").into_bytes());
    }

    #[test]
    fn truncation_drops_a_torn_last_line_and_the_steps_past_the_version() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let full: String = (1..=93)
            .map(|s| format!("{{\"step\": {s}, \"loss\": 0.5}}\n"))
            .collect();
        // killed while appending step 94: half a line, no newline
        std::fs::write(&path, format!("{full}{{\"step\": 94, \"lo")).unwrap();
        truncate_metrics(&path, 90).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let steps: Vec<u64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(steps, (1..=90).collect::<Vec<_>>(), "{text}");
        // a line that is not JSON but complete stays (someone wrote it on purpose)
        std::fs::write(&path, "# note\n{\"step\": 1}\n{\"step\": 2}\n").unwrap();
        truncate_metrics(&path, 1).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "# note\n{\"step\": 1}\n"
        );
    }
}
