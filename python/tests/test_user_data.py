"""The user's own data and evaluation: a declared model trained on data the user brings
([data] train_len, no IDX directory), evaluated on a test set of the user's choosing with any
split among the ranks (the shards sum what the workers report and never fail the run for it),
and fed through the user's own DataLoader with prefetching worker processes
(``worker.sampler()`` + ``worker.steps(loader)``), equal to single-process torch."""

import copy
import json
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ps
from ps import _native
from common import REPO, Shards, config_text, max_rel_diff

STEPS = 20
FEATURES, CLASSES = 16, 4


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 24)
        self.fc2 = nn.Linear(24, CLASSES)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def user_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x[:, :CLASSES].argmax(1) + (x[:, -1] > 1.5).long()) % CLASSES
    return x, y


def write_config(tmp_path, model, workers, **keys):
    init = tmp_path / "init.safetensors"
    ps.save_init(model, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, REPO / "data" / "mnist", tmp_path, workers=workers,
                               steps=STEPS, **keys))
    return cfg


def run_threads(n, body):
    errors = []

    def go(r):
        try:
            body(r)
        except BaseException as e:  # reported below, with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=go, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


# each rank's share of the user's test set of 1000 samples: not the shards' even split
OWN_SPLIT = [(0, 500), (500, 800), (800, 1000)]


@pytest.mark.parametrize("data", ["train_len", "idx_dir"])
def test_own_data_and_evaluation_of_any_length_finish_the_run(data, tmp_path):
    """3 workers of a declared model evaluate 500/300/200 samples of their own test set (the
    IDX test split would be 3334/3333/3333) every 5 steps and at the end: every rank and
    shard ends with 0, and the shards' final accuracy is the whole own test set's. With
    `train_len` the config names no IDX directory at all."""
    torch.manual_seed(0)
    base = Mlp()
    n = 600 if data == "train_len" else 60000  # the IDX directory's training set: MNIST's
    x, y = user_data(n, 1)
    tx, ty = user_data(1000, 2)
    keys = dict(train_len=n) if data == "train_len" else {}
    cfg = write_config(tmp_path, base, 3, global_batch=48, eval_every=5, **keys)
    if data == "train_len":
        assert "dir" not in cfg.read_text().split("[data]")[1].split("[train]")[0]
    models = [copy.deepcopy(base) for _ in range(3)]
    with Shards(cfg, 2, tmp_path) as shards:
        def body(r):
            lo, hi = OWN_SPLIT[r]

            def evaluate(m):
                return int((m(tx[lo:hi]).argmax(1) == ty[lo:hi]).sum()), hi - lo

            w = ps.Worker(cfg, models[r], rank=r, servers=shards.addrs, evaluate=evaluate)
            for _, idx in w.batches(None if data == "train_len" else n):
                loss = F.cross_entropy(models[r](x[idx]), y[idx])
                loss.backward()
                w.step(loss_sum=loss.item() * len(idx))

        run_threads(3, body)
        assert shards.wait(60) == [0, 0]
    correct = int((models[0](tx).argmax(1) == ty).sum())
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = [l for l in lines if l.get("final")]
    assert len(final) == 1 and abs(final[0]["test_acc"] - correct / 1000) < 1e-12, (final, correct)


def test_test_slice_is_the_shards_split(tmp_path):
    cfg = write_config(tmp_path, Mlp(), 3, train_len=600)
    slices = [ps.Worker(cfg, Mlp(), rank=r, servers=["x:1", "x:2"]).test_slice(10000)
              for r in range(3)]
    assert slices == [slice(0, 3334), slice(3334, 6667), slice(6667, 10000)]


def test_a_training_set_other_than_the_configs_is_refused_before_registering(tmp_path):
    cfg = write_config(tmp_path, Mlp(), 2, train_len=600)
    w = ps.Worker(cfg, Mlp(), rank=0, servers=["127.0.0.1:9", "127.0.0.1:9"])
    with pytest.raises(RuntimeError, match=r"a training set of 599 samples: .* says \[data\] train_len = 600"):
        next(w.batches(599))


def reference(base, cfg, x, y, workers):
    """One process, torch.optim, batch = the union of the workers' batches of each step."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    desc = [(n, list(p.shape)) for n, p in model.named_parameters()]
    planners = [_native.Client(str(cfg), desc, rank=r, servers=["x:1", "x:2"])
                for r in range(workers)]
    for p in planners:
        p.plan(len(x))
    for t in range(STEPS):
        idx = torch.tensor(sum((p.batch(t) for p in planners), []), dtype=torch.int64)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return model


def test_own_dataloader_with_prefetching_workers_equals_torch(tmp_path):
    """Each rank's DataLoader reads its batches in 2 worker processes, several steps ahead,
    pinned: the batches are the data-order contract's (checked against the indices), and the
    weights after 20 steps of momentum SGD equal one process's on the union batch."""
    torch.manual_seed(0)
    base = Mlp()
    x, y = user_data(640, 3)
    # the sample's index rides along, to check which samples each step got
    data = TensorDataset(x, y, torch.arange(len(x)))
    cfg = write_config(tmp_path, base, 2, global_batch=64, train_len=len(x),
                       optimizer='kind = "sgd"\nlr = 0.1\nmomentum = 0.9')
    models = [copy.deepcopy(base) for _ in range(2)]
    seen = [[], []]
    with Shards(cfg, 2, tmp_path) as shards:
        def body(r):
            w = ps.Worker(cfg, models[r], rank=r, servers=shards.addrs)
            loader = DataLoader(data, batch_sampler=w.sampler(), num_workers=2,
                                pin_memory=True, prefetch_factor=4)
            assert len(loader) == STEPS
            for step, (xb, yb, ib) in w.steps(loader):
                seen[r].append((step, ib.tolist(), w._native.batch(step)))
                loss = F.cross_entropy(models[r](xb), yb)
                loss.backward()
                w.step(loss_sum=loss.item() * len(yb))

        run_threads(2, body)
        assert shards.wait(60) == [0, 0]
    for r in range(2):
        assert [s for s, _, _ in seen[r]] == list(range(STEPS))
        assert all(got == want for _, got, want in seen[r]), r
    ref = reference(base, cfg, x, y, 2)
    moved, _ = max_rel_diff(ref, base)
    assert moved > 1e-3, moved
    for r, m in enumerate(models):
        diff, name = max_rel_diff(m, ref)
        print(f"DataLoader num_workers=2: rank {r} vs torch.optim {diff:.2e} ({name})")
        assert diff < 1e-5, (r, diff, name)
