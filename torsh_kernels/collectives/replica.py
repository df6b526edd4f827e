"""A communicator for measuring, not for moving data: a group of ``world_size`` ranks in which every rank
holds exactly what this process holds.

:class:`ReplicaCommunicator` answers each collective locally as that group would (an all-reduce sums
``world_size`` equal contributions, an all-gather repeats this rank's segment, an all-to-all returns
each destination's block to itself) and records what it was asked to move, as
:class:`~torsh_kernels.collectives.cost_model.Round` s. Running a real reduction through it therefore
exercises the real compress, decode and bookkeeping code for the real world size (decoding ``world_size``
gathered payloads, the sign compressor's server phase over its own shard, ...) while the network costs
nothing; the recorded rounds are what the reduction would put on the wire, for the alpha-beta model to
price. ``compressor="auto"`` (:mod:`torsh_kernels.parallel.auto`) measures candidates this way.

It is not a transport. The values it returns are those of a group whose ranks all agree, which is right
for symmetric schemes (all-reduce, all-gather of payloads); in a sharded scheme, where rank ``d`` serves
part ``d`` (the sign compressor's server phase), every replica serves this rank's part, so the work and
the bytes are right and the values of the other parts are not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from .cost_model import Round
from .protocol import REDUCE_OPS, CompletedHandle

__all__ = ["ReplicaCommunicator"]

_DONE = CompletedHandle()


class ReplicaCommunicator:
    """A local stand-in for ``world_size`` ranks that all hold this rank's data (see the module docstring).

    ``rounds`` lists every collective issued so far (all_reduce / all_gather / all_to_all, with the
    bytes this rank put in); broadcasts and barriers move no payload and are not recorded."""

    def __init__(self, world_size: int, device: torch.device | str = "cpu", *, rank: int = 0,
                 backend: str = "replica") -> None:  # fmt: skip
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgumentError(f"ReplicaCommunicator: world_size must be an int >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidArgumentError(f"ReplicaCommunicator: rank must be in [0, {world_size}), got {rank!r}")
        self._ws = world_size
        self._rank = rank
        self._device = torch.device(device)
        self._backend = backend
        self.rounds: list[Round] = []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._ws

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backend(self) -> str:
        return self._backend

    def __repr__(self) -> str:
        return f"ReplicaCommunicator(world_size={self._ws}, device={self._device})"

    @staticmethod
    def _tensor(t: object, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"ReplicaCommunicator.{what}: expected a torch.Tensor, got {type(t).__name__}")
        return t

    def _record(self, collective: str, t: torch.Tensor) -> None:
        self.rounds.append(Round(collective, t.numel() * t.element_size()))

    def all_reduce(self, tensor, op: str = "sum", *, async_op: bool = False):
        tensor = self._tensor(tensor, "all_reduce")
        if op not in REDUCE_OPS:
            raise InvalidArgumentError(f"ReplicaCommunicator.all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")
        self._record("all_reduce", tensor)
        if op == "sum":
            tensor.mul_(self._ws)  # the sum of world_size equal contributions (one pass, as a reduction)
        elif op == "product":
            tensor.pow_(self._ws)
        # avg, max, min of equal values: the values themselves
        return _DONE if async_op else None

    def all_gather(self, output, input, *, async_op: bool = False):
        input = self._tensor(input, "all_gather")
        self._record("all_gather", input)
        if isinstance(output, (list, tuple)):
            for o in output:
                o.copy_(input)
        else:
            output.view(self._ws, -1).copy_(input.reshape(1, -1))
        return _DONE if async_op else None

    def reduce_scatter(self, output, input, op: str = "sum", *, async_op: bool = False):
        input = self._tensor(input, "reduce_scatter")
        self.rounds.append(Round("all_reduce", input.numel() * input.element_size() / 2))  # half an all-reduce
        seg = input.reshape(self._ws, -1)[self._rank].reshape(output.shape)
        output.copy_(seg * self._ws if op == "sum" else seg)
        return _DONE if async_op else None

    def broadcast(self, tensor, src: int, *, async_op: bool = False):
        return _DONE if async_op else None

    def all_to_all(self, output, input, output_splits: Sequence[int] | None = None,
                   input_splits: Sequence[int] | None = None, *, async_op: bool = False):  # fmt: skip
        input = self._tensor(input, "all_to_all")
        self._record("all_to_all", input)
        if input_splits is None:
            blocks = input.reshape(self._ws, -1)
            mine = blocks[self._rank]
            output.view(self._ws, -1).copy_(mine.reshape(1, -1))  # every rank sends this rank its own block
        else:
            lo = sum(input_splits[: self._rank])
            mine = input[lo : lo + input_splits[self._rank]]
            off = 0
            for n in output_splits or [input_splits[self._rank]] * self._ws:
                output[off : off + n].copy_(mine)
                off += n
        return _DONE if async_op else None

    def send(self, tensor, dst: int, *, tag: int = 0, async_op: bool = False):
        raise InvalidArgumentError("ReplicaCommunicator: point-to-point messages have no replica meaning")

    recv = send

    def barrier(self) -> None:
        return None

    def split(self, groups: Sequence[Sequence[int]]) -> ReplicaCommunicator:
        mine = next((g for g in groups if self._rank in g), None)
        if mine is None:
            raise InvalidArgumentError(f"ReplicaCommunicator.split: rank {self._rank} is in no group")
        return ReplicaCommunicator(len(mine), self._device, rank=list(mine).index(self._rank), backend=self._backend)
