# Migrates Rust code from the flat `Config` fields to the per-section structs
# (see CONFIG_MIGRATION.md). Usage: sed -E -i -f scripts/config-migrate.sed FILE.rs ...
# (GNU sed, extended regular expressions). Idempotent: a migrated path is not matched again.
#
# A field is rewritten only after a receiver that names a Config: an identifier ending in
# `cfg` (cfg, cfg2, setup.cfg, self.cfg, shard_cfg, ...), ending in `config` (config,
# self.config, ...; not `cli.config`, which is a path, because no field below follows it),
# or one of the Config variables of tests/tests/deploy.rs (local, slurm, got, want).
# Anything else the compiler flags (no field `workers` on type `Config`): fix it by hand
# with the table in CONFIG_MIGRATION.md.

# [cluster]
s/\b([A-Za-z0-9_]*cfg[0-9]*|[A-Za-z0-9_]*config|local|slurm|got|want)\.(servers|workers|transport|token|tls)\b/\1.cluster.\2/g
# [model]
s/\b([A-Za-z0-9_]*cfg[0-9]*|[A-Za-z0-9_]*config|local|slurm|got|want)\.dims\b/\1.model.dims/g
# [data]
s/\b([A-Za-z0-9_]*cfg[0-9]*|[A-Za-z0-9_]*config|local|slurm|got|want)\.data_dir\b/\1.data.dir/g
# [train]
s/\b([A-Za-z0-9_]*cfg[0-9]*|[A-Za-z0-9_]*config|local|slurm|got|want)\.(seed|global_batch|batch_from_per_worker|steps|epochs|keep_last|loss_reduction|aggregation|log_every|eval_every)\b/\1.train.\2/g

# Known false positive: ps-server/src/report.rs names its `ReporterConfig` `cfg` (fields
# log_every, total_steps, ...); its two uses sit on lines with `f.step`. Undo them there.
/f\.step/ s/\bcfg\.train\.log_every\b/cfg.log_every/g
