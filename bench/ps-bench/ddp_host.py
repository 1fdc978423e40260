"""PyTorch DDP (gloo) reference for bench/ps-bench/crosshost.sh: one process per rank, in the same
network namespaces as the cluster it is compared with, same MLP, batch per rank, plain SGD and
timing window (steps after the first `--skip`). One thread per process, as the cluster's
workers use on a machine with fewer cores than processes.

Usage (in the rank's namespace):
  python ddp_host.py --rank R --world W --master 10.78.0.1 --ifname eth0 --hidden 1024,1024
Rank 0 prints "ddp ms/step X busy-core-ms/step Y": the slowest rank's mean over the timed
steps, and the machine's busy CPU over them (/proc/stat, as crosshost.sh reads it for the
cluster: every process and the kernel's network work)."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--rank", type=int, required=True)
ap.add_argument("--world", type=int, required=True)
ap.add_argument("--master", required=True)
ap.add_argument("--port", type=int, default=29511)
ap.add_argument("--ifname", required=True)
ap.add_argument("--hidden", required=True, help="hidden widths, e.g. 1024,1024")
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--skip", type=int, default=20)
ap.add_argument("--threads", type=int, default=1)
a = ap.parse_args()

torch.set_num_threads(a.threads)
os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=a.world)
dims = [784] + [int(h) for h in a.hidden.split(",")] + [10]
torch.manual_seed(0)
layers = []
for i in range(len(dims) - 1):
    layers.append(nn.Linear(dims[i], dims[i + 1]))
    if i < len(dims) - 2:
        layers.append(nn.ReLU())
model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1000 * (a.rank + 1))
xs = torch.rand(16, a.batch, dims[0], generator=g)
ys = torch.randint(0, dims[-1], (16, a.batch), generator=g)


def busy_ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system irq softirq


def step(i):
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(xs[i % 16]), ys[i % 16]).backward()
    opt.step()


for i in range(a.skip):
    step(i)
dist.barrier()
c0 = busy_ticks()
t0 = time.perf_counter()
timed = max(a.steps - a.skip, 1)
for i in range(timed):
    step(i)
dist.barrier()
c1 = busy_ticks()
el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
dist.all_reduce(el, op=dist.ReduceOp.MAX)
if a.rank == 0:
    cpu = (c1 - c0) * 1e3 / os.sysconf("SC_CLK_TCK") / timed
    print(f"ddp ms/step {1e3 * el.item() / timed:.2f} busy-core-ms/step {cpu:.1f}", flush=True)
dist.destroy_process_group()
