"""The build backend of ps-torch (PEP 517, in-tree: ``backend-path = ["_build"]``).

It is maturin's backend, which builds the extension module ``ps_torch._native``, plus the
cluster's executables: ``build_wheel`` (and ``build_editable``) also compile ``ps-server``,
``ps-launch`` and ``ps-worker`` with cargo in the same workspace and target directory (so they
share the extension's compiled dependencies), strip them, and add them to the wheel under
``<name>-<version>.data/scripts/``. pip installs those files into the environment's ``bin/``, as
it does a console script, and ``ps-launch`` finds ``ps-server`` and ``ps-worker`` beside itself.
This is the wheel layout maturin itself uses for Rust binaries (``bindings = "bin"``); maturin
cannot put binaries beside a PyO3 module, hence this wrapper. The source distribution carries
their crates because ``python/Cargo.toml`` names them (never compiled into the extension).

A wheel whose platform tag is ``manylinux_2_X`` is refused when an executable needs a newer
glibc symbol or a library outside the manylinux set: maturin's auditwheel check covers only the
extension module. Needs ``strip`` and ``objdump`` (binutils, which the Rust linker needs anyway).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
import zipfile
from pathlib import Path

import maturin
from maturin import (  # noqa: F401  (the hooks this backend does not change)
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

BINARIES = ("ps-server", "ps-launch", "ps-worker")

# the libraries a manylinux executable may link (PEP 600's policy for x86_64, minus the X11 ones)
MANYLINUX_LIBS = {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2",
                  "librt.so.1", "libutil.so.1", "ld-linux-x86-64.so.2"}


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = maturin.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_executables(Path(wheel_directory) / name)
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = maturin.build_editable(wheel_directory, config_settings, metadata_directory)
    add_executables(Path(wheel_directory) / name)
    return name


def compile_executables() -> dict[str, Path]:
    """Builds the executables (release) in the workspace of the extension's crate; their paths.
    From the workspace's root manifest with no package selected, as `cargo build --release
    --bin ps-server ...` there does (scripts/python-tests.sh): the same feature unification, so
    the same compiled crates, not a second variant of each."""
    tool = tomllib.loads(Path("pyproject.toml").read_text()).get("tool", {}).get("maturin", {})
    manifest = tool.get("manifest-path", "Cargo.toml")
    root = subprocess.run(["cargo", "locate-project", "--workspace", "--message-format", "plain",
                           "--manifest-path", manifest], capture_output=True, text=True)
    if root.returncode != 0:
        raise RuntimeError(f"cargo locate-project: {root.stderr.strip()}")
    cmd = ["cargo", "build", "--release", "--manifest-path", root.stdout.strip(),
           "--message-format=json-render-diagnostics"]
    for b in BINARIES:
        cmd += ["--bin", b]
    print("Running `{}`".format(" ".join(cmd)), flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"cargo failed to build {', '.join(BINARIES)} (exit {out.returncode})")
    exes = {}
    for line in out.stdout.splitlines():
        msg = json.loads(line) if line.startswith("{") else {}
        if msg.get("reason") == "compiler-artifact" and msg.get("executable"):
            exes[Path(msg["executable"]).name] = Path(msg["executable"])
    missing = [b for b in BINARIES if b not in exes]
    if missing:
        raise RuntimeError(f"cargo built no executable named {', '.join(missing)}")
    return exes


def glibc_needs(exe: Path) -> tuple[tuple[int, int], set[str]]:
    """The newest glibc symbol version an executable needs, and the libraries it links."""
    syms = subprocess.run(["objdump", "-T", str(exe)], capture_output=True, text=True, check=True)
    versions = [tuple(map(int, v)) for v in re.findall(r"GLIBC_(\d+)\.(\d+)", syms.stdout)]
    heads = subprocess.run(["objdump", "-p", str(exe)], capture_output=True, text=True, check=True)
    return max(versions, default=(2, 0)), set(re.findall(r"NEEDED\s+(\S+)", heads.stdout))


def check_manylinux(tag: str, exe: Path) -> None:
    """Refuses an executable that a `manylinux_2_X` platform tag would misdescribe."""
    m = re.search(r"manylinux_(\d+)_(\d+)", tag)
    if not m:
        return
    allowed = (int(m[1]), int(m[2]))
    newest, libs = glibc_needs(exe)
    if newest > allowed:
        raise RuntimeError(f"{exe.name} needs GLIBC_{newest[0]}.{newest[1]}, newer than the "
                           f"wheel's tag {tag} allows")
    if libs - MANYLINUX_LIBS:
        raise RuntimeError(f"{exe.name} links {sorted(libs - MANYLINUX_LIBS)}, outside the "
                           f"manylinux policy of {tag}")


def record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def add_executables(wheel: Path) -> None:
    """Rewrites `wheel` with the stripped executables under its .data/scripts/ and in RECORD."""
    exes = compile_executables()
    platform_tag = wheel.stem.split("-")[-1]
    with tempfile.TemporaryDirectory() as tmp:
        stripped = {}
        for name in BINARIES:
            out = Path(tmp) / name
            subprocess.run(["strip", "-o", str(out), str(exes[name])], check=True)
            check_manylinux(platform_tag, out)
            stripped[name] = out.read_bytes()
            print(f"ps-torch: {name}: {exes[name].stat().st_size} bytes, stripped "
                  f"{len(stripped[name])}", flush=True)
        new = Path(tmp) / wheel.name
        with zipfile.ZipFile(wheel) as src, \
                zipfile.ZipFile(new, "w", zipfile.ZIP_DEFLATED) as dst:
            (record,) = [n for n in src.namelist() if n.endswith(".dist-info/RECORD")]
            data_dir = record[: -len(".dist-info/RECORD")] + ".data/scripts"
            lines = src.read(record).decode().splitlines()
            for info in src.infolist():
                if info.filename != record:
                    dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
            for name, data in stripped.items():
                info = zipfile.ZipInfo(f"{data_dir}/{name}", date_time=(2020, 1, 1, 0, 0, 0))
                info.external_attr = 0o100755 << 16  # a regular file, executable
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                lines.insert(lines.index(f"{record},,"), record_line(info.filename, data))
            dst.writestr(src.getinfo(record), "\n".join(lines) + "\n")
        shutil.move(new, wheel)
        os.chmod(wheel, 0o644)
