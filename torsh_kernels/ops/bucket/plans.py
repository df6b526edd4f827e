"""The direct path of flatten and unflatten (see ``eager``): validation cached per layout, the implementation
called without the dispatcher. A plan is what one full validation of (tensors, out) or (flat, layout,
tensors) found; it is found again by the tensors' addresses and confirmed by a C-level check of their types,
dtypes, devices, shapes, strides and requires_grad (``common.tensor_guards``), which together fix everything the
validation read (memory ranges included). Anything else takes the full validation, and then the plan is
stored.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import eager
from ..common import Memo, ptrs_of, tensor_guards
from .layout import BucketLayout
from .providers import TORCH_IMPL, flatten_impl, flatten_into, unflatten_impl, unflatten_into

__all__ = [
    "FLAT_PLANS",
    "UNFLAT_PLANS",
    "FlatPlan",
    "UnflatPlan",
    "flat_provider",
    "flatten_run",
    "new_flat_plan",
    "plain_all",
    "unflatten_run",
]


@dataclass(slots=True, eq=False)
class FlatPlan:
    """What a full validation of flatten's (tensors, out) found."""

    guards: object
    ptrs: tuple  # the tensors' addresses when it was validated
    layout: BucketLayout
    device: torch.device
    cat: bool  # every tensor of the flat dtype, so torch.cat(out=) writes the bucket exactly
    cat_scaled: bool  # ... and the flat dtype is its own compute dtype (fp32/fp64): scaling in place rounds once
    one_d: bool  # every tensor is 1-D (no reshape before the cat)
    out_1d: bool  # out is None or 1-D
    grad: bool  # a tensor requires grad: run with grad mode off, as below the dispatcher's autograd


@dataclass(slots=True, eq=False)
class UnflatPlan:
    """What a full validation of unflatten's (flat, layout, tensors) found."""

    guards: object
    layout: BucketLayout
    device: torch.device
    same: bool  # every tensor of flat's dtype and flat contiguous: one _foreach_copy_ from views of flat
    grad: bool
    flat_ref: object = None  # weakref to the flat the views were made of
    views: list | None = None


FLAT_PLANS = Memo(128)  # each plan is stored under two keys (see flatten)
UNFLAT_PLANS = Memo(32)


def plain_all(tensors: Sequence[torch.Tensor]) -> bool:
    return all(map(eager.plain, tensors))


def new_flat_plan(key, tensors, out, layout, device) -> FlatPlan | None:
    if key is None or not eager.unmoded() or not plain_all(tensors) or not eager.plain(out):
        return None
    guards = tensor_guards(list(tensors) if out is None else [*tensors, out])
    if guards is None:
        return None
    dt = layout.dtype
    plan = FlatPlan(
        guards=guards, ptrs=ptrs_of(tensors), layout=layout, device=device, cat=all(d == dt for d in layout.dtypes),
        cat_scaled=dt in (torch.float32, torch.float64), one_d=all(len(sh) == 1 for sh in layout.shapes),
        out_1d=out is None or out.dim() == 1, grad=any(t.requires_grad for t in tensors) or bool(
            out is not None and out.requires_grad),
    )  # fmt: skip
    FLAT_PLANS.put(key, plan)  # found by the list object, and by the tensors' addresses
    if plan.ptrs:
        FLAT_PLANS.put((plan.ptrs, *key[2:]), plan)
    return plan


def flat_provider(plan: FlatPlan, provider: str | None) -> str:
    return flatten_impl.select(plan.device, plan.layout.dtype, plan.layout.total, provider or None)


def flatten_run(plan: FlatPlan, tensors, out, scale: float, name: str):
    layout = plan.layout
    if out is None:
        flat = torch.empty(layout.total, dtype=layout.dtype, device=plan.device)
    else:
        flat = out if plan.out_1d else out.view(-1)
    if layout.total:
        if name in TORCH_IMPL and plan.cat and (scale == 1.0 or plan.cat_scaled):
            if plan.grad:
                eager.run(flatten_impl, name, tensors, flat, scale, plan.one_d)
            else:
                flatten_impl(name, tensors, flat, scale, plan.one_d)
        else:
            eager.run(flatten_into, list(tensors), flat, scale, name)
            eager.written(name, flat)
    return flat, layout


def _storage_views(flat: torch.Tensor, layout: BucketLayout) -> list[torch.Tensor]:
    """Tensors over ``flat``'s storage shaped like the layout's slices: not autograd views of ``flat``, so
    holding them does not keep the ``flat`` object alive (its weakref callback drops the plan)."""
    st, base = flat.untyped_storage(), flat.storage_offset()
    views = []
    for off, shape in zip(layout.offsets, layout.shapes):
        stride, acc = [], 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= max(d, 1)
        views.append(flat.new_empty(0).set_(st, base + off, shape, tuple(reversed(stride))))
    return views


def unflatten_run(plan: UnflatPlan, key, flat, tensors, scale: float, accumulate: bool, provider) -> None:
    total = plan.layout.total
    if total == 0:
        return
    name = unflatten_impl.select(plan.device, flat.dtype, total, provider or None)
    if name in TORCH_IMPL and plan.same and scale == 1.0 and not accumulate:
        views = plan.views
        if views is None or plan.flat_ref() is not flat:
            views = plan.views = _storage_views(flat, plan.layout)
            plan.flat_ref = weakref.ref(flat, lambda _, k=key: UNFLAT_PLANS.pop(k))
        if plan.grad:
            eager.run(unflatten_impl, name, flat, tensors, scale, accumulate, views)
        else:
            unflatten_impl(name, flat, tensors, scale, accumulate, views)
        return
    eager.run(unflatten_into, flat, list(tensors), scale, accumulate, name)
    eager.written(name, *tensors)
