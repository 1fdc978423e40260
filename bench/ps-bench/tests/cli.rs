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

/// A port `p` on 127.0.0.1 with `p + 1` free too (the shard's and the raw peer's), as far as
/// binding both and letting them go can tell.
fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports on 127.0.0.1 in 100 tries");
}

/// What `crosshost.sh` with `PUSHPULL=1` runs on two hosts, here on 127.0.0.1: the client
/// pulls and pushes the large model on the data connection and moves the same bytes on raw
/// TCP, writes one row per direction with both times and their ratio, and both sides end by
/// themselves.
#[test]
fn xhost_client_times_the_data_connection_beside_raw_tcp() {
    let bin = env!("CARGO_BIN_EXE_ps-bench");
    let addr = format!("127.0.0.1:{}", free_port_pair());
    let mut serve = Command::new(bin)
        .args(["--xhost-serve", &addr])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let json = std::env::temp_dir().join(format!("ps-bench-xhost-{}.json", std::process::id()));
    let out = Command::new(bin)
        .args(["--xhost-client", &addr, "--xhost-repeats", "1", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    // the client said Q (or failed): the server ends on its own, within a bound
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let served = loop {
        if let Some(s) = serve.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = serve.kill();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(out.status.success(), "{out:?}");
    assert!(served.is_some_and(|s| s.success()), "server: {served:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("## Across hosts: the data connection against raw TCP"),
        "{text}"
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let rows = rows["xhost"].as_array().unwrap();
    // 784-4096-4096-10: 3,211,264 + 4,096 + 16,777,216 + 4,096 + 40,960 + 10 parameters
    let bytes = 4 * 20_037_642u64;
    // one repeat: a step pushed in pieces, then one pushed whole, each pulled before
    for (what, samples) in [("pull", 2), ("push", 1), ("push in pieces", 1)] {
        let r = rows.iter().find(|r| r["what"] == what).unwrap();
        assert_eq!(r["bytes"].as_u64(), Some(bytes), "{r}");
        for key in ["ms", "raw_ms", "ratio"] {
            let v = r[key].as_f64().unwrap();
            assert!(v.is_finite() && v > 0.0, "{what} {key}: {r}");
        }
        assert_eq!(r["ms_samples"].as_array().unwrap().len(), samples, "{r}");
        assert_eq!(
            r["raw_ms_samples"].as_array().unwrap().len(),
            samples,
            "{r}"
        );
    }
    let passes = rows.iter().filter(|r| r["pass"] == true).count();
    assert_eq!(passes, 2, "the snapshot and check passes: {rows:?}");
}

/// gpu-bench's CNN path, on the smallest CNN it takes: with a GPU (or under
/// `scripts/cuda-harness.sh`) one row per batch with the layout's parameters, the FLOPs of
/// 2·batch·(3·ΣM − M₁) and a step equal to the CPU's; without one, the one "no GPU" line, exit 0
/// and no JSON.
#[test]
fn gpu_bench_times_a_cnn_or_says_there_is_no_gpu() {
    let json = std::env::temp_dir().join(format!("gpu-bench-cnn-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&json);
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-bench"))
        .args([
            "--models",
            "none",
            "--cnns",
            "1x8x8:2:3::2",
            "--batches",
            "2,5",
        ])
        .args(["--steps", "1", "--warmup", "0", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    if text.starts_with("no GPU: ") {
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(!json.exists(), "no JSON without a GPU");
        return;
    }
    assert!(text.contains("| 1x8x8:2:3::2 | 58 | 5 |"), "{text}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(v["results"].as_array().map(Vec::len), Some(0), "{v}");
    let rows = v["cnn_results"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    // conv1 2·6·6·(1·9) = 648, fc 18·2 = 36 multiply-adds: 2·(3·684 − 648) = 2808 per sample
    for (r, batch) in rows.iter().zip([2u64, 5]) {
        assert_eq!(r["model"], "1x8x8:2:3::2", "{r}");
        assert_eq!(r["params"].as_u64(), Some(58), "{r}");
        assert_eq!(r["batch"].as_u64(), Some(batch), "{r}");
        let gflop = r["gflop_per_step"].as_f64().unwrap();
        assert!((gflop - 2808e-9 * batch as f64).abs() < 1e-12, "{r}");
        for key in ["step_ms", "batch_htod_ms", "full_step_ms"] {
            let ms = r[key].as_f64().unwrap();
            assert!(ms.is_finite() && ms > 0.0, "{key}: {r}");
        }
        assert!(r["max_rel_err_vs_cpu"].as_f64().unwrap() <= 1e-3, "{r}");
    }
}

/// A `--cnns` that is not a CNN is refused before any device is touched: exit 2, saying what
/// was expected.
#[test]
fn gpu_bench_refuses_a_bad_cnn() {
    for (arg, says) in [
        (
            "1x28x28:16-32:5:64",
            "expected CxHxW:CHANNELS:KERNEL:HIDDEN:CLASSES",
        ),
        ("1x28x28:8-8:3:64:10", "conv2: output height 11 is odd"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_gpu-bench"))
            .args(["--cnns", arg])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{arg}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{arg}: {err}");
    }
}
