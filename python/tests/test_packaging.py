"""The package as a user installs it: a source distribution that holds what its build needs
(the protocol file ps-proto's build script compiles, the type-hint marker), a version, the
import name and its alias, and the sdist installed into a new virtual environment running a
cluster with the executables that come with it."""

import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

import ps
from common import BIN, REPO, Shards, config_text


def test_version_is_the_packages():
    meta = tomllib.loads((REPO / "python" / "pyproject.toml").read_text())
    assert ps.__version__ == meta["project"]["version"]


# maturin: on PATH (scripts/python-tests.sh), else the test venv's
MATURIN = shutil.which("maturin") or str(Path(sys.executable).parent / "maturin")


@pytest.mark.skipif(not Path(MATURIN).exists(), reason="maturin not installed")
def test_the_sdist_holds_the_protocol_and_the_type_hints(tmp_path):
    out = subprocess.run([MATURIN, "sdist", "-o", str(tmp_path)], cwd=REPO / "python",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
        proto = t.extractfile(next(m for m in t.getmembers()
                                   if m.name.endswith("ps-common/proto/proto/ps.proto"))).read()
    # the package, its alias, its build backend, and the crates of the executables it ships
    assert {"ps-common/proto/build.rs", "ps-common/proto/proto/ps.proto", "ps_torch/py.typed",
            "ps_torch/__init__.py", "ps_torch/_native.pyi", "ps/__init__.py",
            "_build/ps_torch_build.py", "ps-server/service/Cargo.toml", "deploy/launch/Cargo.toml",
            "ps-worker/Cargo.toml"} <= names, sorted(names)
    assert proto == (REPO / "proto" / "ps.proto").read_bytes()


def test_import_ps_is_the_ps_torch_package():
    """The import name is ps_torch; `import ps` (the first name) is the same module."""
    import ps_torch

    assert ps is ps_torch and ps.Worker is ps_torch.Worker
    assert ps_torch._native.Client.__module__ == "ps_torch._native"


def test_the_build_backend_refuses_an_executable_newer_than_the_manylinux_tag():
    """maturin's auditwheel check covers only the extension; the backend checks the
    executables it adds: built on glibc >= 2.34 they need GLIBC_2.34 (pthread_create,
    __libc_start_main), so manylinux_2_34 passes (on this machine's glibc 2.36) and
    manylinux_2_28 is refused, naming the executable and the version."""
    sys.path.insert(0, str(REPO / "python" / "_build"))
    try:
        import ps_torch_build
    finally:
        sys.path.pop(0)
    exe = BIN / "ps-server"
    newest, libs = ps_torch_build.glibc_needs(exe)
    assert newest >= (2, 34) and libs <= ps_torch_build.MANYLINUX_LIBS, (newest, libs)
    ps_torch_build.check_manylinux(f"manylinux_{newest[0]}_{newest[1]}_x86_64", exe)
    ps_torch_build.check_manylinux("linux_x86_64", exe)  # a local build: no claim to check
    with pytest.raises(RuntimeError, match=r"ps-server needs GLIBC_2\.3\d, newer than the "
                                           r"wheel's tag manylinux_2_28_x86_64 allows"):
        ps_torch_build.check_manylinux("manylinux_2_28_x86_64", exe)


def test_the_type_stub_names_what_the_extension_has():
    """ps_torch/_native.pyi (the extension's type hints) has every public name of the module
    and of its Client, and nothing more, so a change to python/src/ shows here."""
    import ast

    stub = ast.parse((REPO / "python" / "ps_torch" / "_native.pyi").read_text())

    def names(body):
        out = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.AnnAssign):
                out.add(node.target.id)
        return {n for n in out if not n.startswith("_")}

    (client,) = [n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "Client"]
    public = lambda obj: {n for n in dir(obj) if not n.startswith("_")}  # noqa: E731
    assert names(stub.body) == public(ps._native)
    assert names(client.body) == public(ps._native.Client)


def test_the_sdist_installs_into_a_fresh_venv_and_runs_a_cluster(tmp_path):
    """What `pip install ps-torch-<version>.tar.gz` gives a user, in a virtual environment
    that has never seen the package: the source distribution (built here) is unpacked and
    built by pip (`--no-index`: nothing is downloaded), and the installed package alone runs
    a cluster: its executables (ps-server, ps-launch, ps-worker on the venv's PATH, stripped,
    `--help`), the example copied out of the repository as two workers against two shards of
    the installed ps-server, `ps-launch --export` of the result, and a whole `ps-launch` run of
    the built-in MLP (ps-launch starting the venv's ps-server and ps-worker).

    Fair as a fresh venv: the package's files come only from the sdist (asserted: ps_torch,
    ps and the executables resolve inside the new venv); its third-party dependencies (torch,
    numpy, safetensors) are the test venv's, seen through a .pth file (`site.addsitedir`),
    the same files pip would install from the index, which pip must find to satisfy the
    sdist's declared requirements. The Rust build reuses the workspace's target directory
    (compiled dependencies); the sdist is unpacked to a fixed folder of it, so a second run
    rebuilds nothing."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    out = subprocess.run([MATURIN, "sdist", "-o", str(tmp_path)], cwd=REPO / "python",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (sdist,) = tmp_path.glob("ps_torch-*.tar.gz")
    unpacked = target / "sdist-check"
    shutil.rmtree(unpacked, ignore_errors=True)
    with tarfile.open(sdist) as t:
        t.extractall(unpacked, filter="data")
    (src,) = unpacked.iterdir()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site_dir = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path("
                                    "'purelib'))"], capture_output=True, text=True,
                                   check=True).stdout.strip())
    import site

    (site_dir / "deps.pth").write_text(
        f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n")
    # maturin's backend runs `maturin` from PATH
    env = {**os.environ, "CARGO_TARGET_DIR": str(target),
           "PATH": f"{Path(MATURIN).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install",
                          "--no-index", "--no-build-isolation", str(src)], env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]

    bin_dir = venv / "bin"
    where = subprocess.run(
        [py, "-c", "import importlib.metadata as m, ps, ps_torch; print(ps_torch.__file__); "
         "print(ps is ps_torch); print(ps_torch.__version__); print(m.requires('ps-torch'))"],
        capture_output=True, text=True, check=True, cwd=tmp_path).stdout.splitlines()
    assert Path(where[0]).is_relative_to(venv), where
    assert where[1:3] == ["True", tomllib.loads(
        (REPO / "python" / "pyproject.toml").read_text())["project"]["version"]], where
    assert {"numpy", "torch", "safetensors"} <= set(eval(where[3])), where
    for exe in ("ps-server", "ps-launch", "ps-worker"):
        out = subprocess.run([bin_dir / exe, "--help"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "Usage" in out.stdout, (exe, out.stderr)
        syms = subprocess.run(["objdump", "-h", bin_dir / exe], capture_output=True,
                              text=True, check=True).stdout
        assert ".symtab" not in syms and ".debug_line" not in syms, f"{exe} is not stripped"

    # the example, copied out of the repository, as 2 workers of the installed package
    example = tmp_path / "train_cnn.py"
    shutil.copy(REPO / "python" / "examples" / "train_cnn.py", example)
    data_dir = REPO / "data" / "mnist"
    run = tmp_path / "run"
    run.mkdir()
    init = run / "init.safetensors"
    subprocess.run([py, str(example), "--data", str(data_dir), "--write-init", str(init)],
                   check=True, cwd=tmp_path, timeout=300)
    cfg = run / "run.toml"
    cfg.write_text(config_text(init, data_dir, run, workers=2, global_batch=32, steps=10))
    with Shards(cfg, 2, run, bin_dir=bin_dir) as shards:
        workers = [subprocess.Popen(
            [py, str(example), "--config", str(cfg), "--rank", str(r), "--servers",
             ",".join(shards.addrs), "--data", str(data_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
            for r in range(2)]
        outs = [w.communicate(timeout=300)[0] for w in workers]
        for r, (w, o) in enumerate(zip(workers, outs)):
            assert w.returncode == 0, f"rank {r}: {o}"
        assert shards.wait(60) == [0, 0]
    out = subprocess.run([bin_dir / "ps-launch", "--config", str(cfg), "--export"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    check = ("import sys, torch; sys.path.insert(0, '.'); from train_cnn import SmallCNN; "
             "from safetensors.torch import load_file; "
             f"SmallCNN().load_state_dict(load_file({str(run / 'model.safetensors')!r}), "
             "strict=True)")
    subprocess.run([py, "-c", check], check=True, cwd=tmp_path, timeout=120)

    # ps-launch alone: shards and Rust workers of the built-in MLP, from the venv's bin/
    mlp = tmp_path / "mlp"
    mlp.mkdir()
    (mlp / "run.toml").write_text(f"""
[cluster]
servers = ["127.0.0.1:0", "127.0.0.1:0"]
workers = 2
[model]
hidden = [32]
[data]
dir = "{data_dir}"
[train]
global_batch = 32
steps = 5
seed = 1
loss_reduction = "mean"
aggregation = "mean"
[optimizer]
kind = "sgd"
lr = 0.1
[server]
out_dir = "{mlp}"
""")
    out = subprocess.run([bin_dir / "ps-launch", "--config", str(mlp / "run.toml"),
                          "--timeout-secs", "120"], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (mlp / "model.safetensors").exists(), sorted(p.name for p in mlp.iterdir())
