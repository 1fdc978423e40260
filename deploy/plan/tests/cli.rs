//! `ps-plan` as a user runs it. (Being an integration test of this crate also makes `cargo test`
//! build `ps-plan`, which the workspace's tests start.)

use std::process::Command;

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
