#!/usr/bin/env python3
"""PyTorch reference for gpu-bench: forward+backward of the same MLP on the GPU in full FP32.

nn.Linear layers with ReLU between them and a mean softmax cross-entropy, the same shapes and
batch sizes as ps-worker's gpu-bench. TF32 is off (torch.backends.cuda.matmul.allow_tf32 =
False, torch.backends.cudnn.allow_tf32 = False, float32 matmul precision "highest"). Each
timed step runs forward and backward on a batch already on the GPU and reads the loss back
with .item(), which synchronises, like gpu-bench's fwd+bwd column (whose batch is also on the
device already); the medians are over --steps steps after --warmup untimed ones. FLOPs are
counted as 6*batch*sum(in*out).

Prints a markdown table; --json PATH also writes JSON. Exits 0 with one line when PyTorch or a
CUDA GPU is missing.
"""

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="784-1024-1024-10,784-4096-4096-10")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"no PyTorch: {e}")
        return 0
    if not torch.cuda.is_available():
        print(f"no GPU: torch {torch.__version__} sees no CUDA device")
        return 0

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda", args.device)
    torch.manual_seed(0)

    models = [[int(d) for d in m.split("-")] for m in args.models.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for dims in models:
        layers = []
        for i, (fan_in, fan_out) in enumerate(zip(dims, dims[1:])):
            layers.append(torch.nn.Linear(fan_in, fan_out))
            if i + 2 < len(dims):
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers).to(dev)
        params = sum(p.numel() for p in model.parameters())
        macs = sum(a * b for a, b in zip(dims, dims[1:]))
        for n in batches:
            x = torch.rand(n, dims[0], device=dev)
            y = torch.randint(0, dims[-1], (n,), device=dev)

            def step(x=x, y=y):
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y, reduction="mean")
                loss.backward()
                return loss.item()

            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize(dev)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize(dev)
                times.append((time.perf_counter() - t0) * 1e3)
            ms = statistics.median(times)
            gflop = 6.0 * n * macs / 1e9
            rows.append(
                {
                    "model": "-".join(map(str, dims)),
                    "params": params,
                    "batch": n,
                    "gflop_per_step": gflop,
                    "step_ms": ms,
                    "step_gflops": gflop / (ms * 1e-3),
                }
            )

    name = torch.cuda.get_device_name(dev)
    print(
        f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}) on cuda:{args.device} ({name}), FP32 (TF32 off): "
        f"median of {args.steps} steps after {args.warmup} warm-up steps; FLOPs = 6·batch·Σ(in·out)"
    )
    print()
    print("| model | params | batch | torch fwd+bwd ms | GFLOP/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['params']} | {r['batch']} | {r['step_ms']:.3f} | {r['step_gflops']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "tool": "torch_mlp_bench",
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "device": f"cuda:{args.device} ({name})",
                    "precision": "fp32 (no TF32)",
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "statistic": "median",
                    "results": rows,
                },
                f,
                indent=2,
            )
            f.write("\n")
        print(f"torch_mlp_bench: wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
