"""Every command the examples print (the docstrings of python/examples/*.py) runs as printed,
from ``python/`` as they say, in a copy of the repository's layout: the ``--write-init``
command writes the init file that its config's ``[model] init`` names; every ``--config``
exists, loads and declares exactly the example's model (``ps.Worker``'s own check); every
``--data`` is the config's ``[data] dir``; every flag is one of the example's."""

import ast
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest

from common import REPO
from ps import _native

EXAMPLES = REPO / "python" / "examples"
MODELS = {"train_cnn.py": "SmallCNN", "train_resnet.py": "SmallResNet"}


def printed_commands(example):
    doc = ast.get_docstring(ast.parse((EXAMPLES / example).read_text()))
    lines = [l.strip() for l in doc.splitlines()]
    return [shlex.split(l.removesuffix("&")) for l in lines
            if l.startswith(("python examples/", "ps-server "))]


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("example", list(MODELS))
def test_every_printed_command_of_the_example_runs_as_printed(example, tmp_path):
    commands = printed_commands(example)
    assert any("--write-init" in c for c in commands), commands
    assert sum("--rank" in c for c in commands) == 2, commands
    shutil.copytree(EXAMPLES, tmp_path / "python" / "examples")
    (tmp_path / "data").symlink_to(REPO / "data")
    cwd = tmp_path / "python"
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    helps = subprocess.run([sys.executable, str(EXAMPLES / example), "--help"],
                           capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_file_location(example[:-3], EXAMPLES / example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    desc = [(n, list(p.shape)) for n, p in getattr(module, MODELS[example])().named_parameters()]
    written = None
    for args in commands:
        if args[0] == "python":
            assert args[1] == f"examples/{example}", args
            for a in args[2:]:
                if a.startswith("--"):
                    assert a in helps, (a, helps)
            assert (cwd / flag(args, "--data")).is_dir(), args
        if "--write-init" in args:
            subprocess.run(args, cwd=cwd, env=env, check=True)  # as printed
            written = (cwd / flag(args, "--write-init")).resolve()
            assert written.is_file(), args
    for args in commands:
        config = flag(args, "--config")
        if config is None:
            continue
        path = cwd / config
        cfg = tomllib.loads(path.read_text())
        assert (path.parent / cfg["model"]["init"]).resolve() == written, (config, written)
        if args[0] == "python":
            data = (path.parent / cfg["data"]["dir"]).resolve()
            assert data == (cwd / flag(args, "--data")).resolve(), (config, args)
            # the config loads, and declares this model (else "model mismatch")
            _native.Client(str(path), desc, rank=int(flag(args, "--rank")),
                           servers=["x:1", "x:2"])
        else:
            assert args[1:] == ["--config", config, "--shard", args[-1]], args
            assert int(args[-1]) < len(cfg["cluster"]["servers"]), args
