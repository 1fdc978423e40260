#!/usr/bin/env bash
# gpu-session.sh: one device call's worth of GPU checks, from the bundle of scripts/gpu-bundle.sh
# (.dev/gpu-bin.tar.xz, .dev/pypkg.tar.xz, optionally .dev/gpu-old.tar.xz), run from the
# repository root on the GPU machine; everything it prints goes to $OUT/all.log too, and
# gpu-check.sh's report and JSON into $OUT. In order (a section that would pass the deadline
# is skipped, saying so):
#   1. the driver, the libraries, NVRTC compiling the kernels, the ps-worker CUDA unit tests,
#      and the registered-board (DMA) tests: 0 host bytes copied on pull and push, a torn
#      version refused (cuda_dma, real cuMemHostRegister)
#   2. scripts/gpu-check.sh: every CUDA parity test, the CUDA-worker clusters against the
#      single process (cluster_cuda), gpu-bench and the same MLPs and CNN in PyTorch (TF32 off),
#      compared against issue 38's targets (scripts/gpu_compare.py)
#   3. the 784-4096-4096-10 MLP, global batch 1024, 2 shards and 2 CUDA workers sharing the
#      GPU: with gpu-old (when bundled) and this build alternately, ROUNDS times; then the
#      same through gRPC (`[cluster] transport = "grpc"`) once each, and with CPU workers (16 cores)
#   4. the default job (deploy/mnist.toml) with CUDA workers, against the single process
#   5. compute-sanitizer (memcheck, racecheck, synccheck) on small parity cases and the gated pull
#   6. the Python worker with a CUDA model (scripts/py_cuda_check.py), its gradients leaving
#      the GPU by non-blocking copies into the registered push buffer (python/tests/test_cuda_push.py),
#      and ResNet-18 (CIFAR-shaped, batch 128 per worker) with 2 ps_torch workers and 2 shards
#      against one PyTorch process at the same global batch (python/bench/ps_torch_resnet.py)
#   7. the Fashion-MNIST CNN job with CUDA workers, against the single process
# Environment: DEADLINE (seconds for the whole script, default 400), ROUNDS (2), LARGE_STEPS (60),
# SKIP_CHECK=1 (no section 2), STOP_AFTER=N (end after section N), SECTIONS="N ..." (only those
# sections, e.g. a first call with SECTIONS="1 2 3" and a second with SECTIONS="4 5 6 7").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
T0=$(date +%s)
DEADLINE="${DEADLINE:-400}"
ROUNDS="${ROUNDS:-2}"
LARGE_STEPS="${LARGE_STEPS:-60}"
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
step() { echo; echo "=================== $* (t=$(($(date +%s) - T0))s, left $(left)s)"; }
want() { # want N: section N is in SECTIONS (default every section), else it says it is skipped
    case " ${SECTIONS:-1 2 3 4 5 6 7} " in *" $1 "*) return 0 ;; esac
    echo; echo "=================== section $1 skipped (SECTIONS=${SECTIONS:-})"; return 1
}
bounded() { # bounded MAX CMD...: runs CMD for at most min(MAX, the time left - 5) seconds
    local max="$1" l=$(($(left) - 5))
    shift
    [ "$l" -lt "$max" ] && max="$l"
    if [ "$max" -le 5 ]; then echo "SKIPPED (no time left): $*"; return 124; fi
    timeout --kill-after=5 "$max" "$@"
}
OUT="${OUT:-/tmp/gpu-session}"
mkdir -p "$OUT"
exec > >(tee "$OUT/all.log") 2>&1
# the runs' logs and metrics (not their weights) come back as $OUT/runs.tgz, however it ends
pack() {
    local runs
    runs="$(cd /tmp && ls -d large-* gpu-mnist gpu-cnn gpu-mnist.log gpu-cnn.log 2>/dev/null)"
    # shellcheck disable=SC2086
    [ -n "$runs" ] && tar czf "$OUT/runs.tgz" --exclude='*.safetensors' --exclude='*tfevents*' -C /tmp $runs
}
trap pack EXIT
for p in gpu-bin pypkg gpu-old; do
    [ -f ".dev/$p.tar.xz" ] && tar xJf ".dev/$p.tar.xz" -C .dev
done
B="$PWD/.dev/gpu-bin"
[ -x "$B/ps-worker" ] || { echo "gpu-session: no $B/ps-worker: run scripts/gpu-bundle.sh here first"; exit 2; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_LOG=info

if want 1; then
step "1. driver, libraries, NVRTC, unit tests"
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm --format=csv
echo "cores $(nproc), binaries of $(cat "$B/BUILD" 2>/dev/null || echo 'an unknown commit')"
bounded 120 "$B/ps_worker_lib" --include-ignored --test-threads=1 cuda:: device::
echo "rc unit=$?"
if [ -x "$B/cuda_dma" ]; then bounded 60 "$B/cuda_dma" --ignored --test-threads=1; echo "rc dma=$?"; fi
fi

if want 2; then
step "2. gpu-check.sh: parity, cluster_cuda, gpu-bench, PyTorch"
if [ "${SKIP_CHECK:-0}" = 1 ]; then echo "skipped (SKIP_CHECK=1)"; else
    STEPS=30 WARMUP=5 bounded 200 scripts/gpu-check.sh "$B"; fi
echo "rc gpu-check=$?"
find bench/results -name 'gpu-*' -newermt "@$T0" -exec cp {} "$OUT/" \;
fi

median() { # median FIELD metrics.jsonl: over the steps after the first 5
    python3 -c "import json,sys,statistics as s;r=[json.loads(l) for l in open(sys.argv[2]) if '\"step_ms\"' in l][5:];print('%.2f' % s.median(x[sys.argv[1]] for x in r) if r else '-')" "$1" "$2"
}
large() { # large LABEL BIN_DIR DEVICE STEPS [--set K=V ...]
    local label="$1" d="/tmp/large-$1" bin="$2" dev="$3" steps="$4"
    shift 4
    bounded 90 "$bin/ps-launch" --config deploy/mnist.toml --out-dir "$d" \
        --set 'model.hidden=[4096,4096]' --set train.steps="$steps" --set train.global_batch=1024 \
        --set train.eval_every=0 --set train.log_every=1000 --set worker.device="$dev" "$@" >"$d.log" 2>&1
    echo "rc large $label=$? | median step_ms $(median step_ms "$d/metrics.jsonl") apply_ms $(median apply_ms "$d/metrics.jsonl") barrier_wait_ms $(median barrier_wait_ms "$d/metrics.jsonl") | $(grep -h 'training finished' "$d.log" | sed 's/.*INFO //')"
    grep -h "done after" "$d"/logs/worker-*.log | sed 's/.*INFO //'
}
if want 3; then
step "3. 784-4096-4096-10, global batch 1024, 2 shards, 2 CUDA workers on one GPU"
for r in $(seq 1 "$ROUNDS"); do
    [ -x .dev/gpu-old/ps-worker ] && large "old-$r" .dev/gpu-old cuda "$LARGE_STEPS"
    large "new-$r" "$B" cuda "$LARGE_STEPS"
done
[ -x .dev/gpu-old/ps-worker ] && large old-grpc .dev/gpu-old cuda "$LARGE_STEPS" --set cluster.transport=grpc
large new-grpc "$B" cuda "$LARGE_STEPS" --set cluster.transport=grpc
large cpu "$B" cpu 20
fi

stop_after() { [ "${STOP_AFTER:-9}" -le "$1" ] && { step "done (STOP_AFTER=$STOP_AFTER)"; exit 0; }; }
stop_after 3

if want 4; then
step "4. the default job, CUDA workers, against the single process"
bounded 120 "$B/ps-launch" --config deploy/mnist.toml --set worker.device=cuda --check-reference \
    --out-dir /tmp/gpu-mnist >/tmp/gpu-mnist.log 2>&1
echo "rc default job=$?"
grep -A12 "^reference check" /tmp/gpu-mnist.log
grep -h "training finished" /tmp/gpu-mnist.log | sed 's/.*INFO //'
grep -h "device cuda\|done after" /tmp/gpu-mnist/logs/worker-*.log | sed 's/.*INFO //'
fi

stop_after 4
if want 5; then
step "5. compute-sanitizer"
for tool in memcheck racecheck synccheck; do
    bounded 60 compute-sanitizer --tool "$tool" --error-exitcode 9 "$B/cuda_parity" --ignored --test-threads=1 \
        --exact parity_13_7_3 gated_pull_uploads_pieces_as_they_arrive 2>&1 | grep -E "SUMMARY|test result"
    echo "$tool rc=${PIPESTATUS[0]}"
done
fi

stop_after 5
if want 6; then
step "6. the Python worker with a CUDA model"
PS_BIN_DIR="$B" PYTHONPATH="$PWD/.dev/pypkg" PYTHONUNBUFFERED=1 bounded 90 python3 scripts/py_cuda_check.py
echo "rc python=$?"
PS_BIN_DIR="$B" PYTHONPATH="$PWD/.dev/pypkg" PYTHONUNBUFFERED=1 bounded 90 python3 python/tests/test_cuda_push.py
echo "rc python push=$?"
PS_BIN_DIR="$B" PYTHONPATH="$PWD/.dev/pypkg" PYTHONUNBUFFERED=1 bounded 90 python3 python/bench/ps_torch_resnet.py \
    --device cuda --steps 30 --timeout 70 --json "$OUT/ps-torch-resnet.json"
echo "rc resnet=$?"
fi

if want 7; then
step "7. the Fashion-MNIST CNN job on CUDA workers, against the single process"
bounded 90 "$B/ps-launch" --config deploy/fashion-cnn.toml --set worker.device=cuda --set train.steps=300 \
    --check-reference --out-dir /tmp/gpu-cnn >/tmp/gpu-cnn.log 2>&1
echo "rc cnn=$?"
grep -E "after [0-9]+ step|test accuracy  |verdict" /tmp/gpu-cnn.log
fi
step "done"
