//! The worker side: compute backends (CPU with ndarray, CUDA with cudarc, one trait), the
//! pull/compute/push training loop against every shard, the launcher environment (flags,
//! torchrun, Slurm, Kubernetes), and the single-process reference run used to check that a
//! distributed run equals one process.
//!
//! The model: `ops` (the device operations trait), `model` (the MLP and the CNN written once
//! over it: `Model<D, N>` with `MlpNet`/`CnnNet`, `model::build` for a `ModelLayout`), `cpu`
//! and `cuda` (the two devices), `backend` (the trait the worker calls), `device` (choosing one
//! from `--device`), `error` (what a device or a backend returns on failure). `gate`: the
//! step's pulls and its forward pass sharing the weights, layer by layer (`ps_net::gate`; the
//! worker's shards and the Python worker's session are `ps_net::peer` and `ps_net::session`).
//! `exact`: a step's gradient as the exact sum of micro-batch terms (`[train] exact_sum`).
//! `evaluating`: the word to the shards while the final evaluation runs.
//! `watch`: the bound on a step's backward pass once its push failed or stalled (no hang).

pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod error;
pub mod evaluating;
/// A worker's placement from flags or its launcher's environment (`ps_process::env`).
pub use ps_process::env;
pub mod exact;
pub mod gate;
pub mod model;
pub mod ops;
pub mod reference;
pub mod watch;
pub mod worker;

/// Threads for the CPU backend's matrix products: the configured number, or the cores this
/// process may use divided among the workers and shards of a local cluster (at least 1).
pub fn cpu_threads(configured: usize, processes_on_host: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / processes_on_host.max(1)).max(1)
}
