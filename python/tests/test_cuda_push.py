"""The Python worker with a model on CUDA (skipped without a GPU): 2 ``ps.Worker`` threads train
SmallCNN on the GPU against 2 real shards, with ``step()`` and with ``backward()`` (the gradient
hooks), and each equals the single-process CPU reference (torch.optim.SGD on the union batch) to
1e-5 (TF32 off, cuDNN deterministic). Every gradient left the GPU by a non-blocking copy into
page-locked memory (the push buffer registered with cudaHostRegister: ``is_pinned()``), once per
tensor and step, the buffer registered and unregistered once per worker, and no synchronous
device-to-host copy (``Tensor.copy_``, ``.cpu()``, ``.to("cpu")`` counted in the whole run); the
pulled weights went up by non-blocking copies straight from the shards' parameters boards (each
registered with cudaHostRegister once and unregistered once), the pulls copying 0 host bytes
(``_native.copied()``).

On the GPU machine (no pytest needed), from the repository root, as scripts/gpu-session.sh does:
    PS_BIN_DIR=.dev/gpu-bin PYTHONPATH=.dev/pypkg python3 python/tests/test_cuda_push.py
"""

import copy
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ps  # noqa: E402
from ps import _native  # noqa: E402
from ps_torch import _device  # noqa: E402
from common import REPO, Shards, SmallCNN, config_text, load, max_rel_diff  # noqa: E402

try:
    import pytest
except ImportError:  # the GPU machine may have no pytest: run as a script (below)
    pytest = None

DATA = REPO / "data" / "mnist"
STEPS = 20
TOLERANCE = 1e-5


class CountingCudaCopies(_device.CudaCopies):
    """The real CUDA operations, counted: copies, copies into memory that is not page-locked,
    registrations."""

    def __init__(self):
        super().__init__()
        self.copies = self.unpinned = self.registered = self.unregistered = 0
        self.ranges = []  # (address, bytes) registered
        self.uploads = self.from_boards = 0  # host-to-device uploads, those from a board

    def register(self, address, nbytes):
        super().register(address, nbytes)
        self.registered += 1
        self.ranges.append((address, nbytes))

    def upload(self, pairs):
        for _, src in pairs:
            if src.device.type == "cpu":
                at = src.data_ptr()
                self.uploads += 1
                self.from_boards += any(a + 4096 <= at < a + n for a, n in self.ranges)
        return super().upload(pairs)

    def unregister(self, address):
        super().unregister(address)
        self.unregistered += 1

    def copy(self, dst, src):
        self.copies += 1
        self.unpinned += not dst.is_pinned()
        return super().copy(dst, src)


class SyncDeviceToHost:
    """Counts the synchronous device-to-host copies made through ``Tensor.copy_``, ``.cpu()``
    and ``.to()`` while active (any thread), and the host-to-device ``copy_`` from pageable
    memory (the pull's uploads)."""

    def __init__(self):
        self.seen = []

    def __enter__(self):
        self.saved = (torch.Tensor.copy_, torch.Tensor.cpu, torch.Tensor.to)
        copy_, cpu, to = self.saved
        seen = self.seen

        def counted_copy_(dst, src, non_blocking=False):
            if src.device.type == "cuda" and dst.device.type == "cpu" and not (
                    non_blocking and dst.is_pinned()):
                seen.append(("copy_", tuple(src.shape)))
            if src.device.type == "cpu" and dst.device.type == "cuda" and not (
                    non_blocking and src.is_pinned()):
                seen.append(("copy_ up", tuple(src.shape)))  # from pageable memory: synchronous
            return copy_(dst, src, non_blocking)

        def counted_cpu(t, *a, **kw):
            if t.device.type == "cuda":
                seen.append(("cpu", tuple(t.shape)))
            return cpu(t, *a, **kw)

        def counted_to(t, *a, **kw):
            out = to(t, *a, **kw)
            if t.device.type == "cuda" and out.device.type == "cpu":
                seen.append(("to", tuple(t.shape)))
            return out

        torch.Tensor.copy_, torch.Tensor.cpu, torch.Tensor.to = counted_copy_, counted_cpu, counted_to
        return self

    def __exit__(self, *exc):
        torch.Tensor.copy_, torch.Tensor.cpu, torch.Tensor.to = self.saved


def train_on_cuda(tmp: Path, overlap: bool):
    """Trains 2 CUDA workers; returns (base, cfg, models, copies, workers, sync copies, median
    step ms)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    x, y = load(DATA, "train")
    xc, yc = x.cuda(), y.cuda()
    torch.manual_seed(3)
    base = SmallCNN()
    init = tmp / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp / "run.toml"
    cfg.write_text(config_text(init, DATA, tmp, global_batch=64, steps=STEPS))
    models = [copy.deepcopy(base).cuda() for _ in range(2)]
    made = []
    real = _device.copies_for

    def counting(params):
        made.append(CountingCudaCopies() if real(params) is not None else None)
        return made[-1]

    _device.copies_for = counting
    errors, times = [], []
    before = _native.copied()[0]
    try:
        with Shards(cfg, 2, tmp) as shards, SyncDeviceToHost() as sync:
            workers = [ps.Worker(cfg, m, rank=r, servers=shards.addrs)
                       for r, m in enumerate(models)]

            def go(r):
                try:
                    w, m = workers[r], models[r]
                    for _, idx in w.batches(len(x)):
                        t0 = time.perf_counter()
                        i = idx.cuda()
                        out = m(xc[i])
                        loss = F.cross_entropy(out, yc[i])
                        correct = (out.argmax(1) == yc[i]).sum()
                        if overlap:
                            w.backward(loss, correct=correct)
                        else:
                            loss.backward()
                            w.step(loss_sum=loss.item() * len(idx), correct=correct)
                        times.append(time.perf_counter() - t0)
                except BaseException as e:  # reported below, with the rank
                    errors.append((r, repr(e)))

            threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            assert not errors and not any(t.is_alive() for t in threads), errors
            assert shards.wait(60) == [0, 0]
    finally:
        _device.copies_for = real
    pulled = _native.copied()[0] - before
    return (base, cfg, models, made, workers, sync.seen, sorted(times)[len(times) // 2] * 1e3,
            pulled)


def check(tmp: Path, overlap: bool) -> str:
    from test_equivalence import STEPS as REF_STEPS, reference

    assert REF_STEPS == STEPS
    base, cfg, models, made, workers, sync, step_ms, pulled = train_on_cuda(tmp, overlap)
    x, y = load(DATA, "train")
    ref = reference(base, cfg, x, y, lambda p: torch.optim.SGD(p, lr=0.05))
    lines = []
    for r in range(2):
        c = made[r]
        assert isinstance(c, CountingCudaCopies)
        assert workers[r].transport() == ["shared memory"] * 2
        assert c.copies == STEPS * len(workers[r]._params), c.copies
        # the push buffer (this worker's gradient board) and the 2 shards' parameters boards
        assert c.unpinned == 0 and c.registered == 3 and c.unregistered == 3
        assert c.uploads >= (STEPS + 1) * len(workers[r]._params) and \
            c.from_boards == c.uploads, (c.uploads, c.from_boards)
        diff, name = max_rel_diff(models[r].cpu(), ref)
        assert diff < TOLERANCE, f"rank {r}: {diff:.2e} in {name}"
        lines.append(f"rank {r}: largest relative difference vs CPU torch.optim {diff:.2e} "
                     f"(in {name})")
    assert sync == [], f"synchronous device-to-host copies: {sync[:5]} ({len(sync)})"
    assert pulled == 0, f"the pulls copied {pulled} host bytes"
    return (f"{'backward' if overlap else 'step'}: PASS; " + "; ".join(lines)
            + f"; {c.copies} non-blocking copies into registered memory per worker, 0 "
            f"synchronous; {c.from_boards} uploads straight from the shards' boards, 0 host "
            f"bytes copied by the pulls; median step {step_ms:.1f} ms")


if pytest is not None:
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    @pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward"])
    def test_cuda_model_pushes_through_registered_memory(tmp_path, overlap):
        print(check(tmp_path, overlap))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device")
        sys.exit(2)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, ps from {ps.__file__}")
    bad = 0
    for overlap in (False, True):
        try:
            print(check(Path(tempfile.mkdtemp(prefix="cudapush-")), overlap), flush=True)
        except Exception as e:  # noqa: BLE001  (both variants run; the exit code says)
            bad += 1
            print(f"{'backward' if overlap else 'step'}: FAIL {e!r}", flush=True)
    sys.exit(1 if bad else 0)
