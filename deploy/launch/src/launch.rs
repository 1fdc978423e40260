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
    /// The run id every process is given (`--run-id`), when set (`ps_config::runid`).
    pub run_id: Option<String>,
    /// How many times [`LocalCluster::wait`] may start a lost shard again (same index and
    /// address, with `--recover`: every shard rolls back to the newest version all have a
    /// checkpoint of, see `ps_server::recovery`) instead of stopping the run; 0: never.
    pub shard_restarts: usize,
    /// The extra arguments the shards were started with, to start one again.
    server_extra: Vec<String>,
    /// The GPUs the workers may use (CUDA ids), when known ([`visible_gpus`]): every worker
    /// gets them as `CUDA_VISIBLE_DEVICES`, and worker `r` `--local-rank r`, so a CUDA worker
    /// uses the `r % n`-th of them (see [`gpu_plan`]).
    pub gpus: Option<Vec<String>>,
    /// The shard credential this launcher generated for its shards (`PS_SHARD_TOKEN`; a
    /// `[server] shard_token_file` in the config wins): shard-to-shard calls need one, and
    /// its workers never see it.
    shard_token: ps_net::auth::Token,
}

/// The GPUs local workers may use and where that list came from: `--gpus` (`flag`), else
/// `CUDA_VISIBLE_DEVICES`, else the devices the CUDA driver sees (`probe`, e.g.
/// `ps_worker::cuda::device_count`); `None` when none is known.
pub fn visible_gpus(
    flag: Option<&str>,
    cuda_visible_devices: Option<&str>,
    probe: impl FnOnce() -> usize,
) -> Option<(Vec<String>, &'static str)> {
    let list = |s: &str| -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|g| !g.is_empty())
            .map(str::to_string)
            .collect()
    };
    if let Some(f) = flag {
        return Some((list(f), "--gpus"));
    }
    if let Some(v) = cuda_visible_devices {
        return Some((list(v), "CUDA_VISIBLE_DEVICES"));
    }
    let n = probe();
    (n > 0).then(|| ((0..n).map(|i| i.to_string()).collect(), "the CUDA driver"))
}

/// Round robin of `workers` local workers over `gpus`: each worker's GPU, and one line per
/// GPU that two or more workers share (empty when none does, or when there is no GPU).
pub fn gpu_plan(workers: usize, gpus: &[String]) -> (Vec<Option<String>>, Vec<String>) {
    if gpus.is_empty() {
        return (vec![None; workers], Vec::new());
    }
    let of = |r: usize| gpus[r % gpus.len()].clone();
    let plan = (0..workers).map(|r| Some(of(r))).collect();
    let shared = gpus
        .iter()
        .filter_map(|g| {
            let on: Vec<String> = (0..workers)
                .filter(|&r| &of(r) == g)
                .map(|r| r.to_string())
                .collect();
            (on.len() > 1).then(|| {
                format!(
                    "workers {} share GPU {g} ({workers} workers, {} GPU(s))",
                    on.join(", "),
                    gpus.len()
                )
            })
        })
        .collect();
    (plan, shared)
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
            gpus: None,
            shard_token: ps_net::auth::Token::random(),
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
            cmd.env(ps_net::auth::SHARD_TOKEN_ENV, self.shard_token.secret());
        } else {
            cmd.env_remove(ps_net::auth::SHARD_TOKEN_ENV);
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

    /// Runs the shards' start-up checks without starting a shard (`ps-server --check`, shard 0,
    /// with `extra`: the config, the overrides, the data set's shape), at most
    /// [`PREFLIGHT_TIMEOUT`]; the refusal is returned in the shard's words. Writes nothing in
    /// the output directory, so a launcher can check before it moves an earlier run aside.
    pub fn preflight(&self, extra: &[String]) -> Result<(), LaunchError> {
        let dir = fresh_temp_dir("ps-launch-check")?;
        let result = (|| {
            let (mut cmd, log) = self.command("ps-server", "check", Some(&dir))?;
            cmd.args(["--shard", "0", "--check"]).args(extra);
            cmd.stdout(Stdio::null());
            let mut child = cmd
                .spawn()
                .map_err(|e| LaunchError(format!("cannot start ps-server --check: {e}")))?;
            let start = Instant::now();
            let status = loop {
                match child.try_wait() {
                    Ok(Some(s)) => break s,
                    Ok(None) if start.elapsed() < PREFLIGHT_TIMEOUT => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Ok(None) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Err(LaunchError(format!(
                            "ps-server --check (the shards' start-up checks) did not finish in {PREFLIGHT_TIMEOUT:?}"
                        )));
                    }
                    Err(e) => return Err(LaunchError(format!("ps-server --check: {e}"))),
                }
            };
            if status.success() {
                return Ok(());
            }
            let text = log
                .and_then(|l| std::fs::read_to_string(l).ok())
                .unwrap_or_default();
            let why: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("error: ") || l.contains(" ERROR "))
                .collect();
            Err(LaunchError(format!(
                "the shards would not start ({status}; nothing in the output directory was touched): {}",
                if why.is_empty() {
                    text.trim().to_string()
                } else {
                    why.join("\n").trim_start_matches("error: ").to_string()
                }
            )))
        })();
        let _ = std::fs::remove_dir_all(&dir);
        result
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
        let run_dir = fresh_temp_dir("ps-launch")?;
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
        // every worker is on this host: its rank is its local rank, which picks its GPU
        cmd.arg("--local-rank").arg(rank.to_string());
        if let Some(gpus) = &self.gpus {
            cmd.env("CUDA_VISIBLE_DEVICES", gpus.join(","));
        }
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
    /// handler can end the wait. A preemption (a shard that exited 143) or an interruption
    /// (130) is an error here; [`LocalCluster::wait_signals`] tells them apart.
    pub fn wait(
        &mut self,
        timeout: Duration,
        interrupted: &dyn Fn() -> bool,
    ) -> Result<(), LaunchError> {
        let stop = || interrupted().then_some(Stop::Interrupt);
        match self.wait_signals(timeout, &stop)? {
            Ended::Finished => Ok(()),
            Ended::Interrupted => Err(LaunchError(
                "interrupted: stopped every server and worker".into(),
            )),
            Ended::Preempted => Err(LaunchError(
                "preempted: every shard checkpointed and stopped".into(),
            )),
        }
    }

    /// [`LocalCluster::wait`], with the launcher's signals polled through `signal`:
    /// - [`Stop::Preempt`] (SIGTERM, SIGUSR1 to the launcher), or a shard that exited 143
    ///   (SIGTERM to the process group or to each process): every process still running gets
    ///   SIGTERM, so every shard writes a checkpoint of one common version and stops; the
    ///   workers' exits that follow are no failures. Bounded by [`PREEMPT_WAIT`].
    /// - [`Stop::Interrupt`] (SIGINT to the launcher), or a shard that exited 130 (Ctrl-C to
    ///   the process group): every process is stopped at once.
    pub fn wait_signals(
        &mut self,
        timeout: Duration,
        signal: &dyn Fn() -> Option<Stop>,
    ) -> Result<Ended, LaunchError> {
        let start = Instant::now();
        let mut preempting: Option<Instant> = None;
        loop {
            let exited_with =
                |p: &Proc, code: i32| p.status.is_some_and(|s| s.code() == Some(code));
            self.reap_servers(preempting.is_some())?;
            let signal = signal();
            if signal == Some(Stop::Interrupt) || self.servers.iter().any(|p| exited_with(p, 130)) {
                self.kill_all();
                return Ok(Ended::Interrupted);
            }
            if preempting.is_none()
                && (signal == Some(Stop::Preempt)
                    || self.servers.iter().any(|p| exited_with(p, 143)))
            {
                eprintln!(
                    "ps-launch: preempted (SIGTERM or SIGUSR1): every shard writes a checkpoint of one common version, then stops (at most {} s)",
                    PREEMPT_WAIT.as_secs()
                );
                self.signal_all(libc::SIGTERM);
                preempting = Some(Instant::now());
            }
            if let Some(since) = preempting {
                if let Some(ended) = self.preempt_progress(since) {
                    return ended;
                }
                std::thread::sleep(Duration::from_millis(25));
                continue;
            }
            self.reap_workers()?;
            // only the exits the two loops above saw, which had their chance of a restart: a
            // process that exits after its loop polled it is seen on the next round. (Reaping
            // here too failed the run when a shard died while a worker killed with it was being
            // restarted: "shard 1 failed with signal: 9", never started again.)
            let mut running = Vec::new();
            let tolerated = &self.tolerated;
            let workers = self
                .workers
                .iter()
                .enumerate()
                .filter(|(i, _)| !tolerated.contains(i))
                .map(|(_, p)| p);
            for p in self.servers.iter().chain(workers) {
                if p.status.is_none() {
                    running.push(p.name.clone());
                }
                if let Some(s) = p.status
                    && !s.success()
                {
                    let msg = format!("{} failed with {s}{}", p.name, p.log_tail(30));
                    self.let_exit(FAILURE_GRACE);
                    self.kill_all();
                    return Err(LaunchError(msg));
                }
            }
            if running.is_empty() {
                return Ok(Ended::Finished);
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

    /// After a failure, the processes still running get `grace` to end on their own before
    /// they are stopped: a worker that its shard told why the run failed says so in its log
    /// (stopped at once, it could lose that race on a loaded machine).
    fn let_exit(&mut self, grace: Duration) {
        let start = Instant::now();
        loop {
            let mut running = false;
            for p in self.servers.iter_mut().chain(self.workers.iter_mut()) {
                if p.status.is_none() {
                    match p.child.try_wait() {
                        Ok(Some(s)) => p.status = Some(s),
                        Ok(None) => running = true,
                        Err(_) => {}
                    }
                }
            }
            if !running || start.elapsed() > grace {
                return;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Records the shards that exited; a shard that failed is started again (the cluster rolls
    /// back with it) unless the cluster is `preempting`.
    fn reap_servers(&mut self, preempting: bool) -> Result<(), LaunchError> {
        // a lost shard may be started again (the cluster rolls back with it)
        for i in 0..self.servers.len() {
            let p = &mut self.servers[i];
            if p.status.is_none()
                && let Ok(Some(s)) = p.child.try_wait()
            {
                p.status = Some(s);
                if !s.success() && !preempting {
                    self.restart_server(i)?;
                }
            }
        }
        Ok(())
    }

    /// A step of the wait after a preemption (SIGTERM sent at `since`): Preempted once every
    /// process has exited, an error past [`PREEMPT_WAIT`] (the rest stopped), None meanwhile.
    fn preempt_progress(&mut self, since: Instant) -> Option<Result<Ended, LaunchError>> {
        for p in self.servers.iter_mut().chain(self.workers.iter_mut()) {
            if p.status.is_none()
                && let Ok(Some(s)) = p.child.try_wait()
            {
                p.status = Some(s);
            }
        }
        let running: Vec<&str> = self
            .servers
            .iter()
            .chain(self.workers.iter())
            .filter(|p| p.status.is_none())
            .map(|p| p.name.as_str())
            .collect();
        if running.is_empty() {
            return Some(Ok(Ended::Preempted));
        }
        if since.elapsed() > PREEMPT_WAIT {
            let running = running.join(", ");
            self.kill_all();
            return Some(Err(LaunchError(format!(
                "preempted, but still running {PREEMPT_WAIT:?} after SIGTERM: {running} (stopped now)"
            ))));
        }
        None
    }

    /// Records the workers that exited; a failed worker is started again (it rejoins at the
    /// shards' step), else with `barrier_policy = "continue"` the run goes on without it.
    fn reap_workers(&mut self) -> Result<(), LaunchError> {
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
        Ok(())
    }

    /// Sends `sig` to every process still running.
    fn signal_all(&self, sig: libc::c_int) {
        for p in self.servers.iter().chain(self.workers.iter()) {
            if p.status.is_none() {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(p.child.id() as i32, sig) };
            }
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

/// What the launcher was asked to do by a signal, for [`LocalCluster::wait_signals`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGINT (Ctrl-C): stop every process at once.
    Interrupt,
    /// SIGTERM or SIGUSR1 (a scheduler's preemption): every shard checkpoints, then stops.
    Preempt,
}

/// How a run waited for by [`LocalCluster::wait_signals`] ended (a failure is an error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Every process exited 0.
    Finished,
    /// Stopped at once (SIGINT): nothing written beyond the periodic checkpoints.
    Interrupted,
    /// Every shard checkpointed one common version and stopped: `--resume` continues.
    Preempted,
}

/// How long a preemption may take from the SIGTERM until every process exited: the shards'
/// grace for the next step boundary (`ps_server::PREEMPT_GRACE`) plus the workers' grace to
/// see the shards go.
pub const PREEMPT_WAIT: Duration = Duration::from_secs(45);

/// How long the processes still running after a failure get to end on their own (and log
/// why) before they are stopped.
pub const FAILURE_GRACE: Duration = Duration::from_secs(3);

/// How long [`LocalCluster::preflight`] waits for `ps-server --check`.
pub const PREFLIGHT_TIMEOUT: Duration = Duration::from_secs(120);

/// A new directory `<tmp>/<prefix>-<pid>-<n>-<nanos>` that nobody used before.
fn fresh_temp_dir(prefix: &str) -> Result<PathBuf, LaunchError> {
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let d = std::env::temp_dir().join(format!(
            "{prefix}-{}-{}-{nanos}",
            std::process::id(),
            unique()
        ));
        match std::fs::create_dir(&d) {
            Ok(()) => return Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(LaunchError(format!("{}: {e}", d.display()))),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_round_robin_and_sharing_is_said() {
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let (plan, shared) = gpu_plan(3, &ids(&["4", "7"]));
        assert_eq!(
            plan,
            vec![Some("4".into()), Some("7".into()), Some("4".into())]
        );
        assert_eq!(
            shared,
            vec!["workers 0, 2 share GPU 4 (3 workers, 2 GPU(s))"]
        );
        let (plan, shared) = gpu_plan(2, &ids(&["0", "1", "2"]));
        assert_eq!(plan, vec![Some("0".into()), Some("1".into())]);
        assert!(shared.is_empty());
        assert_eq!(gpu_plan(2, &[]), (vec![None, None], vec![]));
        // sources in order: --gpus, CUDA_VISIBLE_DEVICES, the driver
        let never = || -> usize { panic!("no probe when a list is given") };
        assert_eq!(
            visible_gpus(Some("2, 3"), Some("0"), never),
            Some((ids(&["2", "3"]), "--gpus"))
        );
        assert_eq!(
            visible_gpus(None, Some("1,0"), never),
            Some((ids(&["1", "0"]), "CUDA_VISIBLE_DEVICES"))
        );
        assert_eq!(
            visible_gpus(None, None, || 2),
            Some((ids(&["0", "1"]), "the CUDA driver"))
        );
        assert_eq!(visible_gpus(None, None, || 0), None);
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
