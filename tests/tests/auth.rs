//! The shared token (`[cluster] token_file`) with real processes: a cluster whose config names
//! one trains normally (workers and the shard-to-shard reports carry it); a request without it
//! or with another is refused as UNAUTHENTICATED, and the shard logs the refusal without the
//! token.

use ps_common::PROTOCOL_VERSION;
use ps_common::launch::{LocalCluster, bin_dir};
use ps_common::pb::RegisterRequest;
use ps_common::pb::parameter_server_client::ParameterServerClient;
use ps_tests::{Spec, Start, cluster_weights, run_cluster};
use std::time::Duration;
use tonic::Code;

const TOKEN: &str = "3f9c0a7d51e24b8e9d6c2a1f0b7e4d35";

fn spec() -> Spec {
    Spec {
        shards: 2,
        workers: 2,
        steps: 5,
        cluster_extra: "token_file = \"token\"".into(),
        ..Spec::default()
    }
}

#[test]
fn a_cluster_with_a_token_trains() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).unwrap();
    let (path, cfg) = spec().write(dir.path());
    run_cluster(&path, &cfg, &Start::default());
    assert_eq!(cluster_weights(&cfg).len(), cfg.layout().num_params());
    for name in ["shard-0.log", "shard-1.log"] {
        let log = std::fs::read_to_string(dir.path().join("logs").join(name)).unwrap();
        assert!(
            name != "shard-0.log" || log.contains("shared token required"),
            "{log}"
        );
        assert!(
            !log.contains("refused") && !log.contains("report to shard 0 failed"),
            "{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_the_token_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    let (path, cfg) = spec().write(dir.path());
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(1, &[], Duration::from_secs(60))
        .unwrap();
    let mut c = ParameterServerClient::connect(format!("http://{}", cluster.addrs[0]))
        .await
        .unwrap();
    let req = || RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        rank: 0,
        world_size: 2,
        num_params: cfg.layout().num_params() as u64,
        shard: 0,
        num_shards: 2,
        ..Default::default()
    };
    let e = c.register(req()).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("without a token"), "{e:?}");
    let mut wrong = tonic::Request::new(req());
    wrong.metadata_mut().insert(
        "authorization",
        "Bearer 00000000000000000000000000000000".parse().unwrap(),
    );
    let e = c.register(wrong).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("wrong token"), "{e:?}");
    let mut right = tonic::Request::new(req());
    right
        .metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    assert_eq!(c.register(right).await.unwrap().into_inner().version, 0);
    cluster.kill_all();
    let log = std::fs::read_to_string(dir.path().join("logs/shard-0.log")).unwrap();
    assert!(log.contains("refused a request from 127.0.0.1"), "{log}");
    assert!(
        !log.contains(TOKEN),
        "the token leaked into the log:\n{log}"
    );
}
