"""The Rust workers' built-in CNN ([model] kind = "cnn", ps-worker's own im2col, GEMM and
pooling code) against PyTorch's own nn.Conv2d/F.max_pool2d/nn.Linear: the same initial
weights (PyTorch's default init, saved with ps.save_init and given as [model] init), the same
batches (the run's data order, from the package's planner), 20 steps of SGD with momentum. A
real ps-launch cluster of 2 shards and 2 Rust workers trains it; its exported
model.safetensors loads into the torch module with strict=True and is within 1e-5 (largest
relative difference per tensor) of torch.optim's single-process result."""

import copy
import subprocess

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ps
from ps import _native
from common import BIN, REPO, load, max_rel_diff

DATA = REPO / "data" / "mnist"
STEPS = 20
TOLERANCE = 1e-5


class RustCNN(nn.Module):
    """The built-in CNN of [model] kind = "cnn", channels = [4, 8], hidden = [16]."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 5)
        self.conv2 = nn.Conv2d(4, 8, 5)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


# a small lr: a ReLU or max-pool input within rounding of a tie flips on one side only and
# changes that step's gradient by a whole term (tests/tests/cnn.rs measures it)
CASES = {
    # name: (loss reduction, aggregation, global batch, torch lr)
    "mean_mean": ("mean", "mean", 16, 0.02),
    "weighted_uneven": ("mean", "weighted", 15, 0.02),
    "sum_sum": ("sum", "sum", 16, 0.002),
}


def config(tmp_path, init, loss, aggregation, global_batch, lr):
    return f"""
[cluster]
servers = ["127.0.0.1:1", "127.0.0.1:2"]
workers = 2

[model]
kind = "cnn"
channels = [4, 8]
hidden = [16]
init = "{init}"

[data]
dir = "{DATA}"

[train]
seed = 11
global_batch = {global_batch}
steps = {STEPS}
loss_reduction = "{loss}"
aggregation = "{aggregation}"
log_every = 10

[optimizer]
kind = "sgd"
lr = {lr}
momentum = 0.9

[server]
out_dir = "{tmp_path / 'out'}"
"""


def torch_reference(base, cfg, x, y, loss, lr):
    """One process, torch.optim, each step's batch the union of the workers' batches."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    desc = [(n, list(p.shape)) for n, p in model.named_parameters()]
    planners = [_native.Client(str(cfg), desc, rank=r, servers=["x:1", "x:2"]) for r in range(2)]
    for p in planners:
        p.plan(len(x))
    for t in range(STEPS):
        idx = torch.tensor(sum((p.batch(t) for p in planners), []), dtype=torch.int64)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx], reduction=loss).backward()
        opt.step()
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_rust_cnn_equals_pytorch(case, tmp_path):
    torch.set_num_threads(1)
    x, y = load(DATA, "train")
    loss, aggregation, global_batch, lr = CASES[case]
    torch.manual_seed(5)
    base = RustCNN()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config(tmp_path, init, loss, aggregation, global_batch, lr))
    run = subprocess.run([str(BIN / "ps-launch"), "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    from safetensors.torch import load_file
    trained = RustCNN()
    trained.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")), strict=True)
    ref = torch_reference(base, cfg, x, y, loss, lr)
    moved, _ = max_rel_diff(ref, base)
    assert moved > 1e-3, f"training moved the weights by only {moved}"
    diff, name = max_rel_diff(trained, ref)
    print(f"{case}: Rust CNN cluster vs PyTorch: largest relative difference {diff:.2e} (in {name})")
    assert diff < TOLERANCE, (case, diff, name)
