//! Section 7, **the host's data path** without a device: the large model, one shard in this
//! process (`run_shard`, shared memory offered), W = 2 workers on this host, each a task of
//! its own with its own client, doing what a worker whose device computes nothing does each
//! step: wait (untimed) for the shard's version t, pull it out of the shard's parameter board, write its gradient into its own
//! gradient board (the copy a device's download makes), push the header. The shard checks the
//! pushes and, at the second, applies the step (mean of the two, plain SGD). Per step, the
//! medians of: the pull (the slower worker), the gradient write, the push (the slower worker:
//! the last push's reply comes after the update), the whole step; beside a `copy_from_slice`
//! of one range measured in the same run (this machine's memcpy rate), and the host bytes the
//! path moves per step, counted from what each side reads and writes (not measured).

use super::*;

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
    let times: Vec<WorkerTimes> = rt.block_on(async {
        let mut tasks = Vec::new();
        for r in 0..2 {
            let d = BoardDir::create(&root, &format!("bench-host-worker{r}"))?;
            let b = Board::create(&grad_path(d.path()), d.token(), len, 1)?;
            let mut c = connect(shard.addr).await?;
            let reply = register_with(&mut c, &cfg, r, Some((&b, d.token()))).await?;
            let link = ShmLink::open(&reply, 0);
            if link.describe() != "shared memory" {
                bail!("the in-process shard offered no shared memory: {reply:?}");
            }
            let cfg = cfg.clone();
            tasks.push(tokio::spawn(worker_steps(c, link, (d, b), cfg, r, steps)));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.context("worker task")??);
        }
        Ok::<_, anyhow::Error>(out)
    })?;
    drop(rt);
    shard.stop()?;
    let copy = median(&bench_copy(len, plan.net_repeats.max(3)));
    Ok(rows(&times, len, copy))
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
/// bytes each part moves and its rate against the memcpy rate `copy` (seconds per range).
fn rows(times: &[WorkerTimes], len: usize, copy: f64) -> Vec<Value> {
    let range = len * 4;
    let w = times.len();
    let per_step = |k: usize| -> Vec<f64> {
        (0..times[0].len())
            .map(|i| times.iter().map(|t| t[i][k]).fold(0.0, f64::max))
            .collect()
    };
    // bytes read + written per step, from the path: a pull copies the range (read, write); the
    // gradient write likewise; the shard reads each pushed range once to check it and the
    // update reads W gradients and the parameters and writes the parameters
    let parts = [
        (
            "pull (each worker copies the range out of the shard's board)",
            0,
            2 * w * range,
        ),
        (
            "gradient into the worker's board (the device download's copy)",
            1,
            2 * w * range,
        ),
        (
            "push: the shard's check of each range + the update at the last",
            2,
            w * range + (w + 2) * range,
        ),
        (
            "step (one worker's pull, write, push)",
            3,
            (6 * w + 2) * range,
        ),
    ];
    let mut out: Vec<Value> = parts
        .iter()
        .map(|&(what, k, bytes)| {
            let s = per_step(k);
            let med = median(&s);
            json!({
                "what": what, "bytes_moved": bytes, "ms": med * 1e3,
                "ms_samples": s.iter().map(|v| v * 1e3).collect::<Vec<_>>(),
                "gbs": gbs(bytes, med),
            })
        })
        .collect();
    out.push(json!({
        "what": "memcpy of one range (copy_from_slice, this run)", "bytes_moved": 2 * range,
        "ms": copy * 1e3, "gbs": gbs(2 * range, copy),
    }));
    out
}

/// Section 7's table.
pub(crate) fn table_host_path(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 7. The host's data path: large model, W = 2, one shard, shared memory, no device\n\n\
         | part | bytes read+written per step (counted) | ms (median) | GB/s |\n|---|---:|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {:.1} MB | {:.2} | {:.2} |",
            r["what"].as_str().unwrap_or("?"),
            f(r, "bytes_moved") / 1e6,
            f(r, "ms"),
            f(r, "gbs")
        );
    }
    s
}
