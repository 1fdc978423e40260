//! The worker's board set registered for the device's DMA: the shards' parameters boards and
//! this worker's gradient board, registered once per set (again only for a board opened anew,
//! as after a shard restart), and all or none: a device that refuses one leaves none of the
//! set registered, and the run stays on the staging path.

use ps_net::shm::{Board, RegisterError, Registrar};
use std::sync::{Arc, Weak};

/// What [`DmaBoards::update`] did.
#[derive(Debug, PartialEq)]
pub(super) enum Registration {
    /// The set is the one registered before (or there is no device to register with, or it
    /// refused before): nothing looked up.
    Unchanged,
    /// The set changed: `new` boards registered now (those registered before were kept).
    Registered { new: usize },
    /// The device refused a board: the registrations of every board of the set were dropped
    /// (`dropped` of them, earlier ones of this attempt included); nothing is registered from
    /// now on.
    Refused {
        error: RegisterError,
        dropped: usize,
    },
}

/// The board set registered with the device, by identity.
#[derive(Debug, Default)]
pub(super) struct DmaBoards {
    /// Each shard's parameters board as registered last (`None`: the shard has none). A weak
    /// reference holds the allocation, so a board opened anew never has an old one's address.
    params: Vec<Option<Weak<Board>>>,
    /// The gradient board was registered (it lives as long as the run).
    grad: bool,
    /// Nothing to do for the rest of the run: the device registers no host memory (a CPU), or
    /// it refused a registration (the run is on the staging path).
    off: bool,
}

impl DmaBoards {
    /// Registers the set (`params`, a board or none per shard, and the gradient board) with
    /// the device of `registrar()` (asked only then) when it is not the set registered before.
    pub(super) fn update(
        &mut self,
        registrar: impl FnOnce() -> Option<Arc<dyn Registrar>>,
        params: &[Option<&Arc<Board>>],
        grad: Option<&Board>,
    ) -> Registration {
        if self.off || (self.grad == grad.is_some() && self.same_params(params)) {
            return Registration::Unchanged;
        }
        let Some(r) = registrar() else {
            self.off = true;
            return Registration::Unchanged;
        };
        let r = r.as_ref();
        let boards = || params.iter().flatten().map(|a| a.as_ref()).chain(grad);
        let mut new = 0;
        for b in boards() {
            match b.register(r) {
                Ok(fresh) => new += usize::from(fresh),
                Err(error) => {
                    let dropped = boards().filter(|b| b.unregister(r.key())).count();
                    *self = Self {
                        off: true,
                        ..Self::default()
                    };
                    return Registration::Refused { error, dropped };
                }
            }
        }
        self.params = params.iter().map(|p| p.map(Arc::downgrade)).collect();
        self.grad = grad.is_some();
        Registration::Registered { new }
    }

    fn same_params(&self, params: &[Option<&Arc<Board>>]) -> bool {
        self.params.len() == params.len()
            && self.params.iter().zip(params).all(|(a, b)| match (a, b) {
                (None, None) => true,
                (Some(a), Some(b)) => std::ptr::eq(a.as_ptr(), Arc::as_ptr(b)),
                _ => false,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_net::shm::{BoardDir, HostRegistration, grad_path, params_path};
    use std::sync::Mutex;

    /// A device that registers (and logs) until its `refuse_at`-th registration.
    struct Probe {
        log: Arc<Mutex<Vec<String>>>,
        refuse_at: Option<usize>,
    }

    struct ProbeReg {
        bytes: usize,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl HostRegistration for ProbeReg {}

    impl Drop for ProbeReg {
        fn drop(&mut self) {
            let line = format!("unregister {}", self.bytes);
            self.log.lock().unwrap().push(line);
        }
    }

    impl Registrar for Probe {
        fn key(&self) -> u64 {
            9
        }
        fn register(&self, _: *mut u8, bytes: usize) -> Result<Box<dyn HostRegistration>, String> {
            let mut log = self.log.lock().unwrap();
            let n = log.iter().filter(|l| l.starts_with("register")).count();
            if self.refuse_at == Some(n) {
                return Err("out of pinnable memory".into());
            }
            log.push(format!("register {bytes}"));
            Ok(Box::new(ProbeReg {
                bytes,
                log: self.log.clone(),
            }))
        }
    }

    /// Two shards' parameters boards of 3000 and 5000 values (opened as a worker opens them)
    /// and a gradient board of 8000; the boards' mappings are 4096 bytes of header and whole
    /// pages per slot.
    struct Set {
        root: std::path::PathBuf,
        dirs: Vec<BoardDir>,
        _shards: Vec<Board>,
        params: Vec<Arc<Board>>,
        grad: Board,
    }

    const SIZES: [usize; 3] = [4096 + 2 * 12288, 4096 + 2 * 20480, 4096 + 32768];

    impl Set {
        fn new(tag: &str) -> Self {
            let root = std::env::temp_dir().join(format!("ps-dmaset-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&root).unwrap();
            let (mut dirs, mut shards, mut params) = (Vec::new(), Vec::new(), Vec::new());
            for (s, len) in [3000, 5000].into_iter().enumerate() {
                let d = BoardDir::create(&root, &format!("shard{s}")).unwrap();
                let path = params_path(d.path());
                shards.push(Board::create(&path, d.token(), len, 2).unwrap());
                params.push(Arc::new(Board::open(&path, d.token(), len, 2).unwrap()));
                dirs.push(d);
            }
            let d = BoardDir::create(&root, "worker0").unwrap();
            let grad = Board::create(&grad_path(d.path()), d.token(), 8000, 1).unwrap();
            dirs.push(d);
            Self {
                root,
                dirs,
                _shards: shards,
                params,
                grad,
            }
        }

        fn update(&self, boards: &mut DmaBoards, r: &Arc<Probe>) -> Registration {
            let params: Vec<_> = self.params.iter().map(Some).collect();
            boards.update(|| Some(r.clone()), &params, Some(&self.grad))
        }

        fn registered(&self) -> Vec<bool> {
            let all = self.params.iter().map(|a| a.as_ref()).chain([&self.grad]);
            all.map(|b| b.registered_with(9)).collect()
        }
    }

    impl Drop for Set {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    #[test]
    fn a_set_is_registered_once_and_a_board_opened_anew_alone_again() {
        let mut set = Set::new("once");
        let log = Arc::new(Mutex::new(Vec::new()));
        let r = Arc::new(Probe {
            log: log.clone(),
            refuse_at: None,
        });
        let mut boards = DmaBoards::default();
        assert_eq!(
            set.update(&mut boards, &r),
            Registration::Registered { new: 3 }
        );
        assert_eq!(set.update(&mut boards, &r), Registration::Unchanged);
        assert_eq!(set.registered(), vec![true; 3]);
        // shard 1 restarted: its board opened anew (the old one dropped with its registration)
        let d = &set.dirs[1];
        let reopened = Board::open(&params_path(d.path()), d.token(), 5000, 2).unwrap();
        set.params[1] = Arc::new(reopened);
        assert_eq!(
            set.update(&mut boards, &r),
            Registration::Registered { new: 1 }
        );
        assert_eq!(set.update(&mut boards, &r), Registration::Unchanged);
        assert_eq!(set.registered(), vec![true; 3]);
        let s = SIZES.map(|b| b.to_string());
        let want = [
            format!("register {}", s[0]),
            format!("register {}", s[1]),
            format!("register {}", s[2]),
            format!("unregister {}", s[1]),
            format!("register {}", s[1]),
        ];
        assert_eq!(*log.lock().unwrap(), want);
        // the device is asked for its registrar only when the set changed
        let unasked = || -> Option<Arc<dyn Registrar>> { panic!("asked") };
        assert_eq!(
            set.update(&mut boards, &r),
            Registration::Unchanged,
            "again"
        );
        let params: Vec<_> = set.params.iter().map(Some).collect();
        assert_eq!(
            boards.update(unasked, &params, Some(&set.grad)),
            Registration::Unchanged
        );
        // a shard without a board: nothing registered for it
        let one = [None, Some(&set.params[1])];
        let r2 = r.clone();
        assert_eq!(
            boards.update(|| Some(r2), &one, Some(&set.grad)),
            Registration::Registered { new: 0 }
        );
        // no device: asked once, then never again
        let mut cpu = DmaBoards::default();
        assert_eq!(cpu.update(|| None, &params, None), Registration::Unchanged);
        let (changed, _) = set.params.split_at(1);
        let changed: Vec<_> = changed.iter().map(Some).collect();
        assert_eq!(cpu.update(unasked, &changed, None), Registration::Unchanged);
    }

    #[test]
    fn a_refusal_leaves_no_board_of_the_set_registered_and_is_final() {
        let set = Set::new("refused");
        let log = Arc::new(Mutex::new(Vec::new()));
        let refuse = Arc::new(Probe {
            log: log.clone(),
            refuse_at: Some(2),
        });
        let mut boards = DmaBoards::default();
        let Registration::Refused { error, dropped } = set.update(&mut boards, &refuse) else {
            panic!("the gradient board is refused");
        };
        assert_eq!(dropped, 2, "the shards' boards registered before it");
        assert!(
            error.to_string().contains("out of pinnable memory"),
            "{error}"
        );
        assert!(error.to_string().contains("worker0"), "{error}");
        assert_eq!(set.registered(), vec![false; 3]);
        let s = SIZES.map(|b| b.to_string());
        let want = [
            format!("register {}", s[0]),
            format!("register {}", s[1]),
            format!("unregister {}", s[0]),
            format!("unregister {}", s[1]),
        ];
        assert_eq!(*log.lock().unwrap(), want);
        // from then on nothing is tried, even by a device that would accept
        let accept = Arc::new(Probe {
            log: log.clone(),
            refuse_at: None,
        });
        assert_eq!(set.update(&mut boards, &accept), Registration::Unchanged);
        assert_eq!(set.registered(), vec![false; 3]);
        assert_eq!(log.lock().unwrap().len(), 4);
    }
}
