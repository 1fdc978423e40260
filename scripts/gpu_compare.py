#!/usr/bin/env python3
"""gpu-check.sh's comparison of gpu-bench with PyTorch (scripts/torch_mlp_bench.py) from their JSON.

Usage: gpu_compare.py GPU_BENCH_JSON TORCH_JSON [OLD_GPU_BENCH_JSON]

Prints a markdown section: per MLP and batch, our fwd+bwd against PyTorch's (ours / PyTorch);
per CNN and batch, ours against PyTorch with cudnn.benchmark on (the strongest baseline) and
with cuDNN's default heuristics, and issue 38's target (the Fashion-MNIST CNN at batch 256:
ours / PyTorch with cudnn.benchmark <= 2) with PASS or FAIL. A figure missing on one side
shows as "-". With the JSON of an older build's gpu-bench, the CNN table also shows its time
and new / old. Standard library only. Exit status: 0 (the report records a missed target; it is
not a failure of the check), 2 when a file cannot be read as JSON.
"""

import json
import sys

CNN_TARGET = {"model": "1x28x28:16-32:5:64:10", "batch": 256, "ratio": 2.0}


def by_key(rows):
    return {(r["model"], r["batch"]): r for r in rows or []}


def ms(v):
    return "-" if v is None else f"{v:.3f}"


def ratio(a, b):
    return None if a is None or b is None or b <= 0 else a / b


def fmt_ratio(r):
    return "-" if r is None else f"{r:.2f}"


def mlp_table(ours, torch):
    t = by_key(torch.get("results"))
    lines = [
        "| MLP | batch | ours fwd+bwd ms | PyTorch ms | ours / PyTorch |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in ours.get("results") or []:
        p = t.get((r["model"], r["batch"]), {}).get("step_ms")
        lines.append(f"| {r['model']} | {r['batch']} | {ms(r['step_ms'])} | {ms(p)} | {fmt_ratio(ratio(r['step_ms'], p))} |")
    return lines


def verdict(model, batch, r):
    if model != CNN_TARGET["model"] or batch != CNN_TARGET["batch"]:
        return "-"
    if r is None:
        return "NOT MEASURED"
    return f"{'PASS' if r <= CNN_TARGET['ratio'] else 'FAIL'} (<= {CNN_TARGET['ratio']:g})"


def cnn_table(ours, torch, old=None):
    t = by_key(torch.get("cnn_results"))
    o = by_key((old or {}).get("cnn_results"))
    head = "| CNN | batch | ours fwd+bwd ms | PyTorch ms (cudnn.benchmark) | ours / PyTorch | PyTorch ms (cuDNN default) | ours / PyTorch default | target |"
    rule = "|---|---:|---:|---:|---:|---:|---:|---|"
    if old is not None:
        head += " old build ms | new / old |"
        rule += "---:|---:|"
    lines = [head, rule]
    rows = ours.get("cnn_results") or []
    for r in rows:
        p = t.get((r["model"], r["batch"]), {})
        best, default = p.get("step_ms"), p.get("step_ms_cudnn_default")
        rb = ratio(r["step_ms"], best)
        line = (
            f"| {r['model']} | {r['batch']} | {ms(r['step_ms'])} | {ms(best)} | {fmt_ratio(rb)} | "
            f"{ms(default)} | {fmt_ratio(ratio(r['step_ms'], default))} | {verdict(r['model'], r['batch'], rb)} |"
        )
        if old is not None:
            was = o.get((r["model"], r["batch"]), {}).get("step_ms")
            line += f" {ms(was)} | {fmt_ratio(ratio(r['step_ms'], was))} |"
        lines.append(line)
    if not any(r["model"] == CNN_TARGET["model"] and r["batch"] == CNN_TARGET["batch"] for r in rows):
        lines.append(
            f"| {CNN_TARGET['model']} | {CNN_TARGET['batch']} | - | - | - | - | - | NOT MEASURED (not in gpu-bench's JSON) |"
            + (" - | - |" if old is not None else "")
        )
    return lines


def main(argv):
    if len(argv) not in (3, 4):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    docs = []
    for path in argv[1:]:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"gpu_compare: {path}: {e}", file=sys.stderr)
            return 2
    ours, torch = docs[:2]
    old = docs[2] if len(docs) > 2 else None
    print(
        f"gpu-bench on {ours.get('device')} against PyTorch {torch.get('torch')} on {torch.get('device')}, "
        f"both FP32 without TF32, medians of {ours.get('steps')} and {torch.get('steps')} steps, each ending "
        "with a synchronisation; ratios below 1 mean ours is faster."
    )
    print()
    print("\n".join(mlp_table(ours, torch)))
    print()
    if old is not None:
        print(f"The old build: gpu-bench on {old.get('device')}, the same run.")
        print()
    print("\n".join(cnn_table(ours, torch, old)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
