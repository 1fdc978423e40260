"""Shared by the Python tests and the example: the shipped data sets, a small CNN, shards
started as real ps-server processes, ranks run in threads, and the weight comparison the Rust
tests use."""

from __future__ import annotations

import gzip
import os
import secrets
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("PS_BIN_DIR", REPO / "target" / "release"))


def read_idx(path: Path) -> np.ndarray:
    data = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir: Path, split: str = "train"):
    """(images as float32 [N, 1, 28, 28] in [0, 1], labels as int64 [N])."""
    prefix = "train" if split == "train" else "t10k"

    def find(kind):
        for name in (f"{prefix}-{kind}-idx{3 if kind == 'images' else 1}-ubyte.gz",
                     f"{prefix}-{kind}-idx{3 if kind == 'images' else 1}-ubyte"):
            if (data_dir / name).exists():
                return data_dir / name
        raise FileNotFoundError(f"{data_dir}: no {prefix} {kind}")

    x = torch.from_numpy(read_idx(find("images")).astype(np.float32) / 255.0).unsqueeze(1)
    y = torch.from_numpy(read_idx(find("labels")).astype(np.int64))
    return x, y


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Shards:
    """S real ps-server processes on free 127.0.0.1 ports (stopped on exit)."""

    def __init__(self, config: Path, num_shards: int, out_dir: Path, timeout: float = 60,
                 extra_args: tuple[str, ...] = (), bin_dir: Path = BIN):
        self.bin_dir = bin_dir  # where ps-server is (an installed wheel's: the venv's bin/)
        self.procs = []
        self.addrs = []
        self.logs = []
        self.config, self.out_dir, self.timeout = config, out_dir, timeout
        # the shard credential of this cluster (shard-to-shard calls: step reports, recovery),
        # as ps-launch gives its shards one; workers never see it
        self.env = {**os.environ, "PS_SHARD_TOKEN": secrets.token_hex(16)}
        for i in range(num_shards):
            self.procs.append(None)
            self.logs.append(None)
            self.addrs.append(self._start(i, "127.0.0.1:0", list(extra_args)))

    def _start(self, i: int, listen: str, extra: list[str], log_name=None) -> str:
        """Starts shard i listening on ``listen``; returns its address once it is bound."""
        out_dir = self.out_dir
        addr_file = out_dir / f"shard-{i}.addr"
        addr_file.unlink(missing_ok=True)  # a previous run's in the same folder
        log_path = out_dir / (log_name or f"shard-{i}.log")
        log = open(log_path, "w")
        self.logs[i] = log
        args = [str(self.bin_dir / "ps-server"), "--config", str(self.config), "--shard", str(i),
                "--listen", listen, "--addr-file", str(addr_file),
                "--out-dir", str(out_dir), *extra]
        if i > 0:
            args += ["--shard0", self.addrs[0]]
        self.procs[i] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        begun = time.time()
        while not (addr_file.exists() and addr_file.read_text().strip()):
            if self.procs[i].poll() is not None or time.time() - begun > self.timeout:
                self.stop()
                raise RuntimeError(f"shard {i} did not start: {log_path.read_text()}")
            time.sleep(0.05)
        return addr_file.read_text().strip()

    def kill(self, i: int) -> None:
        """SIGKILL to shard i (a lost shard)."""
        self.procs[i].kill()
        self.procs[i].wait()
        self.logs[i].close()

    def recover(self, i: int) -> None:
        """Starts a replacement of shard i on its address with --recover (as ps-launch
        --restart-shards does); its log is shard-i.recover.log."""
        self._start(i, self.addrs[i], ["--recover", "--peers", ",".join(self.addrs)],
                    log_name=f"shard-{i}.recover.log")

    def wait(self, timeout: float = 120) -> list[int]:
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs:
            if log is not None:
                log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def config_text(init: Path, data_dir: Path, out_dir: Path, *, workers=2, shards=2,
                global_batch=64, steps=20, loss_reduction="mean", aggregation="mean",
                optimizer='kind = "sgd"\nlr = 0.05', eval_every=0, seed=7,
                train_len=None) -> str:
    """A run's config; `train_len`: the user's own data of that many samples ([data]
    train_len, no IDX directory) instead of `data_dir`."""
    data = f"train_len = {train_len}" if train_len is not None else f'dir = "{data_dir}"'
    servers = ", ".join(f'"127.0.0.1:{50000 + i}"' for i in range(shards))
    return f"""
[cluster]
servers = [{servers}]
workers = {workers}

[model]
init = "{init}"

[data]
{data}

[train]
seed = {seed}
global_batch = {global_batch}
steps = {steps}
loss_reduction = "{loss_reduction}"
aggregation = "{aggregation}"
log_every = 10
eval_every = {eval_every}

[optimizer]
{optimizer}

[server]
out_dir = "{out_dir}"
"""


def delaying_proxy(target: str, delay: float) -> str:
    """A TCP proxy on 127.0.0.1 in front of ``target`` ("host:port") that holds back every
    read from the target (the replies) for ``delay`` seconds, requests going through at once:
    a shard whose answers come late. Background threads; returns the proxy's address."""
    import threading

    host, port = target.rsplit(":", 1)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def pipe(src, dst, pause):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if pause:
                    time.sleep(pause)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def accept():
        while True:
            client, _ = listener.accept()
            try:
                server = socket.create_connection((host, int(port)))
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=pipe, args=(client, server, 0), daemon=True).start()
            threading.Thread(target=pipe, args=(server, client, delay), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return "127.0.0.1:%d" % listener.getsockname()[1]


def run_ranks(go, ranks: int = 2, timeout: float = 120.0):
    """Runs `go(r)` for each rank in a thread of its own and waits for them (each at most
    `timeout` s); fails naming the ranks that raised, or if one still runs."""
    errors = []

    def run(r):
        try:
            go(r)
        except BaseException as e:  # reported below, with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"a rank still runs after {timeout} s"
    assert not errors, errors


def train_rank(worker, model, x, y, reduction: str, overlap: bool = False):
    """The user's loop: forward, loss with the configured reduction, backward, step (or
    `worker.backward(loss)`, which pushes while backward runs)."""
    for _, idx in worker.batches(len(x)):
        out = model(x[idx])
        loss = F.cross_entropy(out, y[idx], reduction=reduction)
        if overlap:
            worker.backward(loss, correct=(out.argmax(1) == y[idx]).sum())
            continue
        loss.backward()
        per_sample = loss.item() * (len(idx) if reduction == "mean" else 1)
        worker.step(loss_sum=per_sample, correct=(out.argmax(1) == y[idx]).sum())


def max_rel_diff(a: nn.Module, b: nn.Module) -> tuple[float, str]:
    """Largest over tensors of max |a - b| / max |b| (ps_model::weights::max_rel_diff)."""
    worst = (0.0, "")
    bp = dict(b.named_parameters())
    for n, p in a.named_parameters():
        ref = bp[n].detach().double()
        dev = (p.detach().double() - ref).abs().max().item()
        scale = max(ref.abs().max().item(), 1e-300)
        if dev / scale >= worst[0]:
            worst = (dev / scale, n)
    return worst


def lose_shard_after_checkpoint(shards: Shards, out: Path, errors: list, shard: int = 1,
                                version: int = 10) -> None:
    """While workers train in threads (their exceptions collected in ``errors``): SIGKILLs
    ``shard`` once it has written its checkpoint of ``version``, then starts its replacement
    with --recover, so the cluster rolls back to the newest common checkpoint."""
    ckpt = (out / "checkpoints" /
            f"shard-{shard}-of-{len(shards.procs)}-v{version:08d}.safetensors")
    begun = time.time()
    while not ckpt.exists():
        assert time.time() - begun < 60, f"shard {shard} did not checkpoint version {version}"
        assert not errors, errors
        time.sleep(0.005)
    assert shards.procs[shard].poll() is None, f"the run ended before shard {shard} was lost"
    shards.kill(shard)
    # the replacement starts at once, as ps-launch --restart-shards starts it: the workers learn
    # of the loss from a refused call or from the rollback, whichever comes first
    shards.recover(shard)
