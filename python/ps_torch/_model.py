"""The model as the cluster holds it: its ``state_dict`` entries by role and their checks,
the init file (``save_init``) and the whole-model export (``export``)."""

from __future__ import annotations

import os

import torch

from ._errors import UnsupportedModelError
from ._native import ORDER_KEY


# dtypes a buffer or frozen parameter may have (ps_model::declared::EXTRA_DTYPES)
_EXTRA_DTYPES = {
    torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def _entries(model: torch.nn.Module):
    """The model's ``state_dict`` entries by role: (trainable parameters, frozen parameters,
    persistent buffers, aliases {tied name: the name it shares a tensor with}); each a list of
    (name, tensor) in the model's order. Refuses a buffer or frozen parameter of a dtype the
    init file cannot hold."""
    params = _trainable(model)
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    keys = model.state_dict(keep_vars=True)
    buffers = [(n, b) for n, b in model.named_buffers() if n in keys]
    for kind, items in (("buffer", buffers), ("frozen parameter", frozen)):
        for n, t in items:
            if t.dtype not in _EXTRA_DTYPES:
                raise UnsupportedModelError(
                    f"{kind} {n} is {t.dtype}: supported are "
                    f"{', '.join(str(d).removeprefix('torch.') for d in _EXTRA_DTYPES)}"
                )
    canonical = {id(t): n for n, t in params + frozen + buffers}
    aliases = {k: canonical[id(v)] for k, v in keys.items()
               if k not in canonical.values() and id(v) in canonical}
    return params, frozen, buffers, aliases


def _trainable(model: torch.nn.Module):
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise UnsupportedModelError("the model has no parameter with requires_grad=True")
    for n, p in params:
        if p.dtype != torch.float32:
            raise UnsupportedModelError(
                f"parameter {n} is {p.dtype}: expected torch.float32 (call model.float())"
            )
    return params


def save_init(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Writes the run's model, the file ``[model] init`` names (safetensors): the initial
    weights of ``model``'s trainable parameters (float32) in ``named_parameters()`` order,
    carried in the file's metadata under ``parameter_order``; its persistent buffers
    (``buffer_order``: the shards hold them through the run) and frozen parameters
    (``constant_order``), each in its own dtype; and its tied entries (``aliases``), so that
    the shards' export holds the whole ``state_dict``. ``batch_statistics`` names the modules
    that normalise by the batch's statistics and keep no running ones (BatchNorm with
    ``track_running_stats=False``), for the shards' equivalence statement."""
    import json

    from safetensors.torch import save_file

    params, frozen, buffers, aliases = _entries(model)
    tensors = {n: t.detach().cpu().clone().contiguous() for n, t in params + frozen + buffers}
    meta = {
        ORDER_KEY: json.dumps([n for n, _ in params]),
        "buffer_order": json.dumps([n for n, _ in buffers]),
        "constant_order": json.dumps([n for n, _ in frozen]),
        "aliases": json.dumps(aliases),
        "batch_statistics": json.dumps(_batch_statistics(model)),
    }
    save_file(tensors, str(path), metadata=meta)


def _batch_statistics(model: torch.nn.Module) -> list[str]:
    """The modules of ``model`` that normalise by the statistics of the batch they see and
    hold no running statistics (BatchNorm with ``track_running_stats=False``: also in eval
    mode): on the cluster each worker's forward pass sees only its own samples of a step."""
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not m.track_running_stats]


def export(model: torch.nn.Module, path: str | os.PathLike[str],
           metadata: dict[str, str] | None = None) -> None:
    """Writes every entry of ``model.state_dict()`` to ``path`` (safetensors): the trained
    parameters, frozen parameters, tied parameters under each of their names, and buffers
    (BatchNorm running statistics, ``num_batches_tracked`` in its own dtype), so
    ``model.load_state_dict(safetensors.torch.load_file(path), strict=True)`` restores the
    whole model. Call it on a worker after ``batches()`` ended: its model holds the run's final
    weights, the frozen entries every worker holds alike, and the model's buffers (rank 0's,
    which every worker got with the final weights). ``ps-launch --export`` writes the same
    entries from the shards' final files and the init file."""
    from safetensors.torch import save_file

    # each entry its own contiguous copy: tied entries share storage, and on a worker the
    # parameters are views of one flat buffer, which safetensors refuses to write as such
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})
