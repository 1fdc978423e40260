"""Communication time per step (push + pull) of a Python worker (ps.Worker) against the Rust
worker (ps-worker) for the same model on the same host: a declared MLP 784-H-H-10, 1 worker,
2 shards on 127.0.0.1, each side a fresh cluster. The Rust worker's figures are those of its
final log line (push: the wait after backward, the pushes overlap it); the Python worker's those
of Worker.timing(), once with loss.backward() + Worker.step() (push: the whole push) and once
with Worker.backward(loss) (push: the wait after backward, as Rust). Not a test: run by hand, e.g.

    target/pyenv/bin/python python/bench/comm_bench.py --hidden 1024 --steps 200
"""

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import ps  # noqa: E402
from common import BIN, REPO, Shards, config_text, load  # noqa: E402


class MLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, h), nn.Linear(h, h), nn.Linear(h, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--hidden", type=int, default=1024)
    a.add_argument("--steps", type=int, default=200)
    a.add_argument("--batch", type=int, default=64)
    a.add_argument("--transport", default="auto", choices=["auto", "grpc"])
    a.add_argument("--sides", default="rust,python,python-overlap",
                   help="python: loss.backward() then Worker.step(); python-overlap: "
                   "Worker.backward(loss), whose pushes start while backward runs; "
                   "python-overlap-pull: the same with Worker(overlap_pull=True), the pull "
                   "beside the next forward pass (pull: the time forward waited for it)")
    args = a.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = REPO / "data" / "mnist"
    x, y = load(data, "train")
    model = MLP(args.hidden)
    n = sum(p.numel() for p in model.parameters())
    results = {}
    for side in args.sides.split(","):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            init = d / "init.safetensors"
            ps.save_init(model, init)
            cfg = d / "run.toml"
            text = config_text(init, data, d, workers=1, shards=2, global_batch=args.batch,
                               steps=args.steps, optimizer='kind = "sgd"\nlr = 0.01')
            text = text.replace("workers = 1", f'workers = 1\ntransport = "{args.transport}"')
            cfg.write_text(text)
            with Shards(cfg, 2, d) as shards:
                begun = time.time()
                if side == "rust":
                    out = subprocess.run(
                        [str(BIN / "ps-worker"), "--config", str(cfg), "--rank", "0",
                         "--servers", ",".join(shards.addrs)],
                        capture_output=True, text=True, check=True).stderr
                    m = re.search(r"per step pull ([\d.]+) ms, compute ([\d.]+) ms, push ([\d.]+) ms", out)
                    pull, compute, push = map(float, m.groups())
                else:
                    mm = MLP(args.hidden)
                    mm.load_state_dict(model.state_dict())
                    w = ps.Worker(cfg, mm, rank=0, servers=shards.addrs,
                                  overlap_pull=side == "python-overlap-pull")
                    for _, idx in w.batches(len(x)):
                        loss = F.cross_entropy(mm(x[idx]), y[idx])
                        if side.startswith("python-overlap"):
                            w.backward(loss)
                        else:
                            loss.backward()
                            w.step()
                    t = w.timing()
                    pull = 1e3 * t["pull_s"] / t["pulls"]
                    push = 1e3 * t["push_s"] / t["pushes"]
                    compute = float("nan")
                wall = time.time() - begun
                shards.wait(60)
            results[side] = (pull, push, compute, wall)
            print(f"{side:14}: {n:,} parameters, {args.steps} steps, transport {args.transport}: "
                  f"pull {pull:.2f} ms + push {push:.2f} ms = {pull + push:.2f} ms per step "
                  f"(wall {wall:.1f} s)", flush=True)
    r = results.get("rust")
    for side, p in results.items():
        if r and side != "rust":
            print(f"{side} / rust communication time per step: {(p[0] + p[1]) / (r[0] + r[1]):.2f}x")


if __name__ == "__main__":
    main()
