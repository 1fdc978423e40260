"""The package as a user installs it: a source distribution that holds what its build needs
(the protocol file ps-proto's build script compiles, the type-hint marker), and a version."""

import shutil
import subprocess
import sys
import tarfile
import tomllib

import pytest

import ps
from common import REPO


def test_version_is_the_packages():
    meta = tomllib.loads((REPO / "python" / "pyproject.toml").read_text())
    assert ps.__version__ == meta["project"]["version"]


@pytest.mark.skipif(shutil.which("maturin") is None and not (
    REPO / "target" / "pyenv" / "bin" / "maturin").exists(), reason="maturin not installed")
def test_the_sdist_holds_the_protocol_and_the_type_hints(tmp_path):
    maturin = shutil.which("maturin") or str(REPO / "target" / "pyenv" / "bin" / "maturin")
    out = subprocess.run([maturin, "sdist", "-o", str(tmp_path)], cwd=REPO / "python",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
        proto = t.extractfile(next(m for m in t.getmembers()
                                   if m.name.endswith("ps-proto/proto/ps.proto"))).read()
    assert {"ps-proto/build.rs", "ps-proto/proto/ps.proto", "ps/py.typed",
            "ps/__init__.py"} <= names, sorted(names)
    assert proto == (REPO / "proto" / "ps.proto").read_bytes()
