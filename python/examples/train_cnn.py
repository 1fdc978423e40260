"""A small CNN (two conv layers with pooling, two linear layers) trained by one Python worker
of a ps cluster; start one per rank. For example, with the shards of `run.toml` running:

    python examples/train_cnn.py --config run.toml --rank 0 --data ../data/mnist &
    python examples/train_cnn.py --config run.toml --rank 1 --data ../data/mnist

Write the run's init file first (`--write-init init.safetensors`, named by `[model] init`).
At the end each rank prints the test accuracy of the final weights on the whole test set."""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import ps  # noqa: E402
from common import SmallCNN, load  # noqa: E402


def accuracy(model, x, y):
    with torch.no_grad():
        return sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                   for i in range(0, len(x), 1000))


def main():
    a = argparse.ArgumentParser(description=__doc__)
    a.add_argument("--config")
    a.add_argument("--rank", type=int)
    a.add_argument("--servers", help="shard addresses, comma-separated (default: the config's)")
    a.add_argument("--data", required=True, help="IDX data set directory (MNIST layout)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--write-init", help="only write the model's initial weights to this file")
    a.add_argument("--result", help="write {\"test_acc\": ...} here at the end")
    args = a.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = SmallCNN()
    if args.write_init:
        ps.save_init(model, args.write_init)
        return
    x, y = load(Path(args.data), "train")
    tx, ty = load(Path(args.data), "test")
    servers = args.servers.split(",") if args.servers else None

    def evaluate(m):  # this rank's share of the test set, for the shards' log
        lo, hi = len(tx) * worker.rank // worker.world, len(tx) * (worker.rank + 1) // worker.world
        return accuracy(m, tx[lo:hi], ty[lo:hi]), hi - lo

    worker = ps.Worker(args.config, model, rank=args.rank, servers=servers, evaluate=evaluate)
    for _, idx in worker.batches(len(x)):
        out = model(x[idx])
        loss = F.cross_entropy(out, y[idx], reduction=worker.loss_reduction)
        loss.backward()
        n = len(idx) if worker.loss_reduction == "mean" else 1
        worker.step(loss_sum=loss.item() * n, correct=(out.argmax(1) == y[idx]).sum())
    acc = accuracy(model, tx, ty) / len(tx)
    t = worker.timing()
    print(f"rank {worker.rank}: {worker.total_steps} steps; test accuracy {100 * acc:.2f}%; "
          f"per step push {1e3 * t['push_s'] / max(t['pushes'], 1):.2f} ms, "
          f"pull {1e3 * t['pull_s'] / max(t['pulls'], 1):.2f} ms; tensors via {worker.transport()}")
    if args.result:
        Path(args.result).write_text(json.dumps({"test_acc": acc, **t}))


if __name__ == "__main__":
    main()
