//! The launcher beside its binary. Where each concept lives:
//!
//! - [`launch`]: [`LocalCluster`], shards and workers as real processes on 127.0.0.1 (free
//!   ports, address files, logs, restarts of failed workers, stop on drop), and [`bin_dir`],
//!   where the `ps-server` / `ps-worker` binaries are found (next to the running executable).
//! - [`outdir`]: the run's output directory: claimed (refused while another run lives in it)
//!   before anything in it moves, an earlier run's outputs moved aside.
//! - [`plot`]: `curves.svg`, the loss and accuracy curves drawn from a run's `metrics.jsonl`.
//! - `src/main.rs`: the `ps-launch` binary: runs a cluster from a config, merges the shards into
//!   `model.safetensors`, draws the curves, `--check-reference`, `--export`, `--resume`.
//!
//! Used by `ps-launch` and by the integration tests (`tests/`), which start real processes.

pub mod launch;
pub mod outdir;
pub mod plot;

pub use launch::{Ended, LaunchError, LocalCluster, Proc, Stop, bin_dir};
