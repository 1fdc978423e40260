#!/usr/bin/env python3
"""ResNet-18 (CIFAR variant) on one device: one plain PyTorch process at global batch B against
2 ps_torch workers + 2 ps-server shards at B / 2 each (issue 38, item 4). Not a test: a
benchmark that prints a table and writes JSON (--json); python/tests/test_resnet_bench.py runs
its cluster path at a tiny width so that it cannot rot.

The model: BasicBlock/ResNet-18 written here in plain torch.nn (no torchvision): 3x3 stem, no
max pooling, [2, 2, 2, 2] blocks of 64-128-256-512 channels (times --width), global average
pooling, 10 classes: 11,173,962 parameters at width 1. Its BatchNorm layers keep running
statistics (buffers), which ps_torch treats as DDP's broadcast_buffers (python/README.md,
"Buffers"): rank 0's buffers are the model's, each worker normalises over its own b_r samples
(ghost batch norm of size b_r, as DDP without SyncBatchNorm). The data: synthetic CIFAR-shaped
images and labels from a seeded generator.

What is measured, per step after --warmup steps, each step ended by a device synchronisation:
(a) one process: forward+backward on the global batch (plain batch norm over B), then
    torch.optim.SGD's step;
(b) the cluster: 2 worker processes (one per rank, as users run them) on the same device,
    each forward+backward on its B / 2 samples, then Worker.step(): the gradients leave the
    device by non-blocking copies into the page-locked push buffer, the push, the shards'
    barrier and SGD, the pull, the non-blocking upload of the new weights, and BatchNorm's
    buffers through shard 0. Split: compute (forward+backward, synchronised), communication
    (Worker.timing(): the push, and the pull including the wait for the other rank at the
    barrier and the shards' update) and rest (the step minus both: the gradients' device
    copies and their wait, the buffers' PutBuffers/GetBuffers, the weights' upload, Python).
Both sides alike: SGD lr 0.05, momentum 0.9, weight decay 5e-4 (the shards' optimizer in (b)),
cuDNN deterministic, TF32 off unless --tf32; on the CPU the single process has --threads
threads and each worker half of them.

The equivalence check (the promise is exactness): after --check-steps steps every rank's
parameters and buffers are compared with one process that computes exactly what the cluster
claims (mean loss, mean aggregation, equal splits: the mean of the ranks' mean losses, each
rank's B / 2 samples through the model on their own with its batch statistics, running
statistics from rank 0's samples, torch.optim.SGD), on the same device; tolerance 1e-5 (largest
relative difference per tensor; num_batches_tracked exactly). One process with plain batch norm
over B is not what the cluster computes: its distance is printed beside, for scale.

Run from the repository root (ps-server from $PS_BIN_DIR, default target/release):
    target/pyenv/bin/python python/bench/ps_torch_resnet.py --device cpu --width 0.125 --batch 8
On the GPU machine (scripts/gpu-session.sh):
    PS_BIN_DIR=.dev/gpu-bin PYTHONPATH=.dev/pypkg python3 python/bench/ps_torch_resnet.py \\
        --device cuda --steps 30 --timeout 70 --json "$OUT/ps-torch-resnet.json"
Exit status: 0 when the check passed, 1 when it failed or the cluster did not finish, 2 on
refused arguments or no device.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import ps_torch as ps  # noqa: E402
from ps_torch import _native  # noqa: E402
from common import Shards, config_text  # noqa: E402

WORLD = 2  # workers, and shards
TOLERANCE = 1e-5
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers and the identity, or a strided 1x1 conv-BN where the shape
    changes; ReLU after the sum."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 3x32x32 input: 3x3 stem, no max pooling, [2, 2, 2, 2] BasicBlocks of
    64-128-256-512 channels times ``width``, global average pooling, a linear classifier."""

    def __init__(self, width: float = 1.0, classes: int = 10):
        super().__init__()
        c = [max(1, round(64 * width * 2**i)) for i in range(4)]
        self.conv1 = nn.Conv2d(3, c[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c[0])
        layers, cin = [], c[0]
        for i, cout in enumerate(c):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.linear = nn.Linear(c[3], classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.linear(out.mean((2, 3)))


def synthetic(n: int, seed: int, device: torch.device):
    """``n`` CIFAR-shaped samples: images [n, 3, 32, 32] ~ N(0, 1), labels in 0..9."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x.to(device), y.to(device)


def setup_device(device: str, threads: int, tf32: bool = False) -> torch.device:
    """cuDNN deterministic, TF32 off unless ``tf32`` (every process alike); ``threads``
    intra-op CPU threads."""
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return torch.device(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- the worker process (one rank)

def worker_main(a) -> int:
    """One rank: trains against the shards, timing each step; writes its records (and its
    state after --check-steps steps) into --out-dir."""
    device = setup_device(a.device, a.threads, a.tf32)
    x, y = synthetic(a.train_len, a.seed, device)
    torch.manual_seed(a.seed)
    model = ResNet18(a.width).to(device)
    w = ps.Worker(a.config, model, rank=a.worker_rank, servers=a.servers.split(","))
    out = Path(a.out_dir)
    steps = []
    for t, idx in w.batches(a.train_len):
        sync(device)
        t0 = time.perf_counter()
        i = idx.to(device)
        loss = F.cross_entropy(model(x[i]), y[i])
        loss.backward()
        loss_sum = loss.item() * len(idx)
        sync(device)
        t1 = time.perf_counter()
        before = w.timing()
        w.step(loss_sum=loss_sum)
        sync(device)
        t2 = time.perf_counter()
        after = w.timing()
        steps.append({"step": t, "t0": t0, "step_s": t2 - t0, "compute_s": t1 - t0,
                      "push_s": after["push_s"] - before["push_s"],
                      "pull_s": after["pull_s"] - before["pull_s"]})
        if t + 1 == a.check_steps:
            torch.save(cpu_state(model), out / f"rank-{a.worker_rank}-state.pt")
    result = {"rank": w.rank, "steps": steps, "transport": w.transport(),
              "equivalence": str(w.equivalence), "timing": w.timing()}
    (out / f"rank-{a.worker_rank}.json").write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------- the single process

def plans(cfg: Path, model: nn.Module, train_len: int):
    """Each rank's sample indices of each step, from the run's data-order contract (the same
    batches the workers get): plan[r].batch(t)."""
    desc = [(k, list(p.shape)) for k, p in model.named_parameters()]
    out = [_native.Client(str(cfg), desc, rank=r, servers=["x:1", "x:2"]) for r in range(WORLD)]
    for p in out:
        p.plan(train_len)
    return out


def rank_batch(plan, t: int) -> torch.Tensor:
    return torch.tensor(plan.batch(t), dtype=torch.int64)


def single_process(a, base: nn.Module, x, y, plan, device: torch.device):
    """(a): one process, the union of the ranks' batches of each step (plain batch norm over
    B), torch.optim.SGD; per-step records, and the state after --check-steps steps."""
    model = copy.deepcopy(base).to(device)
    opt = sgd(model.parameters())
    steps, state = [], None
    for t in range(a.warmup + a.steps):
        idx = torch.cat([rank_batch(p, t) for p in plan])
        sync(device)
        t0 = time.perf_counter()
        i = idx.to(device)
        F.cross_entropy(model(x[i]), y[i]).backward()
        sync(device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        steps.append({"step": t, "t0": t0, "step_s": time.perf_counter() - t0,
                      "compute_s": t1 - t0})
        if t + 1 == a.check_steps:
            state = cpu_state(model)
    return steps, state


def ghost_reference(a, base: nn.Module, x, y, plan, device: torch.device):
    """What the cluster computes, in one process: each rank's samples of a step through the
    model on their own (ghost batch norm of b_r), the loss the mean of the ranks' mean
    losses, the running statistics from rank 0's samples (the others run on copies of the
    step's buffers, dropped after), torch.optim.SGD. The state after --check-steps steps."""
    ref = copy.deepcopy(base).to(device)
    opt = sgd(ref.parameters())
    mods = [m for m in ref.modules() if m._buffers]
    for t in range(a.check_steps):
        opt.zero_grad(set_to_none=True)
        start = [{k: b.clone() for k, b in m._buffers.items()} for m in mods]
        losses, kept = [], None
        for r, p in enumerate(plan):
            if r > 0:  # new tensors, not in place: rank 0's graph keeps its own
                for m, s in zip(mods, start):
                    m._buffers.update({k: b.clone() for k, b in s.items()})
            i = rank_batch(p, t).to(device)
            losses.append(F.cross_entropy(ref(x[i]), y[i]))
            if r == 0:
                kept = [dict(m._buffers) for m in mods]
        for m, k in zip(mods, kept):
            m._buffers.update(k)
        (sum(losses) / len(losses)).backward()
        opt.step()
    return cpu_state(ref)


def state_diff(got: dict, ref: dict) -> tuple[float, str, list[str]]:
    """(largest over float tensors of max |got - ref| / max |ref|, that tensor's name, the
    integer tensors that differ at all)."""
    worst, where, ints = 0.0, "", []
    for k, b in ref.items():
        g = got[k]
        if not b.is_floating_point():
            if not torch.equal(g, b):
                ints.append(k)
            continue
        d = ((g.double() - b.double()).abs().max() / max(b.double().abs().max().item(), 1e-300))
        if d.item() >= worst:
            worst, where = d.item(), k
    return worst, where, ints


# ---------------------------------------------------------------- the cluster

def write_config(a, tmp: Path, base: nn.Module) -> Path:
    init = tmp / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp / "run.toml"
    text = config_text(init, None, tmp, workers=WORLD, shards=WORLD,
                       global_batch=WORLD * a.batch, steps=a.warmup + a.steps,
                       train_len=a.train_len,
                       optimizer=f'kind = "sgd"\nlr = {LR}\nmomentum = {MOMENTUM}\n'
                                 f'weight_decay = {WEIGHT_DECAY}')
    # [server] is config_text's last section: bounded waits on the shards' side too
    bound = int(a.timeout)
    text += (f"barrier_timeout_secs = {bound}\npull_timeout_secs = {bound}\n\n"
             f"[worker]\nconnect_timeout_secs = {min(bound, 60)}\n")
    cfg.write_text(text)
    return cfg


def run_cluster(a, tmp: Path, cfg: Path) -> list[dict]:
    """(b): 2 shards (ps-server processes) and 2 worker processes (this script with
    --worker-rank); waits for each at most --timeout seconds in all. Returns the ranks'
    records; raises naming the rank or shard that did not finish, with its log's tail."""
    begun = time.monotonic()
    left = lambda: max(1.0, a.timeout - (time.monotonic() - begun))  # noqa: E731
    with Shards(cfg, WORLD, tmp, timeout=min(a.timeout, 60)) as shards:
        procs, logs = [], []
        for r in range(WORLD):
            log = tmp / f"worker-{r}.log"
            logs.append(log)
            args = [sys.executable, str(Path(__file__).resolve()), "--worker-rank", str(r),
                    "--config", str(cfg), "--servers", ",".join(shards.addrs),
                    "--out-dir", str(tmp), "--threads", str(worker_threads(a)),
                    *passed_on(a)]
            with open(log, "w") as f:
                procs.append(subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT))
        try:
            for r, p in enumerate(procs):
                try:
                    code = p.wait(left())
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"rank {r} did not finish its {a.warmup + a.steps} steps "
                                       f"within --timeout {a.timeout:.0f} s; its log ends: "
                                       f"{tail(logs[r])}") from None
                if code != 0:
                    raise RuntimeError(f"rank {r} exited with {code}; its log ends: "
                                       f"{tail(logs[r])}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        codes = shards.wait(min(left(), 60))
        if codes != [0] * WORLD:
            raise RuntimeError(f"the shards exited with {codes} (a shard not done within "
                               f"{min(left(), 60):.0f} s is killed); shard 0's log ends: "
                               f"{tail(tmp / 'shard-0.log')}")
    return [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def worker_threads(a) -> int:
    """Each worker's CPU threads: half the single process's (at least one)."""
    return max(1, a.threads // WORLD)


def passed_on(a) -> list[str]:
    """The arguments a worker process shares with this one."""
    return ["--device", a.device, "--width", str(a.width), "--batch", str(a.batch),
            "--steps", str(a.steps), "--warmup", str(a.warmup), "--check-steps",
            str(a.check_steps), "--seed", str(a.seed), "--train-len", str(a.train_len),
            *(["--tf32"] if a.tf32 else [])]


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text()[-n:] or "(empty: nothing printed yet)"
    except OSError as e:
        return f"(unreadable: {e})"


# ---------------------------------------------------------------- figures and the report

def bandwidths(n: int, device: torch.device) -> dict[str, float]:
    """GB/s of copying ``n`` float32 values, measured here (median of 5 after one): on the
    host (numpy, one thread), and on CUDA device to page-locked host and back."""
    def median_s(f, done=lambda: None):
        times = []
        for k in range(6):
            t0 = time.perf_counter()
            f()
            done()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    nbytes = 4 * n
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    out = {"host_copy_gbps": nbytes / median_s(lambda: np.copyto(dst, src)) / 1e9}
    if device.type == "cuda":
        g = torch.ones(n, device=device)
        pinned = torch.empty(n, pin_memory=True)
        done = lambda: sync(device)  # noqa: E731
        out["d2h_pinned_gbps"] = nbytes / median_s(
            lambda: pinned.copy_(g, non_blocking=True), done) / 1e9
        out["h2d_pinned_gbps"] = nbytes / median_s(
            lambda: g.copy_(pinned, non_blocking=True), done) / 1e9
    return out


def figures(records: list[dict], warmup: int) -> dict[str, float]:
    """Milliseconds per step over the timed steps (after warm-up): the mean of each component
    (they add up to the mean step: the split), the median step, and the timed window's wall
    time per step."""
    timed = [r for r in records if r["step"] >= warmup]
    ms = lambda f: 1e3 * sum(f(r) for r in timed) / len(timed)  # noqa: E731
    out = {"step_ms": ms(lambda r: r["step_s"]), "compute_ms": ms(lambda r: r["compute_s"]),
           "step_ms_median": 1e3 * statistics.median(r["step_s"] for r in timed),
           # the window's wall time per step: the steps and what runs between them
           "wall_ms_per_step": 1e3 * (timed[-1]["t0"] + timed[-1]["step_s"] - timed[0]["t0"])
           / len(timed),
           "timed_steps": len(timed)}
    if "push_s" in timed[0]:
        out["push_ms"], out["pull_ms"] = ms(lambda r: r["push_s"]), ms(lambda r: r["pull_s"])
        out["comm_ms"] = out["push_ms"] + out["pull_ms"]
        out["rest_ms"] = out["step_ms"] - out["compute_ms"] - out["comm_ms"]
    else:
        out["optimizer_ms"] = out["step_ms"] - out["compute_ms"]
    return out


def shard_figures(tmp: Path, warmup: int) -> dict[str, float]:
    """Shard 0's own figures (its metrics.jsonl) over the timed steps, in ms per step (means):
    ``apply_ms`` (its update, from the barrier's completion), ``tail_ms`` (the last gradient's
    arrival to the new version, when it updates bucket by bucket), ``barrier_wait_ms``."""
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()
            if '"step_ms"' in line]
    rows = [r for r in rows if r["step"] > warmup]  # its step t + 1 is the workers' step t
    out = {"steps": len(rows)}
    for k in ("apply_ms", "tail_ms", "barrier_wait_ms", "step_ms"):
        got = [r[k] for r in rows if k in r]
        if got:
            out[k] = sum(got) / len(got)
    return out


def bound(single: dict, cluster: dict, n: int, bw: dict, shard0: dict) -> dict:
    """What the cluster's step is made of, each part against a limit measured in this run."""
    both_ways = 8 * n  # bytes per worker per step: the gradient pushed, the weights pulled
    apply_ms = shard0.get("apply_ms", float("nan"))
    step = cluster["step_ms"]
    floor_host = 1e3 * both_ways / (bw["host_copy_gbps"] * 1e9)
    parts = {
        "compute": f"forward+backward {cluster['compute_ms']:.2f} ms per worker (both workers "
                   f"on one device) = {cluster['compute_ms'] / single['compute_ms']:.2f}x the "
                   f"single process's on the whole batch ({single['compute_ms']:.2f} ms)",
        "communication": f"push {cluster['push_ms']:.2f} + pull {cluster['pull_ms']:.2f} ms "
                         f"(the pull includes the barrier wait for the other rank and the "
                         f"shards' SGD: shard 0's update {apply_ms:.2f} ms "
                         f"from the barrier) for {both_ways / 1e6:.1f} MB per worker both ways = "
                         f"{both_ways / (cluster['comm_ms'] / 1e3) / 1e9:.2f} GB/s; one host "
                         f"copy of those bytes at {bw['host_copy_gbps']:.1f} GB/s (measured "
                         f"here) takes {floor_host:.2f} ms",
        "rest": f"{cluster['rest_ms']:.2f} ms: BatchNorm buffers through shard 0, Python, "
                + ("the gradients' copies off the device and their wait, the weights' upload"
                   if "d2h_pinned_gbps" in bw else "the gradients read in place"),
    }
    out = {"bytes_per_worker_per_step_each_way": 4 * n,
           "bytes_per_worker_per_step_both_ways": both_ways,
           "comm_gbps_effective": both_ways / (cluster["comm_ms"] / 1e3) / 1e9,
           "host_copy_floor_ms": floor_host}
    if "d2h_pinned_gbps" in bw:
        dev_floor = 1e3 * 4 * n * (1 / bw["d2h_pinned_gbps"] + 1 / bw["h2d_pinned_gbps"]) / 1e9
        out["device_copy_floor_ms"] = dev_floor
        parts["rest"] += (f"; the gradients down and the weights up at the pinned-copy rates "
                          f"measured here take {dev_floor:.2f} ms")
    shares = {k: cluster[k + "_ms"] / step for k in ("compute", "comm", "rest")}
    largest = max(shares, key=shares.get)
    out["shares"] = shares
    out["parts"] = parts
    out["bound_by"] = {"compute": "compute", "comm": "communication", "rest": "rest"}[largest]
    return out


def equivalence(a, tmp: Path, ghost: dict, plain: dict, statement: str) -> dict:
    """Every rank's state after --check-steps steps against the ghost-batch-norm reference
    (the promise) and, for scale, against plain batch norm over B (not the promise)."""
    states = [torch.load(tmp / f"rank-{r}-state.pt") for r in range(WORLD)]
    ranks = []
    for r, s in enumerate(states):
        diff, where, ints = state_diff(s, ghost)
        plain_diff, plain_where, _ = state_diff(s, plain)
        ranks.append({"rank": r, "max_rel_diff": diff, "in": where, "int_buffers_differing": ints,
                      "vs_plain_batch_norm": plain_diff, "vs_plain_in": plain_where})
    identical = all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])
    ok = identical and all(r["max_rel_diff"] < TOLERANCE and not r["int_buffers_differing"]
                           for r in ranks)
    return {"check_steps": a.check_steps, "tolerance": TOLERANCE, "pass": ok,
            "ranks_identical": identical, "ranks": ranks, "statement": statement,
            "reference": "one process: each rank's samples through the model on their own "
                         "(ghost batch norm of b_r), mean of the ranks' mean losses, running "
                         "statistics from rank 0's samples, torch.optim.SGD, same device"}


def report(res: dict) -> None:
    s, c, b, e = res["single"], res["cluster"], res["bound"], res["equivalence"]
    print(f"\nResNet-18 (CIFAR variant, width {res['width']}: {res['params']:,} parameters, "
          f"{res['buffers']} buffers), synthetic 3x32x32, 10 classes; {res['device_name']}; "
          f"torch {res['torch']}; TF32 {'on' if res['settings']['tf32'] else 'off'}, cuDNN "
          f"deterministic; {c['timed_steps']} steps timed "
          f"after {res['warmup']}")
    head = ("step ms", "median", "wall", "compute", "comm", "rest")
    print(f"{'':30}" + "".join(f"{h:>9}" for h in head) + "  (ms per step: means, the median "
          "step, the timed window's wall time per step; the means add up)")
    row = lambda label, f, comm, rest, note: print(  # noqa: E731
        f"{label:30}{f['step_ms']:9.2f}{f['step_ms_median']:9.2f}{f['wall_ms_per_step']:9.2f}"
        f"{f['compute_ms']:9.2f}{comm:>9}{rest:9.2f}  ({note})")
    row(f"one process, batch {res['global_batch']}", s, "-", s["optimizer_ms"],
        "rest: the optimizer")
    row(f"2 workers x {res['batch']} + 2 shards", c, f"{c['comm_ms']:.2f}", c["rest_ms"],
        f"rank {c['rank']}, the slower; transport {', '.join(res['transport'])}")
    for f in res["cluster_ranks"]:
        print(f"  rank {f['rank']}: step {f['step_ms']:.2f} = compute {f['compute_ms']:.2f} + "
              f"push {f['push_ms']:.2f} + pull {f['pull_ms']:.2f} + rest {f['rest_ms']:.2f}")
    print(f"ratio cluster / one process: {res['ratio']:.2f}x (target <= 2x: "
          f"{'met' if res['ratio'] <= 2 else 'NOT met'}); communication "
          f"{100 * b['shares']['comm']:.0f}% of the step, compute "
          f"{100 * b['shares']['compute']:.0f}%, rest {100 * b['shares']['rest']:.0f}%")
    for k, text in b["parts"].items():
        print(f"  {k}: {text}")
    print(f"  bound by: {b['bound_by']}")
    print(f"equivalence: the shards' statement: {e['statement']}")
    print(f"  after {e['check_steps']} steps, every rank's parameters and buffers against "
          f"{e['reference']} (tolerance {e['tolerance']:.0e}, largest relative difference "
          f"per tensor; integer buffers exactly):")
    for r in e["ranks"]:
        print(f"  rank {r['rank']}: {r['max_rel_diff']:.2e} (in {r['in']}); integer buffers "
              f"differing: {', '.join(r['int_buffers_differing']) or 'none'}; against plain "
              f"batch norm over {res['global_batch']} (not the promise): "
              f"{r['vs_plain_batch_norm']:.2e}")
    print(f"  ranks identical: {e['ranks_identical']}; {'PASS' if e['pass'] else 'FAIL'}")


def bench(a, tmp: Path) -> dict:
    device = setup_device(a.device, a.threads, a.tf32)
    torch.manual_seed(a.seed)
    base = ResNet18(a.width)
    cfg = write_config(a, tmp, base)
    plan = plans(cfg, base, a.train_len)
    x, y = synthetic(a.train_len, a.seed, device)
    single, plain = single_process(a, base, x, y, plan, device)
    ghost = ghost_reference(a, base, x, y, plan, device)
    n = sum(p.numel() for p in base.parameters())
    bw = bandwidths(n, device)
    del x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the device's memory to the workers
    ranks = run_cluster(a, tmp, cfg)
    per_rank = [dict(figures(r["steps"], a.warmup), rank=r["rank"]) for r in ranks]
    cluster = max(per_rank, key=lambda m: m["step_ms"])
    single_m = figures(single, a.warmup)
    shard0 = shard_figures(tmp, a.warmup)
    return {
        "device": a.device, "width": a.width, "params": n,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__, "buffers": sum(1 for _ in base.buffers()),
        "batch": a.batch, "global_batch": WORLD * a.batch, "workers": WORLD, "shards": WORLD,
        "steps": a.steps, "warmup": a.warmup, "threads": a.threads,
        "worker_threads": worker_threads(a),
        "settings": {"tf32": a.tf32, "cudnn_deterministic": True, "cudnn_benchmark": False,
                     "optimizer": f"SGD lr {LR} momentum {MOMENTUM} weight_decay {WEIGHT_DECAY}",
                     "loss": "mean", "aggregation": "mean",
                     "batch_norm": "running statistics as buffers (DDP broadcast_buffers: "
                                   "ghost batch norm of b_r, rank 0's running statistics)"},
        "single": single_m, "cluster": cluster, "cluster_ranks": per_rank,
        "ratio": cluster["step_ms"] / single_m["step_ms"], "target_ratio": 2.0,
        "transport": ranks[0]["transport"], "bandwidth": bw,
        "bound": bound(single_m, cluster, n, bw, shard0), "shard0": shard0,
        "equivalence": equivalence(a, tmp, ghost, plain, ranks[0]["equivalence"]),
    }


def arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N (default cuda)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--check-steps", type=int, default=3,
                   help="the equivalence check's step count, within the warm-up (default 3)")
    p.add_argument("--width", type=float, default=1.0, help="channel multiplier (default 1)")
    p.add_argument("--batch", type=int, default=128, help="samples per worker (default 128)")
    p.add_argument("--train-len", type=int, help="synthetic samples (default 8 global batches)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 16),
                   help="CPU threads of the single process; each worker gets half")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds the cluster (shards and workers) may take in all")
    p.add_argument("--tf32", action="store_true",
                   help="TF32 in cuDNN convolutions and matmuls (PyTorch's default for cuDNN; "
                   "default here: off, f32 as the project's other GPU comparisons)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep", help="keep the cluster's files (logs, config) in this folder")
    # a worker process (started by this script)
    for k in ("--worker-rank", "--config", "--servers", "--out-dir"):
        p.add_argument(k, help=argparse.SUPPRESS, type=int if k == "--worker-rank" else str)
    a = p.parse_args(argv)
    a.train_len = a.train_len or 8 * WORLD * a.batch
    refused = [why for bad, why in [
        (a.steps < 1, "--steps must be 1 or more"),
        (a.batch < 1, "--batch must be 1 or more"),
        (a.width <= 0, "--width must be above 0"),
        (not 1 <= a.check_steps <= a.warmup,
         "--check-steps must be 1 or more and at most --warmup (the check must not fall "
         "inside the timed steps)"),
        (a.train_len < WORLD * a.batch, "--train-len must hold one global batch"),
        (a.timeout <= 0, "--timeout must be above 0"),
    ] if bad]
    if refused:
        p.error("; ".join(refused))
    return a


def main(argv=None) -> int:
    a = arguments(argv)
    if a.worker_rank is not None:
        return worker_main(a)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("ps_torch_resnet: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    keep = Path(a.keep) if a.keep else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ps-resnet-") as t:
        tmp = keep or Path(t)
        try:
            res = bench(a, tmp)
        except (RuntimeError, OSError) as e:  # the cluster did not finish, or did not start
            print(f"ps_torch_resnet: FAILED: {e}", file=sys.stderr)
            return 1
    report(res)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0 if res["equivalence"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
