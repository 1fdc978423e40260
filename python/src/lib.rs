//! `ps_torch._native`: the Rust half of the PyTorch worker. A [`Client`] is one worker of a run: it
//! reads the run's TOML config, checks the model PyTorch holds against the run's (names and shapes
//! in `named_parameters()` order), registers with every shard through `ps_net::session` (shared
//! memory on one host, gRPC otherwise, token and TLS as the config says), hands out this rank's
//! sample indices of each step (the data-order contract), pushes a flat gradient and pulls a flat
//! weight vector, both as float32 buffers (numpy arrays) that it reads and writes in place with the
//! GIL released; for a model on a GPU it lends its push buffer instead (`lend_grad_buffer`: the
//! GPU copies into it, registered for DMA; `push_in_place`), calling the borrower's release before
//! the buffer is unmapped; and it lends the shards' parameters boards on this host the same way
//! (`register_param_boards`: registered once per mapping through the borrower, released before
//! the mapping goes; `pull_lent`: the slots of a version, read in place by the GPU's uploads;
//! `verify_pulled`: the version re-checked after them). With `[train] exact_sum` it sums the micro-batch gradient terms PyTorch
//! computes exactly (`ps_net::exact`) and pushes that partial sum, encoded. The Python package
//! (`ps_torch/__init__.py`) wraps it in `ps_torch.Worker`.
//!
//! Modules: `client` (the class), `lent` (the borrower glue of the lent boards), `errors` (the
//! exceptions and the session's errors as them), `buffers` (float32 buffers checked),
//! `functions` (`save_init`, `copied`).

mod buffers;
mod client;
mod errors;
mod functions;
mod lent;

use client::Client;
use errors::{ModelMismatchError, RolledBack};
use functions::{copied, save_init};
use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add_function(wrap_pyfunction!(save_init, m)?)?;
    m.add_function(wrap_pyfunction!(copied, m)?)?;
    m.add("RolledBack", m.py().get_type::<RolledBack>())?;
    m.add(
        "ModelMismatchError",
        m.py().get_type::<ModelMismatchError>(),
    )?;
    m.add("ORDER_KEY", ps_model::declared::ORDER_KEY)?;
    Ok(())
}
