#!/usr/bin/env bash
# gpu-check.sh: run the CUDA backend's parity tests and benchmarks on a GPU machine that has
# no Rust toolchain, from binaries built elsewhere, and write everything into
# bench/results/gpu-<date>-<gpu name>.md (plus the two benchmarks' JSON beside it).
#
# `scripts/gpu-bundle.sh` does step 1 and packs the result for a GPU machine reached through a
# copy of the work tree; `scripts/gpu-session.sh` runs this script there among its checks.
#
# 1. Build, on a machine with Rust (its glibc must not be newer than the GPU host's; the
#    binaries need glibc >= 2.34 and link no CUDA library: cudarc loads libcuda, libnvrtc and
#    libcublas at run time), from the repository root:
#
#      cargo build --release -p ps-bench --bin gpu-bench
#      cargo test --release -p ps-worker --test cuda_parity --no-run
#        # prints: Executable tests/cuda_parity.rs (target/release/deps/cuda_parity-<hash>)
#      mkdir -p .dev/gpu-bin
#      cp target/release/gpu-bench .dev/gpu-bin/
#      cp "$(cargo test --release -p ps-worker --test cuda_parity --no-run 2>&1 \
#            | sed -n 's/.*Executable .*(\(.*cuda_parity-[0-9a-f]*\)).*/\1/p' | head -n1)" .dev/gpu-bin/cuda_parity
#      strip --strip-debug .dev/gpu-bin/gpu-bench .dev/gpu-bin/cuda_parity   # 35+38 MB -> 1+2 MB
#      # the distributed CUDA-workers-vs-reference test and the binaries it starts:
#      cargo build --release --bins
#      cp target/release/ps-server target/release/ps-worker .dev/gpu-bin/
#      cp "$(cargo test --release -p ps-tests --test cluster_cuda --no-run 2>&1 \
#            | sed -n 's/.*Executable .*(\(.*cluster_cuda-[0-9a-f]*\)).*/\1/p' | head -n1)" .dev/gpu-bin/cluster_cuda
#      strip --strip-debug .dev/gpu-bin/ps-server .dev/gpu-bin/ps-worker .dev/gpu-bin/cluster_cuda
#
#    (.dev/ is git-ignored: a tool that copies the work tree to the GPU host must be told to
#    carry .dev/gpu-bin.)
#
# 2. Copy the repository (at least scripts/ and .dev/gpu-bin/) to the GPU host and run, from
#    its root:
#
#      scripts/gpu-check.sh [BIN_DIR]        # BIN_DIR: argument, else $BIN, else .dev/gpu-bin
#
#    BIN_DIR must hold `gpu-bench` and the test executable (`cuda_parity` or `cuda_parity-<hash>`).
#    OLD_BIN (default .dev/gpu-old, where scripts/gpu-session.sh unpacks the bundle's OLD build):
#    when it holds a `gpu-bench` (scripts/gpu-bundle.sh carries one from OLD=DIR), its CNN rows
#    are measured too, right after this build's, and compared (new / old).
#    Environment: PS_CUDA_DEVICE (device ordinal, default 0), STEPS / WARMUP (benchmark steps,
#    default 50 / 10), PYTHON (default python3), SKIP_TORCH=1 to skip the PyTorch comparison.
#    When libnvrtc / libcublas are not in the loader's cache, the script adds
#    /usr/local/cuda/lib64 (or the pip "nvidia-*" wheels' lib directories) to LD_LIBRARY_PATH.
#
# The report ends with scripts/gpu_compare.py's table of ours / PyTorch per MLP and CNN and
# batch (the CNN against PyTorch with cudnn.benchmark on, and with cuDNN's defaults), with
# issue 38's target: the Fashion-MNIST CNN at batch 256 within 2x of PyTorch (PASS or FAIL).
#
# Exit status: non-zero when the parity tests fail (or cannot run); the report is written
# either way. Benchmark failures are recorded in the report but do not change the status.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
BIN_DIR="${1:-${BIN:-.dev/gpu-bin}}"
DEVICE="${PS_CUDA_DEVICE:-0}"
STEPS="${STEPS:-50}"
WARMUP="${WARMUP:-10}"
PYTHON="${PYTHON:-python3}"
OLD_BIN="${OLD_BIN:-.dev/gpu-old}"

die() { echo "gpu-check: $*" >&2; exit 2; }

[ -d "$BIN_DIR" ] || die "no binary folder $BIN_DIR (see the build steps at the top of $0)"
BENCH="$BIN_DIR/gpu-bench"
[ -x "$BENCH" ] || die "$BENCH missing or not executable"
PARITY=""
for f in "$BIN_DIR/cuda_parity" "$BIN_DIR"/cuda_parity-*; do
    if [ -f "$f" ] && [ -x "$f" ] && [[ "$f" != *.d ]]; then PARITY="$f"; break; fi
done
[ -n "$PARITY" ] || die "no cuda_parity test executable in $BIN_DIR (see the build steps at the top of $0)"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: is this a GPU machine with the NVIDIA driver?"

# NVRTC and cuBLAS: cudarc dlopens libnvrtc.so(.13|.12) and libcublas.so(.13|.12) by name.
have_lib() { # is a library named $1* in the loader cache or on LD_LIBRARY_PATH?
    ldconfig -p 2>/dev/null | grep -F "$1" >/dev/null && return 0 # (no grep -q: SIGPIPE under pipefail)
    local d dirs
    IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
    for d in "${dirs[@]}"; do compgen -G "$d/$1*" >/dev/null && return 0; done
    return 1
}
add_path() { [ -d "$1" ] && export LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; }
LIB_NOTE="libnvrtc and libcublas found by the loader"
if ! have_lib libnvrtc.so || ! have_lib libcublas.so; then
    ADDED=""
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        if [ -d "$d" ]; then add_path "$d"; ADDED="$ADDED $d"; break; fi
    done
    if ! have_lib libnvrtc.so || ! have_lib libcublas.so; then
        # pip wheels (nvidia-cuda-nvrtc, nvidia-cublas; -cu12 or CUDA 13's nvidia/cu13), e.g. from PyTorch
        WHEEL_DIRS="$("$PYTHON" - <<'PY' 2>/dev/null
import os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
for r in roots:
    for sub in ("cu13/lib", "cuda_nvrtc/lib", "cublas/lib"):
        d = os.path.join(r, sub)
        if os.path.isdir(d):
            print(d)
PY
)"
        for d in $WHEEL_DIRS; do add_path "$d"; ADDED="$ADDED $d"; done
    fi
    if have_lib libnvrtc.so && have_lib libcublas.so; then
        LIB_NOTE="libnvrtc and libcublas found after adding to LD_LIBRARY_PATH:$ADDED"
    else
        LIB_NOTE="libnvrtc or libcublas NOT FOUND (searched the loader cache, LD_LIBRARY_PATH${ADDED:+,$ADDED}): the CUDA backend will report no GPU"
        echo "gpu-check: warning: $LIB_NOTE" >&2
    fi
fi

GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader -i "$DEVICE" 2>/dev/null | head -n1)"
[ -n "$GPU_NAME" ] || GPU_NAME="unknown-gpu"
SAFE_NAME="$(printf '%s' "$GPU_NAME" | tr ' ' '-' | tr -cd 'A-Za-z0-9._-')"
STAMP="$(date -u +%Y-%m-%d-%H%M%S)"
mkdir -p bench/results
REPORT="bench/results/gpu-$STAMP-$SAFE_NAME.md"
BENCH_JSON="bench/results/gpu-$STAMP-$SAFE_NAME.gpu-bench.json"
OLD_JSON="bench/results/gpu-$STAMP-$SAFE_NAME.gpu-bench-old.json"
TORCH_JSON="bench/results/gpu-$STAMP-$SAFE_NAME.torch.json"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

section() { printf '\n## %s\n\n' "$1" >>"$REPORT"; }
fenced() { { echo '```'; cat "$1"; echo '```'; } >>"$REPORT"; }
run_to() { # run_to FILE CMD...: runs CMD, shows and saves its output, returns its status
    local out="$1"; shift
    echo "+ $*" >&2
    "$@" 2>&1 | tee "$out"
    return "${PIPESTATUS[0]}"
}

{
    echo "# GPU check: $GPU_NAME ($STAMP UTC)"
    echo
    echo "- host: $(hostname), $(uname -sr), $(ldd --version 2>/dev/null | head -n1)"
    # the commit the binaries were built from (scripts/gpu-bundle.sh writes it beside them; a
    # copied work tree's .git may be another's)
    echo "- commit: $(cat "$BIN_DIR/BUILD" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- binaries: \`$BENCH\`, \`$PARITY\`"
    echo "- sha256: $(sha256sum "$BENCH" "$PARITY" 2>/dev/null | awk '{printf "%s %s; ", substr($1,1,16), $2}')"
    echo "- CUDA libraries: $LIB_NOTE; LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    echo "- device: PS_CUDA_DEVICE=$DEVICE"
} >"$REPORT"

section "nvidia-smi"
run_to "$TMP/smi" nvidia-smi -L
nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap,pcie.link.gen.current,clocks.max.sm \
    --format=csv >>"$TMP/smi" 2>&1
ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvrtc\.so|libnvrtc-builtins|libcublas\.so' >>"$TMP/smi"
fenced "$TMP/smi"

section "Parity tests (CPU vs CUDA)"
echo "\`$PARITY --ignored --test-threads=1 --nocapture\`" >>"$REPORT"
echo >>"$REPORT"
PS_CUDA_DEVICE="$DEVICE" run_to "$TMP/parity" "$PARITY" --ignored --test-threads=1 --nocapture
PARITY_RC=$?
fenced "$TMP/parity"
if [ "$PARITY_RC" -eq 0 ]; then echo "**parity: PASS**" >>"$REPORT"; else echo "**parity: FAIL (exit $PARITY_RC)**" >>"$REPORT"; fi

section "Distributed run with CUDA workers vs the single-process reference"
CLUSTER_RC=0
if [ -x "$BIN_DIR/cluster_cuda" ] && [ -x "$BIN_DIR/ps-server" ] && [ -x "$BIN_DIR/ps-worker" ]; then
    PS_DATA_DIR="$ROOT/data/mnist" run_to "$TMP/cluster" "$BIN_DIR/cluster_cuda" --ignored --test-threads=1 --nocapture
    CLUSTER_RC=$?
    fenced "$TMP/cluster"
    if [ "$CLUSTER_RC" -eq 0 ]; then echo "**cluster: PASS**" >>"$REPORT"; else echo "**cluster: FAIL (exit $CLUSTER_RC)**" >>"$REPORT"; fi
else
    echo "not run: $BIN_DIR lacks cluster_cuda, ps-server or ps-worker (see the build steps)" | tee -a "$REPORT"
fi

section "gpu-bench (ps-worker CUDA backend)"
run_to "$TMP/bench" "$BENCH" --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP" --json "$BENCH_JSON"
BENCH_RC=$?
cat "$TMP/bench" >>"$REPORT"
[ "$BENCH_RC" -eq 0 ] || echo "**gpu-bench failed (exit $BENCH_RC)**" >>"$REPORT"
[ -f "$BENCH_JSON" ] && echo "JSON: \`$BENCH_JSON\`" >>"$REPORT"

if [ -x "$OLD_BIN/gpu-bench" ]; then
    section "gpu-bench of the old build ($OLD_BIN, $(cat "$OLD_BIN/BUILD" 2>/dev/null || echo 'commit unknown')): the CNN only"
    run_to "$TMP/old" "$OLD_BIN/gpu-bench" --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP" --models none \
        --json "$OLD_JSON"
    OLD_RC=$?
    cat "$TMP/old" >>"$REPORT"
    [ "$OLD_RC" -eq 0 ] || echo "**old gpu-bench failed (exit $OLD_RC)**" >>"$REPORT"
fi

section "PyTorch reference (same MLPs and CNN, FP32, TF32 off)"
if [ "${SKIP_TORCH:-0}" = 1 ]; then
    echo "skipped (SKIP_TORCH=1)" >>"$REPORT"
elif ! command -v "$PYTHON" >/dev/null; then
    echo "skipped: $PYTHON not found" >>"$REPORT"
else
    run_to "$TMP/torch" "$PYTHON" scripts/torch_mlp_bench.py --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP" \
        --json "$TORCH_JSON"
    TORCH_RC=$?
    cat "$TMP/torch" >>"$REPORT"
    [ "$TORCH_RC" -eq 0 ] || echo "**torch_mlp_bench failed (exit $TORCH_RC)**" >>"$REPORT"
    [ -f "$TORCH_JSON" ] && echo "JSON: \`$TORCH_JSON\`" >>"$REPORT"
fi

section "gpu-bench against PyTorch (ours / PyTorch; issue 38: the Fashion-MNIST CNN at batch 256 <= 2x)"
if [ -f "$BENCH_JSON" ] && [ -f "$TORCH_JSON" ]; then
    OLD_ARG=()
    [ -f "$OLD_JSON" ] && OLD_ARG=("$OLD_JSON")
    run_to "$TMP/compare" "$PYTHON" scripts/gpu_compare.py "$BENCH_JSON" "$TORCH_JSON" "${OLD_ARG[@]}"
    cat "$TMP/compare" >>"$REPORT"
else
    echo "not compared: $([ -f "$BENCH_JSON" ] || echo "no gpu-bench JSON; ")$([ -f "$TORCH_JSON" ] || echo "no PyTorch JSON")" | tee -a "$REPORT"
fi

echo
echo "gpu-check: wrote $REPORT"
if [ "$PARITY_RC" -ne 0 ] || [ "$CLUSTER_RC" -ne 0 ]; then
    echo "gpu-check: GPU tests FAILED (parity exit $PARITY_RC, cluster exit $CLUSTER_RC)" >&2
    exit 1
fi
echo "gpu-check: parity tests passed"
