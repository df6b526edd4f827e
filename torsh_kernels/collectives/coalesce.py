"""Coalesced all-reduces: several asynchronous ``all_reduce`` calls sent as one collective.

:class:`Coalescer` wraps any :class:`~torsh_kernels.collectives.Communicator`. Outside a batch it
forwards every call unchanged. Inside ``with coalescer.batch():`` an asynchronous ``all_reduce`` is
not sent at once: it is recorded and answered with a handle, and when the batch closes the recorded
tensors go out as one all-reduce per (device, dtype, op), in the order they were first seen: one
flat buffer (``torch.cat``), one collective, the results copied back into the callers' tensors when
their handle is waited on. This is what ``torch.distributed``'s coalescing manager does for NCCL, for
any transport. It pays where many small all-reduces are issued back to back and each costs more to
launch than to send (PowerSGD's P of one DDP bucket and Q of the one before: one all-reduce per
bucket instead of two).

Order. Anything that could put the recorded all-reduces out of order sends them first: a collective
other than an asynchronous all-reduce (a synchronous one, an all-gather, a broadcast, ...), a wait on
a handle of the batch, a second all-reduce of a tensor already in the batch, and the end of the batch.
So the sequence of collectives on the wire is a function of the sequence of calls alone, and ranks
that make the same calls issue the same collectives, as without coalescing. A batch whose block ends
with an exception is not sent: the failing rank recorded only part of it, which as one all-reduce would
not match its peers'; their collective then fails with a typed error (the peer exited, or the timeout).

Contract, as for any asynchronous collective: a tensor given to ``all_reduce(async_op=True)`` is not
read or written by the caller until its handle is waited on. Inside a batch it is read when the batch
is sent, not at the call. ``is_completed()`` is False until the batch is sent; the result is in the
tensor after ``wait()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from ..errors import CollectiveError
from .protocol import Communicator, Handle

__all__ = ["Coalescer"]


class _Group:
    """The all-reduces of one batch that travel together: one flat buffer, one handle."""

    __slots__ = ("abandoned", "copied", "flat", "handle", "op", "tensors")

    def __init__(self, op: str) -> None:
        self.op = op
        self.tensors: list[torch.Tensor] = []
        self.flat: torch.Tensor | None = None
        self.handle: Handle | None = None
        self.copied = False
        self.abandoned = False  # its batch ended with an error before it was sent: it never will be

    def send(self, comm: Communicator) -> None:
        ts = self.tensors
        if len(ts) == 1:
            self.handle = comm.all_reduce(ts[0], self.op, async_op=True)
            self.copied = True  # reduced in place: nothing to copy back
            return
        self.flat = torch.cat([t.view(-1) for t in ts])
        self.handle = comm.all_reduce(self.flat, self.op, async_op=True)

    def finish(self) -> None:
        """Wait for the collective, then copy each tensor's part of the result back (once)."""
        self.handle.wait()
        if not self.copied:
            self.copied = True
            flat, off = self.flat, 0
            for t in self.tensors:
                n = t.numel()
                t.view(-1).copy_(flat[off : off + n])
                off += n
            self.flat = None


class _Deferred:
    """The handle of an all-reduce recorded in a batch."""

    __slots__ = ("_batch", "_group")

    def __init__(self, batch: _Batch, group: _Group) -> None:
        self._batch = batch
        self._group = group

    def _abandoned(self) -> CollectiveError:
        return CollectiveError(
            f"all_reduce ({len(self._group.tensors)} tensor(s) coalesced): the batch it was recorded in ended with "
            "an error before it was sent, so it was not sent (a part of a batch would not match the other ranks' "
            "collective); start the step again on every rank"
        )

    def wait(self) -> None:
        if self._group.abandoned:
            raise self._abandoned()
        if self._group.handle is None:
            self._batch.send()  # waited on inside its batch: send what is recorded, in order
        self._group.finish()

    def is_completed(self) -> bool:
        g = self._group
        return g.handle is not None and (g.copied or g.handle.is_completed())

    @property
    def error(self):
        """The typed error the batch's collective failed with (see ``TorchHandle.error``), or None."""
        return getattr(self._group.handle, "error", None)

    def future(self) -> torch.futures.Future | None:
        """A future completing once the result is in the tensor (see ``TorchHandle.future``); None where the
        transport's handle offers none. Sends the batch if it has not been sent."""
        g = self._group
        if g.abandoned:
            f: torch.futures.Future = torch.futures.Future()
            f.set_exception(self._abandoned())
            return f
        if g.handle is None:
            self._batch.send()
        get = getattr(g.handle, "future", None)
        f = get() if get is not None else None
        if f is None or g.copied:
            return f

        def copy_back(fut: torch.futures.Future) -> None:
            fut.value()  # raises the collective's error
            g.finish()

        return f.then(copy_back)


class _Batch:
    __slots__ = ("comm", "groups", "ptrs")

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.groups: dict[tuple, _Group] = {}
        self.ptrs: set[int] = set()

    def add(self, tensor: torch.Tensor, op: str) -> _Deferred:
        key = (tensor.device, tensor.dtype, op)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = _Group(op)
        g.tensors.append(tensor)
        self.ptrs.add(tensor.data_ptr())
        return _Deferred(self, g)

    def send(self) -> None:
        groups, self.groups, self.ptrs = self.groups, {}, set()
        for g in groups.values():
            g.send(self.comm)

    def abandon(self) -> None:
        groups, self.groups, self.ptrs = self.groups, {}, set()
        for g in groups.values():
            g.abandoned = True


class Coalescer:
    """A communicator that can send several asynchronous all-reduces as one (see the module docstring).

    ``Coalescer(comm)`` forwards everything to ``comm``; ``with c.batch():`` coalesces the asynchronous
    all-reduces issued through ``c`` until the block ends. Batches do not nest (an inner ``batch()`` joins
    the outer one). Not thread-safe: one thread issues a batch, as one thread issues collectives in order.
    """

    def __init__(self, comm: Communicator) -> None:
        if isinstance(comm, Coalescer):
            comm = comm.inner
        self.inner = comm
        self._batch: _Batch | None = None

    def __repr__(self) -> str:
        return f"Coalescer({self.inner!r})"

    @property
    def traffic(self):
        """The inner communicator's :class:`~torsh_kernels.collectives.Traffic` counters (None if it keeps none)."""
        return getattr(self.inner, "traffic", None)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Coalesce the asynchronous all-reduces issued inside the block; they are sent when it ends. When
        it ends with an exception, what is still recorded is not sent (its handles raise
        ``CollectiveError``): a rank that failed part-way recorded only part of the batch, and that part as
        one all-reduce would not match the other ranks' (gloo aborts the process on a size mismatch, or
        fills a buffer with what it got); its peers fail in their collective instead, with a typed error."""
        if self._batch is not None:
            yield
            return
        b = self._batch = _Batch(self.inner)
        try:
            yield
        except BaseException:
            self._batch = None
            b.abandon()
            raise
        self._batch = None
        b.send()

    @property
    def batching(self) -> bool:
        return self._batch is not None

    def _flush(self) -> None:
        b = self._batch
        if b is not None and b.groups:
            b.send()

    # -- the Communicator protocol ---------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def backend(self) -> str:
        return self.inner.backend

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Handle | None:
        b = self._batch
        if b is None:
            return self.inner.all_reduce(tensor, op, async_op=async_op)
        if (
            async_op and type(op) is str and isinstance(tensor, torch.Tensor) and tensor.is_contiguous()
            and tensor.numel() and tensor.data_ptr() not in b.ptrs
        ):  # fmt: skip
            return b.add(tensor, op)
        # anything else (synchronous, a tensor already in the batch, an argument the transport will reject
        # with its own typed error) goes out after what the batch holds
        self._flush()
        return self.inner.all_reduce(tensor, op, async_op=async_op)

    def all_gather(self, output, input, *, async_op: bool = False) -> Handle | None:
        self._flush()
        return self.inner.all_gather(output, input, async_op=async_op)

    def reduce_scatter(self, output, input, op: str = "sum", *, async_op: bool = False) -> Handle | None:
        self._flush()
        return self.inner.reduce_scatter(output, input, op, async_op=async_op)

    def broadcast(self, tensor, src: int, *, async_op: bool = False) -> Handle | None:
        self._flush()
        return self.inner.broadcast(tensor, src, async_op=async_op)

    def all_to_all(self, output, input, output_splits=None, input_splits=None, *, async_op: bool = False):
        self._flush()
        return self.inner.all_to_all(output, input, output_splits, input_splits, async_op=async_op)

    def send(self, tensor, dst: int, *, tag: int = 0, async_op: bool = False) -> Handle | None:
        self._flush()
        return self.inner.send(tensor, dst, tag=tag, async_op=async_op)

    def recv(self, tensor, src: int, *, tag: int = 0, async_op: bool = False) -> Handle | None:
        self._flush()
        return self.inner.recv(tensor, src, tag=tag, async_op=async_op)

    def barrier(self) -> None:
        self._flush()
        self.inner.barrier()

    def split(self, groups: Sequence[Sequence[int]]) -> Communicator:
        self._flush()
        return self.inner.split(groups)

    def __getattr__(self, name: str):
        # what a particular transport offers beyond the protocol (TorchCommunicator.group, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
