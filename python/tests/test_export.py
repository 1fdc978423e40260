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
