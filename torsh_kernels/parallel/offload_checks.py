"""What :class:`~torsh_kernels.parallel.offload_optimizer.OffloadedOptimizer` checks.

- ``load_state_dict``, before anything changes: :func:`check_state_dict`, a typed error naming the first thing
  in a state dict that does not fit the optimizer (types, group and parameter counts, parameter ids,
  hyperparameter types, and per parameter its state's keys, tensor shapes and dtypes);
- ``step``, across ranks, before anything is committed: :class:`StepAgreement` (made by :func:`step_agreement`
  from the optimizer's ``group``), whether every rank's step succeeded; where any failed, every rank rolls
  back and raises."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..checks import check_timeout
from ..collectives.agreement import exchanging
from ..collectives.communicator import TorchCommunicator, is_dtensor
from ..collectives.protocol import is_communicator, is_mesh
from ..errors import (
    ArgumentTypeError,
    CollectiveError,
    DTypeError,
    InvalidArgumentError,
    RankFailedError,
    ShapeError,
)
from .offload_chunks import local

__all__ = ["LINE", "StepAgreement", "check_state_dict", "error_line", "expected_keys", "same_kind", "step_agreement"]


def check_state_dict(
    sd: Any,
    param_groups: list[dict[str, Any]],
    optimizer_class: type[torch.optim.Optimizer],
    keys_cache: dict[str, dict[str, bool] | None],
    what: str,
) -> tuple[list[dict], dict]:
    """(param groups, state) of a state dict that fits an optimizer with these ``param_groups`` wrapping
    ``optimizer_class``, or a typed error naming the first thing that does not: types, group and parameter
    counts, parameter ids, hyperparameter types, and per parameter its state's keys (those the wrapped
    optimizer keeps, :func:`expected_keys`, remembered in ``keys_cache``), tensor shapes and dtypes."""
    groups, state = _check_layout(sd, param_groups, what)
    seen: set[int] = set()
    for gi, (g, saved) in enumerate(zip(param_groups, groups)):
        _check_group(gi, g, saved, seen, what)
    unknown = [k for k in state if k not in seen]
    if unknown:
        raise InvalidArgumentError(f"{what}: 'state' holds parameter ids {unknown[:5]} that no param group lists")
    ids = [i for saved in groups for i in saved["params"]]
    params = [p for g in param_groups for p in g["params"]]
    group_of = [gi for gi, g in enumerate(param_groups) for _ in g["params"]]
    for pos, (i, p) in enumerate(zip(ids, params)):
        s = state.get(i)
        if s is None:
            continue
        if not isinstance(s, Mapping):
            raise ArgumentTypeError(f"{what}: the state of parameter {i} is a {type(s).__name__}, expected a dict")
        shape = tuple(local(p).shape)
        gi = group_of[pos]
        kinds = expected_keys(optimizer_class, {**param_groups[gi], **groups[gi]}, keys_cache)
        _check_param_state(i, s, shape, kinds, optimizer_class.__name__, what)
    return groups, state


def _check_layout(sd: Any, param_groups: list[dict[str, Any]], what: str) -> tuple[list, Mapping]:
    """The state dict's param groups (as many as ``param_groups``) and its state (a mapping)."""
    if not isinstance(sd, Mapping):
        raise ArgumentTypeError(f"{what}: expected a dict (from state_dict()), got {type(sd).__name__}")
    groups, state = sd.get("param_groups"), sd.get("state", {})
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise InvalidArgumentError(
            f"{what}: {len(groups) if isinstance(groups, list) else repr(groups)} param groups given, this "
            f"optimizer has {len(param_groups)}"
        )
    if not isinstance(state, Mapping):
        raise ArgumentTypeError(f"{what}: 'state' must be a dict of parameter index -> state, got "
                                f"{type(state).__name__}")  # fmt: skip
    return groups, state


def _check_group(gi: int, g: dict[str, Any], saved: Any, seen: set, what: str) -> None:
    """Saved param group ``gi`` against this optimizer's ``g``: its parameter count, its parameter ids
    (added to ``seen``, each once over all groups), its hyperparameters' types."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list):
        raise ArgumentTypeError(f"{what}: param group {gi} must be a dict with a 'params' list, got {saved!r:.80}")
    ps = saved["params"]
    if len(ps) != len(g["params"]):
        raise InvalidArgumentError(
            f"{what}: param group {gi} has {len(ps)} parameters in the state dict and {len(g['params'])} here"
        )
    for i in ps:
        if isinstance(i, bool) or not isinstance(i, (int, str)):  # (str: the names DCP writes)
            raise InvalidArgumentError(f"{what}: param group {gi} lists parameter id {i!r}; expected an int or name")
        if i in seen:
            raise InvalidArgumentError(f"{what}: param group {gi} lists parameter id {i!r} twice")
        seen.add(i)
    for k, v in saved.items():
        if k != "params" and k in g and not same_kind(g[k], v):
            raise ArgumentTypeError(f"{what}: param group {gi} has {k}={v!r:.60}; this optimizer's {k} is "
                                    f"{g[k]!r:.60}, of another type")  # fmt: skip


def _check_param_state(i: Any, s: Mapping, shape: tuple, kinds: dict[str, bool] | None, optimizer: str,
                       what: str) -> None:  # fmt: skip
    """The saved state ``s`` of parameter ``i`` (of ``shape``): the keys ``kinds`` the wrapped ``optimizer``
    keeps (None: not checked), then each value."""
    got = {k for k in s if k != "master"}
    if got and kinds is not None and got != set(kinds):
        raise InvalidArgumentError(
            f"{what}: the state of parameter {i} has keys {sorted(got)}; {optimizer} with "
            f"these hyperparameters keeps {sorted(kinds)} (is this another optimizer's state dict?)"
        )
    for k, v in s.items():
        _check_value(i, k, v, shape, kinds, what)


def _check_value(i: Any, k: Any, v: Any, shape: tuple, kinds: dict[str, bool] | None, what: str) -> None:
    """One entry ``k: v`` of parameter ``i``'s state: a floating-point tensor (a 0-d one of any dtype but the
    master) of the parameter's shape where the optimizer keeps it so, or a finite number (or None)."""
    if not isinstance(k, str):
        raise ArgumentTypeError(f"{what}: the state of parameter {i} has a key {k!r}, expected strings")
    if isinstance(v, torch.Tensor):
        t = local(v)
        if not (t.is_floating_point() or (t.dim() == 0 and k != "master")):
            raise DTypeError(f"{what}: {k} of parameter {i} is {t.dtype}; expected a floating-point tensor")
        # the master, and states the optimizer keeps in the parameter's shape, must have its shape
        param_shaped = k == "master" or (kinds[k] if kinds is not None else t.numel() > 1)
        if param_shaped and tuple(t.shape) != shape:
            raise ShapeError(
                f"{what}: {k} of parameter {i} has shape {tuple(t.shape)}, the parameter {shape}; "
                "the state dict belongs to another model (or another sharding)"
            )
    elif k == "master":
        raise ArgumentTypeError(f"{what}: master of parameter {i} is a {type(v).__name__}, expected a tensor")
    elif v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ArgumentTypeError(f"{what}: {k} of parameter {i} is {v!r:.60}; expected a tensor or a number")
    elif isinstance(v, float) and not math.isfinite(v):
        raise InvalidArgumentError(f"{what}: {k} of parameter {i} is {v}")


def expected_keys(
    optimizer_class: type[torch.optim.Optimizer], hyper: dict[str, Any], cache: dict[str, dict[str, bool] | None]
) -> dict[str, bool] | None:
    """The state keys ``optimizer_class`` keeps for a parameter of a group with these hyperparameters, each
    with whether its value has the parameter's shape, from one step on a throwaway parameter (None when that
    cannot be run: the keys are not checked then); remembered in ``cache`` per hyperparameters."""
    hyper = {k: v for k, v in hyper.items() if k != "params"}
    key = repr(sorted((k, repr(v)) for k, v in hyper.items()))
    if key not in cache:
        try:
            t = torch.zeros(2, 3, requires_grad=True)
            t.grad = torch.ones(2, 3)
            probe = optimizer_class([{"params": [t], **hyper}])
            probe.step()
            cache[key] = {k: isinstance(v, torch.Tensor) and v.shape == t.shape for k, v in probe.state[t].items()}
        except Exception:  # an optimizer that needs a closure, say: its keys are not checked
            cache[key] = None
    return cache[key]


def same_kind(mine: Any, v: Any) -> bool:
    """Whether a loaded hyperparameter ``v`` is of the kind of this optimizer's ``mine``."""
    if isinstance(mine, bool):
        return isinstance(v, bool)
    if isinstance(mine, (int, float)):
        return (not isinstance(v, bool) and isinstance(v, (int, float))) or (
            isinstance(v, torch.Tensor) and v.numel() == 1
        )
    if isinstance(mine, (tuple, list)):
        return isinstance(v, (tuple, list)) and len(v) == len(mine) and all(same_kind(a, b) for a, b in zip(mine, v))
    return True


# -- one step's outcome, agreed across ranks -------------------------------------------------------------

LINE = 200
"""Bytes of a failed rank's error line sent to the other ranks (longer lines are cut)."""


def error_line(e: BaseException) -> str:
    """``"Type: first line of the message"``: how one rank's error is named on the others."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _note(e: BaseException, text: str) -> None:
    if hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(text)


class StepAgreement:
    """The ranks whose ``OffloadedOptimizer.step`` is all or nothing together, and the exchange that decides it.

    ``comms``: communicators whose successive MAX all-reduces reach every one of ``ranks`` (one over a process
    group; one per dimension of a DeviceMesh); ``position``: this rank's index in ``ranks`` (global ranks, or
    a given communicator's ranks). ``unsettled``: set when an exchange did not complete on this rank (a peer
    gone, the timeout): peers may then have committed the step this rank rolled back."""

    __slots__ = ("comms", "position", "ranks", "unsettled")

    def __init__(self, comms: list, position: int, ranks: list[int]) -> None:
        self.comms = comms
        self.position = position
        self.ranks = ranks
        self.unsettled: str | None = None

    def failures(self, failure: str | None) -> dict[int, str]:
        """Every rank's outcome: ``failure`` is this rank's (None: it succeeded); returns {rank: error line}
        of the ranks that failed, the same on every rank ({}: all succeeded). One all-reduce of one byte per
        rank per communicator; where any failed, a second one of ``LINE`` bytes per failed rank. A collective."""
        dev = self.comms[0].device
        flags = torch.zeros(len(self.ranks), dtype=torch.uint8)
        if failure is not None:
            flags[self.position] = 1
        flags = flags.to(dev)
        for c in self.comms:
            c.all_reduce(flags, "max")
        failed = flags.nonzero().flatten().tolist()
        if not failed:
            return {}
        lines = torch.zeros(len(failed), LINE, dtype=torch.uint8)
        if failure is not None:
            raw = failure.encode("utf-8", "replace")[:LINE]
            lines[failed.index(self.position), : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        lines = lines.to(dev)
        for c in self.comms:
            c.all_reduce(lines, "max")
        rows = lines.cpu().tolist()
        return {self.ranks[i]: bytes(r).rstrip(b"\0").decode("utf-8", "replace") for i, r in zip(failed, rows)}

    def settle(self, error: BaseException | None, rollback: Callable[[], None], what: str) -> None:
        """After this rank's step: agree on every rank's outcome. Returns when all succeeded, or when this rank
        failed (``error``; the caller raises it, rolled back already, with a note on what the others did);
        otherwise calls ``rollback`` and raises ``RankFailedError`` naming the failed ranks, or, where the
        exchange itself failed (a peer gone, past the timeout), the communicator's ``CollectiveError``."""
        me = self.ranks[self.position]
        try:
            failed = self.failures(None if error is None else error_line(error))
        except BaseException as e:
            if error is not None:  # no rank can commit: this rank's failure is in the exchange, or it failed
                _note(error, f"{what}: the other ranks could not be told (the exchange failed: {error_line(e)})")
                return
            rollback()
            self.unsettled = (
                f"{what}: the ranks' agreement on a step did not complete on rank {me} ({error_line(e)}); this rank "
                "rolled the step back, but a rank that completed the exchange may have committed it, so the ranks' "
                "parameters may differ. Restore every rank from the last checkpoint (load_state_dict) before "
                "stepping or saving again"
            )
            if isinstance(e, CollectiveError):
                raise type(e)(self.unsettled) from e
            raise
        if error is not None:
            others = sorted(r for r in failed if r != me)
            also = f"; {_ranks(others)} failed too" if others else ""
            _note(error, f"{what}: every rank of the group ({_ranks(self.ranks)}) rolled this step back{also}")
            return
        if failed:
            rollback()
            names = "; ".join(f"rank {r}: {line}" for r, line in failed.items())
            raise RankFailedError(
                f"{what}: {_ranks(list(failed))} failed in this step ({names}); every rank of the group "
                f"({_ranks(self.ranks)}) rolled it back: the parameters and optimizer state are those before it. "
                "Fix what failed there and step again, or restore from a checkpoint",
                failures=failed,
            )


def step_agreement(group: Any, params: list[torch.Tensor], timeout: float | None, what: str) -> StepAgreement | None:
    """The ranks a step agrees with (see ``OffloadedOptimizer``'s ``group``): None where there are none to
    agree with (off, plain tensors under "auto", a single rank); a typed error for a ``group`` it cannot use."""
    if group is False:
        return None
    if timeout is not None:
        timeout = check_timeout(timeout, what)
    if group is None or group is True:
        raise InvalidArgumentError(
            f"{what}: group={group!r}; pass 'auto' (DTensor parameters: their DeviceMesh), a ProcessGroup "
            "(dist.group.WORLD for the default group), a DeviceMesh or a Communicator, or False for no agreement "
            "across ranks"
        )
    if isinstance(group, str):
        if group != "auto":
            raise InvalidArgumentError(f"{what}: group={group!r}; the only string taken is 'auto'")
        meshes = list(dict.fromkeys(p.device_mesh for p in params if is_dtensor(p)))
        if not meshes:
            return None
        if len(meshes) > 1:
            raise InvalidArgumentError(
                f"{what}: the parameters are DTensors on {len(meshes)} different device meshes ({meshes[:3]}); "
                "pass group= the process group whose ranks all step this optimizer together (e.g. "
                "dist.group.WORLD), or group=False for each rank on its own"
            )
        group = meshes[0]
    return _agreement_over(group, timeout, what)


def _agreement_over(group: Any, timeout: float | None, what: str) -> StepAgreement | None:
    if is_mesh(group):
        ranks = group.mesh.flatten().tolist()
        comms = [TorchCommunicator(group, dim=d, timeout=timeout) for d in range(group.ndim)]
        position = ranks.index(dist.get_rank())
    elif isinstance(group, dist.ProcessGroup):
        comms = [TorchCommunicator(group, timeout=timeout)]
        ranks = dist.get_process_group_ranks(group)
        position = comms[0].rank
    elif is_communicator(group, ("all_reduce", "rank", "world_size", "device")):
        if timeout is not None:
            raise InvalidArgumentError(
                f"{what}: timeout applies to a process group or a DeviceMesh; a Communicator has its own"
            )
        comms, ranks, position = [group], list(range(group.world_size)), group.rank
    else:
        raise ArgumentTypeError(
            f"{what}: group must be 'auto', a ProcessGroup, a DeviceMesh, a Communicator or False, got "
            f"{type(group).__name__}"
        )
    comms = [c for c in comms if exchanging(c)]
    return StepAgreement(comms, position, ranks) if comms else None
