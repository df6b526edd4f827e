"""A bucket engine's compressor states: :func:`snapshot` / :func:`restore` (what ``nonfinite="propagate"``
rolls an iteration back to), and the checks of its checkpoint (``BucketCompressor.load_state_dict``): every entry
of a ``state_dict()`` checked before anything changes, a typed error naming the first bad one."""

from __future__ import annotations

import math

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError, LayoutMismatchError, ShapeError

__all__ = ["check_owner", "checked_state", "restore", "snapshot"]


def checked_state(
    engine, sd: dict, what: str, owner: tuple[int, int] | None = None
) -> tuple[object, int, dict, dict, dict]:
    """(auto's recorded decision or None, the iteration, the shapes, the compressor states) of ``sd``,
    checked against ``engine`` (its policy, compressor, auto, the shapes it has seen) and, where both say, against
    the process that loads it (``owner``: its rank and world size; the residuals and PowerSGD's Q are a rank's own)."""
    w = f"{what}.load_state_dict"
    need = {"iteration", "policy", "shapes", "states"}
    known = need | {"compressor", "auto", "rank", "world_size", "handover"}
    if not isinstance(sd, dict):
        raise ArgumentTypeError(f"{w}: expected a dict from state_dict(), got {type(sd).__name__}")
    if not need <= sd.keys() or not sd.keys() <= known:
        raise InvalidArgumentError(
            f"{w}: expected a dict from state_dict() with keys {sorted(need)} (and 'compressor', 'auto'); "
            f"missing {sorted(need - sd.keys())}, unexpected {sorted(map(str, sd.keys() - known))}"
        )
    check_owner(sd, owner, w)
    if sd["policy"] != engine.spec.policy:
        raise InvalidArgumentError(
            f"{w}: the checkpoint was saved with policy={sd['policy']!r}, this state "
            f"uses {engine.spec.policy!r}; construct the state with the same policy"
        )
    iteration = sd["iteration"]
    if isinstance(iteration, bool) or not isinstance(iteration, int):
        raise ArgumentTypeError(f"{w}: 'iteration' must be an int, got {type(iteration).__name__} {iteration!r}")
    if iteration < 0:
        raise InvalidArgumentError(f"{w}: 'iteration' must be >= 0, got {iteration}")
    decision, compressor = None, engine.compressor
    if sd.get("auto") is not None:
        if engine.auto is None:
            choice = sd["auto"].get("choice") if isinstance(sd["auto"], dict) else sd["auto"]
            raise InvalidArgumentError(
                f"{w}: the checkpoint was saved with compressor='auto' (which chose {choice!r}); construct this "
                "state with compressor='auto' too"
            )
        decision = engine.auto.recorded(sd["auto"], what)  # the saved choice, not a new measurement
        compressor = engine.auto_compressor(decision.compressor)
    saved = sd.get("compressor", repr(compressor))
    if not isinstance(saved, str):
        raise ArgumentTypeError(f"{w}: 'compressor' must be the compressor's repr, got {type(saved).__name__}")
    if saved != repr(compressor):
        raise InvalidArgumentError(f"{w}: the checkpoint was saved with {saved}, this state uses {compressor!r}")
    shapes = _checked_shapes(engine, sd["shapes"], w)
    raw = sd["states"]
    if not isinstance(raw, dict):
        raise ArgumentTypeError(f"{w}: 'states' must be a dict of parameter keys -> state, got {type(raw).__name__}")
    states = {}
    for k, v in raw.items():
        key = tuple(k) if isinstance(k, (tuple, list)) else None
        if not key or any(isinstance(i, bool) or not isinstance(i, int) for i in key):
            raise ArgumentTypeError(f"{w}: each key of 'states' must be a non-empty tuple of ints, got {k!r}")
        if key in states:
            raise InvalidArgumentError(f"{w}: 'states' holds the key {key} twice")
        st = compressor.new_state()
        st.load_state_dict(v)  # all-or-nothing per state; st is new, so a failure changes nothing here
        r = st.tensors.get("residual")
        if r is not None:
            if not set(key) <= shapes.keys():
                raise InvalidArgumentError(f"{w}: state {key} names tensors whose shapes 'shapes' does not hold")
            n = sum(math.prod(shapes[i]) for i in key)
            if r.numel() != n:
                raise ShapeError(
                    f"{w}: the residual of state {key} has {r.numel()} elements, its tensors (shapes "
                    f"{[shapes[i] for i in key]}) have {n}; the checkpoint is of another model"
                )
        states[key] = st
    return decision, iteration, shapes, states, _checked_handover(sd.get("handover", {}), shapes, w)


def _checked_handover(raw: object, shapes: dict, w: str) -> dict[int, torch.Tensor]:
    """A checkpoint's ``handover`` (``compressor="auto"`` switched and a parameter's residual waits for its next
    gradient): parameter key -> fp32 tensor of that parameter's size."""
    if not isinstance(raw, dict):
        raise ArgumentTypeError(f"{w}: 'handover' must be a dict of parameter key -> tensor, got {type(raw).__name__}")
    out = {}
    for k, r in raw.items():
        if isinstance(k, bool) or not isinstance(k, int) or k not in shapes:
            raise InvalidArgumentError(f"{w}: 'handover' key {k!r} is not a parameter key of 'shapes'")
        if not isinstance(r, torch.Tensor) or r.dtype != torch.float32 or r.numel() != math.prod(shapes[k]):
            raise ShapeError(f"{w}: handover[{k}] must be an fp32 tensor of {math.prod(shapes[k])} elements, got "
                             f"{type(r).__name__} {getattr(r, 'dtype', '')} {getattr(r, 'shape', '')}")  # fmt: skip
        out[k] = r.clone()
    return out


def check_owner(sd: dict, owner: tuple[int, int] | None, w: str) -> None:
    """A state saved by rank r of n loads only on rank r of n: each rank's residuals and PowerSGD's Q are its own,
    and nothing else in the state tells them apart (the settings, shapes and iteration are the same on every rank)."""
    if "rank" not in sd and "world_size" not in sd:
        return  # saved where the rank was not known (or by a version that did not record it)
    saved = (sd.get("rank"), sd.get("world_size"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in saved) or saved[0] >= saved[1]:
        raise InvalidArgumentError(f"{w}: 'rank' and 'world_size' must be ints with 0 <= rank < world_size, got "
                                   f"{saved[0]!r} and {saved[1]!r}")  # fmt: skip
    if owner is not None and tuple(owner) != saved:
        raise InvalidArgumentError(
            f"{w}: this state was saved by rank {saved[0]} of {saved[1]}, and this process is rank {owner[0]} of "
            f"{owner[1]}: each rank's error-feedback residuals and PowerSGD Q are its own; save one state per rank "
            "(e.g. f'hook-rank{rank}.pt') and load each rank's own"
        )


def _checked_shapes(engine, shapes: object, w: str) -> dict[int, tuple[int, ...]]:
    """A checkpoint's ``shapes`` (parameter key -> shape), checked, and against the shapes seen so far."""
    if not isinstance(shapes, dict):
        raise ArgumentTypeError(f"{w}: 'shapes' must be a dict of parameter key -> shape, got {type(shapes).__name__}")
    out = {}
    for k, v in shapes.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ArgumentTypeError(f"{w}: each key of 'shapes' must be an int >= 0, got {k!r}")
        if not isinstance(v, (tuple, list, torch.Size)) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in v
        ):
            raise ArgumentTypeError(f"{w}: shapes[{k}] must be a tuple of ints >= 0, got {v!r}")
        shape = tuple(v)
        known = engine.shapes.get(k)
        if known is not None and known != shape:
            raise LayoutMismatchError(
                f"{w}: the checkpoint holds shape {shape} for tensor {k}, this state has seen {known}; load a "
                "state saved from the same model"
            )
        out[k] = shape
    return out


def snapshot(st, old: tuple | None) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(step, seed, copies of the tensors) of the compressor state ``st``, reusing ``old``'s buffers (a former
    snapshot of it) where they fit."""
    keep = {}
    for name, t in st.tensors.items():
        b = old[2].get(name) if old is not None else None
        if b is not None and b.shape == t.shape and b.dtype == t.dtype and b.device == t.device:
            keep[name] = b.copy_(t)
        else:
            keep[name] = t.clone()
    return st.step, st.seed, keep


def restore(st, snap: tuple[int, int, dict[str, torch.Tensor]]) -> None:
    """Put the compressor state ``st`` back as :func:`snapshot` saw it."""
    step, seed, saved = snap
    st.step, st.seed = step, seed
    for name in [n for n in st.tensors if n not in saved]:
        del st.tensors[name]
    for name, b in saved.items():
        t = st.tensors.get(name)
        if t is not None and t.shape == b.shape and t.dtype == b.dtype and t.device == b.device:
            t.copy_(b)
        else:
            st.tensors[name] = b.clone()
