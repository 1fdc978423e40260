//! The watch over a worker's backward passes (issue 41: no silent hang): a step whose push
//! failed, or whose push's deadline passed while the backward pass fed it, and whose backward
//! pass does not end within a bound, ends the run with an error naming the step, the shard and
//! the wait ([`crate::worker::run_worker`] returns it; the stuck thread is left behind).

use std::sync::Arc;
use std::time::Duration;

/// A task aborted when dropped (the run of [`crate::worker::run_worker`], when its caller gives up on it).
pub(crate) struct AbortOnDrop<T>(pub(crate) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The longest a step's backward pass may go on after one of its pushes failed before the
/// worker gives up on it (the step is lost; a backward still running is stalled) with the
/// default `[worker] deadline_margin_secs`: the grace of the default config, and of every
/// config whose shards hold a step this long or longer.
pub const STALL_GRACE: Duration = ps_net::client::DEADLINE_MARGIN;

/// The grace of a run of `cfg`: the longest a shard of it holds a step (`[server]
/// pull_timeout_secs`, or twice `barrier_timeout_secs`, as in `ps_net::client::call_deadline`),
/// at most the deadline's margin (`[worker] deadline_margin_secs`, [`STALL_GRACE`] by default).
/// A backward pass still running that long after its push failed feeds no step any shard
/// still holds. The default config (300 s, 600 s) gives [`STALL_GRACE`]; a test config with
/// 1 s timeouts gives up after 2 s.
pub fn stall_grace(cfg: &ps_config::Config) -> Duration {
    let cap = ps_net::client::deadline_margin(cfg);
    let held = cfg
        .server
        .pull_timeout_secs
        .max(2.0 * cfg.server.barrier_timeout_secs);
    Duration::try_from_secs_f64(held).map_or(cap, |held| held.min(cap))
}

/// The watch over each step's backward pass: which step computes, and the error that ends the
/// run when that computation stalls (a push of the step failed and it did not end within the
/// grace, [`stall_grace`], or the push's deadline passed while the backward pass fed it).
#[derive(Clone)]
pub struct Watch(Arc<WatchState>);

/// A watch with the longest grace, [`STALL_GRACE`].
impl Default for Watch {
    fn default() -> Self {
        Self::with_grace(STALL_GRACE)
    }
}

struct WatchState {
    /// How long a backward pass may go on after its push failed.
    grace: Duration,
    /// The step whose backward pass runs, plus one (0: none).
    computing: std::sync::atomic::AtomicU64,
    fatal: std::sync::Mutex<Option<anyhow::Error>>,
    notify: tokio::sync::Notify,
}

impl Watch {
    /// The watch of a run of `cfg`: its grace is [`stall_grace`]`(cfg)`.
    pub fn for_run(cfg: &ps_config::Config) -> Self {
        Self::with_grace(stall_grace(cfg))
    }

    /// A watch whose grace is `grace`.
    pub fn with_grace(grace: Duration) -> Self {
        Self(Arc::new(WatchState {
            grace,
            computing: Default::default(),
            fatal: Default::default(),
            notify: Default::default(),
        }))
    }

    /// Step `t`'s computation begins (`Some`) or ended (`None`).
    pub(crate) fn computing(&self, t: Option<u64>) {
        let v = t.map_or(0, |t| t + 1);
        self.0
            .computing
            .store(v, std::sync::atomic::Ordering::SeqCst);
    }

    fn still_computing(&self, t: u64) -> bool {
        self.0.computing.load(std::sync::atomic::Ordering::SeqCst) == t + 1
    }

    /// A push of step `t` to a shard failed with `e`: if the step's backward pass still runs
    /// when its feed stalled, or the grace later otherwise, the run ends with the error.
    pub(crate) fn push_failed(&self, t: u64, rank: usize, e: &ps_net::client::ClientError) {
        let stalled = matches!(e, ps_net::client::ClientError::FeedStalled { .. });
        let (w, said, grace) = (self.clone(), e.to_string(), self.0.grace);
        tokio::spawn(async move {
            if !stalled {
                tokio::time::sleep(grace).await;
            }
            if w.still_computing(t) {
                let e = if stalled {
                    anyhow::anyhow!("worker {rank}: step {t}: {said}")
                } else {
                    anyhow::anyhow!(
                        "worker {rank}: the backward pass of step {t} did not end within {} s after its push failed ({said})",
                        grace.as_secs_f64()
                    )
                };
                w.fire(e);
            }
        });
    }

    fn fire(&self, e: anyhow::Error) {
        let mut f = self.0.fatal.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert(e);
        self.0.notify.notify_one();
    }

    /// Waits until the run must end on a stalled computation: the error.
    pub(crate) async fn stalled(&self) -> anyhow::Error {
        loop {
            self.0.notify.notified().await;
            let mut f = self.0.fatal.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(e) = f.take() {
                return e;
            }
        }
    }
}
