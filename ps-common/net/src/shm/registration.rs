//! Board memory with an owner and a lifetime, for a device's DMA (`crate::dma`): a device
//! ([`Registrar`]) registers a board's whole mapping (`cuMemHostRegister` on a GPU) through
//! [`Board::register`], and the [`crate::dma::HostRegistration`] it returns is owned by the mapping from
//! then on. Dropping the registration unregisters the memory; the mapping's `Drop` drops its
//! registrations before it unmaps, and nothing else can unmap it, so a registration never
//! outlives its memory: a type rule, not a convention. A registration holds what it needs to
//! unregister (a GPU's context), so it may also outlive the device that made it.
//!
//! [`InPlace`] (here a `MappedSlot`) is one slot of a parameters board read where it lies (by
//! a registered device's DMA) under the board's seqlock: it holds the mapping (so the memory and its registrations
//! stay while it lives), and [`InPlace::intact`] says, after the device's copies completed,
//! whether the slot still held the version throughout (a torn version is refused).

use super::{Board, Mapping, seq_offset};
use crate::dma::{InPlace, Registrar, SlotMemory};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

/// Why a board could not be registered.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("cannot register the board {path} ({bytes} bytes) for DMA: {why}")]
pub struct RegisterError {
    /// The board's file.
    pub path: String,
    /// Bytes of its mapping.
    pub bytes: usize,
    /// The device's reason.
    pub why: String,
}

impl Board {
    /// Registers this board's whole mapping with `registrar`'s device, once per registrar key
    /// (true when this call registered it, false when it was registered already). The board
    /// owns the registration: it is unregistered when the mapping goes, before the unmap.
    pub fn register(&self, registrar: &dyn Registrar) -> Result<bool, RegisterError> {
        let key = registrar.key();
        let mut regs = self
            .map
            .registrations
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if regs.iter().any(|(k, _)| *k == key) {
            return Ok(false);
        }
        let r = registrar
            .register(self.map.ptr.as_ptr(), self.map.len)
            .map_err(|why| RegisterError {
                path: self.path.display().to_string(),
                bytes: self.map.len,
                why,
            })?;
        regs.push((key, r));
        Ok(true)
    }

    /// Drops this board's registration with the device of registrar key `key`, if it has
    /// one (the device unregisters the memory, a GPU after its copies): true when it had one.
    /// The mapping stays; a later [`Board::register`] registers it again.
    pub fn unregister(&self, key: u64) -> bool {
        let dropped = {
            let mut regs = self
                .map
                .registrations
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let i = regs.iter().position(|(k, _)| *k == key);
            i.map(|i| regs.swap_remove(i))
        };
        // dropped outside the lock: a device's unregistration may wait for its copies
        dropped.is_some()
    }

    /// True when the device of registrar key `key` registered this board.
    pub fn registered_with(&self, key: u64) -> bool {
        self.map.registered_with(key)
    }

    /// Slot `version % 2` read in place, if it holds version `version`, complete, now.
    pub fn in_place(&self, version: u64) -> Option<InPlace> {
        let k = (version % 2) as usize;
        let want = 2 * version + 2;
        if self.map.atomic(seq_offset(k)).load(Ordering::Acquire) != want || self.faulted() {
            return None;
        }
        Some(InPlace::new(Arc::new(MappedSlot {
            map: self.map.clone(),
            offset: self.slot_ptr(k) as usize - self.map.ptr.as_ptr() as usize,
            len: self.len,
            seq: seq_offset(k),
            want,
            version,
        })))
    }
}

impl Mapping {
    fn registered_with(&self, key: u64) -> bool {
        self.registrations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(k, _)| *k == key)
    }
}

/// A slot of a board's mapping, held by an [`InPlace`] (with the mapping, so the memory and its
/// registrations stay while it lives).
#[derive(Debug)]
struct MappedSlot {
    map: Arc<Mapping>,
    /// Byte offset of the slot in the mapping.
    offset: usize,
    len: usize,
    /// Byte offset of the slot's sequence number.
    seq: usize,
    /// The sequence number of the version, complete.
    want: u64,
    version: u64,
}

impl SlotMemory for MappedSlot {
    fn base(&self) -> *const f32 {
        // SAFETY: the slot lies inside the mapping, which `self` holds
        unsafe { self.map.ptr.as_ptr().add(self.offset).cast::<f32>() }
    }
    fn len(&self) -> usize {
        self.len
    }
    fn version(&self) -> u64 {
        self.version
    }
    fn registered_with(&self, key: u64) -> bool {
        self.map.registered_with(key)
    }
    fn intact(&self) -> bool {
        // after the device's copies: the sequence the shard marks "being written" before it
        // writes the slot, and the file not truncated
        fence(Ordering::Acquire);
        self.map.atomic(self.seq).load(Ordering::Acquire) == self.want && !self.map.faulted()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::HostRegistration;
    use crate::shm::{BoardDir, params_path};
    use std::sync::Mutex;

    /// Registrations that record, when dropped, whether their memory was still mapped.
    struct Probe {
        log: Arc<Mutex<Vec<String>>>,
        fail: bool,
    }

    struct ProbeReg {
        ptr: usize,
        bytes: usize,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl HostRegistration for ProbeReg {}

    impl Drop for ProbeReg {
        fn drop(&mut self) {
            // msync fails with ENOMEM on a range that is not mapped
            // SAFETY: a plain system call on an address range; it touches no memory
            let rc = unsafe { libc::msync(self.ptr as *mut _, self.bytes, libc::MS_ASYNC) };
            self.log.lock().unwrap().push(format!(
                "unregister {} bytes, mapped: {}",
                self.bytes,
                rc == 0
            ));
        }
    }

    impl Registrar for Probe {
        fn key(&self) -> u64 {
            7
        }
        fn register(
            &self,
            ptr: *mut u8,
            bytes: usize,
        ) -> Result<Box<dyn HostRegistration>, String> {
            if self.fail {
                return Err("out of pinnable memory".into());
            }
            self.log
                .lock()
                .unwrap()
                .push(format!("register {bytes} bytes"));
            Ok(Box::new(ProbeReg {
                ptr: ptr as usize,
                bytes,
                log: self.log.clone(),
            }))
        }
    }

    #[test]
    fn a_registration_is_dropped_before_its_mapping_and_outlives_no_view() {
        let root = std::env::temp_dir().join(format!("ps-shm-reg-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let dir = BoardDir::create(&root, "shard0").unwrap();
        let path = params_path(dir.path());
        let mut w = Board::create(&path, dir.token(), 3000, 2).unwrap();
        let r = Board::open(&path, dir.token(), 3000, 2).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let probe = Probe {
            log: log.clone(),
            fail: false,
        };
        assert!(!r.registered_with(7));
        assert_eq!(r.register(&probe), Ok(true));
        assert_eq!(r.register(&probe), Ok(false), "once per key");
        assert!(r.registered_with(7));
        let v: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        w.publish(5, &v);
        assert!(r.in_place(4).is_none(), "version 4 is not on the board");
        let view = r.in_place(5).unwrap();
        assert!(view.registered_with(7) && view.intact());
        // SAFETY: nothing writes the board while the test reads it
        assert_eq!(unsafe { view.values(10..13) }, &[10.0, 11.0, 12.0]);
        // the shard begins writing version 7 into the same slot: the view is torn
        w.begin_version(7)[0] = -1.0;
        assert!(!view.intact(), "a version being written is not intact");
        w.end_version(7);
        assert!(!view.intact(), "another version is not this one");
        // unregistered on demand, the mapping kept: registered again, once
        assert!(r.unregister(7) && !r.registered_with(7));
        assert!(!r.unregister(7), "nothing left to unregister");
        // SAFETY: nothing writes the board meanwhile
        assert_eq!(unsafe { view.values(0..1) }, &[-1.0], "still mapped");
        assert_eq!(r.register(&probe), Ok(true));
        drop(r);
        // the view holds the mapping: nothing unregistered, still readable
        assert_eq!(log.lock().unwrap().len(), 3, "{:?}", log.lock().unwrap());
        // SAFETY: as above
        assert_eq!(unsafe { view.values(0..1) }, &[-1.0]);
        drop(view);
        let bytes = 4096 + 2 * 12288;
        assert_eq!(
            *log.lock().unwrap(),
            vec![
                format!("register {bytes} bytes"),
                format!("unregister {bytes} bytes, mapped: true"),
                format!("register {bytes} bytes"),
                format!("unregister {bytes} bytes, mapped: true")
            ]
        );
        // a refused registration says why and leaves the board unregistered
        let r = Board::open(&path, dir.token(), 3000, 2).unwrap();
        let e = r
            .register(&Probe {
                log: log.clone(),
                fail: true,
            })
            .unwrap_err();
        assert!(e.to_string().contains("out of pinnable memory"), "{e}");
        assert!(!r.registered_with(7));
        drop((r, w, dir));
        let _ = std::fs::remove_dir_all(&root);
    }
}
