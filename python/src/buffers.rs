//! Python buffers as the client reads and writes them: float32 numpy arrays checked for
//! dtype, layout, writability and length before their address is used.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A float32 buffer (a C-contiguous numpy array) of exactly `len` values: its address.
pub(crate) fn f32_buffer(
    obj: &Bound<'_, PyAny>,
    len: usize,
    writable: bool,
    what: &str,
) -> PyResult<usize> {
    let buf = PyBuffer::<f32>::get(obj)
        .map_err(|e| PyValueError::new_err(format!("{what}: expected a float32 array: {e}")))?;
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what}: expected a C-contiguous array"
        )));
    }
    if writable && buf.readonly() {
        return Err(PyValueError::new_err(format!(
            "{what}: expected a writable array"
        )));
    }
    if buf.item_count() != len {
        return Err(PyValueError::new_err(format!(
            "{what}: holds {} values, expected {len} (the model's parameter count)",
            buf.item_count()
        )));
    }
    Ok(buf.buf_ptr() as usize)
}
