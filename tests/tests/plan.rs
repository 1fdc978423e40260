//! `ps-plan`, run as a process: the questions users arrive with (issue 12), the printed config
//! lines, and that those lines, merged into a real config, train a cluster (in this process) to the weights
//! of the single-process recipe (computed separately, not from the planned config).

use ps_config::{Aggregation, Config, LossReduction};
use ps_launch::bin_dir;
use ps_tests::{Spec, cluster_weights, reference_weights, rel_diff};
use std::process::Command;

/// Float rounding only, after 20 steps (as in cluster.rs).
const TOL: f64 = 1e-5;

/// Runs `ps-plan ARGS`: (exit code, stdout, stderr).
fn ps_plan(args: &str) -> (i32, String, String) {
    let exe = bin_dir().join("ps-plan");
    let out = Command::new(&exe)
        .args(args.split_whitespace())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (build the binaries first: cargo build --release --bins)",
                exe.display()
            )
        });
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `ps-plan ARGS` that must succeed: its stdout.
fn plan_ok(args: &str) -> String {
    let (rc, out, err) = ps_plan(args);
    assert_eq!(rc, 0, "ps-plan {args}: exit {rc}\n{err}");
    out
}

fn assert_lines(out: &str, lines: &[&str]) {
    for l in lines {
        assert!(
            out.lines().any(|x| x == *l),
            "missing line {l:?} in:\n{out}"
        );
    }
}

/// The `key = value` lines of a TOML snippet per section (comments and comment lines dropped).
fn snippet_lines(snippet: &str) -> Vec<(String, String, String)> {
    let mut section = String::new();
    let mut out = Vec::new();
    for line in snippet.lines() {
        let line = line.split(" #").next().unwrap().trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line.starts_with('[') {
            section = line.to_string();
        } else {
            let key = line.split('=').next().unwrap().trim().to_string();
            out.push((section.clone(), key, line.to_string()));
        }
    }
    out
}

/// `base` with every line of `snippet` put into its section (replacing that key; the batch keys
/// replace each other, and an `[optimizer]` in the snippet replaces the whole table).
fn merge(base: &str, snippet: &str) -> String {
    let lines = snippet_lines(snippet);
    let mut out = Vec::new();
    let mut section = String::new();
    for line in base.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            section = t.to_string();
            out.push(line.to_string());
            out.extend(
                lines
                    .iter()
                    .filter(|(s, _, _)| *s == section)
                    .map(|(_, _, l)| l.clone()),
            );
            continue;
        }
        let key = t.split('=').next().unwrap().trim();
        let replaced = lines.iter().any(|(s, k, _)| {
            *s == section
                && (k == key
                    || section == "[optimizer]"
                    || (k.ends_with("_batch") && key.ends_with("_batch")))
        });
        if !replaced {
            out.push(line.to_string());
        }
    }
    out.join("\n") + "\n"
}

/// The planned lines merged into a small test config (2 shards, MLP 784-32-10, 20 steps), run
/// as a cluster in this process (`ps_tests::inproc`); compared with the recipe run in one process (`recipe`: W = 1). Returns
/// the largest relative weight difference.
fn planned_cluster_equals_recipe(planned: &str, recipe: Spec) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let base = Spec::default().toml(&dir.path().join("out"));
    let text = merge(&base, planned);
    let path = dir.path().join("config.toml");
    std::fs::write(&path, &text).unwrap();
    let cfg = Config::load(&path).unwrap_or_else(|e| panic!("{e}\n{text}"));
    ps_tests::inproc::run_in_process(&path);
    let got = cluster_weights(&cfg);

    // the recipe itself: one worker, so the reference is the recipe with no rescaling at all
    let rdir = tempfile::tempdir().unwrap();
    let (_, rcfg) = Spec {
        workers: 1,
        shards: 1,
        ..recipe
    }
    .write(rdir.path());
    let eq = rcfg.equivalence();
    assert!(eq.exact && eq.grad_scale == 1.0, "recipe config: {eq}");
    let want = reference_weights(&rcfg);
    let init = cfg.layout().init_range(cfg.train.seed, 0..got.len());
    assert!(
        rel_diff(&cfg, &init, &want) > 1e-3,
        "training moved the weights"
    );
    let d = rel_diff(&cfg, &got, &want);
    eprintln!(
        "planned config ({}) vs the recipe: largest relative weight difference {d:.3e}",
        cfg.equivalence()
    );
    d
}

#[test]
fn batch_16_lr_001_on_one_gpu_to_2_nodes_x_2_gpus() {
    let out =
        plan_ok("--batch 16 --lr 0.01 --loss mean --momentum 0.9 --nodes 2 --gpus-per-node 2");
    assert_lines(
        &out,
        &[
            "[cluster]",
            "workers = 4",
            "global_batch = 16    # per-worker batches 4, 4, 4, 4",
            "loss_reduction = \"mean\"",
            "aggregation = \"mean\"",
            "kind = \"sgd\"",
            "lr = 0.01",
            "momentum = 0.9",
            "# ps-server will print: equivalent to one process with batch 16, mean loss, lr 0.01",
        ],
    );
    let d = planned_cluster_equals_recipe(
        &out,
        Spec {
            global_batch: 16,
            config: Spec::base().sgd(0.01, 0.9),
            ..Spec::default()
        },
    );
    assert!(d < TOL, "relative difference {d:.3e} >= {TOL:e}");
}

#[test]
fn uneven_batch_30_over_4_workers_is_weighted_8_8_7_7() {
    let out = plan_ok("--batch 30 --lr 0.1 --loss mean --momentum 0.9 --workers 4");
    assert_lines(
        &out,
        &[
            "global_batch = 30    # per-worker batches 8, 8, 7, 7",
            "aggregation = \"weighted\"",
            "lr = 0.1",
            "# ps-server will print: equivalent to one process with batch 30, mean loss, lr 0.1",
        ],
    );
    assert!(out.contains("the slices are 8, 8, 7, 7"), "{out}");
    let d = planned_cluster_equals_recipe(
        &out,
        Spec {
            global_batch: 30,
            ..Spec::default()
        },
    );
    assert!(d < TOL, "relative difference {d:.3e} >= {TOL:e}");
}

#[test]
fn sum_loss_with_mean_aggregation_multiplies_the_lr_by_w() {
    let out =
        plan_ok("--batch 16 --lr 0.002 --loss sum --momentum 0.9 --workers 2 --aggregation mean");
    assert_lines(
        &out,
        &[
            "workers = 2",
            "loss_reduction = \"sum\"",
            "aggregation = \"mean\"",
            "lr = 0.004",
            "# ps-server will print: equivalent to one process with batch 16, sum loss, lr 0.002",
        ],
    );
    let d = planned_cluster_equals_recipe(
        &out,
        Spec {
            global_batch: 16,
            loss: LossReduction::Sum,
            config: Spec::base().sgd(0.002, 0.9),
            ..Spec::default()
        },
    );
    assert!(d < TOL, "relative difference {d:.3e} >= {TOL:e}");

    // without --aggregation, a sum loss plans sum aggregation at the recipe's lr; with AdamW a
    // gradient scale is not an lr scale, so forcing mean aggregation is refused
    let out = plan_ok("--batch 16 --lr 0.002 --loss sum --workers 2");
    assert_lines(&out, &["aggregation = \"sum\"", "lr = 0.002"]);
    let (rc, _, err) = ps_plan(
        "--batch 16 --lr 0.002 --loss sum --workers 2 --aggregation mean --optimizer adamw --weight-decay 0.01",
    );
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("a gradient scale is not an lr scale"), "{err}");
}

#[test]
fn dataparallel_summing_on_4_gpus_is_one_process_with_the_dataloader_batch() {
    let out = plan_ok("--batch 64 --lr 0.1 --loss mean --data-parallel 4 --workers 4");
    assert_lines(
        &out,
        &[
            "global_batch = 64    # per-worker batches 16, 16, 16, 16",
            "aggregation = \"mean\"",
            "lr = 0.1",
            "# ps-server will print: equivalent to one process with batch 64, mean loss, lr 0.1",
        ],
    );
    assert!(out.contains("IS the gradient of that one loss"), "{out}");
    // copying DataParallel's summing into the config is what the explanation catches
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = Spec {
        global_batch: 64,
        aggregation: Aggregation::Sum,
        config: Spec::base().sgd(0.1, 0.0),
        ..Spec::default()
    }
    .write(dir.path());
    let out = plan_ok(&format!("--config {}", path.display()));
    assert_lines(
        &out,
        &[
            "# ps-server will print: equivalent to one process with batch 64, mean loss, lr 0.4",
            "aggregation = \"mean\"",
            "lr = 0.1",
        ],
    );
    assert!(
        out.contains(
            "# warning: loss_reduction \"mean\" with aggregation \"sum\" makes the gradient 4 times"
        ),
        "{out}"
    );
    // the DDP recipe with AdamW: 2 processes of 8 are one process with batch 16
    let out = plan_ok(
        "--batch 8 --lr 0.001 --loss mean --ddp 2 --optimizer adamw --weight-decay 0.01 --workers 4",
    );
    assert_lines(
        &out,
        &[
            "global_batch = 16    # per-worker batches 4, 4, 4, 4",
            "kind = \"adamw\"",
            "weight_decay = 0.01",
            "# ps-server will print: equivalent to one process with batch 16, mean loss, lr 0.001",
        ],
    );
}

#[test]
fn keep_per_worker_batch_states_the_bigger_run_and_labels_the_heuristic() {
    let out = plan_ok(
        "--batch 32 --lr 0.1 --loss mean --momentum 0.9 --workers 4 --keep-per-worker-batch",
    );
    assert_lines(
        &out,
        &[
            "per_worker_batch = 32    # global batch 128",
            "lr = 0.1",
            "# ps-server will print: equivalent to one process with batch 128, mean loss, lr 0.1",
            "# [optimizer] lr = 0.4",
        ],
    );
    assert!(out.contains("This is NOT the recipe"), "{out}");
    assert!(out.contains("HEURISTIC, not an equivalence"), "{out}");
    let out = plan_ok(
        "--batch 32 --lr 0.001 --loss mean --optimizer adam --workers 4 --keep-per-worker-batch",
    );
    assert_lines(&out, &["# [optimizer] lr = 0.002"]);
}

#[test]
fn an_existing_config_is_explained() {
    let out = plan_ok(&format!(
        "--config {}/../deploy/mnist.toml",
        env!("CARGO_MANIFEST_DIR")
    ));
    assert_lines(
        &out,
        &["# ps-server will print: equivalent to one process with batch 128, mean loss, lr 0.1"],
    );
    // uneven mean: not exact, and the fix is weighted
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = Spec {
        global_batch: 30,
        ..Spec::default()
    }
    .write(dir.path());
    let out = plan_ok(&format!("--config {}", path.display()));
    assert_lines(
        &out,
        &[
            "# ps-server will print: approximately (not exactly) equivalent to one process with batch 30, mean loss, lr 0.1; it equals (up to float rounding) one process that averages the 4 workers' mean gradients with equal weights (mean of means)",
            "aggregation = \"weighted\"",
        ],
    );
}

#[test]
fn bad_input_exits_2_with_the_reason() {
    for (args, words) in [
        (
            "--batch 3 --lr 0.1 --loss mean --workers 4",
            "batch 3 over 4 workers: expected at least one sample per worker",
        ),
        (
            "--batch 16 --lr 0 --loss mean --workers 4",
            "--lr 0: expected a positive number",
        ),
        (
            "--batch 16 --lr -0.1 --loss mean --workers 4",
            "--lr -0.1: expected a positive number",
        ),
        (
            "--batch 16 --lr 0.1 --loss avg --workers 4",
            "invalid value 'avg' for '--loss <LOSS>'",
        ),
        (
            "--batch 16 --lr 0.1 --loss mean --workers 0",
            "--workers 0: expected at least one worker",
        ),
        (
            "--batch 16 --lr 0.1 --loss mean --nodes 2 --gpus-per-node 0",
            "--nodes 2 --gpus-per-node 0: expected at least one node",
        ),
        (
            "--batch 30 --lr 0.1 --loss mean --workers 4 --aggregation mean",
            "weights the samples of smaller slices more",
        ),
        (
            "--batch 16 --lr 0.1 --loss mean --workers 2 --optimizer adam --momentum 0.9",
            "--momentum/--nesterov are SGD settings",
        ),
        (
            "--config /nonexistent.toml",
            "/nonexistent.toml: cannot read",
        ),
    ] {
        let (rc, out, err) = ps_plan(args);
        assert_eq!(rc, 2, "ps-plan {args}: exit {rc}\n{out}{err}");
        assert!(out.is_empty(), "ps-plan {args} printed a plan: {out}");
        assert!(err.contains(words), "ps-plan {args}: {err}");
    }
    let (rc, out, _) = ps_plan("--version");
    assert_eq!(
        (rc, out.trim()),
        (0, concat!("ps-plan ", env!("CARGO_PKG_VERSION")))
    );
}

#[test]
fn the_readme_example_is_what_the_binary_prints() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let cmd = "--batch 16 --lr 0.01 --loss mean --momentum 0.9 --nodes 2 --gpus-per-node 2";
    let start = format!("$ target/release/ps-plan {cmd}\n");
    let at = readme
        .find(&start)
        .expect("README shows the 2 nodes x 2 GPUs example")
        + start.len();
    let shown = &readme[at..at + readme[at..].find("```").unwrap()];
    assert_eq!(
        shown,
        plan_ok(cmd),
        "README example differs from the output"
    );
}

/// `ps-plan <recipe> --config IN --out OUT` merges the planned lines into an existing config
/// (no duplicate keys, a planned `global_batch` clears the file's `per_worker_batch`), keeps
/// the rest of IN, and the result loads and states the recipe.
#[test]
fn plan_merges_into_an_existing_config() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        workers: 2,
        ..Spec::default()
    };
    let (input, before) = spec.write(dir.path());
    let text = std::fs::read_to_string(&input).unwrap();
    assert!(text.contains("global_batch = 32\n"), "{text}");
    std::fs::write(
        &input,
        text.replace("global_batch = 32\n", "per_worker_batch = 16\n"),
    )
    .unwrap();
    let out = dir.path().join("merged.toml");
    let (code, stdout, stderr) = ps_plan(&format!(
        "--batch 16 --lr 0.01 --loss mean --momentum 0.9 --workers 4 --config {} --out {}",
        input.display(),
        out.display()
    ));
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("# written: "), "{stdout}");
    let merged = Config::load(&out).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(merged.cluster.workers, 4);
    assert_eq!(
        (
            merged.train.global_batch,
            merged.train.batch_from_per_worker
        ),
        (16, false)
    );
    assert_eq!(merged.data.dir, before.data.dir, "the rest of IN kept");
    assert_eq!(merged.server.out_dir, before.server.out_dir);
    assert_eq!(merged.train.steps, before.train.steps);
    assert!(
        stdout.contains(
            "# ps-server will print: equivalent to one process with batch 16, mean loss, lr 0.01"
        ),
        "{stdout}"
    );
    // a recipe with --config but no --out says what is missing
    let (code, _, stderr) = ps_plan(&format!(
        "--batch 16 --lr 0.01 --loss mean --workers 4 --config {}",
        input.display()
    ));
    assert_eq!(code, 2);
    assert!(stderr.contains("give --out OUT"), "{stderr}");
}

/// One answer to "D2L sums, DDP averages", word for word in the README, `ps-plan
/// --data-parallel`, `ps-server --check` and the run's log (the last two with the warning of a
/// mean loss summed over the workers). They used to answer it in opposite-sounding ways
/// ("rescales your lr" / "Do not copy the summing"), and `--check` omitted the warning.
#[test]
fn one_answer_to_d2l_sums_ddp_averages_in_the_readme_ps_plan_check_and_the_log() {
    let answer = ps_config::SUM_OR_MEAN;
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    assert!(readme.contains(answer), "README.md lacks: {answer}");
    let out = plan_ok("--batch 64 --lr 0.1 --loss mean --data-parallel 4 --workers 4");
    // ps-plan wraps its comments at 100 columns: the sentence, its lines joined
    let unwrapped = out.replace("\n# ", " ");
    assert!(
        unwrapped.contains(answer),
        "ps-plan --data-parallel:\n{out}"
    );
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = Spec {
        shards: 1,
        aggregation: Aggregation::Sum,
        ..Spec::default()
    }
    .write(dir.path());
    let check = Command::new(bin_dir().join("ps-server"))
        .arg("--config")
        .arg(&path)
        .args(["--shard", "0", "--listen", "127.0.0.1:0", "--check"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{stdout}");
    let warning = stdout
        .lines()
        .find(|l| l.starts_with("warning: loss_reduction \"mean\" with aggregation \"sum\""))
        .unwrap_or_else(|| panic!("ps-server --check:\n{stdout}"));
    assert!(warning.contains(answer), "{warning}");
    // the run's log: the shard's start-up lines
    let mut cluster =
        ps_launch::LocalCluster::new(bin_dir(), path.clone(), Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], std::time::Duration::from_secs(60))
        .unwrap();
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    cluster.kill_all();
    let logged = log
        .lines()
        .find(|l| l.contains(" WARN ") && l.contains("with aggregation \"sum\" makes the gradient"))
        .unwrap_or_else(|| panic!("the run's log:\n{log}"));
    assert!(logged.contains(answer), "{logged}");
}

/// A config whose training the recipe does not have (momentum, a cosine schedule with warmup,
/// clipping) is not merged into a file that claims to be the recipe: each conflicting setting
/// is named with the recipe's value, exit 2, nothing written (issue 41: the written file kept
/// them and still said "equivalent to one process with batch 32, mean loss, lr 0.1"). The
/// same recipe with --momentum 0.9 into a config without the schedule is merged.
#[test]
fn plan_refuses_to_merge_training_the_recipe_does_not_have() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        workers: 2,
        config: Spec::base().sgd(0.1, 0.9).cosine(100, 0.0).clip_norm(1.0),
        ..Spec::default()
    };
    let (input, _) = spec.write(dir.path());
    let out = dir.path().join("merged.toml");
    let (code, stdout, stderr) = ps_plan(&format!(
        "--batch 32 --lr 0.1 --loss mean --workers 2 --config {} --out {}",
        input.display(),
        out.display()
    ));
    assert_eq!(code, 2, "{stdout}\n{stderr}");
    assert!(!out.exists(), "nothing written");
    for said in [
        "sets training the recipe does not have: [optimizer] sgd(momentum 0.9) (the recipe: sgd)",
        "[schedule] cosine",
        "(the recipe: constant 0.1)",
        "[optimizer] clip_norm = 1 (the recipe: none)",
        "nothing was written",
    ] {
        assert!(stderr.contains(said), "{said}:\n{stderr}");
    }
    let plain = Spec {
        workers: 2,
        config: Spec::base().sgd(0.1, 0.9),
        ..Spec::default()
    };
    let (input, _) = plain.write(dir.path());
    let (code, stdout, stderr) = ps_plan(&format!(
        "--batch 32 --lr 0.1 --loss mean --momentum 0.9 --workers 2 --config {} --out {}",
        input.display(),
        out.display()
    ));
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let merged = Config::load(&out).unwrap();
    assert_eq!(merged.optimizer.describe(), "sgd(momentum 0.9)");
}
