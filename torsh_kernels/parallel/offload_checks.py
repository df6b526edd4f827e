"""What ``OffloadedOptimizer.load_state_dict`` (:mod:`torsh_kernels.parallel.offload_optimizer`) checks
before anything changes: :func:`check_state_dict`, a typed error naming the first thing in a state
dict that does not fit the optimizer (types, group and parameter counts, parameter ids, hyperparameter
types, and per parameter its state's keys, tensor shapes and dtypes)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ArgumentTypeError, DTypeError, InvalidArgumentError, ShapeError
from .offload_chunks import local

__all__ = ["check_state_dict", "expected_keys", "same_kind"]


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
