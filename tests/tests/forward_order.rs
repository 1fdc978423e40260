//! The pulls of a step overlap its forward pass (`ps_worker::gate`): forward starts on the
//! first layers while the last ones are still arriving, and the version contract stays exact.
//! One shard's answers come late (a delaying proxy in front of it), so that the forward pass
//! reaches the layers it holds before their values of the step's version are in; a worker
//! that read them early would compute with the previous version's values there. With one
//! worker the cluster computes exactly what one process computes: the final weights must be
//! bit-identical to the single-process reference, on every transport. The cluster runs in
//! this process (`ps_tests::inproc`).

use ps_config::Transport;
use ps_tests::inproc::{Shards, finish, start_worker};
use ps_tests::{
    Spec, assert_bit_identical, cluster_weights, delaying_proxy, reference_weights, rel_diff,
};
use std::time::Duration;

/// Runs `spec` with the answers of its last shard held back `delay` per read, and checks the
/// final weights against the reference bit for bit.
fn late_last_shard_is_exact(spec: Spec, delay: Duration) {
    let run = spec.prepare();
    let cfg = &run.cfg;
    let shards = Shards::start(&run.path);
    // the worker reaches the last shard through the proxy
    let mut through = shards.cfg.clone();
    let last = shards.addrs.len() - 1;
    through.cluster.servers[last] = delaying_proxy(shards.addrs[last].clone(), delay);
    let worker = start_worker(&through, 0);
    let log = finish(shards, vec![worker]).worker_logs.remove(0);
    // the worker says what forward waited for, per layer (three layers)
    let waits = log
        .lines()
        .find_map(|l| l.split("pull wait per layer [").nth(1))
        .unwrap_or_else(|| panic!("no per-layer waits in the worker's log:\n{log}"));
    let waits: Vec<f64> = waits
        .split(']')
        .next()
        .unwrap()
        .split(", ")
        .map(|w| w.parse().unwrap())
        .collect();
    assert_eq!(waits.len(), 3, "{log}");
    println!("{:?}: waits {waits:?}", spec.transport);
    let got = cluster_weights(cfg);
    let want = reference_weights(cfg);
    let what = format!(
        "{:?}: against one process (largest relative difference {:.3e})",
        spec.transport,
        rel_diff(cfg, &got, &want)
    );
    assert_bit_identical(&got, &want, &what);
}

/// Three layers over three shards: the first shard holds the start of `fc1.weight`, the
/// second its middle, the last its end and the two smaller layers; one worker.
fn spec(transport: Transport, data_connections: bool) -> Spec {
    Spec {
        shards: 3,
        workers: 1,
        hidden: vec![64, 32],
        global_batch: 64,
        steps: 12,
        transport,
        config: Spec::base().data_connections(data_connections, 0),
        ..Spec::default()
    }
}

#[test]
fn late_shard_through_grpc_chunks_is_exact() {
    late_last_shard_is_exact(spec(Transport::Grpc, false), Duration::from_millis(4));
}

#[test]
fn late_shard_through_the_data_connection_is_exact() {
    late_last_shard_is_exact(spec(Transport::Grpc, true), Duration::from_millis(4));
}

#[test]
fn late_shard_through_shared_memory_is_exact() {
    late_last_shard_is_exact(spec(Transport::Auto, true), Duration::from_millis(4));
}
