//! `deploy/` validated offline: the Kubernetes manifests and every config are checked against
//! the config parser and the real binaries' `--help`, and the Slurm batch script is run on this
//! machine: its config generation with made-up node names, and a whole job (2 shards, 2
//! workers, a few steps on MNIST) with a stand-in `srun` that runs the tasks here. No Slurm,
//! Kubernetes or Docker is needed.
#![allow(clippy::too_many_lines)] // a scenario test reads top to bottom in one function

use ps_config::Config;
use ps_launch::bin_dir;
use ps_tests::slurm::{
    Group, fake_job_env, free_port_pair, repo, run_sbatch, sbatch, small_template, write_exe,
};
use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn deploy() -> PathBuf {
    repo().join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file under `dir`, recursively, sorted; the crates beside the deployment files
/// (`deploy/launch`, `deploy/plan`: a folder with a `Cargo.toml`) are not deployment files.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.unwrap().path();
            if p.is_dir() && p.join("Cargo.toml").is_file() {
                continue;
            }
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn rel(p: &Path) -> String {
    p.strip_prefix(deploy()).unwrap_or(p).display().to_string()
}

// ---------------------------------------------------------------------------------------------
// the binaries' flags

/// The long flags `BIN --help` lists (`--config`, `--shard`, ...).
fn help_flags(bin: &str) -> BTreeSet<String> {
    let exe = bin_dir().join(bin);
    let out = Command::new(&exe)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (build the binaries first: cargo build --release --bins, or cargo test --workspace)",
                exe.display()
            )
        });
    assert!(out.status.success(), "{bin} --help: {:?}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let flags: BTreeSet<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect();
    assert!(
        flags.contains("--config") && flags.contains("--help"),
        "{bin} --help lists {flags:?}"
    );
    flags
}

/// The `--flag` names in a command line (`--x=y` counts as `--x`).
fn flags_of(args: &[String]) -> Vec<String> {
    args.iter()
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap().to_string())
        .collect()
}

/// The value after `flag` in `args`.
fn flag_value<'a>(args: &'a [String], flag: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("{flag} missing from {args:?}"));
    args.get(i + 1)
        .unwrap_or_else(|| panic!("{flag} has no value in {args:?}"))
}

fn assert_flags_exist(what: &str, bin: &str, args: &[String]) {
    let known = help_flags(bin);
    for f in flags_of(args) {
        assert!(
            known.contains(&f),
            "{what}: {bin} has no flag {f} (its --help lists {known:?}); command {args:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// YAML helpers

/// The YAML documents of a manifest (separated by `---` lines).
fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = read(path);
    let mut docs = Vec::new();
    let mut cur = String::new();
    for line in text.lines().chain(std::iter::once("---")) {
        if line.trim_end() == "---" {
            let body = cur
                .lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
            if body {
                let v: Value = serde_yaml::from_str(&cur).unwrap_or_else(|e| {
                    panic!("{}: document {}: {e}\n{cur}", path.display(), docs.len())
                });
                docs.push(v);
            }
            cur.clear();
        } else {
            cur.push_str(line);
            cur.push('\n');
        }
    }
    docs
}

/// `v` at a dotted path; numeric segments index sequences.
fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    let mut cur = v;
    for seg in path.split('.') {
        let next = match seg.parse::<usize>() {
            Ok(i) => cur.get(i),
            Err(_) => cur.get(seg),
        };
        cur = next.unwrap_or_else(|| {
            panic!(
                "no {path} (missing {seg:?}) in\n{}",
                serde_yaml::to_string(v).unwrap()
            )
        });
    }
    cur
}

fn text<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("{path}: expected a string, found {:?}", at(v, path)))
}

fn int(v: &Value, path: &str) -> u64 {
    at(v, path)
        .as_u64()
        .unwrap_or_else(|| panic!("{path}: expected an integer, found {:?}", at(v, path)))
}

fn seq<'a>(v: &'a Value, path: &str) -> &'a Vec<Value> {
    at(v, path)
        .as_sequence()
        .unwrap_or_else(|| panic!("{path}: expected a list, found {:?}", at(v, path)))
}

fn strings(v: &Value, path: &str) -> Vec<String> {
    seq(v, path)
        .iter()
        .map(|x| {
            x.as_str()
                .unwrap_or_else(|| panic!("{path}: {x:?} is not a string"))
                .to_string()
        })
        .collect()
}

/// A string-to-string mapping (labels, selectors).
fn string_map(v: &Value, path: &str) -> BTreeMap<String, String> {
    at(v, path)
        .as_mapping()
        .unwrap_or_else(|| panic!("{path}: expected a mapping"))
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().unwrap().to_string(),
                v.as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The config file the ConfigMap holds.
fn config_toml(cm: &Value) -> &str {
    at(cm, "data")
        .get("config.toml")
        .and_then(Value::as_str)
        .expect("the ConfigMap's data has a config.toml string")
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| text(d, "kind") == kind && text(d, "metadata.name") == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/k8s"))
}

/// The container `name` of a pod template (`spec.template.spec` of a Job).
fn container<'a>(job: &'a Value, name: &str) -> &'a Value {
    seq(job, "spec.template.spec.containers")
        .iter()
        .find(|c| text(c, "name") == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The env entry `name` of a container.
fn env_of<'a>(c: &'a Value, name: &str) -> &'a Value {
    seq(c, "env")
        .iter()
        .find(|e| text(e, "name") == name)
        .unwrap_or_else(|| panic!("container {}: no env {name}", text(c, "name")))
}

/// The volume of pod template `job` mounted in container `c` at `file` or a parent of it.
fn volume_at<'a>(job: &'a Value, c: &Value, file: &Path) -> &'a Value {
    let mount = seq(c, "volumeMounts")
        .iter()
        .filter(|m| file.starts_with(text(m, "mountPath")))
        .max_by_key(|m| text(m, "mountPath").len())
        .unwrap_or_else(|| {
            panic!(
                "container {}: nothing mounted at {}",
                text(c, "name"),
                file.display()
            )
        });
    seq(job, "spec.template.spec.volumes")
        .iter()
        .find(|v| text(v, "name") == text(mount, "name"))
        .expect("the mounted volume")
}

/// Asserts that `config` names a file mounted from ConfigMap `cm` (key = the file's name).
fn assert_config_mounted(job: &Value, c: &Value, config: &str, cm: &Value) {
    let path = Path::new(config);
    let key = path.file_name().unwrap().to_str().unwrap();
    let volume = volume_at(job, c, path);
    assert_eq!(
        text(volume, "configMap.name"),
        text(cm, "metadata.name"),
        "{config} is the ConfigMap"
    );
    assert!(
        at(cm, "data").get(key).is_some(),
        "the ConfigMap has key {key}"
    );
}

/// The ConfigMap's config.toml, parsed with the Secrets' files in place: the token and TLS
/// paths under /etc/ps-secrets/ point at a token and at the tests' TLS files in `dir`.
fn k8s_config(cm: &Value, dir: &Path) -> Config {
    let tls = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tls");
    for (sub, file, from) in [
        ("token", "token", None),
        ("shard-token", "token", None),
        ("tls", "tls.crt", Some(tls.join("shard.pem"))),
        ("tls", "tls.key", Some(tls.join("shard.key"))),
        ("tls", "ca.crt", Some(tls.join("ca.pem"))),
    ] {
        let d = dir.join(sub);
        std::fs::create_dir_all(&d).unwrap();
        match from {
            Some(f) => std::fs::copy(f, d.join(file)).map(|_| ()).unwrap(),
            None => {
                std::fs::write(d.join(file), "a-token-for-the-deploy-test-0123456789\n").unwrap()
            }
        }
    }
    let text = config_toml(cm).replace("/etc/ps-secrets/", &format!("{}/", dir.display()));
    Config::parse(&text, Path::new("/etc/ps/config.toml"))
        .unwrap_or_else(|e| panic!("the ConfigMap's config.toml: {e}"))
}

// ---------------------------------------------------------------------------------------------
// processes

// The batch script's runs, the stand-in srun and the job's environment: `ps_tests::slurm`.

// ---------------------------------------------------------------------------------------------
// tests

#[test]
fn every_shell_script_parses() {
    let scripts: Vec<PathBuf> = files_under(&deploy())
        .into_iter()
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("sh" | "sbatch" | "bash")
            ) || read(p)
                .lines()
                .next()
                .is_some_and(|l| l.starts_with("#!") && (l.contains("bash") || l.ends_with("/sh")))
        })
        .collect();
    assert!(
        scripts.contains(&sbatch()),
        "found {:?}",
        scripts.iter().map(|p| rel(p)).collect::<Vec<_>>()
    );
    for s in &scripts {
        let out = Command::new("bash").arg("-n").arg(s).output().unwrap();
        assert!(
            out.status.success(),
            "bash -n {}: {}",
            rel(s),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // the batch script: strict, bounded, and its ps-server/ps-worker flags exist
    let body = read(&sbatch());
    assert!(body.contains("\nset -euo pipefail\n"));
    let directives: Vec<&str> = body.lines().filter(|l| l.starts_with("#SBATCH ")).collect();
    assert!(
        directives.iter().any(|l| l.starts_with("#SBATCH --time=")),
        "bounded: {directives:?}"
    );
    // GPUs are opt-in (a cluster without GPUs rejects any GPU request), the defaults fit a
    // 2-CPU node, and the job is told before its end to checkpoint (SIGUSR1)
    assert!(
        !directives
            .iter()
            .any(|l| l.contains("gpu") || l.contains("gres")),
        "no GPU request by default: {directives:?}"
    );
    assert!(
        directives.contains(&"#SBATCH --cpus-per-task=1"),
        "{directives:?}"
    );
    assert!(
        directives.contains(&"#SBATCH --signal=B:USR1@120"),
        "{directives:?}"
    );
    let mut launches = 0;
    for (bin, needed) in [
        ("ps-server", &["--config", "--shard", "--listen"][..]),
        ("ps-worker", &["--config", "--device"][..]),
    ] {
        let marker = format!("\"$bin/{bin}\"");
        let line = body
            .lines()
            .find(|l| l.contains(&marker))
            .unwrap_or_else(|| panic!("the batch script starts no {bin}"));
        let args: Vec<String> = line
            .split_once(&marker)
            .unwrap()
            .1
            .split_whitespace()
            .map(str::to_string)
            .collect();
        assert_flags_exist("ps-cluster.sbatch", bin, &args);
        for f in needed {
            assert!(flags_of(&args).iter().any(|a| a == f), "{bin} {f}: {line}");
        }
        launches += 1;
    }
    assert_eq!(launches, 2);
}

#[test]
fn every_toml_config_under_deploy_parses() {
    let tomls: Vec<PathBuf> = files_under(&deploy())
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    let names: Vec<String> = tomls.iter().map(|p| rel(p)).collect();
    for expected in ["mnist.toml", "slurm/template.toml"] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} in {names:?}"
        );
    }
    for p in &tomls {
        let cfg = Config::load(p).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            cfg.num_shards() >= 1 && cfg.cluster.workers >= 1,
            "{}",
            rel(p)
        );
    }
    let mnist_data = repo().join("data/mnist").canonicalize().unwrap();
    let local = Config::load(&deploy().join("mnist.toml")).unwrap();
    assert_eq!(
        local.cluster.servers,
        ["127.0.0.1:50051", "127.0.0.1:50052"]
    );
    assert_eq!(local.cluster.workers, 2);
    assert_eq!(local.data.dir.canonicalize().unwrap(), mnist_data);
    let slurm = Config::load(&deploy().join("slurm/template.toml")).unwrap();
    assert_eq!(slurm.data.dir.canonicalize().unwrap(), mnist_data);
    assert!(
        slurm.train.global_batch >= slurm.cluster.workers,
        "the template runs as is"
    );
    // the Kubernetes config (embedded in the ConfigMap) parses too; checked in detail below
    let docs = yaml_docs(&deploy().join("k8s/ps-cluster.yaml"));
    let cm = find(&docs, "ConfigMap", "ps-config");
    let secrets = tempfile::tempdir().unwrap();
    let cfg = k8s_config(cm, secrets.path());
    assert_eq!((cfg.num_shards(), cfg.cluster.workers), (2, 4));
}

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

#[test]
fn slurm_config_generation_gives_every_shard_its_node_and_port() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    let slurm_dir = deploy().join("slurm");
    let template = slurm_dir.join("template.toml");

    // the node list from a stand-in `scontrol show hostnames` (one name per line)
    let bin = tmp.join("bin");
    std::fs::create_dir(&bin).unwrap();
    write_exe(
        &bin.join("scontrol"),
        "#!/bin/sh\n[ \"$*\" = 'show hostnames gpu[01-02]' ] || { echo \"scontrol $*\" >&2; exit 1; }\nprintf 'gpu01\\ngpu02\\n'\n",
    );
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let job_dir = tmp.join("job");
    let (st, out, err, _) = run_sbatch(
        &[],
        &[
            ("PATH", path),
            ("PS_GENERATE_ONLY", "1".into()),
            ("SLURM_SUBMIT_DIR", repo().display().to_string()),
            ("SLURM_JOB_ID", "77".into()),
            ("SLURM_JOB_NODELIST", "gpu[01-02]".into()),
            ("SLURM_NTASKS", "8".into()),
            ("PS_JOB_DIR", job_dir.display().to_string()),
        ],
        &tmp,
        Duration::from_secs(30),
    );
    assert!(st.success(), "{st:?}\n{out}\n{err}");
    let generated = job_dir.join("config.toml");
    assert_eq!(out.lines().last(), Some(generated.to_str().unwrap()));
    let got = Config::load(&generated).unwrap_or_else(|e| panic!("{e}"));
    // ports from the job id (20000 + (77 mod 1000) * 40): concurrent jobs do not collide
    assert_eq!(
        got.cluster.servers,
        ["gpu01:23080", "gpu02:23081"],
        "one shard per node"
    );
    assert_eq!(got.cluster.workers, 8, "W = SLURM_NTASKS");
    // a per-job token (the template names none), readable by the job's user only
    let token = job_dir.join("token");
    assert_eq!(
        got.cluster.token,
        Some(ps_net::auth::Token::read(&token).unwrap())
    );
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&token).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "token mode {mode:o}");
    }
    // the outputs in a per-job folder under the template's out_dir
    assert_eq!(
        got.server.out_dir,
        slurm_dir.join("../../runs/slurm/slurm-77")
    );
    // everything else is the template's, relative paths resolved against the template's dir
    let mut want = Config::load(&template).unwrap();
    want.path = generated.clone();
    want.cluster.servers = got.cluster.servers.clone();
    want.cluster.workers = 8;
    want.cluster.token = got.cluster.token.clone();
    want.server.out_dir = want.server.out_dir.join("slurm-77");
    assert_eq!(got, want);
    assert!(got.data.dir.is_absolute() && got.server.out_dir.is_absolute());
    assert_eq!(
        got.data.dir.canonicalize().unwrap(),
        repo().join("data/mnist").canonicalize().unwrap()
    );

    // PS_NODES, more shards than nodes, another port; a template with a multi-line servers
    // array, comments, an absolute data dir and a relative out_dir
    let tdir = tmp.join("t");
    std::fs::create_dir(&tdir).unwrap();
    let custom = tdir.join("run.toml");
    std::fs::write(
        &custom,
        format!(
            "[cluster]   # the cluster\nservers = [\n  \"a:1\",  # first\n  \"b:2\",\n]\nworkers = 1\n\n[data]\ndir = {:?}\n\n[train]\nglobal_batch = 30\nsteps = 3\nloss_reduction = \"mean\"\naggregation = \"weighted\"\n\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n\n[server]\nout_dir = \"out\"\n",
            repo().join("data/mnist").display().to_string()
        ),
    )
    .unwrap();
    let job_dir2 = tmp.join("job2");
    let (st, out, err, _) = run_sbatch(
        &[&custom],
        &[
            ("PS_GENERATE_ONLY", "1".into()),
            ("PS_NODES", "n1 n2".into()),
            ("PS_SHARDS", "3".into()),
            ("PS_PORT", "6000".into()),
            ("PS_WORKERS", "3".into()),
            ("PS_JOB_DIR", job_dir2.display().to_string()),
            ("PS_BIN", bin_dir().display().to_string()),
        ],
        &tmp,
        Duration::from_secs(30),
    );
    assert!(st.success(), "{st:?}\n{out}\n{err}");
    assert!(
        out.contains("3 shard(s) at n1:6000 n2:6001 n1:6002; 3 worker(s)"),
        "{out}"
    );
    let got = Config::load(&job_dir2.join("config.toml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        got.cluster.servers,
        ["n1:6000", "n2:6001", "n1:6002"],
        "round-robin"
    );
    assert_eq!(got.cluster.workers, 3);
    assert_eq!(got.train.global_batch, 30);
    assert_eq!(got.data.dir, repo().join("data/mnist"), "absolute: kept");
    assert_eq!(
        got.server.out_dir,
        tdir.canonicalize().unwrap().join("out/slurm-local"),
        "no job id: the folder says so"
    );

    // refusals, each naming the problem
    let refusals: [(&[(&str, &str)], &str); 4] = [
        (&[("PS_NODES", "n1"), ("PS_SHARDS", "0")], "PS_SHARDS=0"),
        (&[("PS_NODES", "n1")], "PS_WORKERS=unset"),
        (&[("SLURM_NTASKS", "2")], "SLURM_JOB_NODELIST is not set"),
        (
            &[
                ("PS_NODES", "n1"),
                ("SLURM_NTASKS", "2"),
                ("PS_PORT", "65535"),
                ("PS_SHARDS", "2"),
            ],
            "exceed 65535",
        ),
    ];
    for (env, msg) in refusals {
        let mut env: Vec<(&str, String)> = env.iter().map(|(k, v)| (*k, v.to_string())).collect();
        env.push(("PS_GENERATE_ONLY", "1".into()));
        env.push(("PS_JOB_DIR", tmp.join("job3").display().to_string()));
        let (st, _, err, _) = run_sbatch(&[&custom], &env, &tmp, Duration::from_secs(30));
        assert_eq!(st.code(), Some(2), "{env:?}: {err}");
        assert!(err.contains(msg), "{env:?}: {err}");
    }
    let no_workers = tdir.join("bad.toml");
    std::fs::write(&no_workers, "[cluster]\nservers = [\"a:1\"]\n").unwrap();
    let (st, _, err, _) = run_sbatch(
        &[&no_workers],
        &[
            ("PS_GENERATE_ONLY", "1".into()),
            ("PS_NODES", "n1".into()),
            ("PS_WORKERS", "1".into()),
            ("PS_JOB_DIR", tmp.join("job4").display().to_string()),
        ],
        &tmp,
        Duration::from_secs(30),
    );
    assert!(!st.success());
    assert!(
        err.contains("no [cluster] servers and workers lines"),
        "{err}"
    );
}

#[test]
fn slurm_job_runs_a_whole_cluster_with_a_stand_in_srun() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    let template = small_template(&tmp, 120, None);
    let port = free_port_pair();
    let (st, out, err, took) = run_sbatch(
        &[&template],
        &fake_job_env(&tmp, port),
        &tmp,
        Duration::from_secs(180),
    );
    let job = tmp.join("runs/slurm-4242");
    let logs = |name: &str| std::fs::read_to_string(job.join(name)).unwrap_or_default();
    assert!(
        st.success(),
        "{st:?} after {took:?}\nstdout:\n{out}\nstderr:\n{err}\nshard 0:\n{}\nworker 0:\n{}",
        logs("shard-0.log"),
        logs("worker-0.log")
    );
    assert!(out.contains(&format!(
        "2 shard(s) at 127.0.0.1:{port} 127.0.0.1:{}; 2 worker(s)",
        port + 1
    )));
    assert!(out.contains("ps-cluster: finished"), "{out}");
    let cfg = Config::load(&job.join("config.toml")).unwrap();
    assert_eq!(
        cfg.cluster.servers,
        [
            format!("127.0.0.1:{port}"),
            format!("127.0.0.1:{}", port + 1)
        ]
    );
    assert!(
        logs("shard-0.log").contains("training finished: 5 steps"),
        "{}",
        logs("shard-0.log")
    );
    for i in 0..2 {
        let log = logs(&format!("shard-{i}.log"));
        assert!(
            log.contains(&format!("shard {i}: final weights (version 5) written to")),
            "{log}"
        );
    }
    for r in 0..2 {
        let log = logs(&format!("worker-{r}.log"));
        assert!(
            log.contains(&format!("rank {r} of 2, local rank {r}, from slurm")),
            "{log}"
        );
    }
    for i in 0..2 {
        assert!(
            tmp.join(format!("out/slurm-4242/shard-{i}.safetensors"))
                .exists(),
            "final weights of shard {i} in the job's folder under the template's out_dir"
        );
    }
    // merged and drawn at the end, as ps-launch does
    for f in ["model.safetensors", "curves.svg"] {
        assert!(tmp.join("out/slurm-4242").join(f).exists(), "{f}: {out}");
    }
    assert!(out.contains("every shard listens"), "{out}");
    for r in 0..2 {
        let log = logs(&format!("worker-{r}.log"));
        assert!(log.contains("run 4242 (run id from the Slurm job"), "{log}");
    }
    // what was asked of srun (the shard steps start in the background: any order): each
    // shard pinned to its node, the workers one GPU each
    let calls = read(&tmp.join("srun.log"));
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 3, "{calls:?}");
    let config = job.join("config.toml");
    for i in 0..2u16 {
        let shard = format!(
            "/ps-server --config {} --shard {i} --listen 0.0.0.0:{}",
            config.display(),
            port + i
        );
        let call = calls
            .iter()
            .find(|c| c.ends_with(&shard))
            .unwrap_or_else(|| panic!("no srun step runs ...{shard}: {calls:?}"));
        assert!(
            call.starts_with("--nodes=1 --ntasks=1 --nodelist=127.0.0.1 --overlap"),
            "{call}"
        );
    }
    let workers: Vec<&&str> = calls.iter().filter(|c| c.contains("/ps-worker ")).collect();
    assert_eq!(workers.len(), 1, "one worker step: {calls:?}");
    assert!(
        workers[0]
            .starts_with("--ntasks=2 --gpus-per-task=1 --cpus-per-task=1 --kill-on-bad-exit=1"),
        "{}",
        workers[0]
    );
    assert!(
        workers[0].ends_with(&format!(
            "/ps-worker --config {} --device auto",
            config.display()
        )),
        "{}",
        workers[0]
    );
}

#[test]
fn slurm_job_stops_the_shards_when_the_workers_fail() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    // a barrier timeout far beyond the bound below: only the script can end the shards early
    let template = small_template(&tmp, 600, None);
    let port = free_port_pair();
    let mut env = fake_job_env(&tmp, port);
    env.push(("PS_DEVICE", "no-such-device".into()));
    let (st, out, err, took) = run_sbatch(&[&template], &env, &tmp, Duration::from_secs(60));
    assert_eq!(st.code(), Some(1), "the workers' exit code\n{out}\n{err}");
    assert!(took < Duration::from_secs(60), "bounded: {took:?}");
    assert!(
        err.contains("the workers failed (exit 1), stopping the shards"),
        "{err}"
    );
    let worker = read(&tmp.join("runs/slurm-4242/worker-0.log"));
    assert!(worker.contains("no-such-device"), "{worker}");
    let pids = read(&tmp.join("srun.pids"));
    let pids: Vec<i32> = pids.lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(pids.len(), 4, "2 shards + 2 workers");
    for pid in pids {
        // SAFETY: signal 0 only checks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!alive, "process {pid} still runs after the job ended");
    }
}

#[test]
fn slurm_job_fails_within_the_wait_naming_a_shard_that_never_listens() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    let template = small_template(&tmp, 600, None);
    let port = free_port_pair();
    // stand-in binaries: a shard that starts but never listens; a worker that must not start
    let fake = tmp.join("fakebin");
    std::fs::create_dir(&fake).unwrap();
    // (the credentials step is the real one's)
    write_exe(
        &fake.join("ps-server"),
        &format!(
            "#!/bin/sh\n[ \"$1\" = credentials ] && exec {:?} \"$@\"\necho 'shard stuck before listening'\nexec sleep 600\n",
            bin_dir().join("ps-server")
        ),
    );
    write_exe(
        &fake.join("ps-worker"),
        "#!/bin/sh\necho started >\"$FAKE_WORKER_MARK\"\n",
    );
    let mut env = fake_job_env(&tmp, port);
    env.retain(|(k, _)| *k != "PS_BIN");
    env.push(("PS_BIN", fake.display().to_string()));
    env.push(("PS_SHARD_WAIT", "3".into()));
    env.push((
        "FAKE_WORKER_MARK",
        tmp.join("worker-ran").display().to_string(),
    ));
    let (st, out, err, took) = run_sbatch(&[&template], &env, &tmp, Duration::from_secs(60));
    assert_eq!(st.code(), Some(3), "{out}\n{err}");
    assert!(took < Duration::from_secs(30), "fails fast: {took:?}");
    let log = tmp.join("runs/slurm-4242/shard-0.log");
    assert!(
        err.contains(&format!(
            "shard 0 is not listening on 127.0.0.1:{port} after 3 s; see {}",
            log.display()
        )) && err.contains("shard stuck before listening"),
        "names the shard, its log and the log's end: {err}"
    );
    assert!(!tmp.join("worker-ran").exists(), "no worker started");
}

/// The Slurm recipe restarts a lost shard with `--recover`: shard 1's process killed with
/// SIGKILL mid-run (as the OOM killer does), the job still succeeds and its final weights equal
/// those of a job that lost nothing, bit for bit.
#[test]
fn slurm_job_restarts_a_lost_shard_and_ends_with_the_same_weights() {
    let job = |kill: bool| {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().canonicalize().unwrap();
        let template = small_template(&tmp, 120, None);
        let text = read(&template).replace("steps = 5\n", "steps = 150\n")
            + "\n[checkpoint]\nevery = 10\n";
        std::fs::write(&template, text).unwrap();
        let port = free_port_pair();
        let env = fake_job_env(&tmp, port);
        let killer = kill.then(|| {
            let tmp = tmp.clone();
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let log = tmp.join("runs/slurm-4242/shard-1.log");
                while !read_opt(&log).contains("checkpoint of version 40 written") {
                    assert!(t0.elapsed() < Duration::from_secs(90), "no progress");
                    std::thread::sleep(Duration::from_millis(10));
                }
                let pids = read_opt(&tmp.join("srun.pids"));
                let shard1 = pids
                    .lines()
                    .filter_map(|l| l.trim().parse::<i32>().ok())
                    .find(|p| {
                        let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                        cmd.contains("ps-server") && cmd.contains("--shard 1 ")
                    })
                    .expect("shard 1's process");
                // SAFETY: kill(2) on a process this test's job started.
                unsafe { libc::kill(shard1, libc::SIGKILL) };
            })
        });
        let (st, out, err, _) = run_sbatch(&[&template], &env, &tmp, Duration::from_secs(180));
        if let Some(k) = killer {
            k.join().unwrap();
        }
        let jobdir = tmp.join("runs/slurm-4242");
        assert!(
            st.success(),
            "{st:?}\n{out}\n{err}\nshard 1:\n{}",
            read_opt(&jobdir.join("shard-1.restart-1.log"))
        );
        if kill {
            assert!(
                err.contains(
                    "ps-cluster: shard 1 was lost (exit 137); starting it again with --recover"
                ),
                "{err}"
            );
            let log = read(&jobdir.join("shard-1.restart-1.log"));
            assert!(log.contains("every shard rolls back to version"), "{log}");
        }
        let cfg = Config::load(&jobdir.join("config.toml")).unwrap();
        ps_model::weights::read_shards(&cfg.server.out_dir, 2, cfg.layout().num_params())
            .unwrap()
            .0
    };
    let straight = job(false);
    let recovered = job(true);
    assert_eq!(straight.len(), recovered.len());
    assert!(
        straight
            .iter()
            .zip(&recovered)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the recovered job's weights differ from the straight job's"
    );
}

fn read_opt(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The deploy README's override examples (`PS_SET_TRAIN_STEPS=100`, `--set train.steps=100`),
/// run on both shipped configs, which state `epochs`: the set key replaces it, and back.
#[test]
fn the_readmes_override_examples_work_on_the_shipped_configs() {
    let readme = read(&deploy().join("README.md"));
    assert!(
        readme.contains("`PS_SET_TRAIN_STEPS=100`") && readme.contains("`--set train.steps=100`"),
        "the examples this test runs are in deploy/README.md"
    );
    let slurm_dir = tempfile::tempdir().unwrap();
    for config in [
        deploy().join("mnist.toml"),
        deploy().join("slurm/template.toml"),
    ] {
        assert!(
            read(&config).contains("\nepochs = "),
            "{}",
            config.display()
        );
        let check = |env: &[(&str, &str)], args: &[&str]| {
            let out = Command::new(bin_dir().join("ps-server"))
                .arg("--config")
                .arg(&config)
                .args(["--shard", "0", "--check", "--data-dir"])
                .arg(repo().join("data/mnist"))
                .args(["--out-dir"])
                .arg(slurm_dir.path())
                .args(args)
                .envs(env.iter().copied())
                .output()
                .unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout).to_string(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            );
            assert!(
                out.status.success(),
                "{} {env:?} {args:?}: {stderr}",
                config.display()
            );
            (stdout, stderr)
        };
        let (stdout, stderr) = check(&[("PS_SET_TRAIN_STEPS", "100")], &[]);
        assert!(stdout.contains("; 100 steps"), "{stdout}");
        assert!(
            stderr.contains("train.steps = 100 (from PS_SET_TRAIN_STEPS; clears train.epochs"),
            "{stderr}"
        );
        let (stdout, _) = check(&[], &["--set", "train.steps=100"]);
        assert!(stdout.contains("; 100 steps"), "{stdout}");
        // and back to epochs, over the environment's steps
        let (stdout, _) = check(
            &[("PS_SET_TRAIN_STEPS", "100")],
            &["--set", "train.epochs=1"],
        );
        assert!(!stdout.contains("; 100 steps"), "{stdout}");
    }
}

/// After a node loss (the whole job killed, SIGKILL) a new job with another id continues the
/// run with one documented setting, `PS_RESUME=1`: it finds the earlier run's folder and id by
/// itself, resumes from its checkpoints, finishes every step once, and exports
/// `model.safetensors` and `curves.svg`.
#[test]
fn slurm_resume_in_a_new_job_finds_the_earlier_run_by_itself_and_exports() {
    resume_in_a_new_job("1");
}

/// `PS_RESUME=<job id>`, the command a preempted job prints ("continue with: PS_RESUME=4242
/// sbatch ..."), continues that run as `PS_RESUME=1` does (it used to pick the run's folder
/// but start its shards without `--resume`).
#[test]
fn slurm_resume_of_a_named_job_continues_that_run() {
    resume_in_a_new_job("4242");
}

/// A job 4242 killed with SIGKILL past a few checkpoints, then job 4343 with `PS_RESUME=resume`:
/// it continues run 4242 in its folder to the last step and exports.
fn resume_in_a_new_job(resume: &str) {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().canonicalize().unwrap();
    let template = small_template(&tmp, 120, None);
    // gRPC only: a killed run leaves no shared-memory boards for the next to meet
    let text = read(&template)
        .replace("steps = 5", "steps = 300")
        .replace("[cluster]\n", "[cluster]\ntransport = \"grpc\"\n");
    std::fs::write(&template, format!("{text}\n[checkpoint]\nevery = 2\n")).unwrap();
    // the first job, killed with everything it started once some checkpoints exist
    let env = fake_job_env(&tmp, free_port_pair());
    let mut cmd = Command::new("bash");
    cmd.arg(sbatch())
        .arg(&template)
        .env_clear()
        .current_dir(&tmp)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(tmp.join("first.stdout")).unwrap())
        .stderr(std::fs::File::create(tmp.join("first.stderr")).unwrap())
        .process_group(0);
    for (k, v) in &env {
        cmd.env(k, v);
    }
    let mut first = cmd.spawn().unwrap();
    let group = Group(first.id());
    let metrics = tmp.join("out/slurm-4242/metrics.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 8 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no progress:\n{}",
            read(&tmp.join("first.stderr"))
        );
        assert!(
            first.try_wait().unwrap().is_none(),
            "the first job ended early:\n{}",
            read(&tmp.join("first.stderr"))
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(group);
    let _ = first.wait();
    // the next job: another id, PS_RESUME=1, nothing else
    let mut env = fake_job_env(&tmp, free_port_pair());
    for (k, v) in env.iter_mut() {
        if *k == "SLURM_JOB_ID" {
            *v = "4343".into();
        }
    }
    env.push(("PS_RESUME", resume.into()));
    let (st, out, err, _) = run_sbatch(&[&template], &env, &tmp, Duration::from_secs(180));
    let shard0 = read(&tmp.join("runs/slurm-4343/shard-0.log"));
    assert!(st.success(), "{st:?}\n{out}\n{err}\n{shard0}");
    assert!(
        out.contains(&format!("PS_RESUME={resume}: continuing run 4242 in "))
            && out.contains("/out/slurm-4242"),
        "{out}"
    );
    assert!(shard0.contains("resuming at version "), "{shard0}");
    assert!(shard0.contains("run 4242"), "{shard0}");
    ps_tests::assert_metrics_steps(&read(&metrics), 300);
    for f in ["model.safetensors", "curves.svg"] {
        assert!(tmp.join("out/slurm-4242").join(f).exists(), "{f}: {out}");
    }
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

/// Every number deploy/README.md states about the recipes is the number in the file it
/// describes: each row is (what the README says, the file, what the file says). A change to
/// either side without the other fails here.
#[test]
fn the_deploy_readmes_numbers_are_those_of_the_files() {
    let readme = read(&deploy().join("README.md"));
    // both sides wrap lines (the README's prose, YAML, a shell `\` continuation): compare
    // with single spaces
    let flat = |s: &str| {
        s.split_whitespace()
            .filter(|w| *w != "\\")
            .collect::<Vec<_>>()
            .join(" ")
    };
    let readme = flat(&readme);
    let rows: &[(&str, &str, &str)] = &[
        // Slurm: the batch script's #SBATCH lines and defaults, the template
        (
            "(default: 1 node × 2 tasks, 1 CPU per task, no GPU, 1 hour",
            "slurm/ps-cluster.sbatch",
            "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --cpus-per-task=1\n#SBATCH --time=01:00:00\n",
        ),
        (
            "`#SBATCH --signal=B:USR1@120` warns the batch script 120 s before",
            "slurm/ps-cluster.sbatch",
            "#SBATCH --signal=B:USR1@120\n",
        ),
        (
            "`PS_PORT` defaults to `20000 + (SLURM_JOB_ID mod 1000) * 40`",
            "slurm/ps-cluster.sbatch",
            "default_port=$((20000 + (10#$job_id % 1000) * 40))",
        ),
        (
            "(up to `PS_SHARD_RESTARTS` times, default 2;",
            "slurm/ps-cluster.sbatch",
            "shard_restarts=${PS_SHARD_RESTARTS:-2}",
        ),
        (
            "within `PS_SHARD_WAIT` seconds (default 60)",
            "slurm/ps-cluster.sbatch",
            "shard_wait=${PS_SHARD_WAIT:-60}",
        ),
        (
            "`PS_SHARD_CPUS`, default 1, CPUs each",
            "slurm/ps-cluster.sbatch",
            "shard_cpus=${PS_SHARD_CPUS:-1}",
        ),
        (
            "`[server] barrier_timeout_secs` (the template: 300 s)",
            "slurm/template.toml",
            "barrier_timeout_secs = 300 ",
        ),
        // Kubernetes: the Job, the config in its ConfigMap, the claim, the probes
        (
            "against `backoffLimit` (6)",
            "k8s/ps-cluster.yaml",
            "backoffLimit: 6 ",
        ),
        (
            "Shards wait for it up to `barrier_timeout_secs` (600 s here",
            "k8s/ps-cluster.yaml",
            "barrier_timeout_secs = 600 ",
        ),
        (
            "(`[checkpoint] every = 200`, on the claim",
            "k8s/ps-cluster.yaml",
            "every = 200 ",
        ),
        (
            "(`metrics_linger_secs = 120` in the template)",
            "k8s/ps-cluster.yaml",
            "metrics_linger_secs = 120 ",
        ),
        (
            "`ps-runs` (20 Gi, ReadWriteMany",
            "k8s/ps-base.yaml",
            "storage: 20Gi\n",
        ),
        (
            "shard container 1 CPU and 2 GiB",
            "k8s/ps-cluster.yaml",
            "cpu: \"1\"\n              memory: 2Gi\n",
        ),
        (
            "worker container 2 CPUs and 4 GiB (`[worker] threads = 2`)",
            "k8s/ps-cluster.yaml",
            "cpu: \"2\"\n              memory: 4Gi\n",
        ),
        (
            "worker container 2 CPUs and 4 GiB (`[worker] threads = 2`)",
            "k8s/ps-cluster.yaml",
            "threads = 2 ",
        ),
        (
            "scrape the shard pods (completion index below `PS_SHARDS`, here 2)",
            "k8s/ps-cluster.yaml",
            "- name: PS_SHARDS  # S\n              value: \"2\"\n",
        ),
        (
            "`startupProbe` (up to 5 min)",
            "k8s/ps-cluster.yaml",
            "periodSeconds: 5\n            failureThreshold: 60\n",
        ),
        (
            "--shard $i --listen 0.0.0.0:50051 --health-listen 0.0.0.0:50052 --metrics-listen 0.0.0.0:9090",
            "k8s/ps-cluster.yaml",
            "--shard \"$i\" --listen 0.0.0.0:50051 \\\n      --health-listen 0.0.0.0:50052 --metrics-listen 0.0.0.0:9090 $extra",
        ),
        (
            "all mode 0440 for the pod's group",
            "k8s/ps-cluster.yaml",
            "defaultMode: 288   # 0440",
        ),
        (
            "(uid/gid 65532, the image's user)",
            "k8s/ps-cluster.yaml",
            "runAsUser: 65532\n        runAsGroup: 65532\n",
        ),
        // the image
        (
            "`cargo build --release --locked --bins` in `rust:1.95-bookworm`",
            "Dockerfile",
            "FROM rust:1.95-bookworm AS build\n",
        ),
        (
            "a `debian:bookworm-slim` image, running as the numeric user 65532",
            "Dockerfile",
            "ARG RUNTIME_IMAGE=debian:bookworm-slim\n",
        ),
        (
            "a `debian:bookworm-slim` image, running as the numeric user 65532",
            "Dockerfile",
            "USER 65532:65532\n",
        ),
        // the offline checks
        (
            "for every V from 1.28.0 to 1.37.0",
            "../scripts/deploy-checks.sh",
            "for v in 1.28.0 1.29.0 1.30.0 1.31.0 1.32.0 1.33.0 1.34.0 1.35.0 1.36.0 1.37.0; do",
        ),
    ];
    for (said, file, there) in rows {
        assert!(
            readme.contains(&flat(said)),
            "deploy/README.md no longer says {said:?}: update this row with it"
        );
        let text = flat(&read(&deploy().join(file)));
        assert!(
            text.contains(&flat(there)),
            "deploy/README.md says {said:?}, but deploy/{file} has no {there:?}"
        );
    }
    // a worker that cannot reach a shard says so every CONNECT_LOG_EVERY
    let every = ps_net::client::CONNECT_LOG_EVERY.as_secs();
    assert!(
        readme.contains(&format!(
            "A worker that cannot reach a shard says so every {every} s"
        )),
        "deploy/README.md: the worker's connect message comes every {every} s"
    );
}

/// The deploy README's own example of the config generation, run as printed (only its job
/// folder moved into a temporary one): two shards on the named nodes, 8 workers, and a config
/// the real parser loads.
#[test]
fn the_deploy_readmes_config_generation_example_runs_as_printed() {
    let readme = read(&deploy().join("README.md"));
    let example = "PS_GENERATE_ONLY=1 PS_NODES=\"n1 n2\" PS_WORKERS=8 PS_JOB_DIR=/tmp/job \\\n    bash deploy/slurm/ps-cluster.sbatch && cat /tmp/job/config.toml";
    assert!(readme.contains(example), "the example this test runs");
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job");
    let cmd = example
        .replace("\\\n    ", "")
        .replace("/tmp/job", &job.display().to_string());
    let out = Command::new("bash")
        .args(["-c", &cmd])
        .current_dir(repo())
        .env_remove("SLURM_JOB_ID")
        .env_remove("SLURM_NTASKS")
        .env_remove("PS_PORT")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{cmd}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    // without a job id the ports are the fixed default, as the README says
    assert!(
        stdout.contains("servers = [\"n1:50051\", \"n2:50052\"]\nworkers = 8\n"),
        "{stdout}"
    );
    let cfg = Config::load(&job.join("config.toml")).unwrap();
    assert_eq!((cfg.num_shards(), cfg.cluster.workers), (2, 8));
}
