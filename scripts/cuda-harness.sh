#!/usr/bin/env bash
# The GPU-less CUDA harness (ps-worker/cuda-harness/): builds a CPU emulation of libcuda +
# libcublas that runs the real ps-worker/src/cuda/kernels.cu on the CPU behind the real cudarc
# and the real NVRTC (pip's nvidia-cuda-nvrtc, in target/cuda-harness/venv), then
#   scripts/cuda-harness.sh test        runs the CUDA tests under it (what .ci/run runs):
#                                       NVRTC compiles every kernel for sm_80 and sm_90, the
#                                       ps-worker lib tests with a "GPU" present, the CUDA parity
#                                       tests, the registered-board (DMA) tests, a --device cuda
#                                       cluster against the reference,
#                                       the exact-sum mode's CUDA workers at W = 1 and 2, and
#                                       gpu-bench's CNN path;
#   scripts/cuda-harness.sh run CMD...  runs CMD under it (e.g. target/release/ps-launch ...).
# An emulation, not a GPU: the device calls itself "cuda-harness CPU emulation (not a GPU)",
# each process prints "CUDA-HARNESS: ..." at exit, and a harness check that fails (a bounds,
# context, launch-shape or BLAS-argument error, a kernel it does not emulate) makes the process
# exit with status 86. Stream-ordering races and speed cannot show here. Needs g++ and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
W="$ROOT/target/cuda-harness"
mkdir -p "$W/lib"
if ! ls "$W"/venv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 >/dev/null 2>&1; then
    echo "cuda-harness: installing NVRTC (pip nvidia-cuda-nvrtc==13.0.*) into $W/venv" >&2
    python3 -m venv "$W/venv"
    "$W/venv/bin/pip" install --quiet "nvidia-cuda-nvrtc==13.0.*"
fi
NVRTC="$(dirname "$(ls "$W"/venv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 | head -n1)")"
SRC="$ROOT/ps-worker/cuda-harness"
LIB="$W/libcudaharness.so"
if [ ! -f "$LIB" ] || [ -n "$(find "$SRC" "$ROOT/ps-worker/src/cuda/kernels.cu" -newer "$LIB" -print -quit)" ]; then
    echo "cuda-harness: building $LIB" >&2
    g++ -std=c++17 -O2 -fPIC -shared -ffp-contract=off -Wall -Wno-unused-function -Wno-sign-compare \
        -DKERNELS_CU="\"$ROOT/ps-worker/src/cuda/kernels.cu\"" -o "$LIB.tmp" "$SRC/harness.cpp"
    mv "$LIB.tmp" "$LIB"
fi
# libcuda.so only (not .so.1): NVRTC 13 dlopens libcuda.so.1 itself and calls cuGetExportTable
for n in libcuda.so libcublas.so libcublas.so.13; do ln -sf "$LIB" "$W/lib/$n"; done
export LD_LIBRARY_PATH="$W/lib:$NVRTC${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PS_CUDA_HARNESS=1

case "${1:-}" in
run)
    shift
    exec "$@"
    ;;
test)
    shift
    # one test thread: the emulation is one process-wide "device" and slow; the tests are small
    cargo test --release -p ps-worker --lib -- --include-ignored --test-threads=1
    cargo test --release -p ps-worker --test cli -- --include-ignored --test-threads=1
    cargo test --release -p ps-worker --test cuda_parity -- --include-ignored --test-threads=1
    # registered boards: 0 host bytes on pull and push, a torn version refused (and the worker's
    # step redone exactly), unregistration before unmap (the harness checks it at each
    # unregistration and at exit), a refused registration training on staging, said once
    cargo test --release -p ps-worker --test cuda_dma -- --include-ignored --test-threads=1
    cargo test --release -p ps-tests --test cluster_cuda -- --include-ignored --test-threads=1
    cargo test --release -p ps-tests --test exact -- --ignored --test-threads=1 cuda_workers
    # gpu-bench's CNN path (what a GPU session measures) end to end on a small CNN
    cargo test --release -p ps-bench --test cli -- --test-threads=1 gpu_bench
    echo "cuda-harness: every CUDA test passed on the CPU emulation (not a GPU)"
    ;;
*)
    echo "usage: scripts/cuda-harness.sh test | run CMD [ARGS...]" >&2
    exit 2
    ;;
esac
