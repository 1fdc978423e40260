//! `ps-plan`: the question users arrive with, answered the other way round. From a
//! single-process recipe (batch, lr, loss reduction, optimizer) and a cluster shape, the config
//! lines that reproduce it exactly; from an existing config, the single-process run it equals.
//!
//! The plain-words statement is not written a second time here: the planned lines are parsed
//! by [`Config::parse`] and stated by [`Config::equivalence`], exactly as `ps-server` will at
//! start-up, and a plan is only printed after that statement was checked to be the recipe.

use crate::{Aggregation, Config, Equivalence, LossReduction};
use ps_model::layout::split_even;
use ps_optim::Optimizer;
use std::fmt::Write as _;
use std::path::Path;

/// A planning error: bad input, or a recipe the cluster cannot reproduce exactly.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    /// A flag's value is out of range (the message names the flag and what was expected).
    #[error("{0}")]
    BadInput(String),
    /// The recipe cannot be reproduced exactly with the requested choice.
    #[error("{0}")]
    NotExact(String),
}

/// How the single-process recipe was run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// One process, one device: `batch` is the batch of each step.
    Single,
    /// `torch.nn.DataParallel` over this many GPUs: `batch` is the DataLoader's batch.
    DataParallel(usize),
    /// `DistributedDataParallel` over this many processes: `batch` is each process's batch.
    Ddp(usize),
}

/// The run the user has.
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    /// The batch as the user's code states it (see [`Source`]).
    pub batch: usize,
    /// The learning rate.
    pub lr: f64,
    /// The loss reduction of the criterion.
    pub loss: LossReduction,
    /// The optimizer (lr apart).
    pub optimizer: Optimizer,
    /// How it ran.
    pub source: Source,
}

/// The cluster the user wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// `W`: one worker per GPU (or CPU slot).
    pub workers: usize,
    /// `(nodes, gpus per node)` when given that way.
    pub nodes: Option<(usize, usize)>,
}

impl Shape {
    /// `--workers W`.
    pub fn workers(w: usize) -> Result<Shape, PlanError> {
        if w == 0 {
            return Err(PlanError::BadInput(
                "--workers 0: expected at least one worker".into(),
            ));
        }
        Ok(Shape {
            workers: w,
            nodes: None,
        })
    }

    /// `--nodes N --gpus-per-node G`.
    pub fn nodes(n: usize, g: usize) -> Result<Shape, PlanError> {
        if n == 0 || g == 0 {
            return Err(PlanError::BadInput(format!(
                "--nodes {n} --gpus-per-node {g}: expected at least one node and one GPU per node"
            )));
        }
        Ok(Shape {
            workers: n * g,
            nodes: Some((n, g)),
        })
    }

    fn describe(&self) -> String {
        match self.nodes {
            Some((n, g)) => format!(
                "{n} node{} x {g} GPU{} = {} workers (one per GPU)",
                plural(n),
                plural(g),
                self.workers
            ),
            None => format!("{} worker{}", self.workers, plural(self.workers)),
        }
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// What to plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The run the user has.
    pub recipe: Recipe,
    /// The cluster.
    pub shape: Shape,
    /// Force this aggregation (the lr is then adjusted to stay exact, where it can be).
    pub aggregation: Option<Aggregation>,
    /// Keep the recipe's batch per worker: the global batch grows (not an equivalence).
    pub keep_per_worker_batch: bool,
}

/// The single-process run the recipe is: batch, loss, and the lr (or gradient scale).
#[derive(Debug, Clone, PartialEq)]
struct Target {
    batch: usize,
    loss: LossReduction,
    lr: f64,
    notes: Vec<String>,
}

fn lr_is_scale(o: &Optimizer) -> bool {
    matches!(o, Optimizer::Sgd { weight_decay, .. } if *weight_decay == 0.0)
}

fn validate(r: &Recipe) -> Result<(), PlanError> {
    let bad = |m: String| Err(PlanError::BadInput(m));
    if r.batch == 0 {
        return bad("--batch 0: expected a positive batch size".into());
    }
    if !(r.lr.is_finite() && r.lr > 0.0) {
        return bad(format!("--lr {}: expected a positive number", r.lr));
    }
    match r.optimizer {
        Optimizer::Sgd {
            momentum,
            nesterov,
            weight_decay,
        } => {
            if !(0.0..1.0).contains(&momentum) {
                return bad(format!("--momentum {momentum}: expected 0 <= momentum < 1"));
            }
            if nesterov && momentum == 0.0 {
                return bad("--nesterov needs --momentum > 0".into());
            }
            if !(weight_decay.is_finite() && weight_decay >= 0.0) {
                return bad(format!("--weight-decay {weight_decay}: expected 0 or more"));
            }
        }
        Optimizer::Adam { weight_decay, .. } => {
            if !(weight_decay.is_finite() && weight_decay >= 0.0) {
                return bad(format!("--weight-decay {weight_decay}: expected 0 or more"));
            }
        }
    }
    match r.source {
        Source::DataParallel(0) | Source::Ddp(0) => {
            bad("--data-parallel/--ddp 0: expected at least one GPU".into())
        }
        _ => Ok(()),
    }
}

fn target(r: &Recipe) -> Result<Target, PlanError> {
    let mut notes = Vec::new();
    let (batch, lr) = match r.source {
        Source::Single => (r.batch, r.lr),
        Source::DataParallel(g) => {
            notes.push(format!(
                "torch.nn.DataParallel on {g} GPUs splits each batch of {b} over the GPUs, gathers the outputs and computes the {l} loss over all {b} samples; the replicas' gradients are summed, and that sum IS the gradient of that one loss. So the recipe is one process with batch {b}, {l} loss, lr {lr}. {sum_or_mean}.",
                b = r.batch,
                l = r.loss,
                lr = r.lr,
                sum_or_mean = crate::SUM_OR_MEAN
            ));
            (r.batch, r.lr)
        }
        Source::Ddp(p) => {
            let b = r.batch * p;
            match r.loss {
                LossReduction::Mean => {
                    notes.push(format!(
                        "DistributedDataParallel on {p} processes averages their gradients: {p} x {} samples with a mean loss is one process with batch {b}, mean loss, lr {}.",
                        r.batch, r.lr
                    ));
                    (b, r.lr)
                }
                LossReduction::Sum if lr_is_scale(&r.optimizer) => {
                    let lr = r.lr / p as f64;
                    notes.push(format!(
                        "DistributedDataParallel on {p} processes averages their gradients: with a sum loss that is one process with batch {b}, sum loss, lr {} / {p} = {lr}.",
                        r.lr
                    ));
                    (b, lr)
                }
                LossReduction::Sum => {
                    return Err(PlanError::NotExact(format!(
                        "--ddp {p} with --loss sum and {}: DDP averages summed gradients, which divides the gradient by {p}, and with this optimizer that is not an lr scale; no single-process lr reproduces it",
                        r.optimizer.describe()
                    )));
                }
            }
        }
    };
    Ok(Target {
        batch,
        loss: r.loss,
        lr,
        notes,
    })
}

/// The planned config: the TOML lines, what the server will say, and the notes around them.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The output, ready to print: TOML lines, explanations as `#` comments (the whole text
    /// parses as TOML).
    pub text: String,
    /// The statement `ps-server` will print for the planned config.
    pub equivalence: Equivalence,
    /// Per-worker batches of the planned config.
    pub split: Vec<usize>,
}

fn fmt_list(v: &[usize]) -> String {
    v.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The `[optimizer]` lines for `o` with learning rate `lr` (defaults left out).
pub fn optimizer_lines(o: &Optimizer, lr: f64) -> String {
    let mut s = String::new();
    match *o {
        Optimizer::Sgd {
            momentum,
            nesterov,
            weight_decay,
        } => {
            let _ = writeln!(s, "kind = \"sgd\"\nlr = {lr}");
            if momentum != 0.0 {
                let _ = writeln!(s, "momentum = {momentum}");
            }
            if nesterov {
                let _ = writeln!(s, "nesterov = true");
            }
            if weight_decay != 0.0 {
                let _ = writeln!(s, "weight_decay = {weight_decay}");
            }
        }
        Optimizer::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
        } => {
            let kind = if decoupled { "adamw" } else { "adam" };
            let _ = writeln!(s, "kind = \"{kind}\"\nlr = {lr}");
            if beta1 != 0.9 {
                let _ = writeln!(s, "beta1 = {beta1}");
            }
            if beta2 != 0.999 {
                let _ = writeln!(s, "beta2 = {beta2}");
            }
            if eps != 1e-8 {
                let _ = writeln!(s, "eps = {eps:e}");
            }
            if weight_decay != 0.0 {
                let _ = writeln!(s, "weight_decay = {weight_decay}");
            }
        }
    }
    s
}

/// The lines a plan prints (without comments), in the config file's format.
struct Lines {
    workers: usize,
    batch_key: &'static str,
    batch: usize,
    loss: LossReduction,
    aggregation: Aggregation,
    optimizer: String,
}

impl Lines {
    /// A whole config around the lines, as `ps-server` would read it (placeholders elsewhere).
    fn parse(&self) -> Result<Config, PlanError> {
        let text = format!(
            "[cluster]\nservers = [\"127.0.0.1:1\"]\nworkers = {}\n[data]\ndir = \".\"\n[train]\n{} = {}\nsteps = 1\nloss_reduction = \"{}\"\naggregation = \"{}\"\n[optimizer]\n{}",
            self.workers, self.batch_key, self.batch, self.loss, self.aggregation, self.optimizer
        );
        Config::parse(&text, Path::new("ps-plan.toml")).map_err(|e| {
            PlanError::BadInput(format!("the planned lines do not form a valid config: {e}"))
        })
    }
}

fn comment(out: &mut String, text: &str) {
    // wrap at about 96 columns, every line a TOML comment
    let mut line = String::from("#");
    for word in text.split_whitespace() {
        if line.len() + 1 + word.len() > 96 && line.len() > 1 {
            let _ = writeln!(out, "{line}");
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    let _ = writeln!(out, "{line}");
}

fn recipe_words(t: &Target, o: &Optimizer) -> String {
    format!(
        "one process with batch {}, {} loss, {}, lr {}",
        t.batch,
        t.loss,
        o.describe(),
        t.lr
    )
}

/// Plans `req`: the config lines that reproduce the recipe exactly (or, with
/// `keep_per_worker_batch`, the grown-batch config and the large-batch heuristic).
pub fn plan(req: &Request) -> Result<Plan, PlanError> {
    let r = &req.recipe;
    validate(r)?;
    let t = target(r)?;
    let w = req.shape.workers;
    let mut out = String::new();
    comment(
        &mut out,
        &format!(
            "ps-plan: {} on {}",
            recipe_words(&t, &r.optimizer),
            req.shape.describe()
        ),
    );
    for n in &t.notes {
        comment(&mut out, n);
    }
    if req.keep_per_worker_batch {
        return plan_grown(req, &t, out);
    }
    if t.batch < w {
        return Err(PlanError::BadInput(format!(
            "batch {} over {w} workers: expected at least one sample per worker (batch >= workers); use fewer workers, or --keep-per-worker-batch to grow the global batch",
            t.batch
        )));
    }
    let split: Vec<usize> = split_even(t.batch, w).iter().map(|x| x.len()).collect();
    let uneven = split.iter().any(|&b| b != split[0]);
    let scale_ok = lr_is_scale(&r.optimizer);
    let (aggregation, lr, why) = aggregation_and_lr(req, &t, &split, uneven)?;
    let lines = Lines {
        workers: w,
        batch_key: "global_batch",
        batch: t.batch,
        loss: t.loss,
        aggregation,
        optimizer: optimizer_lines(&r.optimizer, lr),
    };
    let cfg = lines.parse()?;
    let eq = cfg.equivalence();
    check_is_recipe(&eq, &t)?;
    comment(&mut out, "config lines that reproduce it exactly:");
    let _ = writeln!(out, "[cluster]\nworkers = {w}");
    let _ = writeln!(
        out,
        "[train]\nglobal_batch = {}    # per-worker batches {}\nloss_reduction = \"{}\"\naggregation = \"{aggregation}\"",
        t.batch,
        fmt_list(&split),
        t.loss
    );
    let _ = write!(out, "[optimizer]\n{}", lines.optimizer);
    comment(&mut out, &format!("why: {why}."));
    state(&mut out, &eq);
    if !eq.warnings.is_empty() && eq.grad_scale != 1.0 {
        comment(
            &mut out,
            &format!(
                "(the lr above, {lr}, already compensates this: the run is the recipe at lr {})",
                t.lr
            ),
        );
    }
    if t.loss == LossReduction::Sum && scale_ok && req.aggregation.is_none() {
        comment(
            &mut out,
            &format!(
                "alternatively: a sum loss is the mean loss times {b}, so with this optimizer loss_reduction = \"mean\", aggregation = \"{}\", lr = {} is the same run.",
                if uneven { "weighted" } else { "mean" },
                t.lr * t.batch as f64,
                b = t.batch
            ),
        );
    }
    Ok(Plan {
        text: out,
        equivalence: eq,
        split,
    })
}

/// The aggregation and the lr that make the cluster's update the recipe's (`t` over
/// `req.shape.workers` workers, per-worker batches `split`, `uneven` when they differ), and
/// why; NotExact for an asked aggregation that cannot be the recipe.
fn aggregation_and_lr(
    req: &Request,
    t: &Target,
    split: &[usize],
    uneven: bool,
) -> Result<(Aggregation, f64, String), PlanError> {
    let r = &req.recipe;
    let w = req.shape.workers;
    let scale_ok = lr_is_scale(&r.optimizer);
    let wf = w as f64;
    // the aggregation and the lr that make the cluster's update the recipe's
    let (aggregation, lr, why) = match (t.loss, req.aggregation) {
        (LossReduction::Mean, None | Some(Aggregation::Mean)) if !uneven => (
            Aggregation::Mean,
            t.lr,
            "mean loss + mean aggregation over equal slices is the mean over the global batch (what DDP does)".to_string(),
        ),
        (LossReduction::Mean, None | Some(Aggregation::Weighted)) => (
            Aggregation::Weighted,
            t.lr,
            if uneven {
                format!(
                    "{} is not divisible by {w}: the slices are {}, and \"weighted\" (sum of b_r g_r / B) keeps it exact where \"mean\" would weight the samples of smaller slices more",
                    t.batch,
                    fmt_list(split)
                )
            } else {
                "weighted = sum of b_r g_r / B: exact for any split".to_string()
            },
        ),
        (LossReduction::Mean, Some(Aggregation::Mean)) => {
            return Err(PlanError::NotExact(format!(
                "aggregation \"mean\" with batch {} over {w} workers (slices {}) weights the samples of smaller slices more: not exactly the recipe; use aggregation \"weighted\" (the default plan)",
                t.batch,
                fmt_list(split)
            )));
        }
        (LossReduction::Mean, Some(Aggregation::Sum)) if uneven => {
            return Err(PlanError::NotExact(format!(
                "aggregation \"sum\" of mean-loss gradients with batch {} over {w} workers (slices {}) weights the samples of smaller slices more: not exactly the recipe; use aggregation \"weighted\" (the default plan)",
                t.batch,
                fmt_list(split)
            )));
        }
        (LossReduction::Mean, Some(Aggregation::Sum)) => {
            if !scale_ok {
                return Err(not_scale(&r.optimizer, "mean", "sum", w, "mean\" or \"weighted"));
            }
            (
                Aggregation::Sum,
                t.lr / wf,
                format!("aggregation \"sum\" of mean-loss gradients is {w} times the mean gradient, so the lr is divided by {w}"),
            )
        }
        (LossReduction::Sum, None | Some(Aggregation::Sum)) => (
            Aggregation::Sum,
            t.lr,
            "sum loss + sum aggregation is the sum over the global batch, for any split".to_string(),
        ),
        (LossReduction::Sum, Some(Aggregation::Mean)) => {
            if !scale_ok {
                return Err(not_scale(&r.optimizer, "sum", "mean", w, "sum"));
            }
            (
                Aggregation::Mean,
                t.lr * wf,
                format!("aggregation \"mean\" of sum-loss gradients is the summed gradient divided by {w}, so the lr is multiplied by {w}"),
            )
        }
        (LossReduction::Sum, Some(Aggregation::Weighted)) => {
            return Err(PlanError::NotExact(
                "aggregation \"weighted\" expects mean-reduced worker gradients; with --loss sum use aggregation \"sum\" (the default plan)".into(),
            ));
        }
    };
    Ok((aggregation, lr, why))
}

fn not_scale(o: &Optimizer, loss: &str, agg: &str, w: usize, use_agg: &str) -> PlanError {
    let factor = if agg == "sum" {
        format!("multiplies the gradient by {w}")
    } else {
        format!("divides the gradient by {w}")
    };
    PlanError::NotExact(format!(
        "loss \"{loss}\" with aggregation \"{agg}\" {factor}, and with {} a gradient scale is not an lr scale (weight decay or Adam's normalisation): no lr makes it exact; use aggregation \"{use_agg}\" (the default plan)",
        o.describe()
    ))
}

/// The server's statement and warnings, as comments.
fn state(out: &mut String, eq: &Equivalence) {
    // one line, whatever its length: this is the line to look for in the server's log
    let _ = writeln!(out, "# ps-server will print: {eq}");
    for w in &eq.warnings {
        comment(out, &format!("warning: {w}"));
    }
}

fn check_is_recipe(eq: &Equivalence, t: &Target) -> Result<(), PlanError> {
    let lr_ok = (eq.grad_scale == 1.0 || eq.lr_is_scale) && (eq.lr - t.lr).abs() <= 1e-9 * t.lr;
    if eq.exact && eq.global_batch == t.batch && eq.loss_reduction == t.loss && lr_ok {
        Ok(())
    } else {
        Err(PlanError::NotExact(format!(
            "internal check failed: the planned config states \"{eq}\", not one process with batch {}, {} loss, lr {}",
            t.batch, t.loss, t.lr
        )))
    }
}

/// `--keep-per-worker-batch`: what the config with the recipe's batch on every worker is, and
/// the large-batch heuristic (labelled as such).
fn plan_grown(req: &Request, t: &Target, mut out: String) -> Result<Plan, PlanError> {
    let r = &req.recipe;
    let w = req.shape.workers;
    let b = match r.source {
        Source::Ddp(_) => r.batch,
        Source::DataParallel(g) if r.batch.is_multiple_of(g) => r.batch / g,
        Source::DataParallel(g) => {
            return Err(PlanError::BadInput(format!(
                "--keep-per-worker-batch with --data-parallel {g}: the batch {} does not split evenly over {g} GPUs, so there is no per-GPU batch to keep",
                r.batch
            )));
        }
        Source::Single => t.batch,
    };
    let (aggregation, lr) = match t.loss {
        LossReduction::Mean => (Aggregation::Mean, t.lr),
        LossReduction::Sum => (Aggregation::Sum, t.lr),
    };
    let lines = Lines {
        workers: w,
        batch_key: "per_worker_batch",
        batch: b,
        loss: t.loss,
        aggregation,
        optimizer: optimizer_lines(&r.optimizer, lr),
    };
    let cfg = lines.parse()?;
    let eq = cfg.equivalence();
    let global = b * w;
    comment(
        &mut out,
        &format!(
            "--keep-per-worker-batch: {b} samples on each of {w} workers, so the global batch grows to {global}. This is NOT the recipe (that is the plan without this flag); it is a different single-process run:"
        ),
    );
    let _ = writeln!(out, "[cluster]\nworkers = {w}");
    let _ = writeln!(
        out,
        "[train]\nper_worker_batch = {b}    # global batch {global}\nloss_reduction = \"{}\"\naggregation = \"{aggregation}\"",
        t.loss
    );
    let _ = write!(out, "[optimizer]\n{}", lines.optimizer);
    state(&mut out, &eq);
    let ratio = global as f64 / t.batch as f64;
    let k = fmt_ratio(ratio);
    comment(
        &mut out,
        &format!(
            "what changes: each step averages {global} samples instead of {} ({k} times as many, so less gradient noise per step); an epoch has {k} times fewer steps, so the same number of epochs makes {k} times fewer updates.{}",
            t.batch,
            if t.loss == LossReduction::Sum {
                format!(
                    " With a sum loss the gradient itself grows {k} times: at the same lr every step is about {k} times larger."
                )
            } else {
                String::new()
            }
        ),
    );
    if ratio > 1.0 {
        let (rule, new_lr) = match (r.optimizer.clone(), t.loss) {
            (_, LossReduction::Sum) => (
                "a sum loss already grows the gradient with the batch; the heuristic is to keep the lr and warm it up".to_string(),
                lr,
            ),
            (Optimizer::Sgd { .. }, LossReduction::Mean) => (
                format!("the linear scaling rule (Goyal et al. 2017, \"Accurate, Large Minibatch SGD\"): multiply the lr by {k}, and warm it up linearly from small over the first epochs (they used 5)"),
                lr * ratio,
            ),
            (Optimizer::Adam { .. }, LossReduction::Mean) => (
                format!("for Adam/AdamW the usual rule is square-root scaling (Malladi et al. 2022): multiply the lr by sqrt({k}), with a warmup"),
                lr * ratio.sqrt(),
            ),
        };
        comment(
            &mut out,
            &format!(
                "HEURISTIC, not an equivalence: {rule}. It often recovers the small-batch accuracy in the same number of epochs, but it can fail for large batches (check the loss curve): uncomment to try it:"
            ),
        );
        let _ = writeln!(out, "# [optimizer] lr = {new_lr}");
        let _ = writeln!(
            out,
            "# [schedule] warmup_steps = ...   (about 5% of the run's steps)"
        );
    }
    Ok(Plan {
        text: out,
        equivalence: eq,
        split: vec![b; w],
    })
}

fn fmt_ratio(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{x}")
    } else {
        format!("{x:.3}")
    }
}

/// `ps-plan --config F`: which single-process run `cfg` equals, its warnings, and when it
/// rescales the lr or is not exact, the lines that would make its own lr exact.
pub fn explain(cfg: &Config) -> String {
    let mut out = String::new();
    let split = cfg.worker_batches();
    comment(
        &mut out,
        &format!(
            "{}: {} worker{}, global batch {}{} (per-worker batches {}), loss_reduction \"{}\", aggregation \"{}\", {}, lr {}",
            cfg.path.display(),
            cfg.cluster.workers,
            plural(cfg.cluster.workers),
            cfg.train.global_batch,
            if cfg.train.batch_from_per_worker {
                " from per_worker_batch"
            } else {
                ""
            },
            fmt_list(&split),
            cfg.train.loss_reduction,
            cfg.train.aggregation,
            cfg.describe_optimizer(),
            cfg.schedule.base_lr
        ),
    );
    if cfg.train.micro_batches > 1 {
        comment(
            &mut out,
            &format!(
                "[train] micro_batches = {}: each worker computes its batch ({}) in {} micro-batches of {} and sums their gradients before pushing; the step is the same (activation memory per pass is 1/{} of it)",
                cfg.train.micro_batches,
                fmt_list(&split),
                cfg.train.micro_batches,
                fmt_list(
                    &split
                        .iter()
                        .map(|b| b / cfg.train.micro_batches)
                        .collect::<Vec<_>>()
                ),
                cfg.train.micro_batches
            ),
        );
    }
    let eq = cfg.equivalence();
    state(&mut out, &eq);
    if !eq.exact || eq.grad_scale != 1.0 {
        // what the user most likely meant: one process at the config's own lr
        let req = Request {
            recipe: Recipe {
                batch: cfg.train.global_batch,
                lr: cfg.schedule.base_lr,
                loss: cfg.train.loss_reduction,
                optimizer: cfg.optimizer.clone(),
                source: Source::Single,
            },
            shape: Shape {
                workers: cfg.cluster.workers,
                nodes: None,
            },
            // a short last batch is split unevenly: only weighted stays exact
            aggregation: (cfg.train.keep_last && cfg.train.loss_reduction == LossReduction::Mean)
                .then_some(Aggregation::Weighted),
            keep_per_worker_batch: false,
        };
        if let Ok(p) = plan(&req) {
            comment(
                &mut out,
                &format!(
                    "if you meant one process with batch {}, {} loss, lr {} (this config's own lr), use instead:",
                    cfg.train.global_batch, cfg.train.loss_reduction, cfg.schedule.base_lr
                ),
            );
            for l in p.text.lines().filter(|l| !l.starts_with('#')) {
                let _ = writeln!(out, "{l}");
            }
            if let Some(c) = cfg.clip_norm {
                // clipping is of the gradient the shards hold, which the plan keeps unscaled
                let _ = writeln!(out, "clip_norm = {c}");
            }
            if cfg.train.micro_batches > 1 {
                comment(
                    &mut out,
                    &format!(
                        "and keep [train] micro_batches = {}",
                        cfg.train.micro_batches
                    ),
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sgd(momentum: f32) -> Optimizer {
        Optimizer::Sgd {
            momentum,
            nesterov: false,
            weight_decay: 0.0,
        }
    }

    fn req(batch: usize, lr: f64, loss: LossReduction, w: usize) -> Request {
        Request {
            recipe: Recipe {
                batch,
                lr,
                loss,
                optimizer: sgd(0.9),
                source: Source::Single,
            },
            shape: Shape::workers(w).unwrap(),
            aggregation: None,
            keep_per_worker_batch: false,
        }
    }

    fn parses_as_toml(text: &str) {
        // the lines without the [cluster]-[train]-[optimizer] duplicates parse as TOML
        let _: toml::Table = toml::from_str(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    }

    #[test]
    fn even_mean_plans_mean_aggregation_at_the_same_lr() {
        let p = plan(&req(16, 0.01, LossReduction::Mean, 4)).unwrap();
        assert_eq!(p.split, [4, 4, 4, 4]);
        assert!(p.text.contains("aggregation = \"mean\"\n"), "{}", p.text);
        assert!(p.text.contains("lr = 0.01\n"));
        assert_eq!(
            p.equivalence.to_string(),
            "equivalent to one process with batch 16, mean loss, lr 0.01"
        );
        parses_as_toml(&p.text);
    }

    #[test]
    fn uneven_mean_plans_weighted_and_forced_mean_is_refused() {
        let p = plan(&req(30, 0.1, LossReduction::Mean, 4)).unwrap();
        assert_eq!(p.split, [8, 8, 7, 7]);
        assert!(p.text.contains("aggregation = \"weighted\""));
        let mut r = req(30, 0.1, LossReduction::Mean, 4);
        r.aggregation = Some(Aggregation::Mean);
        assert!(matches!(plan(&r), Err(PlanError::NotExact(m)) if m.contains("8, 8, 7, 7")));
    }

    #[test]
    fn forced_aggregations_rescale_the_lr_only_where_that_is_exact() {
        let mut r = req(16, 0.002, LossReduction::Sum, 2);
        r.aggregation = Some(Aggregation::Mean);
        let p = plan(&r).unwrap();
        assert!(p.text.contains("lr = 0.004\n"), "{}", p.text);
        assert_eq!(p.equivalence.grad_scale, 0.5);
        let mut r = req(16, 0.1, LossReduction::Mean, 4);
        r.aggregation = Some(Aggregation::Sum);
        assert!(plan(&r).unwrap().text.contains("lr = 0.025\n"));
        r.recipe.optimizer = Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        };
        assert!(matches!(plan(&r), Err(PlanError::NotExact(m)) if m.contains("not an lr scale")));
    }

    #[test]
    fn bad_input_is_named() {
        let e = plan(&req(3, 0.1, LossReduction::Mean, 4)).unwrap_err();
        assert!(e.to_string().starts_with("batch 3 over 4 workers"), "{e}");
        let e = plan(&req(16, 0.0, LossReduction::Mean, 4)).unwrap_err();
        assert_eq!(e.to_string(), "--lr 0: expected a positive number");
        assert!(Shape::workers(0).is_err() && Shape::nodes(2, 0).is_err());
    }

    #[test]
    fn explain_suggests_weighted_for_a_kept_short_batch() {
        let text = "[cluster]\nservers = [\"127.0.0.1:1\"]\nworkers = 2\n[data]\ndir = \".\"\n[train]\nglobal_batch = 64\nsteps = 5\nkeep_last = true\nloss_reduction = \"mean\"\naggregation = \"mean\"\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
        let cfg = Config::parse(text, Path::new("k.toml")).unwrap();
        let out = explain(&cfg);
        assert!(out.contains("approximately (not exactly)"), "{out}");
        assert!(out.contains("\naggregation = \"weighted\"\n"), "{out}");
        parses_as_toml(&out);
        let mut r = req(30, 0.1, LossReduction::Mean, 4);
        r.aggregation = Some(Aggregation::Sum);
        assert!(matches!(plan(&r), Err(PlanError::NotExact(m)) if m.contains("8, 8, 7, 7")));
        let mut r = req(30, 0.1, LossReduction::Mean, 4);
        r.recipe.source = Source::DataParallel(4);
        r.keep_per_worker_batch = true;
        assert!(
            matches!(plan(&r), Err(PlanError::BadInput(m)) if m.contains("does not split evenly"))
        );
        r.recipe.batch = 32;
        assert!(plan(&r).unwrap().text.contains("per_worker_batch = 8 "));
    }

    #[test]
    fn grown_batch_states_the_new_run_and_labels_the_heuristic() {
        let mut r = req(32, 0.1, LossReduction::Mean, 4);
        r.keep_per_worker_batch = true;
        let p = plan(&r).unwrap();
        assert!(p.text.contains("per_worker_batch = 32"));
        assert_eq!(
            p.equivalence.to_string(),
            "equivalent to one process with batch 128, mean loss, lr 0.1"
        );
        assert!(p.text.contains("HEURISTIC, not an equivalence"));
        assert!(p.text.contains("# [optimizer] lr = 0.4\n"), "{}", p.text);
        parses_as_toml(&p.text);
    }
}
