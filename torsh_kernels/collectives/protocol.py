"""The ``Communicator`` protocol, and what every transport of this package shares.

Every collective of the library goes through a :class:`Communicator`. The protocol is small and
tensor-in, tensor-out (torch tensors, dim-0 splits), so that its transports (a ``torch.distributed``
process group, :mod:`.communicator`; CuPy's NCCL communicator; RDMA through pyverbs) implement it
without callers changing:

- ``rank``, ``world_size``, ``device`` (where this rank's tensors live), ``backend``;
- ``all_reduce(tensor, op)``, in place; ``op`` one of ``"sum" "avg" "max" "min" "product"``;
- ``all_gather(output, input)``: ``output`` is [world * n, ...] (rank r's rows at r * n) or a list of
  ``world_size`` tensors shaped like ``input``;
- ``reduce_scatter(output, input, op)``: ``input`` is [world * n, ...], this rank gets the reduction of
  rows [rank * n, (rank + 1) * n);
- ``broadcast(tensor, src)``;
- ``all_to_all(output, input, output_splits=None, input_splits=None)``: rows of ``input`` go to the
  ranks in ``input_splits`` order; uneven splits allowed;
- ``send(tensor, dst)`` / ``recv(tensor, src)``; ``barrier()``;
- ``split(groups)``: the communicator of the group (a list of ranks of *this* communicator) that holds
  this rank, every member calling with the same partition.

Each call accepts ``async_op=True`` and then returns a :class:`Handle` whose ``wait()`` completes it
(and raises :class:`~torsh_kernels.errors.CollectiveError` if the network part failed); otherwise it
returns ``None`` once done. Every call checks its arguments (types, device, dtype, contiguity, sizes,
ranks) and raises a typed error *before* anything goes on the network: a rank that raises locally then
simply does not join, and its peers fail with ``CollectiveError`` at the group's timeout (or at once if
the process exits) instead of hanging forever.

:class:`CommunicatorBase` holds what the transports share: their identity, their traffic counters and
those argument checks, so that every transport refuses the same bad input with the same typed error.
The helpers below resolve what callers pass as a group (a process group, a DeviceMesh, ``(mesh, dim)``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..errors import (
    ArgumentTypeError,
    CollectiveError,
    CollectiveTimeoutError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    ShapeError,
)
from .traffic import Traffic

__all__ = [
    "REDUCE_OPS",
    "Communicator",
    "CommunicatorBase",
    "CompletedHandle",
    "Handle",
    "is_communicator",
    "is_dtensor",
    "is_mesh",
    "is_mesh_dim",
    "is_timeout",
    "reject_dtensor",
    "resolve_group",
]

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


@runtime_checkable
class Handle(Protocol):
    """An operation in flight: ``wait()`` completes it (raising ``CollectiveError`` on failure)."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


@runtime_checkable
class Communicator(Protocol):
    """What the collectives above need from a transport (see the module docstring)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def backend(self) -> str: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Handle | None: ...

    def all_gather(
        self, output: torch.Tensor | list[torch.Tensor], input: torch.Tensor, *, async_op: bool = False
    ) -> Handle | None: ...

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *, async_op: bool = False
    ) -> Handle | None: ...

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None: ...

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
        *,
        async_op: bool = False,
    ) -> Handle | None: ...

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = False) -> Handle | None: ...

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, async_op: bool = False) -> Handle | None: ...

    def barrier(self) -> None: ...

    def split(self, groups: Sequence[Sequence[int]]) -> Communicator: ...


class CompletedHandle:
    """A handle for work that is already done."""

    __slots__ = ()

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


_TIMEOUT_WORDS = re.compile(r"timed out|timeout", re.IGNORECASE)


def is_timeout(e: BaseException) -> bool:
    """Whether a backend's error reports a timeout. gloo raises a plain ``RuntimeError`` ("Operation timed
    out!", or "Timed out waiting ... for recv" and the like) when the group's timeout expires, and
    ``Work.wait(timeout)`` another one; only a few backends raise ``TimeoutError`` itself."""
    return isinstance(e, TimeoutError) or bool(_TIMEOUT_WORDS.search(str(e).split("\n", 1)[0]))


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it: none exists before)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def reject_dtensor(t: object, what: str, name: str) -> None:
    """Raise ``ArgumentTypeError`` saying what to pass instead when ``t`` is a DTensor."""
    if is_dtensor(t):
        raise ArgumentTypeError(
            f"{what}: {name} is a DTensor (placements {tuple(t.placements)} on {t.device_mesh}); collectives here "
            f"move plain tensors: pass its local shard ({name}.to_local()) with a communicator of the mesh "
            f"dimension to reduce over (TorchCommunicator(mesh, dim=...)), or {name}.full_tensor()"
        )


def _tensor(t: object, what: str, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    reject_dtensor(t, what, name)
    return t


def is_mesh(x: object) -> bool:
    """Whether ``x`` is a ``DeviceMesh`` (without importing it: none exists before)."""
    mod = sys.modules.get("torch.distributed.device_mesh")
    return mod is not None and isinstance(x, mod.DeviceMesh)


def is_mesh_dim(x: object) -> bool:
    """Whether ``x`` is a ``(mesh, dim)`` pair."""
    return isinstance(x, tuple) and len(x) == 2 and is_mesh(x[0])


def resolve_group(group: object, dim: str | int | None, what: str) -> dist.ProcessGroup | None:
    """The process group of ``group``: a ProcessGroup, None (the default group), a DeviceMesh, whose
    dimension ``dim`` (a name or an index; may be omitted for a 1-D mesh) gives the group, or a
    ``(mesh, dim)`` pair."""
    if is_mesh_dim(group):
        if dim is not None:
            raise InvalidArgumentError(f"{what}: the mesh dimension is given twice ({group[1]!r} and {dim!r})")
        group, dim = group
    if group is None or isinstance(group, dist.ProcessGroup):
        if dim is not None:
            raise InvalidArgumentError(f"{what}: dim={dim!r} applies to a DeviceMesh, not to a process group")
        return group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DeviceMesh
        DeviceMesh = ()
    if not isinstance(group, DeviceMesh):
        raise ArgumentTypeError(
            f"{what}: group must be a ProcessGroup, a DeviceMesh, (mesh, dim) or None, got {type(group).__name__}"
        )
    names = group.mesh_dim_names
    if dim is None:
        if group.ndim != 1:
            raise InvalidArgumentError(
                f"{what}: a {group.ndim}-D DeviceMesh (dims {names}); pass dim= the name or index of the "
                "dimension to communicate over"
            )
        return group.get_group()
    if isinstance(dim, str):
        if not names or dim not in names:
            raise InvalidArgumentError(f"{what}: the mesh has no dimension named {dim!r} (its names: {names})")
    elif isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < group.ndim:
        raise InvalidArgumentError(f"{what}: dim must be a dimension name or an index below {group.ndim}, got {dim!r}")
    return group.get_group(dim)


class CommunicatorBase:
    """What every transport here shares: its identity (rank, world size, device, backend, global ranks),
    its :class:`Traffic` counters, and the argument checks each call makes before anything goes on the
    network, so that every :class:`Communicator` of this package refuses the same bad input with the same
    typed error. Subclasses set the slots in their ``__init__`` (``_traffic = Traffic()``) and count each
    collective they issue with ``_traffic.add(op, input bytes, world)``; ``_reduce_dtypes`` holds the
    dtypes their reductions accept."""

    __slots__ = ("_backend", "_device", "_rank", "_ranks", "_reduce_dtypes", "_traffic", "_world")

    @property
    def traffic(self) -> Traffic:
        """Collectives, payload bytes and wire bytes this rank has sent through this communicator."""
        return self._traffic

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def global_ranks(self) -> list[int]:
        """Global (default-group) rank of each rank of this communicator."""
        return list(self._ranks)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self._rank}, world_size={self._world}, backend={self._backend!r})"

    # -- validation ----------------------------------------------------------------------------------------

    def _check_tensor(self, t: object, what: str, name: str, *, reduce: bool = False, op: str = "sum") -> torch.Tensor:
        if (
            t.__class__ is torch.Tensor and t.is_cpu and self._device.type == "cpu" and t.is_contiguous()
            and (not reduce or (t.dtype in self._reduce_dtypes and op != "avg"))
        ):  # fmt: skip
            return t  # the common case on gloo, in a few attribute reads (each collective of a DDP hook)
        t = _tensor(t, what, name)
        dev = self._device
        if t.device.type != dev.type or (dev.type == "cuda" and t.device.index != dev.index):
            raise DeviceMismatchError(
                f"{what}: {name} is on {t.device}, this {self._backend} communicator moves tensors on {dev}; "
                f"move it with .to('{dev}')"
            )
        if not t.is_contiguous():
            raise ShapeError(f"{what}: {name} (shape {tuple(t.shape)}) is not contiguous; pass .contiguous()")
        if reduce:
            allowed = self._reduce_dtypes
            if t.dtype not in allowed:
                raise DTypeError(
                    f"{what}: {self._backend} cannot reduce {t.dtype}; use one of "
                    f"{sorted(str(d).replace('torch.', '') for d in allowed)}"
                )
            if op == "avg" and not (t.is_floating_point() or t.is_complex()):
                raise DTypeError(f"{what}: op='avg' needs a floating-point tensor, {name} is {t.dtype}")
        return t

    def _check_op(self, op: object, what: str) -> str:
        if op.__class__ is str and op == "sum":
            return op
        if not isinstance(op, str) or op.lower() not in REDUCE_OPS:
            raise InvalidArgumentError(f"{what}: op must be one of {REDUCE_OPS}, got {op!r}")
        return op.lower()

    def _check_peer(self, peer: object, what: str, name: str) -> int:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self._world:
            raise InvalidArgumentError(f"{what}: {name} must be a rank in [0, {self._world}), got {peer!r}")
        if peer == self._rank and name != "src":
            raise InvalidArgumentError(f"{what}: {name}={peer} is this rank; a rank cannot send to itself")
        return peer

    def _check_no_tag(self, tag: object, what: str) -> None:
        """For transports whose point-to-point messages have no tags (NCCL, RDMA here)."""
        if tag != 0:
            raise InvalidArgumentError(
                f"{what}: {self._backend} point-to-point has no tags (got tag={tag!r}); messages between two ranks "
                "match in the order they are issued: pass tag=0"
            )

    def failure(self, what: str, e: BaseException) -> CollectiveError:
        """The typed error for a backend call of ``what`` on this communicator's group that failed with ``e``
        (``CollectiveTimeoutError`` for a timeout, else ``CollectiveError``), for code that makes such a
        call itself (FSDP2's in-place all-gather, whose buffers overlap as no communicator call allows)."""
        return self._failure(what, e)

    def _failure(self, what: str, e: BaseException) -> CollectiveError:
        cls = CollectiveTimeoutError if is_timeout(e) else CollectiveError
        return cls(
            f"{what} failed on rank {self._rank} of {self._world} ({self._backend}, global ranks "
            f"{self._ranks}): {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}. "
            "A peer most likely exited, raised before joining this collective, or issued a different one; "
            "look at the other ranks' errors"
        )

    def _check_all_gather(self, output: object, input: object, what: str) -> tuple[object, torch.Tensor]:
        """(the output tensor or list of tensors, the input), checked."""
        x = self._check_tensor(input, what, "input")
        if isinstance(output, (list, tuple)):
            if len(output) != self._world:
                raise ShapeError(f"{what}: output list has {len(output)} tensors, expected world_size={self._world}")
            for i, o in enumerate(output):
                o = self._check_tensor(o, what, f"output[{i}]")
                if o.shape != x.shape or o.dtype != x.dtype:
                    raise ShapeError(
                        f"{what}: output[{i}] is {tuple(o.shape)} {o.dtype}, input is {tuple(x.shape)} {x.dtype}"
                    )
            return list(output), x
        out = self._check_tensor(output, what, "output")
        self._check_world_multiple(out, "output", x, "input", what, "")
        return out, x

    def _check_reduce_scatter(self, output: object, input: object, op: object,
                              what: str) -> tuple[torch.Tensor, torch.Tensor, str]:  # fmt: skip
        op = self._check_op(op, what)
        x = self._check_tensor(input, what, "input", reduce=True, op=op)
        out = self._check_tensor(output, what, "output", reduce=True, op=op)
        self._check_world_multiple(x, "input", out, "output", what, "; pad the input to a multiple of the world size")
        return out, x, op

    def _check_all_to_all(self, output: object, input: object, output_splits, input_splits, what: str) -> tuple:
        """(output, input, output splits, input splits), checked; a split list is None for even splits."""
        x = self._check_tensor(input, what, "input")
        out = self._check_tensor(output, what, "output")
        if out.dtype != x.dtype:
            raise DTypeError(f"{what}: output is {out.dtype}, input is {x.dtype}; they must match")
        if out.dim() == 0 or x.dim() == 0 or out.shape[1:] != x.shape[1:]:
            raise ShapeError(
                f"{what}: input {tuple(x.shape)} and output {tuple(out.shape)} must be at least 1-D with the "
                "same shape after dim 0 (rows are exchanged)"
            )
        ins = self._splits(input_splits, x.shape[0], what, "input")
        outs = self._splits(output_splits, out.shape[0], what, "output")
        _no_overlap(out, x, what, "output", "input")
        return out, x, outs, ins

    def _check_world_multiple(self, big: torch.Tensor, nbig: str, small: torch.Tensor, nsmall: str, what: str,
                              hint: str) -> None:  # fmt: skip
        """``big`` holds world_size times ``small``'s elements, same dtype, no shared memory."""
        if big.dtype != small.dtype:
            raise DTypeError(f"{what}: {nbig} is {big.dtype}, {nsmall} is {small.dtype}; they must match")
        if big.numel() != self._world * small.numel():
            raise ShapeError(
                f"{what}: {nbig} has {big.numel()} elements, expected world_size * {nsmall} = {self._world} * "
                f"{small.numel()} = {self._world * small.numel()}{hint}"
            )
        _no_overlap(big, small, what, nbig, nsmall)

    def _splits(self, splits: Sequence[int] | None, rows: int, what: str, name: str) -> list[int] | None:
        if splits is None:
            if rows % self._world:
                raise ShapeError(
                    f"{what}: {name} has {rows} rows, not divisible by world_size={self._world}; pass "
                    f"{name}_splits for uneven splits"
                )
            return None
        s = list(splits)
        if len(s) != self._world or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in s):
            raise InvalidArgumentError(f"{what}: {name}_splits must be {self._world} ints >= 0, got {splits!r}")
        if sum(s) != rows:
            raise ShapeError(f"{what}: {name}_splits sum to {sum(s)}, {name} has {rows} rows")
        return s

    def _split_members(self, groups: object, what: str = "split") -> list[int]:
        """The ranks of the group (of ``groups``, checked to be disjoint rank lists) holding this rank."""
        if not isinstance(groups, (list, tuple)) or not groups:
            raise ArgumentTypeError(f"{what}: groups must be a non-empty list of rank lists, got {groups!r}")
        seen: set[int] = set()
        mine = None
        for g in groups:
            if not isinstance(g, (list, tuple, range)) or not g:
                raise ArgumentTypeError(f"{what}: each group must be a non-empty list of ranks, got {g!r}")
            for r in g:
                if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self._world:
                    raise InvalidArgumentError(f"{what}: rank {r!r} is not in [0, {self._world})")
                if r in seen:
                    raise InvalidArgumentError(f"{what}: rank {r} appears in two groups; groups must be disjoint")
                seen.add(r)
            if self._rank in g:
                mine = list(g)
        if mine is None:
            raise InvalidArgumentError(f"{what}: rank {self._rank} is in none of the groups {groups!r}")
        return mine


def _no_overlap(a: torch.Tensor, b: torch.Tensor, what: str, na: str, nb: str) -> None:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    if a0 < b1 and b0 < a1:
        raise InvalidArgumentError(f"{what}: {na} and {nb} overlap in memory; use separate buffers")


def is_communicator(x: object, needs: Sequence[str] = ()) -> bool:
    """Whether ``x`` is a Communicator object having the methods in ``needs`` (not None, a process group,
    a DeviceMesh, a ``(mesh, dim)`` pair or a string)."""
    return (
        x is not None and not isinstance(x, (dist.ProcessGroup, tuple, str)) and not is_mesh(x)
        and all(hasattr(x, n) for n in needs)
    )  # fmt: skip
