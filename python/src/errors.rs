//! The module's exceptions (`RolledBack`, `ModelMismatchError`) and the conversion of the
//! session's errors into them (a lost shard's error waits for the recovery first).

use ps_net::session::Session;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    ModelMismatchError,
    PyValueError,
    "The worker's model differs from the run's (names, shapes or order of the parameters)."
);

pyo3::create_exception!(
    _native,
    RolledBack,
    PyRuntimeError,
    "A shard was lost and the cluster rolled back: args (step to redo from, what failed)."
);

/// The error of a push or pull of step `step`; when it is a lost shard's, this waits for the
/// cluster to recover first and is then [`RolledBack`] with the step to redo from. Called
/// without the GIL (it may wait up to `[worker] connect_timeout_secs`).
pub(crate) fn after_failure(
    rt: &tokio::runtime::Runtime,
    session: &mut Session,
    step: u64,
    e: anyhow::Error,
) -> PyErr {
    match rt.block_on(session.recover(step, &e)) {
        Ok(Some(start)) => RolledBack::new_err((start, format!("{e:#}"))),
        Ok(None) => runtime_err(e),
        Err(e) => runtime_err(e),
    }
}

pub(crate) fn runtime_err(e: anyhow::Error) -> PyErr {
    let text = format!("{e:#}");
    if text.contains("model mismatch") {
        ModelMismatchError::new_err(text)
    } else {
        PyRuntimeError::new_err(text)
    }
}
