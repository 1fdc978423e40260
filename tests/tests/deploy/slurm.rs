//! The Slurm batch script run on this machine with a stand-in `srun` (`ps_tests::slurm`: the
//! batch script's runs, the stand-in and the job's environment): its config generation, whole
//! jobs, their failures, a lost shard restarted, and a run resumed in a new job.

use super::*;

#[test]
fn slurm_config_generation_gives_every_shard_its_node_and_port() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    let slurm_dir = deploy().join("slurm");
    let template = slurm_dir.join("template.toml");

    // the node list from a stand-in `scontrol show hostnames` (one name per line)
    let bin = tmp.join("bin");
    std::fs::create_dir(&bin).unwrap();
    write_exe(
        &bin.join("scontrol"),
        "#!/bin/sh\n[ \"$*\" = 'show hostnames gpu[01-02]' ] || { echo \"scontrol $*\" >&2; exit 1; }\nprintf 'gpu01\\ngpu02\\n'\n",
    );
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let job_dir = tmp.join("job");
    let (st, out, err, _) = run_sbatch(
        &[],
        &[
            ("PATH", path),
            ("PS_GENERATE_ONLY", "1".into()),
            ("SLURM_SUBMIT_DIR", repo().display().to_string()),
            ("SLURM_JOB_ID", "77".into()),
            ("SLURM_JOB_NODELIST", "gpu[01-02]".into()),
            ("SLURM_NTASKS", "8".into()),
            ("PS_JOB_DIR", job_dir.display().to_string()),
        ],
        &tmp,
        Duration::from_secs(30),
    );
    assert!(st.success(), "{st:?}\n{out}\n{err}");
    let generated = job_dir.join("config.toml");
    assert_eq!(out.lines().last(), Some(generated.to_str().unwrap()));
    let got = Config::load(&generated).unwrap_or_else(|e| panic!("{e}"));
    // ports from the job id (20000 + (77 mod 1000) * 40): concurrent jobs do not collide
    assert_eq!(
        got.cluster.servers,
        ["gpu01:23080", "gpu02:23081"],
        "one shard per node"
    );
    assert_eq!(got.cluster.workers, 8, "W = SLURM_NTASKS");
    // a per-job token (the template names none), readable by the job's user only
    let token = job_dir.join("token");
    assert_eq!(
        got.cluster.token,
        Some(ps_net::auth::Token::read(&token).unwrap())
    );
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&token).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "token mode {mode:o}");
    }
    // the outputs in a per-job folder under the template's out_dir
    assert_eq!(
        got.server.out_dir,
        slurm_dir.join("../../runs/slurm/slurm-77")
    );
    // everything else is the template's, relative paths resolved against the template's dir
    let mut want = Config::load(&template).unwrap();
    want.path = generated.clone();
    want.cluster.servers = got.cluster.servers.clone();
    want.cluster.workers = 8;
    want.cluster.token = got.cluster.token.clone();
    want.server.out_dir = want.server.out_dir.join("slurm-77");
    assert_eq!(got, want);
    assert!(got.data.dir.is_absolute() && got.server.out_dir.is_absolute());
    assert_eq!(
        got.data.dir.canonicalize().unwrap(),
        repo().join("data/mnist").canonicalize().unwrap()
    );

    // PS_NODES, more shards than nodes, another port; a template with a multi-line servers
    // array, comments, an absolute data dir and a relative out_dir
    let tdir = tmp.join("t");
    std::fs::create_dir(&tdir).unwrap();
    let custom = tdir.join("run.toml");
    std::fs::write(
        &custom,
        format!(
            "[cluster]   # the cluster\nservers = [\n  \"a:1\",  # first\n  \"b:2\",\n]\nworkers = 1\n\n[data]\ndir = {:?}\n\n[train]\nglobal_batch = 30\nsteps = 3\nloss_reduction = \"mean\"\naggregation = \"weighted\"\n\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n\n[server]\nout_dir = \"out\"\n",
            repo().join("data/mnist").display().to_string()
        ),
    )
    .unwrap();
    let job_dir2 = tmp.join("job2");
    let (st, out, err, _) = run_sbatch(
        &[&custom],
        &[
            ("PS_GENERATE_ONLY", "1".into()),
            ("PS_NODES", "n1 n2".into()),
            ("PS_SHARDS", "3".into()),
            ("PS_PORT", "6000".into()),
            ("PS_WORKERS", "3".into()),
            ("PS_JOB_DIR", job_dir2.display().to_string()),
            ("PS_BIN", bin_dir().display().to_string()),
        ],
        &tmp,
        Duration::from_secs(30),
    );
    assert!(st.success(), "{st:?}\n{out}\n{err}");
    assert!(
        out.contains("3 shard(s) at n1:6000 n2:6001 n1:6002; 3 worker(s)"),
        "{out}"
    );
    let got = Config::load(&job_dir2.join("config.toml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        got.cluster.servers,
        ["n1:6000", "n2:6001", "n1:6002"],
        "round-robin"
    );
    assert_eq!(got.cluster.workers, 3);
    assert_eq!(got.train.global_batch, 30);
    assert_eq!(got.data.dir, repo().join("data/mnist"), "absolute: kept");
    assert_eq!(
        got.server.out_dir,
        tdir.canonicalize().unwrap().join("out/slurm-local"),
        "no job id: the folder says so"
    );

    // refusals, each naming the problem
    let refusals: [(&[(&str, &str)], &str); 4] = [
        (&[("PS_NODES", "n1"), ("PS_SHARDS", "0")], "PS_SHARDS=0"),
        (&[("PS_NODES", "n1")], "PS_WORKERS=unset"),
        (&[("SLURM_NTASKS", "2")], "SLURM_JOB_NODELIST is not set"),
        (
            &[
                ("PS_NODES", "n1"),
                ("SLURM_NTASKS", "2"),
                ("PS_PORT", "65535"),
                ("PS_SHARDS", "2"),
            ],
            "exceed 65535",
        ),
    ];
    for (env, msg) in refusals {
        let mut env: Vec<(&str, String)> = env.iter().map(|(k, v)| (*k, v.to_string())).collect();
        env.push(("PS_GENERATE_ONLY", "1".into()));
        env.push(("PS_JOB_DIR", tmp.join("job3").display().to_string()));
        let (st, _, err, _) = run_sbatch(&[&custom], &env, &tmp, Duration::from_secs(30));
        assert_eq!(st.code(), Some(2), "{env:?}: {err}");
        assert!(err.contains(msg), "{env:?}: {err}");
    }
    let no_workers = tdir.join("bad.toml");
    std::fs::write(&no_workers, "[cluster]\nservers = [\"a:1\"]\n").unwrap();
    let (st, _, err, _) = run_sbatch(
        &[&no_workers],
        &[
            ("PS_GENERATE_ONLY", "1".into()),
            ("PS_NODES", "n1".into()),
            ("PS_WORKERS", "1".into()),
            ("PS_JOB_DIR", tmp.join("job4").display().to_string()),
        ],
        &tmp,
        Duration::from_secs(30),
    );
    assert!(!st.success());
    assert!(
        err.contains("no [cluster] servers and workers lines"),
        "{err}"
    );
}

#[test]
fn slurm_job_runs_a_whole_cluster_with_a_stand_in_srun() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    let template = small_template(&tmp, 120, None);
    let port = free_port_pair();
    let (st, out, err, took) = run_sbatch(
        &[&template],
        &fake_job_env(&tmp, port),
        &tmp,
        Duration::from_secs(180),
    );
    let job = tmp.join("runs/slurm-4242");
    let logs = |name: &str| std::fs::read_to_string(job.join(name)).unwrap_or_default();
    assert!(
        st.success(),
        "{st:?} after {took:?}\nstdout:\n{out}\nstderr:\n{err}\nshard 0:\n{}\nworker 0:\n{}",
        logs("shard-0.log"),
        logs("worker-0.log")
    );
    assert!(out.contains(&format!(
        "2 shard(s) at 127.0.0.1:{port} 127.0.0.1:{}; 2 worker(s)",
        port + 1
    )));
    assert!(out.contains("ps-cluster: finished"), "{out}");
    let cfg = Config::load(&job.join("config.toml")).unwrap();
    assert_eq!(
        cfg.cluster.servers,
        [
            format!("127.0.0.1:{port}"),
            format!("127.0.0.1:{}", port + 1)
        ]
    );
    assert!(
        logs("shard-0.log").contains("training finished: 5 steps"),
        "{}",
        logs("shard-0.log")
    );
    for i in 0..2 {
        let log = logs(&format!("shard-{i}.log"));
        assert!(
            log.contains(&format!("shard {i}: final weights (version 5) written to")),
            "{log}"
        );
    }
    for r in 0..2 {
        let log = logs(&format!("worker-{r}.log"));
        assert!(
            log.contains(&format!("rank {r} of 2, local rank {r}, from slurm")),
            "{log}"
        );
    }
    for i in 0..2 {
        assert!(
            tmp.join(format!("out/slurm-4242/shard-{i}.safetensors"))
                .exists(),
            "final weights of shard {i} in the job's folder under the template's out_dir"
        );
    }
    // merged and drawn at the end, as ps-launch does
    for f in ["model.safetensors", "curves.svg"] {
        assert!(tmp.join("out/slurm-4242").join(f).exists(), "{f}: {out}");
    }
    assert!(out.contains("every shard listens"), "{out}");
    for r in 0..2 {
        let log = logs(&format!("worker-{r}.log"));
        assert!(log.contains("run 4242 (run id from the Slurm job"), "{log}");
    }
    // what was asked of srun (the shard steps start in the background: any order): each
    // shard pinned to its node, the workers one GPU each
    let calls = read(&tmp.join("srun.log"));
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 3, "{calls:?}");
    let config = job.join("config.toml");
    for i in 0..2u16 {
        let shard = format!(
            "/ps-server --config {} --shard {i} --listen 0.0.0.0:{}",
            config.display(),
            port + i
        );
        let call = calls
            .iter()
            .find(|c| c.ends_with(&shard))
            .unwrap_or_else(|| panic!("no srun step runs ...{shard}: {calls:?}"));
        assert!(
            call.starts_with("--nodes=1 --ntasks=1 --nodelist=127.0.0.1 --overlap"),
            "{call}"
        );
    }
    let workers: Vec<&&str> = calls.iter().filter(|c| c.contains("/ps-worker ")).collect();
    assert_eq!(workers.len(), 1, "one worker step: {calls:?}");
    assert!(
        workers[0]
            .starts_with("--ntasks=2 --gpus-per-task=1 --cpus-per-task=1 --kill-on-bad-exit=1"),
        "{}",
        workers[0]
    );
    assert!(
        workers[0].ends_with(&format!(
            "/ps-worker --config {} --device auto",
            config.display()
        )),
        "{}",
        workers[0]
    );
}

#[test]
fn slurm_job_stops_the_shards_when_the_workers_fail() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    // a barrier timeout far beyond the bound below: only the script can end the shards early
    let template = small_template(&tmp, 600, None);
    let port = free_port_pair();
    let mut env = fake_job_env(&tmp, port);
    env.push(("PS_DEVICE", "no-such-device".into()));
    let (st, out, err, took) = run_sbatch(&[&template], &env, &tmp, Duration::from_secs(60));
    assert_eq!(st.code(), Some(1), "the workers' exit code\n{out}\n{err}");
    assert!(took < Duration::from_secs(60), "bounded: {took:?}");
    assert!(
        err.contains("the workers failed (exit 1), stopping the shards"),
        "{err}"
    );
    let worker = read(&tmp.join("runs/slurm-4242/worker-0.log"));
    assert!(worker.contains("no-such-device"), "{worker}");
    let pids = read(&tmp.join("srun.pids"));
    let pids: Vec<i32> = pids.lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(pids.len(), 4, "2 shards + 2 workers");
    for pid in pids {
        // SAFETY: signal 0 only checks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!alive, "process {pid} still runs after the job ended");
    }
}

#[test]
fn slurm_job_fails_within_the_wait_naming_a_shard_that_never_listens() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    let template = small_template(&tmp, 600, None);
    let port = free_port_pair();
    // stand-in binaries: a shard that starts but never listens; a worker that must not start
    let fake = tmp.join("fakebin");
    std::fs::create_dir(&fake).unwrap();
    // (the credentials step is the real one's)
    write_exe(
        &fake.join("ps-server"),
        &format!(
            "#!/bin/sh\n[ \"$1\" = credentials ] && exec {:?} \"$@\"\necho 'shard stuck before listening'\nexec sleep 600\n",
            bin_dir().join("ps-server")
        ),
    );
    write_exe(
        &fake.join("ps-worker"),
        "#!/bin/sh\necho started >\"$FAKE_WORKER_MARK\"\n",
    );
    let mut env = fake_job_env(&tmp, port);
    env.retain(|(k, _)| *k != "PS_BIN");
    env.push(("PS_BIN", fake.display().to_string()));
    env.push(("PS_SHARD_WAIT", "3".into()));
    env.push((
        "FAKE_WORKER_MARK",
        tmp.join("worker-ran").display().to_string(),
    ));
    let (st, out, err, took) = run_sbatch(&[&template], &env, &tmp, Duration::from_secs(60));
    assert_eq!(st.code(), Some(3), "{out}\n{err}");
    assert!(took < Duration::from_secs(30), "fails fast: {took:?}");
    let log = tmp.join("runs/slurm-4242/shard-0.log");
    assert!(
        err.contains(&format!(
            "shard 0 is not listening on 127.0.0.1:{port} after 3 s; see {}",
            log.display()
        )) && err.contains("shard stuck before listening"),
        "names the shard, its log and the log's end: {err}"
    );
    assert!(!tmp.join("worker-ran").exists(), "no worker started");
}

/// The Slurm recipe restarts a lost shard with `--recover`: shard 1's process killed with
/// SIGKILL mid-run (as the OOM killer does), the job still succeeds and its final weights equal
/// those of a job that lost nothing, bit for bit.
#[test]
fn slurm_job_restarts_a_lost_shard_and_ends_with_the_same_weights() {
    let job = |kill: bool| {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().canonicalize().unwrap();
        let template = small_template(&tmp, 120, None);
        let text = read(&template).replace("steps = 5\n", "steps = 150\n")
            + "\n[checkpoint]\nevery = 10\n";
        std::fs::write(&template, text).unwrap();
        let port = free_port_pair();
        let env = fake_job_env(&tmp, port);
        let killer = kill.then(|| {
            let tmp = tmp.clone();
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let log = tmp.join("runs/slurm-4242/shard-1.log");
                while !read_opt(&log).contains("checkpoint of version 40 written") {
                    assert!(t0.elapsed() < Duration::from_secs(90), "no progress");
                    std::thread::sleep(Duration::from_millis(10));
                }
                let pids = read_opt(&tmp.join("srun.pids"));
                let shard1 = pids
                    .lines()
                    .filter_map(|l| l.trim().parse::<i32>().ok())
                    .find(|p| {
                        let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                        cmd.contains("ps-server") && cmd.contains("--shard 1 ")
                    })
                    .expect("shard 1's process");
                // SAFETY: kill(2) on a process this test's job started.
                unsafe { libc::kill(shard1, libc::SIGKILL) };
            })
        });
        let (st, out, err, _) = run_sbatch(&[&template], &env, &tmp, Duration::from_secs(180));
        if let Some(k) = killer {
            k.join().unwrap();
        }
        let jobdir = tmp.join("runs/slurm-4242");
        assert!(
            st.success(),
            "{st:?}\n{out}\n{err}\nshard 1:\n{}",
            read_opt(&jobdir.join("shard-1.restart-1.log"))
        );
        if kill {
            assert!(
                err.contains(
                    "ps-cluster: shard 1 was lost (exit 137); starting it again with --recover"
                ),
                "{err}"
            );
            let log = read(&jobdir.join("shard-1.restart-1.log"));
            assert!(log.contains("every shard rolls back to version"), "{log}");
        }
        let cfg = Config::load(&jobdir.join("config.toml")).unwrap();
        ps_model::weights::read_shards(&cfg.server.out_dir, 2, cfg.layout().num_params())
            .unwrap()
            .0
    };
    let straight = job(false);
    let recovered = job(true);
    assert_eq!(straight.len(), recovered.len());
    assert!(
        straight
            .iter()
            .zip(&recovered)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the recovered job's weights differ from the straight job's"
    );
}

/// After a node loss (the whole job killed, SIGKILL) a new job with another id continues the
/// run with one documented setting, `PS_RESUME=1`: it finds the earlier run's folder and id by
/// itself, resumes from its checkpoints, finishes every step once, and exports
/// `model.safetensors` and `curves.svg`.
#[test]
fn slurm_resume_in_a_new_job_finds_the_earlier_run_by_itself_and_exports() {
    resume_in_a_new_job("1");
}

/// `PS_RESUME=<job id>`, the command a preempted job prints ("continue with: PS_RESUME=4242
/// sbatch ..."), continues that run as `PS_RESUME=1` does (it used to pick the run's folder
/// but start its shards without `--resume`).
#[test]
fn slurm_resume_of_a_named_job_continues_that_run() {
    resume_in_a_new_job("4242");
}

/// A job 4242 killed with SIGKILL past a few checkpoints, then job 4343 with `PS_RESUME=resume`:
/// it continues run 4242 in its folder to the last step and exports.
fn resume_in_a_new_job(resume: &str) {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    let template = small_template(&tmp, 120, None);
    // gRPC only: a killed run leaves no shared-memory boards for the next to meet
    let text = read(&template)
        .replace("steps = 5", "steps = 300")
        .replace("[cluster]\n", "[cluster]\ntransport = \"grpc\"\n");
    std::fs::write(&template, format!("{text}\n[checkpoint]\nevery = 2\n")).unwrap();
    // the first job, killed with everything it started once some checkpoints exist
    let env = fake_job_env(&tmp, free_port_pair());
    let mut cmd = Command::new("bash");
    cmd.arg(sbatch())
        .arg(&template)
        .env_clear()
        .current_dir(&tmp)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(tmp.join("first.stdout")).unwrap())
        .stderr(std::fs::File::create(tmp.join("first.stderr")).unwrap())
        .process_group(0);
    for (k, v) in &env {
        cmd.env(k, v);
    }
    let mut first = cmd.spawn().unwrap();
    let group = Group(first.id());
    let metrics = tmp.join("out/slurm-4242/metrics.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 8 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no progress:\n{}",
            read(&tmp.join("first.stderr"))
        );
        assert!(
            first.try_wait().unwrap().is_none(),
            "the first job ended early:\n{}",
            read(&tmp.join("first.stderr"))
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(group);
    let _ = first.wait();
    // the next job: another id, PS_RESUME=1, nothing else
    let mut env = fake_job_env(&tmp, free_port_pair());
    for (k, v) in env.iter_mut() {
        if *k == "SLURM_JOB_ID" {
            *v = "4343".into();
        }
    }
    env.push(("PS_RESUME", resume.into()));
    let (st, out, err, _) = run_sbatch(&[&template], &env, &tmp, Duration::from_secs(180));
    let shard0 = read(&tmp.join("runs/slurm-4343/shard-0.log"));
    assert!(st.success(), "{st:?}\n{out}\n{err}\n{shard0}");
    assert!(
        out.contains(&format!("PS_RESUME={resume}: continuing run 4242 in "))
            && out.contains("/out/slurm-4242"),
        "{out}"
    );
    assert!(shard0.contains("resuming at version "), "{shard0}");
    assert!(shard0.contains("run 4242"), "{shard0}");
    ps_tests::assert_metrics_steps(&read(&metrics), 300);
    for f in ["model.safetensors", "curves.svg"] {
        assert!(tmp.join("out/slurm-4242").join(f).exists(), "{f}: {out}");
    }
}
