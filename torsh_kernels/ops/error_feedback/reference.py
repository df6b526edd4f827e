"""Torch references of the error-feedback ops: the plain oracles the tests compare every provider with (any
device, plain PyTorch)."""

from __future__ import annotations

import torch

__all__ = ["error_update_ref", "residual_add_ref"]


def residual_add_ref(x: torch.Tensor, residual: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    acc = x.reshape(-1).float() + residual.reshape(-1).float()
    if out is None:
        return acc.view(x.shape)
    out.view(-1).copy_(acc)
    return out


def error_update_ref(acc, approx, residual, *, out=None) -> None:
    a = approx.reshape(-1).float()
    residual.view(-1).copy_(acc.reshape(-1).float() - a)
    if out is not None:
        out.view(-1).copy_(a)
