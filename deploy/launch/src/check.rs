//! `ps-launch --check-reference`: does the cluster train like one process would?
//!
//! Two comparisons, because a long run cannot be compared weight for weight:
//! - **early**: the same config cut to [`EARLY_STEPS`] steps, run once more as a small cluster and
//!   once as the single-process reference; their weights differ only by float rounding
//!   (about 1e-7 relative) and must be within [`EARLY_TOLERANCE`]. The reference is the single
//!   process the run equals: the global batch's gradient, or, for `aggregation = "mean"` over
//!   uneven per-worker batches, the mean of the workers' mean gradients (the report then also
//!   says how far the global-batch process is, and why);
//! - **final**: the whole run's weights, training loss and test accuracy beside the reference's;
//!   the test accuracies must be within [`ACCURACY_TOLERANCE_POINTS`].
//!
//! With `[train] exact_sum` the whole run is compared bit for bit instead: the weights after
//! the last step must be the same bits as the single process's in the same mode.

use anyhow::Context;
use ps_config::{Config, Overrides};
use ps_data::idx::{Dataset, Split, load_split};
use ps_launch::launch::{LocalCluster, bin_dir};
use ps_worker::reference::{Kind, run_reference_of};
use std::fmt;
use std::path::Path;
use std::time::Duration;

/// Steps of the early comparison.
pub const EARLY_STEPS: u64 = 1;
/// Largest relative weight difference accepted after the early steps.
pub const EARLY_TOLERANCE: f64 = 1e-5;
/// Largest test-accuracy difference accepted at the end, in percentage points.
pub const ACCURACY_TOLERANCE_POINTS: f64 = 0.5;

/// The comparison, printed by its `Display`.
#[derive(Debug, Clone)]
pub struct Report {
    /// The config's equivalence in words.
    pub equivalence: String,
    /// For `aggregation = "mean"` over uneven per-worker batches: the reference is the mean of
    /// the workers' mean gradients, which the run equals; this is the early difference of the
    /// cluster from the global-batch single process instead (the weighting, not rounding).
    pub global_batch_early_diff: Option<(f64, String)>,
    /// `W`.
    pub workers: usize,
    /// Steps of the early comparison (fewer when the run is shorter).
    pub early_steps: u64,
    /// Largest relative weight difference after them, and its tensor.
    pub early_diff: (f64, String),
    /// Steps of the whole run.
    pub steps: u64,
    /// Largest relative weight difference at the end, and its tensor.
    pub final_diff: (f64, String),
    /// Last step's mean training loss: cluster (from metrics.jsonl, if there), reference.
    pub loss: (Option<f64>, f64),
    /// Test accuracy in percent of the final weights: cluster, reference.
    pub accuracy: (f64, f64),
    /// With `[train] exact_sum`: whether the final weights are bit-identical (the whole run
    /// compared; no early comparison).
    pub bit_identical: Option<bool>,
}

impl Report {
    /// Whether the early difference and the final accuracies are within the tolerances.
    pub fn agrees(&self) -> bool {
        if let Some(same) = self.bit_identical {
            return same;
        }
        self.early_diff.0 < EARLY_TOLERANCE
            && (self.accuracy.0 - self.accuracy.1).abs() <= ACCURACY_TOLERANCE_POINTS
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let loss = |l: Option<f64>| l.map_or("-".to_string(), |l| format!("{l:.4}"));
        writeln!(f, "reference check: {}", self.equivalence)?;
        if let Some(same) = self.bit_identical {
            return self.fmt_exact(f, same);
        }
        match &self.global_batch_early_diff {
            Some((d, tensor)) => writeln!(
                f,
                "  compared with: one process that averages the {} workers' mean gradients with equal weights (mean of means), which is what aggregation \"mean\" computes over uneven per-worker batches; the single process of the whole global batch differs from the cluster by {d:.1e} after {} step(s) (in {tensor}): that is the mean-of-means weighting, not float rounding (aggregation = \"weighted\" equals the global batch)",
                self.workers, self.early_steps
            )?,
            None => writeln!(
                f,
                "  compared with: one process that computes the gradient of the whole global batch"
            )?,
        }
        writeln!(
            f,
            "  after {} step(s):  largest relative weight difference {:.1e} (in {}; tolerance {:.0e})",
            self.early_steps, self.early_diff.0, self.early_diff.1, EARLY_TOLERANCE
        )?;
        writeln!(
            f,
            "  after {} steps:  largest relative weight difference {:.1e} (in {})",
            self.steps, self.final_diff.0, self.final_diff.1
        )?;
        writeln!(f, "                    cluster   single process")?;
        writeln!(
            f,
            "  final loss        {:>7}   {:>7}",
            loss(self.loss.0),
            loss(Some(self.loss.1))
        )?;
        writeln!(
            f,
            "  test accuracy     {:>6.2}%   {:>6.2}%",
            self.accuracy.0, self.accuracy.1
        )?;
        writeln!(
            f,
            "  why they drift: the cluster adds the workers' gradients in another order than one process, each order rounds differently (about 1e-7), and training amplifies such differences step by step, so long runs end at different weights of the same quality."
        )?;
        let acc = (self.accuracy.0 - self.accuracy.1).abs();
        writeln!(
            f,
            "verdict: {} (early-step difference {:.1e} {} {:.0e}; test accuracies {:.2} points apart, {} {})",
            if self.agrees() {
                "the runs agree"
            } else {
                "the runs DO NOT agree"
            },
            self.early_diff.0,
            if self.early_diff.0 < EARLY_TOLERANCE {
                "<"
            } else {
                ">="
            },
            EARLY_TOLERANCE,
            acc,
            if acc <= ACCURACY_TOLERANCE_POINTS {
                "<="
            } else {
                ">"
            },
            ACCURACY_TOLERANCE_POINTS
        )
    }
}

impl Report {
    /// The report of an `exact_sum` run: the whole run, bit for bit.
    fn fmt_exact(&self, f: &mut fmt::Formatter<'_>, same: bool) -> fmt::Result {
        writeln!(
            f,
            "  compared with: one process that sums the same micro-batch gradients exactly (exact_sum), the whole run"
        )?;
        if same {
            writeln!(
                f,
                "  after {} steps: the weights are bit-identical to one process",
                self.steps
            )?;
        } else {
            writeln!(
                f,
                "  after {} steps: the weights are NOT bit-identical to one process: largest relative weight difference {:.1e} (in {})",
                self.steps, self.final_diff.0, self.final_diff.1
            )?;
        }
        writeln!(
            f,
            "  test accuracy     {:>6.2}% (cluster)   {:>6.2}% (single process)",
            self.accuracy.0, self.accuracy.1
        )?;
        writeln!(
            f,
            "verdict: {}",
            if same {
                "the runs agree (the same bits)"
            } else {
                "the runs DO NOT agree (exact_sum promises the same bits)"
            }
        )
    }
}

/// What the run was started with beyond its config file, which the early comparison's cluster
/// gets too (so it checks the run that was made, not the file as written).
#[derive(Debug, Clone, Default)]
pub struct RunArgs<'a> {
    /// `--set` and `PS_SET_*` settings: applied to the early config.
    pub overrides: Option<&'a Overrides>,
    /// `--data-dir`.
    pub data_dir: Option<&'a Path>,
    /// `--worker-arg`s (e.g. `--device=cuda`), passed to every early worker.
    pub worker_args: &'a [String],
}

/// Compares the finished run in `out_dir` (config `cfg`, read from `config` with `run`'s
/// overrides) with the single-process reference, running the early comparison's small cluster
/// in `out_dir/reference-check` with the run's settings and worker arguments.
pub fn check_reference(
    cfg: &Config,
    config: &Path,
    out_dir: &Path,
    run: &RunArgs<'_>,
) -> anyhow::Result<Report> {
    let layout = cfg.layout();
    let classes = cfg.model.dims[cfg.model.dims.len() - 1];
    let train = load_split(&cfg.data.dir, Split::Train, classes)?;
    let test = load_split(&cfg.data.dir, Split::Test, classes)?;
    // the whole run
    let (cluster, version) =
        ps_model::weights::read_shards(out_dir, cfg.num_shards(), layout.num_params())?;
    let eq = cfg.equivalence();
    let kind = if eq.mean_of_means {
        Kind::MeanOfMeans
    } else {
        Kind::GlobalBatch
    };
    let reference = run_reference_of(cfg, &train, kind)?;
    if version != reference.steps {
        anyhow::bail!(
            "the cluster's weights are at version {version}, the reference ran {} steps",
            reference.steps
        );
    }
    let final_diff = ps_model::weights::max_rel_diff(&layout, &cluster, &reference.weights);
    let accuracy = (
        accuracy(cfg, &cluster, &test)?,
        accuracy(cfg, &reference.weights, &test)?,
    );
    let cluster_loss = last_loss(&out_dir.join("metrics.jsonl"), version);
    if cfg.train.exact_micro_batch.is_some() {
        let same = cluster.len() == reference.weights.len()
            && cluster
                .iter()
                .zip(&reference.weights)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        return Ok(Report {
            equivalence: eq.to_string(),
            global_batch_early_diff: None,
            workers: cfg.cluster.workers,
            early_steps: reference.steps,
            early_diff: final_diff.clone(),
            steps: reference.steps,
            final_diff,
            loss: (cluster_loss, reference.last_loss),
            accuracy,
            bit_identical: Some(same),
        });
    }
    // the early steps: the same config cut short, as a cluster and as one process
    let early_steps = EARLY_STEPS.min(reference.steps);
    let (early_cfg_path, early_cfg) = early_config(config, early_steps, run)?;
    let early_dir = out_dir.join("reference-check");
    let early = run_early(&early_cfg_path, &early_cfg, &early_dir, run);
    let _ = std::fs::remove_file(&early_cfg_path);
    let early_cluster = early?;
    let early_ref = run_reference_of(&early_cfg, &train, kind)?;
    let early_diff = ps_model::weights::max_rel_diff(&layout, &early_cluster, &early_ref.weights);
    let global_batch_early_diff = match kind {
        Kind::MeanOfMeans => {
            let global = run_reference_of(&early_cfg, &train, Kind::GlobalBatch)?;
            Some(ps_model::weights::max_rel_diff(
                &layout,
                &early_cluster,
                &global.weights,
            ))
        }
        Kind::GlobalBatch => None,
    };
    Ok(Report {
        equivalence: eq.to_string(),
        global_batch_early_diff,
        workers: cfg.cluster.workers,
        early_steps,
        early_diff,
        steps: reference.steps,
        final_diff,
        loss: (cluster_loss, reference.last_loss),
        accuracy,
        bit_identical: None,
    })
}

/// The config at `config` with the run's overrides applied, `[train] steps = k` and no
/// checkpoints, written beside it (so its relative paths mean the same), and its parsed form.
fn early_config(
    config: &Path,
    k: u64,
    run: &RunArgs<'_>,
) -> anyhow::Result<(std::path::PathBuf, Config)> {
    let data_dir = run.data_dir;
    let text = std::fs::read_to_string(config).with_context(|| config.display().to_string())?;
    let mut doc: toml::Table = match run.overrides {
        Some(o) => o
            .apply_sets(&text)
            .map_err(anyhow::Error::msg)
            .with_context(|| config.display().to_string())?,
        None => text.parse().with_context(|| config.display().to_string())?,
    };
    let train = doc
        .entry("train")
        .or_insert_with(|| toml::Value::Table(Default::default()));
    if let toml::Value::Table(t) = train {
        t.remove("epochs");
        t.insert("steps".into(), toml::Value::Integer(k as i64));
    }
    doc.remove("checkpoint");
    let dir = config.parent().unwrap_or(Path::new("."));
    let path = dir.join(format!(".ps-launch-early-{}.toml", std::process::id()));
    std::fs::write(&path, doc.to_string()).with_context(|| path.display().to_string())?;
    let mut cfg = Config::load(&path);
    if let (Ok(c), Some(d)) = (&mut cfg, data_dir) {
        c.data.dir = d.to_path_buf();
    }
    match cfg {
        Ok(c) => Ok((path, c)),
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            Err(e.into())
        }
    }
}

/// Runs the early config as a cluster into `dir`; its final weights.
fn run_early(path: &Path, cfg: &Config, dir: &Path, run: &RunArgs<'_>) -> anyhow::Result<Vec<f32>> {
    let _ = std::fs::remove_dir_all(dir);
    let mut cluster = LocalCluster::new(bin_dir(), path.to_path_buf(), Some(dir.join("logs")));
    let mut args = vec!["--out-dir".to_string(), dir.display().to_string()];
    let mut worker_args = run.worker_args.to_vec();
    if let Some(d) = run.data_dir {
        for a in [&mut args, &mut worker_args] {
            a.push("--data-dir".into());
            a.push(d.display().to_string());
        }
    }
    cluster.start_servers(cfg.num_shards(), &args, Duration::from_secs(60))?;
    for r in 0..cfg.cluster.workers {
        cluster.start_worker(r, cfg.cluster.workers, &worker_args)?;
    }
    cluster.wait(Duration::from_secs(600), &|| false)?;
    let (w, _) = ps_model::weights::read_shards(dir, cfg.num_shards(), cfg.layout().num_params())?;
    Ok(w)
}

/// Test accuracy in percent of `weights`, computed by the workers' CPU code.
fn accuracy(cfg: &Config, weights: &[f32], test: &Dataset) -> anyhow::Result<f64> {
    let mut backend = ps_worker::cpu::cpu_model(&cfg.layout(), 0);
    backend.set_weights(weights)?;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let mut correct = 0u64;
    let all: Vec<u32> = (0..test.len() as u32).collect();
    for chunk in all.chunks(1000) {
        test.gather(chunk, &mut x, &mut y);
        correct += backend.evaluate(&x, &y)?;
    }
    Ok(100.0 * correct as f64 / test.len().max(1) as f64)
}

/// The training loss of step `step` in a metrics.jsonl, if there.
fn last_loss(metrics: &Path, step: u64) -> Option<f64> {
    let text = std::fs::read_to_string(metrics).ok()?;
    text.lines().rev().find_map(|l| {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        (v.get("step")?.as_u64()? == step).then_some(())?;
        v.get("loss")?.as_f64()
    })
}
