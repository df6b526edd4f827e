"""ZeRO-3-style parameter offload: a module's parameters live in host memory, packed, and each submodule's
parameters come to the device just before its forward and again before its backward
(:class:`ParameterOffloader`). The optimizer that updates them on the host is
:class:`~torsh_kernels.parallel.offload_optimizer.OffloadedOptimizer`."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from .. import recording
from ..collectives.communicator import is_dtensor
from ..env import fmt_bytes
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..ops import Packed, pack, packed_nbytes, unpack
from .offload_optimizer import STATE_FORMATS

__all__ = ["ParameterOffloader"]


class _Fetch(torch.autograd.Function):
    """The device copy of a host parameter; its gradient goes back to the host parameter."""

    @staticmethod
    def forward(ctx, param, box):
        ctx.host = (param.device, param.dtype)  # param carries the autograd edge; box holds the device copy
        return box[0]

    @staticmethod
    def backward(ctx, g):
        device, dtype = ctx.host
        return g.to(device=device, dtype=dtype), None


class _Entry:
    __slots__ = ("buffer", "packed", "param", "version")

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.param = param
        self.packed: Packed | None = None
        self.buffer: torch.Tensor | None = None
        self.version = -1


class ParameterOffloader:
    """Keep a module's parameters in host memory, packed, and bring each submodule's parameters to the
    device just before its forward, and again before its backward, releasing them after.

    The parameters themselves (``module.parameters()``) move to host memory (pinned where CUDA exists)
    and stay the trainable leaves: their gradients accumulate there, and an optimizer updates them there
    (e.g. a CPU optimizer, or :class:`OffloadedOptimizer`'s host update). Each submodule that owns
    parameters is a *unit*: its forward pre-hook unpacks its parameters to the device (``fmt``: "fp32",
    "bf16", "fp16" or "int8"; packed again automatically when a parameter changed, e.g. after
    ``optimizer.step()``) and the module computes with those copies; tensors the module saves for
    backward that live in those copies are not kept: a saved-tensor hook records where they were and
    unpacks them again when backward needs them. ``prefetch`` units ahead (in forward order, the order in
    which the units' forwards first ran, and in reverse order during backward) are unpacked ahead of use,
    on a side stream where CUDA exists.

    ``stats``: ``bytes_moved`` (packed bytes brought to the device), ``fetches``, ``prefetch_hits``,
    ``stall_s`` (time a unit waited for its parameters), ``peak_bytes`` (the most parameter bytes
    materialized at once; on CUDA also ``peak_device_bytes`` from ``torch.cuda.max_memory_allocated``).
    ``remove()`` detaches the hooks and puts the parameters back on the device.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        fmt: str = "bf16",
        prefetch: int = 1,
        *,
        device: torch.device | str | None = None,
        block: int = 256,
    ) -> None:
        what = "ParameterOffloader"
        if not isinstance(module, torch.nn.Module):
            raise ArgumentTypeError(f"{what}: module must be a torch.nn.Module, got {type(module).__name__}")
        if fmt not in STATE_FORMATS:
            raise InvalidArgumentError(f"{what}: fmt={fmt!r}; expected one of {STATE_FORMATS}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise InvalidArgumentError(f"{what}: prefetch={prefetch!r} must be an int >= 0")
        params = list(module.parameters())
        if any(is_dtensor(p) for p in params) or _is_fsdp(module):
            raise InvalidArgumentError(
                f"{what}: this module is sharded by FSDP2 (fully_shard: its parameters are DTensors), which already "
                "moves each shard where it is needed; to keep the shards in host memory use FSDP2's own offload, "
                "fully_shard(module, offload_policy=torch.distributed.fsdp.CPUOffloadPolicy()), and for packed "
                "optimizer state OffloadedOptimizer; ParameterOffloader is for modules that are not sharded"
            )
        if device is None:
            device = params[0].device if params else torch.device("cpu")
        self.device = torch.device(device)
        self.fmt, self.prefetch, self.block = fmt, prefetch, block
        self.module = module
        pin = self.device.type == "cuda"
        self.units: list[torch.nn.Module] = [
            m for m in module.modules() if any(True for _ in m.parameters(recurse=False))
        ]
        self._entries: list[dict[str, _Entry]] = []
        hosts = []  # every host copy first (pinning may fail): the module changes only once all exist
        for m in self.units:
            ents = {}
            for name, p in m._parameters.items():
                if p is None:
                    continue
                host = p.detach().to("cpu", copy=True)
                hosts.append((p, host.pin_memory() if pin else host))
                ents[name] = _Entry(p)
            self._entries.append(ents)
        for p, host in hosts:
            p.data = host
        self._index = {id(m): i for i, m in enumerate(self.units)}
        # units in the order their forwards first ran: read from the units' own hooks, so a container that is
        # never called itself (model.blocks, an nn.ModuleList) records it too
        self._order: list[int] = []
        self._ready: dict[int, tuple[dict[str, torch.Tensor], Any, list[int]]] = {}  # unit -> (copies, event, versions)
        self._live: dict[int, tuple[int, str]] = {}  # storage address of a materialized copy -> (unit, name)
        self._live_bytes = 0
        self._ctx_stack: list[Any] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.stats: dict[str, float] = {"bytes_moved": 0, "fetches": 0, "prefetch_hits": 0, "stall_s": 0.0,
                                        "peak_bytes": 0}  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._handles = []
        for m in self.units:
            self._handles.append(m.register_forward_pre_hook(self._pre_hook))
            self._handles.append(m.register_forward_hook(self._post_hook))

    # -------------------------------------------------------------------------------------- fetching

    def _packed(self, e: _Entry) -> Packed | torch.Tensor:
        """The host source of a parameter: packed bytes (re-packed if the parameter changed) or, for fp32,
        the parameter itself."""
        p = e.param
        if self.fmt == "fp32":
            return p.detach()
        if e.version != p._version or e.packed is None:
            n = packed_nbytes(p.numel(), self.fmt, self.block)
            if e.buffer is None:
                e.buffer = torch.empty(n, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            e.packed = pack(p.detach().float() if p.dtype != torch.float32 else p.detach(), self.fmt, out=e.buffer,
                            block=self.block)  # fmt: skip
            e.version = p._version
        return e.packed

    def _materialize(self, unit: int) -> dict[str, torch.Tensor]:
        """Device copies of a unit's parameters (on the current stream)."""
        with recording.span(
            "offload unit to device", "offload", {"unit": unit, "format": self.fmt}, device=self.device
        ):
            return self._materialize_now(unit)

    def _materialize_now(self, unit: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, e in self._entries[unit].items():
            src = self._packed(e)
            if isinstance(src, Packed):
                out[name] = unpack(src, device=self.device, dtype=e.param.dtype).view(e.param.shape)
                self.stats["bytes_moved"] += src.nbytes
            else:
                out[name] = src.to(self.device, copy=True, non_blocking=True)
                self.stats["bytes_moved"] += src.numel() * src.element_size()
        return out

    def _versions(self, unit: int) -> list[int]:
        return [e.param._version for e in self._entries[unit].values()]

    def _start_prefetch(self, unit: int) -> None:
        if unit in self._ready:
            return
        if self._stream is None:
            self._ready[unit] = (self._materialize(unit), None, self._versions(unit))
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                t = self._materialize(unit)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            self._ready[unit] = (t, ev, self._versions(unit))
        self._track(self._ready[unit][0], +1)

    def _take(self, unit: int) -> dict[str, torch.Tensor]:
        """A unit's device copies: the prefetched ones (waiting for them) or fetched now."""
        t0 = time.perf_counter()
        self.stats["fetches"] += 1
        got = self._ready.pop(unit, None)
        if got is not None:
            self._track(got[0], -1)
            if got[2] != self._versions(unit):  # a parameter changed since (an optimizer step): stale
                got = None
        if got is not None:
            self.stats["prefetch_hits"] += 1
            tensors, ev, _ = got
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
                for t in tensors.values():
                    t.record_stream(torch.cuda.current_stream(self.device))
                ev.synchronize()
        else:
            tensors = self._materialize(unit)
            if self._stream is not None:
                torch.cuda.current_stream(self.device).synchronize()
        self.stats["stall_s"] += time.perf_counter() - t0
        return tensors

    def _track(self, tensors: dict[str, torch.Tensor], sign: int) -> None:
        self._live_bytes += sign * sum(t.numel() * t.element_size() for t in tensors.values())
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self._live_bytes)

    def _next_units(self, unit: int, step: int) -> list[int]:
        if not self._order or unit not in self._order:
            return []
        i = self._order.index(unit)
        ahead = (i + step * d for d in range(1, self.prefetch + 1))
        return [self._order[j] for j in ahead if 0 <= j < len(self._order)]

    # ----------------------------------------------------------------------------------------- hooks

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        unit = self._index[id(module)]
        if unit not in self._order:
            self._order.append(unit)
        tensors = self._take(unit)
        self._track(tensors, +1)
        for name, t in tensors.items():
            e = self._entries[unit][name]
            self._live[t.untyped_storage().data_ptr()] = (unit, name)
            module._parameters[name] = _Fetch.apply(e.param, [t])
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack_hook)
        ctx.__enter__()
        self._ctx_stack.append((ctx, unit, tensors))
        for u in self._next_units(unit, +1):
            self._start_prefetch(u)

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        ctx, unit, tensors = self._ctx_stack.pop()
        ctx.__exit__(None, None, None)
        for name, t in tensors.items():
            self._live.pop(t.untyped_storage().data_ptr(), None)
            module._parameters[name] = self._entries[unit][name].param
        self._track(tensors, -1)

    def _pack_hook(self, t: torch.Tensor) -> Any:
        key = self._live.get(t.untyped_storage().data_ptr()) if t.device == self.device else None
        if key is None:
            return t
        return (key, tuple(t.shape), t.stride(), t.storage_offset())

    def _unpack_hook(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        (unit, name), shape, stride, offset = saved
        tensors = self._take(unit)  # prefetched by the unit after it in forward order, or fetched now
        for u in self._next_units(unit, -1):
            self._start_prefetch(u)
        return tensors[name].as_strided(shape, stride, offset)

    # ------------------------------------------------------------------------------------------ misc

    def reset_stats(self) -> None:
        self.stats.update(bytes_moved=0, fetches=0, prefetch_hits=0, stall_s=0.0, peak_bytes=self._live_bytes)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def __repr__(self) -> str:
        st = self.stats
        return (
            f"ParameterOffloader(units={len(self.units)}, fmt={self.fmt!r}, prefetch={self.prefetch}, "
            f"device={self.device}, fetches={st['fetches']}, prefetch_hits={st['prefetch_hits']}, "
            f"moved {fmt_bytes(st['bytes_moved'])}, stall {st['stall_s']:.3g} s, peak {fmt_bytes(st['peak_bytes'])})"
        )

    def get_stats(self) -> dict[str, float]:
        s = dict(self.stats)
        if self.device.type == "cuda":
            s["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return s

    def remove(self) -> None:
        """Remove the hooks and move the parameters back to the device (all or nothing: the device copies are
        made first, so a failure, such as the device running out of memory, leaves the offloader in place)."""
        back = [(e.param, e.param.data.to(self.device)) for ents in self._entries for e in ents.values()]
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._ready.clear()
        for p, d in back:
            p.data = d


def _is_fsdp(module: torch.nn.Module) -> bool:
    """Whether ``module`` or one of its submodules is an FSDP2 ``FSDPModule`` (without importing FSDP2: none
    exists before)."""
    mod = sys.modules.get("torch.distributed.fsdp")
    return mod is not None and any(isinstance(m, mod.FSDPModule) for m in module.modules())
