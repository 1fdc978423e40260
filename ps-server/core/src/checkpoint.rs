//! Checkpoints: every `[checkpoint] every` steps each shard writes its parameters and its
//! optimizer state to `shard-<i>-of-<S>-v<version>.safetensors` in the checkpoint directory
//! (atomically: a temporary file, then a rename), and deletes its older ones beyond `keep`
//! that a resume can no longer need (never one unless every shard has a newer version: see
//! [`write`]). A failed write is retried once; `[checkpoint] max_failures` consecutive failed
//! checkpoints fail the run.
//! A resumed cluster (`ps-server --resume`, `ps-launch --resume`) starts every shard from the
//! newest version that all S shards have a checkpoint of, so the shards agree on the step
//! (with a directory every shard sees); workers then start at that step, and the data order,
//! a pure function of the step, makes the resumed run continue exactly where it stopped.
//!
//! Every file carries a checksum ([`checksum`]: CRC-32C over its metadata and its values,
//! in the metadata key `checksum`). Reading verifies it: a resume ([`latest_intact_common`]) and
//! a recovery ([`intact_versions`]) skip a corrupted or truncated file, saying which (WARN,
//! naming the file and the version), and fall back to the newest version every shard holds
//! intact. A file written before checksums existed (no `checksum` key) is accepted with a
//! warning that it could not be verified.
//!
//! Shard 0 of a declared model with buffers also keeps the buffers of the version, in the
//! metadata ([`BUFFERS_KEY`], hex of their safetensors serialization), which the checksum
//! covers with the rest of the metadata.

use ps_config::Config;
use ps_model::weights::{NamedTensor, read_safetensors, write_safetensors};
use ps_optim::OptState;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// Why a checkpoint is not written, or not read (each names the file, or the version).
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file cannot be read or written, or does not parse (truncated, say).
    #[error(transparent)]
    File(#[from] ps_model::weights::WeightsError),
    /// The file parses but its contents do not give the checksum it carries.
    #[error(
        "{path}: checksum mismatch: the file says {want}, its contents give {got}: the file is corrupted"
    )]
    Corrupted {
        /// The file.
        path: String,
        /// The checksum the file carries.
        want: String,
        /// The checksum of its contents.
        got: String,
    },
    /// The file is intact but not this shard's state: another run, model, shard layout or
    /// optimizer, or metadata or a tensor that is not what is expected (`why` says which).
    #[error("{path}: {why}")]
    Refused {
        /// The file.
        path: String,
        /// What did not match, and what was expected.
        why: String,
    },
    /// The skipped steps could not be encoded.
    #[error(transparent)]
    Encode(#[from] serde_json::Error),
    /// The shard's state at the version could not be had.
    #[error(transparent)]
    State(#[from] ps_proto::PsError),
    /// The version's parameters left the shard's buffer while they were copied.
    #[error("version {version} left the buffer during the copy")]
    LeftBuffer {
        /// The version.
        version: u64,
    },
}

/// When and where a shard writes checkpoints (`[checkpoint] every` > 0), and how many
/// consecutive failed ones it has seen.
#[derive(Debug)]
pub struct Plan {
    every: u64,
    keep: usize,
    max_failures: u32,
    dir: PathBuf,
    id: Identity,
    /// Checkpoints failed (after their retry) since the last one written.
    consecutive_failures: AtomicU32,
}

/// What became of one due checkpoint ([`Plan::write_retrying`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempted {
    /// Written (at the first or the second attempt).
    pub written: bool,
    /// Attempts that failed (0, 1 or 2).
    pub failed_attempts: u32,
    /// Set when this failure makes `[checkpoint] max_failures` consecutive failed checkpoints:
    /// the run must fail, saying this.
    pub fatal: Option<String>,
}

impl Plan {
    /// The plan of shard `index` of `cfg` (its range of the flat vector), or None when the
    /// config writes no checkpoints.
    pub fn of(cfg: &Config, index: usize, range: Range<usize>) -> Option<Self> {
        (cfg.checkpoint.every > 0).then(|| Self {
            every: cfg.checkpoint.every,
            keep: cfg.checkpoint.keep,
            max_failures: cfg.checkpoint.max_failures,
            dir: cfg.checkpoint_dir(),
            id: Identity::of(cfg, index, range),
            consecutive_failures: AtomicU32::new(0),
        })
    }

    /// The plan of a preemption checkpoint (SIGTERM, SIGUSR1): written whatever `[checkpoint]
    /// every` says, into the same directory, keeping at least the two newest (a shard writes
    /// the version it is at and the next one, see `Shard::request_preempt`).
    pub fn for_preemption(cfg: &Config, index: usize, range: Range<usize>) -> Self {
        Self {
            every: 0,
            keep: cfg.checkpoint.keep.max(2),
            max_failures: cfg.checkpoint.max_failures,
            dir: cfg.checkpoint_dir(),
            id: Identity::of(cfg, index, range),
            consecutive_failures: AtomicU32::new(0),
        }
    }

    /// Writes `saved` and prunes older checkpoints, retrying once as
    /// [`Plan::write_retrying`] does; true when written (a failure is logged).
    pub fn write_checked(&self, version: u64, saved: Result<Saved, CheckpointError>) -> bool {
        self.write_retrying(version, saved).written
    }

    /// True when `version` is one to checkpoint.
    pub fn due(&self, version: u64) -> bool {
        self.every > 0 && version > 0 && version.is_multiple_of(self.every)
    }

    /// Writes `saved` and prunes older checkpoints, retrying a failed write once (a failed
    /// attempt leaves no temporary file); logs the outcome. After `max_failures` consecutive
    /// failed checkpoints the outcome says the run must fail.
    pub fn write_retrying(&self, version: u64, saved: Result<Saved, CheckpointError>) -> Attempted {
        let started = std::time::Instant::now();
        let shard = self.id.shard;
        let saved = match saved {
            Ok(s) => s,
            Err(e) => return self.failed(version, 0, e),
        };
        let mut failed_attempts = 0;
        let mut last_error = None;
        for attempt in 1..=2 {
            match write(&self.dir, &self.id, &saved, self.keep) {
                Ok(path) => {
                    self.consecutive_failures.store(0, Ordering::Relaxed);
                    tracing::info!(
                        "shard {shard}: checkpoint of version {version} written to {} in {:.0} ms{}",
                        path.display(),
                        started.elapsed().as_secs_f64() * 1e3,
                        if attempt > 1 { " (second attempt)" } else { "" }
                    );
                    return Attempted {
                        written: true,
                        failed_attempts,
                        fatal: None,
                    };
                }
                Err(e) => {
                    failed_attempts += 1;
                    if attempt == 1 {
                        tracing::warn!(
                            "shard {shard}: checkpoint of version {version}: {e}; retrying once"
                        );
                    }
                    last_error = Some(e);
                }
            }
        }
        let e = last_error.map_or_else(String::new, |e| e.to_string());
        self.failed(version, failed_attempts, e)
    }

    fn failed(&self, version: u64, failed_attempts: u32, e: impl std::fmt::Display) -> Attempted {
        let shard = self.id.shard;
        let n = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::error!(
            "shard {shard}: checkpoint of version {version} not written: {e} ({n} consecutive failed checkpoint(s); the run fails at {})",
            self.max_failures
        );
        let fatal = (n >= self.max_failures).then(|| {
            format!(
                "{n} consecutive checkpoints failed (the last, of version {version}: {e}); [checkpoint] max_failures = {}",
                self.max_failures
            )
        });
        Attempted {
            written: false,
            failed_attempts,
            fatal,
        }
    }
}

/// Metadata key of the file's [`checksum`].
const CHECKSUM_KEY: &str = "checksum";

/// The checksum of a checkpoint, as written in its metadata: `crc32c:` and 8 hex digits, the
/// CRC-32C (Castagnoli) of its metadata (every key but `checksum`, in key order) and then its
/// tensors (in name order), each string and each tensor's values preceded by its length as a
/// little-endian u64, values as little-endian f32 bytes. It covers everything a reader uses:
/// a changed value, a truncated file or an edited header each give another checksum (or a
/// file that does not parse).
pub fn checksum(meta: &BTreeMap<String, String>, tensors: &[(&str, &[f32])]) -> String {
    fn field(crc: u32, bytes: &[u8]) -> u32 {
        let crc = crc32c::crc32c_append(crc, &(bytes.len() as u64).to_le_bytes());
        crc32c::crc32c_append(crc, bytes)
    }
    let mut crc = 0;
    for (k, v) in meta.iter().filter(|(k, _)| *k != CHECKSUM_KEY) {
        crc = field(crc, k.as_bytes());
        crc = field(crc, v.as_bytes());
    }
    let mut sorted = tensors.to_vec();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut buf = Vec::with_capacity(64 * 1024);
    for (name, values) in sorted {
        crc = field(crc, name.as_bytes());
        crc = crc32c::crc32c_append(crc, &(values.len() as u64).to_le_bytes());
        for chunk in values.chunks(16 * 1024) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            crc = crc32c::crc32c_append(crc, &buf);
        }
    }
    format!("crc32c:{crc:08x}")
}

/// Checks the [`checksum`] of a file's `tensors` and `meta` against the one it carries; the
/// error says what differs. A file without one (written before checksums) passes, with a
/// warning naming it.
fn verify(
    path: &Path,
    tensors: &[NamedTensor],
    meta: &BTreeMap<String, String>,
) -> Result<(), CheckpointError> {
    let Some(want) = meta.get(CHECKSUM_KEY) else {
        tracing::warn!(
            "{}: no checksum (a checkpoint written before checkpoints carried one): its values cannot be verified; accepted as it is",
            path.display()
        );
        return Ok(());
    };
    let views: Vec<(&str, &[f32])> = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.data.as_slice()))
        .collect();
    let got = checksum(meta, &views);
    if &got != want {
        return Err(CheckpointError::Corrupted {
            path: path.display().to_string(),
            want: want.clone(),
            got,
        });
    }
    Ok(())
}

/// Reads the file of shard `shard` of `num_shards` at `version` and verifies its checksum
/// (not its identity: see [`read`]); the error names the file and what is wrong (it does not
/// parse: truncated, say; or its checksum does not match).
pub fn check_intact(
    dir: &Path,
    shard: usize,
    num_shards: usize,
    version: u64,
) -> Result<(), CheckpointError> {
    let path = file(dir, shard, num_shards, version);
    let (tensors, meta) = read_safetensors(&path)?;
    verify(&path, &tensors, &meta)
}

/// The versions of shard `shard`'s checkpoints in `dir` up to `upto`, ascending, that are
/// intact ([`check_intact`]); each one skipped is named in a WARN.
pub fn intact_versions(dir: &Path, shard: usize, num_shards: usize, upto: u64) -> Vec<u64> {
    versions(dir, shard, num_shards)
        .into_iter()
        .filter(|&v| v <= upto)
        .filter(|&v| match check_intact(dir, shard, num_shards, v) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    "shard {shard}: skipping its checkpoint of version {v}, which is not intact: {e}"
                );
                false
            }
        })
        .collect()
}

/// The newest version of which every one of `num_shards` shards has an intact checkpoint in
/// `dir` (each shard's file of it verified, newest version first), or None; and one line per
/// version skipped for a file that is not intact, naming the file (also logged at WARN).
pub fn latest_intact_common(dir: &Path, num_shards: usize) -> (Option<u64>, Vec<String>) {
    let mut skipped = Vec::new();
    for v in common_versions(dir, num_shards).into_iter().rev() {
        let broken: Vec<String> = (0..num_shards)
            .filter_map(|s| check_intact(dir, s, num_shards, v).err())
            .map(|e| e.to_string())
            .collect();
        if broken.is_empty() {
            return (Some(v), skipped);
        }
        let line = format!("version {v} skipped: {}", broken.join("; "));
        tracing::warn!("{line}");
        skipped.push(line);
    }
    (None, skipped)
}

/// Metadata key of each tensor's skipped steps ([`OptState::skipped`]), when any.
const SKIPPED_KEY: &str = "tensor_skipped_steps";

/// Metadata key of the model's buffers at the version (shard 0 of a model with buffers): the
/// hex digits of their safetensors serialization.
pub const BUFFERS_KEY: &str = "buffers_safetensors_hex";

/// A shard's state at a version, as written to and read from a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    /// Steps applied.
    pub version: u64,
    /// The shard's parameters.
    pub params: Vec<f32>,
    /// The optimizer's state.
    pub opt: OptState,
    /// The model's buffers at the version (shard 0 of a declared model with buffers; a
    /// safetensors serialization), else None.
    pub buffers: Option<bytes::Bytes>,
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// What identifies a shard's place in a run: a checkpoint of another shard layout or model is
/// refused.
#[derive(Debug, Clone)]
pub struct Identity {
    /// Shard index.
    pub shard: usize,
    /// S.
    pub num_shards: usize,
    /// The shard's range of the flat vector.
    pub range: Range<usize>,
    /// The model's parameter count.
    pub num_params: usize,
    /// The optimizer, described (state layout and meaning).
    pub optimizer: String,
    /// The run the checkpoint belongs to (`ps_config::runid`; None: the unnamed run). Reading
    /// refuses a checkpoint of another run, naming both.
    pub run_id: Option<String>,
}

impl Identity {
    /// The identity of shard `index` of `cfg`.
    pub fn of(cfg: &Config, index: usize, range: Range<usize>) -> Self {
        Self {
            shard: index,
            num_shards: cfg.num_shards(),
            range,
            num_params: cfg.spec().num_params(),
            optimizer: cfg.describe_optimizer(),
            run_id: cfg.cluster.run_id.clone(),
        }
    }

    fn metadata(&self, version: u64, opt_steps: u64) -> BTreeMap<String, String> {
        [
            ("shard", self.shard.to_string()),
            ("num_shards", self.num_shards.to_string()),
            ("start", self.range.start.to_string()),
            ("end", self.range.end.to_string()),
            ("num_params", self.num_params.to_string()),
            ("optimizer", self.optimizer.clone()),
            ("version", version.to_string()),
            ("opt_steps", opt_steps.to_string()),
            ("run_id", self.run_id.clone().unwrap_or_default()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

/// The file of shard `shard` of `num_shards` at `version`.
pub fn file(dir: &Path, shard: usize, num_shards: usize, version: u64) -> PathBuf {
    dir.join(format!(
        "shard-{shard}-of-{num_shards}-v{version:08}.safetensors"
    ))
}

/// `(shard, num_shards, version)` of a checkpoint file name.
fn parse(name: &str) -> Option<(usize, usize, u64)> {
    let rest = name.strip_prefix("shard-")?.strip_suffix(".safetensors")?;
    let (shard, rest) = rest.split_once("-of-")?;
    let (num_shards, version) = rest.split_once("-v")?;
    Some((
        shard.parse().ok()?,
        num_shards.parse().ok()?,
        version.parse().ok()?,
    ))
}

/// The versions of shard `shard`'s checkpoints in `dir`, ascending.
pub fn versions(dir: &Path, shard: usize, num_shards: usize) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| parse(e.ok()?.file_name().to_str()?))
        .filter(|&(s, n, _)| s == shard && n == num_shards)
        .map(|(_, _, v)| v)
        .collect();
    v.sort_unstable();
    v
}

/// How many of the newest versions that every shard has are never deleted: a resume needs the
/// newest; a shard that restarts while the others write the next one can still find the one
/// before.
pub const COMMON_KEPT: usize = 2;

/// Writes `saved` for the shard `id`, then deletes those of its checkpoints that a resume can
/// no longer need: the ones older than the `keep` newest, and older than the newest version
/// every shard has, and not among the [`COMMON_KEPT`] newest such versions. A shard never
/// deletes a checkpoint unless every shard has a newer one, so the directory always holds a
/// version common to all shards once it has held one. Returns the file.
pub fn write(
    dir: &Path,
    id: &Identity,
    saved: &Saved,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    let path = file(dir, id.shard, id.num_shards, saved.version);
    let shapes = [
        [saved.params.len()],
        [saved.opt.m.len()],
        [saved.opt.v.len()],
    ];
    let (p_shape, m_shape, v_shape) = (shapes[0], shapes[1], shapes[2]);
    let mut tensors: Vec<(&str, &[usize], &[f32])> = vec![("flat", &p_shape, &saved.params)];
    if !saved.opt.m.is_empty() {
        tensors.push(("opt.m", &m_shape, &saved.opt.m));
    }
    if !saved.opt.v.is_empty() {
        tensors.push(("opt.v", &v_shape, &saved.opt.v));
    }
    let mut meta = id.metadata(saved.version, saved.opt.steps);
    if !saved.opt.skipped.is_empty() {
        let skipped = serde_json::to_string(&saved.opt.skipped)?;
        meta.insert(SKIPPED_KEY.to_string(), skipped);
    }
    if let Some(b) = &saved.buffers {
        meta.insert(BUFFERS_KEY.to_string(), to_hex(b));
    }
    let views: Vec<(&str, &[f32])> = tensors.iter().map(|(n, _, d)| (*n, *d)).collect();
    meta.insert(CHECKSUM_KEY.to_string(), checksum(&meta, &views));
    write_safetensors(&path, &tensors, &meta)?;
    for old in prunable(dir, id.shard, id.num_shards, keep) {
        let _ = std::fs::remove_file(file(dir, id.shard, id.num_shards, old));
    }
    Ok(path)
}

/// The versions of shard `shard`'s checkpoints that may be deleted (see [`write`]).
fn prunable(dir: &Path, shard: usize, num_shards: usize, keep: usize) -> Vec<u64> {
    let mine = versions(dir, shard, num_shards);
    let common = common_versions(dir, num_shards);
    let Some(&newest_common) = common.last() else {
        return Vec::new();
    };
    let protected_common = &common[common.len().saturating_sub(COMMON_KEPT)..];
    let newest_mine = &mine[mine.len().saturating_sub(keep)..];
    mine.iter()
        .copied()
        .filter(|v| *v < newest_common && !protected_common.contains(v) && !newest_mine.contains(v))
        .collect()
}

/// The versions of which every one of `num_shards` shards has a checkpoint in `dir`, ascending.
fn common_versions(dir: &Path, num_shards: usize) -> Vec<u64> {
    let mut common = versions(dir, 0, num_shards);
    for s in 1..num_shards {
        let theirs = versions(dir, s, num_shards);
        common.retain(|v| theirs.contains(v));
    }
    common
}

/// The newest version of which every one of `num_shards` shards has a checkpoint in `dir`.
pub fn latest_common(dir: &Path, num_shards: usize) -> Option<u64> {
    common_versions(dir, num_shards).last().copied()
}

/// Which versions each of `num_shards` shards has in `dir`, for a resume error:
/// `shard 0: v15; shard 1: v10, v20` (`none` for a shard without any).
pub fn describe_versions(dir: &Path, num_shards: usize) -> String {
    (0..num_shards)
        .map(|s| {
            let v = versions(dir, s, num_shards);
            let list = if v.is_empty() {
                "none".to_string()
            } else {
                v.iter()
                    .map(|v| format!("v{v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            format!("shard {s}: {list}")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// True when `dir` holds any checkpoint file, of any shard count.
pub fn any_checkpoint(dir: &Path) -> bool {
    std::fs::read_dir(dir).into_iter().flatten().any(|e| {
        e.ok()
            .is_some_and(|e| e.file_name().to_str().and_then(parse).is_some())
    })
}

/// Reads shard `id`'s checkpoint at `version`, checking it against `id` and the optimizer
/// state layout `fresh` (what the config's optimizer keeps); the error names the file and what
/// did not match.
pub fn read(
    dir: &Path,
    id: &Identity,
    version: u64,
    fresh: &OptState,
) -> Result<Saved, CheckpointError> {
    let path = file(dir, id.shard, id.num_shards, version);
    let (tensors, meta) = read_safetensors(&path)?;
    verify(&path, &tensors, &meta)?;
    let bad = |why: String| CheckpointError::Refused {
        path: path.display().to_string(),
        why,
    };
    let expected = id.metadata(version, 0);
    // another run's checkpoint (files without a run id are the unnamed run's)
    let theirs = meta.get("run_id").filter(|s| !s.is_empty());
    if theirs != id.run_id.as_ref() {
        return Err(bad(format!(
            "a checkpoint of {}, but this is {}: --resume continues only its own run's checkpoints; to start from this one, pass --resume-from {}",
            ps_config::runid::show(theirs.map(String::as_str)),
            ps_config::runid::show(id.run_id.as_deref()),
            theirs.map_or("\"\"", String::as_str)
        )));
    }
    for (k, want) in &expected {
        if k == "opt_steps" || k == "run_id" {
            continue;
        }
        let got = meta.get(k).map(String::as_str).unwrap_or("(missing)");
        if got != want {
            return Err(bad(format!(
                "metadata {k} = {got:?}: expected {want:?} (a checkpoint of another model, shard layout or optimizer)"
            )));
        }
    }
    let opt_steps = meta
        .get("opt_steps")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("metadata opt_steps missing".into()))?;
    let take = |name: &str, len: usize| -> Result<Vec<f32>, CheckpointError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let t = tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| bad(format!("no tensor {name}")))?;
        if t.data.len() != len {
            return Err(bad(format!(
                "tensor {name} holds {} values: expected {len}",
                t.data.len()
            )));
        }
        if let Some(i) = t.data.iter().position(|v| !v.is_finite()) {
            return Err(bad(format!("tensor {name}: non-finite value at index {i}")));
        }
        Ok(t.data.clone())
    };
    let params = take("flat", id.range.len())?;
    let m = take("opt.m", fresh.m.len())?;
    let v = take("opt.v", fresh.v.len())?;
    let skipped: Vec<u64> = match meta.get(SKIPPED_KEY) {
        None => Vec::new(),
        Some(s) => serde_json::from_str(s)
            .ok()
            .filter(|k: &Vec<u64>| k.iter().all(|&n| n <= opt_steps))
            .ok_or_else(|| {
                bad(format!(
                    "metadata {SKIPPED_KEY} = {s:?}: expected a JSON list of step counts of at most opt_steps"
                ))
            })?,
    };
    let buffers = match meta.get(BUFFERS_KEY) {
        None => None,
        Some(h) => Some(bytes::Bytes::from(from_hex(h).ok_or_else(|| {
            bad(format!("metadata {BUFFERS_KEY}: not hex digits"))
        })?)),
    };
    Ok(Saved {
        version,
        params,
        opt: OptState {
            steps: opt_steps,
            m,
            v,
            skipped,
        },
        buffers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(shard: usize) -> Identity {
        Identity {
            shard,
            num_shards: 2,
            range: shard * 5..shard * 5 + 5,
            num_params: 10,
            optimizer: "sgd(momentum 0.9)".into(),
            run_id: Some("r1".into()),
        }
    }

    #[test]
    fn write_read_prune_and_agree_on_the_common_version() {
        let dir = tempfile::tempdir().unwrap();
        let saved = |version: u64| Saved {
            version,
            params: vec![version as f32; 5],
            opt: OptState {
                steps: version,
                m: vec![0.5; 5],
                v: Vec::new(),
                skipped: vec![0, version / 5],
            },
            buffers: version
                .is_multiple_of(2)
                .then(|| bytes::Bytes::from(vec![0u8, 7, 255, version as u8])),
        };
        let fresh = OptState {
            steps: 0,
            m: vec![0.0; 5],
            v: Vec::new(),
            skipped: Vec::new(),
        };
        // shard 1 first: a shard prunes only below a version every shard has
        write(dir.path(), &id(1), &saved(20), 2).unwrap();
        for v in [10, 20, 30] {
            write(dir.path(), &id(0), &saved(v), 2).unwrap();
        }
        assert_eq!(versions(dir.path(), 0, 2), vec![20, 30], "keep 2");
        assert_eq!(latest_common(dir.path(), 2), Some(20), "shard 1 has no 30");
        assert_eq!(latest_common(dir.path(), 3), None, "another shard count");
        assert_eq!(read(dir.path(), &id(0), 20, &fresh).unwrap(), saved(20));
        // another optimizer or layout is refused, naming what differs
        let other = Identity {
            optimizer: "adam".into(),
            ..id(0)
        };
        let e = read(dir.path(), &other, 20, &fresh)
            .unwrap_err()
            .to_string();
        assert!(e.contains("metadata optimizer"), "{e}");
        // another run's checkpoint is refused, naming both runs and the way out
        let other_run = Identity {
            run_id: Some("r2".into()),
            ..id(0)
        };
        let e = read(dir.path(), &other_run, 20, &fresh)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a checkpoint of run r1, but this is run r2")
                && e.contains("--resume-from r1"),
            "{e}"
        );
        let e = read(
            dir.path(),
            &id(0),
            20,
            &OptState {
                steps: 0,
                m: vec![0.0; 5],
                v: vec![0.0; 5],
                skipped: Vec::new(),
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("no tensor opt.v"), "{e}");
        assert!(read(dir.path(), &id(0), 10, &fresh).is_err(), "pruned");
        assert_eq!(
            parse("shard-3-of-4-v00000120.safetensors"),
            Some((3, 4, 120))
        );
        assert_eq!(parse("shard-3.safetensors"), None);
    }

    /// `keep = 1` and a shard that stops writing (it died between the two shards'
    /// checkpoints): the other keeps the version they have in common, and the one before it,
    /// however many newer ones it writes; once the late shard catches up, the old ones go.
    #[test]
    fn a_shard_never_prunes_the_last_common_versions() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let saved = |version: u64| Saved {
            version,
            params: vec![1.0; 5],
            opt: OptState {
                steps: version,
                m: Vec::new(),
                v: Vec::new(),
                skipped: Vec::new(),
            },
            buffers: None,
        };
        for v in [5, 10] {
            write(d, &id(0), &saved(v), 1).unwrap();
            write(d, &id(1), &saved(v), 1).unwrap();
        }
        assert_eq!(versions(d, 1, 2), vec![5, 10]);
        // shard 1 is gone; shard 0 goes on
        for v in [15, 20, 25] {
            write(d, &id(0), &saved(v), 1).unwrap();
        }
        assert_eq!(versions(d, 0, 2), vec![5, 10, 15, 20, 25]);
        assert_eq!(latest_common(d, 2), Some(10));
        assert_eq!(
            describe_versions(d, 2),
            "shard 0: v5, v10, v15, v20, v25; shard 1: v5, v10"
        );
        // shard 1 resumed at 10 and writes 15, 20, then 25: the versions below the two newest
        // common ones go, on both sides
        for v in [15, 20, 25] {
            write(d, &id(1), &saved(v), 1).unwrap();
        }
        assert_eq!(versions(d, 1, 2), vec![20, 25]);
        write(d, &id(0), &saved(30), 1).unwrap();
        assert_eq!(versions(d, 0, 2), vec![20, 25, 30]);
        assert_eq!(latest_common(d, 2), Some(25));
        let empty = tempfile::tempdir().unwrap();
        assert!(any_checkpoint(d) && !any_checkpoint(empty.path()));
        assert_eq!(
            describe_versions(empty.path(), 2),
            "shard 0: none; shard 1: none"
        );
    }

    /// The checksum: a changed value, a changed header and a truncated file are caught by
    /// name; the newest intact common version skips them; a file without a checksum (the
    /// format before it) is read.
    #[test]
    fn corrupted_and_truncated_checkpoints_are_caught_and_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let saved = |version: u64| Saved {
            version,
            params: vec![version as f32; 5],
            opt: OptState {
                steps: version,
                m: vec![0.25; 5],
                v: Vec::new(),
                skipped: Vec::new(),
            },
            buffers: None,
        };
        let fresh = OptState {
            steps: 0,
            m: vec![0.0; 5],
            v: Vec::new(),
            skipped: Vec::new(),
        };
        for v in [5, 10] {
            for s in 0..2 {
                write(d, &id(s), &saved(v), 2).unwrap();
            }
        }
        assert_eq!(latest_intact_common(d, 2), (Some(10), vec![]));
        // one value of shard 1's newest file changed (the last 4 bytes: opt.m's last value)
        let f = file(d, 1, 2, 10);
        let mut bytes = std::fs::read(&f).unwrap();
        let n = bytes.len();
        bytes[n - 4..].copy_from_slice(&0.75f32.to_le_bytes());
        std::fs::write(&f, &bytes).unwrap();
        let e = check_intact(d, 1, 2, 10).unwrap_err().to_string();
        assert!(
            e.contains("shard-1-of-2-v00000010.safetensors: checksum mismatch"),
            "{e}"
        );
        let e = read(d, &id(1), 10, &fresh).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
        assert_eq!(intact_versions(d, 1, 2, u64::MAX), vec![5]);
        assert_eq!(intact_versions(d, 0, 2, 7), vec![5], "up to 7");
        let (v, skipped) = latest_intact_common(d, 2);
        assert_eq!(v, Some(5));
        assert!(
            skipped.len() == 1
                && skipped[0].starts_with("version 10 skipped: ")
                && skipped[0].contains("shard-1-of-2-v00000010"),
            "{skipped:?}"
        );
        // truncated: it does not parse
        let f = file(d, 0, 2, 5);
        let bytes = std::fs::read(&f).unwrap();
        std::fs::write(&f, &bytes[..bytes.len() - 3]).unwrap();
        let e = check_intact(d, 0, 2, 5).unwrap_err().to_string();
        assert!(e.contains("shard-0-of-2-v00000005.safetensors"), "{e}");
        let (v, skipped) = latest_intact_common(d, 2);
        assert_eq!((v, skipped.len()), (None, 2), "{skipped:?}");
        // a header value edited (the version, keeping the length): caught too
        let f = file(d, 0, 2, 10);
        let text = std::fs::read(&f).unwrap();
        let (from, to) = (b"\"opt_steps\":\"10\"", b"\"opt_steps\":\"11\"");
        let at = text
            .windows(from.len())
            .position(|w| w == from)
            .expect("the version in the header");
        let mut edited = text.clone();
        edited[at..at + to.len()].copy_from_slice(to);
        std::fs::write(&f, &edited).unwrap();
        let e = check_intact(d, 0, 2, 10).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
        // the format before checksums: read as it is (with a warning)
        let old = tempfile::tempdir().unwrap();
        let path = file(old.path(), 0, 2, 5);
        let mut meta = id(0).metadata(5, 5);
        meta.remove(CHECKSUM_KEY);
        let s = saved(5);
        write_safetensors(
            &path,
            &[("flat", &[5], &s.params), ("opt.m", &[5], &s.opt.m)],
            &meta,
        )
        .unwrap();
        assert_eq!(read(old.path(), &id(0), 5, &fresh).unwrap(), s);
    }

    /// A write that fails leaves no temporary file, is retried once, and the run is told to
    /// fail after `max_failures` consecutive failed checkpoints; a written one resets the count.
    #[test]
    fn failed_writes_are_retried_counted_and_fatal_after_max_failures() {
        let dir = tempfile::tempdir().unwrap();
        // the checkpoint "directory" is a file: every write fails
        let blocked = dir.path().join("blocked");
        std::fs::write(&blocked, b"not a directory").unwrap();
        let plan = Plan {
            every: 1,
            keep: 2,
            max_failures: 2,
            dir: blocked.clone(),
            id: id(0),
            consecutive_failures: AtomicU32::new(0),
        };
        let saved = |version: u64| {
            Ok(Saved {
                version,
                params: vec![1.0; 5],
                opt: OptState::default(),
                buffers: None,
            })
        };
        let a = plan.write_retrying(1, saved(1));
        assert_eq!(
            (a.written, a.failed_attempts, a.fatal.is_none()),
            (false, 2, true)
        );
        let a = plan.write_retrying(2, saved(2));
        let fatal = a.fatal.expect("second consecutive failure is fatal");
        assert!(
            fatal.contains("2 consecutive checkpoints failed") && fatal.contains("version 2"),
            "{fatal}"
        );
        // a directory that works again: written, count reset
        let ok = Plan {
            dir: dir.path().join("ckpt"),
            ..plan
        };
        assert!(ok.write_retrying(3, saved(3)).written);
        assert_eq!(ok.consecutive_failures.load(Ordering::Relaxed), 0);
        // a write into a full or read-only place leaves no .tmp behind
        let ro = dir.path().join("ro");
        std::fs::create_dir(&ro).unwrap();
        let f = file(&ro, 0, 2, 4);
        std::fs::create_dir(&f).unwrap(); // the rename onto a directory fails after the write
        assert!(write(&ro, &id(0), &saved(4).unwrap(), 2).is_err());
        let names: Vec<String> = std::fs::read_dir(&ro)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            vec![f.file_name().unwrap().to_string_lossy().into_owned()]
        );
    }
}
