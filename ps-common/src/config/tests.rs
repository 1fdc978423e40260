//! Unit tests of config parsing and validation.

use super::*;

const GOOD: &str = r#"
[cluster]
servers = ["127.0.0.1:5000", "127.0.0.1:5001"]
workers = 4
[model]
hidden = [32]
[data]
dir = "../data/mnist"
[train]
seed = 3
global_batch = 30
steps = 20
loss_reduction = "mean"
aggregation = "weighted"
[optimizer]
kind = "sgd"
lr = 0.1
"#;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("/etc/ps/run.toml"))
}

#[test]
fn good_config_resolves() {
    let c = parse(GOOD).unwrap();
    assert_eq!(c.model.dims, [784, 32, 10]);
    assert_eq!(c.data.dir, Path::new("/etc/ps/../data/mnist"));
    assert_eq!(c.worker_batches(), [8, 8, 7, 7]);
    let e = c.equivalence();
    assert!(e.exact);
    assert_eq!(
        e.to_string(),
        "equivalent to one process with batch 30, mean loss, lr 0.1"
    );
    assert!(c.describe().contains("per-worker batches [8, 8, 7, 7]"));
}

#[test]
fn equivalences_and_warnings() {
    let c = parse(&GOOD.replace("\"weighted\"", "\"sum\"")).unwrap();
    let e = c.equivalence();
    assert_eq!(e.grad_scale, 4.0);
    assert!((e.lr - 0.4).abs() < 1e-12);
    assert!(e.warnings[0].contains("times 4"), "{:?}", e.warnings);
    let c = parse(&GOOD.replace("aggregation = \"weighted\"", "aggregation = \"mean\"")).unwrap();
    let e = c.equivalence();
    assert!(!e.exact);
    assert!(e.warnings[0].contains("uneven"));
    let c = parse(
        &GOOD
            .replace("\"weighted\"", "\"mean\"")
            .replace("\"mean\"\naggregation", "\"sum\"\naggregation"),
    )
    .unwrap();
    assert_eq!(c.equivalence().grad_scale, 0.25);
}

#[test]
fn errors_name_file_key_and_expectation() {
    let e = parse(&GOOD.replace("seed = 3", "seed = 3\nsede = 4"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("/etc/ps/run.toml: ") && e.contains("unknown field `sede`"),
        "{e}"
    );
    let e = parse(&GOOD.replace(
        "global_batch = 30",
        "global_batch = 30\nper_worker_batch = 8",
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("exactly one"), "{e}");
    let e = parse(&GOOD.replace("kind = \"sgd\"", "kind = \"rmsprop\""))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[optimizer] kind = \"rmsprop\": expected"),
        "{e}"
    );
    let e = parse(&GOOD.replace("workers = 4", "workers = 0"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[cluster] workers = 0"), "{e}");
    let e = parse(&GOOD.replace("global_batch = 30", "global_batch = 3"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("smaller than [cluster] workers = 4"), "{e}");
    let e = parse(&GOOD.replace("lr = 0.1", "lr = -1"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[optimizer] lr = -1"), "{e}");
    let e = parse(&format!("{GOOD}[worker]\ndevice = \"gpu0\"\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[worker] device = \"gpu0\": expected"), "{e}");
    let e = parse(&format!("{GOOD}[checkpoint]\nevery = 10\nkeep = 0\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[checkpoint] keep = 0: expected at least 1"),
        "{e}"
    );
    let e = parse(&GOOD.replace("workers = 4", "workers = 4\ntransport = \"tcp\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[cluster] transport = \"tcp\": expected"), "{e}");
    let e = parse(&GOOD.replace("workers = 4", "workers = 4\ntls_cert = \"c.pem\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected all three"), "{e}");
    let e = parse(&GOOD.replace(
        "workers = 4",
        "workers = 4\ntls_cert = \"c\"\ntls_key = \"k\"\ntls_ca = \"a\"",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("[cluster] tls: cannot read certificate /etc/ps/c"),
        "{e}"
    );
    let c = parse(&format!("{GOOD}[checkpoint]\nevery = 10\n")).unwrap();
    assert_eq!(c.checkpoint_dir(), c.server.out_dir.join("checkpoints"));
    assert!(c.describe().contains("checkpoint every 10 steps"));
    let e = parse("not toml [").unwrap_err().to_string();
    assert!(e.starts_with("/etc/ps/run.toml: "), "{e}");
}
