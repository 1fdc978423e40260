#!/usr/bin/env bash
# gpu-bundle.sh: builds, here (a machine with Rust), everything scripts/gpu-session.sh runs on a
# GPU machine that has no Rust toolchain, stripped and packed small enough to travel with the
# work tree (the device tool's limit is 64 MiB in all; the tracked tree is ~44 MB):
#   .dev/gpu-bin.tar.xz   ps-worker, ps-server, ps-launch, gpu-bench, and the test executables
#                         ps_worker_lib (the --lib tests), cuda_parity, cuda_dma and cluster_cuda, side by
#                         side (cluster_cuda and ps-launch start the binaries of their own folder)
#   .dev/pypkg.tar.xz     the Python package (ps, ps_torch and its native module, abi3)
#   .dev/gpu-old.tar.xz   with OLD=DIR (a folder holding another build's ps-worker): that
#                         ps-worker beside this build's ps-server and ps-launch, for an A/B of
#                         the worker alone in the same device call; and that folder's gpu-bench
#                         when it has one (gpu-check.sh then times the old build's CNN beside
#                         this one's; it needs `--cnns`, so build it from a commit that has
#                         it with the old ps-worker: `cargo build --release -p ps-bench --bin
#                         gpu-bench`)
# Then, e.g.: device run with carry [".dev"]: DEADLINE=300 bash scripts/gpu-session.sh
set -euo pipefail
cd "$(dirname "$0")/.."
exe() { # the test executable cargo prints for `cargo test --release ARGS --no-run`
    cargo test --release "$@" --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | head -n1
}
cargo build --release --bins
cargo build --release -p ps-python
LIB="$(exe -p ps-worker --lib)"
PARITY="$(exe -p ps-worker --test cuda_parity)"
DMA="$(exe -p ps-worker --test cuda_dma)"
CLUSTER="$(exe -p ps-tests --test cluster_cuda)"
rm -rf .dev/gpu-bin .dev/pypkg .dev/gpu-old
mkdir -p .dev/gpu-bin .dev/pypkg/ps .dev/pypkg/ps_torch
cp target/release/{ps-worker,ps-server,ps-launch,gpu-bench} .dev/gpu-bin/
cp "$LIB" .dev/gpu-bin/ps_worker_lib
cp "$PARITY" .dev/gpu-bin/cuda_parity
cp "$DMA" .dev/gpu-bin/cuda_dma
cp "$CLUSTER" .dev/gpu-bin/cluster_cuda
strip --strip-all .dev/gpu-bin/*
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!bench' || echo ' with uncommitted changes')" >.dev/gpu-bin/BUILD
cp python/ps/*.py .dev/pypkg/ps/
cp python/ps_torch/*.py .dev/pypkg/ps_torch/
cp target/release/lib_native.so .dev/pypkg/ps_torch/_native.abi3.so
strip --strip-all .dev/pypkg/ps_torch/_native.abi3.so
packs=(gpu-bin pypkg)
if [ -n "${OLD:-}" ]; then
    mkdir -p .dev/gpu-old
    cp .dev/gpu-bin/{ps-server,ps-launch} .dev/gpu-old/
    cp "$OLD/ps-worker" .dev/gpu-old/
    strip --strip-all .dev/gpu-old/ps-worker
    if [ -x "$OLD/gpu-bench" ]; then
        cp "$OLD/gpu-bench" .dev/gpu-old/
        strip --strip-all .dev/gpu-old/gpu-bench
    fi
    if [ -f "$OLD/BUILD" ]; then cp "$OLD/BUILD" .dev/gpu-old/; fi
    packs+=(gpu-old)
fi
for p in "${packs[@]}"; do
    tar cJf ".dev/$p.tar.xz" -C .dev "$p"
    rm -rf ".dev/$p"
done
rm -f .dev/gpu-bin.tgz .dev/pypkg.tgz
ls -la .dev
