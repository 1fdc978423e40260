//! Reading the Kubernetes manifests: their YAML documents, values at dotted paths, a pod
//! template's containers, env entries and volumes, and the ConfigMap's config parsed with the
//! tests' credentials in place of the Secrets'.

use super::*;

/// The YAML documents of a manifest (separated by `---` lines).
pub(super) fn yaml_docs(path: &Path) -> Vec<Value> {
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
pub(super) fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
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

pub(super) fn text<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("{path}: expected a string, found {:?}", at(v, path)))
}

pub(super) fn int(v: &Value, path: &str) -> u64 {
    at(v, path)
        .as_u64()
        .unwrap_or_else(|| panic!("{path}: expected an integer, found {:?}", at(v, path)))
}

pub(super) fn seq<'a>(v: &'a Value, path: &str) -> &'a Vec<Value> {
    at(v, path)
        .as_sequence()
        .unwrap_or_else(|| panic!("{path}: expected a list, found {:?}", at(v, path)))
}

pub(super) fn strings(v: &Value, path: &str) -> Vec<String> {
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
pub(super) fn string_map(v: &Value, path: &str) -> BTreeMap<String, String> {
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
pub(super) fn config_toml(cm: &Value) -> &str {
    at(cm, "data")
        .get("config.toml")
        .and_then(Value::as_str)
        .expect("the ConfigMap's data has a config.toml string")
}

pub(super) fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| text(d, "kind") == kind && text(d, "metadata.name") == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/k8s"))
}

/// The container `name` of a pod template (`spec.template.spec` of a Job).
pub(super) fn container<'a>(job: &'a Value, name: &str) -> &'a Value {
    seq(job, "spec.template.spec.containers")
        .iter()
        .find(|c| text(c, "name") == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The env entry `name` of a container.
pub(super) fn env_of<'a>(c: &'a Value, name: &str) -> &'a Value {
    seq(c, "env")
        .iter()
        .find(|e| text(e, "name") == name)
        .unwrap_or_else(|| panic!("container {}: no env {name}", text(c, "name")))
}

/// The volume of pod template `job` mounted in container `c` at `file` or a parent of it.
pub(super) fn volume_at<'a>(job: &'a Value, c: &Value, file: &Path) -> &'a Value {
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
pub(super) fn assert_config_mounted(job: &Value, c: &Value, config: &str, cm: &Value) {
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
pub(super) fn k8s_config(cm: &Value, dir: &Path) -> Config {
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
