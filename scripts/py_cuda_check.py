#!/usr/bin/env python3
"""The Python worker (ps.Worker) with a model on the GPU (first run: H100, 2026-11-27, PASS).

Two ps.Worker threads in one process train python/tests' SmallCNN on CUDA against 2 real
ps-server shards for 20 steps, once with step() and once with backward() (the overlapped push:
its post-accumulate-grad hooks run on autograd's CUDA device thread), and each result is
compared with the single-process CPU reference of python/tests/test_equivalence.py
(torch.optim.SGD on the union batch). TF32 off, cuDNN deterministic. Prints per-step time and
the largest relative weight difference; exits 1 when a difference is >= 1e-4 (CPU-vs-GPU
rounding of convolutions is ~1e-6; the CPU-only test's tolerance is 1e-5).

Run from the repository root on the GPU host, with ps-server at $PS_BIN_DIR and the ps package
importable (PYTHONPATH=DIR holding ps/ and ps_torch/ with ps_torch/_native.abi3.so):
    PS_BIN_DIR=.dev/gpu-bin PYTHONPATH=.dev/pypkg python3 scripts/py_cuda_check.py
(scripts/gpu-session.sh runs it from the bundle of scripts/gpu-bundle.sh)
"""
import copy
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path("python/tests").resolve()))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False

import ps  # noqa: E402
from common import Shards, SmallCNN, config_text, load, max_rel_diff, REPO  # noqa: E402
from test_equivalence import reference, STEPS  # noqa: E402

DATA = REPO / "data" / "mnist"
TOL = 1e-4


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, ps from {ps.__file__}")
    x, y = load(DATA, "train")
    xc, yc = x.cuda(), y.cuda()
    bad = 0
    for overlap in (False, True):
        tmp = Path(tempfile.mkdtemp(prefix="pycuda-"))
        torch.manual_seed(3)
        base = SmallCNN()
        init = tmp / "init.safetensors"
        ps.save_init(base, init)
        cfg = tmp / "run.toml"
        cfg.write_text(config_text(init, DATA, tmp, global_batch=64, steps=STEPS))
        models = [copy.deepcopy(base).cuda() for _ in range(2)]
        errors, times = [], [[], []]
        with Shards(cfg, 2, tmp) as shards:
            workers = [ps.Worker(cfg, m, rank=r, servers=shards.addrs) for r, m in enumerate(models)]

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
                        times[r].append(time.perf_counter() - t0)
                except BaseException as e:  # noqa: BLE001
                    errors.append((r, repr(e)))

            threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            alive = [t.is_alive() for t in threads]
            codes = shards.wait(60)
        if errors or any(alive):
            print(f"overlap={overlap}: FAILED errors={errors} threads alive={alive} shard exits={codes} (logs in {tmp})")
            bad += 1
            continue
        ref = reference(base, cfg, x, y, lambda p: torch.optim.SGD(p, lr=0.05))
        for r, m in enumerate(models):
            diff, name = max_rel_diff(m.cpu(), ref)
            med = sorted(times[r])[len(times[r]) // 2] * 1e3
            ok = diff < TOL
            bad += not ok
            print(f"overlap={overlap} rank {r}: {'PASS' if ok else 'FAIL'} largest relative weight "
                  f"difference vs CPU torch.optim {diff:.2e} (in {name}); median step {med:.1f} ms; "
                  f"pushes {workers[r].timing()['pushes']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
