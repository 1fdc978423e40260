//! The shared token (`[cluster] token_file`) and TLS (`tls_cert`, `tls_key`, `tls_ca`) with
//! clusters in this process (`ps_tests::inproc`): a cluster whose config names them trains normally (workers and the
//! shard-to-shard reports carry the token over TLS); a request without the token or with
//! another is refused as UNAUTHENTICATED, and the shard logs the refusal without the token; a
//! client without TLS, or trusting another CA, cannot talk to a TLS shard.

use ps_proto::PROTOCOL_VERSION;
use ps_proto::pb::RegisterRequest;
use ps_proto::pb::parameter_server_client::ParameterServerClient;
use ps_tests::inproc::{Shards, run_in_process};
use ps_tests::{Spec, cluster_weights};
use std::time::Duration;
use tonic::Code;

const TOKEN: &str = "3f9c0a7d51e24b8e9d6c2a1f0b7e4d35";

fn spec() -> Spec {
    Spec {
        shards: 2,
        workers: 2,
        steps: 5,
        config: Spec::base().token_file("token"),
        ..Spec::default()
    }
}

#[test]
fn a_cluster_with_a_token_trains() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).unwrap();
    let (path, cfg) = spec().write(dir.path());
    let run = run_in_process(&path);
    assert_eq!(cluster_weights(&cfg).len(), cfg.layout().num_params());
    // what ps-server logs at start
    let described = cfg.describe();
    assert!(described.contains("shared token required"), "{described}");
    for log in &run.shard_logs {
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
    let shards = Shards::start(&path);
    let mut c = ParameterServerClient::connect(shards.url(0)).await.unwrap();
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
    let log = shards.nodes[0]
        .log
        .wait_for("refused a request from 127.0.0.1", Duration::from_secs(10));
    assert!(
        !log.contains(TOKEN),
        "the token leaked into the log:\n{log}"
    );
}

fn tls_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tls")
}

fn tls_spec() -> Spec {
    let d = tls_dir();
    Spec {
        config: Spec::base().token_file("token").tls(
            d.join("shard.pem"),
            d.join("shard.key"),
            d.join("ca.pem"),
        ),
        ..spec()
    }
}

#[test]
fn a_cluster_with_tls_and_a_token_trains() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    let (path, cfg) = tls_spec().write(dir.path());
    let run = run_in_process(&path);
    assert_eq!(cluster_weights(&cfg).len(), cfg.layout().num_params());
    let described = cfg.describe();
    assert!(
        described.contains("TLS, shared token required"),
        "{described}"
    );
    let log1 = &run.shard_logs[1];
    assert!(!log1.contains("report to shard 0 failed"), "{log1}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_shard_refuses_plain_text_and_unknown_cas() {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    let (path, _) = tls_spec().write(dir.path());
    let shards = Shards::start(&path);
    let addr = shards.addrs[0].clone();
    let register = |ch| async move {
        let mut c = ParameterServerClient::new(ch);
        let mut req = tonic::Request::new(RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            rank: 0,
            world_size: 2,
            num_params: 25_450,
            shard: 0,
            num_shards: 2,
            ..Default::default()
        });
        req.metadata_mut()
            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
        c.register(req).await
    };
    let tls = |ca: &str| {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(
                std::fs::read(tls_dir().join(ca)).unwrap(),
            ))
            .domain_name("127.0.0.1")
    };
    let https = Endpoint::from_shared(format!("https://{addr}")).unwrap();
    // the right CA: registered
    let ch = https
        .clone()
        .tls_config(tls("ca.pem"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    assert_eq!(register(ch).await.unwrap().into_inner().version, 0);
    // another CA: the handshake fails
    let other = https
        .tls_config(tls("other-ca.pem"))
        .unwrap()
        .connect()
        .await;
    assert!(
        other.is_err(),
        "a certificate of an unknown CA was accepted"
    );
    // plain text: no gRPC answer
    let plain = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5));
    let refused = match plain.connect().await {
        Err(_) => true,
        Ok(ch) => register(ch).await.is_err(),
    };
    assert!(
        refused,
        "a plain-text client got an answer from a TLS shard"
    );
}
