#!/usr/bin/env bash
# One device call: the GPU checklist's steps 1-6 plus the cluster runs, everything under $OUT.
# DEADLINE (seconds from start) bounds the whole script.
set -uo pipefail
T0=$(date +%s)
DEADLINE="${DEADLINE:-400}"
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
step() { echo; echo "=================== $* (t=$(( $(date +%s) - T0 ))s, left $(left)s)"; }
bounded() { # bounded MAX CMD...: timeout min(MAX, time left - 5)
    local max="$1"; shift
    local l=$(( $(left) - 5 ))
    [ "$l" -lt "$max" ] && max="$l"
    if [ "$max" -le 5 ]; then echo "SKIPPED (no time left): $*"; return 124; fi
    timeout --kill-after=5 "$max" "$@"
}
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
exec > >(tee "$OUT/all.log") 2>&1
tar xzf .dev/gpu-bin.tgz -C .dev && tar xzf .dev/pypkg.tgz -C .dev || exit 2
B="$PWD/.dev/gpu-bin"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_LOG=info

step "1. driver, libraries, NVRTC"
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm --format=csv
nproc; free -g | head -2
ls /usr/local/cuda/lib64 | grep -E '^lib(nvrtc|cublas)\.so'
ldconfig -p | grep -E 'libcuda\.so|libnvrtc\.so|libcublas\.so'
bounded 60 "$B/ps_worker_lib" --ignored --exact cuda::tests::nvrtc_compiles_the_kernels
echo "rc nvrtc=$?"
bounded 120 "$B/ps_worker_lib" --include-ignored --test-threads=1 cuda:: device::
echo "rc lib cuda=$?"

step "2. open the device, self-test"
bounded 15 "$B/ps-worker" --config deploy/mnist.toml --rank 0 --device cuda 2>&1 | head -4

step "3-4. gpu-check.sh: parity, cluster_cuda, gpu-bench, torch"
STEPS=30 WARMUP=5 bounded 240 scripts/gpu-check.sh "$B"
echo "rc gpu-check=$?"
for f in bench/results/*; do cp "$f" "$OUT/"; done

step "5a. the default job, CUDA workers (device in [worker]), --check-reference"
bounded 150 "$B/ps-launch" --config deploy/mnist.toml --set worker.device=cuda --check-reference \
    --out-dir /tmp/gpu-mnist 2>&1 | grep -vE 'INFO shard [01] step|noise scale' | tail -25
echo "rc default job cuda=${PIPESTATUS[0]}"
grep -h "device cuda\|done after\|share\|round robin" /tmp/gpu-mnist/logs/*.log | head -8

large() { # large NAME DEVICE STEPS
    bounded 90 "$B/ps-launch" --config deploy/mnist.toml --out-dir "/tmp/large-$1" \
        --set 'model.hidden=[4096,4096]' --set train.steps="$3" --set train.global_batch=1024 \
        --set train.eval_every=0 --set train.log_every=10 --set worker.device="$2" 2>&1 | grep -E "step [0-9]+/|finished|accuracy" | tail -6
    echo "rc large $1=${PIPESTATUS[0]}"
    grep -h "device \|done after" /tmp/large-$1/logs/worker-*.log | tail -4
    tail -n 3 /tmp/large-$1/metrics.jsonl
}
step "5b. 784-4096-4096-10, global batch 1024, 2 shards, 2 CUDA workers"
large cuda cuda 60
step "5c. the same with CPU workers"
large cpu cpu 20
step "5d. gpu-bench at the cluster's per-worker batches"
bounded 60 "$B/gpu-bench" --models 784-4096-4096-10,784-256-128-10 --batches 64,512,1024 --steps 30 --warmup 5

step "6. the Python worker with a CUDA model"
PS_BIN_DIR="$B" PYTHONPATH="$PWD/.dev/pypkg" PYTHONUNBUFFERED=1 bounded 120 python3 .dev/py_cuda_check.py
echo "rc python=$?"

step "7. fashion CNN job on CUDA workers, --check-reference"
bounded 120 "$B/ps-launch" --config deploy/fashion-cnn.toml --set worker.device=cuda --set train.steps=300 \
    --check-reference --out-dir /tmp/gpu-cnn 2>&1 | grep -vE 'INFO shard [01] step|noise scale' | tail -8
echo "rc cnn=${PIPESTATUS[0]}"
grep -h "done after" /tmp/gpu-cnn/logs/*.log | head -2

step "8. compute-sanitizer on the small parity cases"
for tool in memcheck racecheck synccheck; do
    bounded 60 compute-sanitizer --tool $tool --error-exitcode 9 "$B/cuda_parity" --ignored --test-threads=1 \
        --exact parity_13_7_3 parity_no_hidden_layer 2>&1 | tail -4
    echo "$tool rc=${PIPESTATUS[0]}"
done
tar czf "$OUT/runs.tgz" -C /tmp gpu-mnist/logs gpu-mnist/metrics.jsonl large-cuda/logs large-cuda/metrics.jsonl \
    large-cpu/logs large-cpu/metrics.jsonl gpu-cnn/logs 2>/dev/null
step "done"
