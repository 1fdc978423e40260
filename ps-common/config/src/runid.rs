//! Run identity: every process of one training run carries the same run id, so that two runs
//! on one host or one network (the same ports, the same folders) refuse each other instead of
//! mixing. The id travels as the `x-ps-run-id` metadata (`ps_proto::keys::RUN_ID`) of every
//! request (registration, push, pull, leave, the shards' step reports; added by
//! `ps_net::auth::AddToken`, checked by `ps_net::auth::CheckToken`), in the names of the
//! shared-memory board directories and in checkpoint metadata.
//!
//! Where it comes from, first found wins ([`resolve`]): the `--run-id` flag, the `PS_RUN_ID`
//! environment variable, `[cluster] run_id`, `SLURM_JOB_ID`, a Kubernetes UID (`PS_K8S_JOB_UID`,
//! from the downward API; it must be the same for the shard and the worker pods, so one owner's
//! UID, not each Job's own `controller-uid`), else none.
//! `ps-launch` generates one when none is found ([`generate`]) and passes it to its shards and
//! workers. Processes without any id form the "unnamed" run: they accept one another only.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::Path;

/// Longest run id, in bytes.
pub const MAX_LEN: usize = 64;

/// Environment variables read for the run id, in order, with the words a log line uses.
pub const ENV_SOURCES: [(&str, &str); 3] = [
    ("PS_RUN_ID", "PS_RUN_ID"),
    ("SLURM_JOB_ID", "the Slurm job (SLURM_JOB_ID)"),
    (
        "PS_K8S_JOB_UID",
        "the Kubernetes Job's UID (PS_K8S_JOB_UID)",
    ),
];

/// An unusable run id, or an output directory another run holds.
#[derive(Debug, thiserror::Error)]
pub enum RunIdError {
    /// Empty, or longer than [`MAX_LEN`].
    #[error("run id {0:?}: expected 1 to {MAX_LEN} characters")]
    Length(String),
    /// A character outside `A-Z a-z 0-9 . _ -` (the id, the character).
    #[error(
        "run id {0:?}: character {1:?} is not allowed: expected letters, digits, '.', '_' and '-'"
    )]
    Character(String, char),
    /// The id given by `what` (`--run-id`, `PS_RUN_ID`, ...) is unusable.
    #[error("{what}: {error}")]
    From {
        /// Where the id came from.
        what: String,
        /// Why it is unusable.
        error: Box<RunIdError>,
    },
    /// The output directory cannot be created.
    #[error("cannot create {}: {error}", dir.display())]
    Create {
        /// The directory.
        dir: std::path::PathBuf,
        /// What went wrong.
        error: std::io::Error,
    },
    /// A shard's lock file cannot be opened.
    #[error("cannot open {}: {error}", path.display())]
    Open {
        /// The lock file.
        path: std::path::PathBuf,
        /// What went wrong.
        error: std::io::Error,
    },
    /// A live shard of another cluster holds the directory.
    #[error(
        "the output directory {} is in use by shard {shard} of another live cluster ({holder}): two runs cannot share a folder; give this one its own out_dir (or stop the other first)",
        dir.display()
    )]
    InUse {
        /// The directory.
        dir: std::path::PathBuf,
        /// The shard.
        shard: usize,
        /// The holder, as its lock file names it (run and pid).
        holder: String,
    },
}

/// Checks that `id` is a usable run id: 1 to [`MAX_LEN`] characters of `A-Z a-z 0-9 . _ -`
/// (it becomes part of file names and a gRPC header).
pub fn validate(id: &str) -> Result<(), RunIdError> {
    if id.is_empty() || id.len() > MAX_LEN {
        return Err(RunIdError::Length(id.to_string()));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(RunIdError::Character(id.to_string(), c));
    }
    Ok(())
}

/// A resolved run id and where it came from (for the start-up log line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunId {
    /// The id; None for the unnamed run.
    pub id: Option<String>,
    /// "--run-id", "PS_RUN_ID", "[cluster] run_id", ..., or "nowhere".
    pub source: String,
}

impl RunId {
    /// The id, or `(none)` for messages.
    pub fn show(&self) -> String {
        show(self.id.as_deref())
    }
}

/// `id` for messages: `run <id>` or `the unnamed run`.
pub fn show(id: Option<&str>) -> String {
    match id {
        Some(id) => format!("run {id}"),
        None => "the unnamed run (no run id)".to_string(),
    }
}

/// The run id of this process (see the module's text for the order); the error names the
/// source whose value is unusable.
pub fn resolve(
    flag: Option<&str>,
    config: Option<&str>,
    env: &HashMap<String, String>,
) -> Result<RunId, RunIdError> {
    let found = |id: &str, source: &str| -> Result<RunId, RunIdError> {
        validate(id).map_err(|e| RunIdError::From {
            what: source.to_string(),
            error: Box::new(e),
        })?;
        Ok(RunId {
            id: Some(id.to_string()),
            source: source.to_string(),
        })
    };
    if let Some(id) = flag {
        return found(id, "--run-id");
    }
    if let Some(id) = env.get("PS_RUN_ID").filter(|s| !s.is_empty()) {
        return found(id, "PS_RUN_ID");
    }
    if let Some(id) = config {
        return found(id, "[cluster] run_id");
    }
    for (var, words) in &ENV_SOURCES[1..] {
        if let Some(id) = env.get(*var).filter(|s| !s.is_empty()) {
            return found(id, words);
        }
    }
    Ok(RunId {
        id: None,
        source:
            "nowhere (no --run-id, PS_RUN_ID, [cluster] run_id, SLURM_JOB_ID or PS_K8S_JOB_UID)"
                .into(),
    })
}

/// A fresh run id for a launcher: `local-<unix seconds>-<8 hex digits>`.
pub fn generate() -> String {
    use std::hash::{BuildHasher, Hasher};
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("local-{secs}-{:08x}", h.finish() as u32)
}

/// The part of a shared-memory board directory's name that names the run: the id, or `norun`.
pub fn board_prefix(id: Option<&str>) -> String {
    id.unwrap_or("norun").to_string()
}

/// Takes the lock of shard `shard` on the output directory `dir` (`.shard-<i>.lock`, an
/// exclusive `flock` held while the returned file is open, by this process only), so that a
/// second run given the same folder fails at once instead of mixing its metrics, weights and
/// checkpoints with the first's. The lock file names the holder (run and pid); the error
/// repeats it.
pub fn lock_out_dir(dir: &Path, shard: usize, run: Option<&str>) -> Result<File, RunIdError> {
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;
    std::fs::create_dir_all(dir).map_err(|error| RunIdError::Create {
        dir: dir.to_path_buf(),
        error,
    })?;
    let path = dir.join(format!(".shard-{shard}.lock"));
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|error| RunIdError::Open {
            path: path.clone(),
            error,
        })?;
    // SAFETY: flock(2) on a file descriptor this `File` owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = f.read_to_string(&mut holder);
        return Err(RunIdError::InUse {
            dir: dir.to_path_buf(),
            shard,
            holder: holder.trim().to_string(),
        });
    }
    let _ = f.set_len(0);
    let _ = f.rewind();
    let _ = writeln!(f, "{}, pid {}", show(run), std::process::id());
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn first_source_wins_and_bad_ids_are_refused() {
        let all = env(&[
            ("PS_RUN_ID", "env-id"),
            ("SLURM_JOB_ID", "77"),
            ("PS_K8S_JOB_UID", "0f6c-uid"),
        ]);
        let r = resolve(Some("flag-id"), Some("cfg-id"), &all).unwrap();
        assert_eq!(
            (r.id.as_deref(), r.source.as_str()),
            (Some("flag-id"), "--run-id")
        );
        let r = resolve(None, Some("cfg-id"), &all).unwrap();
        assert_eq!(r.id.as_deref(), Some("env-id"));
        let r = resolve(None, Some("cfg-id"), &env(&[("SLURM_JOB_ID", "77")])).unwrap();
        assert_eq!(r.id.as_deref(), Some("cfg-id"));
        let r = resolve(None, None, &env(&[("SLURM_JOB_ID", "77")])).unwrap();
        assert_eq!(r.id.as_deref(), Some("77"));
        assert!(r.source.contains("SLURM_JOB_ID"));
        let r = resolve(None, None, &env(&[("PS_K8S_JOB_UID", "0f6c-uid")])).unwrap();
        assert_eq!(r.id.as_deref(), Some("0f6c-uid"));
        let r = resolve(None, None, &env(&[("PS_RUN_ID", "")])).unwrap();
        assert_eq!(r.id, None);
        assert!(r.show().contains("unnamed"));
        let e = resolve(Some("a b"), None, &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--run-id: run id \"a b\"") && e.contains("' '"),
            "{e}"
        );
        let e = resolve(None, None, &env(&[("PS_RUN_ID", &"x".repeat(65))]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 to 64"), "{e}");
        let g = generate();
        assert!(g.starts_with("local-") && validate(&g).is_ok(), "{g}");
        assert_ne!(generate(), g);
    }

    #[test]
    fn one_live_holder_per_shard_and_folder() {
        let dir = tempfile::tempdir().unwrap();
        let held = lock_out_dir(dir.path(), 0, Some("a")).unwrap();
        let e = lock_out_dir(dir.path(), 0, Some("b"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("in use by shard 0") && e.contains("run a, pid"),
            "{e}"
        );
        let _other_shard = lock_out_dir(dir.path(), 1, Some("a")).unwrap();
        drop(held);
        assert!(lock_out_dir(dir.path(), 0, Some("b")).is_ok(), "released");
    }
}
