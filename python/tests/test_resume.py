"""Checkpoints and --resume with a declared model and Python workers: a run of 12 steps
(checkpoints every 5), resumed by fresh shards with --resume and fresh Python workers up to
20 steps, ends with the same weights, bit for bit, as 20 steps without interruption."""

import copy
import threading

import ps
import pytest
import torch

from common import REPO, Shards, SmallCNN, config_text, load, train_rank

DATA = REPO / "data" / "mnist"

CHECKPOINTS = "\n[checkpoint]\nevery = 5\nkeep = 2\n"


@pytest.fixture(scope="module")
def mnist():
    torch.set_num_threads(1)
    return load(DATA, "train")


def run(out, base, x, y, steps, extra_args=()):
    """Trains `base`'s copy with 2 Python workers against 2 shards (SGD with momentum, so the
    optimizer state must be restored too) for a run of `steps` steps; returns the models."""
    init = out / "init.safetensors"
    ps.save_init(base, init)
    cfg = out / "run.toml"
    cfg.write_text(config_text(init, DATA, out, steps=steps,
                               optimizer='kind = "sgd"\nlr = 0.05\nmomentum = 0.9') + CHECKPOINTS)
    models = [copy.deepcopy(base) for _ in range(2)]
    errors = []
    with Shards(cfg, 2, out, extra_args=extra_args) as shards:
        workers = [ps.Worker(cfg, m, rank=r, servers=shards.addrs) for r, m in enumerate(models)]

        def go(r):
            try:
                train_rank(workers[r], models[r], x, y, "mean")
            except BaseException as e:  # reported below, with the rank
                errors.append((r, e))

        threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert shards.wait(60) == [0, 0]
    return models, workers


def test_a_resumed_run_of_python_workers_equals_an_uninterrupted_one(tmp_path, mnist):
    x, y = mnist
    torch.manual_seed(5)
    base = SmallCNN()
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    straight, _ = run(straight_dir, base, x, y, 20)

    out = tmp_path / "resumed"
    out.mkdir()
    run(out, base, x, y, 12)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == [f"shard-{s}-of-2-v{v:08d}.safetensors" for s in range(2) for v in (5, 10)]
    models, workers = run(out, base, x, y, 20, extra_args=("--resume",))
    assert workers[0].start_step == 10, workers[0].start_step
    assert "resuming at version 10" in (out / "shard-0.log").read_text()
    for m in models:
        for (n, a), (_, b) in zip(m.named_parameters(), straight[0].named_parameters()):
            assert torch.equal(a, b), f"{n}: resumed at 10 differs from the uninterrupted run"
