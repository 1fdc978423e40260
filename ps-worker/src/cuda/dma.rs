//! Host memory registered for the GPU's DMA (`cuMemHostRegister`): the shared-memory boards
//! of the shards and of this worker, so that the weights are uploaded straight from the
//! shard's parameters board and each gradient piece is downloaded straight into the gradient
//! board, with no pinned staging and no host copy (as BytePS does with its registered shared
//! memory). [`CudaRegistrar`] is the device's [`Registrar`]; each [`CudaRegistration`] is owned
//! by the board's mapping (`ps_net::shm::registration`), which drops it, waiting for the
//! context's copies and unregistering, before it unmaps the memory. A registration holds the
//! context, so it may outlive the device.

use cudarc::driver::CudaContext;
use cudarc::driver::sys;
use ps_net::shm::{HostRegistration, Registrar};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// The host ranges (byte addresses) registered with one context, shared by the device (which
/// asks whether a download's destination is registered) and the registrations.
pub(super) type Ranges = Arc<Mutex<Vec<Range<usize>>>>;

/// Registers host memory with one CUDA context.
pub(super) struct CudaRegistrar {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ranges: Ranges,
}

/// One registered range: unregistered (after the context's copies finished) when dropped.
struct CudaRegistration {
    ctx: Arc<CudaContext>,
    ptr: usize,
    bytes: usize,
    ranges: Ranges,
}

impl HostRegistration for CudaRegistration {}

impl Registrar for CudaRegistrar {
    fn key(&self) -> u64 {
        Arc::as_ptr(&self.ctx) as u64
    }

    fn register(&self, ptr: *mut u8, bytes: usize) -> Result<Box<dyn HostRegistration>, String> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))?;
        // SAFETY: `ptr..+bytes` is mapped, page-aligned memory that the caller keeps mapped
        // until the registration returned is dropped (`Board::register`'s contract); the
        // driver only records it.
        let rc = unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), bytes, sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostRegister: {rc:?}"));
        }
        let start = ptr as usize;
        lock(&self.ranges).push(start..start + bytes);
        Ok(Box::new(CudaRegistration {
            ctx: self.ctx.clone(),
            ptr: start,
            bytes,
            ranges: self.ranges.clone(),
        }))
    }
}

impl Drop for CudaRegistration {
    fn drop(&mut self) {
        lock(&self.ranges).retain(|r| r.start != self.ptr);
        // no copy queued on the context may still read or write the memory; errors here have
        // nowhere to go but the log
        let done = self
            .ctx
            .bind_to_thread()
            .and_then(|()| self.ctx.synchronize());
        // SAFETY: unregisters exactly the range `register` registered, still mapped (the
        // mapping drops its registrations before it unmaps).
        let rc = unsafe { sys::cuMemHostUnregister(self.ptr as *mut _) };
        if done.is_err() || rc != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(
                "unregistering {} bytes of host memory from the GPU: {done:?}, {rc:?}",
                self.bytes
            );
        }
    }
}

fn lock(r: &Ranges) -> std::sync::MutexGuard<'_, Vec<Range<usize>>> {
    r.lock().unwrap_or_else(|e| e.into_inner())
}

/// True when the `bytes` bytes at `ptr` lie inside one registered range of `ranges`.
pub(super) fn covers(ranges: &Ranges, ptr: usize, bytes: usize) -> bool {
    lock(ranges)
        .iter()
        .any(|r| r.start <= ptr && ptr + bytes <= r.end)
}
