//! Section 5, **scale**: one `ps-server` process and W clients (in this process, or real
//! worker processes), the step time, the server's CPU and its peak memory as W grows.

use super::*;
use crate::e2e::{Processes, cpu_secs, e2e_run, vm_hwm, vm_rss};
use crate::transfer::{connect, pull, push, register, wait_version};

/// Section 5 with the command line's settings (the worker counts, the pending-gradient
/// limits, the models, the steps), its table printed: the rows.
pub(crate) fn section_5(cli: &Cli, plan: &Plan, tmp: &Path) -> anyhow::Result<Vec<Value>> {
    let ws = if cli.scale_workers.is_empty() {
        vec![2, 4, 8, 32, 64]
    } else {
        cli.scale_workers.clone()
    };
    let bin = cli.server_bin_dir.clone().unwrap_or_else(bin_dir);
    let pending = if cli.scale_pending.is_empty() {
        vec![ps_config::DEFAULT_MAX_PENDING_GRADIENTS]
    } else {
        cli.scale_pending.clone()
    };
    let scale = Scale {
        processes: cli.scale_processes,
        server_toml: cli.scale_server_toml.clone(),
        pull: cli.scale_pull,
        models: if cli.scale_models.is_empty() {
            vec![SMALL, LARGE]
        } else {
            cli.scale_models
                .iter()
                .map(|m| match m.as_str() {
                    "tiny" => Ok(TINY),
                    "small" => Ok(SMALL),
                    "large" => Ok(LARGE),
                    other => bail!("--scale-models {other}: expected tiny, small or large"),
                })
                .collect::<anyhow::Result<_>>()?
        },
        steps: cli
            .scale_steps
            .unwrap_or(if plan.large_w4 { 6 } else { 3 })
            .max(2),
    };
    let rows = section_scale(tmp, plan, &scale, &ws, &pending, &bin)?;
    if scale.processes {
        println!("{}", table_scale_processes(&rows));
    } else {
        println!("{}", table_scale(&rows));
    }
    Ok(rows)
}

/// One ps-server process (its peak RSS is what is measured), W gRPC clients in this process,
/// each on its own connection, pushing the same real gradient bytes every step, as workers do
/// (1 MiB chunks); a step is timed from the first push to the new version being pullable.
/// What section 5 runs.
struct Scale {
    /// Real worker processes, every value through gRPC.
    processes: bool,
    /// Lines added to `[server]` (real worker processes only).
    server_toml: String,
    /// Every client pulls the new version after its push.
    pull: bool,
    models: Vec<Model>,
    /// Steps per run, the first untimed.
    steps: u64,
}

fn section_scale(
    tmp: &Path,
    plan: &Plan,
    scale: &Scale,
    ws: &[usize],
    pending: &[usize],
    bin: &Path,
) -> anyhow::Result<Vec<Value>> {
    let mut rows = Vec::new();
    for m in &scale.models {
        for &w in ws {
            if m.name == LARGE.name && w > 8 && !plan.large_w4 {
                continue;
            }
            for &p in pending {
                eprintln!(
                    "ps-bench: scale {} W = {w}, max_pending_gradients = {p}{}",
                    m.name,
                    if scale.pull { ", with pulls" } else { "" }
                );
                rows.push(if scale.processes {
                    scale_processes_run(tmp, m, w, p, scale, bin)?
                } else {
                    scale_run(tmp, m, w, p, scale, bin)?
                });
            }
        }
    }
    Ok(rows)
}

fn scale_run(
    tmp: &Path,
    m: &Model,
    w: usize,
    pending: usize,
    scale: &Scale,
    bin: &Path,
) -> anyhow::Result<Value> {
    let dir = tmp.join(format!("scale-{}-w{w}-p{pending}", m.name));
    let path = dir.join("config.toml");
    let mut text = config_text(1, w, m, ENDLESS, &dir.join("out"));
    if pending > 0 {
        text += &format!("max_pending_gradients = {pending}\n");
    }
    let cfg = write_config(&path, &text)?;
    let len = cfg.layout().num_params();
    let mut cluster = LocalCluster::new(bin.to_path_buf(), path, Some(dir.join("logs")));
    cluster.start_servers(1, &[], Duration::from_secs(60))?;
    let pid = cluster.servers[0].child.id();
    let addr: SocketAddr = cluster.addrs[0].parse()?;
    let rss_idle = vm_rss(pid).unwrap_or(0);
    let grad = f32_to_bytes(&vec![1e-6f32; len]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (steps, pulls) = (scale.steps, scale.pull);
    let (times, cpu) = rt.block_on(async {
        let mut clients = Vec::with_capacity(w);
        for r in 0..w {
            let mut c = connect(addr).await?;
            register(&mut c, &cfg, r).await?;
            clients.push(c);
        }
        let mut times = Vec::new();
        let mut cpu_from = 0.0;
        for step in 0..steps {
            if step == 1 {
                cpu_from = cpu_secs(pid).unwrap_or(f64::NAN);
            }
            let t = Instant::now();
            let mut tasks = Vec::with_capacity(w);
            for (r, c) in clients.iter().enumerate() {
                let mut c = c.clone();
                let g = grad.clone();
                tasks.push(tokio::spawn(async move {
                    push(&mut c, r, step, &g).await?;
                    if pulls {
                        pull(&mut c, step + 1, len).await?;
                    }
                    anyhow::Ok(())
                }));
            }
            for t in tasks {
                t.await??;
            }
            if !pulls {
                wait_version(&mut clients[0], &cfg, step + 1).await?;
            }
            times.push(ms(t.elapsed()));
        }
        let cpu = cpu_secs(pid).unwrap_or(f64::NAN) - cpu_from;
        anyhow::Ok((times, cpu))
    })?;
    let hwm = vm_hwm(pid).unwrap_or(0);
    drop(rt);
    cluster.kill_all();
    let bytes = len as u64 * 4;
    let timed = &times[1..];
    Ok(json!({
        "model": m.name,
        "workers": w,
        "pulls": pulls,
        "max_pending_gradients": if pending > 0 { json!(pending) } else { json!("unset") },
        "param_bytes": bytes,
        "step_ms_median": median(timed),
        "shard_cpu_ms_per_step": 1e3 * cpu / timed.len() as f64,
        "rss_idle_bytes": rss_idle,
        "peak_rss_bytes": hwm,
        "peak_over_params": hwm as f64 / bytes as f64,
        "target_bytes": 4 * bytes + (100 << 20),
        "within_target": hwm <= 4 * bytes + (100 << 20),
        "server": bin.display().to_string(),
    }))
}

/// One run of W `ps-worker` processes on one shard, every value through gRPC.
fn scale_processes_run(
    tmp: &Path,
    m: &Model,
    w: usize,
    pending: usize,
    scale: &Scale,
    bin: &Path,
) -> anyhow::Result<Value> {
    if pending != ps_config::DEFAULT_MAX_PENDING_GRADIENTS {
        bail!("--scale-processes runs the default max_pending_gradients only");
    }
    let skip = 3;
    let steps = scale.steps.max(skip as u64 + 2);
    let procs = Processes {
        bin: Some(bin.to_path_buf()),
        grpc_only: true,
        server_toml: scale.server_toml.clone(),
    };
    let mut r = e2e_run(tmp, m, w, 1, steps, skip, &procs)?;
    r["model"] = json!(m.name);
    r["workers"] = json!(w);
    r["steps"] = json!(steps);
    r["server"] = json!(bin.display().to_string());
    r["loadavg_after"] = json!(loadavg());
    eprintln!(
        "  W={w}: {:.1} ms/step, shard CPU {:.1} ms/step, shard peak {:.1} MB (stated {:.1} MB)",
        f(&r, "step_ms"),
        f(&r, "shard0_cpu_ms_per_step"),
        r["server_hwm_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6,
        r["server_stated_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6
    );
    Ok(r)
}

fn table_scale_processes(rows: &[Value]) -> String {
    let mut t = String::from(
        "## 5. Scale: one shard, W ps-worker processes, every value through gRPC\n\n\
         | model | W | step ms (median) | shard CPU ms / step | shard peak RSS MB | stated MB | parameter MB | load after | server |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            t,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
            r["model"].as_str().unwrap_or("?"),
            r["workers"],
            f(r, "step_ms"),
            f(r, "shard0_cpu_ms_per_step"),
            r["server_hwm_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6,
            r["server_stated_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6,
            r["server_param_bytes"][0].as_f64().unwrap_or(f64::NAN) / 1e6,
            r["loadavg_after"].as_str().unwrap_or("?"),
            r["server"].as_str().unwrap_or("?"),
        );
    }
    t
}

fn table_scale(rows: &[Value]) -> String {
    let mut t = String::from(
        "## 5. Scale: one shard process, W gRPC clients pushing real gradients\n\n\
         | model | W | pulls | max_pending_gradients | parameter MB | step ms (median) | shard CPU ms / step | shard peak RSS MB | peak / params | target MB (4x params + 100) | within |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let mb = |k: &str| f(r, k) / 1e6;
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
            r["model"].as_str().unwrap_or("?"),
            r["workers"],
            if r["pulls"].as_bool() == Some(true) {
                "gRPC"
            } else {
                "no"
            },
            r["max_pending_gradients"].to_string().trim_matches('"'),
            mb("param_bytes"),
            f(r, "step_ms_median"),
            f(r, "shard_cpu_ms_per_step"),
            mb("peak_rss_bytes"),
            f(r, "peak_over_params"),
            mb("target_bytes"),
            if r["within_target"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            }
        );
    }
    t
}
