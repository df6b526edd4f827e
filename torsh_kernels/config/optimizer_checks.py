"""The optimizer a configuration names, checked at import (:func:`check_optimizer`): every argument one the torch
class takes, every value of the kind and in the range it needs, the class buildable with them and two steps on a
throwaway parameter leaving it finite, so that a bad setting is refused under its key when the configuration is
read, not at the first step of a job.

Torch's own constructors accept more than trains: ``lr=inf`` (every parameter NaN after one step), ``eps=inf``,
a third ``betas`` entry (ignored), ``momentum=1e300``. The ranges here:

- ``lr`` in (0, :data:`MAX_LR`]: torch accepts any ``lr >= 0``, inf included. An Adam step moves each parameter
  by up to about ``lr`` (exactly ``lr`` in its first step), so above 65504, the largest finite fp16 value, one
  step takes an fp16 parameter to inf; no learning rate in use comes near it. An ``lr`` of 0 never moves a
  parameter, and is refused as the mistake it is.
- ``betas``: exactly two numbers, each in [0, 1) (torch checks the first two and ignores the rest);
  ``momentum`` in [0, 1) (a momentum of 1 or more never forgets a gradient); ``dampening`` and ``rho`` in [0, 1];
  ``eps`` finite and > 0; ``weight_decay`` finite and >= 0;
- every other number finite and at most :data:`~.common.F32_MAX` in size (the optimizer's state is fp32); the
  iteration counts (``max_iter``, ``max_eval``, ``history_size``, ``ns_steps``) integers in [1, 2**31 - 1]; the
  switches (``amsgrad``, ``foreach``, ``fused``, ...) true or false (or None where torch's default is None).

The throwaway step runs on the CPU without the device switches (``capturable``, ``fused``, ``foreach``,
``differentiable``), which change where and how the step runs, not what it computes; it costs well under a
millisecond. :class:`~torch.optim.LBFGS` (it needs a closure per step) and :class:`~torch.optim.SparseAdam`
(sparse gradients) cannot run inside :class:`~torsh_kernels.parallel.OffloadedOptimizer`, and are refused
where the configuration offloads the optimizer.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from .common import BAD, F32_MAX, Walk, check_bool, check_int, check_num, short_value, show_value

__all__ = ["MAX_LR", "check_optimizer"]

MAX_LR = 65504.0
"""The largest learning rate accepted: fp16's largest finite value (see the module docstring)."""

_LR_WHY = (
    "an lr of 0 never moves a parameter; an Adam step moves one by up to about lr, so above 65504, fp16's largest "
    "value, one step takes an fp16 parameter to inf"
)
_RANGES: dict[str, tuple[float, float, bool, bool, str]] = {  # name: lo, hi, lo open, hi open, why
    "lr": (0.0, MAX_LR, True, False, _LR_WHY),
    "eps": (0.0, F32_MAX, True, False, ""),
    "weight_decay": (0.0, F32_MAX, False, False, ""),
    "momentum": (0.0, 1.0, False, True, "a momentum of 1 or more never forgets a gradient"),
    "dampening": (0.0, 1.0, False, False, ""),
    "rho": (0.0, 1.0, False, False, "the running average's coefficient"),
}
_FLAGS = frozenset(
    {"amsgrad", "capturable", "centered", "decoupled_weight_decay", "differentiable", "foreach", "fused", "maximize"}
    | {"nesterov"}
)
_COUNTS = frozenset(("max_iter", "max_eval", "history_size", "ns_steps"))
_MAX_COUNT = 2**31 - 1
_DEVICE_SWITCHES = frozenset(("capturable", "differentiable", "foreach", "fused"))


def check_optimizer(w: Walk, key: str, cls: type, kwargs: dict[str, Any], *, offloaded: bool) -> bool:
    """Whether ``cls(params, **kwargs)`` is an optimizer that trains (see the module docstring); each problem is
    recorded in ``w``, under ``key.<argument>`` where one argument is at fault, else under ``key``."""
    accepted = inspect.signature(cls.__init__).parameters
    unknown = [k for k in kwargs if k not in accepted]
    for k in unknown:
        w.bad(f"{key}.{k}", f"torch.optim.{cls.__name__} takes no argument {short_value(k)}")
    ok = not unknown
    for k, v in kwargs.items():
        if k in accepted and _check_value(w, f"{key}.{k}", k, v, accepted[k].default) is BAD:
            ok = False
    if offloaded and cls in (torch.optim.LBFGS, torch.optim.SparseAdam):
        why = "needs a closure at each step" if cls is torch.optim.LBFGS else "takes sparse gradients only"
        w.bad(
            key.rsplit(".", 1)[0] + ".type",
            f"torch.optim.{cls.__name__} {why}, which OffloadedOptimizer cannot give it (its step runs the optimizer "
            "on host copies of dense gradients); the zero_optimization section offloads the optimizer",
        )
        ok = False
    if not ok:
        return False
    why = _try_steps(cls, kwargs)
    if why:
        w.bad(key, f"torch.optim.{cls.__name__} {why}")
    return not why


def _check_value(w: Walk, key: str, name: str, v: Any, default: Any) -> Any:
    """One argument's value, by its name and torch's default for it; BAD (recorded) when it cannot train."""
    if default is None and v is None:
        return v
    if name in _FLAGS or isinstance(default, bool):
        return check_bool(w, key, v)
    if name in _COUNTS:
        return check_int(w, key, v, 1, _MAX_COUNT, "a count of iterations or of kept steps")
    if name == "betas":
        return _check_pair(w, key, v, (0.0, 0.0), hi_open=True, why="each beta must be in [0, 1)")
    if name in _RANGES and not isinstance(default, tuple):
        lo, hi, lo_open, hi_open, why = _RANGES[name]
        return check_num(w, key, v, lo, strict=lo_open, hi=hi, hi_open=hi_open, why=why)
    if isinstance(default, tuple):
        return _check_pair(w, key, v, default)
    if isinstance(default, (int, float)) or (default is None and not isinstance(v, str)):
        return check_num(w, key, v, -F32_MAX)
    return v  # a string or an object (LBFGS's line_search_fn): the build and the steps judge it


def _check_pair(w: Walk, key: str, v: Any, default: tuple, *, hi_open: bool = False, why: str = "") -> Any:
    """A list or tuple as long as torch's ``default`` (betas, etas, step_sizes, Adafactor's eps), of finite numbers
    (None where the default has None); with ``hi_open``, each in [0, 1)."""
    n = len(default)
    if not isinstance(v, (list, tuple)):
        return w.bad(key, f"must be a list of {n} numbers, got {show_value(v)}")
    if len(v) != n:
        return w.bad(key, f"must be a list of exactly {n} numbers, got {len(v)}: {short_value(list(v))}")
    for i, (x, d) in enumerate(zip(v, default)):
        if d is None and x is None:
            continue
        lo, hi = (0.0, 1.0) if hi_open else (-F32_MAX, F32_MAX)
        if check_num(w, key, x, lo, hi=hi, hi_open=hi_open) is BAD:
            w.errors[key] = f"entry {i}: {w.errors[key]}" + (f" ({why})" if why else "")
            return BAD
    return tuple(v)


def _try_steps(cls: type, kwargs: dict[str, Any]) -> str:
    """'' when ``cls`` builds with ``kwargs`` and two steps on a throwaway CPU parameter leave it finite; else
    what went wrong (the device switches left out; iteration counts capped at 2, so that LBFGS stays cheap)."""
    kw = {k: (min(v, 2) if k in _COUNTS and isinstance(v, int) else v) for k, v in kwargs.items()
          if k not in _DEVICE_SWITCHES}  # fmt: skip
    p = torch.zeros(2, 2, requires_grad=True)
    try:
        opt = cls([p], **kw)
    except (TypeError, ValueError) as e:
        return f"refuses these values: {e}"
    sparse = cls is torch.optim.SparseAdam

    def closure() -> torch.Tensor:
        g = torch.full((2, 2), 0.5)
        p.grad = g.to_sparse() if sparse else g
        return (p.detach() * 0.5).sum()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):
                opt.step(closure)
    except Exception as e:  # (what torch raises at a step varies: RuntimeError, TypeError, AssertionError...)
        return f"fails a step on a throwaway parameter: {type(e).__name__}: {str(e)[:200]}"
    if not bool(torch.isfinite(p).all()):
        return "takes a throwaway parameter to NaN or inf in two steps with gradients of 0.5: check the values"
    return ""
