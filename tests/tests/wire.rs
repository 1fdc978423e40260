//! `[cluster] wire = "bf16"`: gradients pushed over the network travel as bfloat16 with error
//! feedback. The default MNIST job over gRPC converges to within 0.5 points of its f32 run; a
//! worker whose wire differs from the shard's is refused at registration; a bf16 push is
//! 2 bytes a value (4 are refused), on gRPC chunks and on the data connection.

use ps_config::{Transport, Wire};
use ps_net::auth::ClientSecurity;
use ps_net::client::{ShardClient, push_chunks_of, with_lease};
use ps_net::wire::{Bf16Encoder, f32_to_bytes};
use ps_tests::{Spec, cluster_weights, mnist_test, register_request};
use std::time::Duration;
use tonic::Code;

/// The default job (`deploy/mnist.toml`: 784-256-128-10, batch 128 on 2 workers, SGD 0.1
/// with momentum 0.9, cosine with 100 warm-up steps, 3 epochs = 1404 steps, seed 42) over
/// gRPC on `wire`, in this process (`ps_tests::inproc`); returns the test accuracy of the
/// final weights, the weights and what shard 0 logs at start (`ps-server` logs the config's
/// description, its equivalence statement and its warnings; `docs.rs` runs the binary).
fn default_job(wire: Wire) -> (f64, Vec<f32>, String) {
    let spec = Spec {
        shards: 2,
        workers: 2,
        hidden: vec![256, 128],
        global_batch: 128,
        steps: 1404,
        transport: Transport::Grpc,
        config: Spec::base()
            .seed(42)
            .sgd(0.1, 0.9)
            .cosine(100, 0.0)
            .log_every(200)
            .wire(wire),
        ..Spec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let (path, cfg) = spec.write(dir.path());
    ps_tests::inproc::run_in_process(&path);
    let weights = cluster_weights(&cfg);
    let test = mnist_test();
    let mut cpu = ps_worker::cpu::cpu_model(&cfg.layout(), 1);
    cpu.set_weights(&weights).unwrap();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    test.gather(&(0..test.len() as u32).collect::<Vec<_>>(), &mut x, &mut y);
    let acc = cpu.evaluate(&x, &y).unwrap() as f64 / test.len() as f64;
    let eq = cfg.equivalence();
    let log = format!("{}\n{eq}\n{}", cfg.describe(), eq.warnings.join("\n"));
    (acc, weights, log)
}

#[test]
fn bf16_wire_converges_within_half_a_point_of_f32() {
    let (f32_acc, f32_w, f32_log) = default_job(Wire::F32);
    let (bf16_acc, bf16_w, bf16_log) = default_job(Wire::Bf16);
    eprintln!(
        "default job over gRPC: test accuracy {:.2}% with f32 on the wire, {:.2}% with bf16",
        f32_acc * 100.0,
        bf16_acc * 100.0
    );
    assert!(f32_acc >= 0.97, "f32 run: test accuracy {f32_acc:.4}");
    assert!(
        (bf16_acc - f32_acc).abs() <= 0.005,
        "bf16 {bf16_acc:.4} vs f32 {f32_acc:.4}: more than 0.5 points apart"
    );
    // the bf16 wire was used: the weights are not those of the exact run
    assert!(
        f32_w
            .iter()
            .zip(&bf16_w)
            .any(|(a, b)| a.to_bits() != b.to_bits()),
        "bf16 run gave the f32 run's bits: the wire was not used"
    );
    // and the start-up log says the run is no longer exact
    assert!(
        bf16_log.contains("wire bf16")
            && bf16_log.contains("no longer equals the single-process one exactly"),
        "{bf16_log}"
    );
    assert!(!f32_log.contains("wire bf16"), "{f32_log}");
}

use ps_tests::push_header as header;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bf16_shard_refuses_an_f32_worker_and_takes_half_the_bytes() {
    let run = Spec::small()
        .transport(Transport::Grpc)
        .config(Spec::base().sgd(0.5, 0.0).wire(Wire::Bf16))
        .prepare();
    let n = run.cfg.layout().num_params();
    let shards = run.shards_in_process();
    let sec = ClientSecurity::default();
    let reg = |rank: u32| register_request(rank, 2, n);
    let connect = || ShardClient::connect(0, &shards.addrs[0], &sec, Duration::from_secs(10));

    // a worker with the f32 wire (another config) is refused, naming the key and both values
    let mut f32_client = connect().await.unwrap();
    let e = f32_client.register(reg(0)).await.unwrap_err().to_string();
    assert!(
        e.contains("[cluster] wire mismatch: worker rank 0 pushes")
            && e.contains("f32")
            && e.contains("shard 0 expects")
            && e.contains("bf16"),
        "{e}"
    );

    let mut c0 = connect().await.unwrap();
    c0.set_wire(Wire::Bf16);
    c0.register(reg(0)).await.unwrap();
    assert!(c0.has_data_link());
    let mut c1 = connect().await.unwrap();
    c1.set_wire(Wire::Bf16);
    c1.register(reg(1)).await.unwrap();
    let mut before = vec![0f32; n];
    c0.pull_into(0, false, None, &mut before).await.unwrap();

    let g0: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let g1: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.02).collect();
    // f32 bytes (4 a value) through gRPC chunks under bf16: refused, said in values
    let f32_bytes = f32_to_bytes(&g0);
    assert_eq!(f32_bytes.len(), 4 * n);
    let msgs = with_lease(
        push_chunks_of(header(0, 0, n), &f32_bytes, 4096, 2),
        c0.lease(0),
    );
    let e = c0.rpc().push(tokio_stream::iter(msgs)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message()
            .contains(&format!("expected {n} f32 values, got")),
        "{e:?}"
    );
    // an odd byte count names the encoding
    let odd = bytes::Bytes::from(vec![0u8; 2 * n - 1]);
    let msgs = vec![ps_proto::pb::PushChunk {
        header: Some(header(0, 0, n)),
        offset: 0,
        data: odd,
        lease: c0.lease(0),
    }];
    let e = c0.rpc().push(tokio_stream::iter(msgs)).await.unwrap_err();
    assert!(
        e.message()
            .contains("expected a multiple of 2 (little-endian bfloat16"),
        "{e:?}"
    );
    // f32 bytes on the data connection under bf16: the frame's size is refused
    let e = c0
        .push(header(0, 0, n), &f32_bytes, 4096)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "a frame of {} bytes: expected {} bytes ({n} values, little-endian bfloat16",
            4 * n,
            2 * n
        )),
        "{e}"
    );

    // 2 bytes a value: rank 0 through gRPC chunks, then its retry, rank 1 on its data connection
    let b0 = Bf16Encoder::new().encode_reusing(&g0, None);
    let b1 = Bf16Encoder::new().encode_reusing(&g1, None);
    assert_eq!((b0.len(), b1.len()), (2 * n, 2 * n));
    let rpc0 = c0.rpc().clone();
    let lease0 = c0.lease(0);
    let push_grpc = |b: &bytes::Bytes| {
        let msgs = with_lease(push_chunks_of(header(0, 0, n), b, 64, 2), lease0.clone());
        let mut rpc = rpc0.clone();
        async move {
            rpc.push(tokio_stream::iter(msgs))
                .await
                .map(|r| r.into_inner())
        }
    };
    let r = push_grpc(&b0).await.unwrap();
    assert_eq!((r.counted, r.ranks_in), (true, 1));
    let r = push_grpc(&b0).await.unwrap();
    assert_eq!((r.counted, r.ranks_in), (false, 1), "a retry is recognised");
    let r = c1.push(header(1, 0, n), &b1, 4096).await.unwrap();
    assert_eq!((r.counted, r.ranks_in), (true, 2));
    let mut after = vec![0f32; n];
    c0.pull_into(1, false, None, &mut after).await.unwrap();
    let (mut q0, mut q1) = (vec![0f32; n], vec![0f32; n]);
    ps_net::wire::decode_bf16(&mut q0, &b0);
    ps_net::wire::decode_bf16(&mut q1, &b1);
    for i in 0..n {
        let want = before[i] - 0.5 * (0.5 * q0[i] + 0.5 * q1[i]);
        assert!(
            (after[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "param {i}: {} vs {want}",
            after[i]
        );
    }
}
