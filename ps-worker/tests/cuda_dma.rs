//! The CUDA worker over registered shared-memory boards (issue 40 item 3): the weights are
//! uploaded straight from the shard's parameters board and the gradient downloaded straight
//! into the worker's gradient board, with no host copy (`ps_net::copied`) and no copy through
//! pageable memory (the harness's counters); a version the shard overwrites while the upload
//! is queued is refused before any gradient is handed on, and the step again with copied
//! weights equals the reference bit for bit.
//!
//! They need a CUDA device, so each is `#[ignore]`d; `scripts/cuda-harness.sh test` runs them
//! on the harness (which defers every copy to its stream's synchronisation, so the torn
//! version is written between the queueing and the DMA); on a GPU machine
//! `cargo test --release -p ps-worker --test cuda_dma -- --ignored --test-threads=1` (there the
//! slot is torn before the step, after the pull handed it over: the same refusal).

use ps_config::LossReduction;
use ps_model::layout::MlpLayout;
use ps_net::copied;
use ps_net::gate::{GateError, PullGate};
use ps_net::shm::{Board, BoardDir, grad_path, params_path};
use ps_net::sink::PullSink;
use ps_worker::backend::{Backend, BackendError};
use ps_worker::cuda::CudaBackend;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

const VERSION: u64 = 3;

/// The harness's function `name` (harness.cpp), when this process's driver is the harness.
fn harness_fn(name: &std::ffi::CStr) -> Option<*mut libc::c_void> {
    // SAFETY: dlopen of the driver library the backend has loaded already (the same
    // instance) and dlsym of one of its functions
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW);
        let f = (!h.is_null()).then(|| libc::dlsym(h, name.as_ptr()))?;
        (!f.is_null()).then_some(f)
    }
}

/// Bytes the harness copied from (`d2h` false) or to pageable host memory so far.
fn pageable(d2h: bool) -> Option<i64> {
    let f = harness_fn(c"cuda_harness_pageable_bytes")?;
    // SAFETY: `long long cuda_harness_pageable_bytes(int)`
    let f: extern "C" fn(i32) -> i64 = unsafe { std::mem::transmute(f) };
    Some(f(d2h as i32))
}

/// Two shards' parameters boards (the shard's end, written here, and the worker's, registered)
/// and the worker's gradient board.
struct Boards {
    root: PathBuf,
    _dirs: Vec<BoardDir>,
    shard: Vec<Board>,
    worker: Vec<Arc<Board>>,
    grad: Board,
    ranges: Vec<Range<usize>>,
}

impl Boards {
    fn new(tag: &str, p: usize) -> Self {
        let root = std::env::temp_dir().join(format!("ps-dma-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let ranges = vec![0..p / 3, p / 3..p];
        let (mut dirs, mut shard, mut worker) = (Vec::new(), Vec::new(), Vec::new());
        for (s, r) in ranges.iter().enumerate() {
            let d = BoardDir::create(&root, &format!("shard{s}")).unwrap();
            let path = params_path(d.path());
            shard.push(Board::create(&path, d.token(), r.len(), 2).unwrap());
            worker.push(Arc::new(Board::open(&path, d.token(), r.len(), 2).unwrap()));
            dirs.push(d);
        }
        let d = BoardDir::create(&root, "worker0").unwrap();
        let grad = Board::create(&grad_path(d.path()), d.token(), p, 1).unwrap();
        dirs.push(d);
        Self {
            root,
            _dirs: dirs,
            shard,
            worker,
            grad,
            ranges,
        }
    }

    fn publish(&mut self, version: u64, w: &[f32]) {
        for (b, r) in self.shard.iter_mut().zip(&self.ranges) {
            b.publish(version, &w[r.clone()]);
        }
    }
}

impl Drop for Boards {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn gpu(layout: &MlpLayout) -> CudaBackend {
    CudaBackend::new(0, layout.clone())
        .unwrap_or_else(|e| panic!("these tests need a CUDA device (or the harness): {e}"))
}

/// A batch and weights of `layout` (13 inputs, 3 classes).
fn inputs(layout: &MlpLayout) -> (Vec<f32>, Vec<u8>, Vec<f32>) {
    let p = layout.num_params();
    let x: Vec<f32> = (0..9 * 13)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0)
        .collect();
    let y: Vec<u8> = (0..9).map(|i| (i % 3) as u8).collect();
    (x, y, layout.init_range(5, 0..p))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The gradient of `w` on the same device through the copy path (set_weights, pageable
/// memory): the reference the in-place step must equal bit for bit.
fn reference(m: &mut CudaBackend, x: &[f32], y: &[u8], w: &[f32]) -> Vec<f32> {
    let mut g = vec![0.0; w.len()];
    m.set_weights(w).unwrap();
    m.forward_backward(x, y, LossReduction::Mean, &mut g)
        .unwrap();
    g
}

/// Opens the model's gate for `VERSION` and has each shard's pull hand over its registered
/// slot in place, as the client's board pull does (`PullSink::in_place`); true per shard that
/// took it.
fn pull_in_place(m: &mut CudaBackend, b: &Boards) -> (Arc<PullGate>, Vec<bool>) {
    let gate = m
        .open_gate(VERSION, b.ranges.clone(), Duration::from_secs(30))
        .expect("a CUDA model gates its pull over staging memory");
    let took = (0..b.ranges.len())
        .map(|s| {
            let mut wr = gate.writer(s);
            let slot = b.worker[s]
                .in_place(VERSION)
                .expect("the version is on the board");
            let took = wr.in_place(&slot);
            if !took {
                assert!(b.worker[s].read_version_into(VERSION, &mut wr));
            }
            wr.finish();
            took
        })
        .collect();
    (gate, took)
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine, or under scripts/cuda-harness.sh"]
fn registered_boards_pull_and_push_with_zero_host_bytes() {
    let layout = MlpLayout::new(&[13, 11, 9, 3]);
    let p = layout.num_params();
    let (x, y, w) = inputs(&layout);
    let mut m = gpu(&layout);
    let want = reference(&mut m, &x, &y, &w);
    let mut b = Boards::new("zero", p);
    b.publish(VERSION, &w);
    let r = m
        .registrar()
        .expect("the CUDA device registers host memory");
    for board in b.worker.iter().map(|a| a.as_ref()).chain([&b.grad]) {
        assert_eq!(
            board.register(r.as_ref()),
            Ok(true),
            "{}",
            board.path().display()
        );
    }

    // registered: nothing copied on the host, nothing through pageable memory but the batch
    let (c0, h0, d0) = (copied::totals(), pageable(false), pageable(true));
    let (gate, took) = pull_in_place(&mut m, &b);
    assert_eq!(took, vec![true, true], "both shards handed over in place");
    let mut handed = Vec::new();
    m.forward_backward_overlapped(
        &x,
        &y,
        LossReduction::Mean,
        b.grad.slot_mut(0),
        &mut |start, _, _| handed.push(start),
    )
    .unwrap();
    m.close_gate();
    drop(gate);
    let c1 = copied::totals();
    assert_eq!(
        (c1.0 - c0.0, c1.1 - c0.1),
        (0, 0),
        "host bytes copied (pull, push) over registered boards"
    );
    if let (Some(h0), Some(d0)) = (h0, d0) {
        let (h, d) = (pageable(false).unwrap() - h0, pageable(true).unwrap() - d0);
        eprintln!("through pageable memory: {h} bytes up, {d} down");
        assert_eq!(
            h as usize,
            4 * x.len() + y.len(),
            "only the batch goes up from pageable memory"
        );
        assert_eq!(d, 0, "nothing comes down through pageable memory");
    }
    assert_eq!(handed.len(), layout.num_layers());
    assert_eq!(
        bits(b.grad.slot_mut(0)),
        bits(&want),
        "the in-place step's gradient"
    );

    // the fallback (in place off): the pull copies the slots into staging and the gradient is
    // copied out of pinned memory into a heap vector: counted byte for byte
    m.set_in_place(false);
    let c0 = copied::totals();
    let (gate, took) = pull_in_place(&mut m, &b);
    assert_eq!(took, vec![false, false]);
    let mut got = vec![0.0; p];
    m.forward_backward(&x, &y, LossReduction::Mean, &mut got)
        .unwrap();
    m.close_gate();
    drop(gate);
    let c1 = copied::totals();
    assert_eq!((c1.0 - c0.0, c1.1 - c0.1), (4 * p as u64, 4 * p as u64));
    assert_eq!(bits(&got), bits(&want), "the copied step's gradient");
}

/// What the torn test's hook writes: version `VERSION + 2` into `VERSION`'s slot.
extern "C" fn tear(board: *mut libc::c_void) {
    // SAFETY: the test hands the shard's board, alive and not otherwise in use meanwhile
    let b = unsafe { &mut *board.cast::<Board>() };
    b.begin_version(VERSION + 2).fill(1000.0);
    b.end_version(VERSION + 2);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine, or under scripts/cuda-harness.sh"]
fn a_version_torn_under_the_upload_is_refused_and_the_step_again_is_exact() {
    let layout = MlpLayout::new(&[13, 11, 9, 3]);
    let p = layout.num_params();
    let (x, y, w) = inputs(&layout);
    let mut m = gpu(&layout);
    let want = reference(&mut m, &x, &y, &w);
    let mut b = Boards::new("torn", p);
    b.publish(VERSION, &w);
    let r = m.registrar().unwrap();
    for board in b.worker.iter().map(|a| a.as_ref()).chain([&b.grad]) {
        board.register(r.as_ref()).unwrap();
    }
    let (gate, took) = pull_in_place(&mut m, &b);
    assert_eq!(took, vec![true, true]);
    let hook = harness_fn(c"cuda_harness_before_registered_read");
    let shard0: *mut Board = &mut b.shard[0];
    match hook {
        // the harness runs the hook right before the first queued upload from the board
        // runs: the shard writes the next version into the slot under the queued copy
        Some(f) => {
            // SAFETY: `void cuda_harness_before_registered_read(void (*)(void *), void *)`
            let f: extern "C" fn(extern "C" fn(*mut libc::c_void), *mut libc::c_void) =
                unsafe { std::mem::transmute(f) };
            f(tear, shard0.cast());
        }
        // a GPU: the slot is torn after the pull handed it over, before the upload
        None => tear(shard0.cast()),
    }
    let mut handed = 0;
    let e = m
        .forward_backward_overlapped(
            &x,
            &y,
            LossReduction::Mean,
            b.grad.slot_mut(0),
            &mut |_, _, _| handed += 1,
        )
        .unwrap_err();
    m.close_gate();
    drop(gate);
    assert!(
        matches!(
            e,
            BackendError::Gate(GateError::Torn {
                shard: 0,
                version: VERSION
            })
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("overwrote its board slot of version 3"),
        "{e}"
    );
    assert_eq!(
        handed, 0,
        "a gradient computed from torn weights was handed on"
    );
    assert!(
        b.worker[0].in_place(VERSION).is_none(),
        "version {VERSION} left the board"
    );

    // the step again, its pull copying (the worker's redo: the version comes through gRPC,
    // here delivered from the reference weights): exact, into the registered gradient board
    m.set_in_place(false);
    let gate = m
        .open_gate(VERSION, b.ranges.clone(), Duration::from_secs(30))
        .unwrap();
    for s in 0..b.ranges.len() {
        gate.deliver(s, &w, 1000, Duration::ZERO);
    }
    m.forward_backward(&x, &y, LossReduction::Mean, b.grad.slot_mut(0))
        .unwrap();
    m.close_gate();
    drop(gate);
    assert_eq!(bits(b.grad.slot_mut(0)), bits(&want));
}

/// Unregistration before unmap, checked by the harness: a child process registers an
/// anonymous mapping, is refused a second registration of it with the driver's code, is
/// refused the unregistration of memory never registered with the driver's code, then unmaps
/// the range before it unregisters it: the harness names the fault and the process exits with
/// 86. (On a GPU the driver does not check this: the test says so and checks nothing.)
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine, or under scripts/cuda-harness.sh"]
fn the_harness_fails_a_process_that_unmaps_registered_memory_first() {
    const NAME: &str = "the_harness_fails_a_process_that_unmaps_registered_memory_first";
    let m = gpu(&MlpLayout::new(&[2, 2]));
    let r = m.registrar().unwrap();
    if std::env::var_os("PS_DMA_UNMAP_CHILD").is_some() {
        let len = 2 * 4096;
        // SAFETY: a fresh anonymous mapping, checked
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let reg = r.register(p.cast(), len).unwrap();
        let again = r
            .register(p.cast(), len)
            .err()
            .expect("a second registration");
        assert!(again.contains("HOST_MEMORY_ALREADY_REGISTERED"), "{again}");
        let heap = [0u8; 64];
        // SAFETY: the driver only looks the pointer up
        let rc = unsafe { cudarc::driver::sys::cuMemHostUnregister(heap.as_ptr() as *mut _) };
        assert_eq!(
            rc,
            cudarc::driver::sys::CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        );
        // SAFETY: unmaps the mapping made above, which nothing reads any more
        assert_eq!(unsafe { libc::munmap(p, len) }, 0);
        drop(reg); // after the unmap: the fault the harness reports
        return;
    }
    if harness_fn(c"cuda_harness_registered_bytes").is_none() {
        eprintln!("a GPU, not the harness: the unmap-before-unregister check is the harness's");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", NAME, "--test-threads=1"])
        .env("PS_DMA_UNMAP_CHILD", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(86), "{err}");
    assert!(
        err.contains("CUDA-HARNESS-ERROR: cuMemHostUnregister of 0x")
            && err.contains("its memory was unmapped first"),
        "{err}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the child's own checks (the driver's codes) passed"
    );
}
