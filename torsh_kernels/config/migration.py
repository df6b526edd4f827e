"""What a configuration from elsewhere becomes in torsh: :class:`Migration`, the result of every ``from_*`` mapping
of :mod:`torsh_kernels.config`, and the builders that turn it into torsh objects.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collectives.communicator import as_communicator
from ..compression import Compressor
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..parallel import CompressionHookState, ExpertParallelMoE, MoELayer, OffloadedOptimizer, ParameterOffloader

__all__ = ["Migration"]


@dataclass(kw_only=True, slots=True)
class Migration:
    """What a configuration from elsewhere becomes in torsh (see :mod:`torsh_kernels.config`)."""

    source: str
    """Where the settings came from: "deepspeed", "megatron" or "torch_hook"."""
    compressor: Compressor | None = None
    """The gradient compressor for :func:`~torsh_kernels.parallel.compression_hook` (None: plain averaging)."""
    hook: dict[str, Any] = field(default_factory=dict)
    """Further :class:`~torsh_kernels.parallel.CompressionHookState` arguments (``start_iter``, ``min_numel``,
    ``policy``, ``process_group``)."""
    optimizer: type[torch.optim.Optimizer] | None = None
    """The torch optimizer class the source names (None: it names none)."""
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Its arguments (lr, betas, eps, weight_decay, ...), the source's defaults made explicit."""
    offload_optimizer: dict[str, Any] | None = None
    """:class:`~torsh_kernels.parallel.OffloadedOptimizer` arguments besides the optimizer (``state_format``),
    or None: the optimizer stays where the parameters are."""
    offload_params: dict[str, Any] | None = None
    """:class:`~torsh_kernels.parallel.ParameterOffloader` arguments (``fmt``), or None: no parameter offload."""
    quantized_comm: dict[str, Any] | None = None
    """:func:`~torsh_kernels.parallel.apply_quantized_comm` arguments for an FSDP2 model (``weights``, ``grads``,
    ``error_feedback``), or None."""
    moe: dict[str, Any] | None = None
    """:class:`~torsh_kernels.parallel.MoELayer` / :class:`~torsh_kernels.parallel.ExpertParallelMoE` arguments,
    or None: no MoE layer. ``hidden`` and ``ffn_hidden`` are absent when the source does not give them."""
    expert_parallel_size: int | None = None
    """Ranks the experts are spread over (Megatron's ``expert_model_parallel_size``), or None."""
    mapped: dict[str, str] = field(default_factory=dict)
    """Each mapped key of the input and the torsh argument it became."""
    ignored: dict[str, str] = field(default_factory=dict)
    """Keys outside torsh's scope, each with the reason and where that concern lives instead."""
    notes: dict[str, str] = field(default_factory=dict)
    """Mapped keys whose torsh meaning differs from the source's, or defaults the source implied: how."""

    def __post_init__(self) -> None:
        if self.source not in ("deepspeed", "megatron", "torch_hook"):
            raise InvalidArgumentError(
                f"Migration: source={self.source!r}; expected 'deepspeed', 'megatron' or 'torch_hook'"
            )
        if self.compressor is not None and not isinstance(self.compressor, Compressor):
            raise ArgumentTypeError(
                f"Migration: compressor must be a torsh Compressor or None, got {type(self.compressor).__name__}"
            )

    def summary(self) -> str:
        """What became of every key, one line each: mapped (and to what), ignored (and why), then the notes."""
        lines = [f"from {self.source}:"]
        lines += [f"  mapped   {k}: {v}" for k, v in self.mapped.items()]
        lines += [f"  ignored  {k}: {v}" for k, v in self.ignored.items()]
        lines += [f"  note     {k}: {v}" for k, v in self.notes.items()]
        return "\n".join(lines)

    # -- builders ---------------------------------------------------------------------------------------

    def hook_state(self, **overrides: Any) -> CompressionHookState:
        """The DDP hook's state: ``ddp.register_comm_hook(m.hook_state(), compression_hook)``. ``overrides``
        replace or add :class:`~torsh_kernels.parallel.CompressionHookState` arguments (``process_group``, ...)."""
        kwargs = {"compressor": self.compressor, **self.hook, **overrides}
        return CompressionHookState(**kwargs)

    def build_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The source's optimizer over ``params``: an :class:`~torsh_kernels.parallel.OffloadedOptimizer`
        wrapping it where the source offloads the optimizer, else the torch optimizer itself."""
        if self.optimizer is None:
            raise InvalidArgumentError(
                f"Migration.build_optimizer: the {self.source} settings name no optimizer; build your torch "
                "optimizer and pass it to offload(optimizer) if the settings offload it"
            )
        if self.offload_optimizer is not None:
            return OffloadedOptimizer(params, self.optimizer, **self.offload_optimizer, **self.optimizer_kwargs)
        return self.optimizer(params, **self.optimizer_kwargs)

    def offload(self, optimizer: torch.optim.Optimizer) -> OffloadedOptimizer:
        """An :class:`~torsh_kernels.parallel.OffloadedOptimizer` with the offload settings, wrapping an
        optimizer you built: its class, parameter groups and hyperparameters as they are (its state too,
        if it has stepped)."""
        what = "Migration.offload"
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ArgumentTypeError(
                f"{what}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, OffloadedOptimizer):
            raise ArgumentTypeError(f"{what}: this optimizer is offloaded already")
        if self.offload_optimizer is None:
            raise InvalidArgumentError(f"{what}: the {self.source} settings do not offload the optimizer")
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [dict(g) for g in optimizer.param_groups]
        off = OffloadedOptimizer(groups, cls, **self.offload_optimizer, **defaults)
        if optimizer.state:
            off.load_state_dict(optimizer.state_dict())
        return off

    def offload_parameters(self, module: torch.nn.Module, **overrides: Any) -> ParameterOffloader:
        """A :class:`~torsh_kernels.parallel.ParameterOffloader` over ``module`` with the offload settings."""
        if self.offload_params is None:
            raise InvalidArgumentError(
                f"Migration.offload_parameters: the {self.source} settings do not offload parameters"
            )
        return ParameterOffloader(module, **{**self.offload_params, **overrides})

    def apply_quantized_comm(self, module: torch.nn.Module, **overrides: Any) -> list:
        """:func:`~torsh_kernels.parallel.apply_quantized_comm` on an FSDP2 model (after ``fully_shard``)."""
        if self.quantized_comm is None:
            raise InvalidArgumentError(
                f"Migration.apply_quantized_comm: the {self.source} settings quantize no FSDP communication"
            )
        from ..parallel import apply_quantized_comm

        return apply_quantized_comm(module, **{**self.quantized_comm, **overrides})

    def moe_layer(self, **overrides: Any) -> MoELayer:
        """A :class:`~torsh_kernels.parallel.MoELayer` with the MoE settings; ``overrides`` give what the
        source did not (``hidden``, ``ffn_hidden``) or replace arguments (``device``, ``dtype``, ...)."""
        return MoELayer(**self._moe_kwargs("Migration.moe_layer", overrides))

    def expert_parallel_moe(self, comm: Any, **overrides: Any) -> ExpertParallelMoE:
        """An :class:`~torsh_kernels.parallel.ExpertParallelMoE` over ``comm`` (a Communicator, ProcessGroup or
        DeviceMesh) with the MoE settings; its world size must be the source's expert-parallel size."""
        what = "Migration.expert_parallel_moe"
        kwargs = self._moe_kwargs(what, overrides)
        comm = as_communicator(
            comm,
            what,
            dim=kwargs.pop("mesh_dim", None),
            needs=("rank", "world_size", "all_to_all", "broadcast", "all_reduce"),
        )
        if self.expert_parallel_size is not None and comm.world_size != self.expert_parallel_size:
            raise InvalidArgumentError(
                f"{what}: the communicator has {comm.world_size} rank{'s' if comm.world_size != 1 else ''}; the "
                f"{self.source} settings spread the experts over {self.expert_parallel_size} "
                "(expert_model_parallel_size)"
            )
        return ExpertParallelMoE(comm=comm, **kwargs)

    def _moe_kwargs(self, what: str, overrides: dict[str, Any]) -> dict[str, Any]:
        if self.moe is None:
            raise InvalidArgumentError(f"{what}: the {self.source} settings hold no MoE layer (no number of experts)")
        kwargs = {**self.moe, **overrides}
        missing = [k for k in ("hidden", "ffn_hidden") if k not in kwargs]
        if missing:
            raise InvalidArgumentError(
                f"{what}: the {self.source} settings give no {' and no '.join(missing)}; pass "
                + ", ".join(f"{k}=..." for k in missing)
            )
        return kwargs
