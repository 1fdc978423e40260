//! What a shard expects to hold at its peak, stated at start-up (log and `/metrics`), with a
//! warning naming the keys to change when it exceeds the host's available memory.

use crate::partial::partial_message_budget;
use ps_config::Config;

/// What one gRPC puller costs the shard while its reply is under way, beside the version's
/// values (which every pull shares: the "pull snapshot" part): its HTTP/2 stream, the reply's
/// state and chunk list, and the framing of each chunk (`service::SharedPulls`). Measured with
/// 32 pullers that take nothing of their replies, 0.94 MB of parameters
/// (`tests/tests/many_pullers.rs`): the shard grew by 920 KiB per puller before the replies
/// shared the snapshot (tonic's encoder copied each reply's chunk into its stream), and by
/// 1.1 to 1.8 KiB since; the rest is tonic's buffers made for a moment per call (8 KiB to
/// decode the request, 8 KiB of encoder that the reply does not use).
pub const PULLER_BYTES: u64 = 16 << 10;

/// The name of the pullers' part of a [`MemoryPlan`].
pub const PULLERS: &str = "gRPC pullers";

/// The process itself before any tensor: the binary, the runtime, its threads' stacks, the
/// allocator's arenas (an idle shard of a tiny model: 8.7 MiB resident on the 2-core machine
/// of PERFORMANCE.md).
pub const PROCESS_BYTES: u64 = 10 << 20;

/// The parts of a shard's expected peak memory, in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    /// (what, bytes), in the order logged.
    pub parts: Vec<(&'static str, u64)>,
}

impl MemoryPlan {
    /// The part that `what` names, in bytes (0 when there is none).
    pub fn part(&self, what: &str) -> u64 {
        self.parts.iter().find(|p| p.0 == what).map_or(0, |p| p.1)
    }

    /// The plan of a shard of `len` values under `cfg`.
    pub fn of(cfg: &Config, len: usize) -> Self {
        Self::of_shard(cfg, len, false)
    }

    /// [`MemoryPlan::of`] for a shard that applies per bucket when `bucketed`: the step's
    /// pending optimizer state is a second copy of it (`ps_shard::bucket`).
    pub fn of_shard(cfg: &Config, len: usize, bucketed: bool) -> Self {
        let bytes = len as u64 * 4;
        let opt_buffers = {
            let st = cfg.optimizer.init_state(1);
            (st.m.len() + st.v.len()) as u64
        };
        let workers = cfg.cluster.workers as u64;
        let pending = (cfg.server.max_pending_gradients as u64).min(workers);
        Self {
            parts: vec![
                // current and next version (the update writes the other half)
                ("parameters (two versions)", 2 * bytes),
                // with per-bucket apply, the current one and the step's pending one
                (
                    "optimizer state",
                    (1 + u64::from(bucketed)) * opt_buffers * bytes,
                ),
                ("pull snapshot", bytes),
                // the pending gradients and the step's accumulator
                ("gradient buffers", (pending + 1) * bytes),
                // what queued pushes may have sent before the shard reads them
                (
                    "HTTP/2 receive windows",
                    workers * cfg.server.stream_window_bytes as u64,
                ),
                // every worker's pull under way at once (the values themselves are shared)
                (PULLERS, workers * PULLER_BYTES),
                ("the process", PROCESS_BYTES),
                // what the decoder buffers of messages not yet whole (refused beyond)
                ("partial gRPC messages", partial_message_budget(cfg)),
            ],
        }
    }

    /// The sum of the parts.
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|p| p.1).sum()
    }

    /// One line: the total and its parts (the pullers' as count x each = total).
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .parts
            .iter()
            .map(|&(what, b)| match what {
                PULLERS => format!(
                    "{what} {} x {} KiB = {}",
                    b / PULLER_BYTES,
                    PULLER_BYTES >> 10,
                    mib(b)
                ),
                _ => format!("{what} {}", mib(b)),
            })
            .collect();
        format!("{} ({})", mib(self.total()), parts.join(", "))
    }
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

/// `MemAvailable` of /proc/meminfo in bytes, when the host says.
pub fn available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Logs shard `index`'s expected peak memory, and warns when it exceeds `available`.
pub fn log_plan(index: usize, plan: &MemoryPlan, available: Option<u64>) {
    tracing::info!("shard {index}: expected peak memory {}", plan.describe());
    if let Some(avail) = available
        && plan.total() > avail
    {
        tracing::warn!(
            "shard {index}: expected peak memory {} exceeds the {} this host has available: lower [server] max_pending_gradients or [server] stream_window_bytes, or add shards ([cluster] servers) so that each holds a smaller slice",
            mib(plan.total()),
            mib(avail)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_config::TestConfig;

    #[test]
    fn the_plan_counts_every_part_of_the_shard() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        let text = TestConfig::new()
            .workers(64)
            .global_batch(128)
            .shards(1)
            .hidden(&[1024, 1024])
            .adam(0.001, 0.0, true)
            .max_pending_gradients(4)
            .data_dir(dir.path())
            .out_dir(dir.path())
            .toml();
        std::fs::write(&path, text).unwrap();
        let cfg = Config::load(&path).unwrap();
        let len = cfg.layout().num_params();
        let plan = MemoryPlan::of(&cfg, len);
        let b = len as u64 * 4;
        // 2 versions + Adam's 2 + snapshot + (4 pending + accumulator) + 64 windows of 256 KiB
        // + 64 pullers + the process + 64 partial chunks of 1 MiB + 4 KiB and one 64 MiB
        // message
        assert_eq!(
            plan.total(),
            10 * b
                + 64 * (256 << 10)
                + 64 * PULLER_BYTES
                + PROCESS_BYTES
                + 64 * ((1 << 20) + (4 << 10))
                + (64 << 20),
            "{}",
            plan.describe()
        );
        assert_eq!(plan.part(PULLERS), 64 * PULLER_BYTES);
        assert_eq!(plan.part("the process"), PROCESS_BYTES);
        // per bucket: a second copy of Adam's m and v (the step's pending state)
        let bucketed = MemoryPlan::of_shard(&cfg, len, true);
        assert_eq!(bucketed.total(), plan.total() + 2 * b);
        assert_eq!(bucketed.part("optimizer state"), 4 * b);
        assert!(plan.describe().contains("gradient buffers"));
        assert!(
            plan.describe()
                .contains(&format!("gRPC pullers 64 x {} KiB = ", PULLER_BYTES >> 10)),
            "{}",
            plan.describe()
        );
    }
}
