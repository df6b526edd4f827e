"""The host side of :class:`~torsh_kernels.parallel.offload_optimizer.OffloadedOptimizer`: its parameters cut
into chunks (:func:`chunk_parameters`), each chunk's fp32 masters and gradients as flat host buffers
(:class:`Chunk`), and the conversions between a parameter (a DTensor's local shard under FSDP2) and its
host state (:func:`local`, :func:`host_state`, :func:`like`)."""

from __future__ import annotations

from typing import Any

import torch

from ..collectives.communicator import is_dtensor
from ..errors import InvalidArgumentError, LayoutMismatchError
from ..ops import BucketLayout

__all__ = ["Chunk", "chunk_parameters", "cuda_device", "host_state", "like", "local"]


def cuda_device(params: list[torch.Tensor]) -> torch.device | None:
    """The CUDA device all ``params`` are on, None when they are on another device; a typed error when they
    are on several."""
    devs = {p.device for p in params}
    if len(devs) > 1:
        raise InvalidArgumentError(f"OffloadedOptimizer: parameters on several devices {sorted(map(str, devs))}")
    dev = next(iter(devs))
    return dev if dev.type == "cuda" else None


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and gradients: the memory this rank holds and updates),
    detached; any other tensor as it is."""
    return t.to_local().detach() if is_dtensor(t) else t


def host_state(v: Any) -> Any:
    """A host copy of one state entry: tensors of a parameter's shape in fp32, scalars as they are."""
    if not isinstance(v, torch.Tensor):
        return v
    v = local(v)
    dtype = torch.float32 if v.is_floating_point() and v.dim() else v.dtype
    return v.detach().to("cpu", dtype, copy=True)


def like(p: torch.Tensor, v: Any) -> Any:
    """A state tensor of the shard's shape as a DTensor placed like parameter ``p``; anything else as it is."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return v
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class Chunk:
    """Parameters of one group updated together: their fp32 masters and gradients as flat host buffers."""

    __slots__ = ("grad_flat", "grad_views", "group", "h2d_done", "host_has", "inner", "layout", "master_flat",
                 "masters", "param_meta", "params", "spare")  # fmt: skip

    def __init__(self, group: int, params: list[torch.nn.Parameter], pin: bool) -> None:
        self.group = group
        self.params = params
        shards = [local(p) for p in params]  # a DTensor parameter (FSDP2): its shard, which this rank updates
        n = sum(t.numel() for t in shards)
        self.master_flat = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.grad_flat = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.layout = BucketLayout.for_tensors(shards, torch.float32)
        self.masters = self.layout.views(self.master_flat)
        self.grad_views = self.layout.views(self.grad_flat)
        self.host_has = [False] * len(params)  # offload_gradients="backward": this step's gradient is on the host
        with torch.no_grad():
            for m, t in zip(self.masters, shards):
                m.copy_(t.detach())
        self.inner: torch.optim.Optimizer | None = None
        self.h2d_done: torch.cuda.Event | None = None
        self.spare: torch.Tensor | None = None  # offload_gradients="backward": the masters' undo copy in a step
        self.param_meta = [(tuple(t.shape), t.device) for t in shards]  # what the parameters must still be

    def check_params(self, group_index: int) -> None:
        """The parameters still have the shapes and device the masters were made for (else the step would
        write some parameters and fail at another): a typed error before anything is touched."""
        for p, (shape, dev) in zip(self.params, self.param_meta):
            t = local(p)
            if tuple(t.shape) != shape or t.device != dev or not t.is_floating_point():
                raise LayoutMismatchError(
                    f"OffloadedOptimizer.step: a parameter of param group {group_index} is now {tuple(t.shape)} "
                    f"{t.dtype} on {t.device}; its fp32 master was made for {shape} on {dev} when the optimizer was "
                    "built. "
                    "Build a new optimizer after changing parameters (shape, device), and load its state dict"
                )


def chunk_parameters(param_groups: list[dict[str, Any]], chunk_mb: float, pin: bool) -> list[Chunk]:
    """The parameters of each group, in order, cut into chunks of at most ``chunk_mb`` megabytes of fp32
    (a chunk holds at least one parameter, so one larger than that is a chunk of its own)."""
    chunks: list[Chunk] = []
    limit = int(chunk_mb * (1 << 20)) // 4
    for gi, g in enumerate(param_groups):
        cur: list[torch.nn.Parameter] = []
        size = 0
        for p in g["params"]:
            n = local(p).numel()
            if cur and size + n > limit:
                chunks.append(Chunk(gi, cur, pin))
                cur, size = [], 0
            cur.append(p)
            size += n
        if cur:
            chunks.append(Chunk(gi, cur, pin))
    return chunks
