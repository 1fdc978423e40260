//! What a team watches, with real processes: gRPC health for probes (on the shard's own port
//! beside the shard service, and alone in plaintext on `--health-listen`); the Prometheus
//! (OpenMetrics) exposition with its histograms, per-rank arrival lag and process figures,
//! checked line by line; TensorBoard event files from shard 0 equal to `metrics.jsonl`.
#![allow(clippy::too_many_lines)] // a scenario test reads top to bottom in one function

use ps_launch::{LocalCluster, bin_dir};
use ps_proto::PROTOCOL_VERSION;
use ps_proto::pb::RegisterRequest;
use ps_proto::pb::parameter_server_client::ParameterServerClient;
use ps_server::tensorboard;
use ps_tests::{Spec, Start, logged_addr, run_cluster};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic_health::ServingStatus;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

fn tls_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tls")
}

async fn check(c: &mut HealthClient<tonic::transport::Channel>, service: &str) -> i32 {
    c.check(HealthCheckRequest {
        service: service.into(),
    })
    .await
    .unwrap_or_else(|e| panic!("health check of {service:?}: {e}"))
    .into_inner()
    .status
}

/// Waits (at most 30 s) until `service` is SERVING; until then it may be unknown (not yet
/// registered) or NOT_SERVING.
async fn wait_serving(c: &mut HealthClient<tonic::transport::Channel>, service: &str) {
    let t0 = Instant::now();
    loop {
        let r = c
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await;
        match &r {
            Ok(ok) if ok.get_ref().status == ServingStatus::Serving as i32 => return,
            Ok(_) => {}
            Err(e) if e.code() == Code::NotFound => {}
            Err(e) => panic!("health check of {service:?}: {e}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{service:?} not SERVING within 30 s: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A shard with TLS and a token answers `grpc.health.v1` in plaintext and without the token on
/// its health port (the kubelet's probe can do neither), and on its TLS port without the token,
/// while its shard service there still refuses a request without the token. "" and the shard
/// service are SERVING while it runs; an unknown service is NOT_FOUND; a watcher sees the shard
/// service turn NOT_SERVING when the run ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_answers_probes_and_follows_the_run() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("token"),
        "a-token-of-this-test-0123456789\n",
    )
    .unwrap();
    let d = tls_dir();
    let spec = Spec {
        shards: 1,
        workers: 1,
        hidden: vec![4],
        global_batch: 8,
        steps: 3,
        config: Spec::base().token_file("token").tls(
            d.join("shard.pem"),
            d.join("shard.key"),
            d.join("ca.pem"),
        ),
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir.path());
    let logs = dir.path().join("logs");
    let (mut cluster, health_addr) = ps_tests::start_shard_with_health(path, &logs);

    // the probe's view: plaintext, no token
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{health_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut probe = HealthClient::new(ch);
    assert_eq!(check(&mut probe, "").await, ServingStatus::Serving as i32);
    // the health port is up before the shard service is (set SERVING once it serves): wait
    // for that, bounded
    wait_serving(&mut probe, ps_server::HEALTH_SERVICE).await;
    assert_eq!(
        check(&mut probe, ps_server::HEALTH_SERVICE).await,
        ServingStatus::Serving as i32
    );
    let unknown = probe
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");

    // the shard's own port: TLS; health needs no token, the shard service does
    let tls_no_token = ps_net::auth::ClientSecurity::new(None, cfg.cluster.tls.clone());
    let ch = tls_no_token
        .endpoint(&cluster.addrs[0])
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut on_shard_port = HealthClient::new(ch.clone());
    assert_eq!(
        check(&mut on_shard_port, ps_server::HEALTH_SERVICE).await,
        ServingStatus::Serving as i32
    );
    let refused = ParameterServerClient::new(ch)
        .register(RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            rank: 0,
            world_size: 1,
            num_params: cfg.layout().num_params() as u64,
            shard: 0,
            num_shards: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");

    let mut watch = on_shard_port
        .watch(HealthCheckRequest {
            service: ps_server::HEALTH_SERVICE.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);

    cluster.start_worker(0, 1, &[]).unwrap();
    let watcher = tokio::spawn(async move {
        let mut seen = Vec::new();
        while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(60), watch.message())
            .await
            .unwrap()
        {
            seen.push(m.status);
            if m.status == ServingStatus::NotServing as i32 {
                break;
            }
        }
        seen
    });
    let seen = watcher.await.unwrap();
    assert_eq!(
        seen.last(),
        Some(&(ServingStatus::NotServing as i32)),
        "the watcher saw {seen:?}"
    );
    tokio::task::spawn_blocking(move || {
        cluster
            .wait(Duration::from_secs(60), &|| false)
            .map(|_| cluster)
    })
    .await
    .unwrap()
    .unwrap();
    assert!(dir.path().join("out/shard-0.safetensors").exists());
}

/// `GET /metrics` asking for OpenMetrics: the status line, the content type and the body.
async fn scrape(addr: &str) -> (String, String, String) {
    scrape_accepting(
        addr,
        "application/openmetrics-text; version=1.0.0,text/plain;q=0.5",
    )
    .await
}

/// `GET /metrics` with `Accept: <accept>` (none when empty).
async fn scrape_accepting(addr: &str, accept: &str) -> (String, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let accept = if accept.is_empty() {
        String::new()
    } else {
        format!("Accept: {accept}\r\n")
    };
    sock.write_all(format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{accept}\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    sock.read_to_string(&mut text).await.unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Type: "))
        .unwrap_or_default()
        .to_string();
    (
        head.lines().next().unwrap().to_string(),
        content_type,
        body.to_string(),
    )
}

/// A sample's labels, in order.
type Labels = Vec<(String, String)>;

/// One sample: name, labels in order, value.
type Sample = (String, Labels, f64);

/// Parses an OpenMetrics text exposition strictly enough to catch what Prometheus rejects:
/// every family has one TYPE (and HELP) before its samples, every sample belongs to the family
/// declared last with a suffix its type allows, names and labels are well formed, values
/// parse, the text ends with `# EOF`. Returns the samples, and the families with their types.
fn parse_openmetrics(body: &str) -> (Vec<Sample>, BTreeMap<String, String>) {
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(
        lines.last(),
        Some(&"# EOF"),
        "the exposition ends with # EOF"
    );
    assert!(body.ends_with("# EOF\n"));
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
            && !n.starts_with(|c: char| c.is_ascii_digit())
    };
    let mut families: BTreeMap<String, String> = BTreeMap::new();
    let mut helped = BTreeSet::new();
    let mut current: Option<(String, String)> = None;
    let mut samples = Vec::new();
    for line in &lines[..lines.len() - 1] {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(helped.insert(name.to_string()), "two HELP for {name}");
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(name_ok(name), "family name {name:?}");
            assert!(
                [
                    "counter",
                    "gauge",
                    "histogram",
                    "summary",
                    "info",
                    "stateset",
                    "unknown"
                ]
                .contains(&kind),
                "type {kind}"
            );
            assert!(
                families.insert(name.into(), kind.into()).is_none(),
                "two TYPE lines for {name}"
            );
            assert!(helped.contains(name), "HELP before TYPE for {name}");
            current = Some((name.into(), kind.into()));
        } else if line.starts_with('#') {
            assert!(line.starts_with("# UNIT "), "unexpected comment {line:?}");
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v
                    .parse()
                    .unwrap_or_else(|_| panic!("value {v:?} in {line:?}")),
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => {
                    let l = l.strip_suffix('}').expect("labels end with }");
                    let mut out = Vec::new();
                    for pair in l.split("\",").filter(|p| !p.is_empty()) {
                        let (k, v) = pair.split_once("=\"").expect("label k=\"v\"");
                        assert!(name_ok(k), "label name {k:?}");
                        out.push((k.to_string(), v.trim_end_matches('"').to_string()));
                    }
                    (n, out)
                }
                None => (series, Vec::new()),
            };
            let (family, kind) = current
                .as_ref()
                .unwrap_or_else(|| panic!("sample before any TYPE: {line}"));
            let suffix = name
                .strip_prefix(family.as_str())
                .unwrap_or_else(|| panic!("sample {name} outside its family {family}"));
            let allowed: &[&str] = match kind.as_str() {
                "counter" => &["_total", "_created"],
                "histogram" => &["_bucket", "_count", "_sum", "_created"],
                _ => &[""],
            };
            assert!(
                allowed.contains(&suffix),
                "{name}: suffix {suffix:?} in a {kind}"
            );
            samples.push((name.to_string(), labels, value));
        }
    }
    (samples, families)
}

/// The value of the sample `name` with exactly `labels`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .find(|(n, l, _)| {
            n == name
                && l.len() == labels.len()
                && l.iter().zip(labels).all(|(a, b)| a.0 == b.0 && a.1 == b.1)
        })
        .map(|s| s.2)
        .unwrap_or_else(|| panic!("no {name}{labels:?}"))
}

/// Checks every histogram's series: `le` ascending and ending in +Inf, cumulative counts
/// non-decreasing, +Inf = _count. Returns the number of series checked.
fn check_histograms(samples: &[Sample], families: &BTreeMap<String, String>) -> usize {
    let mut series = 0;
    for (family, _) in families.iter().filter(|(_, k)| *k == "histogram") {
        let bucket = format!("{family}_bucket");
        // labels but le -> (le, cumulative count)
        let mut by_labels: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
        for (_, l, v) in samples.iter().filter(|s| s.0 == bucket) {
            let le = l
                .iter()
                .find(|(k, _)| k == "le")
                .expect("le label")
                .1
                .clone();
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap()
            };
            let rest: Vec<_> = l.iter().filter(|(k, _)| k != "le").cloned().collect();
            by_labels.entry(rest).or_default().push((le, *v));
        }
        for (labels, buckets) in by_labels {
            assert!(
                buckets.windows(2).all(|w| w[0].0 < w[1].0),
                "{family} le order"
            );
            assert!(
                buckets.windows(2).all(|w| w[0].1 <= w[1].1),
                "{family} cumulative"
            );
            assert_eq!(buckets.last().unwrap().0, f64::INFINITY);
            let l: Vec<(&str, &str)> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            assert_eq!(
                buckets.last().unwrap().1,
                value(samples, &format!("{family}_count"), &l),
                "{family}{labels:?}: +Inf bucket = count"
            );
            series += 1;
        }
    }
    series
}

/// A live shard's exposition as two workers train: valid OpenMetrics; the step-time and
/// barrier-wait histograms count every applied step; each rank's arrival lag is counted once
/// per step and the first arrival of a step has lag 0; process figures are the shard's own and
/// plausible; the long-standing metric names still answer with `shard` first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_exposition_is_valid_with_histograms_lag_and_process_figures() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 1,
        workers: 2,
        hidden: vec![4],
        global_batch: 8,
        steps: 100_000, // stopped below
        ..Spec::default()
    };
    let (path, _cfg) = spec.write(dir.path());
    let logs = dir.path().join("logs");
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(logs.clone()));
    cluster
        .start_servers(
            1,
            &["--metrics-listen".into(), "127.0.0.1:0".into()],
            Duration::from_secs(60),
        )
        .unwrap();
    let addr = logged_addr(&logs.join("shard-0.log"), "Prometheus metrics on http://");
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    cluster.start_worker(0, 2, &[]).unwrap();
    cluster.start_worker(1, 2, &[]).unwrap();
    let t0 = Instant::now();
    let (content_type, body) = loop {
        let (status, ct, body) = scrape(&addr).await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        let (samples, _) = parse_openmetrics(&body);
        if value(&samples, "ps_version", &[("shard", "0")]) >= 20.0 {
            break (ct, body);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no progress:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    cluster.kill_all();
    assert_eq!(
        content_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    let (samples, families) = parse_openmetrics(&body);
    let shard = [("shard", "0")];
    let version = value(&samples, "ps_version", &shard);
    // a scrape is not atomic across families: a step may be applied in between
    let steps = value(&samples, "ps_step_duration_seconds_count", &shard);
    assert!(
        (steps - version).abs() <= 1.0,
        "{steps} steps timed at version {version}"
    );
    let barrier = value(&samples, "ps_barrier_wait_duration_seconds_count", &shard);
    assert!((barrier - steps).abs() <= 1.0);
    assert!(value(&samples, "ps_step_duration_seconds_sum", &shard) > 0.0);
    let lag: Vec<f64> = ["0", "1"]
        .iter()
        .map(|r| {
            value(
                &samples,
                "ps_arrival_lag_seconds_count",
                &[("shard", "0"), ("rank", r)],
            )
        })
        .collect();
    assert!(
        lag.iter().all(|&n| (n - steps).abs() <= 1.0),
        "each rank counted once per step: {lag:?} for {steps} steps"
    );
    // the first of the two arrivals has lag 0: at least one observation per step in the
    // lowest bucket, summed over the ranks
    let lowest_buckets: Vec<f64> = samples
        .iter()
        .filter(|(n, l, _)| {
            n == "ps_arrival_lag_seconds_bucket"
                && l.iter()
                    .any(|(k, v)| k == "le" && v.parse::<f64>().ok() == Some(0.0005))
        })
        .map(|s| s.2)
        .collect();
    assert_eq!(lowest_buckets.len(), 2, "one lowest bucket per rank");
    let zero_bucket: f64 = lowest_buckets.iter().sum();
    assert!(
        zero_bucket >= steps - 1.0,
        "{zero_bucket} for {steps} steps"
    );
    assert_eq!(families["ps_step_duration_seconds"], "histogram");
    assert_eq!(families["ps_pushes"], "counter");
    assert_eq!(families["ps_loss"], "gauge");
    assert_eq!(check_histograms(&samples, &families), 2 + 2);

    let rss = value(&samples, "process_resident_memory_bytes", &[]);
    assert!((1e6..8e9).contains(&rss), "rss {rss}");
    assert!(value(&samples, "process_virtual_memory_bytes", &[]) >= rss);
    let cpu = value(&samples, "process_cpu_seconds_total", &[]);
    assert!(cpu > 0.0 && cpu < 600.0, "cpu {cpu}");
    let fds = value(&samples, "process_open_fds", &[]);
    assert!(fds >= 5.0, "fds {fds}: stdio, listeners, connections");
    assert!(value(&samples, "process_max_fds", &[]) >= fds);
    assert!(value(&samples, "process_threads", &[]) >= 2.0);
    let start = value(&samples, "process_start_time_seconds", &[]);
    assert!(
        (started - 120.0..started + 1.0).contains(&start),
        "start {start} vs test {started}"
    );

    // the names dashboards and tests already use
    assert!(
        value(
            &samples,
            "ps_pushes_total",
            &[("shard", "0"), ("outcome", "accepted")]
        ) >= 2.0 * (version - 1.0)
    );
    assert_eq!(value(&samples, "ps_total_steps", &shard), 100_000.0);
    assert!(value(&samples, "ps_samples_total", &shard) >= 8.0 * (version - 1.0));
    for g in [
        "ps_loss",
        "ps_train_accuracy",
        "ps_learning_rate",
        "ps_grad_norm_shard",
        "ps_workers_in",
        "ps_step_seconds",
        "ps_barrier_wait_seconds",
        "ps_apply_seconds",
    ] {
        assert!(value(&samples, g, &shard).is_finite(), "{g}");
    }
    assert_eq!(value(&samples, "ps_workers_in", &shard), 2.0);
}

/// Shard 0's TensorBoard event file holds, per step, exactly the figures of `metrics.jsonl`
/// (as float32), the periodic test accuracies at the version they evaluated, and the final
/// evaluation; every record's CRCs check. Shard 1 writes none.
/// Prometheus' text format 0.0.4 (what `promtool check metrics` and a scraper without
/// OpenMetrics read), checked line by line: every family's HELP and TYPE name its samples'
/// family (a counter's includes `_total`), help texts end in one full stop, no OpenMetrics-only
/// lines. Returns (family, type) pairs and samples by name.
fn parse_text_format(body: &str) -> (BTreeMap<String, String>, BTreeMap<String, f64>) {
    let mut types = BTreeMap::new();
    let mut helps = BTreeSet::new();
    let mut samples = BTreeMap::new();
    for line in body.lines() {
        assert!(
            !line.starts_with("# EOF") && !line.starts_with("# UNIT"),
            "OpenMetrics only: {line}"
        );
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap();
            assert!(
                help.ends_with('.') && !help.ends_with(".."),
                "help text of {name}: {help:?}"
            );
            helps.insert(name.to_string());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(helps.contains(name), "no help text before TYPE {name}");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            if kind == "counter" {
                assert!(name.ends_with("_total"), "counter family {name}");
            }
            types.insert(name.to_string(), kind.to_string());
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let name = series.split('{').next().unwrap();
            let family = types
                .keys()
                .find(|f| {
                    name == f.as_str()
                        || ["_bucket", "_sum", "_count"]
                            .iter()
                            .any(|s| name == format!("{f}{s}"))
                })
                .unwrap_or_else(|| panic!("sample {name} outside a declared family"));
            assert!(helps.contains(family));
            let v: f64 = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("{line}")),
            };
            samples.entry(name.to_string()).or_insert(v);
        }
    }
    (types, samples)
}

/// The final version, loss and test accuracy reach the scraper: with `[server]
/// metrics_linger_secs`, a shard keeps `/metrics` up after the run until it is scraped once
/// more, in the plain text format when the scraper does not ask for OpenMetrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_final_figures_reach_a_scraper_in_the_text_format_after_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 1,
        workers: 2,
        steps: 12,
        config: Spec::base().log_every(1),
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir.path());
    let logs = dir.path().join("logs");
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(logs.clone()));
    cluster
        .start_servers(
            1,
            &[
                "--metrics-listen".into(),
                "127.0.0.1:0".into(),
                "--set".into(),
                "server.metrics_linger_secs=120".into(),
            ],
            Duration::from_secs(60),
        )
        .unwrap();
    let addr = logged_addr(&logs.join("shard-0.log"), "Prometheus metrics on http://");
    cluster.start_worker(0, 2, &[]).unwrap();
    cluster.start_worker(1, 2, &[]).unwrap();
    // the run's end: the shard says it lingers (after metrics.jsonl's final line)
    let shard_log = logs.join("shard-0.log");
    let t0 = Instant::now();
    while !std::fs::read_to_string(&shard_log)
        .unwrap_or_default()
        .contains("/metrics stays up until it is scraped once more")
    {
        assert!(t0.elapsed() < Duration::from_secs(120), "no end of run");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, content_type, body) = scrape_accepting(&addr, "").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
    let (types, samples) = parse_text_format(&body);
    assert_eq!(types["ps_pushes_total"], "counter");
    assert_eq!(types["ps_step_duration_seconds"], "histogram");
    let metrics = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["final"], true, "{last}");
    assert_eq!(samples["ps_version"], 12.0, "{body}");
    let acc = samples["ps_test_accuracy"];
    assert!(
        (acc - last["test_acc"].as_f64().unwrap()).abs() < 1e-6,
        "{acc} vs {last}"
    );
    assert!(samples.contains_key("ps_loss"), "{body}");
    // scraped: the shard ends now, long before its linger
    tokio::task::spawn_blocking(move || {
        cluster
            .wait(Duration::from_secs(60), &|| false)
            .map(|_| cluster)
    })
    .await
    .unwrap()
    .unwrap();
}

#[test]
fn tensorboard_events_equal_metrics_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 2,
        workers: 2,
        steps: 12,
        config: Spec::base().eval_every(5),
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir.path());
    let out = run_cluster(&path, &cfg, &Start::default());
    let files = tensorboard::event_files(&out);
    assert_eq!(files.len(), 1, "one event file: {files:?}");
    let events = tensorboard::read_events(&files[0]).unwrap();
    assert!(
        matches!(&events[0].what, Some(tensorboard::What::FileVersion(v)) if v == "brain.Event:2")
    );
    let scalars = tensorboard::scalars(&events);
    let get = |tag: &str, step: u64| -> Option<f32> {
        scalars
            .iter()
            .find(|(t, s, _)| t == tag && *s == step)
            .map(|x| x.2)
    };
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut checked = 0;
    let mut evals = 0;
    for l in &lines {
        let step = l["step"].as_u64().unwrap();
        if l.get("final").is_some() {
            assert_eq!(
                get("test/accuracy", step),
                Some(l["test_acc"].as_f64().unwrap() as f32),
                "final evaluation"
            );
            evals += 1;
            continue;
        }
        for (tag, key) in [
            ("train/loss", "loss"),
            ("train/accuracy", "train_acc"),
            ("train/lr", "lr"),
            ("train/grad_norm", "grad_norm"),
            ("time/step_ms", "step_ms"),
            ("time/barrier_wait_ms", "barrier_wait_ms"),
            ("time/apply_ms", "apply_ms"),
        ] {
            assert_eq!(
                get(tag, step),
                Some(l[key].as_f64().unwrap() as f32),
                "{tag} at step {step}"
            );
            checked += 1;
        }
        if let Some(a) = l.get("test_acc_before_step") {
            assert_eq!(
                get("test/accuracy", step - 1),
                Some(a.as_f64().unwrap() as f32)
            );
            evals += 1;
        }
    }
    assert_eq!(checked, 12 * 7);
    assert!(
        evals >= 3,
        "evaluations at 0, 5, 10 and the final one: {evals}"
    );
    let test_points = scalars.iter().filter(|s| s.0 == "test/accuracy").count();
    assert_eq!(
        test_points, evals,
        "no test accuracy beyond metrics.jsonl's"
    );
    assert_eq!(scalars.len(), checked + evals);
}

/// `ps-launch --metrics` alone keeps every shard's `/metrics` up after the run until it is
/// scraped once more (saying how long), and every shard, not only shard 0, publishes the final
/// test accuracy (issue 41: shard 1 kept the value of its last evaluation during the run, and
/// the endpoints closed with the run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_metrics_every_shard_serves_the_final_test_accuracy_after_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        shards: 2,
        workers: 2,
        steps: 12,
        config: Spec::base().log_every(1).eval_every(5),
        ..Spec::default()
    };
    let (path, cfg) = spec.write(dir.path());
    assert_eq!(
        cfg.server.metrics_linger_secs, 0.0,
        "the config says nothing"
    );
    let log = dir.path().join("launch");
    let mut launch = ps_tests::spawn_launch(&path, &["--metrics"], &log);
    let err = log.with_extension("err");
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(&err).unwrap_or_default();
        if text
            .matches("/metrics stays up until it is scraped once more")
            .count()
            == 2
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no end of run:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = std::fs::read_to_string(&err).unwrap();
    assert!(
        text.contains("ps-launch: --metrics: each shard's /metrics stays up after the run until it is scraped once more, at most 120 s"),
        "{text}"
    );
    let metrics = std::fs::read_to_string(cfg.server.out_dir.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["final"], true, "{last}");
    let final_acc = last["test_acc"].as_f64().unwrap();
    for s in 0..2 {
        let addr = logged_addr(&err, &format!("shard {s}: Prometheus metrics on http://"));
        let (status, _, body) = scrape_accepting(&addr, "").await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        let (_, samples) = parse_text_format(&body);
        assert_eq!(samples["ps_version"], 12.0, "shard {s}: {body}");
        let acc = samples["ps_test_accuracy"];
        assert!(
            (acc - final_acc).abs() < 1e-9,
            "shard {s}: {acc} vs the final {final_acc}"
        );
    }
    // scraped: ps-launch ends now, long before the 120 s
    let st = tokio::task::spawn_blocking(move || launch.wait().unwrap())
        .await
        .unwrap();
    assert!(st.success(), "{st}");
    assert!(t0.elapsed() < Duration::from_secs(100));
}
