//! The module's functions: `save_init` (a declared model's init file) and `copied` (the host
//! bytes the data path copied).

use crate::buffers::f32_buffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::path::Path;

/// Writes a declared model's init file: `names` and `shapes` in flat order over the flat
/// float32 `values`, with the order in the metadata (`parameter_order`).
#[pyfunction]
pub(crate) fn save_init(
    path: &str,
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    values: &Bound<'_, PyAny>,
) -> PyResult<()> {
    if names.len() != shapes.len() {
        return Err(PyValueError::new_err("names and shapes differ in length"));
    }
    let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let addr = f32_buffer(values, total, false, "values")?;
    // SAFETY: a float32 buffer of `total` values, alive for this call (the GIL is held).
    let flat = unsafe { std::slice::from_raw_parts(addr as *const f32, total) };
    let mut tensors = Vec::with_capacity(names.len());
    let mut off = 0;
    for (n, s) in names.iter().zip(&shapes) {
        let k: usize = s.iter().product();
        tensors.push((n.as_str(), s.as_slice(), &flat[off..off + k]));
        off += k;
    }
    let order = serde_json::to_string(&names).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let meta = [(ps_model::declared::ORDER_KEY.to_string(), order)].into();
    ps_model::weights::write_safetensors(Path::new(path), &tensors, &meta)
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// The host bytes this process's data path copied so far: (pull, push) (`ps_net::copied`).
#[pyfunction]
pub(crate) fn copied() -> (u64, u64) {
    ps_net::copied::totals()
}
