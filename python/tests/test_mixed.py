"""The Rust MLP worker (ps-worker) and a Python worker join the same run: a declared MLP
(fc1, fc2: the built-in MLP's names and shapes) written from PyTorch; rank 0 is a ps-worker
process, rank 1 a ps.Worker. The result equals single-process torch.optim on the union batch."""

import copy
import subprocess

import torch
import torch.nn as nn
import torch.nn.functional as F

import ps
from common import BIN, REPO, Shards, config_text, load, max_rel_diff, train_rank
from test_equivalence import reference

DATA = REPO / "data" / "mnist"


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def test_rust_and_python_workers_in_one_run(tmp_path):
    torch.manual_seed(5)
    torch.set_num_threads(1)
    x, y = load(DATA, "train")
    base = MLP()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, DATA, tmp_path, global_batch=64, steps=20,
                               optimizer='kind = "sgd"\nlr = 0.1\nmomentum = 0.9'))
    model = copy.deepcopy(base)
    with Shards(cfg, 2, tmp_path) as shards:
        rust = subprocess.Popen(
            [str(BIN / "ps-worker"), "--config", str(cfg), "--rank", "0",
             "--servers", ",".join(shards.addrs)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        worker = ps.Worker(cfg, model, rank=1, servers=shards.addrs)
        train_rank(worker, model, x, y, "mean")
        out = rust.communicate(timeout=120)[0]
        assert rust.returncode == 0, out
        assert shards.wait(60) == [0, 0]
    ref = reference(base, cfg, x, y, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert max_rel_diff(ref, base)[0] > 1e-3
    diff, name = max_rel_diff(model, ref)
    print(f"Rust + Python workers vs torch.optim: largest relative difference {diff:.2e} (in {name})")
    assert diff < 1e-5, (diff, name)
