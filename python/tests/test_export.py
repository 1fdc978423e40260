"""Frozen, tied and buffer entries of a model: every worker must hold the same frozen
parameters and buffers at registration (checked by shard 0 against the first worker's, naming
the entry that differs), and ``ps.export`` writes every ``state_dict`` entry, so a strict load
restores the whole model."""

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

import ps
from common import Shards, config_text


class Full(nn.Module):
    """An embedding tied to the output layer, a frozen layer, and BatchNorm."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok):
        return self.head(self.bn(torch.tanh(self.frozen(self.emb(tok)))))


def tokens(n=400):
    g = torch.Generator().manual_seed(4)
    tok = torch.randint(0, 10, (n,), generator=g)
    return tok, (tok + 1) % 10


def write_config(tmp_path, model):
    init = tmp_path / "init.safetensors"
    ps.save_init(model, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, None, tmp_path, global_batch=32, steps=6, train_len=400))
    return cfg


def train(cfg, models, addrs, x, y):
    errors = []

    def go(r):
        try:
            w = ps.Worker(cfg, models[r], rank=r, servers=addrs, allow_buffers=True)
            for _, idx in w.batches():
                F.cross_entropy(models[r](x[idx]), y[idx]).backward()
                w.step()
        except BaseException as e:  # reported below, with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_export_loads_strictly_with_frozen_tied_and_buffers(tmp_path):
    torch.manual_seed(2)
    base = Full()
    x, y = tokens()
    cfg = write_config(tmp_path, base)
    models = [copy.deepcopy(base) for _ in range(2)]
    with Shards(cfg, 2, tmp_path) as shards:
        assert train(cfg, models, shards.addrs, x, y) == []
        assert shards.wait(60) == [0, 0]
    path = tmp_path / "full.safetensors"
    ps.export(models[0], path)
    saved = load_file(str(path))
    assert {"head.weight", "emb.weight", "frozen.weight", "bn.running_mean",
            "bn.num_batches_tracked"} <= set(saved)
    assert saved["bn.num_batches_tracked"].dtype == torch.int64
    assert int(saved["bn.num_batches_tracked"]) == 6
    fresh = Full()
    fresh.load_state_dict(saved, strict=True)  # raises on a missing or unexpected key
    for k, v in models[0].state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert not torch.equal(fresh.emb.weight, base.emb.weight), "the export holds the trained weights"
    assert fresh.head.weight is fresh.emb.weight, "still tied after loading"


def test_a_worker_whose_frozen_parameter_differs_is_refused_naming_it(tmp_path):
    torch.manual_seed(2)
    base = Full()
    cfg = write_config(tmp_path, base)
    models = [copy.deepcopy(base) for _ in range(2)]
    with torch.no_grad():
        models[1].frozen.weight[0, 0] += 0.5
    with Shards(cfg, 2, tmp_path) as shards:
        ws = [ps.Worker(cfg, m, rank=r, servers=shards.addrs, allow_buffers=True)
              for r, m in enumerate(models)]
        first = ws[0].batches()
        next(first)  # rank 0 registered, its entries are the reference
        with pytest.raises(ps.ModelMismatchError,
                           match=r"rank 1's frozen parameter \"frozen.weight\" differs in value from rank 0's"):
            next(ws[1].batches())
        first.close()


class Bn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def test_batchnorm_equals_one_process_with_ghost_batch_norm(tmp_path):
    """allow_buffers: DDP's broadcast_buffers semantics. Each worker's BatchNorm normalises
    over its own b_r = 16 samples; one process doing the same (ghost batch norm: each worker's
    sub-batch through the model on its own, loss = the mean of their mean losses) with
    torch.optim ends within 1e-5 after 20 steps, and rank 0's running statistics (the model's,
    as with DDP) equal that process's when it updates them from rank 0's sub-batches."""
    torch.manual_seed(6)
    base = Bn()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(640, 12, generator=g) * 2 + 1
    y = (x[:, 0] + x[:, 1] > 2).long() + (x[:, 2] > 1).long()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, None, tmp_path, global_batch=32, steps=20, train_len=640,
                               optimizer='kind = "sgd"\nlr = 0.1\nmomentum = 0.9'))
    models = [copy.deepcopy(base) for _ in range(2)]
    with Shards(cfg, 2, tmp_path) as shards:
        assert train(cfg, models, shards.addrs, x, y) == []
        assert shards.wait(60) == [0, 0]
    from ps import _native
    desc = [(k, list(p.shape)) for k, p in base.named_parameters()]
    plans = [_native.Client(str(cfg), desc, rank=r, servers=["x:1", "x:2"]) for r in range(2)]
    for p in plans:
        p.plan(len(x))
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for t in range(20):
        opt.zero_grad()
        losses = []
        for r, p in enumerate(plans):
            idx = torch.tensor(p.batch(t), dtype=torch.int64)
            # only rank 0's forward updates the model's running statistics: the others run
            # on copies of them (the originals are put back afterwards)
            kept = dict(ref.bn._buffers)
            if r > 0:
                ref.bn._buffers.update({k: b.clone() for k, b in kept.items()})
            losses.append(F.cross_entropy(ref(x[idx]), y[idx]))
            ref.bn._buffers.update(kept)
        (sum(losses) / len(losses)).backward()
        opt.step()
    for r, m in enumerate(models):
        for (k, a), b in zip(m.named_parameters(), ref.parameters()):
            diff = ((a - b).abs().max() / b.abs().max()).item()
            print(f"rank {r}'s {k} vs one process with ghost batch norm: {diff:.2e}")
            assert diff < 1e-5, (r, k, diff)
    for k, b in ref.named_buffers():
        mine = dict(models[0].named_buffers())[k]
        if b.dtype == torch.int64:
            assert torch.equal(mine, b), k
        else:
            diff = ((mine - b).abs().max() / b.abs().max()).item()
            print(f"rank 0's {k} vs one process: {diff:.2e}")
            assert diff < 1e-5, (k, diff)
    # the other rank's statistics are its own: they differ (the reason export is rank 0's)
    assert not torch.equal(models[1].bn.running_mean, ref.bn.running_mean)
