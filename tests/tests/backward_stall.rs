//! A worker whose backward pass stalls mid-push (issue 41: every client wait has a bound):
//! one in-process shard on port 0, one worker (`run_worker`) on the data connection, whose
//! backend hands over all of step 1's gradient but its first value and then hangs. The worker
//! must not hang with it: `run_worker` ends with an error naming the step, the shard and the
//! wait, within the stated bound (the push's deadline, `call_deadline`, or `STALL_GRACE`
//! after the shard refused the push), while the backward pass is still stuck.

use ps_config::{Config, LossReduction, Transport};
use ps_net::client::call_deadline;
use ps_server::{ShardSetup, run_shard};
use ps_tests::{Spec, mnist_dir, mnist_train};
use ps_worker::backend::{Backend, BackendResult, StepStats};
use ps_worker::gate::PullGate;
use ps_worker::worker::{STALL_GRACE, WorkerSetup, run_worker};
use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// The CPU backend, except that the backward pass of its `stall_at`-th call hands over the
/// gradient from flat index 1 on, then waits for `release` (bounded: 10 minutes) before it
/// hands over the rest.
struct Stalling {
    inner: Box<dyn Backend>,
    calls: usize,
    stall_at: usize,
    release: Receiver<()>,
    /// Set when the stall begins.
    stalled: std::sync::mpsc::Sender<()>,
}

impl Backend for Stalling {
    fn name(&self) -> String {
        format!("stalling {}", self.inner.name())
    }
    fn set_weights(&mut self, flat: &[f32]) -> BackendResult<()> {
        self.inner.set_weights(flat)
    }
    fn host_weights(&mut self) -> Option<&mut [f32]> {
        self.inner.host_weights()
    }
    fn layers(&self) -> Vec<Range<usize>> {
        self.inner.layers()
    }
    fn open_gate(
        &mut self,
        version: u64,
        shards: Vec<Range<usize>>,
        patience: Duration,
    ) -> Option<Arc<PullGate>> {
        self.inner.open_gate(version, shards, patience)
    }
    fn close_gate(&mut self) {
        self.inner.close_gate();
    }
    fn forward_backward(
        &mut self,
        x: &[f32],
        labels: &[u8],
        reduction: LossReduction,
        grad: &mut [f32],
    ) -> BackendResult<StepStats> {
        self.inner.forward_backward(x, labels, reduction, grad)
    }
    fn forward_backward_overlapped(
        &mut self,
        x: &[f32],
        labels: &[u8],
        reduction: LossReduction,
        grad: &mut [f32],
        ready: &mut dyn FnMut(usize, &[f32], StepStats),
    ) -> BackendResult<StepStats> {
        let stats = self.inner.forward_backward(x, labels, reduction, grad)?;
        self.calls += 1;
        if self.calls == self.stall_at {
            ready(1, &grad[1..], stats);
            let _ = self.stalled.send(());
            match self.release.recv_timeout(Duration::from_secs(600)) {
                Ok(()) | Err(RecvTimeoutError::Disconnected) => {}
                Err(RecvTimeoutError::Timeout) => panic!("the test never released the stall"),
            }
        }
        ready(0, grad, stats);
        Ok(stats)
    }
    fn evaluate(&mut self, x: &[f32], labels: &[u8]) -> BackendResult<u64> {
        self.inner.evaluate(x, labels)
    }
}

/// The config: 1 shard, 1 worker on gRPC and the data connection (no shared memory, so the
/// push goes piece by piece), a model whose range is one piece of more than
/// `MIN_PIECE_VALUES` values, short barrier and pull timeouts (so a short deadline).
fn config(dir: &std::path::Path) -> Config {
    let spec = Spec {
        shards: 1,
        workers: 1,
        hidden: vec![128],
        steps: 4,
        transport: Transport::Grpc,
        config: Spec::base()
            .sgd(0.1, 0.0)
            .barrier_timeout_secs(1.0)
            .pull_timeout_secs(1.0),
        ..Spec::default()
    };
    spec.write(dir).1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_backward_ends_the_worker_with_the_shard_and_the_wait() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let setup = ShardSetup {
        cfg: cfg.clone(),
        index: 0,
        train_len: mnist_train().len(),
        test_len: None,
        shard0: None,
        resume_from: None,
        metrics_listen: None,
        health_listen: None,
    };
    let shard = tokio::spawn(run_shard(setup, listener, async {
        let _ = stopped.await;
    }));

    let (release, released) = std::sync::mpsc::channel();
    let (stalled_tx, stalled_rx) = std::sync::mpsc::channel();
    let (cpu, _) = ps_worker::device::open_backend("cpu", 0, &cfg.layout(), 1).unwrap();
    let backend = Box::new(Stalling {
        inner: cpu,
        calls: 0,
        stall_at: 2,
        release: released,
        stalled: stalled_tx,
    });
    let test = ps_data::idx::load_split(&mnist_dir(), ps_data::idx::Split::Test, 10).unwrap();
    let worker = WorkerSetup {
        cfg: cfg.clone(),
        servers: vec![addr],
        rank: 0,
        train: mnist_train().clone(),
        test,
        backend,
    };
    let t0 = Instant::now();
    let bound = call_deadline(&cfg).max(STALL_GRACE + Duration::from_secs(5));
    let ended = tokio::time::timeout(bound * 3, run_worker(worker)).await;
    let waited = t0.elapsed();
    let _ = release.send(()); // the stuck backward pass may end now
    let err = match ended {
        Ok(Err(e)) => format!("{e:#}"),
        Ok(Ok(_)) => panic!("the worker finished although its backward pass stalled"),
        Err(_) => panic!(
            "the worker hung past {:?} with its backward pass",
            bound * 3
        ),
    };
    assert!(
        stalled_rx.try_recv().is_ok(),
        "the backend stalled (step 1's backward): {err}"
    );
    assert!(err.contains("step 1"), "names the step: {err}");
    assert!(err.contains("shard 0"), "names the shard: {err}");
    assert!(err.contains("backward pass"), "says what stalled: {err}");
    let deadline = call_deadline(&cfg).as_secs();
    assert_eq!(deadline, 32, "max(1, 2 x 1) + 30 s");
    assert!(
        err.contains(&format!("within {deadline} s")) || err.contains("within 30 s after"),
        "names the wait: {err}"
    );
    assert!(
        waited >= STALL_GRACE,
        "gave up no sooner than its bound ({waited:?}): {err}"
    );
    let _ = stop.send(());
    shard.abort();
}
