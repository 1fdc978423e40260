#!/usr/bin/env python3
"""PyTorch reference for gpu-bench: forward+backward of the same MLPs and CNNs in full FP32.

MLPs: nn.Linear layers with ReLU between them. CNNs (--cnns, gpu-bench's syntax
CxHxW:CHANNELS:KERNEL:HIDDEN:CLASSES[:STRIDE[:PADDING]], default the Fashion-MNIST CNN of
deploy/fashion-cnn.toml): per channel count nn.Conv2d(k, stride, padding) -> ReLU ->
nn.MaxPool2d(2), then nn.Flatten and nn.Linear layers with ReLU between them. Both end in a mean
softmax cross-entropy; the same shapes and batch sizes as ps-worker's gpu-bench. TF32 is off
(torch.backends.cuda.matmul.allow_tf32 = False, torch.backends.cudnn.allow_tf32 = False, float32
matmul precision "highest"). Each timed step zeroes the gradients, runs forward, the loss and
backward on a batch already on the device and reads the loss back with .item(), then
synchronises the device, like gpu-bench's fwd+bwd column (whose batch is also on the device
already); the medians are over --steps steps after --warmup untimed ones (wall clock). The CNNs
are timed twice on CUDA: with torch.backends.cudnn.benchmark = True (cuDNN tries its algorithms
during the warm-up and keeps the fastest: the strongest baseline, "step_ms") and with cuDNN's
default heuristics (benchmark off, "step_ms_cudnn_default").

FLOPs: MLPs 6*batch*sum(in*out); CNNs 2*batch*(3*sum(M) - M1), M the multiply-adds per sample of
each conv (out*oh*ow*c*k*k) and linear (in*out) layer, M1 the first layer's (whose input gradient
is not computed).

Prints markdown tables; --json PATH also writes JSON (MLPs under "results", CNNs under
"cnn_results"). --device N is cuda:N; --device cpu runs the same on the CPU (a smoke test: no
cuDNN there). Exits 0 with one line when PyTorch or a CUDA GPU is missing.
"""

import argparse
import json
import statistics
import sys
import time

FASHION_CNN = "1x28x28:16-32:5:64:10"


def parse_cnn(s):
    """(text, image [c, h, w], channels, kernel, stride, padding, hidden, classes) of a --cnns entry."""
    f = s.strip().split(":")
    if not 5 <= len(f) <= 7:
        raise ValueError(f"{s!r}: expected CxHxW:CHANNELS:KERNEL:HIDDEN:CLASSES[:STRIDE[:PADDING]], like {FASHION_CNN}")
    image = [int(d) for d in f[0].split("x")]
    if len(image) != 3:
        raise ValueError(f"{s!r}: image {f[0]!r}: expected CxHxW, like 1x28x28")
    channels = [int(c) for c in f[1].split("-")]
    hidden = [int(h) for h in f[3].split("-")] if f[3] else []
    stride = int(f[5]) if len(f) > 5 else 1
    padding = int(f[6]) if len(f) > 6 else 0
    return s.strip(), image, channels, int(f[2]), stride, padding, hidden, int(f[4])


def build_cnn(torch, spec):
    """The network of a parsed --cnns entry, and its layers' multiply-adds per sample."""
    _, (c, h, w), channels, k, s, p, hidden, classes = spec
    layers, macs = [], []
    for out in channels:
        oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        if oh % 2 or ow % 2 or oh < 1 or ow < 1:
            raise ValueError(f"{spec[0]!r}: a convolution's output {oh}x{ow} is not halved exactly by 2x2 pooling")
        layers += [torch.nn.Conv2d(c, out, k, stride=s, padding=p), torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
        macs.append(out * oh * ow * c * k * k)
        c, h, w = out, oh // 2, ow // 2
    dims = [c * h * w] + hidden + [classes]
    layers.append(torch.nn.Flatten())
    for i, (fan_in, fan_out) in enumerate(zip(dims, dims[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        macs.append(fan_in * fan_out)
        if i + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers), macs


def build_mlp(torch, dims):
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(dims, dims[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def time_steps(torch, dev, model, x, y, warmup, steps):
    """Median wall time in ms of a forward+loss+backward step, synchronised after each."""
    import torch.nn.functional as F

    def step():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y, reduction="mean")
        loss.backward()
        return loss.item()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_mlps(torch, dev, models, batches, args):
    rows = []
    for dims in models:
        model = build_mlp(torch, dims).to(dev)
        params = sum(p.numel() for p in model.parameters())
        macs = sum(a * b for a, b in zip(dims, dims[1:]))
        for n in batches:
            x = torch.rand(n, dims[0], device=dev)
            y = torch.randint(0, dims[-1], (n,), device=dev)
            ms = time_steps(torch, dev, model, x, y, args.warmup, args.steps)
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
    return rows


def bench_cnns(torch, dev, cnns, batches, args):
    rows = []
    for spec in cnns:
        model, macs = build_cnn(torch, spec)
        model = model.to(dev)
        params = sum(p.numel() for p in model.parameters())
        image, classes = spec[1], spec[7]
        for n in batches:
            x = torch.rand(n, *image, device=dev)
            y = torch.randint(0, classes, (n,), device=dev)
            gflop = 2.0 * n * (3 * sum(macs) - macs[0]) / 1e9
            row = {"model": spec[0], "params": params, "batch": n, "gflop_per_step": gflop}
            if dev.type == "cuda":
                torch.backends.cudnn.benchmark = False
                default_ms = time_steps(torch, dev, model, x, y, args.warmup, args.steps)
                torch.backends.cudnn.benchmark = True
            ms = time_steps(torch, dev, model, x, y, args.warmup, args.steps)
            row["step_ms"] = ms
            row["step_gflops"] = gflop / (ms * 1e-3)
            row["images_per_s"] = n / (ms * 1e-3)
            if dev.type == "cuda":
                row["step_ms_cudnn_default"] = default_ms
            rows.append(row)
    return rows


def print_tables(mlps, cnns, cuda):
    if mlps:
        print()
        print("| model | params | batch | torch fwd+bwd ms | GFLOP/s |")
        print("|---|---:|---:|---:|---:|")
        for r in mlps:
            print(f"| {r['model']} | {r['params']} | {r['batch']} | {r['step_ms']:.3f} | {r['step_gflops']:.0f} |")
    if cnns:
        print()
        best = "torch fwd+bwd ms (cudnn.benchmark)" if cuda else "torch fwd+bwd ms"
        print(f"| cnn | params | batch | {best} | GFLOP/s | images/s | torch ms (cuDNN default) |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in cnns:
            default = r.get("step_ms_cudnn_default")
            print(
                f"| {r['model']} | {r['params']} | {r['batch']} | {r['step_ms']:.3f} | {r['step_gflops']:.0f} | "
                f"{r['images_per_s']:.0f} | {'-' if default is None else f'{default:.3f}'} |"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="784-1024-1024-10,784-4096-4096-10", help="MLPs, or none")
    ap.add_argument("--cnns", default=FASHION_CNN, help="CNNs in gpu-bench's syntax, or none")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", default="0", help="CUDA device index (or cuda:N), or cpu")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    models = [] if args.models == "none" else [[int(d) for d in m.split("-")] for m in args.models.split(",")]
    try:
        cnns = [] if args.cnns == "none" else [parse_cnn(c) for c in args.cnns.split(",")]
    except ValueError as e:
        print(f"torch_mlp_bench: --cnns {e}", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]

    try:
        import torch
    except ImportError as e:
        print(f"no PyTorch: {e}")
        return 0
    if args.device == "cpu":
        dev = torch.device("cpu")
        name = f"cpu, {torch.get_num_threads()} threads"
    elif not torch.cuda.is_available():
        print(f"no GPU: torch {torch.__version__} sees no CUDA device")
        return 0
    else:
        index = int(args.device.removeprefix("cuda:"))
        dev = torch.device("cuda", index)
        name = f"cuda:{index} ({torch.cuda.get_device_name(dev)})"

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)

    mlps = bench_mlps(torch, dev, models, batches, args)
    cnn_rows = bench_cnns(torch, dev, cnns, batches, args)
    print(
        f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}) on {name}, "
        f"FP32 (TF32 off): median of {args.steps} steps after {args.warmup} warm-up steps; "
        f"MLP FLOPs = 6·batch·Σ(in·out), CNN FLOPs = 2·batch·(3·ΣM − M₁)"
    )
    print_tables(mlps, cnn_rows, dev.type == "cuda")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "tool": "torch_mlp_bench",
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "cudnn": torch.backends.cudnn.version(),
                    "device": name,
                    "precision": "fp32 (no TF32)",
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "statistic": "median",
                    "results": mlps,
                    "cnn_cudnn": "step_ms: torch.backends.cudnn.benchmark = True; step_ms_cudnn_default: False",
                    "cnn_results": cnn_rows,
                },
                f,
                indent=2,
            )
            f.write("\n")
        print(f"torch_mlp_bench: wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
