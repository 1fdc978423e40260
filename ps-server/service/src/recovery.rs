//! Recovery from a lost shard: rollback to a version every shard has a checkpoint of.
//!
//! A shard that dies (`kill -9`, a node lost) is started again with the same index and
//! `--recover` (by `ps-launch --restart-shards N`, the Slurm recipe's loop, or a pod's restart
//! policy). Before it listens, the replacement runs [`handshake`]:
//!
//! 1. it asks every other shard (`Recover`, `rollback = false`) for its version, its cluster
//!    generation and the versions it holds checkpoints of;
//! 2. it picks the newest version that every shard, itself included, has an intact checkpoint
//!    of (each shard verifies its own files' checksums and leaves out, naming them at WARN, those
//!    that are corrupted or truncated; 0, the initial weights, when there is none) and the next generation (one more than any
//!    shard's);
//! 3. it orders every other shard to roll back to that version (`rollback = true`): each reads
//!    its own checkpoint of it, refuses from then on what its current state is asked (pushes,
//!    pulls: `UNAVAILABLE`, "rolled back"), and starts serving again from the checkpoint, at
//!    the new generation, on the same listener ([`crate::run_shard_recovering`]);
//! 4. it starts from its own checkpoint of the version, at the new generation, and listens.
//!
//! Workers see a connection error or a "rolled back" refusal, register again with every shard
//! until all answer with one generation newer than theirs, and continue from the shards'
//! version. Batches are a pure function of the step, so the steps redone are the steps done
//! before: the final weights equal those of a run without the loss, bit for bit. No step
//! relies on a launcher: the replacement learns everything from the other shards, at the
//! addresses of the config (or `--peers`).
//!
//! What stops the run instead, loudly: a replacement whose checkpoint directory is gone while
//! checkpoints are configured (it cannot know its weights), a checkpoint that cannot be read,
//! another shard that cannot be reached or refuses. The replacement then tells every shard it
//! can reach to fail with the reason (`abort`), and exits non-zero.

use crate::checkpoint::{self, Identity, Saved};
use crate::shard::Shard;
use ps_config::Config;
use ps_proto::pb::{RecoverReply, RecoverRequest};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A rollback a shard was ordered to make.
#[derive(Debug, Clone)]
pub struct Rollback {
    /// The shard that was lost.
    pub lost: usize,
    /// The version to start from again.
    pub version: u64,
    /// The generation the cluster enters.
    pub generation: u64,
    /// The state of that version (None: version 0, the initial weights).
    pub saved: Option<Saved>,
    /// The version this shard was at when ordered.
    pub from: u64,
    /// When the order came.
    pub ordered: Instant,
}

/// What a shard's service shares with its run loop about recovery: the generation it serves
/// and the rollback it was ordered to make, if any.
#[derive(Debug)]
pub struct Cell {
    cfg: Config,
    index: usize,
    generation: u64,
    ordered: Mutex<Option<Rollback>>,
    notify: tokio::sync::Notify,
}

impl Cell {
    /// The cell of shard `index` of `cfg`, serving `generation`.
    pub fn new(cfg: Config, index: usize, generation: u64) -> Self {
        Self {
            cfg,
            index,
            generation,
            ordered: Mutex::new(None),
            notify: tokio::sync::Notify::new(),
        }
    }

    /// The generation this shard serves.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The versions this shard holds intact checkpoints of (checksums verified: a file that
    /// is not intact is named at WARN and left out), up to `version` (ascending). Reads every
    /// file: call it off the async threads.
    pub fn checkpoints(&self, version: u64) -> Vec<u64> {
        let dir = self.cfg.checkpoint_dir();
        checkpoint::intact_versions(&dir, self.index, self.cfg.num_shards(), version)
    }

    /// Reads this shard's state at `version` (None for version 0: the initial weights).
    pub fn load(&self, version: u64) -> Result<Option<Saved>, checkpoint::CheckpointError> {
        load(&self.cfg, self.index, version)
    }

    /// Records the order (the first one of a generation counts), and wakes the run loop.
    pub fn order(&self, rollback: Rollback) {
        let mut o = self.ordered.lock().unwrap_or_else(|p| p.into_inner());
        if o.is_none() {
            *o = Some(rollback);
        }
        drop(o);
        self.notify.notify_waiters();
        self.notify.notify_one();
    }

    /// The rollback ordered, if any.
    pub fn ordered(&self) -> Option<Rollback> {
        self.ordered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Resolves once a rollback is ordered.
    pub async fn wait(&self) -> Rollback {
        loop {
            let n = self.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if let Some(r) = self.ordered() {
                return r;
            }
            n.await;
        }
    }
}

/// Shard `index`'s state at `version` from its checkpoint (None for version 0: the initial
/// weights, which the shard makes from the seed or the init file).
pub fn load(
    cfg: &Config,
    index: usize,
    version: u64,
) -> Result<Option<Saved>, checkpoint::CheckpointError> {
    if version == 0 {
        return Ok(None);
    }
    let range = Shard::range_of(cfg, index);
    let fresh = cfg.optimizer.init_state(range.len());
    let id = Identity::of(cfg, index, range);
    checkpoint::read(&cfg.checkpoint_dir(), &id, version, &fresh).map(Some)
}

/// The version every shard can roll back to: the newest in every list of checkpoint versions
/// (`mine` and each of `theirs`), 0 when no version is in all of them.
pub fn common_version(mine: &[u64], theirs: &[Vec<u64>]) -> u64 {
    mine.iter()
        .copied()
        .filter(|v| theirs.iter().all(|t| t.contains(v)))
        .max()
        .unwrap_or(0)
}

/// Where the cluster stands after [`handshake`]: the generation the replacement serves and the
/// state it starts from.
#[derive(Debug)]
pub struct Recovered {
    /// The new generation.
    pub generation: u64,
    /// The version rolled back to.
    pub version: u64,
    /// Its state (None: version 0).
    pub saved: Option<Saved>,
}

/// The replacement's side of a recovery (see the module): asks the other shards at `peers`
/// (every shard's address, this one's included, by index) where they are, orders them to roll
/// back to the newest version all have a checkpoint of, and returns that version's state. On
/// an error it tells every shard it can reach to stop the run with the reason (`abort`).
pub async fn handshake(
    cfg: &Config,
    index: usize,
    peers: &[String],
    shard_token: Option<&ps_net::auth::Token>,
) -> anyhow::Result<Recovered> {
    let started = Instant::now();
    let s = cfg.num_shards();
    if peers.len() != s {
        anyhow::bail!(
            "--recover: {} shard addresses given, expected {s} (one per shard of the config)",
            peers.len()
        );
    }
    tracing::warn!(
        "shard {index}: started with --recover: shard {index} was lost; asking the {} other shard(s) where the run is",
        s - 1
    );
    let patience = Duration::from_secs_f64(cfg.worker.connect_timeout_secs.max(1.0));
    let security = ps_net::auth::ClientSecurity::of(cfg);
    let mut clients = Vec::new();
    for (j, addr) in peers.iter().enumerate() {
        if j == index {
            continue;
        }
        let c = ps_net::client::ShardClient::connect(j, addr, &security, patience).await;
        match c {
            Ok(c) => clients.push((j, c)),
            Err(e) => {
                let why = format!(
                    "shard {index} was lost and cannot be recovered: shard {j} at {addr} cannot be reached ({e})"
                );
                abort(&mut clients, index, shard_token, &why).await;
                anyhow::bail!(why);
            }
        }
    }
    let result = negotiate(cfg, index, &mut clients, shard_token, started).await;
    if let Err(e) = &result {
        abort(&mut clients, index, shard_token, &format!("{e:#}")).await;
    }
    result
}

async fn negotiate(
    cfg: &Config,
    index: usize,
    clients: &mut [(usize, ps_net::client::ShardClient)],
    shard_token: Option<&ps_net::auth::Token>,
    started: Instant,
) -> anyhow::Result<Recovered> {
    let s = cfg.num_shards();
    let dir = cfg.checkpoint_dir();
    if cfg.checkpoint.every > 0 && !dir.is_dir() {
        anyhow::bail!(
            "shard {index} was lost and cannot be recovered: its checkpoint directory {} is gone ([checkpoint] every = {}), so the weights it held cannot be known; the run stops rather than train from wrong weights (restore the directory and start the cluster again with --resume)",
            dir.display(),
            cfg.checkpoint.every
        );
    }
    let mine = checkpoint::intact_versions(&dir, index, s, u64::MAX);
    let any_of_mine = !checkpoint::versions(&dir, index, s).is_empty();
    let mut states = Vec::new();
    for (j, c) in clients.iter_mut() {
        let req = RecoverRequest {
            lost: index as u32,
            rollback: false,
            ..Default::default()
        };
        let r = call(c, req, shard_token)
            .await
            .map_err(|e| anyhow::anyhow!("shard {j} did not say where it is: {e}"))?;
        states.push((*j, r));
    }
    let theirs: Vec<Vec<u64>> = states.iter().map(|(_, r)| r.checkpoints.clone()).collect();
    let version = common_version(&mine, &theirs);
    let generation = states.iter().map(|(_, r)| r.generation).max().unwrap_or(0) + 1;
    let furthest = states.iter().map(|(_, r)| r.version).max().unwrap_or(0);
    // the directory removed and then refilled by the other shards' next checkpoints looks
    // like a directory: but this shard, at most a step from the others, would hold a
    // checkpoint of its own once they are past the first one plus a step
    let every = cfg.checkpoint.every;
    if every > 0 && !any_of_mine && furthest >= every + 2 {
        anyhow::bail!(
            "shard {index} was lost and cannot be recovered: its checkpoint directory {} is gone or was emptied (none of this shard's checkpoints is there, yet the others are at version {furthest}, past the first checkpoint at version {every}), so the weights it held cannot be known; the run stops rather than train from wrong weights (restore the directory and start the cluster again with --resume)",
            dir.display()
        );
    }
    if version == 0 && (!mine.is_empty() || theirs.iter().any(|t| !t.is_empty())) {
        tracing::warn!(
            "shard {index}: no version that every shard has an intact checkpoint of (this shard: {mine:?}; the others: {}): the run restarts from version 0, the initial weights",
            describe(&states)
        );
    }
    let saved = load(cfg, index, version).map_err(|e| {
        anyhow::anyhow!(
            "shard {index} was lost and cannot be recovered: its checkpoint of version {version} cannot be read: {e}"
        )
    })?;
    for (j, c) in clients.iter_mut() {
        let req = RecoverRequest {
            lost: index as u32,
            rollback: true,
            version,
            generation,
            abort: String::new(),
        };
        call(c, req, shard_token).await.map_err(|e| {
            anyhow::anyhow!("shard {j} could not roll back to version {version}: {e}")
        })?;
    }
    tracing::warn!(
        "shard {index}: recovery: shard {index} was lost; every shard rolls back to version {version} (generation {generation}); the others were at {}: steps {version}..{furthest} are redone; agreed in {:.2} s",
        describe(&states),
        started.elapsed().as_secs_f64()
    );
    Ok(Recovered {
        generation,
        version,
        saved,
    })
}

fn describe(states: &[(usize, RecoverReply)]) -> String {
    states
        .iter()
        .map(|(j, r)| {
            format!(
                "shard {j} at version {} (checkpoints {:?})",
                r.version, r.checkpoints
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

async fn call(
    c: &mut ps_net::client::ShardClient,
    req: RecoverRequest,
    shard_token: Option<&ps_net::auth::Token>,
) -> Result<RecoverReply, Refused> {
    let mut request = tonic::Request::new(req);
    request.set_timeout(Duration::from_secs(60));
    if let Some(t) = shard_token {
        request.metadata_mut().insert(
            ps_net::auth::SHARD_TOKEN_KEY,
            ps_net::auth::metadata_value(t),
        );
    }
    c.rpc()
        .recover(request)
        .await
        .map(|r| r.into_inner())
        .map_err(Refused)
}

/// A `Recover` call another shard refused or did not answer: its gRPC status.
#[derive(Debug, thiserror::Error)]
#[error("{:?}: {}", .0.code(), .0.message())]
struct Refused(tonic::Status);

/// Tells every shard in `clients` to stop the run with `why` (best effort: it is stopping).
async fn abort(
    clients: &mut [(usize, ps_net::client::ShardClient)],
    index: usize,
    shard_token: Option<&ps_net::auth::Token>,
    why: &str,
) {
    tracing::error!("shard {index}: {why}");
    for (j, c) in clients.iter_mut() {
        let req = RecoverRequest {
            lost: index as u32,
            abort: why.to_string(),
            ..Default::default()
        };
        if let Err(e) = call(c, req, shard_token).await {
            tracing::warn!("shard {index}: could not tell shard {j} to stop: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_common_version_is_the_newest_every_shard_has() {
        assert_eq!(common_version(&[5, 10], &[vec![5, 10], vec![10, 15]]), 10);
        assert_eq!(common_version(&[5, 10], &[vec![5, 10, 15], vec![5]]), 5);
        // the lost shard had not written 15 yet
        assert_eq!(common_version(&[10], &[vec![10, 15]]), 10);
        // before the first checkpoint: the initial weights
        assert_eq!(common_version(&[], &[vec![], vec![]]), 0);
        assert_eq!(common_version(&[5], &[vec![10]]), 0);
        // one shard alone
        assert_eq!(common_version(&[20, 25], &[]), 25);
    }
}
