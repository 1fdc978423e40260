//! The Kubernetes manifests against the config parser and the real binaries' flags, the
//! ConfigMap's shard.sh run with stand-in binaries, and the scrape settings (only shard pods).

use super::yaml::{
    assert_config_mounted, at, config_toml, container, env_of, find, int, k8s_config, seq,
    string_map, strings, text, volume_at, yaml_docs,
};
use super::*;

#[test]
fn kubernetes_manifests_are_consistent_with_the_config_and_the_binaries() {
    let manifests: Vec<PathBuf> = files_under(&deploy().join("k8s"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    let docs: Vec<Value> = manifests.iter().flat_map(|p| yaml_docs(p)).collect();
    let kinds: BTreeSet<(String, String)> = docs
        .iter()
        .map(|d| {
            assert!(
                ["v1", "batch/v1", "networking.k8s.io/v1"].contains(&text(d, "apiVersion")),
                "{d:?}"
            );
            (
                text(d, "kind").to_string(),
                text(d, "metadata.name").to_string(),
            )
        })
        .collect();
    let expected: BTreeSet<(String, String)> = [
        ("Namespace", "ps"),
        ("PersistentVolumeClaim", "ps-runs"),
        ("Service", "ps-shards"),
        ("NetworkPolicy", "ps-run"),
        ("ConfigMap", "ps-config"),
        ("Job", "ps-run"),
        ("Pod", "ps-outputs"),
    ]
    .iter()
    .map(|(k, n)| (k.to_string(), n.to_string()))
    .collect();
    assert_eq!(kinds, expected);
    assert_eq!(docs.len(), expected.len(), "no duplicate objects");

    let namespace = find(&docs, "Namespace", "ps");
    let ns = text(namespace, "metadata.name");
    assert_eq!(
        string_map(namespace, "metadata.labels")["pod-security.kubernetes.io/enforce"],
        "restricted",
        "the namespace enforces the restricted Pod Security level"
    );
    for d in docs.iter().filter(|d| text(d, "kind") != "Namespace") {
        assert_eq!(text(d, "metadata.namespace"), ns, "{}", text(d, "kind"));
    }
    let cm = find(&docs, "ConfigMap", "ps-config");
    let svc = find(&docs, "Service", "ps-shards");
    let job = find(&docs, "Job", "ps-run");
    let pvc = find(&docs, "PersistentVolumeClaim", "ps-runs");
    let netpol = find(&docs, "NetworkPolicy", "ps-run");
    let outputs = find(&docs, "Pod", "ps-outputs");
    let secrets = tempfile::tempdir().unwrap();
    let cfg = k8s_config(cm, secrets.path());
    let pod_labels = string_map(job, "spec.template.metadata.labels");

    // the headless Service selects the run's pods; shard i is pod i
    assert_eq!(text(svc, "spec.clusterIP"), "None", "headless");
    assert_eq!(
        at(svc, "spec.publishNotReadyAddresses").as_bool(),
        Some(true)
    );
    let selector = string_map(svc, "spec.selector");
    assert!(!selector.is_empty());
    assert!(
        selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "{selector:?} selects the run's pods {pod_labels:?}"
    );
    let svc_ports = seq(svc, "spec.ports");
    assert_eq!(svc_ports.len(), 1);
    let port = int(&svc_ports[0], "port");
    assert_eq!(port, 50051);

    // one Indexed Job of W pods: a container that fails restarts in its pod, the restarts of
    // the whole run are bounded, and the run fails or succeeds as one
    let w = cfg.cluster.workers as u64;
    let s = cfg.num_shards() as u64;
    assert_eq!((s, w), (2, 4));
    assert_eq!(text(job, "spec.completionMode"), "Indexed");
    assert_eq!(int(job, "spec.completions"), w, "completions = W");
    assert_eq!(int(job, "spec.parallelism"), w, "all pods at once");
    assert_eq!(text(job, "spec.template.spec.restartPolicy"), "OnFailure");
    assert!((1..=20).contains(&int(job, "spec.backoffLimit")));
    assert!(int(job, "spec.activeDeadlineSeconds") > 0);
    assert_eq!(
        text(job, "spec.template.spec.subdomain"),
        text(svc, "metadata.name"),
        "pod DNS names need subdomain = the headless Service"
    );
    let dns: Vec<String> = (0..s)
        .map(|i| {
            format!(
                "{}-{i}.{}.{ns}.svc.cluster.local:{port}",
                text(job, "metadata.name"),
                text(svc, "metadata.name")
            )
        })
        .collect();
    assert_eq!(cfg.cluster.servers, dns);
    assert_eq!(
        cfg.cluster.servers,
        [
            "ps-run-0.ps-shards.ps.svc.cluster.local:50051",
            "ps-run-1.ps-shards.ps.svc.cluster.local:50051"
        ]
    );
    let names: Vec<&str> = seq(job, "spec.template.spec.containers")
        .iter()
        .map(|c| text(c, "name"))
        .collect();
    assert_eq!(names, ["shard", "worker"]);
    let shard = container(job, "shard");
    let worker = container(job, "worker");
    // a pinned image, the workspace's version, the same everywhere
    let version = env!("CARGO_PKG_VERSION");
    for (what, c) in [
        ("shard", shard),
        ("worker", worker),
        ("ps-outputs", &seq(outputs, "spec.containers")[0]),
    ] {
        assert_eq!(text(c, "image"), format!("ps:{version}"), "{what}");
    }

    // the shard container: /etc/ps/shard.sh from the ConfigMap, S from PS_SHARDS
    assert_eq!(strings(shard, "command"), ["sh", "/etc/ps/shard.sh"]);
    assert_config_mounted(job, shard, "/etc/ps/shard.sh", cm);
    assert_eq!(text(env_of(shard, "PS_SHARDS"), "value"), s.to_string());
    let script = at(cm, "data")
        .get("shard.sh")
        .and_then(Value::as_str)
        .unwrap();
    let server_line: String = script
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("ps-server "))
        .take(2)
        .collect::<Vec<_>>()
        .join(" ");
    let server_args: Vec<String> = server_line
        .split_whitespace()
        .map(|a| a.trim_matches('"').to_string())
        .filter(|a| a != "\\")
        .collect();
    assert_eq!(flag_value(&server_args, "--config"), "/etc/ps/config.toml");
    assert_config_mounted(job, shard, "/etc/ps/config.toml", cm);
    assert_config_mounted(job, worker, "/etc/ps/config.toml", cm);
    assert_eq!(
        flag_value(&server_args, "--listen"),
        format!("0.0.0.0:{port}")
    );
    let health_port: u64 = flag_value(&server_args, "--health-listen")
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let metrics_port: u64 = flag_value(&server_args, "--metrics-listen")
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let cports: BTreeMap<String, u64> = seq(shard, "ports")
        .iter()
        .map(|p| (text(p, "name").to_string(), int(p, "containerPort")))
        .collect();
    assert_eq!(cports[text(&svc_ports[0], "targetPort")], port);
    assert_eq!(cports["health"], health_port);
    assert_eq!(cports["metrics"], metrics_port);
    // probes: the kubelet's gRPC probe on the plaintext health port; readiness = the shard
    // service, liveness = the process
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        assert_eq!(
            int(shard, &format!("{probe}.grpc.port")),
            health_port,
            "{probe}"
        );
    }
    assert_eq!(
        text(shard, "readinessProbe.grpc.service"),
        ps_server::HEALTH_SERVICE
    );
    assert!(at(shard, "livenessProbe.grpc").get("service").is_none());

    // the run's identity and folder: the Job's UID, common to every pod; the folder on the claim
    for c in [shard, worker] {
        assert_eq!(
            text(env_of(c, "PS_K8S_JOB_UID"), "valueFrom.fieldRef.fieldPath"),
            "metadata.labels['batch.kubernetes.io/controller-uid']"
        );
    }
    let out = text(env_of(shard, "PS_SET_SERVER_OUT_DIR"), "value");
    assert_eq!(out, "/var/lib/ps/runs/$(PS_K8S_JOB_UID)");
    let runs = volume_at(job, shard, Path::new(out));
    assert_eq!(
        text(runs, "persistentVolumeClaim.claimName"),
        text(pvc, "metadata.name")
    );
    assert!(cfg.server.out_dir.starts_with("/var/lib/ps/runs"));
    assert_eq!(strings(pvc, "spec.accessModes"), ["ReadWriteMany"]);

    // token and TLS from Secrets; the shard credential in the shard container only
    assert!(cfg.cluster.tls.is_some() && cfg.cluster.token.is_some());
    for (key, secret, containers) in [
        ("token_file", "ps-token", vec![shard, worker]),
        ("tls_cert", "ps-tls", vec![shard, worker]),
        ("tls_key", "ps-tls", vec![shard, worker]),
        ("tls_ca", "ps-tls", vec![shard, worker]),
        ("shard_token_file", "ps-shard-token", vec![shard]),
    ] {
        let line = config_toml(cm)
            .lines()
            .find(|l| l.starts_with(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("no {key} in the config"));
        let file = line.split('"').nth(1).unwrap();
        assert!(file.starts_with("/etc/ps-secrets/"), "{line}");
        for c in containers {
            let v = volume_at(job, c, Path::new(file));
            assert_eq!(text(v, "secret.secretName"), secret, "{key}");
        }
    }
    assert!(
        !seq(worker, "volumeMounts")
            .iter()
            .any(|m| text(m, "mountPath").contains("shard-token")),
        "the workers never see the shard credential"
    );
    // one name on the certificate for every shard: the Service's
    assert!(
        config_toml(cm).lines().any(|l| l.starts_with(&format!(
            "tls_domain = \"{}.{ns}.svc.cluster.local\"",
            text(svc, "metadata.name")
        ))),
        "tls_domain names the Service"
    );

    // the worker: rank = JOB_COMPLETION_INDEX, the rest from the config
    let cmd = strings(worker, "command");
    assert_eq!(cmd[0], "ps-worker");
    assert_flags_exist("the worker container", "ps-worker", &cmd[1..]);
    assert_eq!(flag_value(&cmd, "--config"), "/etc/ps/config.toml");
    assert_eq!(flag_value(&cmd, "--device"), "auto");
    for f in ["--rank", "--world-size", "--servers"] {
        assert!(
            !cmd.iter().any(|a| a == f),
            "{f}: rank comes from JOB_COMPLETION_INDEX, the rest from the config"
        );
    }

    // the NetworkPolicy: the run's pods, gRPC from the run's pods only
    assert_eq!(string_map(netpol, "spec.podSelector.matchLabels"), selector);
    let grpc_rule = seq(netpol, "spec.ingress")
        .iter()
        .find(|r| r.get("ports").is_some() && int(&seq(r, "ports")[0], "port") == port)
        .expect("an ingress rule for the gRPC port");
    assert_eq!(
        string_map(&seq(grpc_rule, "from")[0], "podSelector.matchLabels"),
        selector
    );
    assert_eq!(strings(netpol, "spec.policyTypes"), ["Ingress", "Egress"]);

    // shard.sh, run here with stand-in ps-server and ps-launch that record their arguments
    check_shard_script(script, &server_args);

    // the image holds what the config names: the data at /opt/ps/data, binaries on PATH
    let docker = read(&deploy().join("Dockerfile"));
    assert!(docker.contains("cargo build --release --locked --bins"));
    assert!(docker.contains("FROM ${RUNTIME_IMAGE}") && docker.contains("debian:bookworm-slim"));
    assert!(docker.contains("target/release/ps-server target/release/ps-worker"));
    assert!(docker.contains("COPY --from=build /out/ /usr/local/bin/"));
    assert!(docker.contains("COPY data/ /opt/ps/data/"));
    assert!(
        docker.contains("USER 65532:65532"),
        "a numeric non-root user"
    );
    let in_repo = cfg.data.dir.strip_prefix("/opt/ps").unwrap();
    assert!(
        repo()
            .join(in_repo)
            .join("train-images-idx3-ubyte.gz")
            .exists(),
        "{} comes from the repository's {}",
        cfg.data.dir.display(),
        in_repo.display()
    );
}

/// Runs the ConfigMap's shard.sh with `sh` and stand-in binaries: a pod past S holds no shard;
/// shard 0 runs `ps-server` with the manifest's flags (which exist) and then exports with
/// `ps-launch --export` (whose flags exist); started again in the same run, it adds `--recover`;
/// a failing ps-server's exit code is the container's, without an export.
fn check_shard_script(script: &str, server_args: &[String]) {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let calls = tmp.path().join("calls");
    for name in ["ps-server", "ps-launch"] {
        write_exe(
            &bin.join(name),
            &format!(
                "#!/bin/sh\necho \"{name} $*\" >> {}\nif [ {name} = ps-server ]; then exit \"${{FAKE_RC:-0}}\"; fi\nexit 0\n",
                calls.display()
            ),
        );
    }
    let script_path = tmp.path().join("shard.sh");
    std::fs::write(&script_path, script).unwrap();
    let out_dir = tmp.path().join("runs/uid-1");
    let run = |index: u32, rc: u8| {
        let _ = std::fs::remove_file(&calls);
        let out = Command::new("sh")
            .arg(&script_path)
            .env_clear()
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
            .env("JOB_COMPLETION_INDEX", index.to_string())
            .env("PS_SHARDS", "2")
            .env("PS_SET_SERVER_OUT_DIR", &out_dir)
            .env("FAKE_RC", rc.to_string())
            .output()
            .unwrap();
        let calls = std::fs::read_to_string(&calls).unwrap_or_default();
        (
            out.status.code(),
            calls,
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, calls_made, stdout) = run(3, 0);
    assert_eq!(code, Some(0));
    assert!(calls_made.is_empty(), "{calls_made}");
    assert!(stdout.contains("no shard in this pod"), "{stdout}");

    let (code, calls_made, _) = run(0, 0);
    assert_eq!(code, Some(0), "{calls_made}");
    let lines: Vec<&str> = calls_made.lines().collect();
    assert_eq!(lines.len(), 2, "{calls_made}");
    let server: Vec<String> = lines[0].split_whitespace().map(str::to_string).collect();
    assert_eq!(server[0], "ps-server");
    assert_flags_exist("shard.sh", "ps-server", &server[1..]);
    assert_eq!(flag_value(&server, "--shard"), "0");
    assert!(!server.iter().any(|a| a == "--recover"));
    for f in [
        "--config",
        "--listen",
        "--health-listen",
        "--metrics-listen",
    ] {
        assert_eq!(flag_value(&server, f), flag_value(server_args, f), "{f}");
    }
    let launch: Vec<String> = lines[1].split_whitespace().map(str::to_string).collect();
    assert_eq!(launch[0], "ps-launch");
    assert_flags_exist("shard.sh", "ps-launch", &launch[1..]);
    assert!(launch.iter().any(|a| a == "--export"));
    assert_eq!(flag_value(&launch, "--out-dir"), out_dir.to_str().unwrap());

    // the same shard started again in this run: --recover; its failure is the container's
    let (code, calls_made, _) = run(0, 1);
    assert_eq!(code, Some(1));
    assert_eq!(calls_made.lines().count(), 1, "no export: {calls_made}");
    assert!(calls_made.contains(" --recover"), "{calls_made}");

    // shard 1: its first start resumes nothing, and it does not export
    let (code, calls_made, _) = run(1, 0);
    assert_eq!(code, Some(0));
    assert_eq!(calls_made.lines().count(), 1, "{calls_made}");
    assert!(calls_made.contains("--shard 1") && !calls_made.contains("--recover"));
}

/// Only shard pods are scraped: no pod-wide `prometheus.io/scrape` annotation (pods from
/// PS_SHARDS on run no shard), and the documented scrape job keeps exactly the completion
/// indices 0..PS_SHARDS; the shards linger for the last scrape.
#[test]
fn only_shard_pods_are_scraped_and_the_final_figures_are_served() {
    let path = deploy().join("k8s/ps-cluster.yaml");
    let docs = yaml_docs(&path);
    let job = find(&docs, "Job", "ps-run");
    let annotations = at(job, "spec.template.metadata");
    assert!(
        annotations
            .get("annotations")
            .and_then(|a| a.get("prometheus.io/scrape"))
            .is_none(),
        "every pod of the Job would be scraped"
    );
    let shards: usize = text(env_of(container(job, "shard"), "PS_SHARDS"), "value")
        .parse()
        .unwrap();
    let readme = read(&deploy().join("README.md"));
    let want = (0..shards)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join("|");
    assert!(
        readme.contains(&format!(
            "regex: \"{want}\"            # 0 to PS_SHARDS - 1"
        )),
        "the README's scrape job keeps indices {want}"
    );
    let cm = find(&docs, "ConfigMap", "ps-config");
    let dir = tempfile::tempdir().unwrap();
    let cfg = k8s_config(cm, dir.path());
    assert!(cfg.server.metrics_linger_secs >= 60.0);
}
