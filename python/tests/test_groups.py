"""Parameter groups (``[[optimizer.groups]]``: tensors by name pattern with their own lr
multiplier, weight decay and betas), applied by the shards: 2 workers against 2 shards (the
groups' tensors split across them) equal one process with torch.optim's param groups within
1e-5 after 20 steps, with SGD (momentum, weight decay off for biases, half the lr for one
layer) and Adam (other betas and weight decay for one layer). A pattern that matches nothing,
two groups sharing a tensor, or an lr multiplier <= 0 are refused when the config is read,
before any step."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ps
from common import Shards, config_text, max_rel_diff
from test_ddp import Mlp, data, run_ranks

STEPS = 20

SGD = '''kind = "sgd"
lr = 0.1
momentum = 0.9
weight_decay = 0.01

[[optimizer.groups]]
params = ["*.bias"]
weight_decay = 0.0

[[optimizer.groups]]
params = ["fc2.weight"]
lr_scale = 0.5
'''

ADAM = '''kind = "adam"
lr = 0.01
eps = 1e-6
weight_decay = 0.001

[[optimizer.groups]]
params = ["fc1.*"]
beta1 = 0.8
beta2 = 0.99
weight_decay = 0.1
'''


def torch_groups(kind, ref):
    p = dict(ref.named_parameters())
    if kind == "sgd":
        return torch.optim.SGD([
            {"params": [p["fc1.bias"], p["fc2.bias"]], "weight_decay": 0.0},
            {"params": [p["fc2.weight"]], "lr": 0.05},
            {"params": [p["fc1.weight"]]},
        ], lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam([
        {"params": [p["fc1.weight"], p["fc1.bias"]], "betas": (0.8, 0.99), "weight_decay": 0.1},
        {"params": [p["fc2.weight"], p["fc2.bias"]]},
    ], lr=0.01, eps=1e-6, weight_decay=0.001)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_parameter_groups_equal_torch_param_groups(tmp_path, kind):
    torch.manual_seed(3)
    base = Mlp()
    x, y = data()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, None, tmp_path, global_batch=32, steps=STEPS, train_len=640,
                               optimizer=SGD if kind == "sgd" else ADAM))
    models = [copy.deepcopy(base) for _ in range(2)]
    with Shards(cfg, 2, tmp_path) as shards:
        def go(r):
            w = ps.Worker(cfg, models[r], rank=r, servers=shards.addrs)
            for _, idx in w.batches():
                F.cross_entropy(models[r](x[idx]), y[idx]).backward()
                w.step()

        assert run_ranks(go) == []
        assert shards.wait(60) == [0, 0]
    log = (tmp_path / "shard-0.log").read_text()
    assert "group [" in log, log[-2000:]
    from ps import _native
    desc = [(k, list(p.shape)) for k, p in base.named_parameters()]
    plans = [_native.Client(str(cfg), desc, rank=r, servers=["x:1", "x:2"]) for r in range(2)]
    for p in plans:
        p.plan(len(x))
    ref = copy.deepcopy(base)
    opt = torch_groups(kind, ref)
    for t in range(STEPS):
        idx = torch.tensor([i for p in plans for i in p.batch(t)], dtype=torch.int64)
        opt.zero_grad()
        F.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()
    plain = copy.deepcopy(base)  # the groups matter: without them the run would differ
    for r, m in enumerate(models):
        diff, name = max_rel_diff(m, ref)
        print(f"{kind} with groups, rank {r} vs torch.optim param groups: {diff:.2e} ({name})")
        assert diff < 1e-5, (r, name, diff)
        assert max_rel_diff(m, plain)[0] > 1e-3


@pytest.mark.parametrize("groups, error", [
    ('[[optimizer.groups]]\nparams = ["*.bais"]\nweight_decay = 0.0\n',
     r'\[\[optimizer.groups\]\] 0 \(params = \["\*.bais"\]\): pattern "\*.bais" matches no tensor of the model'),
    ('[[optimizer.groups]]\nparams = ["*.bias"]\n\n[[optimizer.groups]]\nparams = ["fc1.*"]\n',
     r'\[\[optimizer.groups\]\] 1 \(params = \["fc1.\*"\]\): tensor "fc1.bias" is in group 0 too'),
    ('[[optimizer.groups]]\nparams = ["fc1.*"]\nlr_scale = 0.0\n',
     r"lr_scale = 0: expected a positive number"),
    ('[[optimizer.groups]]\nparams = ["fc1.*"]\nbeta1 = 0.5\n',
     r"beta1/beta2 are Adam settings; the optimizer is SGD"),
])
def test_bad_groups_are_refused_before_any_step(tmp_path, groups, error):
    base = Mlp()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, None, tmp_path, train_len=640,
                               optimizer='kind = "sgd"\nlr = 0.1\n\n' + groups))
    with pytest.raises(ValueError, match=error):
        ps.Worker(cfg, base, rank=0)
