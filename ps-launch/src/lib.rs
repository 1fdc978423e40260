//! The launcher beside its binary. Where each concept lives:
//!
//! - [`launch`]: [`LocalCluster`], shards and workers as real processes on 127.0.0.1 (free
//!   ports, address files, logs, restarts of failed workers, stop on drop), and [`bin_dir`],
//!   where the `ps-server` / `ps-worker` binaries are found (next to the running executable).
//! - [`plot`]: `curves.svg`, the loss and accuracy curves drawn from a run's `metrics.jsonl`.
//! - `src/main.rs`: the `ps-launch` binary: runs a cluster from a config, merges the shards into
//!   `model.safetensors`, draws the curves, `--check-reference`, `--export`, `--resume`.
//!
//! Used by `ps-launch` and by the integration tests (`tests/`), which start real processes.

pub mod launch;
pub mod plot;

pub use launch::{LaunchError, LocalCluster, Proc, bin_dir};
