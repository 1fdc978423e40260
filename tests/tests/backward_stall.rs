//! A worker whose backward pass stalls mid-push (issue 41: every client wait has a bound):
//! one in-process shard on port 0, one worker (`run_worker`) on the data connection, whose
//! backend hands over all of step 1's gradient but its first value and then hangs. The worker
//! must not hang with it: `run_worker` ends with an error naming the step, the shard and the
//! wait, within the stated bound (the push's deadline, `call_deadline`, or the grace,
//! `stall_grace`, after the shard refused the push), while the backward pass is still stuck.
//! The grace follows the config's timeouts: 2 s here, 30 s (`STALL_GRACE`) by default. The
//! deadline's margin is `[worker] deadline_margin_secs`: 3 s here (30 s by default).

use ps_config::{Config, LossReduction, Transport};
use ps_net::client::call_deadline;
use ps_server::{ShardSetup, run_shard};
use ps_tests::{Spec, mnist_dir, mnist_train};
use ps_worker::backend::{Backend, BackendResult, StepStats};
use ps_worker::gate::PullGate;
use ps_worker::watch::{STALL_GRACE, stall_grace};
use ps_worker::worker::{WorkerSetup, run_worker};
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
            .pull_timeout_secs(1.0)
            .deadline_margin_secs(3.0),
        ..Spec::default()
    };
    spec.write(dir).1
}

/// Runs one in-process shard of `cfg` and worker 0 on the [`Stalling`] backend, whose step 1
/// backward pass stalls, until the worker ends (bounded: three times the longer of the push's
/// deadline and the grace plus 5 s); the worker's error and how long it ran. Asserts the
/// backend stalled and the error names the step, the shard and what stalled.
async fn stalled_run(cfg: &Config) -> (String, Duration) {
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
    let bound = call_deadline(cfg).max(stall_grace(cfg) + Duration::from_secs(5));
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
    let _ = stop.send(());
    shard.abort();
    (err, waited)
}

/// The shard waits for the rest of the push (its stream is not idle for 60 s): the worker
/// gives up at the push's deadline, or the grace after a failed push, no sooner than the
/// bound it names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_backward_ends_the_worker_with_the_shard_and_the_wait() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let deadline = call_deadline(&cfg);
    assert_eq!(deadline.as_secs(), 5, "max(1, 2 x 1) + 3 s");
    let grace = stall_grace(&cfg);
    assert_eq!(grace, Duration::from_secs(2), "max(1, 2 x 1) s");
    let (err, waited) = stalled_run(&cfg).await;
    let bound = if err.contains("within 5 s") {
        assert!(
            err.contains("[worker] deadline_margin_secs = 3 s"),
            "names the margin: {err}"
        );
        deadline
    } else {
        assert!(err.contains("within 2 s after"), "names the wait: {err}");
        grace
    };
    assert!(
        waited >= bound,
        "gave up no sooner than its bound, {bound:?} ({waited:?}): {err}"
    );
}

/// The shard ends the stalled push once its stream is idle past `stream_idle_secs` (1 s): the
/// push failed, and the worker gives up the grace later, 2 s with these 1 s timeouts (30 s,
/// `STALL_GRACE`, with the default config's), no sooner, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_backward_after_a_failed_push_ends_the_worker_after_the_configs_grace() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.server.stream_idle_secs = 1.0;
    let grace = stall_grace(&cfg);
    assert_eq!(grace, Duration::from_secs(2), "max(1, 2 x 1) s");
    let (err, waited) = stalled_run(&cfg).await;
    assert!(
        err.contains("did not end within 2 s after its push failed"),
        "names the grace: {err}"
    );
    assert!(
        waited >= grace,
        "gave up no sooner than the grace, {grace:?} ({waited:?}): {err}"
    );
}

/// The grace of the default config is the longest, `STALL_GRACE` (30 s): a shard of it holds a
/// step far longer (barrier 300 s, pull 600 s); a config whose shards hold a step less than 30 s
/// gives up sooner, and one with a longer hold never later than 30 s, or its `[worker]
/// deadline_margin_secs` when set.
#[test]
fn the_grace_is_the_longest_hold_of_a_step_at_most_30_s() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        config: ps_config::TestConfig::new(),
        ..Spec::default()
    };
    let (_, default) = spec.write(dir.path());
    assert_eq!(
        (
            default.server.barrier_timeout_secs,
            default.server.pull_timeout_secs
        ),
        (300.0, 600.0)
    );
    assert_eq!(stall_grace(&default), STALL_GRACE);
    assert_eq!(STALL_GRACE, Duration::from_secs(30));
    let mut cfg = default.clone();
    cfg.server.barrier_timeout_secs = 4.0;
    cfg.server.pull_timeout_secs = 5.0;
    assert_eq!(stall_grace(&cfg), Duration::from_secs(8), "2 x 4 s");
    cfg.server.pull_timeout_secs = 12.5;
    assert_eq!(
        stall_grace(&cfg),
        Duration::from_secs_f64(12.5),
        "the pull's 12.5 s"
    );
    cfg.server.barrier_timeout_secs = 20.0;
    assert_eq!(stall_grace(&cfg), STALL_GRACE, "2 x 20 s, capped");
    // the cap is the deadline's margin, [worker] deadline_margin_secs
    cfg.worker.deadline_margin_secs = 7.5;
    assert_eq!(
        stall_grace(&cfg),
        Duration::from_secs_f64(7.5),
        "2 x 20 s, capped by the margin"
    );
    cfg.worker.deadline_margin_secs = 100.0;
    assert_eq!(stall_grace(&cfg), Duration::from_secs(40), "2 x 20 s");
}
