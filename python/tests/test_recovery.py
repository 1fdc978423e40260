"""A lost shard with Python workers: shard 1 is killed with SIGKILL mid-run and started again
with --recover on its address; the shards roll back to the newest checkpoint both have, the
Python workers wait for them, redo the steps from there, and the run ends with the same
weights, bit for bit, as a run that never lost a shard (also with rank 0 reading its batches
through a prefetching DataLoader over worker.sampler(), and with each step's pull beside the
next forward pass, overlap_pull)."""

import copy
import threading

import ps
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import REPO, Shards, lose_shard_after_checkpoint, SmallCNN, config_text, load, train_rank

DATA = REPO / "data" / "mnist"
STEPS = 120
CHECKPOINTS = "\n[checkpoint]\nevery = 5\nkeep = 2\n"


@pytest.fixture(scope="module")
def mnist():
    torch.set_num_threads(1)
    return load(DATA, "train")


def run(out, base, x, y, lose_shard: bool, overlap: bool):
    """Trains `base`'s copy with 2 Python workers against 2 shards (SGD with momentum: the
    optimizer state rolls back too); with `lose_shard`, kills shard 1 once both shards have
    checkpointed version 10 and starts its replacement. Returns the models and the version
    the replacement recovered at (None without a loss)."""
    init = out / "init.safetensors"
    ps.save_init(base, init)
    cfg = out / "run.toml"
    cfg.write_text(config_text(init, DATA, out, steps=STEPS,
                               optimizer='kind = "sgd"\nlr = 0.05\nmomentum = 0.9')
                   + CHECKPOINTS + "\n[worker]\nconnect_timeout_secs = 60\n")
    models = [copy.deepcopy(base) for _ in range(2)]
    errors = []
    with Shards(cfg, 2, out) as shards:
        # "pull": each step's pull beside the next forward pass (rank 1 pushing from backward)
        workers = [ps.Worker(cfg, m, rank=r, servers=shards.addrs, overlap_pull=overlap == "pull")
                   for r, m in enumerate(models)]

        def go(r):
            try:
                if overlap == "loader" and r == 0:
                    # the user's DataLoader, prefetching in 2 processes: after the rollback
                    # steps() starts it again from the step rolled back to
                    loader = DataLoader(TensorDataset(x, y), num_workers=2, prefetch_factor=4,
                                        batch_sampler=workers[r].sampler(len(x)))
                    for _, (xb, yb) in workers[r].steps(loader):
                        F.cross_entropy(models[r](xb), yb).backward()
                        workers[r].step()
                    return
                backward = overlap is True or overlap == "pull"
                train_rank(workers[r], models[r], x, y, "mean", overlap=backward and r == 1)
            except BaseException as e:  # reported below, with the rank
                errors.append((r, e))

        threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        if lose_shard:
            lose_shard_after_checkpoint(shards, out, errors)
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "a worker did not finish"
        assert not errors, errors
        assert shards.wait(60) == [0, 0]
    return models


@pytest.mark.parametrize("overlap", [False, True, "loader", "pull"],
                         ids=["step", "backward", "loader", "pull_overlapped"])
def test_python_workers_go_on_bit_identical_after_a_lost_shard(tmp_path, mnist, overlap, caplog):
    x, y = mnist
    torch.manual_seed(11)
    base = SmallCNN()
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    straight = run(straight_dir, base, x, y, lose_shard=False, overlap=overlap)

    out = tmp_path / "lost"
    out.mkdir()
    with caplog.at_level("WARNING", logger="ps"):
        models = run(out, base, x, y, lose_shard=True, overlap=overlap)
    log = (out / "shard-1.recover.log").read_text()
    assert "every shard rolls back to version" in log, log[-3000:]
    log0 = (out / "shard-0.log").read_text()
    assert "shard 1 was lost: rolling back from version" in log0, log0[-3000:]
    said = [r.getMessage() for r in caplog.records if r.name == "ps"]
    for r in range(2):
        assert any(m.startswith(f"worker {r}: a shard was lost") and
                   "the cluster rolled back to version" in m for m in said), said
    for m in models:
        for (n, a), (_, b) in zip(m.named_parameters(), straight[0].named_parameters()):
            assert torch.equal(a, b), f"{n}: the run that lost shard 1 differs from the straight one"
