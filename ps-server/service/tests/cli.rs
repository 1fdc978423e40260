//! The `ps-server` binary refuses bad configs and arguments with one precise line and exit code 2.

use std::process::Command;

fn run(config: &str, extra: &[&str]) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ps-server"))
        .arg("--config")
        .arg(&path)
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const GOOD: &str = r#"
[cluster]
servers = ["127.0.0.1:0"]
workers = 2
[data]
dir = "/nonexistent/mnist"
[train]
global_batch = 32
steps = 5
loss_reduction = "mean"
aggregation = "mean"
[optimizer]
kind = "sgd"
lr = 0.1
"#;

#[test]
fn unknown_key_names_file_and_key() {
    let (code, err) = run(
        &GOOD.replace("lr = 0.1", "lr = 0.1\nlearning_rate = 3"),
        &["--shard", "0"],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("bad.toml") && err.contains("unknown field `learning_rate`"),
        "{err}"
    );
}

#[test]
fn bad_values_say_what_was_expected() {
    let (code, err) = run(
        &GOOD.replace("aggregation = \"mean\"", "aggregation = \"median\""),
        &["--shard", "0"],
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("unknown variant `median`") && err.contains("sum") && err.contains("weighted"),
        "{err}"
    );
    let (code, err) = run(
        &GOOD.replace("steps = 5", "steps = 5\nepochs = 2"),
        &["--shard", "0"],
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("steps and epochs are both set: expected exactly one"),
        "{err}"
    );
}

#[test]
fn shard_out_of_range_and_missing_data_are_errors() {
    let (code, err) = run(GOOD, &["--shard", "3"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--shard 3: expected a shard index in 0..1"),
        "{err}"
    );
    let (code, err) = run(GOOD, &["--shard", "0"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("/nonexistent/mnist") && err.contains("no train images"),
        "{err}"
    );
}
