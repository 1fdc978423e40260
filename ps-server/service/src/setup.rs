//! Loading what a shard starts from: its [`ShardSetup`](crate::ShardSetup) from the config and
//! the data files' lengths ([`load_setup`]), and the checkpoint it resumes from
//! ([`load_checkpoint`]).

use crate::ShardSetup;
use crate::checkpoint::{self, Identity, Saved};
use crate::shard::Shard;
use anyhow::Context;
use ps_config::Config;

/// The state shard `index` resumes from: the newest version of which every shard has an
/// intact checkpoint (its checksum verified) in the config's checkpoint directory, the
/// versions skipped named at WARN; the error says what is missing or wrong.
pub fn load_checkpoint(cfg: &Config, index: usize, train_len: usize) -> anyhow::Result<Saved> {
    load_checkpoint_of(cfg, index, train_len, None)
}

/// [`load_checkpoint`] of run `from` (`--resume-from RUN`), instead of this run's own (the
/// config's `[cluster] run_id`); a checkpoint of any other run is refused, naming both.
pub fn load_checkpoint_of(
    cfg: &Config,
    index: usize,
    train_len: usize,
    from: Option<&str>,
) -> anyhow::Result<Saved> {
    let total_steps = cfg.total_steps(train_len)?;
    let dir = cfg.checkpoint_dir();
    let s = cfg.num_shards();
    let (version, skipped) = checkpoint::latest_intact_common(&dir, s);
    let version = version.ok_or_else(|| {
        if !skipped.is_empty() {
            anyhow::anyhow!(
                "--resume: no version that all {s} shards have an intact checkpoint of in {}: {}",
                dir.display(),
                skipped.join("; ")
            )
        } else if checkpoint::any_checkpoint(&dir) {
            anyhow::anyhow!(
                "--resume: no version that all {s} shards have a checkpoint of in {} ({}; files of another shard count do not count)",
                dir.display(),
                checkpoint::describe_versions(&dir, s)
            )
        } else {
            anyhow::anyhow!(
                "--resume: no version that all {s} shards have a checkpoint of in {}: it holds no checkpoint (expected files shard-<i>-of-{s}-v<version>.safetensors; a run writes them when [checkpoint] every is set)",
                dir.display()
            )
        }
    })?;
    if !skipped.is_empty() {
        tracing::warn!(
            "shard {index}: --resume: the newest version every shard holds intact is {version}; skipped: {}",
            skipped.join("; ")
        );
    }
    if version > total_steps {
        anyhow::bail!(
            "--resume: the checkpoints in {} are at version {version}, past the end of this run ({total_steps} steps)",
            dir.display()
        );
    }
    let range = Shard::range_of(cfg, index);
    let fresh = cfg.optimizer.init_state(range.len());
    let mut id = Identity::of(cfg, index, range);
    if let Some(run) = from {
        id.run_id = (!run.is_empty()).then(|| run.to_string());
    }
    let saved = checkpoint::read(&dir, &id, version, &fresh)
        .map_err(|e| anyhow::anyhow!("--resume: {e}"))?;
    tracing::info!(
        "shard {index}: resuming at version {version} from {}",
        checkpoint::file(&dir, index, s, version).display()
    );
    Ok(saved)
}

/// Loads and checks the config (with the command line's `overrides`) and the training set a
/// shard needs; the error names the file.
pub fn load_setup(
    config: &std::path::Path,
    index: usize,
    shard0: Option<String>,
    overrides: &ps_config::Overrides,
) -> anyhow::Result<ShardSetup> {
    let cfg = Config::load_with(config, overrides)?;
    if index >= cfg.num_shards() {
        anyhow::bail!(
            "--shard {index}: expected a shard index in 0..{} ({} lists {} servers)",
            cfg.num_shards(),
            config.display(),
            cfg.num_shards()
        );
    }
    // where the data directory came from, for an error a person can act on
    let given = overrides
        .sets
        .iter()
        .rev()
        .find(|s| s.key == "data.dir")
        .map(|s| s.source.clone());
    let data_dir = match (&overrides.data_dir, given) {
        (Some(_), _) => format!("[data] dir = {} (from --data-dir)", cfg.data.dir.display()),
        (None, Some(source)) => format!("[data] dir = {} (from {source})", cfg.data.dir.display()),
        (None, None) => format!(
            "[data] dir = {} (in {}; a relative dir is taken from the config file's directory)",
            cfg.data.dir.display(),
            config.display()
        ),
    };
    // the shard needs the number of samples (the data order) but not the images; a declared
    // model's workers may bring their own data ([data] train_len), and their evaluation is
    // theirs too (any test set, any length: no test slices to check)
    let (train_len, test_len) = match cfg.data.train_len {
        Some(n) => (n, None),
        None => idx_lengths(&cfg, &data_dir)?,
    };
    let shard0 = shard0.or_else(|| (index > 0).then(|| cfg.cluster.servers[0].clone()));
    let cfg_metrics = cfg.server.metrics_addrs.get(index).cloned();
    Ok(ShardSetup {
        train_len,
        test_len,
        cfg,
        index,
        shard0,
        resume_from: None,
        metrics_listen: cfg_metrics,
        health_listen: None,
    })
}

/// The training set's length from the IDX directory's header, and, for the built-in model, the
/// test set's (each rank evaluates its slice of it). A declared model's evaluation is the
/// user's own (any test set, any length): no test length to check it against. `data_dir` says
/// where the directory came from, for the error.
pub(crate) fn idx_lengths(cfg: &Config, data_dir: &str) -> anyhow::Result<(usize, Option<usize>)> {
    // a declared model's labels are the user's business: any byte is a label
    let classes = match cfg.model.declared {
        Some(_) => 256,
        None => cfg.model.dims[cfg.model.dims.len() - 1],
    };
    let (train_len, features) =
        ps_data::idx::split_shape(&cfg.data.dir, ps_data::idx::Split::Train, classes)
            .with_context(|| {
                format!("reading the training set's labels and header of {data_dir}")
            })?;
    if cfg.model.declared.is_some() {
        return Ok((train_len, None));
    }
    if features != cfg.model.dims[0] {
        anyhow::bail!(
            "{}: images have {features} pixels but [model] inputs = {}",
            cfg.data.dir.display(),
            cfg.model.dims[0]
        );
    }
    let (test_len, _) =
        ps_data::idx::split_shape(&cfg.data.dir, ps_data::idx::Split::Test, classes)
            .with_context(|| format!("reading the test set's labels and header of {data_dir}"))?;
    Ok((train_len, Some(test_len)))
}
