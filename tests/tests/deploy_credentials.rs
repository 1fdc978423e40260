//! The Slurm recipe and the Kubernetes manifests take a run's credentials from the credentials
//! step (`ps-server credentials --dir DIR`, deploy/README.md "Credentials"), as every cluster
//! started without `ps-launch` must. The Slurm job is run here with the stand-in `srun` of
//! `ps_tests::slurm` (shared with `deploy.rs`) and a
//! `ps-server` that logs its arguments before running the real one; the Kubernetes commands
//! that make the Secrets are read from the manifests' and the README's text and run up to the
//! step.

use ps_config::Config;
use ps_launch::bin_dir;
use ps_tests::slurm::{fake_job_env, free_port_pair, repo, run_sbatch, small_template, write_exe};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The longest a run of the batch script may take (a loaded machine included).
const JOB_LIMIT: Duration = Duration::from_secs(240);

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
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
    let template = small_template(&tmp, 120, Some(0.5));
    // the stand-in srun in tmp/bin (`fake_job_env`); beside it, as PS_BIN, a ps-server that
    // logs its arguments, then is the real one, and the real ps-worker and ps-launch
    let job_env = fake_job_env(&tmp, free_port_pair());
    let bin = tmp.join("bin");
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
    let env = |generate_only: bool| {
        // a CPU job; PS_BIN the logging ps-server's folder
        let mut env: Vec<(&str, String)> = job_env
            .iter()
            .filter(|(k, _)| *k != "SLURM_GPUS_PER_TASK")
            .cloned()
            .collect();
        env.push(("PS_BIN", bin.display().to_string()));
        if generate_only {
            env.push(("PS_GENERATE_ONLY", "1".into()));
        }
        env
    };
    let job = tmp.join("runs/slurm-4242");
    let (st, out, err, _) = run_sbatch(&[&template], &env(true), &tmp, JOB_LIMIT);
    assert!(st.success(), "{st:?}\n{out}{err}");
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
    let (st, out, err, _) = run_sbatch(&[&template], &env(false), &tmp, JOB_LIMIT);
    let shard1 = read(&job.join("shard-1.log"));
    assert!(st.success(), "{st:?}\n{out}{err}\nshard 1:\n{shard1}");
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
