"""python/README.md's own-model recipe, run as written, start to finish: its shell blocks
(the init file, the shards, the workers, the export) taken from the README and run by bash in
a copy of its layout (``python/examples`` with ``train_cnn.py`` and ``run.toml``, ``data/mnist``),
from the ``python/`` directory as it says. The config is the README's own block (equal to
``examples/run.toml``); only when one of its two ports is taken on this machine are they
replaced by free ones. The result is checked by numbers: every process ends with 0, shard 0
counts the whole test set, and the exported ``state_dict`` loads with ``strict=True`` into the
example's model and scores exactly the accuracy shard 0 logged."""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import torch

from common import BIN, REPO, free_port

README = REPO / "python" / "README.md"


def recipe_blocks():
    """The fenced blocks of the README's section "The recipe", by language, in order."""
    text = README.read_text()
    section = text.split("## The recipe", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_the_readmes_own_model_recipe_runs_as_written(tmp_path):
    blocks = recipe_blocks()
    sh = [body for lang, body in blocks if lang == "sh"]
    toml = [body for lang, body in blocks if lang == "toml"]
    assert len(sh) == 4 and len(toml) == 1, blocks
    init, shards, workers, export = sh
    assert toml[0] == (REPO / "python" / "examples" / "run.toml").read_text()
    # the README's layout: python/examples/{train_cnn.py, run.toml}, data/mnist
    examples = tmp_path / "python" / "examples"
    examples.mkdir(parents=True)
    shutil.copy(REPO / "python" / "examples" / "train_cnn.py", examples)
    config = toml[0]
    for port in re.findall(r'"127\.0\.0\.1:(\d+)"', config):
        if port_taken(int(port)):
            config = config.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}")
    (examples / "run.toml").write_text(config)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mnist").symlink_to(REPO / "data" / "mnist")
    # the programs the README names, from this environment: python, ps-server, ps-launch
    env = {**os.environ,
           "PATH": f"{os.path.dirname(sys.executable)}:{BIN}:{os.environ['PATH']}"}
    script = "\n".join([
        "set -e",
        init,
        shards,
        workers,
        # the background jobs (the shards, worker 0): each must end with 0
        'for job in $(jobs -p); do wait "$job" || { echo "job $job: exit $?"; exit 1; }; done',
    ])
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    log = run.stdout + run.stderr
    print(log)
    assert run.returncode == 0, log
    assert "equivalent to one process with batch 64, mean loss, lr 0.05" in log, log
    out = tmp_path / "runs" / "python-cnn"
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    final = [l for l in lines if l.get("final")]
    assert len(final) == 1 and final[0]["step"] == 300 and final[0]["test_count"] == 10000, final
    acc = final[0]["test_acc"]
    assert acc >= 0.95, acc
    correct = round(acc * 10000)
    assert f"final test accuracy {100 * acc:.2f}% ({correct}/10000)" in log, log
    # each worker printed the accuracy of the final weights on the whole test set: the same
    printed = re.findall(r"rank (\d): 300 steps; test accuracy ([\d.]+)%", log)
    assert sorted(r for r, _ in printed) == ["0", "1"], log
    assert all(a == f"{100 * acc:.2f}" for _, a in printed), (printed, acc)
    # step 5: the export, as written, then the README's load_state_dict(..., strict=True)
    run = subprocess.run(["bash", "-c", "set -e\n" + export], cwd=tmp_path / "python", env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    spec = importlib.util.spec_from_file_location("train_cnn", examples / "train_cnn.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from safetensors.torch import load_file
    model = example.SmallCNN()
    model.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    tx, ty = example.load(tmp_path / "data" / "mnist", "test")
    torch.set_num_threads(1)
    assert example.accuracy(model, tx, ty) == correct
