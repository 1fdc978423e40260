"""Parameters a step's backward does not reach, exactly as torch.optim treats a `.grad` of
None: a model routes each sample to one of six heads by a category in its input, so in some
steps a head gets no sample on any worker (torch.optim skips it: no momentum, no weight
decay, no Adam step count) and in others on one worker only (the other pushes zeros). The
cluster equals single-process torch on the union batch. And a worker that raises tells the
shards at once: the other worker stops with its reason, not at the barrier timeout."""

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ps
from ps import _native
from common import REPO, Shards, lose_shard_after_checkpoint, config_text, max_rel_diff, run_ranks

STEPS = 20
HEADS = 6
FEATURES = 12
# category probabilities: the last heads are missing from many global batches of 8
PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01])


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(FEATURES, 16)
        self.heads = nn.ModuleList(nn.Linear(16, 3) for _ in range(HEADS))

    def forward(self, x):
        cat = x[:, -1].long()
        h = torch.tanh(self.trunk(x))
        out = torch.zeros(len(x), 3)
        for k in range(HEADS):
            m = cat == k
            if m.any():  # a data-dependent branch: the head's backward runs only if used
                out = out.index_put((m.nonzero()[:, 0],), self.heads[k](h[m]))
        return out


def data(n=800, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    x[:, -1] = torch.multinomial(PROBS, n, replacement=True, generator=g).float()
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    return x, y


OPTIMIZERS = {
    "sgd_momentum_weight_decay": (
        'kind = "sgd"\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.01',
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    "adam": (
        'kind = "adam"\nlr = 0.01\neps = 1e-6\nweight_decay = 0.01',
        lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-6, weight_decay=0.01),
    ),
}


def write_config(tmp_path, base, optimizer, **keys):
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, None, tmp_path, global_batch=8, steps=STEPS,
                               optimizer=optimizer, train_len=800, **keys))
    return cfg


def planners(cfg, base, n):
    desc = [(k, list(p.shape)) for k, p in base.named_parameters()]
    ps_ = [_native.Client(str(cfg), desc, rank=r, servers=["x:1", "x:2"]) for r in range(2)]
    for p in ps_:
        p.plan(n)
    return ps_


@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_unreached_parameters_are_updated_as_torch_optim_does(case, tmp_path):
    optimizer, make_opt = OPTIMIZERS[case]
    torch.manual_seed(1)
    base = Routed()
    x, y = data()
    cfg = write_config(tmp_path, base, optimizer)
    # the test means something: some head is reached by no worker in some step, and by one
    # worker only in another
    plan = planners(cfg, base, len(x))
    none_reached = one_reached = 0
    for t in range(STEPS):
        cats = [set(x[torch.tensor(p.batch(t)), -1].long().tolist()) for p in plan]
        none_reached += sum(k not in cats[0] | cats[1] for k in range(HEADS))
        one_reached += sum((k in cats[0]) != (k in cats[1]) for k in range(HEADS))
    assert none_reached > 5 and one_reached > 5, (none_reached, one_reached)

    models = [copy.deepcopy(base) for _ in range(2)]
    with Shards(cfg, 2, tmp_path) as shards:
        def go(r):
            w = ps.Worker(cfg, models[r], rank=r, servers=shards.addrs)
            for _, idx in w.batches():
                loss = F.cross_entropy(models[r](x[idx]), y[idx])
                if r == 1:  # both paths: rank 1 pushes while backward runs
                    w.backward(loss)
                else:
                    loss.backward()
                    w.step(loss_sum=loss.item() * len(idx))

        run_ranks(go)
        assert shards.wait(60) == [0, 0]

    ref = copy.deepcopy(base)
    opt = make_opt(ref.parameters())
    for t in range(STEPS):
        idx = torch.tensor(sum((p.batch(t) for p in plan), []), dtype=torch.int64)
        opt.zero_grad()  # set_to_none: an unreached head's .grad stays None, and is skipped
        F.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()
    moved, _ = max_rel_diff(ref, base)
    assert moved > 1e-3, moved
    for r, m in enumerate(models):
        diff, name = max_rel_diff(m, ref)
        print(f"{case}: rank {r} vs torch.optim {diff:.2e} ({name})")
        assert diff < 1e-5, (case, r, diff, name)


def test_a_worker_that_raises_ends_the_run_at_once(tmp_path):
    """Rank 1 raises in its loop at step 3; the barrier timeout is 600 s, yet rank 0 stops
    with an error naming rank 1 and its step, and the shards end (exit code 1)."""
    torch.manual_seed(1)
    base = Routed()
    x, y = data()
    cfg = write_config(tmp_path, base, 'kind = "sgd"\nlr = 0.1')
    cfg.write_text(cfg.read_text().replace("[server]\n", "[server]\nbarrier_timeout_secs = 600\n"))
    models = [copy.deepcopy(base) for _ in range(2)]
    errors = {}
    with Shards(cfg, 2, tmp_path) as shards:
        def go(r):
            try:
                w = ps.Worker(cfg, models[r], rank=r, servers=shards.addrs)
                for t, idx in w.batches():
                    if r == 1 and t == 3:
                        raise ValueError("the user's bug")
                    F.cross_entropy(models[r](x[idx]), y[idx]).backward()
                    w.step()
            except BaseException as e:  # checked below, with the rank
                errors[r] = e

        threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a worker still waits"
        codes = shards.wait(60)
    assert isinstance(errors.get(1), ValueError), errors
    assert "rank 1 stopped on an error at version 3: its training loop was left before the " \
        "run's end" in str(errors.get(0)), errors
    assert codes[0] != 0 and codes[1] != 0, codes


def test_a_lost_shard_under_adam_with_skipped_heads_ends_bit_identical(tmp_path):
    """Adam with heads skipped in some steps (their own step counts, checkpointed with the
    optimizer state): shard 1 is killed once both shards checkpointed version 10 and
    recovered; the shards roll back and the run ends bit for bit as one that lost nothing."""
    
    torch.manual_seed(1)
    base = Routed()
    x, y = data()

    def run(out, lose):
        out.mkdir()
        init = out / "init.safetensors"
        ps.save_init(base, init)
        cfg = out / "run.toml"
        cfg.write_text(config_text(init, None, out, global_batch=8, steps=150, train_len=800,
                                   optimizer=OPTIMIZERS["adam"][0])
                       + "\n[checkpoint]\nevery = 5\nkeep = 2\n"
                       + "\n[worker]\nconnect_timeout_secs = 60\n")
        models = [copy.deepcopy(base) for _ in range(2)]
        errors = []
        with Shards(cfg, 2, out) as shards:
            def go(r):
                try:
                    w = ps.Worker(cfg, models[r], rank=r, servers=shards.addrs)
                    for _, idx in w.batches():
                        loss = F.cross_entropy(models[r](x[idx]), y[idx])
                        if r == 1:
                            w.backward(loss)
                        else:
                            loss.backward()
                            w.step()
                except BaseException as e:  # reported below, with the rank
                    errors.append((r, e))

            threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            if lose:
                lose_shard_after_checkpoint(shards, out, errors)
            for t in threads:
                t.join(180)
            assert not any(t.is_alive() for t in threads), "a worker did not finish"
            assert not errors, errors
            assert shards.wait(60) == [0, 0]
        return models

    straight = run(tmp_path / "straight", False)
    lost = run(tmp_path / "lost", True)
    log = (tmp_path / "lost" / "shard-1.recover.log").read_text()
    assert "every shard rolls back to version" in log, log[-3000:]
    for m in lost:
        for (n, a), (_, b) in zip(m.named_parameters(), straight[0].named_parameters()):
            assert torch.equal(a, b), f"{n}: the run that lost shard 1 differs from the straight one"
