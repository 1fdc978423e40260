//! Unit tests of config parsing and validation.

use super::limits::MAX_SECS;
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

fn refused(text: &str) -> String {
    parse(text).unwrap_err().to_string()
}

fn with_server(line: &str) -> String {
    format!("{GOOD}[server]\n{line}\n")
}

#[test]
fn durations_past_their_maximum_are_refused_with_key_file_value_and_maximum() {
    for (line, want) in [
        (
            "barrier_timeout_secs = 1e308",
            "[server] barrier_timeout_secs = 1e308: expected at most 604800 seconds (7 days)",
        ),
        (
            "pull_timeout_secs = 1e30",
            "[server] pull_timeout_secs = 1e30: expected at most 604800 seconds (7 days)",
        ),
        (
            "linger_secs = 1e20",
            "[server] linger_secs = 1e20: expected at most 604800 seconds (7 days)",
        ),
        (
            "barrier_warn_secs = nan",
            "[server] barrier_warn_secs = NaN: expected a positive number of seconds",
        ),
        (
            "linger_secs = inf",
            "[server] linger_secs = inf: expected a positive number of seconds",
        ),
    ] {
        let e = refused(&with_server(line));
        assert_eq!(e, format!("/etc/ps/run.toml: {want}"), "{line}");
    }
    let e = refused(&format!("{GOOD}[worker]\nconnect_timeout_secs = 604801\n"));
    assert!(
        e.contains("[worker] connect_timeout_secs = 604801: expected at most 604800 seconds"),
        "{e}"
    );
    // the maximum itself is accepted
    let c = parse(&with_server("barrier_timeout_secs = 604800")).unwrap();
    assert_eq!(c.server.barrier_timeout_secs, MAX_SECS);
}

#[test]
fn widths_and_parameter_counts_past_their_maximum_are_refused_before_any_allocation() {
    let hidden = |h: &str| refused(&GOOD.replace("hidden = [32]", &format!("hidden = {h}")));
    assert_eq!(
        hidden("[4294967296]"),
        "/etc/ps/run.toml: [model] hidden[0] = 4294967296: expected at most 1048576 units per layer"
    );
    assert_eq!(
        hidden("[2147483648]"),
        "/etc/ps/run.toml: [model] hidden[0] = 2147483648: expected at most 1048576 units per layer"
    );
    assert_eq!(
        hidden("[100000, 100000]"),
        "/etc/ps/run.toml: [model] hidden = [100000, 100000]: 10079600010 parameters, expected at most 2147483647"
    );
    let e = refused(&GOOD.replace("[model]", "[model]\ninputs = 1048577"));
    assert!(
        e.contains("[model] inputs = 1048577: expected at most 1048576"),
        "{e}"
    );
    let many = format!("[{}]", vec!["1"; 65].join(", "));
    assert!(
        hidden(&many).contains("[model] hidden has 65 layers: expected at most 64"),
        "{}",
        hidden(&many)
    );
}

#[test]
fn the_model_must_fit_in_the_hosts_memory() {
    // 784-20000-20000-10: 416 M parameters, about 5 GB per process
    let text = GOOD.replace("hidden = [32]", "hidden = [20000, 20000]");
    let path = Path::new("/etc/ps/run.toml");
    let small = Host {
        available_bytes: Some(1 << 30),
    };
    let e = Config::parse_with(&text, path, &Overrides::default(), &small)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("/etc/ps/run.toml: [model] hidden = [20000, 20000] (415920010 parameters) with a per-worker batch of up to 8: needs about 4.7 GiB per process")
            && e.ends_with("but this host has 1.0 GiB available (MemAvailable)"),
        "{e}"
    );
    let big = Host {
        available_bytes: Some(64 << 30),
    };
    let c = Config::parse_with(&text, path, &Overrides::default(), &big).unwrap();
    assert_eq!(c.model.num_params(), 415_920_010);
    // the estimate: a worker's parameters, gradient and pull buffer, and batch activations
    assert_eq!(
        c.model_memory_bytes(),
        Some(4 * (3 * 415_920_010 + 2 * 8 * (784 + 20000 + 20000 + 10)))
    );
}

#[test]
fn token_file_is_read_with_a_size_bound() {
    let t = std::time::Instant::now();
    let e = refused(&GOOD.replace("workers = 4", "workers = 4\ntoken_file = \"/dev/zero\""));
    assert_eq!(
        e,
        "/etc/ps/run.toml: [cluster] token_file: cannot read the token file /dev/zero: larger than 4096 bytes (the most read)"
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(2));
    // a FIFO with no writer: refused at once, not waited on
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = refused(&GOOD.replace(
        "workers = 4",
        &format!("workers = 4\ntoken_file = {:?}", fifo.display().to_string()),
    ));
    assert!(e.contains("[cluster] token_file: token file"), "{e}");
}

#[test]
fn counts_and_their_products_are_checked() {
    let e = refused(&GOOD.replace("steps = 20", "epochs = 4611686018427387904"));
    assert_eq!(
        e,
        "/etc/ps/run.toml: [train] epochs = 4611686018427387904: expected at most 1099511627776"
    );
    // within the maximum, but epochs x steps per epoch past it
    let c = parse(&GOOD.replace("steps = 20", "epochs = 1099511627776")).unwrap();
    let e = c.total_steps(60000).unwrap_err().to_string();
    assert!(
        e.contains("[train] epochs = 1099511627776 x 2000 steps per epoch (60000 samples in /etc/ps/../data/mnist, global batch 30): expected at most 1099511627776 steps"),
        "{e}"
    );
    assert_eq!(
        parse(&GOOD.replace("steps = 20", "epochs = 3"))
            .unwrap()
            .total_steps(60000)
            .unwrap(),
        6000
    );
    let e = refused(&GOOD.replace(
        "global_batch = 30",
        "per_worker_batch = 9223372036854775807",
    ));
    assert!(
        e.contains("[train] per_worker_batch = 9223372036854775807: expected at most 1048576"),
        "{e}"
    );
    let e = refused(&GOOD.replace("global_batch = 30", "per_worker_batch = 1048576"));
    assert!(
        e.contains("[train] per_worker_batch = 1048576 x [cluster] workers = 4: expected a global batch of at most 1048576"),
        "{e}"
    );
    for (text, want) in [
        (
            GOOD.replace("workers = 4", "workers = 4097"),
            "[cluster] workers = 4097: expected at most 4096",
        ),
        (
            format!("{GOOD}[checkpoint]\nevery = 1099511627777\n"),
            "[checkpoint] every = 1099511627777: expected at most 1099511627776",
        ),
        (
            format!("{GOOD}[checkpoint]\nkeep = 1001\n"),
            "[checkpoint] keep = 1001: expected at most 1000",
        ),
        (
            format!("{GOOD}[checkpoint]\nmax_failures = 1001\n"),
            "[checkpoint] max_failures = 1001: expected at most 1000",
        ),
        (
            format!("{GOOD}[checkpoint]\nmax_failures = 0\n"),
            "[checkpoint] max_failures = 0: expected at least 1",
        ),
        (
            format!("{GOOD}[worker]\nthreads = 1025\n"),
            "[worker] threads = 1025: expected at most 1024",
        ),
        (
            GOOD.replace("steps = 20", "steps = 20\nlog_every = 1099511627777"),
            "[train] log_every = 1099511627777: expected at most 1099511627776",
        ),
        (
            format!("{GOOD}[schedule]\nwarmup_steps = 1099511627777\n"),
            "[schedule] warmup_steps = 1099511627777: expected at most 1099511627776",
        ),
        (
            GOOD.replace("workers = 4", "workers = -1"),
            "invalid value: integer `-1`, expected usize",
        ),
    ] {
        let e = refused(&text);
        assert!(e.contains(want), "{want}: {e}");
    }
}

#[test]
fn kinds_are_serde_enums_with_the_accepted_names_in_the_error() {
    for (from, to, want) in [
        (
            "kind = \"sgd\"",
            "kind = \"rmsprop\"",
            "[optimizer] kind = \"rmsprop\": expected \"sgd\", \"adam\" or \"adamw\"",
        ),
        (
            "aggregation = \"weighted\"",
            "aggregation = \"median\"",
            "[train] aggregation = \"median\": unknown variant `median`, expected \"sum\", \"mean\" or \"weighted\"",
        ),
        (
            "loss_reduction = \"mean\"",
            "loss_reduction = \"max\"",
            "[train] loss_reduction = \"max\": unknown variant `max`, expected \"mean\" or \"sum\"",
        ),
    ] {
        let e = refused(&GOOD.replace(from, to));
        assert!(e.contains(want), "{want}: {e}");
    }
    let e = refused(&format!("{GOOD}[schedule]\nkind = \"linear\"\n"));
    assert!(
        e.contains("[schedule] kind = \"linear\": expected \"constant\", \"step\" or \"cosine\""),
        "{e}"
    );
    let e = refused(&with_server("barrier_policy = \"retry\""));
    assert!(
        e.contains("[server] barrier_policy = \"retry\": expected \"fail\""),
        "{e}"
    );
    let c = parse(&with_server("barrier_policy = \"continue\"")).unwrap();
    assert_eq!(c.server.barrier_policy, BarrierPolicy::Continue);
}

#[test]
fn overrides_replace_file_values_before_validation() {
    let path = Path::new("/etc/ps/run.toml");
    let o = Overrides {
        data_dir: Some("rel/data".into()),
        out_dir: Some("/tmp/out".into()),
        ..Overrides::default()
    };
    let c = Config::parse_with(GOOD, path, &o, &Host::this()).unwrap();
    // taken as given (relative to the working directory), not relative to the file
    assert_eq!(c.data.dir, Path::new("rel/data"));
    assert_eq!(c.server.out_dir, Path::new("/tmp/out"));
    assert_eq!(c.checkpoint_dir(), Path::new("/tmp/out/checkpoints"));
    assert!(
        c.describe().contains("; data rel/data; "),
        "{}",
        c.describe()
    );
    // without overrides: the file's values, relative to the file
    let c = parse(GOOD).unwrap();
    assert_eq!(c.server.out_dir, Path::new("/etc/ps/runs/default"));
    // the override markers are not keys of the file
    let e = refused(&GOOD.replace("[data]", "[data]\ndir_as_given = true"));
    assert!(e.contains("unknown field `dir_as_given`"), "{e}");
    let e = refused(&with_server("out_dir_as_given = true"));
    assert!(e.contains("unknown field `out_dir_as_given`"), "{e}");
}

#[test]
fn the_builder_writes_the_file_the_parser_reads() {
    let b = TestConfig::new()
        .workers(3)
        .hidden(&[16, 8])
        .global_batch(30)
        .epochs(2)
        .aggregation(Aggregation::Weighted)
        .transport(Transport::Grpc)
        .adam(0.01, 0.01, true)
        .cosine(5, 0.001)
        .checkpoint(5, 2)
        .barrier_policy(BarrierPolicy::Continue)
        .out_dir("/tmp/o");
    let text = b.toml();
    assert!(text.contains("[optimizer]\nkind = \"adamw\""), "{text}");
    let c = b.build(Path::new("/etc/ps/run.toml")).unwrap();
    assert_eq!(c.cluster.workers, 3);
    assert_eq!(c.cluster.servers, ["127.0.0.1:1", "127.0.0.1:2"]);
    assert_eq!(c.cluster.transport, Transport::Grpc);
    assert_eq!(c.model.dims, [784, 16, 8, 10]);
    assert_eq!(c.data.dir, Path::new("/etc/ps/data"));
    assert_eq!((c.train.global_batch, c.train.epochs), (30, Some(2)));
    assert_eq!(c.train.aggregation, Aggregation::Weighted);
    assert_eq!(
        c.optimizer,
        Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true
        }
    );
    assert_eq!(c.schedule.warmup_steps, 5);
    assert_eq!((c.checkpoint.every, c.checkpoint.keep), (5, 2));
    assert_eq!(c.server.barrier_policy, BarrierPolicy::Continue);
    assert_eq!(c.server.out_dir, Path::new("/tmp/o"));
    // the parsed text writes back to the same config
    let again = Config::parse(&text, Path::new("/etc/ps/run.toml")).unwrap();
    assert_eq!(again, c);
}

#[test]
fn the_deadline_margin_defaults_to_30_s_is_set_from_file_or_environment_and_refused_unless_positive()
 {
    assert_eq!(parse(GOOD).unwrap().worker.deadline_margin_secs, 30.0);
    let c = parse(&format!("{GOOD}[worker]\ndeadline_margin_secs = 2.5\n")).unwrap();
    assert_eq!(c.worker.deadline_margin_secs, 2.5);
    let env = [(
        "PS_SET_WORKER_DEADLINE_MARGIN_SECS".to_string(),
        "4".to_string(),
    )]
    .into();
    let o = Overrides::from_env(&env);
    let c = Config::parse_with(GOOD, Path::new("/etc/ps/run.toml"), &o, &Host::this()).unwrap();
    assert_eq!(c.worker.deadline_margin_secs, 4.0);
    for (value, want) in [
        (
            "0",
            "[worker] deadline_margin_secs = 0: expected a positive number of seconds",
        ),
        (
            "-1",
            "[worker] deadline_margin_secs = -1: expected a positive number of seconds",
        ),
        (
            "nan",
            "[worker] deadline_margin_secs = NaN: expected a positive number of seconds",
        ),
        (
            "inf",
            "[worker] deadline_margin_secs = inf: expected a positive number of seconds",
        ),
        (
            "604801",
            "[worker] deadline_margin_secs = 604801: expected at most 604800 seconds (7 days)",
        ),
    ] {
        let e = refused(&format!("{GOOD}[worker]\ndeadline_margin_secs = {value}\n"));
        assert_eq!(e, format!("/etc/ps/run.toml: {want}"), "{value}");
    }
}

#[test]
fn the_resolved_config_reads_as_before() {
    let c = parse(GOOD).unwrap();
    assert_eq!(
        c.describe(),
        "config /etc/ps/run.toml: 2 shards [\"127.0.0.1:5000\", \"127.0.0.1:5001\"], 4 workers, transport auto (shared memory on one host, else gRPC), no authentication, no TLS; mlp 784-32-10 (25,450 parameters); data /etc/ps/../data/mnist; seed 3; global batch 30 (as stated), per-worker batches [8, 8, 7, 7]; 20 steps, short last batch dropped; loss reduction mean, aggregation weighted; optimizer sgd; lr constant 0.1; log every 10 steps, eval every run (at the end only); no checkpoints"
    );
}

#[test]
fn any_key_is_overridable_from_the_environment_and_the_command_line() {
    let path = Path::new("/etc/ps/run.toml");
    let env: std::collections::HashMap<String, String> = [
        ("PS_SET_TRAIN_LOG_EVERY", "7"),
        ("PS_SET_SERVER_BARRIER_TIMEOUT_SECS", "99.5"),
        ("PS_RUN_ID", "not an override"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let mut o = Overrides::from_env(&env);
    o.set_from_cli(&["train.log_every=3".into(), "optimizer.kind=sgd".into()])
        .unwrap();
    let c = Config::parse_with(GOOD, path, &o, &Host::this()).unwrap();
    assert_eq!(
        c.train.log_every, 3,
        "the command line wins over the environment"
    );
    assert_eq!(c.server.barrier_timeout_secs, 99.5);
    let said = o.describe();
    assert!(
        said.contains("train.log_every = 7 (from PS_SET_TRAIN_LOG_EVERY)")
            && said.contains("train.log_every = 3 (from --set)")
            && said.contains("optimizer.kind = sgd (from --set)"),
        "{said}"
    );
    // an override is checked like a file value, and the error says where it came from
    let mut bad = Overrides::default();
    bad.set_from_cli(&["train.log_evry=3".into()]).unwrap();
    let e = Config::parse_with(GOOD, path, &bad, &Host::this()).unwrap_err();
    assert!(
        e.message.contains("log_evry") && e.message.contains("--set train.log_evry"),
        "{e}"
    );
    let mut bad = Overrides::default();
    bad.set_from_cli(&["train.log_every=0".into()]).unwrap();
    assert!(Config::parse_with(GOOD, path, &bad, &Host::this()).is_err());
    assert!(
        Overrides::default()
            .set_from_cli(&["nokey".into()])
            .is_err()
    );
    assert!(
        Overrides::default()
            .set_from_cli(&["train=3".into()])
            .is_err()
    );
}

#[test]
fn a_set_key_clears_its_alternative_steps_for_epochs_and_back() {
    let path = Path::new("/etc/ps/run.toml");
    let epochs = GOOD.replace("steps = 20", "epochs = 2");
    assert!(epochs.contains("epochs = 2"), "{epochs}");
    // the file states epochs: --set train.steps replaces it
    let mut o = Overrides::default();
    o.set_from_cli(&["train.steps=100".into()]).unwrap();
    let c = Config::parse_with(&epochs, path, &o, &Host::this()).unwrap();
    assert_eq!((c.train.steps, c.train.epochs), (Some(100), None));
    assert!(
        o.describe()
            .contains("train.steps = 100 (from --set; clears train.epochs, which it excludes)"),
        "{}",
        o.describe()
    );
    // the environment's PS_SET_TRAIN_STEPS does the same
    let env: std::collections::HashMap<String, String> =
        [("PS_SET_TRAIN_STEPS".to_string(), "100".to_string())].into();
    let c = Config::parse_with(&epochs, path, &Overrides::from_env(&env), &Host::this()).unwrap();
    assert_eq!((c.train.steps, c.train.epochs), (Some(100), None));
    // and back: a steps file takes --set train.epochs
    let mut o = Overrides::default();
    o.set_from_cli(&["train.epochs=1".into()]).unwrap();
    let c = Config::parse_with(GOOD, path, &o, &Host::this()).unwrap();
    assert_eq!((c.train.steps, c.train.epochs), (None, Some(1)));
    // the batch's two forms exclude each other too
    let mut o = Overrides::default();
    o.set_from_cli(&["train.per_worker_batch=4".into()])
        .unwrap();
    let c = Config::parse_with(GOOD, path, &o, &Host::this()).unwrap();
    assert_eq!(
        (c.train.global_batch, c.train.batch_from_per_worker),
        (16, true)
    );
}

#[test]
fn wire_defaults_to_f32_and_bf16_is_said_to_be_inexact() {
    let c = parse(GOOD).unwrap();
    assert_eq!(c.cluster.wire, Wire::F32);
    assert!(!c.describe().contains("wire"));
    assert!(c.equivalence().warnings.iter().all(|w| !w.contains("bf16")));
    let exact = c.equivalence().exact;
    let c = parse(&GOOD.replace("workers = 4", "workers = 4\nwire = \"bf16\"")).unwrap();
    assert_eq!(c.cluster.wire, Wire::Bf16);
    assert!(c.describe().contains("wire bf16"), "{}", c.describe());
    let eq = c.equivalence();
    assert!(exact && !eq.exact, "bf16 makes an exact run inexact");
    assert!(
        eq.to_string().starts_with("approximately (not exactly)"),
        "{eq}"
    );
    assert!(
        eq.warnings
            .iter()
            .any(|w| w.contains("bfloat16 with error feedback") && w.contains("no longer equals")),
        "{:?}",
        eq.warnings
    );
    let e = parse(&GOOD.replace("workers = 4", "workers = 4\nwire = \"fp16\""))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[cluster] wire = \"fp16\": expected \"f32\" (exact) or \"bf16\""),
        "{e}"
    );
}

#[test]
fn data_is_an_idx_directory_or_the_users_own_length() {
    let no_dir = GOOD.replace("dir = \"../data/mnist\"", "");
    let e = refused(&no_dir);
    assert!(
        e.contains("[data]: expected dir") && e.contains("or train_len"),
        "{e}"
    );
    // the built-in model's workers read the IDX files: train_len alone is not enough
    let e = refused(&no_dir.replace("[data]", "[data]\ntrain_len = 600"));
    assert!(
        e.contains("[data] dir: required for the built-in model"),
        "{e}"
    );
    let e = refused(&GOOD.replace("[data]", "[data]\ntrain_len = 0"));
    assert!(e.contains("[data] train_len = 0: expected 1..="), "{e}");
    let c = parse(&GOOD.replace("[data]", "[data]\ntrain_len = 600")).unwrap();
    assert_eq!(c.data.train_len, Some(600));
    assert!(
        c.describe().contains("data the user's own (600 samples"),
        "{}",
        c.describe()
    );
}

/// `[model] kind = "cnn"`: the defaults, the geometry in the layout, and a precise error for
/// each bad value (a stride that does not divide, an odd convolution output, an image that is
/// not `inputs` values, a CNN key on the MLP, an unknown kind).
#[test]
fn the_cnn_is_configured_in_model_and_bad_geometry_is_refused() {
    let cnn = |keys: &str| GOOD.replace("hidden = [32]", keys);
    let c = parse(&cnn("kind = \"cnn\"")).unwrap();
    assert_eq!(c.model.dims, [784, 64, 10]);
    let l = c.layout();
    assert_eq!(l.tensors[0].name, "conv1.weight");
    assert_eq!(l.tensors[0].shape, [8, 1, 5, 5]);
    assert_eq!(l.num_params() as u64, c.model.num_params());
    assert_eq!(c.spec().names_and_shapes(), l.names_and_shapes());
    assert!(
        c.describe_model()
            .starts_with("cnn 1x28x28 conv5x5 8-16 maxpool2, fc 256-64-10")
    );
    let c = parse(&cnn(
        "kind = \"cnn\"\nchannels = [4]\nkernel = 3\npadding = 1\nhidden = []",
    ))
    .unwrap();
    assert_eq!(c.layout().names_and_shapes()[2].1, [10, 4 * 14 * 14]);
    let err = |keys: &str| parse(&cnn(keys)).unwrap_err().to_string();
    assert_eq!(
        err("kind = \"cnn\"\nstride = 2"),
        "/etc/ps/run.toml: [model] kind = \"cnn\": conv1: stride 2 does not divide input height 28 + 2 x padding 0 - kernel 5 = 23"
    );
    assert!(
        err("kind = \"cnn\"\nkernel = 4").contains("conv1: output height 25 is odd"),
        "{}",
        err("kind = \"cnn\"\nkernel = 4")
    );
    assert!(
        err("kind = \"cnn\"\nimage = [3, 28, 28]")
            .contains("[model] image = [3, 28, 28] is 2352 values per sample but inputs = 784")
    );
    assert!(err("kind = \"cnn\"\nchannels = [8, 8, 8]").contains("smaller than the kernel 5"));
    assert!(err("channels = [8]").contains("[model] channels is a key of the CNN"));
    assert!(
        err("kind = \"resnet\"").contains("[model] kind = \"resnet\": expected \"mlp\" or \"cnn\"")
    );
    assert!(err("kind = \"cnn\"\nchannels = [1048576, 1048576]").contains("convolution weights"));
}

/// `GOOD` (W = 4, B = 30, weighted) in the exact-sum mode with `extra` lines in `[train]`.
fn exact(extra: &str) -> Result<Config, ConfigError> {
    parse(&GOOD.replace(
        "aggregation = \"weighted\"",
        &format!("aggregation = \"weighted\"\nexact_sum = true\n{extra}"),
    ))
}

#[test]
fn exact_sum_splits_the_batch_in_whole_micro_batches_and_says_what_it_guarantees() {
    // B = 30: the default micro-batch is the largest of 16, 8, 4, 2, 1 dividing it
    let c = exact("").unwrap();
    assert_eq!(c.train.exact_micro_batch, Some(2));
    assert_eq!(
        c.worker_batches(),
        [8, 8, 8, 6],
        "15 micro-batches of 2 over 4"
    );
    let c = exact("exact_micro_batch = 5").unwrap();
    assert_eq!(c.worker_batches(), [10, 10, 5, 5], "6 of 5 over 4");
    let order = c.data_order(1000);
    assert_eq!(order.micro_batch, 5);
    assert_eq!(order.worker_range(3, 1, 4), 10..20);
    let eq = c.equivalence();
    assert!(eq.exact && !eq.mean_of_means);
    assert!(
        eq.to_string()
            .contains("every step's gradient is 6 terms of 5 samples")
            && eq
                .to_string()
                .contains("the same bits at any number of workers"),
        "{eq}"
    );
    // mean aggregation is the mean over the global batch in the mode, even split or not
    let c = parse(&GOOD.replace(
        "aggregation = \"weighted\"",
        "aggregation = \"mean\"\nexact_sum = true\nexact_micro_batch = 5",
    ))
    .unwrap();
    assert!(c.equivalence().exact && c.equivalence().warnings.is_empty());
    // off: as before
    let c = parse(GOOD).unwrap();
    assert_eq!(c.train.exact_micro_batch, None);
    assert_eq!(c.data_order(1000).micro_batch, 1);
    assert!(!c.equivalence().to_string().contains("exact sum"));
}

#[test]
fn exact_sum_refuses_what_depends_on_w_naming_why() {
    let refused = |text: &str, want: &str| {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.contains(want), "{e}\nexpected: {want}");
    };
    let with = |train: &str| {
        GOOD.replace(
            "aggregation = \"weighted\"",
            &format!("aggregation = \"weighted\"\nexact_sum = true\n{train}"),
        )
    };
    refused(
        &with("exact_micro_batch = 4"),
        "[train] exact_sum = true: exact_micro_batch = 4 does not divide the global batch 30",
    );
    refused(
        &with("exact_micro_batch = 10"),
        "the global batch 30 is 3 micro-batches of 10, fewer than [cluster] workers = 4",
    );
    refused(
        &with("micro_batches = 2"),
        "[train] micro_batches = 2: the exact mode",
    );
    refused(
        &with("keep_last = true"),
        "keep_last = true: a short last batch",
    );
    refused(
        &with("exact_micro_batch = 0"),
        "[train] exact_micro_batch = 0",
    );
    refused(
        &GOOD.replace(
            "aggregation = \"weighted\"",
            "aggregation = \"sum\"\nexact_sum = true",
        ),
        "loss_reduction \"mean\" with aggregation \"sum\" sums W mean gradients: the result scales with W",
    );
    refused(
        &GOOD.replace(
            "loss_reduction = \"mean\"\naggregation = \"weighted\"",
            "loss_reduction = \"sum\"\naggregation = \"mean\"\nexact_sum = true",
        ),
        "loss_reduction \"sum\" with aggregation \"mean\" divides the summed gradient by W",
    );
    refused(
        &with("").replace("workers = 4", "workers = 4\nwire = \"bf16\""),
        "[cluster] wire = \"bf16\" rounds each worker's gradient",
    );
    refused(
        &GOOD.replace(
            "aggregation = \"weighted\"",
            "aggregation = \"weighted\"\nexact_micro_batch = 2",
        ),
        "[train] exact_micro_batch = 2 without exact_sum = true",
    );
    // a declared model (PyTorch workers, ps_torch's Worker.terms) is in the mode too
    let mut train = exact("").unwrap().train;
    train.exact_micro_batch = Some(0);
    exact::resolve(&mut train, 4, Wire::F32).unwrap();
    assert_eq!(train.exact_micro_batch, Some(2));
}

/// With `clip_norm` the exact mode's statement says that the bits hold for a given shard
/// count only (a tensor split between shards has its squared norm summed in parts, in f64),
/// and without it that they hold for any shard count.
#[test]
fn exact_sum_with_clipping_states_that_the_shard_count_is_fixed() {
    let clipped = parse(
        &GOOD
            .replace(
                "aggregation = \"weighted\"",
                "aggregation = \"weighted\"\nexact_sum = true",
            )
            .replace("lr = 0.1", "lr = 0.1\nclip_norm = 1.0"),
    )
    .unwrap()
    .equivalence()
    .to_string();
    assert!(
        clipped.contains("and a given number of shards")
            && clipped.contains("other shard counts are not guaranteed the same bits"),
        "{clipped}"
    );
    assert!(!clipped.contains("and any number of shards"), "{clipped}");
    let plain = exact("").unwrap().equivalence().to_string();
    assert!(plain.contains("and any number of shards"), "{plain}");
    assert!(!plain.contains("a given number of shards"), "{plain}");
}
