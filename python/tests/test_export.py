"""Frozen, tied and buffer entries of a model: every worker must hold the same frozen
parameters at registration (checked by shard 0 against the first worker's, naming the entry
that differs); buffers live on shard 0 (DDP's broadcast_buffers: rank 0's, every worker starts
each step from them), checkpointed; ``ps.export`` and ``ps-launch --export`` write every
``state_dict`` entry, so a strict load restores the whole model."""

import copy
import subprocess
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

import ps
from common import BIN, Shards, config_text, lose_shard_after_checkpoint


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


def train(cfg, models, addrs, x, y, during=None, overlap=False):
    """Trains each model as one rank in a thread; ``during(errors)`` runs meanwhile (a lost
    shard); returns the errors (rank, exception)."""
    errors = []

    def go(r):
        try:
            w = ps.Worker(cfg, models[r], rank=r, servers=addrs)
            for _, idx in w.batches():
                loss = F.cross_entropy(models[r](x[idx]), y[idx])
                if overlap and r == 0:
                    w.backward(loss)
                    continue
                loss.backward()
                w.step()
        except BaseException as e:  # reported below, with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(models))]
    for t in threads:
        t.start()
    if during is not None:
        during(errors)
    for t in threads:
        t.join(120)
    return errors


def launch_export(cfg, out):
    """``ps-launch --export``: merges the shards' final files of ``out`` into
    ``out/model.safetensors``; returns its tensors."""
    done = subprocess.run([str(BIN / "ps-launch"), "--config", str(cfg), "--out-dir", str(out),
                           "--export"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return load_file(str(out / "model.safetensors"))


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
    # the shards' export holds the same entries: frozen and tied from the init file, buffers
    # from shard 0
    merged = launch_export(cfg, tmp_path)
    assert set(merged) == set(saved)
    fresh = Full()
    fresh.load_state_dict(merged, strict=True)
    for k, v in models[0].state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
        assert merged[k].dtype == v.dtype, k


def test_a_worker_whose_frozen_parameter_differs_is_refused_naming_it(tmp_path):
    torch.manual_seed(2)
    base = Full()
    cfg = write_config(tmp_path, base)
    models = [copy.deepcopy(base) for _ in range(2)]
    with torch.no_grad():
        models[1].frozen.weight[0, 0] += 0.5
    with Shards(cfg, 2, tmp_path) as shards:
        ws = [ps.Worker(cfg, m, rank=r, servers=shards.addrs) for r, m in enumerate(models)]
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


def ghost_batch_norm_reference(cfg, base, x, y, steps):
    """One process with the cluster's semantics: each worker's sub-batch of a step through the
    model on its own (ghost batch norm of b_r), the loss the mean of their mean losses,
    torch.optim's SGD with momentum; the running statistics are updated by rank 0's sub-batch
    only (the others run on copies of them)."""
    from ps import _native
    desc = [(k, list(p.shape)) for k, p in base.named_parameters()]
    plans = [_native.Client(str(cfg), desc, rank=r, servers=["x:1", "x:2"]) for r in range(2)]
    for p in plans:
        p.plan(len(x))
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for t in range(steps):
        opt.zero_grad()
        losses = []
        for r, p in enumerate(plans):
            idx = torch.tensor(p.batch(t), dtype=torch.int64)
            kept = dict(ref.bn._buffers)
            if r > 0:
                ref.bn._buffers.update({k: b.clone() for k, b in kept.items()})
            losses.append(F.cross_entropy(ref(x[idx]), y[idx]))
            ref.bn._buffers.update(kept)
        (sum(losses) / len(losses)).backward()
        opt.step()
    return ref


def assert_state_equal(model, ref, who):
    """Parameters within 1e-5 (relative to the tensor's largest value), float buffers too,
    integer buffers exactly."""
    got = model.state_dict()
    for k, b in ref.state_dict().items():
        mine = got[k]
        assert mine.dtype == b.dtype, (who, k)
        if not b.is_floating_point():
            assert torch.equal(mine, b), (who, k, mine, b)
            continue
        diff = ((mine - b).abs().max() / b.abs().max()).item()
        print(f"{who}'s {k} vs one process with ghost batch norm: {diff:.2e}")
        assert diff < 1e-5, (who, k, diff)


def bn_setup(tmp_path, steps=20, extra=""):
    torch.manual_seed(6)
    base = Bn()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(640, 12, generator=g) * 2 + 1
    y = (x[:, 0] + x[:, 1] > 2).long() + (x[:, 2] > 1).long()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, None, tmp_path, global_batch=32, steps=steps, train_len=640,
                               optimizer='kind = "sgd"\nlr = 0.1\nmomentum = 0.9') + extra)
    return base, x, y, cfg


def test_batchnorm_equals_one_process_with_ghost_batch_norm(tmp_path):
    """Buffers on the shards, DDP's broadcast_buffers semantics: each worker's BatchNorm
    normalises over its own b_r = 16 samples, and every worker starts each step from rank 0's
    running statistics. One process doing the same (ghost batch norm, statistics from rank 0's
    sub-batches) with torch.optim ends within 1e-5 after 20 steps on every rank, parameters
    and buffers (num_batches_tracked exactly), and the shards' export (buffers from shard 0)
    loads with strict=True and holds the same."""
    base, x, y, cfg = bn_setup(tmp_path)
    models = [copy.deepcopy(base) for _ in range(2)]
    with Shards(cfg, 2, tmp_path) as shards:
        assert train(cfg, models, shards.addrs, x, y, overlap=True) == []
        assert shards.wait(60) == [0, 0]
    log = (tmp_path / "shard-0.log").read_text()
    assert "batch norm over b_r = [16, 16], ghost batch norm, not over 32" in log, log[-3000:]
    ref = ghost_batch_norm_reference(cfg, base, x, y, 20)
    assert int(ref.bn.num_batches_tracked) == 20
    for r, m in enumerate(models):
        assert_state_equal(m, ref, f"rank {r}")
    merged = Bn()
    merged.load_state_dict(launch_export(cfg, tmp_path), strict=True)
    assert_state_equal(merged, ref, "ps-launch --export")


def test_buffers_survive_a_lost_shard_0(tmp_path):
    """Shard 0, which holds the buffers, is killed after its checkpoint of version 10 and
    replaced: the cluster rolls back, the buffers come back from the checkpoint, and the run
    ends equal to one process (as above) after 30 steps."""
    base, x, y, cfg = bn_setup(
        tmp_path, steps=30,
        extra="\n[checkpoint]\nevery = 5\nkeep = 2\n\n[worker]\nconnect_timeout_secs = 60\n")
    models = [copy.deepcopy(base) for _ in range(2)]
    with Shards(cfg, 2, tmp_path) as shards:
        lose = lambda errors: lose_shard_after_checkpoint(shards, tmp_path, errors, shard=0)
        assert train(cfg, models, shards.addrs, x, y, during=lose) == []
        assert shards.wait(60) == [0, 0]
    log = (tmp_path / "shard-0.recover.log").read_text()
    assert "every shard rolls back to version" in log, log[-3000:]
    ref = ghost_batch_norm_reference(cfg, base, x, y, 30)
    for r, m in enumerate(models):
        assert_state_equal(m, ref, f"rank {r}")
