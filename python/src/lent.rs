//! The glue between `ps_net::dma` and a Python borrower of the shards' parameters boards
//! (`ps_torch._device.ParamBoards`): a [`Registrar`] calling its `register`, and the
//! registration whose drop calls its `release` before the mapping goes.

use ps_net::dma::{HostRegistration, Registrar};
use pyo3::prelude::*;
use std::sync::atomic::AtomicU64;

/// The registrar key of the next client (each registers the boards once for itself; far from
/// the small keys of the CUDA contexts of ps-worker).
pub(crate) static NEXT_KEY: AtomicU64 = AtomicU64::new(1 << 40);

/// The device of a Python borrower (`ps_torch._device.ParamBoards`: `register(address,
/// nbytes)`, which raises to refuse, and `release(address)`), registering board mappings for
/// its DMA.
pub(crate) struct PyRegistrar {
    pub(crate) key: u64,
    pub(crate) borrower: Py<PyAny>,
}

impl Registrar for PyRegistrar {
    fn key(&self) -> u64 {
        self.key
    }

    fn register(&self, ptr: *mut u8, bytes: usize) -> Result<Box<dyn HostRegistration>, String> {
        let address = ptr as usize;
        Python::attach(|py| {
            self.borrower
                .call_method1(py, "register", (address, bytes))
                .map_err(|e| e.to_string())?;
            Ok(Box::new(PyRegistration {
                address,
                borrower: self.borrower.clone_ref(py),
            }) as Box<dyn HostRegistration>)
        })
    }
}

/// A board mapping registered by a Python borrower: owned by the mapping, which drops it
/// before it unmaps; dropping it calls the borrower's `release(address)` (which waits for the
/// uploads from it and unregisters it) once, its error reported as unraisable.
struct PyRegistration {
    address: usize,
    borrower: Py<PyAny>,
}

impl HostRegistration for PyRegistration {}

impl Drop for PyRegistration {
    fn drop(&mut self) {
        Python::attach(|py| {
            if let Err(e) = self.borrower.call_method1(py, "release", (self.address,)) {
                e.write_unraisable(py, Some(self.borrower.bind(py)));
            }
        });
    }
}
