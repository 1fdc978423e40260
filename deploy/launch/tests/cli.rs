//! The launcher's binary as a user runs it. (Being an integration test of this crate also
//! makes `cargo test` build `ps-launch`, which the workspace's tests start; `ps-plan` is built by
//! its own crate's test.)

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
