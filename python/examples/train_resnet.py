"""A small ResNet-style model with BatchNorm (a stem, three residual blocks, global average
pooling: 23,298 parameters, 9 BatchNorm layers) trained by one Python worker of a ps
cluster on Fashion-MNIST (or any IDX data set in the MNIST layout); start one per rank. From
`python/`, with `examples/run-resnet.toml` (python/README.md's `examples/run.toml` with this
model's init file, Fashion-MNIST and its own out_dir): the init file, the shards, the workers:

    python examples/train_resnet.py --data ../data/fashion-mnist --write-init examples/resnet-init.safetensors
    ps-server --config examples/run-resnet.toml --shard 0 &
    ps-server --config examples/run-resnet.toml --shard 1 &
    python examples/train_resnet.py --config examples/run-resnet.toml --rank 0 --data ../data/fashion-mnist &
    python examples/train_resnet.py --config examples/run-resnet.toml --rank 1 --data ../data/fashion-mnist

With 2 workers, global batch 64, 300 steps, SGD lr 0.05 with momentum 0.9 it reaches 73.5%
test accuracy on Fashion-MNIST (`python/tests/test_cnn.py` runs exactly that, copied out of
the repository, and asserts 70%).

The loop is the one a DDP script has (`ps.distributed`: forward through the wrapper,
`loss.backward()`, `opt_step()` where `optimizer.step()` was; the shards run the config's
optimizer); `--explicit` trains with the explicit API instead (`ps.Worker.batches()` and
`worker.step()`), the same numbers. BatchNorm follows DDP's broadcast_buffers: each worker
normalises over its own samples of a step, and every worker starts each step from rank 0's
running statistics, which the shards hold and checkpoint. `--export model.safetensors` writes
the whole state_dict at the end (loads with `load_state_dict(..., strict=True)`). The script
needs only the ps-torch package (`import ps_torch`, with torch and numpy): it runs from
anywhere (copy it out of the repository)."""

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ps_torch as ps


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN plus the shortcut (a strided 1x1 conv and BN when the shape
    changes), then ReLU."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.short is None else self.short(x)))


class SmallResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU())
        self.blocks = nn.Sequential(Block(8, 16, 2), Block(16, 16, 1), Block(16, 32, 2))
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean((2, 3)))


def load(data_dir: Path, split: str):
    """An IDX data set (MNIST layout, gzipped or not): float32 images [N, 1, 28, 28]
    normalised, and int64 labels [N]."""
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
    return (x - 0.5) / 0.5, torch.from_numpy(read("labels", 1).astype(np.int64))


def accuracy(model, x, y):
    """Correct predictions of `model` in evaluation mode (the running statistics)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                      for i in range(0, len(x), 1000))
    model.train(was)
    return correct


def main():
    a = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--config")
    a.add_argument("--rank", type=int)
    a.add_argument("--servers", help="shard addresses, comma-separated (default: the config's)")
    a.add_argument("--data", required=True, help="IDX data set directory (MNIST layout)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--explicit", action="store_true",
                   help="the explicit API (Worker.batches, worker.step) instead of ps.distributed")
    a.add_argument("--write-init", help="only write the model's initial state to this file")
    a.add_argument("--export", help="write the final state_dict here (safetensors)")
    a.add_argument("--result", help="write {\"test_acc\": ...} here at the end")
    args = a.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    net = SmallResNet()
    if args.write_init:
        ps.save_init(net, args.write_init)  # parameters and BatchNorm buffers
        return
    x, y = load(Path(args.data), "train")
    tx, ty = load(Path(args.data), "test")
    servers = args.servers.split(",") if args.servers else None

    def evaluate(m):  # this rank's share of the test set, for the shards' log
        part = m_worker().test_slice(len(tx))
        return accuracy(m, tx[part], ty[part]), len(tx[part])

    if args.explicit:
        worker = ps.Worker(args.config, net, rank=args.rank, servers=servers, evaluate=evaluate)
        m_worker = lambda: worker
        for _, idx in worker.batches(len(x)):
            out = net(x[idx])
            loss = F.cross_entropy(out, y[idx])
            loss.backward()
            worker.step(loss_sum=loss.item() * len(idx), correct=(out.argmax(1) == y[idx]).sum())
    else:
        model = ps.distributed(net, args.config, rank=args.rank, servers=servers,
                               evaluate=evaluate)
        m_worker = lambda: model.worker
        worker = model.worker
        for xb, yb in model.loader(TensorDataset(x, y)):
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            loss.backward()
            model.opt_step(loss, correct=(out.argmax(1) == yb).sum())
    acc = accuracy(net, tx, ty) / len(tx)
    print(f"rank {worker.rank}: {worker.total_steps} steps; test accuracy {100 * acc:.2f}%")
    if args.export:
        ps.export(net, args.export)
    if args.result:
        Path(args.result).write_text(json.dumps({"test_acc": acc}))


if __name__ == "__main__":
    main()
