"""PyTorch workers for the ps parameter-server cluster (the distribution ``ps-torch``).

Import it as ``import ps_torch as ps``; ``import ps``, the package's first name, still gives
this module (a thin alias package). The wheel also installs the cluster's executables
``ps-server``, ``ps-launch`` and ``ps-worker`` into the environment's ``bin/``, so ``pip
install`` is enough to run a cluster: ``ps-server --config run.toml --shard i`` per shard, one
Python process per rank, ``ps-launch --config run.toml --export`` for ``model.safetensors``.

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

The data may be the user's own (``[data] train_len = N`` instead of an IDX ``[data] dir``),
read through the user's own ``DataLoader`` with ``batch_sampler=worker.sampler()`` and
``worker.steps(loader)`` (prefetching and ``num_workers > 0`` are fine: the sampler yields
each step's indices ahead of time from the data-order contract).

The run's model is declared by ``[model] init = "init.safetensors"`` in the config: write that
file with ``ps.save_init(model, path)`` (it carries the ``named_parameters()`` order in its
metadata, key ``parameter_order``). Every worker starts from the init file's weights (version
0 pulled from the shards); a worker whose model differs (names, shapes or order) is refused
with ``ModelMismatchError`` naming the first tensor that differs.

For a loop that keeps its shape (as with DDP), ``ps.distributed`` wraps the model::

    model = ps.distributed(model, "run.toml")          # registers on first use
    for x, y in model.loader(train_set, num_workers=2):  # this rank's batch of each step
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.opt_step(loss)                            # instead of optimizer.step()

Gradient accumulation: ``for part, scale in worker.micro_batches(batch, k): (loss(part) *
scale).backward()`` then ``step()`` once (the whole batch's gradient). Parameter groups (lr
multiplier, weight decay, betas by tensor-name pattern) are the config's
``[[optimizer.groups]]``, applied by the shards.

The exact-sum mode (``[train] exact_sum = true``: the same bits at any number of workers):
``for part in worker.terms(batch): loss(part).backward()`` then ``step()`` once; each
micro-batch's gradient is added to an exact fixed-point sum (``ps_net::exact``), which the
shards add to the other workers' and round once.

Behaviour with special parameters and buffers:

* Parameters with ``requires_grad=False`` are not part of the run's model: ``save_init`` and
  the worker leave them out, the shards never see them, and each worker keeps its local value.
  Every worker must hold the same: at registration shard 0 compares each worker's frozen
  parameters and buffers (fingerprints of their bytes; buffers only at the run's start, as
  they train) with the first worker's and refuses one that differs with
  ``ModelMismatchError`` naming the entry (DDP would silently take rank 0's).
* ``ps.export(model, path)`` writes every ``state_dict`` entry (trained, frozen, tied under
  each name, buffers in their dtype): ``load_state_dict(..., strict=True)`` restores it.
* Buffers (BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``, any
  registered persistent buffer) are part of the run's model: ``save_init`` writes them into
  the init file in their own dtypes, shard 0 holds them beside its parameters, checkpoints
  them (they survive a lost shard and ``--resume``) and writes them at the end
  (``buffers.safetensors``, merged by ``ps-launch --export``). Their semantics are DDP's
  ``broadcast_buffers``: rank 0's buffers are the model's; rank 0 sends them after its
  forward pass of each step, and every worker starts each step from them (it gets them with
  the weights). So BatchNorm in training normalises over each worker's own ``b_r`` samples of
  the step (ghost batch norm of size ``b_r``, not batch norm over the global batch ``B``; a
  SyncBatchNorm-like option is not offered), and the running statistics are those rank 0's
  forward passes make. Integer buffers are kept exactly. The shards' start-up statement and
  the worker's log say so. Cost: one more request per step to shard 0 for each worker (rank 0
  also sends). Tested: parameters and buffers equal one process running ghost batch norm
  (``python/tests/test_export.py``). Non-persistent buffers (``persistent=False``, not in the
  ``state_dict``) stay each worker's own.
* A trainable parameter whose ``.grad`` is ``None`` at ``step()`` (backward did not reach
  it: a branch not taken in this batch) is treated exactly as ``torch.optim`` treats it: when
  no worker's backward reached it in a step, the shards do not update it at all (no momentum,
  no weight decay, no Adam step count); when some did, it gets the others' zeros (the
  gradient of the union batch). No flag is needed. A step in which no parameter has a
  gradient (``backward()`` not called) raises ``GradNoneError``.
* A worker that stops on an error (or leaves the loop of ``batches()`` early) tells the
  shards at once: the run fails with its reason and the other workers stop, instead of
  waiting out the barrier timeout.
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

import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

from . import _device, _native
from ._errors import GradNoneError, UnsupportedModelError
from ._model import _EXTRA_DTYPES, _entries, export, save_init
from ._native import ModelMismatchError

try:
    from importlib.metadata import version as _version

    __version__ = _version("ps-torch")
except Exception:  # not installed as a distribution (a source tree on sys.path)
    __version__ = "0+unknown"

__all__ = [
    "Worker",
    "distributed",
    "Distributed",
    "save_init",
    "export",
    "ModelMismatchError",
    "GradNoneError",
    "UnsupportedModelError",
    "ORDER_KEY",
    "StepSampler",
    "__version__",
]

ORDER_KEY = _native.ORDER_KEY

_log = logging.getLogger("ps")


class Worker:
    """One data-parallel worker of a run: see the module's documentation."""

    def __init__(
        self,
        config: str | os.PathLike[str],
        model: torch.nn.Module,
        rank: int | None = None,
        servers: list[str] | None = None,
        evaluate: Callable[[torch.nn.Module], tuple[int, int]] | None = None,
        allow_buffers: bool = False,
        run_id: str | None = None,
        overlap_pull: bool = False,
    ):
        """``config``: the run's TOML file. ``rank``: this worker's rank (default: from
        RANK, SLURM_PROCID or JOB_COMPLETION_INDEX). ``servers``: shard addresses instead of
        the config's. ``evaluate``: optional ``f(model) -> (correct, count)`` on this rank's
        share of a test set of the user's choosing (any length, any split among the ranks;
        ``test_slice(n)`` gives the shards' split), called every ``[train] eval_every``
        steps and at the end (the shards sum the counts and log the accuracy). ``run_id``: the run this worker joins
        (default, as ps-worker: PS_RUN_ID, ``[cluster] run_id``, SLURM_JOB_ID, PS_K8S_JOB_UID);
        a shard of another run refuses the worker, naming both ids. ``allow_buffers``: no
        longer needed (buffers are part of the run's model), accepted for old scripts.
        ``overlap_pull``: the pull of the next step's weights runs in the background after
        ``step()``/``backward()`` return, and each module's forward pass first waits for its
        own parameters (a forward pre-hook), so that forward starts on the first layers while
        the last ones are still arriving, as ``ps-worker`` does. The parameters must be on
        the CPU, the model without buffers, and read between ``step()`` and the next
        ``step()`` only by the forward passes of the modules that own them (a module that
        reads another's parameters directly, or code outside forward, may see a mix of two
        versions); a failed pull discards the step computed with it, as a failed push does."""
        self.model = model
        self._params, _, self._buffers, _ = _entries(model)
        desc = [(n, [int(d) for d in p.shape]) for n, p in self._params]
        self._native = _native.Client(str(config), desc, rank, servers, run_id)
        self._check_buffers(config)
        norms = [n for n, m in model.named_modules()
                 if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if norms:
            _log.warning(
                "BatchNorm layers %s%s normalise over each worker's own b_r samples of a step "
                "(ghost batch norm of size b_r, as DDP with broadcast_buffers and without "
                "SyncBatchNorm), not over the global batch: the run equals one process with "
                "that batch norm; the running statistics are rank 0's (every worker starts "
                "each step from them)",
                norms[:3], " ..." if len(norms) > 3 else "",
            )
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
        # a model on a GPU: its gradients are copied off it asynchronously into page-locked
        # memory (the push buffer, lent once connected; a staging tensor for exact terms)
        self._copies = _device.copies_for([p for _, p in self._params])
        self._views = all(p.device.type == "cpu" for _, p in self._params) and getattr(
            self._copies, "host_params", True)
        self._push_buffer = None
        self._staging = None
        # and its weights uploaded by non-blocking copies, from the shards' boards where they
        # lend them (_boards), else from page-locked memory pulled into (the events behind the
        # last pull's uploads: waited for before the next pull writes there or a board goes)
        self._uploads = []
        self._boards = None
        # the version of the pull lent from the boards whose uploads are not verified yet
        self._lent = None
        if self._copies is not None and not self._views:
            self._flat = self._copies.staging(n)
        if self._views:
            with torch.no_grad():
                for (_, p), o in zip(self._params, self._offsets):
                    v = self._flat[o : o + p.numel()].view_as(p)
                    v.copy_(p.data)
                    p.data = v
        self._step = None
        self._samples = 0
        # [train] exact_sum: the step whose terms were summed (terms()), the tensors reached
        self._exact_m = self._native.exact_micro_batch
        self._terms = None
        self._timing = (0, 0.0, 0, 0.0)
        # backward(): each parameter's gradient goes to the shards as soon as autograd has
        # accumulated it (the hooks act only inside Worker.backward)
        self._overlap = None
        for i, (_, p) in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._grad_hook(i))
        self._transport = []
        self.start_step = None
        self.total_steps = None
        # overlap_pull: the version being pulled beside the forward pass, and the range of
        # each module's own parameters that its forward pass waits for
        self._overlap_pull = overlap_pull
        self._pulling = None
        self._pull_ranges = []
        if overlap_pull:
            self._hook_pull_waits(model)

    def _hook_pull_waits(self, model: torch.nn.Module) -> None:
        """overlap_pull: a forward pre-hook on every module that owns parameters waits for
        their range of the pull under way."""
        if not self._views or self._buffers:
            raise ValueError(
                "overlap_pull needs the parameters on the CPU (views of the pulled weights) "
                "and a model without buffers (they are loaded after the pull)"
            )
        index = {id(p): i for i, (_, p) in enumerate(self._params)}
        for m in model.modules():
            own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if not own:
                continue
            lo = min(self._offsets[i] for i in own)
            hi = max(self._offsets[i] + self._params[i][1].numel() for i in own)
            self._pull_ranges.append((lo, hi))
            m.register_forward_pre_hook(self._pull_wait_hook(lo, hi))
        self._pull_ranges.sort()

    def _pull_wait_hook(self, lo: int, hi: int):
        def hook(module, args):
            if self._pulling is not None:
                # False: the pull failed; the step is discarded at step()/backward()
                self._native.wait_pulled(lo, hi)

        return hook

    def _finish_pull(self) -> bool:
        """Ends the pull under way beside the forward pass, if any; False when it failed with
        a lost shard (the cluster rolled back: the weights of the step to redo are pulled,
        and the step computed with the failed pull's values is not pushed)."""
        if self._pulling is None:
            return True
        self._pulling = None
        try:
            self._native.finish_pull()
            return True
        except _native.RolledBack as e:
            self._pull_or_rewind(self._rolled_back(e))
            return False

    def _check_buffers(self, config) -> None:
        """The model's persistent buffers must be the run's (names, dtypes, shapes)."""
        theirs = {n: (d, list(s)) for n, d, s in self._native.buffer_specs}
        mine = {n: (_EXTRA_DTYPES[b.dtype], [int(d) for d in b.shape]) for n, b in self._buffers}
        if mine and not theirs:
            raise UnsupportedModelError(
                f"the model has buffers {list(mine)[:5]}, but the run's init file ({config}: "
                "[model] init) declares none: write it with ps.save_init(model, path), which "
                "includes them"
            )
        if mine != theirs:
            first = next(n for n in list(mine) + list(theirs) if mine.get(n) != theirs.get(n))
            raise ModelMismatchError(
                f"model mismatch: buffer {first!r}: the worker's model has "
                f"{mine.get(first, 'none')} (dtype, shape), the run's {theirs.get(first, 'none')}"
            )

    def _buffer_blob(self) -> bytes:
        from safetensors.torch import save

        return save({n: b.detach().cpu().contiguous() for n, b in self._buffers})

    def _wait_uploads(self) -> None:
        """Waits for the last pull's uploads (they read the memory pulled into)."""
        uploads, self._uploads = self._uploads, []
        for event in uploads:
            self._copies.wait(event)

    def _pull(self, version: int, copied: bool = False) -> None:
        """Pulls ``version`` into the parameters (and the model's buffers); ``copied``: through
        page-locked host memory even where the shards lend their boards."""
        self._wait_uploads()
        self._lent = None
        spans = None if copied or self._boards is None else self._pull_lent(version)
        if spans is not None:
            self._uploads = self._copies.upload(self._boards.pairs(
                spans, self._flat, [p.data for _, p in self._params], self._offsets))
            self._lent = version
        else:
            self._native.pull(version, self._flat.numpy())
            if not self._views and self._copies is not None:
                self._uploads = self._copies.upload(
                    [(p.data, self._flat[o : o + p.numel()].view_as(p))
                     for (_, p), o in zip(self._params, self._offsets)])
            elif not self._views:
                with torch.no_grad():
                    for (_, p), o in zip(self._params, self._offsets):
                        p.data.copy_(self._flat[o : o + p.numel()].view_as(p))
        if self._buffers:
            # the model's buffers of this version: rank 0's after its forward of the step before
            from safetensors.torch import load

            got = load(self._native.get_buffers(version))
            with torch.no_grad():
                for n, b in self._buffers:
                    b.copy_(got[n])

    def _pull_lent(self, version: int):
        """The pull of ``version`` lent from the shards' boards registered for the GPU's DMA
        (``pull_lent``'s spans), or None where none is (gRPC, the registration refused: said
        once), then pulled by copying."""
        boards = self._boards
        if boards.refused is not None:
            return None
        before = len(boards.registered)
        try:
            if self._native.register_param_boards(boards) == 0:
                return None
        except RuntimeError as e:
            boards.refused = str(e)
            _log.warning("worker %d: %s; the weights are pulled into page-locked memory and "
                         "uploaded from there (a host copy)", self.rank, e)
            return None
        if len(boards.registered) > before:
            _log.info("worker %d: %d shared-memory parameters boards registered for the GPU's "
                      "DMA: the weights are uploaded from the shards' boards, no host copy",
                      self.rank, len(boards.registered) - before)
        return self._native.pull_lent(version, self._flat.numpy())

    def _pulled_intact(self) -> bool:
        """True unless the last pull was lent from the boards and a shard overwrote a slot
        while the uploads read it: the native client re-checks each slot's version once the
        uploads completed; a torn one is said, and the version pulled again by copying (the
        step computed from it is then redone)."""
        version, self._lent = self._lent, None
        if version is None:
            return True
        self._wait_uploads()
        torn = self._native.verify_pulled()
        if torn is None:
            return True
        _log.warning("worker %d: %s; version %d pulled again by copying, the step computed "
                     "from it done again", self.rank, torn, version)
        self._pull_or_rewind(version, copied=True)
        return False

    def _redo(self, t: int) -> None:
        """Step ``t`` is not pushed and is done again (after ``_pulled_intact`` refused its
        weights): the same batch, from the weights pulled again."""
        for _, p in self._params:
            p.grad = None
        if self._rewind is None:  # a rollback while pulling again says where to go on
            self._rewind = t
        self._step = None

    def _data_len(self, train_len: int | None) -> int:
        """``train_len``, or the config's ``[data] train_len`` when None."""
        if train_len is None:
            train_len = self._native.train_len
            if train_len is None:
                raise ValueError(
                    "no training-set length: pass train_len (the number of samples of the "
                    "training set), or set [data] train_len in the config"
                )
        return int(train_len)

    def batches(self, train_len: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Registers with the shards for a training set of ``train_len`` samples (default:
        the config's ``[data] train_len``), loads the run's current weights into the model,
        and yields ``(step, indices)`` for every step of the run: ``indices`` (a LongTensor)
        are this rank's samples of that step's global batch. Call ``step()`` once per yielded
        step. At the end the model holds the final weights."""

        def source(t0):
            for t in range(t0, self.total_steps):
                idx = torch.from_numpy(np.asarray(self._native.batch(t), dtype=np.int64))
                yield t, idx, len(idx)

        yield from self._run(self._data_len(train_len), source)

    def sampler(self, train_len: int | None = None) -> "StepSampler":
        """A batch sampler for the user's own ``torch.utils.data.DataLoader`` over a data set
        of ``train_len`` samples (default: the config's ``[data] train_len``): each batch it
        yields is this rank's indices of one step, in step order from the step the run
        (re)starts at, computed ahead of time from the data-order contract, so the loader may
        prefetch (``num_workers > 0``, ``pin_memory``)::

            loader = DataLoader(train_set, batch_sampler=worker.sampler(len(train_set)),
                                num_workers=2, pin_memory=True)
            for step, (x, y) in worker.steps(loader):
                ...
                worker.step(...)
        """
        return StepSampler(self, self._data_len(train_len))

    def steps(self, loader: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        """As ``batches()``, for a ``DataLoader`` whose ``batch_sampler`` is this worker's
        ``sampler()``: registers, loads the run's weights and yields ``(step, batch)`` with
        the loader's batch of each step. After a lost shard's rollback the loader is started
        again from the step the cluster rolled back to (its prefetched batches are dropped)."""
        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, StepSampler) or sampler.worker is not self:
            raise ValueError(
                "worker.steps(loader): the loader's batch_sampler must be this worker's "
                "sampler() (DataLoader(data, batch_sampler=worker.sampler(len(data)), ...))"
            )

        def source(t0):
            sampler._start = t0
            batches = iter(loader)
            for t in range(t0, self.total_steps):
                yield t, next(batches), sampler.step_len(t)

        yield from self._run(sampler.train_len, source)

    def micro_batches(self, batch: Any, k: int) -> Iterator[tuple[Any, float]]:
        """Gradient accumulation: splits this step's ``batch`` (a tensor, or a tuple/list of
        tensors sharing the first dimension, e.g. ``(x, y)`` or the indices) into ``k``
        micro-batches and yields ``(micro_batch, scale)``: call ``(loss * scale).backward()``
        on each, then ``step()`` once. ``scale`` makes the accumulated ``.grad`` the gradient
        of the whole batch (the micro-batch's share of it with a mean loss, 1 with a sum), so
        the run equals one process with the same global batch (except layers whose forward
        depends on the batch, such as BatchNorm, which then sees the micro-batch). ``k``
        must divide this rank's batch of every step: checked for all steps before the
        first."""
        k = int(k)
        if k < 1:
            raise ValueError(f"micro_batches: k = {k}: expected 1 or more")
        self._check_accumulation(k)
        parts = batch if isinstance(batch, (tuple, list)) else (batch,)
        n = len(parts[0])
        size = n // k
        mean = self.loss_reduction == "mean"
        for i in range(k):
            chunk = tuple(p[i * size:(i + 1) * size] for p in parts)
            yield (chunk if isinstance(batch, (tuple, list)) else chunk[0]), (
                size / n if mean else 1.0)

    def terms(self, batch: Any) -> Iterator[Any]:
        """The exact-sum mode (``[train] exact_sum = true``): splits this step's ``batch`` (a
        tensor, or a tuple/list of tensors sharing the first dimension) into the run's
        micro-batches of ``[train] exact_micro_batch`` samples and yields each: call
        ``backward()`` on its loss (the configured reduction over the micro-batch). After
        each, its gradient (every ``.grad``) is added without rounding to this step's exact
        partial sum and cleared; then call ``step()`` once, which pushes the sum. The same
        samples meet the same shapes at any W, so the run's weights are the same bits at any
        W."""
        t = self._step
        if t is None:
            raise RuntimeError("worker.terms() outside a step of worker.batches()")
        m = self._exact_m
        if m is None:
            raise ValueError("worker.terms(): [train] exact_sum is off in the config: use "
                             "backward() (or micro_batches() for gradient accumulation)")
        parts = batch if isinstance(batch, (tuple, list)) else (batch,)
        n = len(parts[0])
        if n % m:
            raise ValueError(f"worker.terms(): a batch of {n} samples at step {t}: expected "
                             f"whole micro-batches of exact_micro_batch = {m} (this rank's "
                             "batch of the step, as batches() or sampler() gives it)")
        self._terms = None
        self._native.begin_terms(t)
        reached = [False] * len(self._params)
        for i in range(n // m):
            chunk = tuple(p[i * m:(i + 1) * m] for p in parts)
            yield chunk if isinstance(batch, (tuple, list)) else chunk[0]
            self._add_term(t, reached)
        self._terms = (t, reached)

    def _add_term(self, t: int, reached: list) -> None:
        """Adds every ``.grad`` (None: not reached, zeros) to step ``t``'s exact sum and clears
        them."""
        if self._copies is not None:
            self._add_device_term(t, reached)
            return
        arrays = []
        with torch.no_grad():
            for i, ((_, p), o) in enumerate(zip(self._params, self._offsets)):
                g = p.grad
                if g is None:
                    arrays.append(None)
                    continue
                reached[i] = True
                if g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous():
                    arrays.append(g.reshape(-1).numpy())
                else:
                    buf = self._grad[o : o + p.numel()]
                    buf.copy_(g.reshape(-1))
                    arrays.append(buf.numpy())
        self._native.add_term(t, arrays)
        for _, p in self._params:
            p.grad = None

    def _add_device_term(self, t: int, reached: list) -> None:
        """``_add_term`` for a model on a GPU: the gradients are copied asynchronously into a
        page-locked staging tensor (allocated once), waited for, and added from there."""
        if self._staging is None:
            flat = self._copies.staging(self._native.num_params)
            self._staging = _device.DeviceGrads(flat, self._copies, self._offsets, self._sizes())
        staging = self._staging
        arrays = []
        for i, (_, p) in enumerate(self._params):
            if p.grad is None:
                arrays.append(None)
                continue
            reached[i] = True
            staging.queue(i, p.grad)
            arrays.append(staging.views[i].numpy())
        staging.wait()
        self._native.add_term(t, arrays)
        for _, p in self._params:
            p.grad = None

    def _step_exact(self, t: int, loss_sum, correct, samples) -> None:
        """``step()`` in the exact-sum mode: pushes the exact partial sum of ``terms()``."""
        done, self._terms = self._terms, None
        if done is None or done[0] != t:
            raise RuntimeError(f"worker.step() at step {t} in the exact-sum mode: expected "
                               "the step's terms first (for part in worker.terms(batch): "
                               "loss(part).backward())")
        unused = [i for i, r in enumerate(done[1]) if not r]
        self._check_reached(unused, t)
        ev, loss_sum, correct, n = self._step_figures(t, loss_sum, correct, samples)

        def push():
            self._put_buffers(t)
            if unused:
                self._native.mark_unused(t, unused)
            self._native.push_exact(t, n, float(loss_sum), int(correct), ev[0], ev[1])

        self._push_and_pull(push)

    def _check_accumulation(self, k: int) -> None:
        """``k`` divides this rank's batch of every step of the run (checked once per k)."""
        checked = getattr(self, "_accumulation_ok", set())
        if k in checked:
            return
        for t in range(self.start_step or 0, self.total_steps or 0):
            b = len(self._native.batch(t))
            if b % k:
                raise ValueError(
                    f"micro_batches: k = {k} does not divide rank {self.rank}'s batch of "
                    f"step {t} ({b} samples): pick k dividing every per-worker batch (the "
                    "config's per-worker batches, and the short last batch of an epoch with "
                    "keep_last)"
                )
        checked.add(k)
        self._accumulation_ok = checked

    def test_slice(self, n: int) -> slice:
        """This rank's share of a test set of ``n`` samples, as the shards split one among
        the ranks (contiguous; the first ``n % world`` ranks get one more): for an
        ``evaluate`` that covers the whole test set once across the workers. Any other split,
        or none, is fine too: the shards sum what the workers report."""
        lo, hi = self._native.slice_of(int(n))
        return slice(lo, hi)

    def _run(self, train_len: int, source):
        """The run: registers, pulls the starting weights, and yields ``(step, batch)`` from
        ``source(first_step)`` (items ``(step, batch, samples)``), expecting ``step()`` once
        per item; after a rollback, starts ``source`` again from the step rolled back to. At
        the end reports the final evaluation and leaves."""
        start, total = self._native.connect(int(train_len))
        self.start_step, self.total_steps = start, total
        self._transport = self._native.transport()
        try:
            if self._copies is not None and self._exact_m is None:
                self._push_buffer = _device.PushBuffer(
                    self._native, self._copies, self._offsets, self._sizes())
            if self._copies is not None and not self._views:
                self._boards = _device.ParamBoards(self._copies, self._wait_uploads)
            # frozen parameters and buffers: every worker's must equal the first worker's
            self._native.check_constants(self._constants())
            self._rewind = None
            self._pull_or_rewind(start)
            t0, self._rewind = (start if self._rewind is None else self._rewind), None
            while True:
                redo = None
                items = source(t0)
                try:
                    for t, batch, samples in items:
                        self._step, self._samples = t, samples
                        yield t, batch
                        if self._step is not None:
                            raise RuntimeError(
                                f"worker.step() was not called for step {t}: call it once "
                                "per batch"
                            )
                        # after a lost shard the cluster rolled back: the steps from there
                        # are redone (the same batches, so the run ends as if nothing had
                        # happened)
                        if self._rewind is not None:
                            redo, self._rewind = self._rewind, None
                            break
                finally:
                    items.close()
                if redo is None:
                    break
                t0 = redo
            self._pulled_intact()  # the final weights: pulled again by copying if torn
            correct, count = self._run_evaluate()
            self._native.leave(correct, count)
        except BaseException as e:
            # the run cannot complete without this worker: the shards end it now, and the
            # other workers stop with the reason instead of waiting out the barrier timeout
            why = ("its training loop was left before the run's end (an exception in the "
                   "loop's body, or a break)"
                   if isinstance(e, GeneratorExit) else f"{type(e).__name__}: {e}")
            self._native.abandon(f"{why} (step {self._step})")
            raise
        finally:
            self._step = None
            self._pulling = None  # close() stops a pull under way
            self._timing = self._native.timing()
            # gives the push buffer back first (PushBuffer.release), then the parameters
            # boards (ParamBoards.release, after the uploads from them)
            self._native.close()
            self._push_buffer = None
            self._boards = None
            self._lent = None

    def _constants(self):
        """(name, shape, dtype, fingerprint, is a buffer) of each frozen parameter (the
        buffers are the run's, from shard 0: not compared)."""
        out = []
        entries = [(n, p, False) for n, p in self.model.named_parameters() if not p.requires_grad]
        for name, t, buffer in entries:
            data = t.detach().cpu().contiguous().reshape(-1)
            raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
            digest = hashlib.blake2b(raw, digest_size=8).digest()
            out.append((name, [int(d) for d in t.shape], str(t.dtype).removeprefix("torch."),
                        int.from_bytes(digest, "little"), buffer))
        return out

    def _pull_or_rewind(self, version: int, copied: bool = False) -> None:
        """Pulls ``version`` (``copied``: see ``_pull``); when a shard was lost meanwhile and the
        cluster rolled back, pulls the version rolled back to instead and records it as the
        step to go on from."""
        while True:
            try:
                self._pull(version, copied)
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
        if self._overlap_pull and t + 1 < self.total_steps:
            # pulled while the next step's forward pass runs (each module waits for its own)
            self._native.begin_pull(t + 1, self._flat.numpy(), self._pull_ranges)
            self._pulling = t + 1
        else:
            self._pull_or_rewind(t + 1)
        self._step = None

    def _step_figures(self, t, loss_sum, correct, samples):
        """The figures a push of step ``t`` carries: the evaluation of version ``t`` when one
        is due (``(correct, count)``, else ``(0, 0)``), the loss sum and the correct count as
        numbers, and the step's sample count."""
        ev = (0, 0)
        if self._eval_every and t > 0 and t % self._eval_every == 0:
            ev = self._run_evaluate()
        if isinstance(loss_sum, torch.Tensor):
            loss_sum = loss_sum.item()
        if isinstance(correct, torch.Tensor):
            correct = correct.item()
        n = self._samples if samples is None else int(samples)
        return ev, loss_sum, correct, n

    def _run_evaluate(self):
        if self._evaluate is None:
            return 0, 0
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            correct, count = self._evaluate(self.model)
        self.model.train(was_training)
        return int(correct), int(count)

    def step(self, loss_sum: float = 0.0, correct: int | torch.Tensor = 0,
             samples: int | None = None) -> None:
        """Pushes the ``.grad`` of every trainable parameter for the current step (and
        ``loss_sum``, the sum of the per-sample losses of this worker's batch, and ``correct``,
        its correct predictions, for the shards' log), then pulls the new weights into the
        parameters in place. Clears every ``.grad`` (sets it to None) for the next step.
        ``samples`` defaults to this step's batch length (the weight of ``weighted``
        aggregation)."""
        t = self._step
        if t is None:
            raise RuntimeError("worker.step() outside a step of worker.batches()")
        if not self._finish_pull():
            self._step = None  # computed with a failed pull's weights: redone after the rollback
            return
        if not self._pulled_intact():
            self._redo(t)
            return
        if self._exact_m is not None:
            self._step_exact(t, loss_sum, correct, samples)
            return
        if self._push_buffer is not None:
            self._step_device(t, loss_sum, correct, samples)
            return
        # one array per tensor: CPU float32 gradients are read in place (copied once, into
        # the buffer the shards read); others are first copied to the CPU
        parts = []
        unused = [i for i, (_, p) in enumerate(self._params) if p.grad is None]
        self._check_reached(unused, t)
        with torch.no_grad():
            for (name, p), o in zip(self._params, self._offsets):
                g = p.grad
                if g is None:  # not reached: zeros, and the shards are told (mark_unused)
                    buf = self._grad[o : o + p.numel()]
                    buf.zero_()
                    parts.append(buf.numpy())
                    continue
                if g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous():
                    parts.append(g.reshape(-1).numpy())
                else:
                    buf = self._grad[o : o + p.numel()]
                    buf.copy_(g.reshape(-1))
                    parts.append(buf.numpy())
        ev, loss_sum, correct, n = self._step_figures(t, loss_sum, correct, samples)

        def push():
            self._put_buffers(t)
            if unused:
                self._native.mark_unused(t, unused)
            self._native.push_parts(t, parts, n, float(loss_sum), int(correct), ev[0], ev[1])

        self._push_and_pull(push)

    def _step_device(self, t: int, loss_sum, correct, samples) -> None:
        """``step()`` for a model on a GPU: each ``.grad`` is copied asynchronously into its
        range of the page-locked push buffer; the push waits for those copies, then the shards
        read the buffer as it is."""
        buf = self._push_buffer
        unused = [i for i, (_, p) in enumerate(self._params) if p.grad is None]
        self._check_reached(unused, t)
        for i, (_, p) in enumerate(self._params):
            if p.grad is None:  # not reached: zeros, and the shards are told (mark_unused)
                buf.zero(i)
            else:
                buf.queue(i, p.grad)
        ev, loss_sum, correct, n = self._step_figures(t, loss_sum, correct, samples)

        def push():
            self._put_buffers(t)
            if unused:
                self._native.mark_unused(t, unused)
            buf.wait()
            self._native.push_in_place(t, n, float(loss_sum), int(correct), ev[0], ev[1])

        self._push_and_pull(push)

    def _sizes(self) -> list[int]:
        return [p.numel() for _, p in self._params]

    def _put_buffers(self, t: int) -> None:
        """Rank 0: its buffers after the forward pass of step ``t`` go to shard 0 (they are
        the buffers of version ``t + 1``), before its push of the step."""
        if self._buffers and self.rank == 0:
            self._native.put_buffers(t, self._buffer_blob())

    def _check_reached(self, unused: list, t: int) -> None:
        """A step in which no trainable parameter got a gradient is a missing backward()."""
        if len(unused) == len(self._params):
            raise GradNoneError(
                f"no trainable parameter has a gradient at step {t}: call loss.backward() "
                "before worker.step()"
            )

    def backward(self, loss: torch.Tensor, correct: int | torch.Tensor = 0,
                 samples: int | None = None) -> None:
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
        if self._exact_m is not None:
            raise ValueError("worker.backward(): [train] exact_sum = true pushes the exact sum "
                             "of micro-batch terms: use worker.terms(batch), then step()")
        if not self._finish_pull():
            self._step = None  # computed with a failed pull's weights: redone after the rollback
            return
        if not self._pulled_intact():  # before anything computed from the weights goes out
            self._redo(t)
            return
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
        try:
            self._put_buffers(t)  # the forward pass is done: its buffers go before the push
        except _native.RolledBack as e:
            self._pull_or_rewind(self._rolled_back(e))
            self._step = None
            return
        device = self._push_buffer
        if device is None:
            self._native.begin_push(t, n, loss_sum, int(correct), ev[0], ev[1])
        self._overlap = [False] * len(self._params)
        try:
            loss.backward()
        finally:
            written, self._overlap = self._overlap, None
        missing = [i for i, w in enumerate(written) if not w]
        if len(missing) == len(self._params):
            if device is None:
                try:
                    self._native.finish_push()  # nothing was written: drops the begun push
                except RuntimeError:
                    pass
            self._check_reached(missing, t)

        def finish():
            if device is not None:
                # a model on a GPU: the hooks queued the copies into the push buffer
                for i in missing:
                    device.zero(i)
                if missing:
                    self._native.mark_unused(t, missing)
                device.wait()
                self._native.push_in_place(t, n, loss_sum, int(correct), ev[0], ev[1])
                return
            # parameters backward did not reach: zeros, after telling the shards holding
            # them (whose pushes wait for these values, so they start only now)
            if missing:
                self._native.mark_unused(t, missing)
                for i in missing:
                    o, k = self._offsets[i], self._params[i][1].numel()
                    buf = self._grad[o : o + k]
                    buf.zero_()
                    self._native.grad_ready(i, buf.numpy())
            self._native.finish_push()

        self._push_and_pull(finish)

    def _grad_hook(self, i: int):
        def hook(p):
            if self._overlap is None:
                return
            g = p.grad
            if self._push_buffer is not None:  # a model on a GPU: an asynchronous copy
                self._push_buffer.queue(i, g)
                self._overlap[i] = True
                return
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

    def timing(self) -> dict[str, float]:
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

    def transport(self) -> list[str]:
        """How tensors travel to each shard ("shared memory", "gRPC", ...), once connected."""
        return self._transport


# after Worker: the wrapper builds one (the circular import finds it defined)
from ._ddp import Distributed, StepSampler, distributed  # noqa: E402

# the public names defined in the private modules show as ps_torch's (reprs, tracebacks, help)
for _public in (GradNoneError, UnsupportedModelError, save_init, export, StepSampler,
                distributed, Distributed):
    _public.__module__ = __name__
del _public
