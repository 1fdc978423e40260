//! Checkpoints: every `[checkpoint] every` steps each shard writes its parameters and its
//! optimizer state to `shard-<i>-of-<S>-v<version>.safetensors` in the checkpoint directory
//! (atomically: a temporary file, then a rename), and deletes its older ones beyond `keep`.
//! A resumed cluster (`ps-server --resume`, `ps-launch --resume`) starts every shard from the
//! newest version that all S shards have a checkpoint of, so the shards agree on the step
//! (with a directory every shard sees); workers then start at that step, and the data order,
//! a pure function of the step, makes the resumed run continue exactly where it stopped.

use ps_common::config::Config;
use ps_common::optim::OptState;
use ps_common::weights::{read_safetensors, write_safetensors};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// When and where a shard writes checkpoints (`[checkpoint] every` > 0).
#[derive(Debug)]
pub struct Plan {
    every: u64,
    keep: usize,
    dir: PathBuf,
    id: Identity,
}

impl Plan {
    /// The plan of shard `index` of `cfg` (its range of the flat vector), or None when the
    /// config writes no checkpoints.
    pub fn of(cfg: &Config, index: usize, range: Range<usize>) -> Option<Self> {
        (cfg.checkpoint.every > 0).then(|| Self {
            every: cfg.checkpoint.every,
            keep: cfg.checkpoint.keep,
            dir: cfg.checkpoint_dir(),
            id: Identity::of(cfg, index, range),
        })
    }

    /// The plan of a preemption checkpoint (SIGTERM, SIGUSR1): written whatever `[checkpoint]
    /// every` says, into the same directory, keeping at least the two newest (a shard writes
    /// the version it is at and the next one, see `Shard::request_preempt`).
    pub fn for_preemption(cfg: &Config, index: usize, range: Range<usize>) -> Self {
        Self {
            every: 0,
            keep: cfg.checkpoint.keep.max(2),
            dir: cfg.checkpoint_dir(),
            id: Identity::of(cfg, index, range),
        }
    }

    /// Writes `saved` and prunes older checkpoints; true when written (a failure is logged).
    pub fn write_checked(&self, version: u64, saved: Result<Saved, String>) -> bool {
        let shard = self.id.shard;
        match saved.and_then(|s| write(&self.dir, &self.id, &s, self.keep)) {
            Ok(path) => {
                tracing::info!(
                    "shard {shard}: checkpoint of version {version} written to {}",
                    path.display()
                );
                true
            }
            Err(e) => {
                tracing::error!("shard {shard}: checkpoint of version {version} not written: {e}");
                false
            }
        }
    }

    /// True when `version` is one to checkpoint.
    pub fn due(&self, version: u64) -> bool {
        self.every > 0 && version > 0 && version.is_multiple_of(self.every)
    }

    /// Writes `saved` and prunes older checkpoints; logs the outcome (a failed write is
    /// logged, and training goes on).
    pub fn write_logged(&self, version: u64, saved: Result<Saved, String>) {
        let started = std::time::Instant::now();
        let shard = self.id.shard;
        let written = saved.and_then(|s| write(&self.dir, &self.id, &s, self.keep));
        match written {
            Ok(path) => tracing::info!(
                "shard {shard}: checkpoint of version {version} written to {} in {:.0} ms",
                path.display(),
                started.elapsed().as_secs_f64() * 1e3
            ),
            Err(e) => {
                tracing::error!("shard {shard}: checkpoint of version {version} not written: {e}")
            }
        }
    }
}

/// A shard's state at a version, as written to and read from a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    /// Steps applied.
    pub version: u64,
    /// The shard's parameters.
    pub params: Vec<f32>,
    /// The optimizer's state.
    pub opt: OptState,
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
    /// The run the checkpoint belongs to (`ps_common::runid`; None: the unnamed run). Reading
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
            num_params: cfg.layout().num_params(),
            optimizer: cfg.optimizer.describe(),
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
fn versions(dir: &Path, shard: usize, num_shards: usize) -> Vec<u64> {
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

/// Writes `saved` for the shard `id`, then deletes its checkpoints older than the `keep`
/// newest. Returns the file.
pub fn write(dir: &Path, id: &Identity, saved: &Saved, keep: usize) -> Result<PathBuf, String> {
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
    write_safetensors(
        &path,
        &tensors,
        &id.metadata(saved.version, saved.opt.steps),
    )
    .map_err(|e| e.to_string())?;
    let all = versions(dir, id.shard, id.num_shards);
    for old in &all[..all.len().saturating_sub(keep)] {
        let _ = std::fs::remove_file(file(dir, id.shard, id.num_shards, *old));
    }
    Ok(path)
}

/// The newest version of which every one of `num_shards` shards has a checkpoint in `dir`.
pub fn latest_common(dir: &Path, num_shards: usize) -> Option<u64> {
    let mut common = versions(dir, 0, num_shards);
    for s in 1..num_shards {
        let mine = versions(dir, s, num_shards);
        common.retain(|v| mine.contains(v));
    }
    common.last().copied()
}

/// Reads shard `id`'s checkpoint at `version`, checking it against `id` and the optimizer
/// state layout `fresh` (what the config's optimizer keeps); the error names the file and what
/// did not match.
pub fn read(dir: &Path, id: &Identity, version: u64, fresh: &OptState) -> Result<Saved, String> {
    let path = file(dir, id.shard, id.num_shards, version);
    let (tensors, meta) = read_safetensors(&path).map_err(|e| e.to_string())?;
    let bad = |what: String| format!("{}: {what}", path.display());
    let expected = id.metadata(version, 0);
    // another run's checkpoint (files without a run id are the unnamed run's)
    let theirs = meta.get("run_id").filter(|s| !s.is_empty());
    if theirs != id.run_id.as_ref() {
        return Err(bad(format!(
            "a checkpoint of {}, but this is {}: --resume continues only its own run's checkpoints; to start from this one, pass --resume-from {}",
            ps_common::runid::show(theirs.map(String::as_str)),
            ps_common::runid::show(id.run_id.as_deref()),
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
    let take = |name: &str, len: usize| -> Result<Vec<f32>, String> {
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
    Ok(Saved {
        version,
        params,
        opt: OptState {
            steps: opt_steps,
            m,
            v,
        },
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
            },
        };
        let fresh = OptState {
            steps: 0,
            m: vec![0.0; 5],
            v: Vec::new(),
        };
        for v in [10, 20, 30] {
            write(dir.path(), &id(0), &saved(v), 2).unwrap();
        }
        write(dir.path(), &id(1), &saved(20), 2).unwrap();
        assert_eq!(versions(dir.path(), 0, 2), vec![20, 30], "keep 2");
        assert_eq!(latest_common(dir.path(), 2), Some(20), "shard 1 has no 30");
        assert_eq!(latest_common(dir.path(), 3), None, "another shard count");
        assert_eq!(read(dir.path(), &id(0), 20, &fresh).unwrap(), saved(20));
        // another optimizer or layout is refused, naming what differs
        let other = Identity {
            optimizer: "adam".into(),
            ..id(0)
        };
        let e = read(dir.path(), &other, 20, &fresh).unwrap_err();
        assert!(e.contains("metadata optimizer"), "{e}");
        // another run's checkpoint is refused, naming both runs and the way out
        let other_run = Identity {
            run_id: Some("r2".into()),
            ..id(0)
        };
        let e = read(dir.path(), &other_run, 20, &fresh).unwrap_err();
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
            },
        )
        .unwrap_err();
        assert!(e.contains("no tensor opt.v"), "{e}");
        assert!(read(dir.path(), &id(0), 10, &fresh).is_err(), "pruned");
        assert_eq!(
            parse("shard-3-of-4-v00000120.safetensors"),
            Some((3, 4, 120))
        );
        assert_eq!(parse("shard-3.safetensors"), None);
    }
}
