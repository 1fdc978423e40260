//! A cluster started by hand, as `deploy/README.md` and the README's several-hosts section say
//! (`ps-server --config run.toml --shard i`, `ps-worker --config run.toml --rank r`), with no
//! `ps-launch` and no `PS_SHARD_TOKEN` in any environment: the guarantees of a launched cluster
//! hold. The credentials step (`ps-server credentials --dir DIR`) writes the run's workers'
//! token and shard credential; with them, a clipped run equals one process that clips. A config
//! that needs the shard credential and has none is refused at start (exit 2), naming that step.
//! A worker whose shard stops answering (SIGSTOP) exits with an error naming the shard and the
//! wait, within its deadline (`ps_net::client::call_deadline`).

use ps_config::Config;
use ps_launch::bin_dir;
use ps_tests::{Spec, cluster_weights, reference_weights, rel_diff};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A process of the cluster and the file its stderr goes to.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded) for the process to end.
    fn wait(&mut self, limit: Duration, what: &str) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            if t0.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "{what} still running after {:.0} s:\n{}",
                    limit.as_secs_f64(),
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) on a process this test started (it may be stopped: resume it).
            unsafe { libc::kill(self.child.id() as i32, libc::SIGCONT) };
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A command of `bin` with no credential or launcher variable inherited from the test's
/// environment: what a user's shell on another host has.
fn command(bin: &str) -> Command {
    let mut c = Command::new(bin_dir().join(bin));
    for v in [
        ps_config::credential::SHARD_TOKEN_ENV,
        "PS_TOKEN_FILE",
        "PS_RUN_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_JOB_ID",
        "JOB_COMPLETION_INDEX",
    ] {
        c.env_remove(v);
    }
    c.stdin(Stdio::null());
    c
}

fn spawn(mut c: Command, log: PathBuf) -> Proc {
    let child = c
        .stdout(std::fs::File::create(log.with_extension("out")).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Proc { child, log }
}

/// Waits (bounded) for a shard's `--addr-file`.
fn addr_of(file: &Path, shard: &mut Proc) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok(a) = std::fs::read_to_string(file)
            && a.ends_with('\n')
        {
            return a.trim().to_string();
        }
        if let Ok(Some(st)) = shard.child.try_wait() {
            panic!("the shard ended ({st}) before listening:\n{}", shard.log());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no address after 60 s:\n{}",
            shard.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The shards and workers of `cfg` (at `path`) started by hand, as the README says: the shards
/// listen on free ports, shard i > 0 is told shard 0's address, the workers the shards'.
fn start_by_hand(path: &Path, cfg: &Config) -> (Vec<Proc>, Vec<Proc>, Vec<String>) {
    start_by_hand_with(path, cfg, &|_, _| {})
}

/// [`start_by_hand`], each shard's command given to `shard_env` first (`index`, command).
fn start_by_hand_with(
    path: &Path,
    cfg: &Config,
    shard_env: &dyn Fn(usize, &mut Command),
) -> (Vec<Proc>, Vec<Proc>, Vec<String>) {
    let (shards, addrs) = start_shards(path, cfg, shard_env);
    let workers = start_workers(path, cfg, &addrs);
    (shards, workers, addrs)
}

/// The shards: on free ports, shard i > 0 told shard 0's address; they and their addresses.
fn start_shards(
    path: &Path,
    cfg: &Config,
    shard_env: &dyn Fn(usize, &mut Command),
) -> (Vec<Proc>, Vec<String>) {
    let dir = path.parent().unwrap();
    let mut shards = Vec::new();
    let mut addrs: Vec<String> = Vec::new();
    for i in 0..cfg.num_shards() {
        let file = dir.join(format!("shard-{i}.addr"));
        let mut c = command("ps-server");
        c.arg("--config")
            .arg(path)
            .args(["--shard", &i.to_string(), "--listen", "127.0.0.1:0"])
            .arg("--addr-file")
            .arg(&file);
        if let Some(a0) = addrs.first() {
            c.args(["--shard0", a0]);
        }
        shard_env(i, &mut c);
        let mut p = spawn(c, dir.join(format!("shard-{i}.log")));
        addrs.push(addr_of(&file, &mut p));
        shards.push(p);
    }
    (shards, addrs)
}

/// Every worker, told the shards' addresses.
fn start_workers(path: &Path, cfg: &Config, addrs: &[String]) -> Vec<Proc> {
    let dir = path.parent().unwrap();
    (0..cfg.cluster.workers)
        .map(|r| {
            let mut c = command("ps-worker");
            c.arg("--config").arg(path).args([
                "--rank",
                &r.to_string(),
                "--servers",
                &addrs.join(","),
            ]);
            spawn(c, dir.join(format!("worker-{r}.log")))
        })
        .collect()
}

/// The credentials step: `ps-server credentials --dir DIR`; the printed config lines.
fn credentials(dir: &Path) -> std::process::Output {
    command("ps-server")
        .args(["credentials", "--dir"])
        .arg(dir)
        .output()
        .unwrap()
}

/// The quoted value of `key = "..."` in `text`.
fn value_of(text: &str, key: &str) -> PathBuf {
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{key} = ")))
        .unwrap_or_else(|| panic!("no {key} in:\n{text}"));
    PathBuf::from(line.split('"').nth(1).unwrap())
}

fn clip_spec(config: ps_config::TestConfig) -> Spec {
    Spec {
        shards: 2,
        workers: 3,
        hidden: vec![32],
        global_batch: 48,
        steps: 20,
        config: config.clip_norm(0.5).log_every(1),
        ..Spec::default()
    }
}

/// The README's hand-started recipe with clipping, the credentials step included, runs to the
/// end and equals one process that clips (issue 41: the shards panicked at step 0).
#[test]
fn a_hand_started_clipped_cluster_with_the_credentials_step_equals_one_process() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("creds");
    let out = credentials(&creds);
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{out:?}");
    let token = value_of(&printed, "token_file");
    let shard_token = value_of(&printed, "shard_token_file");
    assert_eq!(
        (token.clone(), shard_token.clone()),
        (creds.join("token"), creds.join("shard-token"))
    );
    assert!(printed.contains("[cluster]\ntoken_file = ") && printed.contains("[server]\n"));
    let (a, b) = (
        std::fs::read_to_string(&token).unwrap(),
        std::fs::read_to_string(&shard_token).unwrap(),
    );
    for (f, text) in [(&token, &a), (&shard_token, &b)] {
        let mode = std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", f.display());
        assert_eq!(text.trim().len(), 32, "{text}");
        assert!(text.trim().bytes().all(|c| c.is_ascii_hexdigit()), "{text}");
    }
    assert_ne!(a, b, "two credentials, not one");
    // written once: a second run of the step replaces nothing
    let again = credentials(&creds);
    assert_eq!(again.status.code(), Some(2), "{again:?}");
    assert!(String::from_utf8_lossy(&again.stderr).contains("token exists"));
    assert_eq!(std::fs::read_to_string(&token).unwrap(), a);

    let spec = clip_spec(
        Spec::base()
            .token_file(&token)
            .shard_token_file(&shard_token),
    );
    let (path, cfg) = spec.write(dir.path());
    let (shards, workers, _) = start_by_hand(&path, &cfg);
    for (what, mut p) in workers
        .into_iter()
        .map(|p| ("worker", p))
        .chain(shards.into_iter().map(|p| ("shard", p)))
    {
        let st = p.wait(Duration::from_secs(300), what);
        assert!(st.success(), "{what}: {st}:\n{}", p.log());
        assert!(!p.log().contains("panicked"), "{}", p.log());
        assert!(!p.log().contains("unauthenticated"), "{}", p.log());
    }
    let d = rel_diff(&cfg, &cluster_weights(&cfg), &reference_weights(&cfg));
    assert!(
        d < 1e-5,
        "relative difference from one process that clips {d:.3e}"
    );
    let metrics = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl")).unwrap();
    let coefs: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("clip_coef").and_then(serde_json::Value::as_f64))
        .collect();
    assert_eq!(coefs.len(), 20, "{metrics}");
    assert!(
        coefs.iter().filter(|&&c| c < 1.0).count() >= 15,
        "{coefs:?}"
    );
}

/// What needs the shard credential and has none is refused at start, exit 2, naming the step
/// that fixes it, before the shard writes or listens.
#[test]
fn a_config_that_needs_the_shard_credential_without_one_is_refused_naming_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = clip_spec(Spec::base()).write(dir.path());
    let refused = |extra: &[&str]| {
        let out = command("ps-server")
            .arg("--config")
            .arg(&path)
            .args(["--shard", "1", "--listen", "127.0.0.1:0"])
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("needs the shard credential, and none is set ([server] shard_token_file, or PS_SHARD_TOKEN): run `ps-server credentials --dir DIR` once for the run"),
            "{stderr}"
        );
        stderr
    };
    let e = refused(&[]);
    assert!(
        e.contains("shard 1: [optimizer] clip_norm over 2 shards"),
        "{e}"
    );
    assert!(!cfg.server.out_dir.exists(), "nothing written");
    // without clipping, a replacement (--recover) needs it too
    let plain = Spec {
        config: Spec::base(),
        ..clip_spec(Spec::base())
    };
    let dir2 = tempfile::tempdir().unwrap();
    let (path2, _) = plain.write(dir2.path());
    let out = command("ps-server")
        .arg("--config")
        .arg(&path2)
        .args(["--shard", "1", "--listen", "127.0.0.1:0", "--recover"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("shard 1: --recover (the replacement orders the other shards to roll back) needs the shard credential"),
        "{stderr}"
    );
}

/// Shard 1 frozen (SIGSTOP) mid-run: shard 0 fails the run at its barrier timeout and exits;
/// every worker, started by hand, exits within its call deadline with an error naming shard 1,
/// its address and the wait (issue 41: they stayed alive over 200 s, logging nothing).
#[test]
fn hand_started_workers_whose_shard_is_frozen_exit_naming_it_within_their_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("creds");
    assert!(credentials(&creds).status.success());
    // a model large enough that the run is still going when shard 1 is frozen
    let spec = Spec {
        shards: 2,
        workers: 2,
        hidden: vec![1024, 1024],
        global_batch: 32,
        steps: 2000,
        config: Spec::base()
            .token_file(creds.join("token"))
            .shard_token_file(&creds.join("shard-token"))
            .barrier_timeout_secs(2.0)
            .pull_timeout_secs(2.0)
            .connect_timeout_secs(5.0)
            .deadline_margin_secs(3.0)
            .log_every(1),
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir.path());
    let deadline = ps_net::client::call_deadline(&cfg);
    assert_eq!(deadline, Duration::from_secs(7), "max(2, 2 x 2) + 3 s");
    let (mut shards, workers, addrs) = start_by_hand(&path, &cfg);
    let metrics = cfg.server.out_dir.join("metrics.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 5 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no step 5 after 120 s"
        );
        // a run that failed before step 5 fails the test at once, with the reason
        for p in shards.iter_mut() {
            if let Ok(Some(st)) = p.child.try_wait() {
                panic!("a shard ended ({st}) before step 5:\n{}", p.log());
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill(2) on a process this test started.
    unsafe { libc::kill(shards[1].child.id() as i32, libc::SIGSTOP) };
    let frozen = Instant::now();
    let at = std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count());
    assert!(at < 1500, "shard 1 frozen mid-run, after step {at}");
    // shard 0: the barrier timeout, then at most the stop's 5 s and the margin of a loaded box
    let st = shards[0].wait(Duration::from_secs(2 + 30), "shard 0");
    assert_eq!(st.code(), Some(1), "{}", shards[0].log());
    assert!(
        shards[0].log().contains("run failed"),
        "{}",
        shards[0].log()
    );
    for (r, mut w) in workers.into_iter().enumerate() {
        let left = (deadline + Duration::from_secs(30)).saturating_sub(frozen.elapsed());
        let st = w.wait(left, "a worker");
        let log = w.log();
        assert!(!st.success(), "worker {r}: {st}:\n{log}");
        assert!(
            log.contains(&format!("shard 1 at {} did not answer", addrs[1]))
                && log.contains("within 7 s (the worker's deadline")
                && log.contains("[worker] deadline_margin_secs = 3 s)"),
            "worker {r}:\n{log}"
        );
        eprintln!(
            "worker {r} exited {:.1} s after shard 1 froze",
            frozen.elapsed().as_secs_f64()
        );
    }
}

/// Shards whose shard credentials differ (a config or a secret copied wrong): shard 0 refuses
/// shard 1's gradient norms, shard 1's step 0 ends with the refusal named (no panic, no retry
/// until a timeout), and every process exits: the shards within 2 x barrier_timeout_secs +
/// deadline_margin_secs of the failure plus their stop, the workers told by the refusals.
#[test]
fn shards_with_different_shard_credentials_fail_the_clipped_run_naming_the_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let spec = clip_spec(
        Spec::base()
            .barrier_timeout_secs(2.0)
            .pull_timeout_secs(2.0)
            .connect_timeout_secs(5.0)
            .deadline_margin_secs(3.0),
    );
    let (path, cfg) = spec.write(dir.path());
    let tokens = [
        "0123456789abcdef0123456789abcdef",
        "fedcba9876543210fedcba9876543210",
    ];
    let t0 = Instant::now();
    let (shards, workers, _) = start_by_hand_with(&path, &cfg, &|i, c| {
        c.env(ps_config::credential::SHARD_TOKEN_ENV, tokens[i]);
    });
    for (what, mut p) in shards
        .into_iter()
        .map(|p| ("shard", p))
        .chain(workers.into_iter().map(|p| ("worker", p)))
    {
        // the failure comes at step 0: 2 x 2 + 3 s, the stop's 5 s, a loaded machine's 30 s
        let st = p.wait(Duration::from_secs(45), what);
        let log = p.log();
        assert!(!st.success(), "{what}: {st}:\n{log}");
        assert!(!log.contains("panicked"), "{log}");
    }
    let shard1 = std::fs::read_to_string(dir.path().join("shard-1.log")).unwrap();
    assert!(
        shard1.contains("step 0: gradient clipping ([optimizer] clip_norm) needs the gradient norm of every shard: shard 0 refused the gradient norms of step 0: Unauthenticated"),
        "{shard1}"
    );
    assert!(shard1.contains("run failed"), "{shard1}");
    eprintln!(
        "every process ended {:.1} s after the start",
        t0.elapsed().as_secs_f64()
    );
}

/// Gradient norms sent to shard 0 with the shard credential, but for a step past shard 0's
/// version or for another cluster generation, are refused at once and change nothing: the run
/// then goes on and equals one process that clips (issue 41: a forged round for a later step
/// replaced the real one, and the shards panicked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn norms_for_another_step_or_generation_are_refused_and_change_nothing() {
    use ps_proto::pb::ClipNormRequest;
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("creds");
    assert!(credentials(&creds).status.success());
    let spec = clip_spec(
        Spec::base()
            .token_file(creds.join("token"))
            .shard_token_file(&creds.join("shard-token")),
    );
    let (path, cfg) = spec.write(dir.path());
    // the shards first: the workers start after the forged calls
    let (mut shards, addrs) = start_shards(&path, &cfg, &|_, _| {});
    let sec = ps_net::auth::ClientSecurity::of(&cfg);
    let mut c = ps_net::client::ShardClient::connect(0, &addrs[0], &sec, Duration::from_secs(10))
        .await
        .unwrap();
    let credential = std::fs::read_to_string(creds.join("shard-token")).unwrap();
    let spans = ps_model::layout::shard_ranges(cfg.layout().num_params(), 2);
    let t = ps_model::clip::tensors_of(&cfg.spec(), &spans[1]);
    let forged = |step: u64, generation: u64| {
        let mut r = tonic::Request::new(ClipNormRequest {
            shard: 1,
            step,
            generation,
            first_tensor: t.start as u32,
            sq: vec![1e6; t.len()],
        });
        r.metadata_mut().insert(
            ps_net::auth::SHARD_TOKEN_KEY,
            credential.trim().parse().unwrap(),
        );
        r
    };
    let t0 = Instant::now();
    let e = c.rpc().clip_norm(forged(5, 0)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert_eq!(
        e.message(),
        "gradient norms of step 5 from shard 1: shard 0 is at version 0; expected a step not past it"
    );
    let e = c.rpc().clip_norm(forged(0, 3)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert_eq!(
        e.message(),
        "gradient norms from shard 1 of generation 3: this shard serves generation 0"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "refused at once");
    let mut workers = start_workers(&path, &cfg, &addrs);
    for p in workers.iter_mut().chain(shards.iter_mut()) {
        let st = p.wait(Duration::from_secs(300), "a process");
        assert!(st.success(), "{st}:\n{}", p.log());
    }
    let d = rel_diff(&cfg, &cluster_weights(&cfg), &reference_weights(&cfg));
    assert!(
        d < 1e-5,
        "relative difference from one process that clips {d:.3e}"
    );
}
