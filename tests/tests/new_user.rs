//! What a new user meets (issue 17): ps-launch's summary on stdout, tidy paths, the note on
//! replaced ports, a previous run moved aside, the final evaluation in metrics.jsonl, the input
//! scaling in model.safetensors, `--check-reference`'s report and verdict, `--version` on every
//! binary, the world size's source in errors, and a public shard without any credential refused.

use ps_launch::bin_dir;
use ps_tests::Spec;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn small() -> Spec {
    Spec {
        shards: 2,
        workers: 2,
        steps: 12,
        ..Spec::default()
    }
}

fn launch(config: &std::path::Path, out_dir: &str) -> (String, String) {
    let out = Command::new(bin_dir().join("ps-launch"))
        .arg("--config")
        .arg(config)
        .args(["--out-dir", out_dir, "--check-reference"])
        .output()
        .expect("ps-launch runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(
        out.status.success(),
        "ps-launch failed:\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}

#[test]
fn a_launch_reads_right_and_a_second_one_moves_the_first_aside() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _cfg) = small().write(dir.path());
    let out = dir.path().join("out");
    // an untidy path, as `deploy/../runs/mnist` would be
    let untidy = format!("{}/sub/../out", dir.path().display());
    let (stdout, stderr) = launch(&path, &untidy);
    let tidy = out.display().to_string();
    // the summary on stdout, with tidy paths; the logs on stderr
    assert!(stdout.contains("ps-launch: weights ("), "{stdout}");
    assert!(
        stdout.contains(&format!("in {tidy}/model.safetensors")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("curves in {tidy}/curves.svg")),
        "{stdout}"
    );
    assert!(!stdout.contains("/../"), "{stdout}");
    assert!(
        !stdout.contains(" INFO "),
        "no log lines on stdout: {stdout}"
    );
    assert!(stderr.contains("INFO"), "logs on stderr: {stderr}");
    assert!(
        stderr.contains("replaced by free ports on this machine: 127.0.0.1:"),
        "{stderr}"
    );
    // the reference check: both comparisons, side by side, a verdict
    assert!(stdout.contains("after 1 step(s):"), "{stdout}");
    let early: f64 = stdout
        .lines()
        .find(|l| l.contains("after 1 step(s):"))
        .and_then(|l| l.split("difference ").nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("early difference in {stdout}"));
    assert!(early < 1e-5, "early-step difference {early}");
    assert!(stdout.contains("after 12 steps:"), "{stdout}");
    assert!(stdout.contains("final loss"), "{stdout}");
    assert!(stdout.contains("test accuracy"), "{stdout}");
    assert!(stdout.contains("why they drift"), "{stdout}");
    assert!(stdout.contains("verdict: the runs agree"), "{stdout}");
    // metrics.jsonl ends with the final evaluation, equal to what the shard logged
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["final"], true, "{last}");
    assert_eq!(last["step"], 12);
    assert_eq!(last["test_count"], 10000);
    let acc = last["test_acc"].as_f64().unwrap();
    assert!(acc > 0.5 && acc <= 1.0, "{acc}");
    let logged = format!("final test accuracy {:.2}%", acc * 100.0);
    assert!(stderr.contains(&logged), "{logged} in the log");
    // the model file states the input scaling
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let scaling = header["__metadata__"]["input_scaling"].as_str().unwrap();
    assert!(scaling.contains("pixel / 255"), "{scaling}");
    // a second run in the same folder: the first run's files move aside, said on stdout
    let (stdout2, _) = launch(&path, &tidy);
    let prev = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("previous-"))
        })
        .expect("a previous-* folder");
    assert!(
        stdout2.contains(&format!("moved to {}", prev.display())),
        "{stdout2}"
    );
    for f in [
        "model.safetensors",
        "curves.svg",
        "metrics.jsonl",
        "shard-0.safetensors",
        "shard-1.safetensors",
    ] {
        assert!(prev.join(f).exists(), "{f} moved aside");
        assert!(out.join(f).exists(), "{f} of the new run");
    }
    let new_metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(
        new_metrics
            .lines()
            .filter(|l| l.contains("\"final\""))
            .count(),
        1,
        "one run's story"
    );
}

#[test]
fn every_binary_answers_version() {
    for bin in [
        "ps-server",
        "ps-worker",
        "ps-launch",
        "ps-bench",
        "gpu-bench",
    ] {
        let out = Command::new(bin_dir().join(bin))
            .arg("--version")
            .output()
            .unwrap_or_else(|e| panic!("{bin}: {e}"));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{bin} --version");
        assert_eq!(
            text.trim(),
            format!("{bin} {}", env!("CARGO_PKG_VERSION")),
            "{bin}"
        );
    }
}

#[test]
fn a_world_size_error_names_its_own_source() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = small().write(dir.path());
    let out = Command::new(bin_dir().join("ps-worker"))
        .arg("--config")
        .arg(&path)
        .args(["--rank", "0", "--world-size", "3"])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("world size 3 (from flags (--world-size)) differs from [cluster] workers = 2"),
        "{err}"
    );
    // a rank from torchrun's environment and the world size from it too
    let out = Command::new(bin_dir().join("ps-worker"))
        .arg("--config")
        .arg(&path)
        .env("RANK", "0")
        .env("WORLD_SIZE", "5")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("world size 5 (from torchrun (WORLD_SIZE))"),
        "{err}"
    );
}

/// A shard outside loopback without any credential (neither `[cluster] token_file` nor a shard
/// credential) refuses to start, saying what to set; `[server] allow_unauthenticated = true`
/// starts it with a loud warning; with a shard credential but no token it starts and warns; on
/// loopback it starts quietly.
#[test]
fn a_public_shard_without_any_credential_refuses_to_start_unless_told() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = small().write(dir.path());
    let opt_out = ["--set", "server.allow_unauthenticated=true"];
    let credential = [(ps_net::auth::SHARD_TOKEN_ENV, "0123456789abcdef0123")];
    type Case<'a> = (
        &'a str,
        &'a [&'a str],
        &'a [(&'a str, &'a str)],
        Option<&'a str>,
    );
    let cases: [Case; 4] = [
        ("0.0.0.0:0", &[], &[], None),
        (
            "0.0.0.0:0",
            &opt_out,
            &[],
            Some("WITHOUT ANY CREDENTIAL ([server] allow_unauthenticated = true)"),
        ),
        (
            "0.0.0.0:0",
            &[],
            &credential,
            Some("outside loopback, without a token"),
        ),
        ("127.0.0.1:0", &[], &[], None),
    ];
    for (i, (listen, args, env, warning)) in cases.into_iter().enumerate() {
        let addr = dir.path().join("addr");
        let _ = std::fs::remove_file(&addr);
        let log = dir.path().join("shard.log");
        let mut shard = Command::new(bin_dir().join("ps-server"))
            .arg("--config")
            .arg(&path)
            .args(["--shard", "0", "--listen", listen, "--addr-file"])
            .arg(&addr)
            .args(args)
            .env_remove(ps_net::auth::SHARD_TOKEN_ENV)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let refused = i == 0;
        let start = Instant::now();
        let status = loop {
            if addr.exists() {
                break None;
            }
            if let Some(st) = shard.try_wait().unwrap() {
                break Some(st);
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "case {i}: shard neither listens nor exits"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        if status.is_none() {
            shard.kill().unwrap();
            shard.wait().unwrap();
        }
        let text = std::fs::read_to_string(&log).unwrap();
        if refused {
            assert_eq!(status.and_then(|s| s.code()), Some(2), "{listen}: {text}");
            assert!(
                text.contains("outside loopback, without any credential")
                    && text.contains("Set [cluster] token_file")
                    && text.contains("[server] shard_token_file or PS_SHARD_TOKEN")
                    && text.contains("[server] allow_unauthenticated = true"),
                "{listen}: {text}"
            );
            continue;
        }
        assert!(
            status.is_none(),
            "case {i}, {listen}: the shard listens: {text}"
        );
        match warning {
            Some(w) => assert!(
                text.contains(w) && text.contains("WARN"),
                "case {i}: {w}: {text}"
            ),
            None => assert!(!text.contains("outside loopback"), "case {i}: {text}"),
        }
    }
}

/// A worker without TLS against a TLS shard, and a TLS worker against a plain shard: the
/// worker's error says "TLS expected", not only "h2 protocol error".
#[test]
fn a_tls_mismatch_says_tls_expected() {
    let tls = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tls");
    for (shard_tls, worker_tls) in [(true, false), (false, true)] {
        let dir = tempfile::tempdir().unwrap();
        let spec = |tls_on: bool| Spec {
            shards: 1,
            workers: 1,
            config: {
                let base = Spec::base().connect_timeout_secs(2.0);
                if tls_on {
                    base.tls(
                        tls.join("shard.pem"),
                        tls.join("shard.key"),
                        tls.join("ca.pem"),
                    )
                } else {
                    base
                }
            },
            ..small()
        };
        let sdir = dir.path().join("shard");
        let wdir = dir.path().join("worker");
        std::fs::create_dir_all(&sdir).unwrap();
        std::fs::create_dir_all(&wdir).unwrap();
        let (spath, _) = spec(shard_tls).write(&sdir);
        let (wpath, _) = spec(worker_tls).write(&wdir);
        let mut cluster =
            ps_launch::LocalCluster::new(bin_dir(), spath, Some(dir.path().join("logs")));
        cluster
            .start_servers(1, &[], Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}"));
        // the probe a plain-text client makes when its first request is reset
        let rt = tokio::runtime::Runtime::new().unwrap();
        assert_eq!(
            rt.block_on(ps_net::neterr::speaks_tls(&cluster.addrs[0])),
            shard_tls,
            "speaks_tls of a shard with TLS {shard_tls}"
        );
        let out = Command::new(bin_dir().join("ps-worker"))
            .arg("--config")
            .arg(&wpath)
            .args(["--rank", "0", "--servers", &cluster.addrs[0]])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "shard TLS {shard_tls}: {err}");
        assert!(
            err.contains("TLS expected"),
            "shard TLS {shard_tls}, worker TLS {worker_tls}: {err}"
        );
        cluster.kill_all();
    }
}

#[test]
fn a_second_live_worker_of_a_rank_is_refused_and_a_restarted_one_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 1,
        workers: 2,
        ..small()
    };
    let (path, _) = spec.write(dir.path());
    let mut cluster =
        ps_launch::LocalCluster::new(bin_dir(), path.clone(), Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    let worker = |rank: &str| {
        let mut c = Command::new(bin_dir().join("ps-worker"));
        c.arg("--config")
            .arg(&path)
            .args(["--rank", rank, "--servers", &cluster.addrs[0]]);
        c
    };
    // rank 0 registers and waits at the barrier for rank 1: alive
    let first_log = dir.path().join("first.log");
    let mut first = worker("0")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&first_log).unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !std::fs::read_to_string(&first_log)
        .unwrap_or_default()
        .contains("registered with")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "rank 0 never registered: {}",
            std::fs::read_to_string(&first_log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = worker("0").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("rank 0 is held by a live worker"), "{err}");
    // the first one dies; a replacement of rank 0 is accepted and, with rank 1, ends the run
    first.kill().unwrap();
    first.wait().unwrap();
    let again_log = dir.path().join("again.log");
    let mut again = worker("0")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&again_log).unwrap())
        .spawn()
        .unwrap();
    let one = worker("1").output().unwrap();
    let again_ok = again.wait().unwrap().success();
    cluster.kill_all();
    let logs = || {
        let shard =
            std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap_or_default();
        let again = std::fs::read_to_string(&again_log).unwrap_or_default();
        format!(
            "rank 1:\n{}\nthe replacement of rank 0:\n{again}\nshard 0:\n{shard}",
            String::from_utf8_lossy(&one.stderr)
        )
    };
    assert!(one.status.success(), "{}", logs());
    assert!(again_ok, "{}", logs());
}

/// `--check-reference`'s early cluster runs what the run ran: the `--set` settings (here one
/// worker where the file says two) and the `--worker-arg`s (here `--device=auto`, which the
/// worker logs; the file's device is the default, `cpu`). It used to re-read the raw file (two
/// workers) and drop the worker arguments.
#[test]
fn the_reference_checks_early_cluster_keeps_set_and_worker_args() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _cfg) = small().write(dir.path());
    let out = dir.path().join("out");
    let o = Command::new(bin_dir().join("ps-launch"))
        .arg("--config")
        .arg(&path)
        .arg("--out-dir")
        .arg(&out)
        .args([
            "--check-reference",
            "--set",
            "cluster.workers=1",
            "--worker-arg=--device=auto",
        ])
        .output()
        .expect("ps-launch runs");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "ps-launch failed:\n{stderr}");
    let logs = out.join("reference-check/logs");
    let w0 = std::fs::read_to_string(logs.join("worker-0.log")).unwrap();
    assert!(w0.contains("device auto: "), "{w0}");
    assert!(
        !logs.join("worker-1.log").exists(),
        "the early cluster started the file's 2 workers, not --set cluster.workers=1"
    );
}

/// ps-launch gives each local worker its own local rank (which picks its GPU) and says how the
/// workers are spread over the GPUs, warning when two share one; without a GPU here, the plan
/// is checked through its log and the workers' placement lines (they run on the CPU). It used
/// to start every worker with local rank 0, all on cuda:0, silently.
#[test]
fn ps_launch_spreads_workers_over_the_gpus_and_says_when_two_share_one() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        workers: 3,
        ..small()
    };
    let (path, _cfg) = spec.write(dir.path());
    let out = dir.path().join("out");
    let o = Command::new(bin_dir().join("ps-launch"))
        .arg("--config")
        .arg(&path)
        .arg("--out-dir")
        .arg(&out)
        .args(["--gpus", "4,7"])
        .output()
        .expect("ps-launch runs");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "ps-launch failed:\n{stderr}");
    assert!(
        stderr.contains(
            "GPUs for CUDA workers, round robin over [4, 7] (from --gpus): worker 0 -> GPU 4, worker 1 -> GPU 7, worker 2 -> GPU 4"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("warning: workers 0, 2 share GPU 4 (3 workers, 2 GPU(s))"),
        "{stderr}"
    );
    for r in 0..3 {
        let log = std::fs::read_to_string(out.join(format!("logs/worker-{r}.log"))).unwrap();
        assert!(
            log.contains(&format!("rank {r} of 3, local rank {r}, from flags")),
            "{log}"
        );
    }
}

/// `--check-reference` on `aggregation = "mean"` over an uneven split (17/17/16), which the run
/// calls "approximately (not exactly) equivalent": it compares with what the run equals (the
/// mean of the workers' mean gradients), agrees, and says how far the global-batch process is
/// and why. It used to compare with the global batch, exit 1 with "DO NOT agree" and blame
/// float rounding.
#[test]
fn check_reference_on_uneven_mean_aggregation_compares_with_the_mean_of_means() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 1,
        workers: 3,
        global_batch: 50,
        steps: 4,
        aggregation: ps_config::Aggregation::Mean,
        ..Spec::default()
    };
    let (path, _cfg) = spec.write(dir.path());
    let out = dir.path().join("out");
    let (stdout, _) = launch(&path, out.to_str().unwrap());
    assert!(
        stdout.contains("approximately (not exactly) equivalent to one process with batch 50")
            && stdout.contains("it equals (up to float rounding) one process that averages the 3 workers' mean gradients"),
        "{stdout}"
    );
    let number = |line: &str, after: &str| -> f64 {
        line.split(after)
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("a number after {after:?} in {line}"))
    };
    let early = stdout
        .lines()
        .find(|l| l.contains("after 1 step(s):"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(number(early, "difference ") < 1e-5, "{stdout}");
    let compared = stdout
        .lines()
        .find(|l| l.contains("compared with:"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        compared.contains("(mean of means)") && compared.contains("not float rounding"),
        "{compared}"
    );
    // the global batch is beyond the tolerance: the weighting, not rounding
    assert!(
        number(compared, "differs from the cluster by ") > 1e-5,
        "{compared}"
    );
    assert!(stdout.contains("verdict: the runs agree"), "{stdout}");
}
