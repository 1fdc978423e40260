"""PyTorch workers for the ps parameter-server cluster.

The shards hold the model's parameters and run the optimizer; a ``ps.Worker`` computes
gradients of any ``nn.Module`` with PyTorch, pushes them, and pulls the new weights into the
model's parameters in place, through the same Rust transport as ``ps-worker`` (shared memory
with shards on the same host, gRPC otherwise, the config's token and TLS)::

    worker = ps.Worker("run.toml", model)          # rank: argument, or RANK / SLURM_PROCID / ...
    for step, idx in worker.batches(len(train_set)):   # this rank's sample indices of step `step`
        out = model(x[idx])
        loss = F.cross_entropy(out, y[idx], reduction=worker.loss_reduction)
        loss.backward()
        worker.step(loss_sum=..., correct=...)      # push every .grad, pull the new weights

The run's model is declared by ``[model] init = "init.safetensors"`` in the config: write that
file with ``ps.save_init(model, path)`` (it carries the ``named_parameters()`` order in its
metadata, key ``parameter_order``). Every worker starts from the init file's weights (version
0 pulled from the shards); a worker whose model differs (names, shapes or order) is refused
with ``ModelMismatchError`` naming the first tensor that differs.

Behaviour with special parameters and buffers:

* Parameters with ``requires_grad=False`` are not part of the run's model: ``save_init`` and
  the worker leave them out, the shards never see them, and each worker keeps its local value
  (so every worker must set them alike, e.g. from the same pretrained file).
* Buffers (BatchNorm running statistics, ...) are not synchronised by the shards: each worker
  would keep its own, and the workers would silently diverge. A model with buffers is refused
  with ``UnsupportedModelError`` unless ``allow_buffers=True`` is passed, which states that the
  buffers are constants or that diverging per-worker values are intended (use GroupNorm or
  LayerNorm, or BatchNorm with ``track_running_stats=False``, for an exact run).
* A trainable parameter whose ``.grad`` is ``None`` at ``step()`` (unused in the forward pass,
  or ``backward()`` not called) raises ``GradNoneError`` naming it.
* Parameters must be float32 (``model.float()``).

A lost shard does not end the run: when a shard is restarted with ``ps-server --recover``
(``ps-launch --restart-shards``, the Slurm and Kubernetes recipes), the cluster rolls back to
the newest checkpoint every shard has, and the worker waits for it (at most ``[worker]
connect_timeout_secs``), loads those weights and ``batches()`` yields the steps from there
again (logged on the ``ps`` logger). The batches of a step are a pure function of the step, so
the final weights equal those of a run that never failed; state the user's loop keeps per step
(its own counters, a scheduler of its own) should follow the step numbers yielded.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from . import _native
from ._native import ModelMismatchError

__all__ = [
    "Worker",
    "save_init",
    "ModelMismatchError",
    "GradNoneError",
    "UnsupportedModelError",
    "ORDER_KEY",
]

ORDER_KEY = _native.ORDER_KEY

_log = logging.getLogger("ps")


class GradNoneError(RuntimeError):
    """A trainable parameter has no gradient at ``Worker.step()``."""


class UnsupportedModelError(ValueError):
    """The model has something the cluster cannot keep in step (buffers, non-float32)."""


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


def save_init(model: torch.nn.Module, path) -> None:
    """Writes the initial weights of ``model``'s trainable parameters to ``path``
    (safetensors, float32), in ``named_parameters()`` order, carried in the file's metadata
    under ``parameter_order``: the file ``[model] init`` names."""
    params = _trainable(model)
    flat = torch.cat([p.detach().reshape(-1).float().cpu() for _, p in params]).numpy()
    _native.save_init(
        str(path), [n for n, _ in params], [list(p.shape) for _, p in params], flat
    )


class Worker:
    """One data-parallel worker of a run: see the module's documentation."""

    def __init__(
        self,
        config,
        model: torch.nn.Module,
        rank: int | None = None,
        servers: list[str] | None = None,
        evaluate=None,
        allow_buffers: bool = False,
        run_id: str | None = None,
    ):
        """``config``: the run's TOML file. ``rank``: this worker's rank (default: from
        RANK, SLURM_PROCID or JOB_COMPLETION_INDEX). ``servers``: shard addresses instead of
        the config's. ``evaluate``: optional ``f(model) -> (correct, count)`` on this rank's
        share of the test set, called every ``[train] eval_every`` steps and at the end (the
        shards log the cluster-wide test accuracy). ``run_id``: the run this worker joins
        (default, as ps-worker: PS_RUN_ID, ``[cluster] run_id``, SLURM_JOB_ID, PS_K8S_JOB_UID);
        a shard of another run refuses the worker, naming both ids."""
        buffers = [n for n, _ in model.named_buffers()]
        if buffers and not allow_buffers:
            raise UnsupportedModelError(
                f"the model has buffers {buffers[:5]}{' ...' if len(buffers) > 5 else ''}, "
                "which the shards do not synchronise: each worker would keep its own and the "
                "workers would silently diverge. Use GroupNorm/LayerNorm or BatchNorm with "
                "track_running_stats=False, or pass allow_buffers=True if they are constants"
            )
        self.model = model
        self._params = _trainable(model)
        desc = [(n, [int(d) for d in p.shape]) for n, p in self._params]
        self._native = _native.Client(str(config), desc, rank, servers, run_id)
        self.rank = self._native.rank
        self.world = self._native.world
        self.loss_reduction = self._native.loss_reduction
        self.equivalence = self._native.equivalence
        self._evaluate = evaluate
        self._eval_every = self._native.eval_every
        n = self._native.num_params
        self._offsets = []
        off = 0
        for _, p in self._params:
            self._offsets.append(off)
            off += p.numel()
        assert off == n
        # the pulled weights land in one flat float32 buffer; on the CPU the parameters are
        # views of it, so a pull updates them in place with no copy
        self._flat = torch.zeros(n, dtype=torch.float32)
        self._grad = torch.zeros(n, dtype=torch.float32)
        self._views = all(p.device.type == "cpu" for _, p in self._params)
        if self._views:
            with torch.no_grad():
                for (_, p), o in zip(self._params, self._offsets):
                    v = self._flat[o : o + p.numel()].view_as(p)
                    v.copy_(p.data)
                    p.data = v
        self._step = None
        self._samples = 0
        self._timing = (0, 0.0, 0, 0.0)
        # backward(): each parameter's gradient goes to the shards as soon as autograd has
        # accumulated it (the hooks act only inside Worker.backward)
        self._overlap = None
        for i, (_, p) in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._grad_hook(i))
        self._transport = []
        self.start_step = None
        self.total_steps = None

    def _pull(self, version: int) -> None:
        self._native.pull(version, self._flat.numpy())
        if not self._views:
            with torch.no_grad():
                for (_, p), o in zip(self._params, self._offsets):
                    p.data.copy_(self._flat[o : o + p.numel()].view_as(p))

    def batches(self, train_len: int):
        """Registers with the shards for a training set of ``train_len`` samples, loads the
        run's current weights into the model, and yields ``(step, indices)`` for every step of
        the run: ``indices`` (a LongTensor) are this rank's samples of that step's global batch.
        Call ``step()`` once per yielded step. At the end the model holds the final weights."""
        start, total = self._native.connect(int(train_len))
        self.start_step, self.total_steps = start, total
        self._transport = self._native.transport()
        try:
            self._rewind = None
            self._pull_or_rewind(start)
            t = start if self._rewind is None else self._rewind
            self._rewind = None
            while t < total:
                idx = np.asarray(self._native.batch(t), dtype=np.int64)
                self._step, self._samples = t, len(idx)
                yield t, torch.from_numpy(idx)
                if self._step is not None:
                    raise RuntimeError(
                        f"worker.step() was not called for step {t}: call it once per batch"
                    )
                # after a lost shard the cluster rolled back: the steps from there are redone
                # (the same batches, so the run ends as if nothing had happened)
                t, self._rewind = (t + 1 if self._rewind is None else self._rewind), None
            correct, count = self._run_evaluate()
            self._native.leave(correct, count)
        finally:
            self._step = None
            self._timing = self._native.timing()
            self._native.close()

    def _pull_or_rewind(self, version: int) -> None:
        """Pulls ``version``; when a shard was lost meanwhile and the cluster rolled back, pulls
        the version rolled back to instead and records it as the step to go on from."""
        while True:
            try:
                self._pull(version)
                return
            except _native.RolledBack as e:
                version = self._rolled_back(e)

    def _rolled_back(self, e) -> int:
        """Records the step to redo from after ``e`` (a RolledBack) and returns it."""
        start = int(e.args[0])
        _log.warning(
            "worker %d: a shard was lost (%s); the cluster rolled back to version %d: the "
            "steps from %d are redone",
            self.rank, e.args[1], start, start,
        )
        for _, p in self._params:
            p.grad = None
        self._rewind = start
        return start

    def _push_and_pull(self, push) -> None:
        """``push()`` (the step's push), then the pull of the next version; after a lost shard,
        the pull of the version the cluster rolled back to."""
        t = self._step
        try:
            push()
        except _native.RolledBack as e:
            self._pull_or_rewind(self._rolled_back(e))
            self._step = None
            return
        for _, p in self._params:
            p.grad = None
        self._pull_or_rewind(t + 1)
        self._step = None

    def _run_evaluate(self):
        if self._evaluate is None:
            return 0, 0
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            correct, count = self._evaluate(self.model)
        self.model.train(was_training)
        return int(correct), int(count)

    def step(self, loss_sum=0.0, correct=0, samples: int | None = None) -> None:
        """Pushes the ``.grad`` of every trainable parameter for the current step (and
        ``loss_sum``, the sum of the per-sample losses of this worker's batch, and ``correct``,
        its correct predictions, for the shards' log), then pulls the new weights into the
        parameters in place. Clears every ``.grad`` (sets it to None) for the next step.
        ``samples`` defaults to this step's batch length (the weight of ``weighted``
        aggregation)."""
        t = self._step
        if t is None:
            raise RuntimeError("worker.step() outside a step of worker.batches()")
        # one array per tensor: CPU float32 gradients are read in place (copied once, into
        # the buffer the shards read); others are first copied to the CPU
        parts = []
        with torch.no_grad():
            for (name, p), o in zip(self._params, self._offsets):
                g = p.grad
                if g is None:
                    raise GradNoneError(
                        f"parameter {name} has no gradient (.grad is None) at step {t}: it is "
                        "not used in the forward pass, or backward() was not called. Set "
                        "requires_grad=False on parameters the model does not train"
                    )
                if g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous():
                    parts.append(g.reshape(-1).numpy())
                else:
                    buf = self._grad[o : o + p.numel()]
                    buf.copy_(g.reshape(-1))
                    parts.append(buf.numpy())
        ev = (0, 0)
        if self._eval_every and t > 0 and t % self._eval_every == 0:
            ev = self._run_evaluate()
        if isinstance(loss_sum, torch.Tensor):
            loss_sum = loss_sum.item()
        if isinstance(correct, torch.Tensor):
            correct = correct.item()
        n = self._samples if samples is None else int(samples)
        self._push_and_pull(
            lambda: self._native.push_parts(
                t, parts, n, float(loss_sum), int(correct), ev[0], ev[1]
            )
        )

    def backward(self, loss, correct=0, samples: int | None = None) -> None:
        """``loss.backward()`` and ``step()`` in one, with the push overlapping backward (as
        DDP overlaps its all-reduce): the gradient of each shard's range is pushed as soon as
        autograd has produced it, while backward goes on with earlier layers; then the new
        weights are pulled into the parameters in place. ``loss``: this worker's batch loss
        with the configured reduction (the loss sum for the shards' log is derived from it);
        ``correct``: its correct predictions. Same numbers as ``loss.backward()`` followed by
        ``step()``."""
        t = self._step
        if t is None:
            raise RuntimeError("worker.backward() outside a step of worker.batches()")
        n = self._samples if samples is None else int(samples)
        value = float(loss.detach())
        loss_sum = value * n if self.loss_reduction == "mean" else value
        if isinstance(correct, torch.Tensor):
            correct = correct.item()
        ev = (0, 0)
        if self._eval_every and t > 0 and t % self._eval_every == 0:
            ev = self._run_evaluate()  # the weights of version t, as step() evaluates them
        for _, p in self._params:
            p.grad = None
        self._native.begin_push(t, n, loss_sum, int(correct), ev[0], ev[1])
        self._overlap = [False] * len(self._params)
        try:
            loss.backward()
        finally:
            written, self._overlap = self._overlap, None
        missing = [name for (name, _), w in zip(self._params, written) if not w]

        def finish():
            try:
                self._native.finish_push()
            except _native.RolledBack:
                raise
            except RuntimeError:
                if not missing:
                    raise
            if missing:
                raise GradNoneError(
                    f"parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} got no "
                    f"gradient from backward at step {t}: they are not used in the forward "
                    "pass. Set requires_grad=False on parameters the model does not train"
                )

        self._push_and_pull(finish)

    def _grad_hook(self, i: int):
        def hook(p):
            if self._overlap is None:
                return
            g = p.grad
            with torch.no_grad():
                if g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous():
                    arr = g.reshape(-1).numpy()
                else:
                    o = self._offsets[i]
                    buf = self._grad[o : o + p.numel()]
                    buf.copy_(g.reshape(-1))
                    arr = buf.numpy()
            self._native.grad_ready(i, arr)
            self._overlap[i] = True

        return hook

    def timing(self):
        """Communication so far: {"pushes", "push_s", "pulls", "pull_s"}."""
        if self._native_connected():
            self._timing = self._native.timing()
        pushes, push_s, pulls, pull_s = self._timing
        return {"pushes": pushes, "push_s": push_s, "pulls": pulls, "pull_s": pull_s}

    def _native_connected(self) -> bool:
        try:
            self._native.timing()
            return True
        except RuntimeError:
            return False

    def transport(self):
        """How tensors travel to each shard ("shared memory", "gRPC", ...), once connected."""
        return self._transport
