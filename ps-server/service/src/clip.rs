//! Global gradient-norm clipping across the shards (`[optimizer] clip_norm`), exactly as
//! `torch.nn.utils.clip_grad_norm_(params, max_norm)` on the aggregated gradient.
//!
//! torch takes the L2 norm of each parameter's gradient (f32), then the norm of those norms,
//! and scales every gradient by `min(1, max_norm / (total + 1e-6))` (f32). A tensor may span
//! two shards, so before applying step `t` each shard sums the squares of its range of each
//! tensor of the aggregated gradient ([`partials`]) and the shards exchange them:
//!
//! - shard 0 is the hub ([`Hub`]): it adds its own and every other shard's per-tensor sums
//!   as they come (`ClipNorm`, authenticated with the shard credential like `ReportStep`),
//!   and once all S are in computes the total ([`total_norm`]) and answers every waiting one;
//! - shard i > 0 ([`Spoke`]) sends its sums to shard 0 and waits for the total in the reply:
//!   one round trip per step, overlapping the time shard 0 itself needs to get there.
//!
//! Every shard then scales its range by the same coefficient ([`coefficient`]), so the run
//! equals one process that clips its gradient. Tensors no rank's backward reached in the step
//! (torch's `grad is None`) count 0 and are not updated anyway (`crate::shard::unused`).
//!
//! Waits are bounded ([`bound`]) and end as soon as the shard's run fails (a worker that
//! stopped, a rollback ordered by a lost shard's replacement): the exchange never holds a step
//! past the existing failure paths. The design alternative, workers gathering the per-shard
//! sums and sending the total back, needs a second round trip from every worker to every
//! shard after its push (W x S calls instead of S - 1) and lets a slow worker delay it.

use crate::shard::{NormError, NormExchange, Shard};
use ps_model::layout::ModelSpec;
use ps_proto::pb::{ClipNormReply, ClipNormRequest};
use std::ops::Range;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::watch;

pub use ps_model::clip::{coefficient, partials, tensors_of, total_norm};

/// How long a shard waits for the other shards' norms of a step: as long as their barriers
/// may legitimately take (twice the barrier timeout, the longest under `barrier_policy =
/// "continue"`), plus the cluster's margin for a peer that is slow but alive (`[worker]
/// deadline_margin_secs`, 30 s by default: the margin of the workers' call deadlines too).
pub fn bound(cfg: &ps_config::Config) -> Duration {
    Duration::from_secs_f64(2.0 * cfg.server.barrier_timeout_secs)
        + ps_net::client::deadline_margin(cfg)
}

/// Resolves with the reason once `shard`'s run has failed (a rollback fails it too).
async fn failed(shard: &Shard) -> String {
    let mut versions = shard.subscribe();
    loop {
        if let Some(why) = shard.failure() {
            return why;
        }
        if versions.changed().await.is_err() {
            return "the shard stopped".into();
        }
    }
}

/// One step's sums as they come in at shard 0.
#[derive(Debug)]
struct Round {
    step: u64,
    sq: Vec<f64>,
    from: Vec<bool>,
}

/// Shard 0's side: gathers every shard's per-tensor sums of a step and publishes the total.
#[derive(Debug)]
pub struct Hub {
    spec: ModelSpec,
    ranges: Vec<Range<usize>>,
    round: Mutex<Option<Round>>,
    /// The newest complete step and its total norm.
    done: watch::Sender<Option<(u64, f32)>>,
    bound: Duration,
    runtime: tokio::runtime::Handle,
}

impl Hub {
    /// The hub of `cfg`'s shards; call from within the runtime.
    pub fn new(cfg: &ps_config::Config) -> Self {
        let spec = cfg.spec();
        let ranges = ps_model::layout::shard_ranges(spec.num_params(), cfg.num_shards());
        Self {
            spec,
            ranges,
            round: Mutex::new(None),
            done: watch::Sender::new(None),
            bound: bound(cfg),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// Checks a request of shard `r.shard`: another shard of the layout, its tensors, finite
    /// non-negative sums. The message says what is wrong.
    pub fn check(&self, r: &ClipNormRequest) -> Result<(), ClipError> {
        let s = self.ranges.len();
        let shard = r.shard as usize;
        if shard == 0 || shard >= s {
            return Err(ClipError::NotASpoke {
                shard: r.shard,
                shards: s,
            });
        }
        let t = tensors_of(&self.spec, &self.ranges[shard]);
        if r.first_tensor as usize != t.start || r.sq.len() != t.len() {
            return Err(ClipError::WrongTensors {
                shard,
                sums: r.sq.len(),
                first: r.first_tensor,
                want_sums: t.len(),
                want_first: t.start,
                range: self.ranges[shard].clone(),
            });
        }
        if let Some(&value) = r.sq.iter().find(|v| !(v.is_finite() && **v >= 0.0)) {
            return Err(ClipError::BadSum {
                shard,
                step: r.step,
                value,
            });
        }
        Ok(())
    }

    /// Adds `shard`'s sums for `step` (checked with [`Hub::check`] when they came over the
    /// network); the same shard's again, or a step already complete, changes nothing. A newer
    /// step starts a new round (one left incomplete belonged to a step its shards gave up).
    pub fn contribute(&self, shard: usize, step: u64, first: u32, sq: &[f64]) {
        if self.done.borrow().is_some_and(|(s, _)| s >= step) {
            return;
        }
        let mut round = self.round.lock().unwrap_or_else(|p| p.into_inner());
        let r = match &mut *round {
            Some(r) if r.step == step => r,
            Some(r) if r.step > step => return,
            _ => round.insert(Round {
                step,
                sq: vec![0.0; self.spec.tensors.len()],
                from: vec![false; self.ranges.len()],
            }),
        };
        if std::mem::replace(&mut r.from[shard], true) {
            return;
        }
        for (i, &v) in sq.iter().enumerate() {
            r.sq[first as usize + i] += v;
        }
        if r.from.iter().all(|&f| f) {
            let total = total_norm(&r.sq);
            *round = None;
            self.done.send_replace(Some((step, total)));
        }
    }

    /// The total norm of `step` once every shard's sums are in; an error when the wait passes
    /// [`bound`], when `shard`'s run fails meanwhile, or when the hub moved past the step.
    pub async fn wait(&self, step: u64, shard: &Shard) -> Result<f32, NormError> {
        let mut done = self.done.subscribe();
        let all_in = async {
            loop {
                if let Some((s, total)) = *done.borrow_and_update() {
                    if s == step {
                        return Ok(total);
                    }
                    if s > step {
                        return Err(NormError::Superseded { step, at: s });
                    }
                }
                if done.changed().await.is_err() {
                    return Err(NormError::RunFailed {
                        step,
                        why: "shard 0 stopped".into(),
                    });
                }
            }
        };
        tokio::select! {
            r = tokio::time::timeout(self.bound, all_in) => r.unwrap_or_else(|_| Err(NormError::TimedOut {
                step,
                at: "of every shard at shard 0".into(),
                secs: self.bound.as_secs_f64(),
                last: String::new(),
            })),
            why = failed(shard) => Err(NormError::RunFailed { step, why }),
        }
    }

    /// Shortens the bound of every wait (tests).
    pub fn with_bound(mut self, bound: Duration) -> Self {
        self.bound = bound;
        self
    }
}

impl NormExchange for Hub {
    fn total_norm(
        &self,
        shard: &Shard,
        step: u64,
        first: u32,
        sq: Vec<f64>,
    ) -> Result<f32, NormError> {
        self.contribute(0, step, first, &sq);
        self.runtime.block_on(self.wait(step, shard))
    }
}

/// The side of shard i > 0: sends its sums to shard 0 and waits for the total in the reply,
/// retrying (bounded) while shard 0 cannot be reached or refuses for the time being.
#[derive(Debug)]
pub struct Spoke {
    index: usize,
    shard0: String,
    security: ps_net::auth::ClientSecurity,
    token: Option<ps_net::auth::Token>,
    generation: u64,
    bound: Duration,
    runtime: tokio::runtime::Handle,
    client: tokio::sync::Mutex<Option<ps_net::client::ShardClient>>,
}

impl Spoke {
    /// Shard `index`'s side, reaching shard 0 at `shard0` with the shard credential `token`,
    /// in cluster `generation`; call from within the runtime.
    pub fn new(
        cfg: &ps_config::Config,
        index: usize,
        shard0: String,
        token: Option<ps_net::auth::Token>,
        generation: u64,
    ) -> Self {
        Self {
            index,
            shard0,
            security: ps_net::auth::ClientSecurity::of(cfg),
            token,
            generation,
            bound: bound(cfg),
            runtime: tokio::runtime::Handle::current(),
            client: tokio::sync::Mutex::new(None),
        }
    }

    /// Shortens the bound of the wait (tests).
    pub fn with_bound(mut self, bound: Duration) -> Self {
        self.bound = bound;
        self
    }

    async fn ask(&self, req: ClipNormRequest) -> Result<f32, NormError> {
        let step = req.step;
        let deadline = Instant::now() + self.bound;
        let mut backoff = Duration::from_millis(50);
        let mut client = self.client.lock().await;
        let mut last = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(NormError::TimedOut {
                    step,
                    at: format!("from shard 0 at {}", self.shard0),
                    secs: self.bound.as_secs_f64(),
                    last: if last.is_empty() {
                        last
                    } else {
                        format!(", last: {last}")
                    },
                });
            }
            let why = match client.as_mut() {
                None => {
                    match ps_net::client::ShardClient::connect(
                        0,
                        &self.shard0,
                        &self.security,
                        left.min(Duration::from_secs(5)),
                    )
                    .await
                    {
                        Ok(c) => {
                            *client = Some(c);
                            continue;
                        }
                        Err(e) => e.to_string(),
                    }
                }
                Some(c) => {
                    let mut request = tonic::Request::new(req.clone());
                    request.set_timeout(left);
                    if let Some(t) = &self.token {
                        request.metadata_mut().insert(
                            ps_net::auth::SHARD_TOKEN_KEY,
                            ps_net::auth::metadata_value(t),
                        );
                    }
                    // the call itself is bounded too: a frozen shard 0 never answers
                    match tokio::time::timeout(left, c.rpc().clip_norm(request)).await {
                        Ok(Ok(r)) => {
                            let ClipNormReply {
                                step: got,
                                total_norm,
                            } = r.into_inner();
                            if got != step {
                                return Err(NormError::OtherStep { step, got });
                            }
                            return Ok(total_norm);
                        }
                        // an answer that retrying would not change
                        Ok(Err(s)) if is_final(s.code()) => {
                            return Err(NormError::Refused {
                                step,
                                why: format!("{:?}: {}", s.code(), s.message()),
                            });
                        }
                        Ok(Err(s)) => {
                            *client = None;
                            format!("{:?}: {}", s.code(), s.message())
                        }
                        Err(_) => {
                            *client = None;
                            format!("no answer within {:.1} s", left.as_secs_f64())
                        }
                    }
                }
            };
            tracing::debug!(
                "shard {}: gradient norms of step {step} to shard 0: {why}; trying again",
                self.index
            );
            last = why;
            tokio::time::sleep(backoff.min(left)).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
}

/// Whether shard 0's refusal is final: this side's request is wrong (its credential, its
/// figures, its step), not the moment.
fn is_final(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::InvalidArgument
            | tonic::Code::Unauthenticated
            | tonic::Code::PermissionDenied
            | tonic::Code::FailedPrecondition
    )
}

impl NormExchange for Spoke {
    fn total_norm(
        &self,
        shard: &Shard,
        step: u64,
        first: u32,
        sq: Vec<f64>,
    ) -> Result<f32, NormError> {
        let req = ClipNormRequest {
            shard: self.index as u32,
            step,
            generation: self.generation,
            first_tensor: first,
            sq,
        };
        self.runtime.block_on(async {
            tokio::select! {
                r = self.ask(req) => r,
                why = failed(shard) => Err(NormError::RunFailed { step, why }),
            }
        })
    }
}

/// Why shard 0 refuses another shard's gradient norms ([`Hub::check`]).
#[derive(Debug, thiserror::Error)]
pub enum ClipError {
    /// The sender is not a shard i > 0 of the layout.
    #[error("gradient norms from shard {shard}: expected a shard in 1..{shards}")]
    NotASpoke {
        /// The shard it says it is.
        shard: u32,
        /// S.
        shards: usize,
    },
    /// Not the sums of the tensors of the sender's range.
    #[error(
        "gradient norms from shard {shard}: {sums} sums from tensor {first}: expected {want_sums} from tensor {want_first} (the tensors of its range {range:?})"
    )]
    WrongTensors {
        /// The shard.
        shard: usize,
        /// How many sums it sent.
        sums: usize,
        /// The tensor of its first sum.
        first: u32,
        /// How many its range has.
        want_sums: usize,
        /// Its range's first tensor.
        want_first: usize,
        /// Its range of the flat vector.
        range: std::ops::Range<usize>,
    },
    /// A sum that is not a finite non-negative number.
    #[error(
        "gradient norms from shard {shard} of step {step}: squared norm {value}: expected finite non-negative numbers"
    )]
    BadSum {
        /// The shard.
        shard: usize,
        /// The step.
        step: u64,
        /// The sum.
        value: f64,
    },
}

#[cfg(test)]
mod tests {
    //! Each way the exchange ends without a total, on a real hub and spoke in-process: the
    //! typed error, within the bound, never a hang.
    use super::*;
    use ps_config::TestConfig;
    use std::sync::Arc;

    fn cfg(dir: &std::path::Path) -> ps_config::Config {
        TestConfig::new()
            .shards(2)
            .workers(1)
            .hidden(&[4])
            .sgd(0.1, 0.0)
            .clip_norm(1.0)
            .build(&dir.join("config.toml"))
            .unwrap()
    }

    const SHORT: Duration = Duration::from_millis(300);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_hub_times_out_is_superseded_or_joins_the_failure() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = cfg(dir.path());
        let shard = Shard::new(&cfg, 0, 10);
        let hub = Hub::new(&cfg).with_bound(SHORT);
        let t0 = Instant::now();
        let e = hub.wait(0, &shard).await.unwrap_err();
        assert!(
            matches!(&e, NormError::TimedOut { step: 0, secs, .. } if *secs == SHORT.as_secs_f64()),
            "{e:?}"
        );
        assert!(t0.elapsed() < SHORT * 10, "{:?}", t0.elapsed());
        // both shards' sums of step 1 complete it: step 0 was settled without this shard
        let t = tensors_of(&hub.spec, &hub.ranges[1]);
        hub.contribute(
            0,
            1,
            0,
            &vec![1.0; tensors_of(&hub.spec, &hub.ranges[0]).len()],
        );
        hub.contribute(1, 1, t.start as u32, &vec![1.0; t.len()]);
        assert!(hub.wait(1, &shard).await.is_ok());
        let e = hub.wait(0, &shard).await.unwrap_err();
        assert_eq!(e, NormError::Superseded { step: 0, at: 1 });
        // a contribution for an older step than the newest complete one changes nothing
        hub.contribute(1, 0, t.start as u32, &vec![1.0; t.len()]);
        assert!(hub.round.lock().unwrap().is_none());
        // a rollback order fails the shard's state: a wait under way ends with it
        let waiting = {
            let (hub, shard) = (Arc::new(hub), shard.clone());
            tokio::spawn(async move { hub.wait(2, &shard).await })
        };
        shard.fail("rolled back to version 0 (generation 1): shard 1 was lost".into());
        let e = waiting.await.unwrap().unwrap_err();
        assert_eq!(
            e,
            NormError::RunFailed {
                step: 2,
                why: "rolled back to version 0 (generation 1): shard 1 was lost".into()
            }
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_spoke_facing_a_frozen_shard_0_times_out_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = cfg(dir.path());
        let shard = Shard::new(&cfg, 1, 10);
        // accepts connections and never says a word: a stopped process's kernel does that
        let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = frozen.local_addr().unwrap().to_string();
        let spoke = Arc::new(Spoke::new(&cfg, 1, addr.clone(), None, 0).with_bound(SHORT));
        let t0 = Instant::now();
        let e = tokio::task::spawn_blocking(move || spoke.total_norm(&shard, 3, 0, vec![1.0]))
            .await
            .unwrap()
            .unwrap_err();
        let NormError::TimedOut { step, at, last, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(
            (*step, at.as_str()),
            (3, format!("from shard 0 at {addr}").as_str())
        );
        assert!(!last.is_empty(), "the last try's failure is said");
        assert!(t0.elapsed() < SHORT * 20, "{:?}", t0.elapsed());
        drop(frozen);
    }
}
