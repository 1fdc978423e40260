//! A run's output directory, as the launcher owns it: checked before anything in it moves,
//! held while the run lives, and cleared of an earlier run's files only once the new run's
//! start-up checks passed.
//!
//! - [`claim`] takes the launcher's lock (`.ps-launch.lock`, an exclusive `flock` held for the
//!   launcher's life, naming the run and its pids) and finds any live shard of another run
//!   holding its own lock there (`.shard-<i>.lock`, `ps_config::runid::lock_out_dir`); either
//!   refuses the launch before a file moves, naming the live run, its pids and how to choose
//!   another folder.
//! - [`move_previous_run`] moves an earlier run's outputs ([`RUN_OUTPUTS`], shard files,
//!   TensorBoard events) into `previous-<unix seconds>/`.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// The launcher's lock file in an output directory.
pub const LAUNCH_LOCK: &str = ".ps-launch.lock";

/// What a run writes into its output directory; a new run moves an earlier run's copies aside.
pub const RUN_OUTPUTS: [&str; 7] = [
    "run_id",
    "model.safetensors",
    "curves.svg",
    "metrics.jsonl",
    "logs",
    "checkpoints",
    "reference-check",
];

/// The launcher's hold on an output directory: the lock is released when this is dropped (or
/// the process ends, however it ends).
#[derive(Debug)]
pub struct Claim {
    file: File,
    /// The directory claimed.
    pub dir: PathBuf,
    /// Whether the claim made the directory, and its lock file.
    made: (bool, bool),
}

impl Claim {
    /// Gives the directory back as it was before the claim, for a launch refused before it
    /// wrote anything (its start-up checks failed): the lock file goes when the claim made it,
    /// and the directory too when the claim made it and it is still empty.
    pub fn release_untouched(self) {
        let Claim { file, dir, made } = self;
        if made.1 {
            let _ = std::fs::remove_file(dir.join(LAUNCH_LOCK));
        }
        drop(file);
        if made.0 {
            let _ = std::fs::remove_dir(&dir);
        }
    }

    /// Records who holds the directory (read by a second launcher's refusal): the run, this
    /// launcher's pid and, once started, its shards' and workers' pids.
    pub fn record(&mut self, run: &str, shards: &[u32], workers: &[u32]) {
        let list = |p: &[u32]| p.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
        let mut text = format!("run {run}, ps-launch pid {}", std::process::id());
        if !shards.is_empty() {
            text += &format!("; shard pids {}", list(shards));
        }
        if !workers.is_empty() {
            text += &format!("; worker pids {}", list(workers));
        }
        let _ = self.file.set_len(0);
        let _ = self.file.rewind();
        let _ = writeln!(self.file, "{text}");
    }
}

/// Whether an exclusive `flock` on `f` is free (taken and kept by the caller when it is).
fn try_lock(f: &File) -> bool {
    // SAFETY: flock(2) on a file descriptor this `File` owns.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

fn holder(mut f: &File) -> String {
    let mut s = String::new();
    let _ = f.rewind();
    let _ = f.read_to_string(&mut s);
    s.trim().to_string()
}

/// Why an output directory cannot be claimed ([`claim`]).
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The directory cannot be created.
    #[error("cannot create {}: {error}", dir.display())]
    Create {
        /// The directory.
        dir: PathBuf,
        /// What went wrong.
        error: std::io::Error,
    },
    /// The launcher's lock file cannot be opened.
    #[error("cannot open {}: {error}", path.display())]
    Open {
        /// The lock file.
        path: PathBuf,
        /// What went wrong.
        error: std::io::Error,
    },
    /// Another launcher, or a live shard, holds the directory.
    #[error(
        "the output directory {} belongs to a live run ({who}): nothing in it was moved or written; give this run another folder (--out-dir DIR, or --set server.out_dir=DIR), or stop that run first (SIGTERM to its ps-launch checkpoints it)",
        dir.display()
    )]
    Live {
        /// The directory.
        dir: PathBuf,
        /// The live run: its lock's contents (run id, pids), per holder.
        who: String,
    },
}

/// Claims `dir` for a new launch (creating it when missing) before anything in it moves or is
/// written: refused when another launcher holds it or a live shard of any run holds its lock
/// there. The error names the live run, its pids and how to choose another folder; the
/// directory is left exactly as it was.
pub fn claim(dir: &Path, run: &str) -> Result<Claim, ClaimError> {
    let made_dir = !dir.exists();
    std::fs::create_dir_all(dir).map_err(|error| ClaimError::Create {
        dir: dir.to_path_buf(),
        error,
    })?;
    let refuse = |who: String| ClaimError::Live {
        dir: dir.to_path_buf(),
        who,
    };
    let path = dir.join(LAUNCH_LOCK);
    let made_lock = path.symlink_metadata().is_err();
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|error| ClaimError::Open {
            path: path.clone(),
            error,
        })?;
    if !try_lock(&file) {
        return Err(refuse(holder(&file)));
    }
    // shards started without this launcher (by hand, Slurm, another launcher's restart) hold
    // only their own locks
    let mut live = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut locks: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(".shard-") && n.ends_with(".lock"))
            })
            .collect();
        locks.sort();
        for p in locks {
            let Ok(f) = OpenOptions::new().read(true).write(true).open(&p) else {
                continue;
            };
            // taken and dropped at once: only a held lock matters
            if !try_lock(&f) {
                let name = p.file_name().map(|n| n.to_string_lossy().to_string());
                let shard = name
                    .as_deref()
                    .and_then(|n| n.strip_prefix(".shard-")?.strip_suffix(".lock"))
                    .unwrap_or("?");
                live.push(format!("shard {shard}: {}", holder(&f)));
            }
        }
    }
    if !live.is_empty() {
        return Err(refuse(live.join("; ")));
    }
    let mut claim = Claim {
        file,
        dir: dir.to_path_buf(),
        made: (made_dir, made_lock),
    };
    claim.record(run, &[], &[]);
    Ok(claim)
}

/// Moves the outputs of an earlier run in `out_dir` (those of [`RUN_OUTPUTS`], the shard
/// files `shard-*.safetensors` and TensorBoard's `events.out.tfevents.*`) into a new
/// `out_dir/previous-<unix seconds>/`, so the directory holds one run's story. Returns that
/// directory, or None when there was nothing to move. Call it holding the [`Claim`].
pub fn move_previous_run(out_dir: &Path) -> std::io::Result<Option<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(out_dir) else {
        return Ok(None);
    };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(n) = name.to_str() else { continue };
        let shard_file = n.starts_with("shard-") && n.ends_with(".safetensors");
        let tensorboard_file = n.starts_with("events.out.tfevents.");
        if shard_file || tensorboard_file || RUN_OUTPUTS.contains(&n) {
            found.push(e.path());
        }
    }
    if found.is_empty() {
        return Ok(None);
    }
    found.sort();
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut dest = out_dir.join(format!("previous-{secs}"));
    let mut n = 1;
    while dest.exists() {
        n += 1;
        dest = out_dir.join(format!("previous-{secs}-{n}"));
    }
    std::fs::create_dir(&dest)?;
    for p in found {
        if let Some(name) = p.file_name() {
            std::fs::rename(&p, dest.join(name))?;
        }
    }
    Ok(Some(dest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_earlier_runs_outputs_move_aside_tensorboard_events_and_reference_check_included() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        for f in [
            "metrics.jsonl",
            "shard-0.safetensors",
            "events.out.tfevents.1700000000.host",
            "config.toml",
        ] {
            std::fs::write(out.join(f), "x").unwrap();
        }
        std::fs::create_dir(out.join("reference-check")).unwrap();
        let prev = move_previous_run(out).unwrap().expect("moved");
        for f in [
            "metrics.jsonl",
            "shard-0.safetensors",
            "events.out.tfevents.1700000000.host",
            "reference-check",
        ] {
            assert!(prev.join(f).exists() && !out.join(f).exists(), "{f}");
        }
        assert!(out.join("config.toml").exists(), "not an output: stays");
    }

    #[test]
    fn a_held_folder_is_refused_naming_the_holder_and_freed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = claim(dir.path(), "run-a").unwrap();
        first.record("run-a", &[11, 12], &[13]);
        let e = claim(dir.path(), "run-b").unwrap_err().to_string();
        assert!(
            e.contains("belongs to a live run (run run-a, ps-launch pid")
                && e.contains("shard pids 11, 12; worker pids 13")
                && e.contains("--out-dir DIR"),
            "{e}"
        );
        drop(first);
        let second = claim(dir.path(), "run-b").unwrap();
        // a live shard's own lock (a run started without ps-launch) refuses too
        drop(second);
        let _shard = ps_config::runid::lock_out_dir(dir.path(), 1, Some("job-7")).unwrap();
        let e = claim(dir.path(), "run-c").unwrap_err().to_string();
        assert!(e.contains("(shard 1: run job-7, pid"), "{e}");
    }
}
