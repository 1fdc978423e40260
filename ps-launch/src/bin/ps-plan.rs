//! `ps-plan`: from a single-process recipe and a cluster shape, the config lines that reproduce
//! it exactly (`ps_common::plan`); `ps-plan --config F` says what an existing config equals.
//! Bad input exits 2 with the reason.

use clap::{Parser, ValueEnum};
use ps_common::config::{Aggregation, Config, LossReduction};
use ps_common::optim::Optimizer;
use ps_common::plan::{Recipe, Request, Shape, Source, explain, plan};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "ps-plan",
    version,
    about = "Plan a cluster config that reproduces a single-process training run, or explain a config"
)]
struct Cli {
    /// Explain this config: which single-process run it equals, and its warnings.
    #[arg(long, conflicts_with_all = ["batch", "lr", "loss", "workers", "nodes", "data_parallel", "ddp", "keep_per_worker_batch", "aggregation"])]
    config: Option<PathBuf>,
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

fn run(cli: Cli) -> Result<String, String> {
    if let Some(f) = &cli.config {
        let cfg = Config::load(f).map_err(|e| e.to_string())?;
        return Ok(explain(&cfg));
    }
    let shape = match (cli.workers, cli.nodes, cli.gpus_per_node) {
        (Some(w), _, _) => Shape::workers(w),
        (None, Some(n), Some(g)) => Shape::nodes(n, g),
        _ => unreachable!("clap requires --workers or --nodes with --gpus-per-node"),
    }
    .map_err(|e| e.to_string())?;
    if cli.optimizer != Opt::Sgd && (cli.momentum != 0.0 || cli.nesterov) {
        return Err(format!(
            "--momentum/--nesterov are SGD settings; --optimizer {} uses betas 0.9/0.999",
            if cli.optimizer == Opt::Adam {
                "adam"
            } else {
                "adamw"
            }
        ));
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
    plan(&req).map(|p| p.text).map_err(|e| e.to_string())
}
