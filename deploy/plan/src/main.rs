//! `ps-plan`: from a single-process recipe and a cluster shape, the config lines that reproduce
//! it exactly (`ps_config::plan`); `ps-plan --config F` says what an existing config equals;
//! `ps-plan <recipe> --config IN --out OUT` writes IN with the planned lines merged in (a
//! planned key replaces the file's, and clears the key it excludes: `global_batch` and
//! `per_worker_batch`), checked like any config. Bad input exits 2 with the reason.

use clap::{Parser, ValueEnum};
use ps_config::plan::PlanError;
use ps_config::plan::{Recipe, Request, Shape, Source, explain, plan};
use ps_config::{Aggregation, Config, ConfigError, LossReduction};
use ps_optim::Optimizer;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "ps-plan",
    version,
    about = "Plan a cluster config that reproduces a single-process training run, or explain a config"
)]
struct Cli {
    /// Explain this config: which single-process run it equals, and its warnings. With a
    /// recipe and --out: the config to merge the planned lines into.
    #[arg(long)]
    config: Option<PathBuf>,
    /// With a recipe and --config IN: write IN with the planned lines merged in here (comments
    /// of IN are not kept; relative paths stay relative to IN's directory, so write it beside IN).
    #[arg(long, requires = "config", requires = "batch")]
    out: Option<PathBuf>,
    /// The recipe's batch (with --ddp: each process's batch).
    #[arg(long, required_unless_present = "config")]
    batch: Option<usize>,
    /// The recipe's learning rate.
    #[arg(
        long,
        required_unless_present = "config",
        allow_negative_numbers = true
    )]
    lr: Option<f64>,
    /// The recipe's loss reduction.
    #[arg(long, value_enum, required_unless_present = "config")]
    loss: Option<Loss>,
    /// The recipe's optimizer.
    #[arg(long, value_enum, default_value = "sgd")]
    optimizer: Opt,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    momentum: f32,
    /// SGD Nesterov momentum.
    #[arg(long)]
    nesterov: bool,
    /// Weight decay (L2 for sgd/adam, decoupled for adamw).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    weight_decay: f32,
    /// The recipe ran under torch.nn.DataParallel on this many GPUs (--batch: the DataLoader's).
    #[arg(long, conflicts_with = "ddp")]
    data_parallel: Option<usize>,
    /// The recipe ran under DistributedDataParallel on this many processes (--batch: each one's).
    #[arg(long)]
    ddp: Option<usize>,
    /// Workers of the cluster.
    #[arg(long, conflicts_with_all = ["nodes", "gpus_per_node"], required_unless_present_any = ["config", "nodes"])]
    workers: Option<usize>,
    /// Nodes of the cluster (with --gpus-per-node: one worker per GPU).
    #[arg(long, requires = "gpus_per_node")]
    nodes: Option<usize>,
    /// GPUs per node.
    #[arg(long, requires = "nodes")]
    gpus_per_node: Option<usize>,
    /// Use this aggregation (the lr is adjusted where that stays exact).
    #[arg(long, value_enum)]
    aggregation: Option<Agg>,
    /// Keep the recipe's batch on every worker and grow the global batch (not an equivalence).
    #[arg(long)]
    keep_per_worker_batch: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Loss {
    Mean,
    Sum,
}

#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum Opt {
    Sgd,
    Adam,
    Adamw,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Agg {
    Mean,
    Sum,
    Weighted,
}

/// Why `ps-plan` refuses (exit code 2), each message naming what was expected.
#[derive(Debug, thiserror::Error)]
enum Error {
    /// The config to explain or merge into.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The recipe or the cluster shape.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A recipe with --config but no --out.
    #[error(
        "--config with a recipe: give --out OUT too (the merged config is written there), or leave the recipe out to explain the config"
    )]
    NoOut,
    /// --momentum or --nesterov with an Adam optimizer (named).
    #[error("--momentum/--nesterov are SGD settings; --optimizer {0} uses betas 0.9/0.999")]
    SgdSetting(&'static str),
    /// The config with the planned lines merged in does not load.
    #[error("{} with the planned lines merged in is not a valid config: {message}", into.display())]
    Merged {
        /// The config merged into.
        into: PathBuf,
        /// Why it does not load.
        message: String,
    },
    /// The merged config would train beyond the recipe (each setting named with the recipe's).
    #[error(
        "{} sets training the recipe does not have: {conflicts}; the merged file would not be the recipe, so nothing was written: give the recipe those settings (--optimizer, --momentum, --nesterov, --weight-decay) or remove them from {} ([schedule], [[optimizer.groups]] and clip_norm have no ps-plan flag: merge without them, then add them back knowing the run is no longer the recipe)",
        into.display(),
        into.display()
    )]
    NotTheRecipe {
        /// The config merged into.
        into: PathBuf,
        /// The settings beyond the recipe, each with the recipe's value.
        conflicts: String,
    },
    /// Reading or writing a file.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        error: std::io::Error,
    },
    /// The config to merge into is not TOML.
    #[error("{}: {error}", path.display())]
    Toml {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        error: toml::de::Error,
    },
    /// The planned lines are not TOML (a bug of the planner).
    #[error("the planned lines: {0}")]
    PlannedLines(toml::de::Error),
    /// A planned section is a plain key in the config.
    #[error("{}: {section} is not a [section]", path.display())]
    NotASection {
        /// The config.
        path: PathBuf,
        /// The section.
        section: String,
    },
    /// The merged table cannot be written as TOML.
    #[error(transparent)]
    Serialize(#[from] toml::ser::Error),
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<String, Error> {
    if let (Some(f), None) = (&cli.config, &cli.batch) {
        let cfg = Config::load(f)?;
        return Ok(explain(&cfg));
    }
    let merge = match (&cli.config, &cli.out) {
        (Some(into), Some(out)) => Some((into.clone(), out.clone())),
        (Some(_), None) => {
            return Err(Error::NoOut);
        }
        _ => None,
    };
    let shape = match (cli.workers, cli.nodes, cli.gpus_per_node) {
        (Some(w), _, _) => Shape::workers(w),
        (None, Some(n), Some(g)) => Shape::nodes(n, g),
        _ => unreachable!("clap requires --workers or --nodes with --gpus-per-node"),
    }?;
    if cli.optimizer != Opt::Sgd && (cli.momentum != 0.0 || cli.nesterov) {
        return Err(Error::SgdSetting(if cli.optimizer == Opt::Adam {
            "adam"
        } else {
            "adamw"
        }));
    }
    let optimizer = match cli.optimizer {
        Opt::Sgd => Optimizer::Sgd {
            momentum: cli.momentum,
            nesterov: cli.nesterov,
            weight_decay: cli.weight_decay,
        },
        Opt::Adam | Opt::Adamw => Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: cli.weight_decay,
            decoupled: cli.optimizer == Opt::Adamw,
        },
    };
    let source = match (cli.data_parallel, cli.ddp) {
        (Some(g), _) => Source::DataParallel(g),
        (_, Some(p)) => Source::Ddp(p),
        _ => Source::Single,
    };
    let req = Request {
        recipe: Recipe {
            batch: cli.batch.expect("required by clap"),
            lr: cli.lr.expect("required by clap"),
            loss: match cli.loss.expect("required by clap") {
                Loss::Mean => LossReduction::Mean,
                Loss::Sum => LossReduction::Sum,
            },
            optimizer,
            source,
        },
        shape,
        aggregation: cli.aggregation.map(|a| match a {
            Agg::Mean => Aggregation::Mean,
            Agg::Sum => Aggregation::Sum,
            Agg::Weighted => Aggregation::Weighted,
        }),
        keep_per_worker_batch: cli.keep_per_worker_batch,
    };
    let text = plan(&req)?.text;
    let planned_optimizer = req.recipe.optimizer.clone();
    let Some((into, out)) = merge else {
        return Ok(text);
    };
    let merged = merge_into(&into, &text)?;
    // checked like any config before it is written (paths relative to IN's directory)
    let cfg = Config::parse(&merged, &into).map_err(|e| Error::Merged {
        into: into.clone(),
        message: e.message,
    })?;
    let conflicts = not_in_the_recipe(&cfg, &planned_optimizer);
    if !conflicts.is_empty() {
        return Err(Error::NotTheRecipe {
            into: into.clone(),
            conflicts: conflicts.join("; "),
        });
    }
    std::fs::write(&out, &merged).map_err(|e| Error::Io {
        path: out.clone(),
        error: e,
    })?;
    Ok(format!(
        "{text}# written: {} with the lines above merged in -> {}\n# ps-server will print: {}\n",
        into.display(),
        out.display(),
        cfg.equivalence()
    ))
}

/// What the merged `cfg` trains with beyond the recipe (whose optimizer is `optimizer`, at a
/// constant lr, without groups or clipping), each said with the recipe's value.
fn not_in_the_recipe(cfg: &Config, optimizer: &Optimizer) -> Vec<String> {
    let mut out = Vec::new();
    if cfg.optimizer != *optimizer {
        out.push(format!(
            "[optimizer] {} (the recipe: {})",
            cfg.optimizer.describe(),
            optimizer.describe()
        ));
    }
    let s = &cfg.schedule;
    if s.warmup_steps > 0 || !matches!(s.decay, ps_optim::Decay::Constant) {
        out.push(format!(
            "[schedule] {} (the recipe: constant {})",
            s.describe(),
            s.base_lr
        ));
    }
    if !cfg.groups.is_empty() {
        out.push(format!(
            "[[optimizer.groups]] ({} groups; the recipe: none)",
            cfg.groups.len()
        ));
    }
    if let Some(c) = cfg.clip_norm {
        out.push(format!("[optimizer] clip_norm = {c} (the recipe: none)"));
    }
    out
}

/// The config file `into` with the planned `lines` (TOML) merged in: each planned key replaces
/// the file's, and clears the keys it excludes (`ps_config::ALTERNATIVES`).
fn merge_into(into: &Path, lines: &str) -> Result<String, Error> {
    let text = std::fs::read_to_string(into).map_err(|e| Error::Io {
        path: into.to_path_buf(),
        error: e,
    })?;
    let mut table: toml::Table = toml::from_str(&text).map_err(|e| Error::Toml {
        path: into.to_path_buf(),
        error: e,
    })?;
    let planned: toml::Table = toml::from_str(lines).map_err(Error::PlannedLines)?;
    for (section, values) in planned {
        let toml::Value::Table(values) = values else {
            continue;
        };
        let entry = table
            .entry(section.clone())
            .or_insert_with(|| toml::Value::Table(Default::default()));
        let toml::Value::Table(target) = entry else {
            return Err(Error::NotASection {
                path: into.to_path_buf(),
                section,
            });
        };
        for (key, value) in values {
            for (s, keys) in ps_config::ALTERNATIVES {
                if s == section && keys.contains(&key.as_str()) {
                    for other in keys.iter().filter(|k| **k != key) {
                        target.remove(*other);
                    }
                }
            }
            target.insert(key, value);
        }
    }
    Ok(toml::to_string(&table)?)
}
