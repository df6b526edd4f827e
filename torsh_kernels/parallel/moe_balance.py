"""Auxiliary-loss-free load balancing (DeepSeek-V3; Wang et al. 2024, arXiv:2408.15664): :class:`BiasBalancer`.

A per-expert bias ``b`` is added to the router's scores for the *selection* of the K experts only (the
combine weights come from the unbiased scores: ``moe_route(score_bias=b)``). Between optimizer steps the
balancer sums the tokens each expert was assigned (``routing.tokens_per_expert``, the kept assignments), and
``step()`` moves the bias against the imbalance, outside the gradient:

    load = sum of the counts since the last step   (summed over the ranks of ``comm`` when given)
    b_e += rate * sign(mean(load) - load_e)

as Megatron-Core's ``get_updated_expert_bias`` (which all-reduces over the tensor-, context- and
data-parallel group). An overloaded expert's bias falls by ``rate``, an underloaded one's rises; an expert
exactly at the mean keeps its bias; after a step with no tokens nothing moves. The counts are then cleared.
With a communicator, every rank must call :meth:`BiasBalancer.step` the same number of times (it is an
all-reduce) and every rank ends with the same bias, given the same bias before.

The bias (fp32) and the pending counts (int64) are buffers: they move with ``.to()``, and are in the
``state_dict`` (of the layer that holds the balancer, under ``balancer.bias`` / ``balancer.load``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..collectives.agreement import agree_once, enabled, exchanging
from ..collectives.communicator import Communicator, as_communicator
from ..errors import ArgumentTypeError, DeviceMismatchError, DTypeError, InvalidArgumentError, ShapeError

__all__ = ["BiasBalancer", "check_rate"]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _negative(what: str, counts: torch.Tensor) -> None:
    raise InvalidArgumentError(f"{what}: token counts must be >= 0, got {counts.tolist()} (pass a routing's "
                               "tokens_per_expert)")  # fmt: skip


def check_rate(rate: object, what: str, name: str = "rate") -> float:
    """A number in [0, 1] (0: the bias never moves, as Megatron-Core's rate 0; the bias shifts scores in [0, 1], so
    a larger step only overshoots, and a huge one overflows the fp32 bias); a typed error otherwise."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise ArgumentTypeError(f"{what}: {name} must be a number, got {type(rate).__name__} {rate!r}")
    if not (0 <= rate <= 1):  # (NaN fails too)
        raise InvalidArgumentError(f"{what}: {name}={rate} must be a number in [0, 1] (DeepSeek-V3 uses 1e-3)")
    return float(rate)


class BiasBalancer(nn.Module):
    """DeepSeek-V3's aux-loss-free balancing of ``num_experts`` experts (see the module docstring).

    Args:
        num_experts: E.
        rate: the bias step ``u`` (1e-3, DeepSeek-V3's and Megatron-Core's default; 0 freezes the bias).
        comm: a :class:`~torsh_kernels.collectives.Communicator` (or ProcessGroup, DeviceMesh, ``(mesh, dim)``)
            over which the counts are summed at each step: the ranks whose tokens the router sees (data-,
            expert-parallel). None: this process's counts only.
        device: where the bias and the counts live (the router's device).

    ``observe(tokens_per_expert)`` adds one forward's counts; ``step()`` updates ``bias`` and clears them.
    A layer built with ``expert_bias=True`` holds one as ``layer.balancer`` and calls ``observe`` itself in
    training mode; call ``layer.update_expert_bias()`` once per optimizer step.
    """

    def __init__(
        self,
        num_experts: int,
        *,
        rate: float = 1e-3,
        comm: Communicator | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        what = "BiasBalancer"
        if isinstance(num_experts, bool) or not isinstance(num_experts, int):
            raise ArgumentTypeError(f"{what}: num_experts must be an int, got {type(num_experts).__name__}")
        if num_experts < 1:
            raise InvalidArgumentError(f"{what}: num_experts={num_experts} must be >= 1")
        self.num_experts = num_experts
        self.rate = check_rate(rate, what)
        self.comm = None if comm is None else as_communicator(comm, what, needs=("world_size", "all_reduce"))
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.int64, device=device))
        self.steps = 0
        """Updates made by :meth:`step` in this process (not saved)."""

    def extra_repr(self) -> str:
        comm = "" if self.comm is None else f", comm=<{type(self.comm).__name__} of {self.comm.world_size}>"
        return f"num_experts={self.num_experts}, rate={self.rate}{comm}"

    @torch.no_grad()
    def observe(self, tokens_per_expert: torch.Tensor) -> None:
        """Add one forward's assignments per expert (``routing.tokens_per_expert``, [E] integers) to the counts
        (on the device, no host sync)."""
        t = tokens_per_expert
        if t.__class__ is not torch.Tensor or t.dtype != torch.int64 or t.shape != self.load.shape:
            what = "BiasBalancer.observe"
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(f"{what}: tokens_per_expert must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 1 or t.shape[0] != self.num_experts:
                raise ShapeError(f"{what}: tokens_per_expert must be [E={self.num_experts}], got {tuple(t.shape)}")
            if t.dtype not in _INT_DTYPES:
                raise DTypeError(f"{what}: tokens_per_expert must hold integer counts, got {t.dtype}")
        if t.device != self.load.device:
            raise DeviceMismatchError(
                f"BiasBalancer.observe: the counts are on {t.device}, the balancer on {self.load.device}; move the "
                "layer (or the balancer) to the router's device"
            )
        if t.is_cpu and bool((t < 0).any()):  # (on a GPU step() checks them: no host sync per forward)
            _negative("BiasBalancer.observe", t)
        self.load += t

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """``bias += rate * sign(mean(load) - load)`` with ``load`` the counts since the last step, summed over
        ``comm``'s ranks; the counts are cleared. Returns that load ([E] int64). A collective when ``comm`` has
        other ranks: every rank calls it alike."""
        load = self.load.clone()
        if not load.is_cpu and bool((load < 0).any()):  # (observe checked the CPU counts as they came)
            _negative("BiasBalancer.step", load)
        if self.comm is not None and exchanging(self.comm):
            # different expert counts per rank would abort inside gloo (every Communicator has all_gather; a
            # stand-in with all_reduce alone is not checked)
            if enabled(None, "BiasBalancer.step") and hasattr(self.comm, "all_gather"):
                E, rate = self.num_experts, self.rate
                agree_once(self.comm, ("BiasBalancer", E, rate), "a BiasBalancer's step",
                           lambda: [("num_experts", E), ("rate", rate)], what="BiasBalancer.step",
                           fix="Build every rank's balancer with the same num_experts and rate.")  # fmt: skip
            self.comm.all_reduce(load)
        offset = load.sum().to(torch.float32) / self.num_experts - load.to(torch.float32)
        self.bias.add_(torch.sign(offset), alpha=self.rate)
        self.load.zero_()
        self.steps += 1
        return load

    def imbalance(self) -> float:
        """max / mean of the pending counts (1.0: balanced; NaN with no counts). Reads the device."""
        load = self.load.to(torch.float64)
        mean = load.mean().item()
        return load.max().item() / mean if mean > 0 else float("nan")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:  # fmt: skip
        """The entries present are checked (shape [E], the bias finite floats, the counts non-negative integers)
        before any is copied; a typed error names the first bad one."""
        what = "BiasBalancer.load_state_dict"
        for name in ("bias", "load"):
            t = state_dict.get(prefix + name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(f"{what}: {prefix}{name} must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != (self.num_experts,):
                raise ShapeError(f"{what}: {prefix}{name} has shape {tuple(t.shape)}; expected ({self.num_experts},)")
            if name == "bias":
                if not t.is_floating_point():
                    raise DTypeError(f"{what}: {prefix}bias must be floating point, got {t.dtype}")
                if not bool(torch.isfinite(t).all()):
                    raise InvalidArgumentError(f"{what}: {prefix}bias holds NaN or Inf")
            else:
                if t.dtype not in _INT_DTYPES:
                    raise DTypeError(f"{what}: {prefix}load must hold integer counts, got {t.dtype}")
                if t.numel() and int(t.min()) < 0:
                    raise InvalidArgumentError(f"{what}: {prefix}load holds a negative count")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)  # fmt: skip
