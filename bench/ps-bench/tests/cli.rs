//! The benchmark binary answers for itself. (Being an integration test of this crate also makes
//! `cargo test` build `ps-bench`, which the workspace's `--version` test starts.)

use std::process::Command;

#[test]
fn ps_bench_answers_version() {
    let out = Command::new(env!("CARGO_BIN_EXE_ps-bench"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("ps-bench "), "{text}");
}
