//! The Slurm batch script (`deploy/slurm/ps-cluster.sbatch`) run on this machine, for
//! `deploy.rs` and `deploy_credentials.rs`: a stand-in `srun` that runs a job's tasks here, the
//! job's environment on "node" 127.0.0.1, a small job config, and the script run in its own
//! process group with a bound (the group is killed when the run ends, so a failing test leaves
//! nothing behind).

use ps_launch::bin_dir;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The workspace root (canonical).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .canonicalize()
        .expect("canonical workspace root")
}

/// `deploy/slurm/ps-cluster.sbatch`.
pub fn sbatch() -> PathBuf {
    repo().join("deploy/slurm/ps-cluster.sbatch")
}

/// A file's text; empty when it cannot be read (a log not written yet).
fn read_or_empty(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// A process group killed when dropped, so a failing test leaves nothing behind.
pub struct Group(pub u32);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: plain syscall on a process group this test created.
        unsafe { libc::killpg(self.0 as i32, libc::SIGKILL) };
    }
}

/// Runs `bash sbatch args` with exactly `env` (plus this process's PATH, unless `env` sets
/// one), in `dir` and its own process group, bounded by `limit`: its status, stdout, stderr
/// and how long it took. Panics with both outputs when it runs past `limit`.
pub fn run_sbatch(
    args: &[&Path],
    env: &[(&str, String)],
    dir: &Path,
    limit: Duration,
) -> (ExitStatus, String, String, Duration) {
    let out = dir.join("sbatch.stdout");
    let err = dir.join("sbatch.stderr");
    let mut cmd = Command::new("bash");
    cmd.arg(sbatch())
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("create sbatch.stdout"))
        .stderr(std::fs::File::create(&err).expect("create sbatch.stderr"))
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd.spawn().expect("bash runs");
    let _group = Group(child.id());
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for bash") {
            break s;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the batch script ran past {limit:?}\nstdout:\n{}\nstderr:\n{}",
                read_or_empty(&out),
                read_or_empty(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (
        status,
        read_or_empty(&out),
        read_or_empty(&err),
        started.elapsed(),
    )
}

/// Writes an executable script.
pub fn write_exe(path: &Path, body: &str) {
    std::fs::write(path, body).expect("write the script");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .expect("make the script executable");
}

/// A stand-in `srun`: logs its arguments (to `$FAKE_SRUN_LOG`), then runs the command here
/// `--ntasks` times with Slurm's task variables, `--output` (with `%t`) as each task's log,
/// forwarding TERM/INT; each task's pid goes to `$FAKE_SRUN_PIDS`. Every option must be
/// written `--name=value` or `--flag`, as the batch script does.
pub const FAKE_SRUN: &str = r#"#!/usr/bin/env bash
set -u
echo "$*" >>"$FAKE_SRUN_LOG"
n=1 out=
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
        --ntasks=*) n=${1#*=} ;;
        --output=*) out=${1#*=} ;;
        --*) ;;
        *) echo "fake srun: unsupported option $1" >&2; exit 2 ;;
    esac
    shift
done
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
for ((t = 0; t < n; t++)); do
    if [[ -n $out ]]; then
        SLURM_PROCID=$t SLURM_NTASKS=$n SLURM_LOCALID=$t "$@" >"${out//%t/$t}" 2>&1 &
    else
        SLURM_PROCID=$t SLURM_NTASKS=$n SLURM_LOCALID=$t "$@" &
    fi
    pids+=("$!")
    echo "$!" >>"$FAKE_SRUN_PIDS"
done
rc=0
for p in "${pids[@]}"; do
    wait "$p"; s=$?
    while kill -0 "$p" 2>/dev/null; do wait "$p"; s=$?; done
    if ((s != 0 && rc == 0)); then rc=$s; fi
done
exit "$rc"
"#;

/// Two consecutive free TCP ports (PS_PORT and PS_PORT + 1).
pub fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let a = std::net::TcpListener::bind("0.0.0.0:0").expect("bind a port");
        let p = a.local_addr().expect("the bound port").port();
        if p < 65535 && std::net::TcpListener::bind(("0.0.0.0", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports");
}

/// A small config for a real job, written to `dir/template.toml`: 5 steps of a 784-16-10 MLP
/// (seed 3, batch 32, SGD at lr 0.1, with `clip_norm` when given), placeholders in
/// [cluster].
pub fn small_template(dir: &Path, barrier_timeout: u32, clip_norm: Option<f64>) -> PathBuf {
    let path = dir.join("template.toml");
    let clip = clip_norm.map_or(String::new(), |c| format!("clip_norm = {c}\n"));
    std::fs::write(
        &path,
        format!(
            "[cluster]\nservers = [\"placeholder:1\"]\nworkers = 1\n\n[model]\nhidden = [16]\n\n[data]\ndir = {:?}\n\n[train]\nseed = 3\nglobal_batch = 32\nsteps = 5\nloss_reduction = \"mean\"\naggregation = \"mean\"\nlog_every = 1\n\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n{clip}\n[server]\nout_dir = \"out\"\nbarrier_timeout_secs = {barrier_timeout}\nlinger_secs = 5\n\n[worker]\nthreads = 1\nconnect_timeout_secs = 60\n",
            repo().join("data/mnist").display().to_string()
        ),
    )
    .expect("write the template");
    path
}

/// The environment of job 4242 on "node" 127.0.0.1 with 2 tasks, 2 shards on `port` and
/// `port + 1`, and the stand-in srun in `tmp/bin` (its logs `tmp/srun.log` and
/// `tmp/srun.pids`), submitted with `--gpus-per-task=1` (GPUs are opt-in); PS_BIN the real
/// binaries.
pub fn fake_job_env(tmp: &Path, port: u16) -> Vec<(&'static str, String)> {
    let bin = tmp.join("bin");
    std::fs::create_dir_all(&bin).expect("create bin");
    write_exe(&bin.join("srun"), FAKE_SRUN);
    vec![
        (
            "PATH",
            format!(
                "{}:{}",
                bin.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        ),
        ("FAKE_SRUN_LOG", tmp.join("srun.log").display().to_string()),
        (
            "FAKE_SRUN_PIDS",
            tmp.join("srun.pids").display().to_string(),
        ),
        ("SLURM_SUBMIT_DIR", tmp.display().to_string()),
        ("SLURM_JOB_ID", "4242".into()),
        ("SLURM_NTASKS", "2".into()),
        ("SLURM_CPUS_PER_TASK", "1".into()),
        ("PS_NODES", "127.0.0.1".into()),
        ("PS_SHARDS", "2".into()),
        ("PS_SHARD_CPUS", "1".into()),
        ("PS_PORT", port.to_string()),
        ("PS_BIN", bin_dir().display().to_string()),
        // GPUs are opt-in: as a job submitted with --gpus-per-task=1
        ("SLURM_GPUS_PER_TASK", "1".into()),
    ]
}
