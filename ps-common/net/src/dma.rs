//! Plane memory a device reads and writes by DMA, with an owner and a lifetime: the device's
//! side ([`Registrar`], which registers host memory, and the [`HostRegistration`] it returns,
//! which unregisters it when dropped) and a slot of a board read in place ([`InPlace`]). The
//! owner of the memory holds the registrations and drops them before the memory goes (a
//! shared-memory board's mapping does: `crate::shm::registration`); this module depends on no
//! transport, so the sinks of every plane (`crate::sink`) can name it.

use std::ops::Range;
use std::sync::Arc;

/// A device's registration of host memory for DMA; dropping it unregisters the memory (a GPU
/// waits for its copies first). Owned by the memory's owner (a board's mapping:
/// `crate::shm::Board::register`), which drops it before the memory is unmapped.
pub trait HostRegistration: Send + Sync {}

/// A device that registers host memory for its DMA.
pub trait Registrar: Send + Sync {
    /// Who registers: one registration per key and memory (a GPU's context).
    fn key(&self) -> u64;
    /// Registers the `bytes` bytes at `ptr` (page-aligned, mapped, readable and writable) for
    /// this device's DMA. The caller keeps them mapped until the returned registration is
    /// dropped.
    fn register(&self, ptr: *mut u8, bytes: usize) -> Result<Box<dyn HostRegistration>, String>;
}

/// The memory behind an [`InPlace`] slot (implemented by the board that holds it).
pub trait SlotMemory: Send + Sync + std::fmt::Debug {
    /// The slot's first value; valid while `self` lives.
    fn base(&self) -> *const f32;
    /// Values of the slot.
    fn len(&self) -> usize;
    /// True when the slot holds no values.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The version it was taken at.
    fn version(&self) -> u64;
    /// True when the device of registrar key `key` registered the memory.
    fn registered_with(&self, key: u64) -> bool;
    /// True while the slot still holds the version, complete.
    fn intact(&self) -> bool;
}

/// One version of a board's slot, read where it lies by a device's DMA: it holds the memory
/// (and so its registrations) while it lives. The writer may overwrite the slot at any time
/// (it then publishes another version there): whatever was read from it counts only if
/// [`InPlace::intact`] says so after the reads completed.
#[derive(Debug, Clone)]
pub struct InPlace(Arc<dyn SlotMemory>);

impl InPlace {
    /// A slot of `memory`.
    pub fn new(memory: Arc<dyn SlotMemory>) -> Self {
        Self(memory)
    }
    /// Values of the slot.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// True when the slot holds no values.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// The version read.
    pub fn version(&self) -> u64 {
        self.0.version()
    }
    /// True when the device of registrar key `key` registered the memory.
    pub fn registered_with(&self, key: u64) -> bool {
        self.0.registered_with(key)
    }
    /// True while the slot still holds the version, complete: asked after the device's copies
    /// out of it completed, it says they read that version alone.
    pub fn intact(&self) -> bool {
        self.0.intact()
    }
    /// Values `r` of the slot, for a device's DMA to read.
    ///
    /// # Safety
    /// The writer may write them meanwhile: they may be handed to a device copy that reads them
    /// as bytes (a DMA), whose result is used only if [`InPlace::intact`] holds after it
    /// completed; Rust code must not read them through the slice while a writer may write.
    pub unsafe fn values(&self, r: Range<usize>) -> &[f32] {
        assert!(
            r.start <= r.end && r.end <= self.len(),
            "{r:?} past the slot"
        );
        // SAFETY: inside the slot, which `self` keeps allocated; 4-byte aligned; reads are
        // the caller's contract above.
        unsafe { std::slice::from_raw_parts(self.0.base().add(r.start), r.len()) }
    }
}
