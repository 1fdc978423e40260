//! Starting a local cluster as real processes: shards on OS-chosen 127.0.0.1 ports (each
//! writes its bound address to a file the launcher waits for, bounded), then workers pointed at
//! them. Used by `ps-launch` and by the integration tests. Children die with their parent
//! (`PR_SET_PDEATHSIG`) and are killed on drop, so nothing is left orphaned.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A launch failure, in words.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct LaunchError(pub String);

/// The directory holding the `ps-server` and `ps-worker` binaries: the current executable's
/// directory, or its parent when running from `target/<profile>/deps` (tests).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().map(Path::to_path_buf).unwrap_or(dir)
    } else {
        dir
    }
}

/// One child process with a name for messages and an optional log file.
#[derive(Debug)]
pub struct Proc {
    /// "shard 0", "worker 3".
    pub name: String,
    /// The process.
    pub child: Child,
    /// Where its stdout and stderr go, when captured.
    pub log: Option<PathBuf>,
    /// Its exit status once reaped.
    pub status: Option<ExitStatus>,
}

impl Proc {
    /// The last `n` lines of its log, for error messages.
    pub fn log_tail(&self, n: usize) -> String {
        let Some(log) = &self.log else {
            return String::new();
        };
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(n)..].join("\n");
        format!("\n--- last lines of {} ---\n{tail}", log.display())
    }
}

/// A set of server and worker processes on this machine.
#[derive(Debug)]
pub struct LocalCluster {
    /// Binaries' directory.
    pub bin_dir: PathBuf,
    /// The config every process reads.
    pub config: PathBuf,
    /// When set, servers log to `<dir>/shard-<i>.log` instead of the terminal.
    pub server_logs: Option<PathBuf>,
    /// When set, workers log to `<dir>/worker-<r>.log` instead of the terminal.
    pub worker_logs: Option<PathBuf>,
    /// Shard processes, shard `i` at index `i`.
    pub servers: Vec<Proc>,
    /// Bound address of each shard.
    pub addrs: Vec<String>,
    /// Worker processes.
    pub workers: Vec<Proc>,
    /// How many times [`LocalCluster::wait`] may start a failed worker again (same rank and
    /// arguments) instead of stopping the run; 0: the first failure stops everything.
    pub worker_restarts: usize,
    /// Each worker's (rank, world, extra arguments), to start it again.
    worker_args: Vec<(usize, usize, Vec<String>)>,
    /// `barrier_policy = "continue"`: a worker that fails (beyond the restart budget) does not
    /// stop the run; the shards go on without it and decide how the run ends.
    pub elastic: bool,
    /// Indices of the workers whose failure [`LocalCluster::elastic`] let the run outlive.
    tolerated: Vec<usize>,
    /// The run id every process is given (`--run-id`), when set (`ps_common::runid`).
    pub run_id: Option<String>,
    /// How many times [`LocalCluster::wait`] may start a lost shard again (same index and
    /// address, with `--recover`: every shard rolls back to the newest version all have a
    /// checkpoint of, see `ps_server::recovery`) instead of stopping the run; 0: never.
    pub shard_restarts: usize,
    /// The extra arguments the shards were started with, to start one again.
    server_extra: Vec<String>,
    /// The shard credential this launcher generated for its shards (`PS_SHARD_TOKEN`; a
    /// `[server] shard_token_file` in the config wins): shard-to-shard calls need one, and
    /// its workers never see it.
    shard_token: ps_common::auth::Token,
}

impl LocalCluster {
    /// An empty cluster for `config`; `logs` captures every process's output in that directory.
    pub fn new(bin_dir: PathBuf, config: PathBuf, logs: Option<PathBuf>) -> Self {
        Self {
            bin_dir,
            config,
            server_logs: logs.clone(),
            worker_logs: logs,
            servers: Vec::new(),
            addrs: Vec::new(),
            workers: Vec::new(),
            worker_restarts: 0,
            worker_args: Vec::new(),
            elastic: false,
            tolerated: Vec::new(),
            run_id: None,
            shard_restarts: 0,
            server_extra: Vec::new(),
            shard_token: ps_common::auth::Token::random(),
        }
    }

    fn command(
        &self,
        bin: &str,
        name: &str,
        log_dir: Option<&Path>,
    ) -> Result<(Command, Option<PathBuf>), LaunchError> {
        let path = self.bin_dir.join(bin);
        if !path.exists() {
            return Err(LaunchError(format!(
                "{} not found: build it first (cargo build --release --bins, or cargo test --workspace builds it)",
                path.display()
            )));
        }
        let mut cmd = Command::new(path);
        cmd.arg("--config").arg(&self.config).stdin(Stdio::null());
        if let Some(id) = &self.run_id {
            cmd.arg("--run-id").arg(id);
        }
        if bin == "ps-server" {
            cmd.env(ps_common::auth::SHARD_TOKEN_ENV, self.shard_token.secret());
        } else {
            cmd.env_remove(ps_common::auth::SHARD_TOKEN_ENV);
        }
        // SAFETY: prctl is async-signal-safe and touches only the child's own process state.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let log = match log_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| LaunchError(format!("{}: {e}", dir.display())))?;
                let p = dir.join(format!("{}.log", name.replace(' ', "-")));
                let f = std::fs::File::create(&p)
                    .map_err(|e| LaunchError(format!("{}: {e}", p.display())))?;
                let f2 = f.try_clone().map_err(|e| LaunchError(e.to_string()))?;
                cmd.stdout(f).stderr(f2);
                Some(p)
            }
            None => None,
        };
        Ok((cmd, log))
    }

    /// Starts shards `0..num_shards` on 127.0.0.1 port 0 and waits (at most `timeout`) until each
    /// has written its bound address. `extra` is appended to every server's arguments.
    pub fn start_servers(
        &mut self,
        num_shards: usize,
        extra: &[String],
        timeout: Duration,
    ) -> Result<(), LaunchError> {
        // a directory nobody used before: a stale address file of an earlier launcher with the
        // same pid would send the workers to a dead port
        let run_dir = loop {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let d = std::env::temp_dir().join(format!(
                "ps-launch-{}-{}-{nanos}",
                std::process::id(),
                unique()
            ));
            match std::fs::create_dir(&d) {
                Ok(()) => break d,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(LaunchError(format!("{}: {e}", d.display()))),
            }
        };
        self.server_extra = extra.to_vec();
        let started = self.spawn_servers(num_shards, extra, timeout, &run_dir);
        let _ = std::fs::remove_dir_all(&run_dir);
        started
    }

    fn spawn_servers(
        &mut self,
        num_shards: usize,
        extra: &[String],
        timeout: Duration,
        run_dir: &Path,
    ) -> Result<(), LaunchError> {
        for shard in 0..num_shards {
            let name = format!("shard {shard}");
            let addr_file = run_dir.join(format!("shard-{shard}.addr"));
            let (mut cmd, log) = self.command("ps-server", &name, self.server_logs.as_deref())?;
            cmd.arg("--shard")
                .arg(shard.to_string())
                .arg("--listen")
                .arg("127.0.0.1:0")
                .arg("--addr-file")
                .arg(&addr_file);
            if let Some(a0) = self.addrs.first() {
                cmd.arg("--shard0").arg(a0);
            }
            cmd.args(extra);
            let child = cmd
                .spawn()
                .map_err(|e| LaunchError(format!("cannot start {name}: {e}")))?;
            self.servers.push(Proc {
                name: name.clone(),
                child,
                log,
                status: None,
            });
            let addr = self.wait_for_addr(shard, &addr_file, timeout)?;
            self.addrs.push(addr);
        }
        Ok(())
    }

    fn wait_for_addr(
        &mut self,
        shard: usize,
        file: &Path,
        timeout: Duration,
    ) -> Result<String, LaunchError> {
        let start = Instant::now();
        loop {
            if let Ok(s) = std::fs::read_to_string(file)
                && s.ends_with('\n')
            {
                return Ok(s.trim().to_string());
            }
            let p = &mut self.servers[shard];
            if let Ok(Some(status)) = p.child.try_wait() {
                p.status = Some(status);
                return Err(LaunchError(format!(
                    "{} exited with {status} before listening{}",
                    p.name,
                    p.log_tail(20)
                )));
            }
            if start.elapsed() > timeout {
                return Err(LaunchError(format!(
                    "{} did not report its address in {:?} (waited for {})",
                    p.name,
                    timeout,
                    file.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts worker `rank` of `world` pointed at the shards; `extra` is appended to its arguments.
    pub fn start_worker(
        &mut self,
        rank: usize,
        world: usize,
        extra: &[String],
    ) -> Result<(), LaunchError> {
        let proc = self.spawn_worker(rank, world, extra)?;
        self.workers.push(proc);
        self.worker_args.push((rank, world, extra.to_vec()));
        Ok(())
    }

    fn spawn_worker(
        &self,
        rank: usize,
        world: usize,
        extra: &[String],
    ) -> Result<Proc, LaunchError> {
        let name = format!("worker {rank}");
        let (mut cmd, log) = self.command("ps-worker", &name, self.worker_logs.as_deref())?;
        cmd.arg("--rank")
            .arg(rank.to_string())
            .arg("--world-size")
            .arg(world.to_string());
        cmd.arg("--servers").arg(self.addrs.join(","));
        cmd.args(extra);
        let child = cmd
            .spawn()
            .map_err(|e| LaunchError(format!("cannot start {name}: {e}")))?;
        Ok(Proc {
            name,
            child,
            log,
            status: None,
        })
    }

    /// Starts lost shard `i` again if the restart budget allows and the way it ended says a
    /// restart can help (killed by a signal, a crash; not a refusal at start, exit 2, nor a run
    /// that failed, 1, was interrupted, 130, or preempted, 143): same index and address,
    /// `--recover` (it has every shard roll back with it), its log so far kept as `<log>.<n>`.
    /// True when it was restarted.
    fn restart_server(&mut self, i: usize) -> Result<bool, LaunchError> {
        use std::os::unix::process::ExitStatusExt;
        let Some(status) = self.servers[i].status else {
            return Ok(false);
        };
        let restartable = status.signal().is_some()
            || status
                .code()
                .is_some_and(|c| ![0, 1, 2, 130, 143].contains(&c));
        if self.shard_restarts == 0 || !restartable || i >= self.addrs.len() {
            return Ok(false);
        }
        self.shard_restarts -= 1;
        let old = &self.servers[i];
        eprintln!(
            "ps-launch: {} was lost ({status}); starting it again at {} with --recover: every shard rolls back to the newest version all have a checkpoint of ({} restart(s) left){}",
            old.name,
            self.addrs[i],
            self.shard_restarts,
            old.log_tail(5)
        );
        if let Some(log) = &old.log {
            let n = (1..).find(|n| !log.with_extension(format!("log.{n}")).exists());
            let _ = std::fs::rename(log, log.with_extension(format!("log.{}", n.unwrap_or(1))));
        }
        let name = old.name.clone();
        let (mut cmd, log) = self.command("ps-server", &name, self.server_logs.as_deref())?;
        cmd.arg("--shard")
            .arg(i.to_string())
            .arg("--listen")
            .arg(&self.addrs[i])
            .arg("--recover")
            .arg("--peers")
            .arg(self.addrs.join(","));
        if i > 0 {
            cmd.arg("--shard0").arg(&self.addrs[0]);
        }
        // a replacement recovers: it does not resume from where the run started
        let mut extra = self.server_extra.iter();
        while let Some(a) = extra.next() {
            match a.as_str() {
                "--resume" => {}
                "--resume-from" => {
                    extra.next();
                }
                _ if a.starts_with("--resume-from=") => {}
                _ => {
                    cmd.arg(a);
                }
            }
        }
        let child = cmd
            .spawn()
            .map_err(|e| LaunchError(format!("cannot start {name} again: {e}")))?;
        self.servers[i] = Proc {
            name,
            child,
            log,
            status: None,
        };
        Ok(true)
    }

    /// Starts failed worker `i` again if the restart budget allows: its log so far is kept as
    /// `<log>.<n>` (n = restarts so far). True when it was restarted.
    fn restart_worker(&mut self, i: usize) -> Result<bool, LaunchError> {
        if self.worker_restarts == 0 || i >= self.worker_args.len() {
            return Ok(false);
        }
        self.worker_restarts -= 1;
        let old = &self.workers[i];
        eprintln!(
            "ps-launch: {} failed with {}; starting it again ({} restart(s) left){}",
            old.name,
            old.status.map_or("?".to_string(), |s| s.to_string()),
            self.worker_restarts,
            old.log_tail(5)
        );
        if let Some(log) = &old.log {
            let n = (1..).find(|n| !log.with_extension(format!("log.{n}")).exists());
            let _ = std::fs::rename(log, log.with_extension(format!("log.{}", n.unwrap_or(1))));
        }
        let (rank, world, extra) = self.worker_args[i].clone();
        self.workers[i] = self.spawn_worker(rank, world, &extra)?;
        Ok(true)
    }

    /// Waits until every process has exited, at most `timeout`. The first failure stops the
    /// others and is returned with the end of its log; `interrupted` is polled so a Ctrl-C
    /// handler can end the wait.
    pub fn wait(
        &mut self,
        timeout: Duration,
        interrupted: &dyn Fn() -> bool,
    ) -> Result<(), LaunchError> {
        let start = Instant::now();
        loop {
            // a lost shard may be started again (the cluster rolls back with it)
            for i in 0..self.servers.len() {
                let p = &mut self.servers[i];
                if p.status.is_none()
                    && let Ok(Some(s)) = p.child.try_wait()
                {
                    p.status = Some(s);
                    if !s.success() {
                        self.restart_server(i)?;
                    }
                }
            }
            // a failed worker may be started again (it rejoins at the shards' step)
            for i in 0..self.workers.len() {
                let p = &mut self.workers[i];
                if p.status.is_none()
                    && let Ok(Some(s)) = p.child.try_wait()
                {
                    p.status = Some(s);
                    if !s.success() && !self.restart_worker(i)? && self.elastic {
                        let p = &self.workers[i];
                        eprintln!(
                            "ps-launch: {} failed with {s}; the run goes on without it (barrier_policy = \"continue\"){}",
                            p.name,
                            p.log_tail(5)
                        );
                        self.tolerated.push(i);
                    }
                }
            }
            let mut running = Vec::new();
            let tolerated = &self.tolerated;
            let workers = self
                .workers
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| !tolerated.contains(i))
                .map(|(_, p)| p);
            for p in self.servers.iter_mut().chain(workers) {
                if p.status.is_none() {
                    match p.child.try_wait() {
                        Ok(Some(s)) => p.status = Some(s),
                        Ok(None) => running.push(p.name.clone()),
                        Err(e) => return Err(LaunchError(format!("{}: {e}", p.name))),
                    }
                }
                if let Some(s) = p.status
                    && !s.success()
                {
                    let msg = format!("{} failed with {s}{}", p.name, p.log_tail(30));
                    self.kill_all();
                    return Err(LaunchError(msg));
                }
            }
            if running.is_empty() {
                return Ok(());
            }
            if interrupted() {
                self.kill_all();
                return Err(LaunchError(
                    "interrupted: stopped every server and worker".into(),
                ));
            }
            if start.elapsed() > timeout {
                self.kill_all();
                return Err(LaunchError(format!(
                    "still running after {timeout:?}: {}",
                    running.join(", ")
                )));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Sends SIGINT (stop at once, removing shared-memory boards) to every process still
    /// running, then SIGKILL after a short grace period. Not SIGTERM: the shards and workers
    /// take that as preemption and go on to the next checkpoint first, which can outlast the
    /// grace period and leave boards behind.
    pub fn kill_all(&mut self) {
        let procs: Vec<&mut Proc> = self
            .servers
            .iter_mut()
            .chain(self.workers.iter_mut())
            .collect();
        for p in &procs {
            if p.status.is_none() {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(p.child.id() as i32, libc::SIGINT) };
            }
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        for p in procs {
            while p.status.is_none() {
                match p.child.try_wait() {
                    Ok(Some(s)) => p.status = Some(s),
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    _ => {
                        let _ = p.child.kill();
                        p.status = p.child.wait().ok();
                        break;
                    }
                }
            }
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// `p` with `.` and `dir/..` removed lexically (`deploy/../runs/mnist` becomes `runs/mnist`),
/// for messages a person reads.
pub fn tidy(p: &Path) -> PathBuf {
    use std::path::Component;
    let mut out: Vec<Component> = Vec::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => match out.last() {
                Some(Component::Normal(_)) => {
                    out.pop();
                }
                Some(Component::RootDir) => {}
                _ => out.push(c),
            },
            _ => out.push(c),
        }
    }
    if out.is_empty() {
        return PathBuf::from(".");
    }
    out.iter().collect()
}

/// What a run writes into its output directory; a new run moves an earlier run's copies aside.
pub const RUN_OUTPUTS: [&str; 6] = [
    "run_id",
    "model.safetensors",
    "curves.svg",
    "metrics.jsonl",
    "logs",
    "checkpoints",
];

/// Moves the outputs of an earlier run in `out_dir` (those of [`RUN_OUTPUTS`], the shard
/// files `shard-*.safetensors` and TensorBoard's `events.out.tfevents.*`) into a new `out_dir/previous-<unix seconds>/`, so the directory
/// holds one run's story. Returns that directory, or None when there was nothing to move.
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
    fn an_earlier_runs_outputs_move_aside_tensorboard_events_included() {
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
        let prev = move_previous_run(out).unwrap().expect("moved");
        for f in [
            "metrics.jsonl",
            "shard-0.safetensors",
            "events.out.tfevents.1700000000.host",
        ] {
            assert!(prev.join(f).exists() && !out.join(f).exists(), "{f}");
        }
        assert!(out.join("config.toml").exists(), "not an output: stays");
    }

    #[test]
    fn tidy_removes_dot_and_dotdot() {
        assert_eq!(
            tidy(Path::new("deploy/../runs/mnist")),
            Path::new("runs/mnist")
        );
        assert_eq!(tidy(Path::new("./a/./b/")), Path::new("a/b"));
        assert_eq!(tidy(Path::new("/x/../y")), Path::new("/y"));
        assert_eq!(tidy(Path::new("../up/z")), Path::new("../up/z"));
        assert_eq!(tidy(Path::new("a/..")), Path::new("."));
    }
}
