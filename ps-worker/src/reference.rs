//! The single-process reference: the same model code and optimizer, batch `B`, the same data
//! order, no network. A distributed run must end at its weights, bit for bit with one
//! worker.

use ps_config::Config;
use ps_data::idx::Dataset;
use ps_data::order::BatchPlanner;

/// Result of a reference run.
#[derive(Debug, Clone)]
pub struct ReferenceRun {
    /// Final flat weights.
    pub weights: Vec<f32>,
    /// Steps run.
    pub steps: u64,
    /// Mean training loss of the last step.
    pub last_loss: f64,
}

/// Which single process a reference run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One gradient of the whole global batch (the single-process run of
    /// [`Config::equivalence`]).
    GlobalBatch,
    /// The mean of the `W` workers' mean gradients, each of its own part of the global batch,
    /// with equal weights: what `aggregation = "mean"` computes when the parts are uneven
    /// ([`ps_config::Equivalence::mean_of_means`]). Equals [`Kind::GlobalBatch`] up
    /// to rounding when every part has the same length.
    MeanOfMeans,
}

/// Trains `cfg`'s model in one process on `train` for the run's steps, as the single-process
/// run of [`Config::equivalence`]: batch `B`, the configured loss reduction, and the
/// equivalent learning rate (or gradient scale, when the optimizer makes them differ).
pub fn run_reference(cfg: &Config, train: &Dataset) -> anyhow::Result<ReferenceRun> {
    run_reference_of(cfg, train, Kind::GlobalBatch)
}

/// [`run_reference`], computing each step's gradient as `kind` says.
pub fn run_reference_of(cfg: &Config, train: &Dataset, kind: Kind) -> anyhow::Result<ReferenceRun> {
    let layout = cfg.layout();
    let spec = cfg.spec();
    let total = cfg.total_steps(train.len())?;
    let eq = cfg.equivalence();
    let schedule = cfg.schedule_for(total);
    // with clipping the gradient is scaled as the shards hold it, then clipped (never an lr
    // scale instead: eq.lr_is_scale is false then)
    let (lr_factor, grad_factor) = if eq.lr_is_scale {
        (eq.grad_scale, 1.0)
    } else {
        (1.0, eq.grad_scale as f32)
    };
    // the seeded init, or the init file of a declared MLP or of the CNN
    let mut params = cfg
        .initial_range(0..layout.num_params())
        .map_err(anyhow::Error::msg)?;
    let mut opt = cfg.optimizer.init_state(params.len());
    let mut backend = crate::cpu::cpu_model(&layout, 0);
    let mut planner = BatchPlanner::new(cfg.data_order(train.len()));
    let mut grad = vec![0f32; params.len()];
    let mut part = vec![0f32; params.len()];
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let mut last_loss = 0.0;
    let world = cfg.cluster.workers;
    let mut exact_acc = ps_net::exact::TermSum::default();
    for t in 0..total {
        backend.set_weights(&params)?;
        if let Some(m) = cfg.train.exact_micro_batch {
            // [train] exact_sum: the terms of the global batch's micro-batches summed exactly,
            // rounded once, times the shards' coefficient ([`exact_step`])
            train.gather(planner.global_batch(t), &mut x, &mut y);
            last_loss = exact_step(
                cfg,
                backend.as_mut(),
                (&x, &y),
                m,
                &mut exact_acc,
                &mut part,
                &mut grad,
            )?;
        } else if kind == Kind::GlobalBatch {
            train.gather(planner.global_batch(t), &mut x, &mut y);
            let stats = backend.forward_backward(&x, &y, cfg.train.loss_reduction, &mut grad)?;
            last_loss = stats.loss_sum / y.len().max(1) as f64;
        } else {
            // each worker's mean gradient, summed in rank order with coefficient 1/W as the
            // shards do; a worker without samples contributes nothing
            grad.iter_mut().for_each(|g| *g = 0.0);
            let (mut loss_sum, mut samples) = (0.0, 0usize);
            let c = 1.0 / world as f32;
            for rank in 0..world {
                train.gather(planner.worker_batch(t, rank, world), &mut x, &mut y);
                if y.is_empty() {
                    continue;
                }
                let stats =
                    backend.forward_backward(&x, &y, cfg.train.loss_reduction, &mut part)?;
                loss_sum += stats.loss_sum;
                samples += y.len();
                grad.iter_mut().zip(&part).for_each(|(g, p)| *g += c * p);
            }
            last_loss = loss_sum / samples.max(1) as f64;
        }
        if grad_factor != 1.0 {
            grad.iter_mut().for_each(|g| *g *= grad_factor);
        }
        if let Some(max_norm) = cfg.clip_norm {
            ps_model::clip::clip_grad_norm(&spec, &mut grad, max_norm);
        }
        let lr = schedule.lr(t) * lr_factor;
        cfg.optimizer.step(&mut params, &grad, &mut opt, lr as f32);
    }
    Ok(ReferenceRun {
        weights: params,
        steps: total,
        last_loss,
    })
}

/// One step's gradient of the exact-sum mode into `grad`: the exact sum of the terms of `m`
/// samples of the global batch `x`/`y`, rounded once, times the coefficient the shards apply
/// (the mean over the terms with a mean loss, 1 with a sum loss); returns the mean loss.
fn exact_step(
    cfg: &Config,
    backend: &mut dyn crate::backend::Backend,
    (x, y): (&[f32], &[u8]),
    m: usize,
    acc: &mut ps_net::exact::TermSum,
    part: &mut Vec<f32>,
    grad: &mut [f32],
) -> anyhow::Result<f64> {
    let reduction = cfg.train.loss_reduction;
    let stats = crate::exact::partial_sum(backend, x, y, reduction, (m, grad.len()), acc, part)?;
    acc.round(grad)?;
    if reduction == ps_config::LossReduction::Mean {
        let c = ps_net::exact::mean_coefficient(y.len() / m);
        grad.iter_mut().for_each(|g| *g *= c);
    }
    Ok(stats.loss_sum / y.len().max(1) as f64)
}

/// Runs the reference for `cfg` and compares it with the shard weights a cluster wrote to
/// `out_dir`: returns the largest relative difference (see [`ps_model::weights::max_rel_diff`])
/// and the tensor where it occurs.
pub fn compare_with_reference(
    cfg: &Config,
    out_dir: &std::path::Path,
) -> anyhow::Result<(f64, String)> {
    let layout = cfg.layout();
    let classes = cfg.model.dims[cfg.model.dims.len() - 1];
    let train = ps_data::idx::load_split(&cfg.data.dir, ps_data::idx::Split::Train, classes)?;
    let (cluster, version) =
        ps_model::weights::read_shards(out_dir, cfg.num_shards(), layout.num_params())?;
    let reference = run_reference(cfg, &train)?;
    if version != reference.steps {
        anyhow::bail!(
            "the cluster's weights are at version {version}, the reference ran {} steps",
            reference.steps
        );
    }
    Ok(ps_model::weights::max_rel_diff(
        &layout,
        &cluster,
        &reference.weights,
    ))
}
