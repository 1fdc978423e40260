"""The DDP-like entry point (``ps.distributed``: the loop keeps its shape) and gradient
accumulation over micro-batches (``micro_batches``): 2 workers against 2 shards equal one
process with torch.optim on the same global batch within 1e-5 after 20 steps; a k that does
not divide a worker's batch is refused before the first push, naming the step."""

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ps
from common import Shards, config_text, max_rel_diff

STEPS = 20


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def data(n=640):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, 12, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return x, y


def setup(tmp_path):
    torch.manual_seed(3)
    base = Mlp()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, None, tmp_path, global_batch=32, steps=STEPS, train_len=640,
                               optimizer='kind = "sgd"\nlr = 0.1\nmomentum = 0.9'))
    return base, cfg


def run_ranks(go, n=2):
    errors = []

    def wrapped(r):
        try:
            go(r)
        except BaseException as e:  # reported below, with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=wrapped, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_distributed_loop_with_accumulation_equals_one_process(tmp_path):
    base, cfg = setup(tmp_path)
    x, y = data()
    models = [copy.deepcopy(base) for _ in range(2)]
    with Shards(cfg, 2, tmp_path) as shards:
        def go(r):
            model = ps.distributed(models[r], cfg, rank=r, servers=shards.addrs)
            for xb, yb in model.loader(TensorDataset(x, y)):
                if r == 0:  # rank 0 accumulates over 4 micro-batches of 4
                    for (xm, ym), scale in model.micro_batches((xb, yb), 4):
                        (F.cross_entropy(model(xm), ym) * scale).backward()
                    model.opt_step()
                    continue
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                model.opt_step(loss)

        assert run_ranks(go) == []
        assert shards.wait(60) == [0, 0]
    # one process, the same global batches (the union of the ranks' indices), torch.optim
    from ps import _native
    desc = [(k, list(p.shape)) for k, p in base.named_parameters()]
    plans = [_native.Client(str(cfg), desc, rank=r, servers=["x:1", "x:2"]) for r in range(2)]
    for p in plans:
        p.plan(len(x))
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for t in range(STEPS):
        idx = torch.tensor([i for p in plans for i in p.batch(t)], dtype=torch.int64)
        opt.zero_grad()
        F.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()
    for r, m in enumerate(models):
        diff, name = max_rel_diff(m, ref)
        print(f"rank {r} (ps.distributed{', 4 micro-batches' if r == 0 else ''}) vs one process: {diff:.2e} ({name})")
        assert diff < 1e-5, (r, name, diff)


def test_accumulation_that_does_not_divide_the_batch_is_refused_before_any_push(tmp_path):
    base, cfg = setup(tmp_path)
    x, y = data()
    with Shards(cfg, 2, tmp_path) as shards:
        w = ps.Worker(cfg, copy.deepcopy(base), rank=0, servers=shards.addrs)
        batches = w.batches()
        _, idx = next(batches)
        with pytest.raises(ValueError, match=r"k = 3 does not divide rank 0's batch of step 0 \(16 samples\)"):
            list(w.micro_batches(idx, 3))
        with pytest.raises(ValueError, match="k = 0: expected 1 or more"):
            list(w.micro_batches(idx, 0))
        assert w.timing()["pushes"] == 0
        batches.close()
