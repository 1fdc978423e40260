//! Section 6: the built-in models' CPU forward+backward against PyTorch's on the same machine,
//! in the same run: one thread each (`MATMUL_NUM_THREADS=1` here, `torch.set_num_threads(1)`
//! there), the same batch, synthetic pixels. The models: the CNN of `deploy/fashion-cnn.toml`
//! (1 x 28 x 28, conv 5x5 16 and 32 channels, 2x2 max-pooling, linear 512 -> 64 -> 10) and the
//! small and large MLPs of section 3 (784-1024-1024-10, 784-4096-4096-10).
//! Figures: median milliseconds of forward + loss + backward, wall clock and the thread's CPU
//! time (which other processes on a loaded machine do not move much), and the ratios ours /
//! PyTorch's.

use ps_config::LossReduction;
use ps_model::layout::{CnnLayout, CnnShape, MlpLayout, ModelLayout};
use serde_json::{Value, json};
use std::time::Instant;

/// PyTorch's side: the same model with torch's own `nn.Conv2d`, `F.max_pool2d`, `nn.Linear`;
/// argv: batch, repeats, warmup, then `cnn` or the MLP's widths (`784,1024,1024,10`). Prints
/// one JSON line of per-repeat wall and thread-CPU milliseconds.
const TORCH: &str = r#"
import json, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
batch, repeats, warmup = (int(a) for a in sys.argv[1:4])
class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5); self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(512, 64); self.fc2 = nn.Linear(64, 10)
    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))
if sys.argv[4] == "cnn":
    m, x = CNN(), torch.rand(batch, 1, 28, 28)
else:
    d = [int(v) for v in sys.argv[4].split(",")]
    layers = []
    for i in range(len(d) - 1):
        layers += [nn.Linear(d[i], d[i + 1])] + ([nn.ReLU()] if i + 2 < len(d) else [])
    m, x = nn.Sequential(*layers), torch.rand(batch, d[0])
y = torch.randint(0, 10, (batch,))
wall, cpu = [], []
for r in range(warmup + repeats):
    t, c = time.perf_counter(), time.thread_time()
    m.zero_grad(set_to_none=False)
    F.cross_entropy(m(x), y).backward()
    if r >= warmup:
        wall.append((time.perf_counter() - t) * 1e3); cpu.append((time.thread_time() - c) * 1e3)
print(json.dumps({"ms": wall, "cpu_ms": cpu, "torch": torch.__version__}))
"#;

/// The CNN of `deploy/fashion-cnn.toml`.
fn cnn() -> CnnLayout {
    CnnLayout::new(CnnShape {
        image: [1, 28, 28],
        channels: vec![16, 32],
        kernel: 5,
        stride: 1,
        padding: 0,
        hidden: vec![64],
        classes: 10,
    })
    .expect("a valid CNN")
}

/// The models of the section: the layout and PyTorch's argument for it.
fn models() -> Vec<(ModelLayout, String)> {
    let mut v = vec![(ModelLayout::from(cnn()), "cnn".to_string())];
    for h in [1024, 4096] {
        let dims = [784, h, h, 10];
        let arg = dims.map(|d| d.to_string()).join(",");
        v.push((ModelLayout::from(MlpLayout::new(&dims)), arg));
    }
    v
}

/// Milliseconds of CPU time this thread has used.
fn thread_cpu_ms() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 * 1e3 + t.tv_nsec as f64 / 1e6
}

/// Runs the section with `python` (which must import torch): one row per model, `repeats`
/// steps for the CNN and the small MLP, a fifth of them (at least 3) for the large MLP.
pub fn section_vs_torch(python: &str, batch: usize, repeats: usize) -> anyhow::Result<Vec<Value>> {
    let mut rows = Vec::new();
    for (layout, arg) in models() {
        let n = layout.num_params();
        let repeats = if n > 10_000_000 {
            (repeats / 5).max(3)
        } else {
            repeats
        };
        let warmup = 3;
        let mut b = ps_worker::cpu::cpu_model(&layout, 1);
        b.set_weights(&layout.init_range(1, 0..n))?;
        let x: Vec<f32> = (0..batch * layout.inputs())
            .map(|i| ((i * 7919) % 256) as f32 / 255.0)
            .collect();
        let y: Vec<u8> = (0..batch).map(|i| (i % 10) as u8).collect();
        let mut g = vec![0f32; n];
        let (mut wall, mut cpu) = (Vec::new(), Vec::new());
        for r in 0..warmup + repeats {
            let (t, c) = (Instant::now(), thread_cpu_ms());
            b.forward_backward(&x, &y, LossReduction::Mean, &mut g)?;
            if r >= warmup {
                wall.push(super::ms(t.elapsed()));
                cpu.push(thread_cpu_ms() - c);
            }
        }
        let out = std::process::Command::new(python)
            .arg("-c")
            .arg(TORCH)
            .args([batch, repeats, warmup].map(|v| v.to_string()))
            .arg(&arg)
            .output()
            .map_err(|e| anyhow::anyhow!("running {python}: {e}"))?;
        if !out.status.success() {
            anyhow::bail!(
                "{python} (PyTorch's side) failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let v: Value = serde_json::from_slice(&out.stdout)?;
        let list = |k: &str| -> Vec<f64> {
            v[k].as_array()
                .map(|a| a.iter().filter_map(Value::as_f64).collect())
                .unwrap_or_default()
        };
        let (o, t) = (super::median(&wall), super::median(&list("ms")));
        let (oc, tc) = (super::median(&cpu), super::median(&list("cpu_ms")));
        eprintln!(
            "  {}: ours {o:.2} ms (cpu {oc:.2}), PyTorch {t:.2} ms (cpu {tc:.2})",
            layout.describe()
        );
        rows.push(json!({
            "model": layout.describe(),
            "batch": batch,
            "threads": 1,
            "repeats": repeats,
            "ours_ms": o,
            "torch_ms": t,
            "ratio": o / t,
            "ours_cpu_ms": oc,
            "torch_cpu_ms": tc,
            "cpu_ratio": oc / tc,
            "torch": v["torch"],
        }));
    }
    Ok(rows)
}

/// The section's markdown table.
pub fn table_vs_torch(rows: &[Value]) -> String {
    let torch = rows
        .first()
        .and_then(|r| r["torch"].as_str())
        .unwrap_or("?");
    let mut s = format!(
        "| model | batch | threads | ours (ms) | PyTorch {torch} (ms) | ours / PyTorch | ours CPU (ms) | PyTorch CPU (ms) | CPU ratio |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    for r in rows {
        s += &format!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
            r["model"].as_str().unwrap_or("?"),
            r["batch"],
            r["threads"],
            f(r, "ours_ms"),
            f(r, "torch_ms"),
            f(r, "ratio"),
            f(r, "ours_cpu_ms"),
            f(r, "torch_cpu_ms"),
            f(r, "cpu_ratio"),
        );
    }
    s
}
