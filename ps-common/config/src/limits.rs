//! The stated maximum of every duration, count and size a config can set, and the checks
//! that refuse a value past it with the key, the value and the maximum (the file is added by
//! [`super::ConfigError`]). A value under these maximums never panics, aborts or hangs a
//! process: durations stay far from `Duration`'s and tokio's limits, products of counts are
//! computed with checked arithmetic, and the model's memory is checked against the host's.

use crate::error::Invalid;

/// Longest duration of any `*_secs` key: 7 days.
pub const MAX_SECS: f64 = 7.0 * 24.0 * 3600.0;
/// Most shards (`[cluster] servers`).
pub const MAX_SHARDS: usize = 1024;
/// Most workers (`[cluster] workers`).
pub const MAX_WORKERS: usize = 4096;
/// Widest layer (`[model] inputs`, `classes`, each of `hidden`).
pub const MAX_WIDTH: usize = 1 << 20;
/// Most hidden layers.
pub const MAX_HIDDEN_LAYERS: usize = 64;
pub use ps_model::MAX_PARAMS;
/// Largest global batch (`global_batch`, or `per_worker_batch` x workers).
pub const MAX_BATCH: u64 = 1 << 20;
/// Largest step count of any kind: `steps`, `epochs`, epochs x steps per epoch, `log_every`,
/// `eval_every`, `[checkpoint] every`, `warmup_steps`, `step_size` (2^40, about 1.1e12).
pub const MAX_STEPS: u64 = 1 << 40;
/// Most checkpoints kept per shard.
pub const MAX_KEEP: usize = 1000;
/// Most consecutive failed checkpoints `[checkpoint] max_failures` allows.
pub const MAX_CHECKPOINT_FAILURES: u32 = 1000;
/// Most compute threads per worker.
pub const MAX_THREADS: usize = 1024;
/// Largest token file read (`[cluster] token_file`).
pub const MAX_TOKEN_FILE_BYTES: u64 = 4096;
/// Largest PEM file read (`[cluster] tls_cert`, `tls_key`, `tls_ca`).
pub const MAX_PEM_FILE_BYTES: u64 = 1 << 20;

/// A number as a person would write it in the file (`1e308`, not 309 digits).
pub fn show(v: f64) -> String {
    if v.is_finite() && v.abs() >= 1e9 {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// A duration in seconds: positive, finite, at most [`MAX_SECS`].
pub fn secs(key: &str, v: f64) -> Result<f64, Invalid> {
    if !(v.is_finite() && v > 0.0) {
        return Err(Invalid::NotPositiveSecs {
            key: key.into(),
            value: show(v),
        });
    }
    if v > MAX_SECS {
        return Err(Invalid::TooManySecs {
            key: key.into(),
            value: show(v),
            max: MAX_SECS,
        });
    }
    Ok(v)
}

/// A count at most `max`.
pub fn at_most<T: PartialOrd + std::fmt::Display>(key: &str, v: T, max: T) -> Result<T, Invalid> {
    if v > max {
        return Err(Invalid::TooLarge {
            key: key.into(),
            value: v.to_string(),
            max: max.to_string(),
        });
    }
    Ok(v)
}

/// Reads at most `max` bytes of `path`; a longer file (or an endless one, `/dev/zero`) is
/// refused after reading `max + 1` bytes, and a FIFO without a writer reads as empty, so no
/// file can make a process read or wait without bound.
pub fn read_bounded(path: &std::path::Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // non-blocking: opening a FIFO with no writer returns at once instead of waiting
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if f.metadata()?.is_dir() {
        return Err(std::io::Error::other("is a directory"));
    }
    let mut buf = Vec::new();
    f.take(max + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > max {
        return Err(std::io::Error::other(format!(
            "larger than {max} bytes (the most read)"
        )));
    }
    Ok(buf)
}

/// Bytes of memory this host can give a new process (`MemAvailable` of `/proc/meminfo`),
/// or None where that is unknown (no check then).
pub fn host_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Largest config file read.
pub const MAX_CONFIG_FILE_BYTES: u64 = 1 << 20;

/// Default payload per chunk: 1 MiB streams well over HTTP/2: a chunk is about one frame of
/// `ps_net::client::MAX_FRAME_BYTES`, eight fit in the stream window
/// (`ps_net::client::STREAM_WINDOW_BYTES`), and gRPC's per-message cost is negligible beside
/// it, while a whole tensor in one message would be copied and held at once on both sides.
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;

/// Largest gRPC message either side accepts; chunks stay far below it.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
