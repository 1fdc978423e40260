//! The Slurm recipe and the Kubernetes manifests take a run's credentials from the credentials
//! step (`ps-server credentials --dir DIR`, deploy/README.md "Credentials"), as every cluster
//! started without `ps-launch` must. The Slurm job is run here with a stand-in `srun` and a
//! `ps-server` that logs its arguments before running the real one; the Kubernetes commands
//! that make the Secrets are read from the manifests' and the README's text and run up to the
//! step.

use ps_config::Config;
use ps_launch::bin_dir;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

fn write_exe(path: &Path, body: &str) {
    std::fs::write(path, body).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A stand-in `srun`: runs the command here `--ntasks` times with Slurm's task variables and
/// `--output` (with `%t`) as each task's log, forwarding TERM.
const SRUN: &str = r#"#!/usr/bin/env bash
n=1 out=
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
        --ntasks=*) n=${1#*=} ;;
        --output=*) out=${1#*=} ;;
    esac
    shift
done
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
for ((t = 0; t < n; t++)); do
    SLURM_PROCID=$t SLURM_NTASKS=$n SLURM_LOCALID=$t "$@" >"${out//%t/$t}" 2>&1 &
    pids+=("$!")
done
rc=0
for p in "${pids[@]}"; do
    wait "$p"; s=$?
    while kill -0 "$p" 2>/dev/null; do wait "$p"; s=$?; done
    if ((s != 0 && rc == 0)); then rc=$s; fi
done
exit "$rc"
"#;

/// Kills the batch script's process group when dropped.
struct Group(u32);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: plain syscall on a process group this test created.
        unsafe { libc::killpg(self.0 as i32, libc::SIGKILL) };
    }
}

/// Runs the Slurm batch script on `template` with `env` (and a clean environment), bounded.
fn run_job(template: &Path, env: &[(&str, String)], dir: &Path) -> (ExitStatus, String) {
    let log = dir.join("sbatch.log");
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("deploy/slurm/ps-cluster.sbatch"))
        .arg(template)
        .env_clear()
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(dir.join("sbatch.err")).unwrap())
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t0 = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let _group = Group(child.id());
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return (st, read(&log) + &read(&dir.join("sbatch.err")));
        }
        assert!(
            t0.elapsed() < Duration::from_secs(240),
            "the job ran past 240 s:\n{}{}",
            read(&log),
            read(&dir.join("sbatch.err"))
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Two consecutive free ports (PS_PORT, PS_PORT + 1).
fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let a = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < 65535 && std::net::TcpListener::bind(("0.0.0.0", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports");
}

/// A credential file as the step writes it: 32 hex digits and a newline, mode 0600.
fn assert_written_by_the_step(f: &Path) -> String {
    let text = read(f);
    let mode = std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", f.display());
    assert!(
        text.len() == 33 && text.ends_with('\n'),
        "{}: {text:?}",
        f.display()
    );
    assert!(text.trim().bytes().all(|c| c.is_ascii_hexdigit()), "{text}");
    text
}

/// The Slurm job makes its credentials with the step (once per job folder: a requeued job
/// keeps them), gives the workers' token to every process through the job's config and the
/// shard credential to the shards: a clipped 2-shard run, which the shards refuse to start
/// without the shard credential, runs to its end.
#[test]
fn the_slurm_job_takes_its_credentials_from_the_credentials_step() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    let template = tmp.join("template.toml");
    std::fs::write(
        &template,
        format!(
            "[cluster]\nservers = [\"placeholder:1\"]\nworkers = 1\n\n[model]\nhidden = [16]\n\n[data]\ndir = {:?}\n\n[train]\nseed = 3\nglobal_batch = 32\nsteps = 5\nloss_reduction = \"mean\"\naggregation = \"mean\"\n\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\nclip_norm = 0.5\n\n[server]\nout_dir = \"out\"\nbarrier_timeout_secs = 120\nlinger_secs = 5\n\n[worker]\nthreads = 1\nconnect_timeout_secs = 60\n",
            repo().join("data/mnist").display().to_string()
        ),
    )
    .unwrap();
    // PS_BIN: a ps-server that logs its arguments, then is the real one; the real ps-worker
    // and ps-launch
    let bin = tmp.join("bin");
    std::fs::create_dir(&bin).unwrap();
    write_exe(&bin.join("srun"), SRUN);
    let calls = tmp.join("ps-server.calls");
    write_exe(
        &bin.join("ps-server"),
        &format!(
            "#!/bin/sh\necho \"$*\" >>{:?}\nexec {:?} \"$@\"\n",
            calls,
            bin_dir().join("ps-server")
        ),
    );
    for b in ["ps-worker", "ps-launch"] {
        std::os::unix::fs::symlink(bin_dir().join(b), bin.join(b)).unwrap();
    }
    let port = free_port_pair();
    let env = |generate_only: bool| {
        let mut env = vec![
            (
                "PATH",
                format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
            ),
            ("SLURM_SUBMIT_DIR", tmp.display().to_string()),
            ("SLURM_JOB_ID", "4343".into()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_CPUS_PER_TASK", "1".into()),
            ("PS_NODES", "127.0.0.1".into()),
            ("PS_SHARDS", "2".into()),
            ("PS_SHARD_CPUS", "1".into()),
            ("PS_PORT", port.to_string()),
            ("PS_BIN", bin.display().to_string()),
        ];
        if generate_only {
            env.push(("PS_GENERATE_ONLY", "1".into()));
        }
        env
    };
    let job = tmp.join("runs/slurm-4343");
    let (st, out) = run_job(&template, &env(true), &tmp);
    assert!(st.success(), "{st:?}\n{out}");
    assert_eq!(
        read(&calls),
        format!("credentials --dir {}\n", job.display()),
        "the job's only ps-server call so far is the credentials step"
    );
    let token = assert_written_by_the_step(&job.join("token"));
    let shard_token = assert_written_by_the_step(&job.join("shard-token"));
    assert_ne!(token, shard_token);
    let cfg = Config::load(&job.join("config.toml")).unwrap();
    assert_eq!(
        cfg.cluster.token,
        Some(ps_net::auth::Token::read(&job.join("token")).unwrap()),
        "the job's config names the step's workers' token"
    );
    // the whole job (a requeued one: the same folder): no second step, the same credentials,
    // and the clipped run needs the shard credential the step wrote
    let (st, out) = run_job(&template, &env(false), &tmp);
    let shard1 = read(&job.join("shard-1.log"));
    assert!(st.success(), "{st:?}\n{out}\nshard 1:\n{shard1}");
    assert_eq!(read(&job.join("token")), token);
    assert_eq!(read(&job.join("shard-token")), shard_token);
    let calls = read(&calls);
    assert_eq!(
        calls.matches("credentials").count(),
        1,
        "one credentials step per job folder:\n{calls}"
    );
    assert_eq!(calls.matches(" --shard ").count(), 2, "{calls}");
    let shard0 = read(&job.join("shard-0.log"));
    assert!(shard0.contains("training finished: 5 steps"), "{shard0}");
    for log in [&shard0, &shard1] {
        assert!(!log.contains("unauthenticated"), "{log}");
        assert!(!log.contains("needs the shard credential"), "{log}");
    }
}

/// The commands that make the Kubernetes Secrets (ps-base.yaml's header, deploy/README.md's
/// "Kubernetes"): the credentials step, then each Secret the manifests mount from the file the
/// step wrote, under the key the config reads; run here up to kubectl.
#[test]
fn the_kubernetes_secrets_are_made_from_the_credentials_step() {
    let manifest = read(&repo().join("deploy/k8s/ps-cluster.yaml"));
    for (key, path) in [
        ("token_file", "/etc/ps-secrets/token/token"),
        ("shard_token_file", "/etc/ps-secrets/shard-token/token"),
    ] {
        assert!(
            manifest.contains(&format!("{key} = \"{path}\"")),
            "the manifest's config reads {key} at {path}"
        );
    }
    for (secret, mount) in [
        ("ps-token", "/etc/ps-secrets/token"),
        ("ps-shard-token", "/etc/ps-secrets/shard-token"),
    ] {
        assert!(
            manifest.contains(&format!("secretName: {secret}")),
            "{secret}"
        );
        assert!(manifest.contains(&format!("mountPath: {mount}")), "{mount}");
    }
    for doc in ["deploy/k8s/ps-base.yaml", "deploy/README.md"] {
        let text = read(&repo().join(doc));
        let lines: Vec<&str> = text
            .lines()
            .map(|l| l.trim_start_matches('#').trim())
            .collect();
        let step = lines
            .iter()
            .position(|l| l.starts_with("ps-server credentials --dir "))
            .unwrap_or_else(|| panic!("{doc}: no credentials step"));
        let args: Vec<&str> = lines[step]
            .split('#')
            .next()
            .unwrap()
            .split_whitespace()
            .collect();
        assert_eq!(args[..3], ["ps-server", "credentials", "--dir"], "{doc}");
        let dir = args[3];
        // the step as written, here: it writes the files the Secrets are made from
        let tmp = tempfile::tempdir().unwrap();
        let out = Command::new(bin_dir().join("ps-server"))
            .args(&args[1..])
            .current_dir(tmp.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{doc}: {out:?}");
        for (secret, file) in [("ps-token", "token"), ("ps-shard-token", "shard-token")] {
            let made = lines
                .iter()
                .position(|l| {
                    l.starts_with(&format!("kubectl -n ps create secret generic {secret} "))
                })
                .unwrap_or_else(|| panic!("{doc}: no Secret {secret}"));
            assert!(
                made > step,
                "{doc}: {secret} made before the credentials step"
            );
            assert!(
                lines[made].ends_with(&format!(" --from-file=token={dir}/{file}")),
                "{doc}: {secret} from the step's {file} under the key token: {}",
                lines[made]
            );
            assert_written_by_the_step(&tmp.path().join(dir).join(file));
        }
        assert!(
            !text.contains("openssl rand"),
            "{doc}: a credential made by hand"
        );
    }
}
