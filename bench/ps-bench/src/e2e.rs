//! Sections 3 and 4, **end-to-end training and server memory**: real `ps-server` and
//! `ps-worker` processes (`LocalCluster`) on the shipped MNIST, their step times beside the
//! single-process step and the compute bound, each shard's peak resident memory beside its
//! parameter bytes.

use super::*;

/// Checks that the cluster binaries exist; returns a line saying which ones the runs use and
/// how old they are (the runs measure whatever was last built there).
pub(crate) fn check_binaries() -> anyhow::Result<String> {
    let dir = bin_dir();
    let mut ages = Vec::new();
    for b in ["ps-server", "ps-worker"] {
        let p = dir.join(b);
        let Ok(meta) = std::fs::metadata(&p) else {
            bail!(
                "{} not found: build the binaries first (cargo build --release --bins)",
                p.display()
            );
        };
        let age = meta
            .modified()
            .ok()
            .and_then(|t| t.elapsed().ok())
            .map_or("?".into(), |d| format!("{:.0} min", d.as_secs_f64() / 60.0));
        ages.push(format!("{b} built {age} ago"));
    }
    Ok(format!(
        "cluster binaries: {} ({})",
        dir.display(),
        ages.join(", ")
    ))
}

/// Milliseconds of one single-process training step at batch 64: set the weights,
/// forward+backward on one matmul thread, SGD update. One figure per repeat.
fn single_process(cfg: &Config, repeats: usize, warmup: usize) -> anyhow::Result<Vec<f64>> {
    let layout = cfg.layout();
    let n = layout.num_params();
    let optimizer = &cfg.optimizer;
    let lr = cfg.schedule.lr(0) as f32;
    let mut params = layout.init_range(cfg.train.seed, 0..n);
    let mut state = optimizer.init_state(n);
    let mut backend = ps_worker::cpu::cpu_model(&layout, 1);
    // synthetic pixels in [0, 1] (the cost does not depend on the data)
    let x: Vec<f32> = (0..BATCH * layout.inputs())
        .map(|i| ((i * 7919) % 256) as f32 / 255.0)
        .collect();
    let y: Vec<u8> = (0..BATCH).map(|i| (i % 10) as u8).collect();
    let mut grad = vec![0f32; n];
    let mut out = Vec::new();
    for rep in 0..warmup + repeats {
        let t = Instant::now();
        backend.set_weights(&params)?;
        backend.forward_backward(&x, &y, LossReduction::Mean, &mut grad)?;
        optimizer.step(&mut params, &grad, &mut state, lr);
        if rep >= warmup {
            out.push(ms(t.elapsed()));
        }
    }
    Ok(out)
}

/// Peak resident set (VmHWM) of a live process, in bytes.
pub(crate) fn vm_hwm(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// User + system CPU time of a live process so far, in seconds.
pub(crate) fn cpu_secs(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // the fields after the command name, which is in parentheses and may hold spaces
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the name
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

/// Resident set (VmRSS) of a live process, in bytes.
pub(crate) fn vm_rss(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub(crate) fn read_metrics(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

pub(crate) fn section_e2e(
    tmp: &Path,
    plan: &Plan,
    cores: usize,
) -> anyhow::Result<(Vec<Value>, bool)> {
    let mut rows = Vec::new();
    let mut ok = true;
    for m in [SMALL, LARGE] {
        let i = Plan::idx(&m);
        let (warmup, repeats) = (if i == 0 { 5 } else { 2 }, plan.single_repeats[i]);
        let dir = tmp.join(format!("single-{}", m.name));
        let cfg = write_config(
            &dir.join("config.toml"),
            &config_text(1, 1, &m, ENDLESS, &dir.join("out")),
        )?;
        let single_s = single_process(&cfg, repeats, warmup)?;
        let single = median(&single_s);
        eprintln!(
            "  {} single process, batch {BATCH}, 1 thread: {single:.1} ms/step",
            m.name
        );
        for w in [1usize, 2, 4] {
            if w == 4 && i == 1 && !plan.large_w4 {
                continue;
            }
            for s in [1usize, 2] {
                let steps = plan.e2e_steps[i];
                let skip = plan.e2e_skip[i];
                let mut row = json!({
                    "model": m.name, "workers": w, "shards": s, "batch_per_worker": BATCH,
                    "steps": steps, "skipped_steps": skip,
                    "single_process_ms": single,
                    "single_process_ms_samples": single_s,
                });
                match e2e_run(tmp, &m, w, s, steps, skip, &Processes::default()) {
                    Ok(r) => {
                        let step = f(&r, "step_ms");
                        let bound = single * w.div_ceil(cores) as f64;
                        if let (Value::Object(dst), Value::Object(src)) = (&mut row, r) {
                            dst.extend(src);
                        }
                        row["steps_per_s"] = json!(1e3 / step);
                        row["samples_per_s"] = json!(1e3 / step * (w * BATCH) as f64);
                        row["overhead_ms"] = json!(step - single);
                        row["compute_bound_ms"] = json!(bound);
                        row["ratio_bound_to_step"] = json!(bound / step);
                        row["loadavg_after"] = json!(loadavg());
                        eprintln!(
                            "  {} W={w} S={s}: {step:.1} ms/step ({:.1} steps/s), server peak {}",
                            m.name,
                            1e3 / step,
                            row["server_hwm_bytes"]
                        );
                    }
                    Err(e) => {
                        ok = false;
                        eprintln!("  {} W={w} S={s}: failed: {e:#}", m.name);
                        row["error"] = json!(format!("{e:#}"));
                    }
                }
                rows.push(row);
            }
        }
    }
    Ok((rows, ok))
}

/// Where a cluster run's binaries come from and how its values move.
#[derive(Debug, Default)]
pub(crate) struct Processes {
    /// The directory of `ps-server` and `ps-worker` (default: this build's).
    pub(crate) bin: Option<PathBuf>,
    /// Every value through gRPC: `transport = "grpc"`, `[server] data_connections = false`
    /// (as with TLS).
    pub(crate) grpc_only: bool,
    /// Lines added to `[server]`.
    pub(crate) server_toml: String,
}

/// One cluster run; returns its figures (step times from shard 0's metrics, memory peaks,
/// shard 0's CPU time per step over the timed steps).
pub(crate) fn e2e_run(
    tmp: &Path,
    m: &Model,
    w: usize,
    s: usize,
    steps: u64,
    skip: usize,
    procs: &Processes,
) -> anyhow::Result<Value> {
    let dir = tmp.join(format!("e2e-{}-w{w}-s{s}", m.name));
    let out_dir = dir.join("out");
    let path = dir.join("config.toml");
    let mut text = config_text(s, w, m, steps, &out_dir);
    if procs.grpc_only {
        text = text.replacen("\n\n[model]", "\ntransport = \"grpc\"\n\n[model]", 1)
            + "data_connections = false\n";
    }
    if !procs.server_toml.is_empty() {
        text = text + &procs.server_toml + "\n";
    }
    let cfg = write_config(&path, &text)?;
    let ranges = ps_model::layout::shard_ranges(cfg.layout().num_params(), cfg.num_shards());
    let bin = procs.bin.clone().unwrap_or_else(bin_dir);
    let mut cluster = LocalCluster::new(bin, path, Some(dir.join("logs")));
    let started = Instant::now();
    cluster.start_servers(s, &[], Duration::from_secs(60))?;
    for r in 0..w {
        cluster.start_worker(r, w, &[])?;
    }
    let metrics_path = out_dir.join("metrics.jsonl");
    let weights: Vec<PathBuf> = (0..s)
        .map(|i| out_dir.join(format!("shard-{i}.safetensors")))
        .collect();
    let Watched {
        server_hwm,
        worker_hwm,
        cpu_from,
        cpu_to,
        ended_early,
    } = watch_e2e(&mut cluster, &metrics_path, &weights, steps, skip)?;
    let wall = started.elapsed().as_secs_f64();
    let metrics = read_metrics(&metrics_path);
    if (metrics.len() as u64) < steps {
        bail!(
            "{} holds {} steps: expected {steps}",
            metrics_path.display(),
            metrics.len()
        );
    }
    let timed = &metrics[skip.min(metrics.len())..];
    let col = |k: &str| -> Vec<f64> { timed.iter().filter_map(|v| v[k].as_f64()).collect() };
    let step_ms = col("step_ms");
    let param_bytes: Vec<u64> = ranges.iter().map(|r| r.len() as u64 * 4).collect();
    let cpu_per_step = match (cpu_from, cpu_to) {
        (Some((c0, n0)), Some((c1, n1))) if n1 > n0 => 1e3 * (c1 - c0) / (n1 - n0) as f64,
        _ => f64::NAN,
    };
    Ok(json!({
        "step_ms": median(&step_ms),
        "shard0_cpu_ms_per_step": cpu_per_step,
        "step_ms_min": step_ms.iter().copied().fold(f64::INFINITY, f64::min),
        "step_ms_max": step_ms.iter().copied().fold(0.0, f64::max),
        "barrier_wait_ms": median(&col("barrier_wait_ms")),
        "apply_ms": median(&col("apply_ms")),
        "timed_steps": step_ms.len(),
        "wall_secs": wall,
        "stopped_after_last_step": ended_early,
        "server_hwm_bytes": server_hwm,
        "server_param_bytes": param_bytes,
        // what each shard stated at start-up it would peak at (`ps_server::memory`)
        "server_stated_bytes": ranges.iter()
            .map(|r| ps_server::memory::MemoryPlan::of(&cfg, r.len()).total())
            .collect::<Vec<_>>(),
        "server_hwm_ratio": server_hwm.iter().zip(&param_bytes)
            .map(|(h, p)| *h as f64 / *p as f64).collect::<Vec<_>>(),
        "worker_hwm_bytes": worker_hwm,
    }))
}

/// What [`watch_e2e`] saw of a cluster run: each process's peak resident memory, shard 0's
/// CPU seconds and applied steps once the skipped steps were done and at the end, and whether
/// it stopped the run after its last step (the workers' final evaluation left out).
struct Watched {
    server_hwm: Vec<u64>,
    worker_hwm: Vec<u64>,
    cpu_from: Option<(f64, usize)>,
    cpu_to: Option<(f64, usize)>,
    ended_early: bool,
}

/// Watches a started cluster until every process has exited, or every step is in
/// `metrics_path` and every shard's `weights` are written (then stops it); an error names a
/// failed process, or the run past 600 s.
fn watch_e2e(
    cluster: &mut LocalCluster,
    metrics_path: &Path,
    weights: &[PathBuf],
    steps: u64,
    skip: usize,
) -> anyhow::Result<Watched> {
    let mut server_hwm = vec![0u64; cluster.servers.len()];
    let mut worker_hwm = vec![0u64; cluster.workers.len()];
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut last_check = Instant::now();
    let mut ended_early = false;
    // shard 0's CPU seconds and applied steps, once the skipped steps are done and at the end
    let mut cpu_from: Option<(f64, usize)> = None;
    let mut cpu_to: Option<(f64, usize)> = None;
    let shard0 = cluster.servers[0].child.id();
    let sample = |c: &LocalCluster, sh: &mut [u64], wh: &mut [u64]| {
        for (h, p) in sh.iter_mut().zip(&c.servers) {
            if p.status.is_none()
                && let Some(v) = vm_hwm(p.child.id())
            {
                *h = (*h).max(v);
            }
        }
        for (h, p) in wh.iter_mut().zip(&c.workers) {
            if p.status.is_none()
                && let Some(v) = vm_hwm(p.child.id())
            {
                *h = (*h).max(v);
            }
        }
    };
    loop {
        sample(cluster, &mut server_hwm, &mut worker_hwm);
        let mut running = 0;
        let mut failure = None;
        for p in cluster.servers.iter_mut().chain(cluster.workers.iter_mut()) {
            if p.status.is_none() {
                match p.child.try_wait()? {
                    Some(st) => p.status = Some(st),
                    None => running += 1,
                }
            }
            if let Some(st) = p.status
                && !st.success()
                && failure.is_none()
            {
                failure = Some(format!("{} failed with {st}{}", p.name, p.log_tail(20)));
            }
        }
        if let Some(msg) = failure {
            cluster.kill_all();
            bail!(msg);
        }
        if running == 0 {
            break;
        }
        // every step applied and every shard's final weights written: the rest of the run is
        // the workers' final test-set evaluation, which nothing here measures; stop it
        if last_check.elapsed() > Duration::from_millis(200) {
            last_check = Instant::now();
            let done = read_metrics(metrics_path).len();
            if cpu_from.is_none()
                && done >= skip
                && let Some(c) = cpu_secs(shard0)
            {
                cpu_from = Some((c, done));
            }
            if done as u64 >= steps && weights.iter().all(|p| p.exists()) {
                cpu_to = cpu_secs(shard0).map(|c| (c, done));
                std::thread::sleep(Duration::from_millis(200));
                sample(cluster, &mut server_hwm, &mut worker_hwm);
                ended_early = true;
                cluster.kill_all();
                break;
            }
        }
        if Instant::now() > deadline {
            cluster.kill_all();
            bail!("still running after 600 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Watched {
        server_hwm,
        worker_hwm,
        cpu_from,
        cpu_to,
        ended_early,
    })
}

pub(crate) fn table_e2e(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 3. End-to-end training (server and worker processes, MNIST, batch 64 per worker, plain SGD)\n\n\
         step = median of shard 0's step_ms after the skipped first steps; single = one process, \
         batch 64, 1 thread; overhead = step − single; bound = single × ceil(W / cores) (the step \
         if communication and the server cost nothing)\n\n\
         | model | W | S | step ms | steps/s | samples/s | barrier wait ms | apply ms | single ms | overhead ms | bound ms | ratio bound/step |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let head = format!(
            "| {} | {} | {} ",
            r["model"].as_str().unwrap_or("?"),
            r["workers"],
            r["shards"]
        );
        if let Some(e) = r["error"].as_str() {
            let _ = writeln!(
                s,
                "{head}| failed: {} | | | | | | | | |",
                e.lines().next().unwrap_or("")
            );
            continue;
        }
        let _ = writeln!(
            s,
            "{head}| {:.1} | {:.1} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
            f(r, "step_ms"),
            f(r, "steps_per_s"),
            f(r, "samples_per_s"),
            f(r, "barrier_wait_ms"),
            f(r, "apply_ms"),
            f(r, "single_process_ms"),
            f(r, "overhead_ms"),
            f(r, "compute_bound_ms"),
            f(r, "ratio_bound_to_step"),
        );
    }
    s
}

pub(crate) fn table_memory(rows: &[Value]) -> String {
    let mut s = String::from(
        "## 4. Server peak memory (VmHWM, polled every 20 ms during the runs of section 3)\n\n\
         | model | W | S | shard | parameter bytes | peak RSS | ratio |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let (Some(h), Some(p)) = (
            r["server_hwm_bytes"].as_array(),
            r["server_param_bytes"].as_array(),
        ) else {
            continue;
        };
        for (i, (h, p)) in h.iter().zip(p).enumerate() {
            let (h, p) = (h.as_f64().unwrap_or(0.0), p.as_f64().unwrap_or(0.0));
            let _ = writeln!(
                s,
                "| {} | {} | {} | {i} | {:.1} MB | {:.1} MB | {:.2} |",
                r["model"].as_str().unwrap_or("?"),
                r["workers"],
                r["shards"],
                p / 1e6,
                h / 1e6,
                h / p,
            );
        }
    }
    s
}
