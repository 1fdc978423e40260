"""Global gradient-norm clipping (``[optimizer] clip_norm``), applied by the shards to the
aggregated gradient over the whole model: 3 workers against 2 shards (a tensor split across
them, so the global norm needs both shards' sums) equal one process that calls
``torch.nn.utils.clip_grad_norm_(params, max_norm)`` before ``opt.step()`` within 1e-5 after 20
steps, with SGD (momentum) and Adam, at a max norm that clips most steps (counted on both
sides: shard 0's metrics say which steps it clipped). The model holds a layer its forward
never uses: its ``grad`` is None in torch, so it does not count in the norm and is not
updated. A clip norm <= 0 or not finite is refused when the config is read, before any
step."""

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ps
from common import Shards, config_text, max_rel_diff
from test_ddp import data, run_ranks

STEPS = 20
WORKERS = 3
MAX_NORM = 0.3

OPTIMIZERS = {
    "sgd": ('kind = "sgd"\nlr = 0.2\nmomentum = 0.9',
            lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9)),
    "adam": ('kind = "adam"\nlr = 0.01\neps = 1e-6',
             lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-6)),
}


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.spare = nn.Linear(12, 3)  # never used: grad None
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def torch_run(base, x, y, plans, make_opt, max_norm):
    """One process on the same global batches; returns the model and the steps it clipped."""
    ref = copy.deepcopy(base)
    opt = make_opt(ref.parameters())
    clipped = []
    for t in range(STEPS):
        idx = torch.tensor([i for p in plans for i in p.batch(t)], dtype=torch.int64)
        opt.zero_grad()
        F.cross_entropy(ref(x[idx]), y[idx]).backward()
        if max_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            if total > max_norm:
                clipped.append(t)
        opt.step()
    return ref, clipped


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_clipping_equals_torch_clip_grad_norm(tmp_path, kind):
    torch.manual_seed(3)
    base = Mlp()
    x, y = data()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    text = config_text(init, None, tmp_path, workers=WORKERS, global_batch=48, steps=STEPS,
                       train_len=len(x), optimizer=OPTIMIZERS[kind][0] + f"\nclip_norm = {MAX_NORM}")
    cfg.write_text(text.replace("log_every = 10", "log_every = 1"))
    models = [copy.deepcopy(base) for _ in range(WORKERS)]
    with Shards(cfg, 2, tmp_path) as shards:
        def go(r):
            w = ps.Worker(cfg, models[r], rank=r, servers=shards.addrs)
            for _, idx in w.batches():
                F.cross_entropy(models[r](x[idx]), y[idx]).backward()
                w.step()

        assert run_ranks(go, WORKERS) == []
        assert shards.wait(60) == [0, 0]
    log = (tmp_path / "shard-0.log").read_text()
    assert "clip_grad_norm_(params, max_norm = 0.3)" in log, log[-3000:]
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    coefs = [l["clip_coef"] for l in lines if "clip_coef" in l]
    assert len(coefs) == STEPS, lines
    cluster_clipped = [t for t, c in enumerate(coefs) if c < 1.0]

    from ps import _native
    desc = [(k, list(p.shape)) for k, p in base.named_parameters()]
    plans = [_native.Client(str(cfg), desc, rank=r, servers=["x:1", "x:2"])
             for r in range(WORKERS)]
    for p in plans:
        p.plan(len(x))
    ref, clipped = torch_run(base, x, y, plans, OPTIMIZERS[kind][1], MAX_NORM)
    plain, _ = torch_run(base, x, y, plans, OPTIMIZERS[kind][1], None)
    print(f"{kind}: torch clipped {len(clipped)} of {STEPS} steps, the shards {len(cluster_clipped)}")
    assert cluster_clipped == clipped
    assert len(clipped) >= 15, clipped
    for r, m in enumerate(models):
        diff, name = max_rel_diff(m, ref)
        print(f"{kind} clipped, rank {r} vs torch clip_grad_norm_: {diff:.2e} ({name})")
        assert diff < 1e-5, (r, name, diff)
        assert max_rel_diff(m, plain)[0] > 1e-3, "clipping changed the run"
        assert torch.equal(m.spare.weight, base.spare.weight), "an unused layer is not updated"


@pytest.mark.parametrize("value", ["0.0", "-1.0", "nan", "inf"])
def test_bad_clip_norms_are_refused_before_any_step(tmp_path, value):
    base = Mlp()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, None, tmp_path, train_len=640,
                               optimizer=f'kind = "sgd"\nlr = 0.1\nclip_norm = {value}'))
    with pytest.raises(ValueError, match=r"\[optimizer\] clip_norm = .*expected a positive, finite number"):
        ps.Worker(cfg, base, rank=0)
