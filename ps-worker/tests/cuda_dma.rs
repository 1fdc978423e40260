//! The CUDA worker over registered shared-memory boards (issue 40 item 3): the weights are
//! uploaded straight from the shard's parameters board and the gradient downloaded straight
//! into the worker's gradient board, with no host copy (`ps_net::copied`) and no copy through
//! pageable memory (the harness's counters); a version the shard overwrites while the upload
//! is queued is refused before any gradient is handed on, and the step again with copied
//! weights equals the reference bit for bit (at the model level, and at the worker level: the
//! worker does the step again and ends with the untorn run's weights); with every registration
//! refused, CUDA worker processes train on the staging path, say so once and copy exactly the
//! staging figures.
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

/// Panics with `what` and the first difference unless `a` and `b` hold the same bits.
fn assert_same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: first difference at {i}: {} vs {}", a[i], b[i]);
    }
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

/// CUDA and CPU gradients agree to ~1e-6 relative per step; the weights of a few steps stay
/// within 1e-4 of the CPU reference's (as `tests/tests/cluster_cuda.rs`).
const CUDA_TOL: f64 = 1e-4;

/// The shards of the config at `path`, each served in this process on 127.0.0.1:0 by a
/// runtime on a thread of its own (as `ps-server` serves it), with a fresh shard credential.
struct Shards {
    addrs: Vec<String>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    done: Vec<std::sync::mpsc::Receiver<anyhow::Result<ps_server::Outcome>>>,
}

impl Shards {
    fn start(path: &std::path::Path, n: usize) -> Self {
        let credential = path.with_file_name("shard-token");
        let token = ps_config::credential::Token::random();
        std::fs::write(&credential, token.secret()).unwrap();
        let listeners: Vec<_> = (0..n)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<String> = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect();
        let (mut stops, mut done) = (Vec::new(), Vec::new());
        for (index, l) in listeners.into_iter().enumerate() {
            l.set_nonblocking(true).unwrap();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let (tx, rx) = std::sync::mpsc::channel();
            let (path, addrs, credential) = (path.to_path_buf(), addrs.clone(), credential.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .unwrap();
                let r = rt.block_on(async move {
                    let shard0 = (index > 0).then(|| addrs[0].clone());
                    let o = ps_config::Overrides::default();
                    let mut setup = ps_server::load_setup(&path, index, shard0, &o)?;
                    setup.cfg.cluster.servers = addrs;
                    setup.cfg.server.shard_token_file = Some(credential);
                    let total = setup.cfg.total_steps(setup.train_len)?;
                    setup.cfg.schedule = setup.cfg.schedule_for(total);
                    let listener = tokio::net::TcpListener::from_std(l)?;
                    ps_server::run_shard(setup, listener, async {
                        let _ = stopped.await;
                    })
                    .await
                });
                let _ = tx.send(r);
            });
            stops.push(stop);
            done.push(rx);
        }
        Self { addrs, stops, done }
    }

    /// Waits (at most `limit` each) for every shard to end; panics unless each finished.
    fn join(self, limit: Duration) {
        for (i, rx) in self.done.iter().enumerate() {
            match rx.recv_timeout(limit) {
                Ok(Ok(ps_server::Outcome::Finished)) => {}
                other => panic!("shard {i} ended {other:?}"),
            }
        }
    }
}

impl Drop for Shards {
    fn drop(&mut self) {
        for s in self.stops.drain(..) {
            let _ = s.send(());
        }
    }
}

/// Waits (at most `limit`) for `child` to exit; kills it and panics with its log otherwise.
fn wait_bounded(child: &mut std::process::Child, log: &std::path::Path, limit: Duration) {
    let t0 = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            assert!(status.success(), "a worker exited {status}:\n{text}");
            return;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let text = std::fs::read_to_string(log).unwrap_or_default();
            panic!("a worker did not finish within {limit:?}:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The 2-shard cluster (784-16-10, 4 steps of 32 over 2 workers, over shared memory) in
/// `dir`: the shards in this process, the workers `ps-worker --device=cuda` processes, every
/// registration refused by the driver when `refuse` (the harness's
/// `CUDA_HARNESS_REGISTER_RESULT`, set for the worker processes alone). Its config, each
/// worker's log and the final weights.
fn cuda_cluster(dir: &std::path::Path, refuse: bool) -> (ps_config::Config, Vec<String>, Vec<f32>) {
    let path = dir.join("config.toml");
    let toml = ps_config::TestConfig::new()
        .shards(2)
        .workers(2)
        .hidden(&[16])
        .transport(ps_config::Transport::Auto)
        .sgd(0.1, 0.9)
        .barrier_timeout_secs(120.0)
        .data_dir(mnist())
        .global_batch(32)
        .steps(4)
        .out_dir(dir.join("out"))
        .toml();
    std::fs::write(&path, &toml).unwrap();
    let cfg = ps_config::Config::load(&path).unwrap();
    let shards = Shards::start(&path, 2);
    let mut workers: Vec<_> = (0..2)
        .map(|rank| {
            let log = dir.join(format!("worker-{rank}.log"));
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ps-worker"));
            cmd.arg("--config")
                .arg(&path)
                .args(["--rank", &rank.to_string(), "--world-size", "2"])
                .args(["--local-rank", "0", "--device", "cuda"])
                .arg("--servers")
                .arg(shards.addrs.join(","))
                .env_remove("CUDA_HARNESS_REGISTER_RESULT")
                .stdout(std::fs::File::create(dir.join("stdout")).unwrap())
                .stderr(std::fs::File::create(&log).unwrap());
            if refuse {
                cmd.env("CUDA_HARNESS_REGISTER_RESULT", "2");
            }
            (cmd.spawn().unwrap(), log)
        })
        .collect();
    for (child, log) in &mut workers {
        wait_bounded(child, log, Duration::from_secs(300));
    }
    shards.join(Duration::from_secs(60));
    let logs = workers
        .iter()
        .map(|(_, log)| std::fs::read_to_string(log).unwrap())
        .collect();
    let p = cfg.layout().num_params();
    let (w, version) = ps_model::weights::read_shards(&cfg.server.out_dir, 2, p).unwrap();
    assert_eq!(version, 4, "the shards at the last version");
    (cfg, logs, w)
}

fn mnist() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/mnist")
}

/// The fallback end to end: with every registration refused by the driver, two CUDA workers
/// (each a process, as in production) train with two in-process shards over shared memory:
/// each says the refusal once and registers nothing, each step copies exactly the staging
/// figures on the host (`ps_net::copied`: the weights out of the boards, 4·params, and the
/// gradient out of pinned memory into the board, 4·params), nothing runs by DMA on registered
/// memory and nothing is registered at exit (the harness's summary). The final weights are
/// those of the same cluster with the boards registered (0 host bytes per step) bit for bit,
/// and the CPU reference's within `CUDA_TOL`.
#[test]
#[ignore = "needs the CUDA harness (its registration switch): run under scripts/cuda-harness.sh"]
fn refused_registration_trains_on_staging_with_its_host_copies_said_once() {
    let _ = gpu(&MlpLayout::new(&[2, 2]));
    if harness_fn(c"cuda_harness_registered_bytes").is_none() {
        eprintln!("a GPU, not the harness: registration cannot be refused on demand here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (cfg, logs, w) = cuda_cluster(dir.path(), true);
    let p = cfg.layout().num_params();
    for (rank, log) in logs.iter().enumerate() {
        assert!(log.contains("device cuda: using cuda:"), "{log}");
        assert!(
            log.contains("tensors via [\"shared memory\", \"shared memory\"]"),
            "worker {rank} over shared memory:\n{log}"
        );
        let said: Vec<&str> = log.lines().filter(|l| l.contains("for DMA:")).collect();
        assert_eq!(said.len(), 1, "worker {rank} said the refusal once:\n{log}");
        assert!(
            said[0].contains(&format!("worker {rank}: cannot register the board"))
                && said[0].contains("CUDA_ERROR_OUT_OF_MEMORY")
                && said[0].contains("pinned staging memory (a host copy each way)"),
            "{}",
            said[0]
        );
        assert!(
            !log.contains("boards registered for the device's DMA"),
            "worker {rank} registered nothing:\n{log}"
        );
        let staging = format!("host bytes copied per step: pull {}, push {}", 4 * p, 4 * p);
        assert!(log.contains(&staging), "worker {rank}: {staging}:\n{log}");
        assert!(
            log.contains(", 0 copies by DMA on registered memory, 0 ranges registered at exit"),
            "worker {rank}: the harness's summary:\n{log}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let (_, logs, registered) = cuda_cluster(dir.path(), false);
    for (rank, log) in logs.iter().enumerate() {
        assert!(
            log.contains(&format!(
                "worker {rank}: 3 shared-memory boards registered for the device's DMA"
            )) && log.contains("host bytes copied per step: pull 0, push 0"),
            "worker {rank} registered its boards:\n{log}"
        );
    }
    assert_same_bits(
        &w,
        &registered,
        "the staging path's weights against the registered boards'",
    );
    let train = ps_data::idx::load_split(&mnist(), ps_data::idx::Split::Train, 10).unwrap();
    let want = ps_worker::reference::run_reference(&cfg, &train)
        .unwrap()
        .weights;
    let (d, at) = ps_model::weights::max_rel_diff(&cfg.layout(), &w, &want);
    eprintln!("largest relative difference from the CPU reference: {d:.3e} ({at})");
    assert!(d < CUDA_TOL, "{d} at {at}");
}

/// What the worker-level torn test's hook and log writer share: a handle of the shard's
/// parameters board (opened by the hook: the shard makes it when the worker registers) and
/// the values of version 0 it tore.
struct Tear {
    board: Option<Board>,
    saved: Vec<f32>,
}

static TEAR: std::sync::Mutex<Option<Tear>> = std::sync::Mutex::new(None);

/// This process's log (the worker's and the shards', as the binaries write it).
static LOG: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// The hook (run by the harness right before the worker's first upload from a registered
/// board): the shard's slot of version 0 gets version 2, as a shard two steps ahead would
/// write it.
extern "C" fn tear_version_0(_: *mut libc::c_void) {
    let mut t = TEAR.lock().unwrap();
    let t = t.as_mut().expect("the board to tear");
    let (dir, token) = shard0_dir();
    let mut board = Board::open(&params_path(&dir), token, t.saved.len(), 2).unwrap();
    assert!(
        board.read_version(0, &mut t.saved),
        "version 0 on the board"
    );
    board.begin_version(2).fill(1000.0);
    board.end_version(2);
    t.board = Some(board);
}

/// The log writer: appends to [`LOG`]; when the worker has said it does the step again, puts
/// version 0 back on the board (as the shard still holds it), before the worker goes on.
struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let mut log = LOG.lock().unwrap();
        log.push_str(&String::from_utf8_lossy(b));
        if log.contains("again, copying the weights")
            && let Some(Tear {
                board: Some(mut board),
                saved,
            }) = TEAR.lock().unwrap().take()
        {
            board.begin_version(0).copy_from_slice(&saved);
            board.end_version(0);
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The shared-memory directory of this process's shard 0 (`ps-<run>-shard0-pid<pid>-<token>`)
/// and its token.
fn shard0_dir() -> (std::path::PathBuf, u64) {
    let root = ps_net::shm::shm_root().expect("a shared-memory root");
    let mark = format!("shard0-pid{}-", std::process::id());
    for e in std::fs::read_dir(&root).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some((_, hex)) = name.split_once(&mark) {
            return (e.path(), u64::from_str_radix(hex, 16).unwrap());
        }
    }
    panic!("no {mark} directory in {}", root.display());
}

/// One shard and one CUDA worker in this process (784-16-10, 3 steps of 16, shared memory);
/// with `tear`, shard 0's slot of version 0 is torn right before the worker's first upload
/// from it and put back once the worker said it does the step again. The final weights.
fn torn_run(tear: bool) -> (ps_config::Config, Vec<f32>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    let toml = ps_config::TestConfig::new()
        .shards(1)
        .workers(1)
        .hidden(&[16])
        .transport(ps_config::Transport::Auto)
        .sgd(0.1, 0.9)
        .barrier_timeout_secs(120.0)
        .data_dir(mnist())
        .global_batch(16)
        .steps(3)
        .out_dir(dir.path().join("out"))
        .toml();
    std::fs::write(&path, &toml).unwrap();
    let mut cfg = ps_config::Config::load(&path).unwrap();
    let layout = MlpLayout::new(&[784, 16, 10]);
    let p = layout.num_params();
    let shards = Shards::start(&path, 1);
    cfg.cluster.servers = shards.addrs.clone();
    let backend = Box::new(gpu(&layout));
    if tear {
        *TEAR.lock().unwrap() = Some(Tear {
            board: None,
            saved: vec![0.0; p],
        });
        let hook = harness_fn(c"cuda_harness_before_registered_read").unwrap();
        // SAFETY: `void cuda_harness_before_registered_read(void (*)(void *), void *)`
        let hook: extern "C" fn(extern "C" fn(*mut libc::c_void), *mut libc::c_void) =
            unsafe { std::mem::transmute(hook) };
        hook(tear_version_0, std::ptr::null_mut());
    }
    let train = ps_data::idx::load_split(&mnist(), ps_data::idx::Split::Train, 10).unwrap();
    let test = ps_data::idx::load_split(&mnist(), ps_data::idx::Split::Test, 10).unwrap();
    let setup = ps_worker::worker::WorkerSetup {
        servers: cfg.cluster.servers.clone(),
        cfg: cfg.clone(),
        rank: 0,
        train,
        test,
        backend,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let worker = rt.spawn(ps_worker::worker::run_worker(setup));
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(300), worker)
            .await
            .expect("the worker finished within 300 s")
            .unwrap()
            .unwrap()
    });
    shards.join(Duration::from_secs(60));
    let (w, version) = ps_model::weights::read_shards(&cfg.server.out_dir, 1, p).unwrap();
    assert_eq!(version, 3);
    (cfg, w)
}

/// The worker-level redo after a torn version, in this process (the harness's hook tears the
/// shard's slot of version 0 right before the worker's first upload from it, and this test's
/// log writer puts version 0 back once the worker said it does the step again, as the shard
/// still holds it): the worker says the tear once, does step 0 again with copied weights, and
/// ends with the weights of the same run untorn, bit for bit.
#[test]
#[ignore = "needs the CUDA harness (its hook before a registered read): run under scripts/cuda-harness.sh"]
fn a_version_torn_under_the_workers_upload_is_redone_by_the_worker_exactly() {
    let _ = gpu(&MlpLayout::new(&[2, 2]));
    if harness_fn(c"cuda_harness_before_registered_read").is_none() {
        eprintln!("a GPU, not the harness: no hook to tear a version under the upload");
        return;
    }
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(|| LogWriter)
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("this test's log");
    let (_, plain) = torn_run(false);
    assert!(!LOG.lock().unwrap().contains("again"), "untorn");
    let (_, torn) = torn_run(true);
    let log = LOG.lock().unwrap().clone();
    assert!(TEAR.lock().unwrap().is_none(), "torn and put back:\n{log}");
    let again: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("again, copying"))
        .collect();
    assert_eq!(again.len(), 1, "{log}");
    assert!(
        again[0].contains("worker 0: ")
            && again[0].contains("overwrote its board slot of version 0")
            && again[0].contains("step 0 again, copying the weights"),
        "{}",
        again[0]
    );
    assert!(
        log.contains("shared-memory boards registered for the device's DMA"),
        "{log}"
    );
    assert_same_bits(&torn, &plain, "the redone run's weights");
}
