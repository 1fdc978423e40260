//! The launcher's binaries as a user runs them. (Being an integration test of this crate also
//! makes `cargo test` build `ps-launch` and `ps-plan`, which the workspace's tests start.)

use std::process::Command;

#[test]
fn ps_launch_names_a_missing_config_and_exits_non_zero() {
    let out = Command::new(env!("CARGO_BIN_EXE_ps-launch"))
        .args(["--config", "/nonexistent/run.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/run.toml"), "{err}");
}

#[test]
fn ps_plan_refuses_a_batch_smaller_than_the_workers_with_exit_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_ps-plan"))
        .args([
            "--batch",
            "2",
            "--lr",
            "0.1",
            "--loss",
            "mean",
            "--workers",
            "4",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(!out.stderr.is_empty(), "{out:?}");
}
