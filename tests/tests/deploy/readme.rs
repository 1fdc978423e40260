//! deploy/README.md's examples and numbers against the files and binaries they describe.

use super::*;

/// The deploy README's override examples (`PS_SET_TRAIN_STEPS=100`, `--set train.steps=100`),
/// run on both shipped configs, which state `epochs`: the set key replaces it, and back.
#[test]
fn the_readmes_override_examples_work_on_the_shipped_configs() {
    let readme = read(&deploy().join("README.md"));
    assert!(
        readme.contains("`PS_SET_TRAIN_STEPS=100`") && readme.contains("`--set train.steps=100`"),
        "the examples this test runs are in deploy/README.md"
    );
    let slurm_dir = tempfile::tempdir().unwrap();
    for config in [
        deploy().join("mnist.toml"),
        deploy().join("slurm/template.toml"),
    ] {
        assert!(
            read(&config).contains("\nepochs = "),
            "{}",
            config.display()
        );
        let check = |env: &[(&str, &str)], args: &[&str]| {
            let out = Command::new(bin_dir().join("ps-server"))
                .arg("--config")
                .arg(&config)
                .args(["--shard", "0", "--check", "--data-dir"])
                .arg(repo().join("data/mnist"))
                .args(["--out-dir"])
                .arg(slurm_dir.path())
                .args(args)
                .envs(env.iter().copied())
                .output()
                .unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout).to_string(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            );
            assert!(
                out.status.success(),
                "{} {env:?} {args:?}: {stderr}",
                config.display()
            );
            (stdout, stderr)
        };
        let (stdout, stderr) = check(&[("PS_SET_TRAIN_STEPS", "100")], &[]);
        assert!(stdout.contains("; 100 steps"), "{stdout}");
        assert!(
            stderr.contains("train.steps = 100 (from PS_SET_TRAIN_STEPS; clears train.epochs"),
            "{stderr}"
        );
        let (stdout, _) = check(&[], &["--set", "train.steps=100"]);
        assert!(stdout.contains("; 100 steps"), "{stdout}");
        // and back to epochs, over the environment's steps
        let (stdout, _) = check(
            &[("PS_SET_TRAIN_STEPS", "100")],
            &["--set", "train.epochs=1"],
        );
        assert!(!stdout.contains("; 100 steps"), "{stdout}");
    }
}

/// Every number deploy/README.md states about the recipes is the number in the file it
/// describes: each row is (what the README says, the file, what the file says). A change to
/// either side without the other fails here.
#[test]
fn the_deploy_readmes_numbers_are_those_of_the_files() {
    let readme = read(&deploy().join("README.md"));
    // both sides wrap lines (the README's prose, YAML, a shell `\` continuation): compare
    // with single spaces
    let flat = |s: &str| {
        s.split_whitespace()
            .filter(|w| *w != "\\")
            .collect::<Vec<_>>()
            .join(" ")
    };
    let readme = flat(&readme);
    let rows: &[(&str, &str, &str)] = &[
        // Slurm: the batch script's #SBATCH lines and defaults, the template
        (
            "(default: 1 node × 2 tasks, 1 CPU per task, no GPU, 1 hour",
            "slurm/ps-cluster.sbatch",
            "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --cpus-per-task=1\n#SBATCH --time=01:00:00\n",
        ),
        (
            "`#SBATCH --signal=B:USR1@120` warns the batch script 120 s before",
            "slurm/ps-cluster.sbatch",
            "#SBATCH --signal=B:USR1@120\n",
        ),
        (
            "`PS_PORT` defaults to `20000 + (SLURM_JOB_ID mod 1000) * 40`",
            "slurm/ps-cluster.sbatch",
            "default_port=$((20000 + (10#$job_id % 1000) * 40))",
        ),
        (
            "(up to `PS_SHARD_RESTARTS` times, default 2;",
            "slurm/ps-cluster.sbatch",
            "shard_restarts=${PS_SHARD_RESTARTS:-2}",
        ),
        (
            "within `PS_SHARD_WAIT` seconds (default 60)",
            "slurm/ps-cluster.sbatch",
            "shard_wait=${PS_SHARD_WAIT:-60}",
        ),
        (
            "`PS_SHARD_CPUS`, default 1, CPUs each",
            "slurm/ps-cluster.sbatch",
            "shard_cpus=${PS_SHARD_CPUS:-1}",
        ),
        (
            "`[server] barrier_timeout_secs` (the template: 300 s)",
            "slurm/template.toml",
            "barrier_timeout_secs = 300 ",
        ),
        // Kubernetes: the Job, the config in its ConfigMap, the claim, the probes
        (
            "against `backoffLimit` (6)",
            "k8s/ps-cluster.yaml",
            "backoffLimit: 6 ",
        ),
        (
            "Shards wait for it up to `barrier_timeout_secs` (600 s here",
            "k8s/ps-cluster.yaml",
            "barrier_timeout_secs = 600 ",
        ),
        (
            "(`[checkpoint] every = 200`, on the claim",
            "k8s/ps-cluster.yaml",
            "every = 200 ",
        ),
        (
            "(`metrics_linger_secs = 120` in the template)",
            "k8s/ps-cluster.yaml",
            "metrics_linger_secs = 120 ",
        ),
        (
            "`ps-runs` (20 Gi, ReadWriteMany",
            "k8s/ps-base.yaml",
            "storage: 20Gi\n",
        ),
        (
            "shard container 1 CPU and 2 GiB",
            "k8s/ps-cluster.yaml",
            "cpu: \"1\"\n              memory: 2Gi\n",
        ),
        (
            "worker container 2 CPUs and 4 GiB (`[worker] threads = 2`)",
            "k8s/ps-cluster.yaml",
            "cpu: \"2\"\n              memory: 4Gi\n",
        ),
        (
            "worker container 2 CPUs and 4 GiB (`[worker] threads = 2`)",
            "k8s/ps-cluster.yaml",
            "threads = 2 ",
        ),
        (
            "scrape the shard pods (completion index below `PS_SHARDS`, here 2)",
            "k8s/ps-cluster.yaml",
            "- name: PS_SHARDS  # S\n              value: \"2\"\n",
        ),
        (
            "`startupProbe` (up to 5 min)",
            "k8s/ps-cluster.yaml",
            "periodSeconds: 5\n            failureThreshold: 60\n",
        ),
        (
            "--shard $i --listen 0.0.0.0:50051 --health-listen 0.0.0.0:50052 --metrics-listen 0.0.0.0:9090",
            "k8s/ps-cluster.yaml",
            "--shard \"$i\" --listen 0.0.0.0:50051 \\\n      --health-listen 0.0.0.0:50052 --metrics-listen 0.0.0.0:9090 $extra",
        ),
        (
            "all mode 0440 for the pod's group",
            "k8s/ps-cluster.yaml",
            "defaultMode: 288   # 0440",
        ),
        (
            "(uid/gid 65532, the image's user)",
            "k8s/ps-cluster.yaml",
            "runAsUser: 65532\n        runAsGroup: 65532\n",
        ),
        // the image
        (
            "`cargo build --release --locked --bins` in `rust:1.95-bookworm`",
            "Dockerfile",
            "FROM rust:1.95-bookworm AS build\n",
        ),
        (
            "a `debian:bookworm-slim` image, running as the numeric user 65532",
            "Dockerfile",
            "ARG RUNTIME_IMAGE=debian:bookworm-slim\n",
        ),
        (
            "a `debian:bookworm-slim` image, running as the numeric user 65532",
            "Dockerfile",
            "USER 65532:65532\n",
        ),
        // the offline checks
        (
            "for every V from 1.28.0 to 1.37.0",
            "../scripts/deploy-checks.sh",
            "for v in 1.28.0 1.29.0 1.30.0 1.31.0 1.32.0 1.33.0 1.34.0 1.35.0 1.36.0 1.37.0; do",
        ),
    ];
    for (said, file, there) in rows {
        assert!(
            readme.contains(&flat(said)),
            "deploy/README.md no longer says {said:?}: update this row with it"
        );
        let text = flat(&read(&deploy().join(file)));
        assert!(
            text.contains(&flat(there)),
            "deploy/README.md says {said:?}, but deploy/{file} has no {there:?}"
        );
    }
    // a worker that cannot reach a shard says so every CONNECT_LOG_EVERY
    let every = ps_net::client::CONNECT_LOG_EVERY.as_secs();
    assert!(
        readme.contains(&format!(
            "A worker that cannot reach a shard says so every {every} s"
        )),
        "deploy/README.md: the worker's connect message comes every {every} s"
    );
}

/// The deploy README's own example of the config generation, run as printed (only its job
/// folder moved into a temporary one): two shards on the named nodes, 8 workers, and a config
/// the real parser loads.
#[test]
fn the_deploy_readmes_config_generation_example_runs_as_printed() {
    let readme = read(&deploy().join("README.md"));
    let example = "PS_GENERATE_ONLY=1 PS_NODES=\"n1 n2\" PS_WORKERS=8 PS_JOB_DIR=/tmp/job \\\n    bash deploy/slurm/ps-cluster.sbatch && cat /tmp/job/config.toml";
    assert!(readme.contains(example), "the example this test runs");
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job");
    let cmd = example
        .replace("\\\n    ", "")
        .replace("/tmp/job", &job.display().to_string());
    let out = Command::new("bash")
        .args(["-c", &cmd])
        .current_dir(repo())
        .env_remove("SLURM_JOB_ID")
        .env_remove("SLURM_NTASKS")
        .env_remove("PS_PORT")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{cmd}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    // without a job id the ports are the fixed default, as the README says
    assert!(
        stdout.contains("servers = [\"n1:50051\", \"n2:50052\"]\nworkers = 8\n"),
        "{stdout}"
    );
    let cfg = Config::load(&job.join("config.toml")).unwrap();
    assert_eq!((cfg.num_shards(), cfg.cluster.workers), (2, 8));
}
