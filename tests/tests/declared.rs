//! Models declared by the user (`[model] init = "init.safetensors"`): a cluster in this process trains a
//! declared model from the file's weights exactly as the single-process reference does; the
//! config refuses missing, malformed and non-f32 init files; a shard refuses a worker that
//! describes another model, naming the first tensor that differs; ps-worker refuses a declared
//! model that is not an MLP.

use ps_config::{Config, TestConfig};
use ps_launch::launch::bin_dir;
use ps_model::declared::ORDER_KEY;
use ps_model::layout::MlpLayout;
use ps_net::client::ShardClient;
use ps_proto::PROTOCOL_VERSION;
use ps_proto::pb::{RegisterRequest, TensorDesc};
use ps_tests::{cluster_weights, mnist_dir, reference_weights, rel_diff};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Writes `tensors` with the order metadata listing them in the given order.
fn write_init(path: &Path, tensors: &[(&str, &[usize], &[f32])]) {
    let order: Vec<&str> = tensors.iter().map(|t| t.0).collect();
    let meta: BTreeMap<String, String> = [(
        ORDER_KEY.to_string(),
        serde_json::to_string(&order).unwrap(),
    )]
    .into();
    ps_model::weights::write_safetensors(path, tensors, &meta).unwrap();
}

/// An MLP 784-32-10 init file with weights from seed 99 (the config's seed is 7).
fn mlp_init(path: &Path) -> Vec<f32> {
    let m = MlpLayout::new(&[784, 32, 10]);
    let flat = m.init_range(99, 0..m.num_params());
    let t: Vec<(&str, &[usize], &[f32])> = m
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice(), &flat[t.range()]))
        .collect();
    write_init(path, &t);
    flat
}

fn config(dir: &Path, init: &Path) -> (PathBuf, Config) {
    let text = TestConfig::new()
        .sgd(0.1, 0.9)
        .barrier_timeout_secs(120.0)
        .shards(2)
        .workers(2)
        .data_dir(mnist_dir())
        .global_batch(32)
        .steps(20)
        .out_dir(dir.join("out"))
        .model_init(init)
        .toml();
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    let cfg = Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
    (path, cfg)
}

#[test]
fn a_declared_mlp_trains_from_its_file_like_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let init = dir.path().join("init.safetensors");
    let flat = mlp_init(&init);
    let (path, cfg) = config(dir.path(), &init);
    assert_eq!(
        cfg.model.dims,
        [784, 32, 10],
        "the widths come from the file"
    );
    assert!(
        cfg.describe()
            .contains("declared model of 4 tensors (25,450 parameters)")
    );
    assert_eq!(cfg.initial_range(0..flat.len()).unwrap(), flat);
    ps_tests::inproc::run_in_process(&path);
    let got = cluster_weights(&cfg);
    let want = reference_weights(&cfg);
    assert!(
        rel_diff(&cfg, &flat, &want) > 1e-3,
        "training moved the weights"
    );
    let seeded = cfg.layout().init_range(cfg.train.seed, 0..flat.len());
    assert!(
        rel_diff(&cfg, &flat, &seeded) > 0.5,
        "the file is not the seed's init"
    );
    let d = rel_diff(&cfg, &got, &want);
    eprintln!("declared MLP: largest relative weight difference {d:.3e}");
    assert!(d < 1e-5, "{d}");
    // checkpoints identify the model by its parameter count; the export uses its names
    let out = std::process::Command::new(bin_dir().join("ps-launch"))
        .args(["--config", path.to_str().unwrap(), "--export"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (tensors, meta) =
        ps_model::weights::read_safetensors(&cfg.server.out_dir.join("model.safetensors")).unwrap();
    assert_eq!(
        meta[ORDER_KEY],
        r#"["fc1.weight","fc1.bias","fc2.weight","fc2.bias"]"#
    );
    assert_eq!(
        tensors.iter().map(|t| t.data.len()).sum::<usize>(),
        got.len()
    );
}

#[test]
fn bad_init_files_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let load = |init: &Path| {
        let text = TestConfig::new()
            .data_dir(mnist_dir())
            .model_init(init)
            .toml();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(&path).map(drop).unwrap_err().to_string()
    };
    let e = load(&dir.path().join("missing.safetensors"));
    assert!(
        e.contains("[model] init") && e.contains("cannot open"),
        "{e}"
    );
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, b"\x10\0\0\0\0\0\0\0{\"a\": 1}        ").unwrap();
    let e = load(&bad);
    assert!(e.contains("malformed safetensors header"), "{e}");
    let head = br#"{"__metadata__":{"parameter_order":"[\"h\"]"},"h":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#;
    let mut f = (head.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(head);
    f.extend_from_slice(&[0; 8]);
    std::fs::write(&bad, f).unwrap();
    let e = load(&bad);
    assert!(e.contains("tensor \"h\" is F64: expected F32"), "{e}");
    // init and hidden together
    let good = dir.path().join("good.safetensors");
    mlp_init(&good);
    let text = TestConfig::new()
        .data_dir(mnist_dir())
        .model_init(&good)
        .toml()
        .replace("[model]", "[model]\nhidden = [8]");
    let e = Config::parse(&text, &dir.path().join("c.toml"))
        .map(drop)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[model] init and hidden are both given"), "{e}");
}

#[test]
fn a_shard_refuses_another_model_naming_the_first_differing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let init = dir.path().join("init.safetensors");
    // not an MLP: a conv weight and bias, then a linear layer
    write_init(
        &init,
        &[
            ("conv.weight", &[4, 1, 3, 3], &[0.1; 36]),
            ("conv.bias", &[4], &[0.0; 4]),
            ("fc.weight", &[10, 4], &[0.2; 40]),
            ("fc.bias", &[10], &[0.0; 10]),
        ],
    );
    let (path, cfg) = config(dir.path(), &init);
    assert!(MlpLayout::from_spec(&cfg.spec()).is_none());
    // ps-worker trains only the built-in MLP: it says so
    let out = std::process::Command::new(bin_dir().join("ps-worker"))
        .args(["--config", path.to_str().unwrap(), "--rank", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("ps-worker trains only the built-in MLP"),
        "{err}"
    );

    let shards = ps_tests::inproc::Shards::start(&path);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let desc = |shape: &[u64]| {
        let mut m: Vec<TensorDesc> = cfg
            .spec()
            .tensors
            .iter()
            .map(|t| TensorDesc {
                name: t.name.clone(),
                shape: t.shape.iter().map(|&d| d as u64).collect(),
            })
            .collect();
        m[2].shape = shape.to_vec();
        m
    };
    let register = |model: Vec<TensorDesc>| {
        rt.block_on(async {
            let mut c = ShardClient::connect(
                0,
                &shards.addrs[0],
                &ps_net::auth::ClientSecurity::of(&cfg),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
            c.register_retrying(
                RegisterRequest {
                    protocol_version: PROTOCOL_VERSION,
                    rank: 0,
                    world_size: 2,
                    num_params: cfg.spec().num_params() as u64,
                    shard: 0,
                    num_shards: 2,
                    model,
                    ..Default::default()
                },
                Duration::from_secs(10),
            )
            .await
        })
    };
    let e = register(desc(&[10, 5])).unwrap_err().to_string();
    // (the status's message is quoted in the client's error)
    assert!(
        e.contains("model mismatch: tensor 2 differs: the worker has")
            && e.contains("fc.weight")
            && e.contains("[10, 5], the run's model")
            && e.contains("[10, 4]"),
        "{e}"
    );
    let mut short = desc(&[10, 4]);
    short.pop();
    let e = register(short).unwrap_err().to_string();
    assert!(e.contains("lacks tensor 3") && e.contains("fc.bias"), "{e}");
    register(desc(&[10, 4])).expect("the same model is accepted");
}
