//! Section 7, **the host's data path** without a device: the large model, one shard in this
//! process (`run_shard`, shared memory offered), W = 2 workers on this host, each a task of
//! its own with its own client, doing what a worker whose device computes nothing does each
//! step: wait (untimed) for the shard's version t, pull it out of the shard's parameter board,
//! write its gradient into its own gradient board (the copy a device's download makes), push
//! the header. The shard checks the pushes and, at the second, applies the step (mean of the
//! two, plain SGD). Per step, the medians of: the pull (the slower worker), the gradient write,
//! the push (the slower worker: the last push's reply comes after the update), the update
//! itself (the shard's `apply_ms` in its metrics.jsonl), the whole step; beside a
//! `copy_from_slice` of one range measured in the same run (this machine's memcpy rate).
//!
//! Host bytes copied are measured, not derived: `ps_net::copied::totals()` read before the
//! first step and after the last, divided by the steps (the shard and both workers are in
//! this process, so the counter sees every copy site of the data path that calls
//! `copied::count`). The bench's own gradient write, standing for the device's download, is
//! counted by the bench (`Side::Push`) and shown on its own row.

use super::*;
use crate::aggregation::bench_copy;
use crate::e2e::read_metrics;
use crate::transfer::{InProcShard, connect, push_shm, register_with};
use ps_net::copied::{self, Side};

/// One worker's timings of each step after the first: (pull, gradient write, push, step).
type WorkerTimes = Vec<[f64; 4]>;

/// The runs of section 7: one table row per figure.
pub(crate) fn section_host_path(tmp: &Path, plan: &Plan) -> anyhow::Result<Vec<Value>> {
    let m = LARGE;
    let steps = plan.net_repeats as u64 + 1;
    let dir = tmp.join("host-path");
    let cfg = write_config(
        &dir.join("config.toml"),
        &config_text(1, 2, &m, ENDLESS, &dir.join("out")),
    )?;
    let len = cfg.layout().num_params();
    let shard = InProcShard::start(cfg.clone())?;
    let root = ps_net::shm::shm_root().context("no /dev/shm for section 7")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (counted, times): ((u64, u64), Vec<WorkerTimes>) = rt.block_on(async {
        let mut workers = Vec::new();
        for r in 0..2 {
            let d = BoardDir::create(&root, &format!("bench-host-worker{r}"))?;
            let b = Board::create(&grad_path(d.path()), d.token(), len, 1)?;
            let mut c = connect(shard.addr).await?;
            let reply = register_with(&mut c, &cfg, r, Some((&b, d.token()))).await?;
            let link = ShmLink::open(&reply, 0);
            if link.describe() != "shared memory" {
                bail!("the in-process shard offered no shared memory: {reply:?}");
            }
            workers.push((c, link, (d, b), r));
        }
        // every worker registered: from here to the end only the steps copy
        let before = copied::totals();
        let mut tasks = Vec::new();
        for (c, link, board, r) in workers {
            let cfg = cfg.clone();
            tasks.push(tokio::spawn(worker_steps(c, link, board, cfg, r, steps)));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.context("worker task")??);
        }
        let after = copied::totals();
        Ok::<_, anyhow::Error>(((after.0 - before.0, after.1 - before.1), out))
    })?;
    drop(rt);
    shard.stop()?;
    // the shard's own figure of each update (metrics.jsonl), after the first step
    let apply: Vec<f64> = read_metrics(&dir.join("out").join("metrics.jsonl"))
        .iter()
        .skip(1)
        .map(|m| f(m, "apply_ms"))
        .filter(|v| v.is_finite())
        .collect();
    let copy = median(&bench_copy(len, plan.net_repeats.max(3)));
    let per_step = |b: u64| b as f64 / steps as f64;
    let copied = Copied {
        pull: per_step(counted.0),
        push: per_step(counted.1) - (2 * len * 4) as f64,
        grad: (2 * len * 4) as f64,
    };
    let mut out = rows(&times, len, copy, &copied);
    // the update reads the 2 gradients and the parameters and writes the parameters: the
    // traffic of 2 memcpy's of the range
    out.insert(
        3,
        json!({
            "what": "update (inside the push row: the shard's apply_ms, metrics.jsonl)",
            "copied_bytes": 0,
            "counts": "no copy: reads 2 gradients and the parameters, writes the parameters in place (the traffic of 2 memcpy's of the range)",
            "ms": if apply.is_empty() { f64::NAN } else { median(&apply) },
            "ms_samples": apply,
            "ms_at_memcpy": 2.0 * copy * 1e3,
        }),
    );
    Ok(out)
}

/// Host bytes copied per step, measured with `ps_net::copied` over every step of the run.
struct Copied {
    /// `Side::Pull`, all workers and the shard.
    pull: f64,
    /// `Side::Push` less the bench's own gradient write: the client's and the shard's.
    push: f64,
    /// The bench's gradient write into each worker's board (counted by the bench).
    grad: f64,
}

/// Steps `0..steps` of worker `rank`: wait for version t, pull it from the board, write the
/// gradient into the rank's board, push; the times of each step after the first.
async fn worker_steps(
    mut c: Client,
    link: ShmLink,
    (dir, mut board): (BoardDir, Board),
    cfg: Config,
    rank: usize,
    steps: u64,
) -> anyhow::Result<WorkerTimes> {
    let len = board.len();
    let token = dir.token();
    let grad: Vec<f32> = (0..len).map(|i| 1e-6 * (i % 7) as f32).collect();
    let mut w = vec![0f32; len];
    let mut out = Vec::new();
    for t in 0..steps {
        // registering again (idempotent, as this rank with its board) says the shard's version
        let deadline = Instant::now() + Duration::from_secs(60);
        while register_with(&mut c, &cfg, rank, Some((&board, token)))
            .await?
            .version
            < t
        {
            if Instant::now() > deadline {
                bail!("the shard did not reach version {t} in 60 s");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let t0 = Instant::now();
        c.pull_into(t, false, link.params.as_deref(), &mut w)
            .await?;
        let t1 = Instant::now();
        board.slot_mut(0).copy_from_slice(black_box(&grad));
        // the device download this write stands for copies on the host: counted here
        copied::count(Side::Push, len * 4);
        let t2 = Instant::now();
        push_shm(&c, rank, t, len).await?;
        let t3 = Instant::now();
        if t > 0 {
            let s = |a: Instant, b: Instant| (b - a).as_secs_f64();
            out.push([s(t0, t1), s(t1, t2), s(t2, t3), s(t0, t3)]);
        }
    }
    Ok(out)
}

/// The table's rows from both workers' times (per step the slower worker's figure), with the
/// host bytes copied per step (`c`, measured) and the time they take at this run's memcpy
/// rate (`copy`: seconds per range).
fn rows(times: &[WorkerTimes], len: usize, copy: f64, c: &Copied) -> Vec<Value> {
    let range = len * 4;
    let rate = range as f64 / copy; // bytes per second
    let per_step = |k: usize| -> Vec<f64> {
        (0..times[0].len())
            .map(|i| times.iter().map(|t| t[i][k]).fold(0.0, f64::max))
            .collect()
    };
    let parts = [
        (
            "pull: each worker's copy of the range out of the shard's board",
            0,
            c.pull,
            "Side::Pull, every copy site of the pull that counts (client and shard)",
        ),
        (
            "gradient into each worker's board (stands for the device download)",
            1,
            c.grad,
            "the bench's copy_from_slice, counted by the bench (Side::Push)",
        ),
        (
            "push: the shard's checks, the update at the last push",
            2,
            c.push,
            "Side::Push less the bench's own: client and shard copies (the update's reads and writes are not copies)",
        ),
        (
            "step (one worker's pull, write, push)",
            3,
            c.pull + c.grad + c.push,
            "the pull, gradient and push rows",
        ),
    ];
    let mut out: Vec<Value> = parts
        .iter()
        .map(|&(what, k, bytes, counts)| {
            let s = per_step(k);
            let med = median(&s);
            json!({
                "what": what, "copied_bytes": bytes, "counts": counts, "ms": med * 1e3,
                "ms_samples": s.iter().map(|v| v * 1e3).collect::<Vec<_>>(),
                "ms_at_memcpy": bytes / rate * 1e3,
            })
        })
        .collect();
    out.push(json!({
        "what": "memcpy of one range (copy_from_slice, this run)", "copied_bytes": range,
        "counts": "the range once", "ms": copy * 1e3, "ms_at_memcpy": copy * 1e3,
        "gbs": gbs(range, copy),
    }));
    out
}

/// Section 7's table.
pub(crate) fn table_host_path(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 7. The host's data path: large model, W = 2, one shard, shared memory, no device\n\n\
         | part | host bytes copied per step (ps_net::copied, measured) | what the count covers | ms (median) | ms at this run's memcpy rate |\n\
         |---|---:|---|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {:.1} MB | {} | {:.2} | {:.2} |",
            r["what"].as_str().unwrap_or("?"),
            f(r, "copied_bytes") / 1e6,
            r["counts"].as_str().unwrap_or("?"),
            f(r, "ms"),
            f(r, "ms_at_memcpy"),
        );
    }
    for (side, r) in [("Side::Pull", &rows[0]), ("Side::Push", &rows[2])] {
        if f(r, "copied_bytes") == 0.0 {
            let _ = writeln!(
                s,
                "\n{side}: 0 bytes counted: this build copies nothing there, or its copy sites there do not call `ps_net::copied::count`"
            );
        }
    }
    if let Some(m) = rows.iter().find(|r| r.get("gbs").is_some()) {
        let range = f(m, "copied_bytes");
        let _ = writeln!(
            s,
            "\nmemcpy rate this run: {:.2} GB/s; one copy per direction per worker (W = 2) is {:.1} MB per step",
            f(m, "gbs"),
            4.0 * range / 1e6
        );
    }
    s
}
