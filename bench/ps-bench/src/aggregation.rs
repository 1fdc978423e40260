//! Section 1, **aggregation + optimizer update** in process: `Shard::accept` for W ranks from
//! their shared-memory boards, then `Shard::apply` (mean in rank order, plain SGD), beside a
//! plain `copy_from_slice` of the same bytes.

use super::*;

pub(crate) fn section_aggregation(tmp: &Path, plan: &Plan) -> anyhow::Result<Vec<Value>> {
    let mut rows = Vec::new();
    for m in [SMALL, LARGE] {
        for w in [2usize, 4] {
            let repeats = plan.agg_repeats[Plan::idx(&m)];
            rows.push(bench_aggregation(tmp, &m, w, repeats, plan.copy_repeats)?);
        }
    }
    Ok(rows)
}

fn bench_aggregation(
    tmp: &Path,
    m: &Model,
    w: usize,
    repeats: usize,
    copy_repeats: usize,
) -> anyhow::Result<Value> {
    let dir = tmp.join(format!("agg-{}-w{w}", m.name));
    let cfg = write_config(
        &dir.join("config.toml"),
        &config_text(1, w, m, ENDLESS, &dir.join("out")),
    )?;
    let shard = Shard::new(&cfg, 0, ENDLESS);
    // as workers on this host do: each has a gradient board that the shard reads in place,
    // and the shard's parameters move into its shared-memory board
    let root = ps_net::shm::shm_root().context("no /dev/shm: the bench mirrors local runs")?;
    let mut boards = Vec::new();
    for r in 0..w {
        let d = BoardDir::create(&root, &format!("bench-worker{r}"))?;
        let b = Board::create(&grad_path(d.path()), d.token(), shard.num_params, 1)?;
        shard.register(r as u32)?;
        shard
            .offer_shm(r as u32)?
            .context("the shard offers no shared memory")?;
        if !shard.attach_grad(r as u32, b.path(), d.token())? {
            bail!("the shard could not open the gradient board of rank {r}");
        }
        boards.push((d, b));
    }
    let len = shard.len();
    let bytes = w * len * 4;
    let (mut apply_s, mut step_s) = (Vec::new(), Vec::new());
    for rep in 0..=repeats {
        // the workers' backward passes write their gradients
        for (r, (_, b)) in boards.iter_mut().enumerate() {
            b.slot_mut(0)
                .fill(1e-4 * (r + 1) as f32 + rep as f32 * 1e-7);
        }
        let step = shard.version();
        let t0 = Instant::now();
        let mut ready = None;
        for r in 0..w {
            let meta = PushMeta {
                rank: r as u32,
                step,
                samples: BATCH as u32,
                loss_sum: 1.0,
                correct: 0,
                eval: (0, 0),
            };
            let (g, fingerprint) = shard.shm_grad(r as u32)?;
            let (_, slots) = shard.accept(meta, g, fingerprint)?;
            if slots.is_some() {
                ready = slots;
            }
        }
        let slots = ready.context("the last accept did not complete the barrier")?;
        let t1 = Instant::now();
        black_box(shard.apply(slots)?);
        let t2 = Instant::now();
        if rep > 0 {
            apply_s.push((t2 - t1).as_secs_f64());
            step_s.push((t2 - t0).as_secs_f64());
        }
    }
    drop(shard);
    let copy_s = bench_copy(w * len, copy_repeats);
    let (apply, step, copy) = (median(&apply_s), median(&step_s), median(&copy_s));
    let row = json!({
        "model": m.name, "workers": w, "shards": 1, "shard_len": len, "grad_bytes": bytes,
        "apply_ms": apply * 1e3, "accept_apply_ms": step * 1e3,
        "gbs": gbs(bytes, apply), "copy_ms": copy * 1e3, "copy_gbs": gbs(bytes, copy),
        "ratio_to_copy": copy / apply,
        "apply_ms_samples": apply_s.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
        "copy_ms_samples": copy_s.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
    });
    eprintln!(
        "  {} W={w}: apply {:.2} ms ({:.2} GB/s), copy {:.2} ms ({:.2} GB/s)",
        m.name,
        apply * 1e3,
        gbs(bytes, apply),
        copy * 1e3,
        gbs(bytes, copy)
    );
    Ok(row)
}

/// Seconds of `copy_from_slice` of `n` f32 between two preallocated vectors, one per repeat
/// (after one untimed copy).
pub(crate) fn bench_copy(n: usize, repeats: usize) -> Vec<f64> {
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut dst = vec![0f32; n];
    let mut out = Vec::new();
    for rep in 0..=repeats {
        let t = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        if rep > 0 {
            out.push(t.elapsed().as_secs_f64());
        }
    }
    out
}

pub(crate) fn table_aggregation(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 1. Aggregation + optimizer update (in process, one shard, S = 1, mean, plain SGD, parameters and gradients in shared-memory boards as with workers on the same host)\n\n\
         | model | W | shard params | gradient bytes in | apply ms | aggregation+update GB/s | memcpy ms (same bytes) | memcpy GB/s | ratio |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} MB | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r["model"].as_str().unwrap_or("?"),
            r["workers"],
            r["shard_len"],
            f(r, "grad_bytes") / 1e6,
            f(r, "apply_ms"),
            f(r, "gbs"),
            f(r, "copy_ms"),
            f(r, "copy_gbs"),
            f(r, "ratio_to_copy"),
        );
    }
    s
}
