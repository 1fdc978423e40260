"""How the gradients of a model on a CUDA device leave the GPU (``ps_torch.Worker``'s device path).

The session's push buffer (this worker's shared-memory gradient board when its shards share the
host, else the buffer the gRPC push encodes from) is lent by the native client
(``lend_grad_buffer``), page-locked for the GPU's DMA (``cudaHostRegister``) and seen as one
float32 tensor. Each gradient is copied into its own range of it by a non-blocking
device-to-host copy queued on a copy stream, after the work of the gradient's stream, and a CUDA
event is recorded behind the copy; the push waits for those events (not for the whole device)
and hands the buffer over as it is (``push_in_place``): no synchronous copy, no pageable memory,
no host copy. The native client calls ``PushBuffer.release`` before the buffer goes away
(``close``, a new ``connect``, the client's end): the queued copies are waited for and the
memory unregistered while it is still mapped.

With ``[train] exact_sum`` the gradient terms are summed on the host: they are copied the same
way into a page-locked staging tensor allocated once (``DeviceGrads`` over ``CudaCopies.staging``).

The weights go up by non-blocking copies queued before the forward pass (``CudaCopies.upload``);
the next pull waits for them first. When the shards share the host, the native client lends
their parameters boards (``ParamBoards``: each mapping page-locked once, released before it is
unmapped) and the uploads read the board slots of the version pulled where they lie, copying
nothing on the host (``ParamBoards.pairs``); a shard may overwrite a slot only by publishing a
later version there, which the native client's re-check (``verify_pulled``, once the uploads
completed) refuses, and the step is then redone from a copied pull. Otherwise (gRPC, a refused
registration) the weights are pulled into a page-locked tensor and uploaded from it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch


class CudaCopies:
    """The CUDA operations of the device path: page-locking host memory, the copy stream of
    each device, non-blocking copies and the events behind them."""

    #: The parameters are on the device: the pulled weights are uploaded into them (they are
    #: never views of the host memory pulled into).
    host_params = False

    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def register(self, address: int, nbytes: int) -> None:
        """Page-locks ``nbytes`` of host memory at ``address`` for the GPU's DMA."""
        torch.cuda.check_error(self._cudart.cudaHostRegister(address, nbytes, 0))

    def unregister(self, address: int) -> None:
        torch.cuda.check_error(self._cudart.cudaHostUnregister(address))

    def staging(self, n: int) -> torch.Tensor:
        """A page-locked float32 host tensor of ``n`` values."""
        return torch.zeros(n, dtype=torch.float32, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """Queues ``dst.copy_(src)`` (``dst`` in page-locked host memory, ``src`` on a GPU)
        on the copy stream of ``src``'s device, after the work queued so far on its current
        stream (which produced ``src``); returns the event recorded behind the copy."""
        main = torch.cuda.current_stream(src.device)
        side = self._streams.get(src.device)
        if side is None:
            side = self._streams[src.device] = torch.cuda.Stream(src.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        # the caching allocator must not hand src's memory out again before the copy has read it
        src.record_stream(side)
        return done

    def upload(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.cuda.Event]:
        """Queues ``dst.copy_(src, non_blocking=True)`` for each ``(dst, src)`` (``dst`` on a
        GPU, ``src`` in page-locked host memory) on the current stream of ``dst``'s device, so
        that the work queued there next (the forward pass) reads the new values; returns the
        events recorded behind them (one per device), to wait for before ``src`` is written
        again."""
        streams = {}
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                streams[dst.device] = torch.cuda.current_stream(dst.device)
        events = []
        for stream in streams.values():
            done = torch.cuda.Event()
            done.record(stream)
            events.append(done)
        return events

    def wait(self, event: torch.cuda.Event) -> None:
        """Blocks until the copy behind ``event`` has landed."""
        event.synchronize()

    def drain(self) -> None:
        """Blocks until every copy queued so far has landed."""
        for s in self._streams.values():
            s.synchronize()


def copies_for(params: Sequence[torch.Tensor]) -> Any:
    """The device operations for a model whose trainable parameters are ``params``: the CUDA
    ones when every parameter is on a CUDA device; None otherwise (the parameters on the CPU,
    or on several kinds of device: the gradients are read, or copied to the CPU, as before)."""
    if params and all(p.device.type == "cuda" for p in params):
        return CudaCopies()
    return None


class DeviceGrads:
    """Gradients copied off the device into the float32 host tensor ``flat``, tensor ``i``
    into ``flat[offsets[i]:offsets[i] + sizes[i]]`` (a view made once and reused every step),
    by ``copies`` (``CudaCopies`` or an object with its ``copy`` and ``wait``)."""

    def __init__(self, flat: torch.Tensor, copies: Any, offsets: Sequence[int],
                 sizes: Sequence[int]) -> None:
        self.flat = flat
        self.views = [flat[o : o + k] for o, k in zip(offsets, sizes)]
        self._copies = copies
        self._pending: dict[int, Any] = {}

    def queue(self, i: int, grad: torch.Tensor) -> None:
        """Queues the copy of tensor ``i``'s gradient ``grad`` into its view (non-blocking)."""
        with torch.no_grad():
            self._pending[i] = self._copies.copy(self.views[i], grad.detach().reshape(-1))

    def zero(self, i: int) -> None:
        """Zeros tensor ``i``'s view (a tensor backward did not reach), after a copy into it
        still queued, if any."""
        if i in self._pending:
            self._copies.wait(self._pending.pop(i))
        self.views[i].zero_()

    def wait(self) -> None:
        """Blocks until every copy queued has landed: then ``flat`` holds the gradients."""
        pending, self._pending = self._pending, {}
        for event in pending.values():
            self._copies.wait(event)


class PushBuffer(DeviceGrads):
    """The native client's push buffer, lent (``lend_grad_buffer``) and page-locked for the
    copies of ``DeviceGrads``: the gradients land where the shards read them. ``release`` (the
    native client calls it before the buffer goes away) waits for the copies queued and
    unregisters the memory."""

    def __init__(self, native: Any, copies: Any, offsets: Sequence[int],
                 sizes: Sequence[int]) -> None:
        self.address, n = native.lend_grad_buffer(self.release)
        self.nbytes = 4 * n
        self.registered = False
        memory = (ctypes.c_float * n).from_address(self.address)
        super().__init__(torch.frombuffer(memory, dtype=torch.float32), copies, offsets, sizes)
        copies.register(self.address, self.nbytes)
        self.registered = True

    def release(self) -> None:
        """Before the buffer goes away: every copy into it landed, then it is unregistered;
        the views are dropped (nothing may write them any more)."""
        try:
            self._copies.drain()
            self._pending = {}
            if self.registered:
                self.registered = False
                self._copies.unregister(self.address)
        finally:
            self.views = []
            self.flat = None


class ParamBoards:
    """The shards' parameters boards on this host, lent by the native client
    (``register_param_boards``): it calls ``register`` once per board mapping (page-locked by
    ``copies``; an error refuses it) and ``release`` exactly once before the mapping goes away,
    which waits for the uploads queued (``wait_uploads``), then unregisters it while it is
    still mapped. ``pairs`` makes a pull's uploads straight from the slots."""

    def __init__(self, copies: Any, wait_uploads: Any) -> None:
        self._copies = copies
        self._wait_uploads = wait_uploads
        self.registered: dict[int, int] = {}  # address -> bytes of each mapping registered
        self.refused: str | None = None
        self._slots: dict[tuple[int, int], torch.Tensor] = {}

    def register(self, address: int, nbytes: int) -> None:
        self._copies.register(address, nbytes)
        self.registered[address] = nbytes

    def release(self, address: int) -> None:
        self._wait_uploads()
        self._slots = {}
        if self.registered.pop(address, None) is not None:
            self._copies.unregister(address)

    def _slot(self, address: int, n: int) -> torch.Tensor:
        """The ``n`` float32 values at ``address`` (a lent slot) as a tensor (made once)."""
        t = self._slots.get((address, n))
        if t is None:
            memory = (ctypes.c_float * n).from_address(address)
            t = self._slots[(address, n)] = torch.frombuffer(memory, dtype=torch.float32)
        return t

    def pairs(self, spans: Sequence[tuple[int, int, int]], flat: torch.Tensor,
              params: Sequence[torch.Tensor], offsets: Sequence[int]
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The uploads ``(dst, src)`` of a pull lent as ``spans`` (``pull_lent``: each shard's
        flat range ``[lo, hi)`` and the address of its slot, 0 when copied into ``flat``) into
        ``params`` (at ``offsets`` of the flat vector): one per parameter, from the slot (or
        ``flat``) where it lies; a parameter split between shards goes up piece by piece into a
        contiguous device tensor, then into the parameter (a copy on the device)."""
        sources = [(lo, hi, self._slot(a, hi - lo) if a else flat[lo:hi]) for lo, hi, a in spans]
        out = []
        for p, o in zip(params, offsets):
            k = p.numel()
            pieces = [(max(o, lo), min(o + k, hi), lo, src) for lo, hi, src in sources
                      if lo < o + k and o < hi]
            if len(pieces) == 1:
                a, b, lo, src = pieces[0]
                out.append((p, src[a - lo : b - lo].view_as(p)))
                continue
            whole = torch.empty(k, dtype=p.dtype, device=p.device)
            out.extend((whole[a - o : b - o], src[a - lo : b - lo]) for a, b, lo, src in pieces)
            if pieces:
                out.append((p, whole.view_as(p)))
        return out
