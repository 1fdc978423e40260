#!/usr/bin/env bash
# The Python worker's tests: creates the virtual environment target/pyenv once (PyTorch, numpy,
# safetensors, maturin, pytest from the package registry, one pip step; pip's cache keeps the
# wheels), builds and installs the package in python/ into it (`pip install ./python`, through
# its build backend python/_build/ps_torch_build.py: maturin, plus ps-server, ps-launch and
# ps-worker into the venv's bin/, reusing the workspace's release build), and runs python/tests
# with pytest. The tests start the workspace's target/release binaries (built first, below);
# test_packaging.py also builds the sdist and installs it into a new venv (CARGO_TARGET_DIR: the
# workspace's target/, so the registry crates are reused and only the 5 workspace crates compile
# again for the unpacked sdist, about 4 CPU-minutes; a second run rebuilds nothing there, but
# ps-common's build script then reruns once for the in-tree build: the two share target/).
set -euo pipefail
cd "$(dirname "$0")/.."
ENV="${PS_PYENV:-target/pyenv}"
if [ ! -x "$ENV/bin/python" ] || ! "$ENV/bin/python" -c "import torch, numpy, safetensors, maturin, pytest" 2>/dev/null; then
    echo "python-tests: creating $ENV (PyTorch from the package registry; minutes on the first run)"
    python3 -m venv "$ENV"
    "$ENV/bin/pip" install --quiet --upgrade pip
    "$ENV/bin/pip" install --quiet torch numpy safetensors maturin pytest
fi
ENV="$(cd "$ENV" && pwd)"  # PS_PYENV may be relative or absolute
export PATH="$ENV/bin:$PATH"
cargo build --release --bin ps-server --bin ps-worker --bin ps-launch
# python -m pip: a venv copied from another checkout keeps bin/pip's shebang to the original
# venv's python, so a plain `pip` would install there
python -m pip install --quiet --no-build-isolation --force-reinstall --no-deps ./python
cd python/tests
exec python -m pytest -q "$@"
