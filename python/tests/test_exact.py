"""The exact-sum mode (``[train] exact_sum = true``) with a user's PyTorch model: torch computes
each micro-batch's gradient (``Worker.terms``), the worker adds it to an exact fixed-point sum
(``ps_net::exact`` through the extension) and pushes that partial sum; the shards add the
workers' sums and round once. With Adam and global clipping (which clips most steps here), W =
2, 3 and 4 (4: an uneven split, 2 + 2 + 1 + 1 micro-batches) against 2 shards give
the same weights in each shard's file (``shard-<i>.safetensors``: the same tensor bytes and
metadata; the header's key order is the writer's hash map's), and every worker ends with the
same weights, byte for byte. The
mode's refusals: ``backward()`` (a push overlapping backward) and ``step()`` without the
step's terms."""

import copy
import json
import struct

import pytest
import torch
import torch.nn.functional as F

import ps
from common import Shards, config_text
from test_clip import Mlp
from test_ddp import data, run_ranks

STEPS = 20
MAX_NORM = 0.3
ADAM = 'kind = "adam"\nlr = 0.01\neps = 1e-6'


def write_config(tmp_path, init, workers, n, name=None):
    out = tmp_path / (name or f"w{workers}")
    out.mkdir()
    cfg = out / "run.toml"
    text = config_text(init, None, out, workers=workers, global_batch=48, steps=STEPS,
                       train_len=n, optimizer=ADAM + f"\nclip_norm = {MAX_NORM}")
    text = text.replace('aggregation = "mean"',
                        'aggregation = "mean"\nexact_sum = true\nexact_micro_batch = 8')
    cfg.write_text(text.replace("log_every = 10", "log_every = 1"))
    return out, cfg


def weight_file(path):
    """A safetensors file's header (parsed) and its tensor bytes."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def run(tmp_path, base, x, y, workers):
    """One cluster of 2 shards and `workers` Python workers; returns the run's directory and
    the workers' final flat weights (bytes)."""
    init = tmp_path / "init.safetensors"
    if not init.exists():
        ps.save_init(base, init)
    out, cfg = write_config(tmp_path, init, workers, len(x))
    models = [copy.deepcopy(base) for _ in range(workers)]
    with Shards(cfg, 2, out) as shards:
        def go(r):
            w = ps.Worker(cfg, models[r], rank=r, servers=shards.addrs)
            for _, idx in w.batches():
                loss_sum = 0.0
                for xb, yb in w.terms((x[idx], y[idx])):
                    loss = F.cross_entropy(models[r](xb), yb)
                    loss.backward()
                    loss_sum += loss.item() * len(yb)
                w.step(loss_sum)

        assert run_ranks(go, workers) == []
        assert shards.wait(60) == [0, 0]
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy().tobytes()
            for m in models]
    return out, flat


def test_python_workers_give_the_same_bits_at_w_2_3_4_with_adam_and_clipping(tmp_path):
    torch.manual_seed(5)
    base = Mlp()
    x, y = data()
    files, weights = {}, {}
    for workers in (2, 3, 4):
        out, flat = run(tmp_path, base, x, y, workers)
        assert len(set(flat)) == 1, f"W = {workers}: the workers end with different weights"
        weights[workers] = flat[0]
        files[workers] = [weight_file(out / f"shard-{i}.safetensors") for i in range(2)]
        log = (out / "shard-0.log").read_text()
        assert "exact sum (exact_sum = true)" in log, log[-3000:]
        lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        coefs = [l["clip_coef"] for l in lines if "clip_coef" in l]
        assert len(coefs) == STEPS, lines
        assert sum(c < 1.0 for c in coefs) >= 10, coefs
    assert files[3] == files[2], "the shards' weight files differ between W = 2 and W = 3"
    assert files[4] == files[2], "the shards' weight files differ between W = 2 and W = 4"
    assert weights[3] == weights[2] and weights[4] == weights[2]
    assert len(files[2][0][1]) + len(files[2][1][1]) == len(weights[2]), "both shards' bytes"
    start = torch.cat([p.detach().reshape(-1) for p in base.parameters()]).numpy().tobytes()
    assert weights[2] != start, "the run trained"


def test_the_exact_mode_refuses_an_overlapped_push_and_a_step_without_terms(tmp_path):
    torch.manual_seed(5)
    base = Mlp()
    x, y = data()
    ps.save_init(base, tmp_path / "init.safetensors")
    init = tmp_path / "init.safetensors"
    model = copy.deepcopy(base)
    out, cfg = write_config(tmp_path, init, 1, len(x), "backward")
    with Shards(cfg, 2, out) as shards:
        w = ps.Worker(cfg, model, rank=0, servers=shards.addrs)
        with pytest.raises(ValueError, match=r"exact_sum = true pushes the exact sum of "
                                             r"micro-batch terms: use worker.terms"):
            for _, idx in w.batches():
                w.backward(F.cross_entropy(model(x[idx]), y[idx]))
    out, cfg = write_config(tmp_path, init, 1, len(x), "no-terms")
    with Shards(cfg, 2, out) as shards:
        w = ps.Worker(cfg, model, rank=0, servers=shards.addrs)
        with pytest.raises(RuntimeError, match=r"expected the step's terms first"):
            for _, idx in w.batches():
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                w.step()
