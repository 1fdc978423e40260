//! Shard-to-shard calls need the shard credential in every deployment: `ps-launch` (here its
//! `LocalCluster`) gives its shards a fresh one without any config, and a forged `Recover`
//! (stopping the run, ordering a rollback) or `ReportStep` without it, or with a wrong one, is
//! refused `UNAUTHENTICATED` and changes nothing.

use ps_launch::{LocalCluster, bin_dir};
use ps_net::auth::{ClientSecurity, SHARD_TOKEN_KEY};
use ps_net::client::ShardClient;
use ps_proto::pb::{RecoverRequest, StepReport};
use ps_tests::{Spec, register_request};
use std::time::Duration;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_recover_and_step_reports_are_refused_without_the_shard_credential() {
    let spec = Spec {
        shards: 2,
        workers: 1,
        hidden: vec![4],
        steps: 2,
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    assert!(
        cfg.server.shard_token_file.is_none(),
        "no credential configured"
    );
    let mut cluster = LocalCluster::new(bin_dir(), path, Some(dir.path().join("logs")));
    cluster
        .start_servers(2, &[], Duration::from_secs(60))
        .unwrap();
    let sec = ClientSecurity::default();
    let mut c = ShardClient::connect(0, &cluster.addrs[0], &sec, Duration::from_secs(10))
        .await
        .unwrap();
    let forged = |req: RecoverRequest, token: Option<&str>| {
        let mut r = tonic::Request::new(req);
        if let Some(t) = token {
            r.metadata_mut().insert(SHARD_TOKEN_KEY, t.parse().unwrap());
        }
        r
    };
    let attacks = [
        RecoverRequest {
            lost: 1,
            abort: "x".into(),
            ..Default::default()
        },
        RecoverRequest {
            lost: 1,
            rollback: true,
            version: 0,
            generation: 1,
            ..Default::default()
        },
        RecoverRequest {
            lost: 1,
            ..Default::default()
        },
    ];
    for req in attacks {
        for token in [None, Some("not-the-shard-credential-0123")] {
            let e = c
                .rpc()
                .recover(forged(req.clone(), token))
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::Unauthenticated, "{req:?}: {e:?}");
            assert!(e.message().contains("shard credential"), "{e:?}");
        }
    }
    let mut report = tonic::Request::new(StepReport {
        shard: 1,
        step: 0,
        grad_sq_norm: 1e6,
        ..Default::default()
    });
    report.metadata_mut().insert(
        SHARD_TOKEN_KEY,
        "not-the-shard-credential-0123".parse().unwrap(),
    );
    let e = c.rpc().report_step(report).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    // the run was neither stopped nor rolled back: a worker registers at generation 0
    let n = cfg.layout().num_params();
    let mut req = register_request(0, 1, n);
    req.num_shards = 2;
    req.num_params = n as u64;
    let r = c.register(req).await.unwrap();
    assert_eq!((r.version, r.generation), (0, 0), "{r:?}");
    cluster.kill_all();
}
