"""Clear errors for what the cluster cannot train exactly: a model that differs from the
declared one (refused locally, and by a real shard naming the tensor), a gradient that is
None, buffers of an unsupported dtype or not in the run's model, non-float32 parameters, a
missing or non-f32 init file. Parameters with requires_grad=False are left out of the run's
trained model (kept in the init file for the export)."""

import json
import threading

import pytest
import torch
import torch.nn as nn

import ps
from common import REPO, Shards, SmallCNN, config_text

DATA = REPO / "data" / "mnist"


def write_config(tmp_path, model, name="run.toml", **keys):
    init = tmp_path / f"{name}.safetensors"
    ps.save_init(model, init)
    cfg = tmp_path / name
    cfg.write_text(config_text(init, DATA, tmp_path, **keys))
    return cfg


class Narrow(SmallCNN):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(400, 32)
        self.fc2 = nn.Linear(32, 10)


def test_a_different_model_is_refused_naming_the_first_differing_tensor(tmp_path):
    cfg = write_config(tmp_path, SmallCNN())
    with pytest.raises(ps.ModelMismatchError, match=r'tensor 4 differs: the worker has "fc1.weight" \[32, 400\], the run\'s model "fc1.weight" \[48, 400\]'):
        ps.Worker(cfg, Narrow(), rank=0)


def test_a_real_shard_refuses_a_worker_of_another_model(tmp_path):
    # the shards train SmallCNN; the worker's config (wrongly) declares the narrow model
    shard_cfg = write_config(tmp_path, SmallCNN(), steps=2)
    worker_cfg = write_config(tmp_path, Narrow(), name="other.toml", steps=2)
    with Shards(shard_cfg, 2, tmp_path) as shards:
        w = ps.Worker(worker_cfg, Narrow(), rank=0, servers=shards.addrs)
        with pytest.raises(ps.ModelMismatchError, match=r"model mismatch: tensor 4 differs.*fc1.weight.*\[32, 400\]"):
            next(w.batches(60000))


def test_a_step_without_any_gradient_is_refused(tmp_path):
    """backward() not called (no parameter has a gradient) raises GradNoneError, through
    step() and through backward() (a loss that reaches no parameter); the run ends at once
    (the worker tells the shards) instead of at the barrier timeout."""
    model = SmallCNN()
    x = torch.zeros(8, 1, 28, 28)
    for overlapped in (False, True):
        out = tmp_path / f"overlapped-{overlapped}"
        out.mkdir()
        cfg = write_config(out, model, steps=1, workers=1, shards=1, global_batch=8)
        with Shards(cfg, 1, out) as shards:
            w = ps.Worker(cfg, model, rank=0, servers=shards.addrs)
            batches = w.batches(60000)
            next(batches)
            model(x)  # a forward pass, but no backward
            with pytest.raises(ps.GradNoneError, match=r"no trainable parameter has a gradient at step 0: call loss.backward\(\)"):
                if overlapped:
                    w.backward(torch.zeros((), requires_grad=True))
                else:
                    w.step(loss_sum=0.0, correct=0)
            batches.close()
            assert shards.wait(60)[0] != 0
        log = (out / "shard-0.log").read_text()
        assert "rank 0 stopped on an error at version 0: its training loop was left" in log, log


class WithBN(SmallCNN):
    def __init__(self, channels=8, stats=True):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels, track_running_stats=stats)


def test_buffers_must_be_the_runs_and_of_a_supported_dtype(tmp_path):
    model = WithBN()
    cfg = write_config(tmp_path, model)
    assert ps.Worker(cfg, model, rank=0).rank == 0  # buffers are part of the run's model
    # an init file written without them (the run has no buffers): says how to write one
    plain = write_config(tmp_path, WithBN(stats=False), name="plain.toml")
    with pytest.raises(ps.UnsupportedModelError, match=r"buffers \['bn.running_mean'.*declares none.*ps.save_init"):
        ps.Worker(plain, model, rank=0)
    # another buffer (the parameters alike)
    other = WithBN()
    other.bn.register_buffer("extra", torch.zeros(2))
    with pytest.raises(ps.ModelMismatchError, match=r"buffer 'bn.extra': the worker's model has \('F32', \[2\]\) \(dtype, shape\), the run's none"):
        ps.Worker(cfg, other, rank=0)
    # a dtype safetensors cannot hold, before anything is written
    odd = WithBN()
    odd.register_buffer("phase", torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ps.UnsupportedModelError, match="buffer phase is torch.complex64: supported are float32"):
        ps.save_init(odd, tmp_path / "odd.safetensors")
    assert not (tmp_path / "odd.safetensors").exists()


def test_frozen_parameters_are_not_part_of_the_run(tmp_path):
    model = SmallCNN()
    model.conv1.weight.requires_grad_(False)
    cfg = write_config(tmp_path, model)
    init = tmp_path / "run.toml.safetensors"
    from safetensors import safe_open

    with safe_open(str(init), "pt") as f:
        order = json.loads(f.metadata()[ps.ORDER_KEY])
        assert json.loads(f.metadata()["constant_order"]) == ["conv1.weight"]
    assert order == [n for n, p in model.named_parameters() if p.requires_grad]
    ps.Worker(cfg, model, rank=0)  # accepted: the frozen tensor is not described
    # a model that trains it is another model
    with pytest.raises(ps.ModelMismatchError, match="conv1.weight"):
        ps.Worker(cfg, SmallCNN(), rank=0)


def test_non_float32_is_refused(tmp_path):
    cfg = write_config(tmp_path, SmallCNN())
    with pytest.raises(ps.UnsupportedModelError, match="conv1.weight is torch.float64"):
        ps.Worker(cfg, SmallCNN().double(), rank=0)


def test_missing_and_non_f32_init_files(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(tmp_path / "nope.safetensors", DATA, tmp_path))
    with pytest.raises(ValueError, match=r"\[model\] init = .*nope.safetensors.*cannot open"):
        ps.Worker(cfg, SmallCNN(), rank=0)
    from safetensors.torch import save_file

    m = SmallCNN()
    half = tmp_path / "half.safetensors"
    names = [n for n, _ in m.named_parameters()]
    save_file({n: p.detach().half() for n, p in m.named_parameters()}, str(half),
              metadata={ps.ORDER_KEY: json.dumps(names)})
    cfg.write_text(config_text(half, DATA, tmp_path))
    with pytest.raises(ValueError, match=r'tensor "conv1.weight" is F16: expected F32'):
        ps.Worker(cfg, m, rank=0)
    # a plain state_dict file without the order: the error says how to write one
    plain = tmp_path / "plain.safetensors"
    save_file({n: p.detach() for n, p in m.named_parameters()}, str(plain))
    cfg.write_text(config_text(plain, DATA, tmp_path))
    with pytest.raises(ValueError, match=r"no \"parameter_order\" in the file's metadata.*ps.save_init"):
        ps.Worker(cfg, m, rank=0)
