"""The data order as a ``DataLoader`` batch sampler (``StepSampler``) and the
``DistributedDataParallel``-shaped wrapper (``distributed``, ``Distributed``) over a
``Worker``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data

from . import Worker


class StepSampler(torch.utils.data.Sampler):
    """A ``DataLoader`` batch sampler (``Worker.sampler()``): yields this rank's sample
    indices of each step from the step the run starts at (or was rolled back to), a pure
    function of the step (the data-order contract), so a loader may read any number ahead."""

    def __init__(self, worker: Worker, train_len: int):
        self.worker = worker
        self.train_len = int(train_len)
        self._start = 0
        self._native = worker._native
        self._native.plan(self.train_len)  # the order, before connecting (connect sets it too)

    def step_len(self, step: int) -> int:
        """How many samples this rank has in step ``step``."""
        return len(self._native.batch(step))

    def __iter__(self):
        total = self.worker.total_steps
        if total is None:
            raise RuntimeError(
                "iterate the loader through worker.steps(loader): it registers with the "
                "shards first, which says the step the run starts at"
            )
        for t in range(self._start, total):
            yield [int(i) for i in self._native.batch(t)]

    def __len__(self) -> int:
        total = self.worker.total_steps
        if total is None:
            total = self._native.total_steps_for(self.train_len)
        return total - self._start


def distributed(model: torch.nn.Module, config: str | os.PathLike[str],
                **worker_args: Any) -> "Distributed":
    """Wraps ``model`` for a run of ``config``, as ``DistributedDataParallel`` wraps a model:
    the loop keeps its shape (forward through the wrapper, ``loss.backward()``, then
    ``opt_step()`` where ``optimizer.step()`` was; the shards run the optimizer of the
    config). ``worker_args`` go to ``ps.Worker`` (rank, servers, evaluate, run_id)."""
    return Distributed(model, config, **worker_args)


class Distributed(torch.nn.Module):
    """``ps.distributed(model, config)``: the model, a ``ps.Worker`` beside it, and the run's
    data order. ``loader(dataset, ...)`` yields this rank's batch of each step of the run
    (through a ``DataLoader``: ``num_workers``, ``pin_memory`` and the other ``DataLoader``
    arguments are the user's; after a lost shard's rollback it goes on from the step rolled
    back to), ``opt_step()`` pushes the gradients and loads the next weights (and buffers).
    ``module`` is the wrapped model (export it with ``ps.export(model.module, path)``);
    ``worker`` the ``ps.Worker``; ``step_number`` the run's step being computed."""

    def __init__(self, model: torch.nn.Module, config: str | os.PathLike[str],
                 **worker_args: Any):
        super().__init__()
        self.module = model
        self.worker = Worker(config, model, **worker_args)
        self.step_number = None

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def loader(self, dataset: torch.utils.data.Dataset,
               **loader_args: Any) -> torch.utils.data.DataLoader:
        """This rank's batch of each step of the run, as a ``DataLoader`` over ``dataset``
        with ``batch_sampler=worker.sampler(len(dataset))`` makes it (``loader_args``: the
        other ``DataLoader`` arguments). Registers with the shards and loads the run's
        weights first; call ``opt_step()`` once per batch."""
        if "batch_size" in loader_args or "sampler" in loader_args or "shuffle" in loader_args:
            raise ValueError(
                "loader(): batch_size, sampler and shuffle come from the run (its global batch "
                "and data order); pass the other DataLoader arguments only"
            )
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=self.worker.sampler(len(dataset)), **loader_args
        )
        try:
            for t, batch in self.worker.steps(loader):
                self.step_number = t
                yield batch
        finally:
            self.step_number = None

    def opt_step(self, loss: torch.Tensor | None = None,
                 correct: int | torch.Tensor = 0) -> None:
        """Pushes every ``.grad`` of this step (``loss``: the batch's loss, for the shards'
        log only) and pulls the new weights into the model; clears the gradients."""
        loss_sum = 0.0
        if loss is not None:
            n = self.worker._samples
            value = float(loss.detach())
            loss_sum = value * n if self.worker.loss_reduction == "mean" else value
        self.worker.step(loss_sum=loss_sum, correct=correct)

    def micro_batches(self, batch: Any, k: int) -> Iterator[tuple[Any, float]]:
        """``Worker.micro_batches`` of this step's batch."""
        return self.worker.micro_batches(batch, k)

    def terms(self, batch: Any) -> Iterator[Any]:
        """``Worker.terms`` of this step's batch (``[train] exact_sum = true``)."""
        return self.worker.terms(batch)
