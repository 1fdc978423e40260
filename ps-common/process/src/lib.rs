//! The process helpers every binary (ps-server, ps-worker, ps-launch, ps-bench) calls at
//! start-up: allocator tuning, logging on stderr, and the signals that stop or preempt a run;
//! `env`: a worker's rank and world size from flags or its launcher's environment.

pub mod env;

/// Keeps freed memory mapped instead of returning it to the kernel after every step: tensors of
/// megabytes are allocated and freed each step (gRPC buffers, activations), and glibc would
/// otherwise `mmap`/`munmap` them every time and pay a page fault per 4 KiB on each reuse.
/// Call at the start of `main`, before other threads exist.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator thresholds; called before any other thread runs.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// Sets up `tracing` output on stderr, `info` by default, `RUST_LOG` to change it.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// Resolves at the first SIGTERM or SIGUSR1: a scheduler preempting or ending the job
/// (Kubernetes and `scancel` send SIGTERM; Slurm's `--signal=USR1@N` warns N seconds ahead).
/// Never resolves when the handlers cannot be installed.
pub async fn preempt_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut usr1)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::user_defined1()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = usr1.recv() => {}
    }
}

/// Resolves at the first SIGINT (Ctrl-C) or SIGTERM (a launcher stopping its children).
pub async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
