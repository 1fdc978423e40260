//! A config fuzzer: mutations of the shipped configs (deploy/*.toml, the k8s ConfigMap's
//! config.toml, the test configs) — numbers replaced by 0, -1, huge values, 1e308, NaN, inf;
//! strings emptied or garbage; keys dropped or duplicated; arrays emptied or given huge
//! widths — must be refused with a message or accepted, never panic, abort or hang:
//! - 200 mutations parsed in this process by `Config::parse` (a panic is caught and
//!   reported with the mutated text); for an accepted one, what the processes compute from
//!   it next (total steps, the durations the shard waits, the description) must not panic;
//! - 20 of them fed to the real `ps-server --check` with a 20 s limit each: exit 0, or exit
//!   2 with an `error: ` line naming the file; never a signal, a panic (101) or a hang.
//!
//! `PS_FUZZ_SEED` changes the mutations (default: a fixed seed, so a failure reproduces).

use ps_config::{Config, TestConfig};
use ps_launch::bin_dir;
use ps_tests::{Spec, mnist_dir};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const IN_PROCESS: usize = 200;
const PROCESS_RUNS: usize = 20;
const PROCESS_LIMIT: Duration = Duration::from_secs(20);

/// splitmix64: a small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The seeds: (path the text is parsed as, text).
fn seeds() -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for rel in ["deploy/mnist.toml", "deploy/slurm/template.toml"] {
        let p = repo().join(rel);
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{rel}: {e}"));
        out.push((p, text));
    }
    // the ConfigMap's config.toml (a YAML block scalar indented by 4)
    let yaml = std::fs::read_to_string(repo().join("deploy/k8s/ps-cluster.yaml")).unwrap();
    let block: Vec<&str> = yaml
        .lines()
        .skip_while(|l| l.trim() != "config.toml: |")
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        // the token and TLS files come from Secrets that exist only in the pods
        .filter(|l| !l.contains("/etc/ps-secrets/") && !l.starts_with("tls_domain"))
        .collect();
    assert!(block.len() > 10, "the ConfigMap's config.toml was found");
    out.push((PathBuf::from("/etc/ps/config.toml"), block.join("\n")));
    // test configs
    let dir = std::env::temp_dir().join("ps-config-fuzz");
    let test_path = dir.join("config.toml");
    out.push((test_path.clone(), Spec::default().toml(&dir.join("out"))));
    let rich = TestConfig::new()
        .data_dir(mnist_dir())
        .per_worker_batch(8)
        .epochs(2)
        .adam(0.01, 0.01, true)
        .cosine(5, 0.001)
        .checkpoint(5, 2)
        .metrics_addrs(&["127.0.0.1:0", "127.0.0.1:0"]);
    out.push((test_path.clone(), rich.toml()));
    out.push((
        test_path,
        TestConfig::new()
            .data_dir(mnist_dir())
            .step_decay(10, 0.5)
            .toml(),
    ));
    for (p, t) in &out {
        if let Err(e) = Config::parse(t, p) {
            panic!("seed {} is valid: {e}", p.display());
        }
    }
    out
}

const NUMBERS: &[&str] = &[
    "0",
    "-1",
    "1",
    "4611686018427387904",
    "9223372036854775807",
    "18446744073709551616",
    "4294967296",
    "2147483648",
    "1e308",
    "-1e308",
    "1e30",
    "1e20",
    "5e-324",
    "nan",
    "inf",
    "-inf",
    "0.0",
    "-0.0",
];
const STRINGS: &[&str] = &[
    "\"\"",
    "\"x\"",
    "\"\\u0000\"",
    "\"/dev/zero\"",
    "\"/\"",
    "\"::\"",
    "\"cuda:99999999999999999999\"",
    "\"127.0.0.1:99999\"",
];
const OTHERS: &[&str] = &[
    "[]",
    "[0]",
    "[4294967296]",
    "[2147483648]",
    "[100000, 100000]",
    "[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]",
    "[\"\"]",
    "true",
    "{}",
    "",
];

/// One mutation of `text`: a value replaced, a key dropped or duplicated, an array emptied,
/// a section header duplicated or dropped, or a line of garbage.
fn mutate(text: &str, rng: &mut Rng) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let keys: Vec<usize> = (0..lines.len())
        .filter(|&i| {
            let l = lines[i].trim_start();
            !l.starts_with('#') && !l.starts_with('[') && l.contains('=')
        })
        .collect();
    let headers: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].trim_start().starts_with('['))
        .collect();
    // structural mutations 1 in 5, value replacements (which reach validation) the rest
    match rng.below(20) {
        0 => {
            let i = keys[rng.below(keys.len())];
            lines.remove(i);
        }
        1 => {
            let i = keys[rng.below(keys.len())];
            let l = lines[i].clone();
            lines.insert(i, l);
        }
        2 => {
            let i = headers[rng.below(headers.len())];
            if rng.below(2) == 0 {
                lines.remove(i);
            } else {
                let l = lines[i].clone();
                lines.push(l);
            }
        }
        3 => {
            let i = rng.below(lines.len() + 1);
            let junk = rng.pick(&["=", "[", "x = ", "]]", "\u{0}", "key = 1"]);
            lines.insert(i, junk.to_string());
        }
        _ => {
            let i = keys[rng.below(keys.len())];
            let (key, value) = lines[i].split_once('=').unwrap();
            let value = value.split('#').next().unwrap().trim();
            let other_kind = rng.below(4) == 0;
            let pool = match (value.chars().next(), other_kind) {
                (Some('"'), false) => STRINGS,
                (Some('['), false) => OTHERS,
                (Some('"'), true) => OTHERS,
                (Some('['), true) => STRINGS,
                (_, false) => NUMBERS,
                (_, true) => OTHERS,
            };
            let new = rng.pick(pool);
            lines[i] = format!("{key}= {new}");
        }
    }
    lines.join("\n") + "\n"
}

fn mutations(n: usize) -> Vec<(PathBuf, String)> {
    let seed = std::env::var("PS_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_c0f1_u64);
    let mut rng = Rng(seed);
    let seeds = seeds();
    (0..n)
        .map(|_| {
            let (p, t) = &seeds[rng.below(seeds.len())];
            let mut t = t.clone();
            for _ in 0..=rng.below(2) {
                t = mutate(&t, &mut rng);
            }
            (p.clone(), t)
        })
        .collect()
}

/// What the processes do with an accepted config next, which must not panic either.
fn use_accepted(cfg: &Config) {
    let _ = cfg.describe();
    let _ = cfg.equivalence().to_string();
    if let Ok(total) = cfg.total_steps(60000) {
        let s = cfg.schedule_for(total);
        let _ = s.lr(total.saturating_sub(1));
    }
    let now = tokio::time::Instant::now();
    for secs in [
        cfg.server.barrier_warn_secs,
        cfg.server.barrier_timeout_secs,
        cfg.server.pull_timeout_secs,
        cfg.server.linger_secs,
        cfg.worker.connect_timeout_secs,
        cfg.worker.deadline_margin_secs,
    ] {
        let d = Duration::from_secs_f64(secs);
        let _ = now + d;
        let _ = std::time::Instant::now() + d;
    }
    let _ = cfg.layout().num_params();
    let _ = cfg.worker_batches();
}

#[test]
fn mutated_configs_are_refused_or_accepted_in_process_never_a_panic() {
    let mut accepted = 0;
    let mut refused = 0;
    for (i, (path, text)) in mutations(IN_PROCESS).into_iter().enumerate() {
        let t = Instant::now();
        let got = std::panic::catch_unwind(|| match Config::parse(&text, &path) {
            Ok(cfg) => {
                use_accepted(&cfg);
                None
            }
            Err(e) => Some(e.to_string()),
        });
        match got {
            Err(_) => panic!("mutation {i} panicked; config {}:\n{text}", path.display()),
            Ok(None) => accepted += 1,
            Ok(Some(e)) => {
                refused += 1;
                if std::env::var_os("PS_FUZZ_VERBOSE").is_some() {
                    eprintln!("refused: {e}");
                }
                let head = format!("{}: ", path.display());
                assert!(
                    e.starts_with(&head) && e.len() > head.len() + 10,
                    "mutation {i}: the error names the file and says what is wrong: {e}"
                );
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "mutation {i} took {:?}:\n{text}",
            t.elapsed()
        );
    }
    eprintln!("{IN_PROCESS} mutations: {accepted} accepted, {refused} refused");
    assert!(
        refused > IN_PROCESS / 4,
        "the mutations reach validation: {refused} refused"
    );
    assert!(
        accepted > 0,
        "some mutations stay valid: {accepted} accepted"
    );
}

#[test]
fn mutated_configs_make_ps_server_exit_0_or_2_with_a_message_never_crash_or_hang() {
    let exe = bin_dir().join("ps-server");
    assert!(
        exe.exists(),
        "{} not built (run `cargo build --release` or `cargo test --workspace`)",
        exe.display()
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("token"),
        "0123456789abcdef0123456789abcdef\n",
    )
    .unwrap();
    // every seed and mutation is run from the same directory, so relative paths resolve there;
    // `--data-dir` points at the shipped MNIST (an override, validated like the file's value)
    let all = mutations(IN_PROCESS);
    let step = IN_PROCESS / PROCESS_RUNS;
    let (mut ok, mut refused) = (0, 0);
    for (i, (_, text)) in all.into_iter().enumerate().filter(|(i, _)| i % step == 0) {
        let path = dir.path().join(format!("fuzz-{i}.toml"));
        std::fs::write(&path, &text).unwrap();
        let mut child = Command::new(&exe)
            .arg("--config")
            .arg(&path)
            .args(["--shard", "0", "--listen", "127.0.0.1:0", "--check"])
            .arg("--data-dir")
            .arg(mnist_dir())
            .arg("--out-dir")
            .arg(dir.path().join("out"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if started.elapsed() > PROCESS_LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "mutation {i}: ps-server --check still running after {PROCESS_LIMIT:?} (a hang):\n{text}"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        use std::io::Read;
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        match status.code() {
            Some(0) => ok += 1,
            Some(2) => {
                refused += 1;
                assert!(
                    stderr.contains("error: ") && stderr.contains(&format!("fuzz-{i}.toml")),
                    "mutation {i}: exit 2 names the file: {stderr}\n{text}"
                );
            }
            other => panic!(
                "mutation {i}: ps-server exited with {other:?} ({status}); stderr:\n{stderr}\nconfig:\n{text}"
            ),
        }
    }
    eprintln!("{PROCESS_RUNS} ps-server runs: {ok} valid, {refused} refused");
    assert_eq!(ok + refused, PROCESS_RUNS);
}

#[test]
fn ps_server_refuses_each_named_config_of_the_issue_with_exit_2() {
    let exe = bin_dir().join("ps-server");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let with = |config: TestConfig| {
        Spec {
            config,
            ..Spec::default()
        }
        .toml(&out)
    };
    let hidden = |hidden: Vec<usize>| {
        Spec {
            hidden,
            ..Spec::default()
        }
        .toml(&out)
    };
    for (text, want) in [
        (
            with(Spec::base().barrier_timeout_secs(1e308)),
            "[server] barrier_timeout_secs = 1e308: expected at most 604800 seconds",
        ),
        (
            with(Spec::base().pull_timeout_secs(1e30)),
            "[server] pull_timeout_secs = 1e30: expected at most 604800 seconds",
        ),
        (
            with(Spec::base().linger_secs(1e20)),
            "[server] linger_secs = 1e20: expected at most 604800 seconds",
        ),
        (
            hidden(vec![4294967296]),
            "[model] hidden[0] = 4294967296: expected at most 1048576",
        ),
        (
            hidden(vec![2147483648]),
            "[model] hidden[0] = 2147483648: expected at most 1048576",
        ),
        (
            hidden(vec![100000, 100000]),
            "parameters, expected at most 2147483647",
        ),
        (
            with(Spec::base().token_file("/dev/zero")),
            "token file /dev/zero: larger than 4096 bytes",
        ),
        (
            Spec::default()
                .toml(&out)
                .replace("steps = 20", "epochs = 4611686018427387904"),
            "[train] epochs = 4611686018427387904: expected at most 1099511627776",
        ),
    ] {
        let path = dir.path().join("config.toml");
        std::fs::write(&path, &text).unwrap();
        let out = Command::new(&exe)
            .arg("--config")
            .arg(&path)
            .args(["--shard", "0", "--listen", "127.0.0.1:0", "--check"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{want}: {stderr}");
        assert!(stderr.contains(want), "{want}: {stderr}");
    }
}
