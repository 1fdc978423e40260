//! Section 6: the built-in CNN's CPU forward+backward against PyTorch's on the same machine, in
//! the same run: one thread each (`MATMUL_NUM_THREADS=1` here, `torch.set_num_threads(1)`
//! there), the same batch and geometry (the CNN of `deploy/fashion-cnn.toml`: 1 x 28 x 28,
//! conv 5x5 16 and 32 channels, 2x2 max-pooling, linear 512 -> 64 -> 10), synthetic pixels.
//! Figure: median milliseconds of forward + loss + backward, and the ratio ours / PyTorch's.

use ps_common::config::LossReduction;
use ps_common::layout::{CnnLayout, CnnShape, ModelLayout};
use serde_json::{Value, json};
use std::time::Instant;

/// PyTorch's side: the same CNN with torch's own `nn.Conv2d`, `F.max_pool2d`, `nn.Linear`;
/// prints one JSON line of per-repeat milliseconds.
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
m = CNN()
x = torch.rand(batch, 1, 28, 28); y = torch.randint(0, 10, (batch,))
out = []
for r in range(warmup + repeats):
    t = time.perf_counter()
    m.zero_grad(set_to_none=False)
    F.cross_entropy(m(x), y).backward()
    if r >= warmup:
        out.append((time.perf_counter() - t) * 1e3)
print(json.dumps({"ms": out, "torch": torch.__version__}))
"#;

/// The CNN of `deploy/fashion-cnn.toml`.
fn layout() -> CnnLayout {
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

/// Runs the section with `python` (which must import torch): one row.
pub fn section_cnn(python: &str, batch: usize, repeats: usize) -> anyhow::Result<Value> {
    let warmup = 3;
    let l = layout();
    let n = l.num_params();
    let ml = ModelLayout::from(l.clone());
    let mut b = ps_worker::cpu::cpu_model(&ml, 1);
    b.set_weights(&l.init_range(1, 0..n))?;
    let x: Vec<f32> = (0..batch * 784)
        .map(|i| ((i * 7919) % 256) as f32 / 255.0)
        .collect();
    let y: Vec<u8> = (0..batch).map(|i| (i % 10) as u8).collect();
    let mut g = vec![0f32; n];
    let mut ours = Vec::new();
    for r in 0..warmup + repeats {
        let t = Instant::now();
        b.forward_backward(&x, &y, LossReduction::Mean, &mut g)?;
        if r >= warmup {
            ours.push(super::ms(t.elapsed()));
        }
    }
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(TORCH)
        .args([batch, repeats, warmup].map(|v| v.to_string()))
        .output()
        .map_err(|e| anyhow::anyhow!("running {python}: {e}"))?;
    if !out.status.success() {
        anyhow::bail!(
            "{python} (PyTorch's side) failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let theirs: Vec<f64> = v["ms"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default();
    let (o, t) = (super::median(&ours), super::median(&theirs));
    Ok(json!({
        "model": l.describe(),
        "batch": batch,
        "threads": 1,
        "ours_ms": o,
        "torch_ms": t,
        "ratio": o / t,
        "torch": v["torch"],
    }))
}

/// The section's markdown table.
pub fn table_cnn(row: &Value) -> String {
    format!(
        "| model | batch | threads | ours (ms) | PyTorch {} (ms) | ours / PyTorch |\n|---|---|---|---|---|---|\n| {} | {} | {} | {:.2} | {:.2} | {:.2} |\n",
        row["torch"].as_str().unwrap_or("?"),
        row["model"].as_str().unwrap_or("?"),
        row["batch"],
        row["threads"],
        row["ours_ms"].as_f64().unwrap_or(f64::NAN),
        row["torch_ms"].as_f64().unwrap_or(f64::NAN),
        row["ratio"].as_f64().unwrap_or(f64::NAN),
    )
}
