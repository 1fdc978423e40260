"""A small CNN (two conv layers with pooling, two linear layers) trained by one Python worker
of a ps cluster; start one per rank. From `python/`: the run's init file (the one `[model]
init` of `examples/run.toml` names) first, then, with the shards of `examples/run.toml`
running (python/README.md, step 3), the workers:

    python examples/train_cnn.py --data ../data/mnist --write-init examples/init.safetensors
    python examples/train_cnn.py --config examples/run.toml --rank 0 --data ../data/mnist &
    python examples/train_cnn.py --config examples/run.toml --rank 1 --data ../data/mnist

Each rank evaluates its share of the test set (`worker.test_slice`) for the shards' log; at
the end each rank prints the test accuracy of the final weights on the whole test set. The
script needs only the ps-torch package (`import ps_torch`, with torch and numpy): it runs from
anywhere (copy it out of the repository)."""

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ps_torch as ps


class SmallCNN(nn.Module):
    """Two conv layers with max pooling, then two linear layers (20,986 parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.fc1 = nn.Linear(16 * 5 * 5, 48)
        self.fc2 = nn.Linear(48, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load(data_dir: Path, split: str):
    """An IDX data set (MNIST layout, gzipped or not): float32 images [N, 1, 28, 28] in [0, 1]
    and int64 labels [N]."""
    prefix = "train" if split == "train" else "t10k"

    def read(kind, dims):
        for name in (f"{prefix}-{kind}-idx{dims}-ubyte.gz", f"{prefix}-{kind}-idx{dims}-ubyte"):
            path = data_dir / name
            if path.exists():
                data = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
                shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(data[3])]
                return np.frombuffer(data, np.uint8, offset=4 + 4 * data[3]).reshape(shape)
        raise FileNotFoundError(f"{data_dir}: no {prefix} {kind}")

    x = torch.from_numpy(read("images", 3).astype(np.float32) / 255.0).unsqueeze(1)
    return x, torch.from_numpy(read("labels", 1).astype(np.int64))


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
        part = worker.test_slice(len(tx))
        return accuracy(m, tx[part], ty[part]), len(tx[part])

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
