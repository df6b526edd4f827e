"""ZeRO-Offload-style optimizer: fp32 master weights and packed optimizer state in host memory.

``OffloadedOptimizer(params, optimizer=torch.optim.AdamW, state_format="bf16", **optimizer_kwargs)``
wraps any ``torch.optim`` optimizer (the remaining keyword arguments go to it). The parameters stay on
their device; host memory (pinned where CUDA exists) holds an fp32 master copy of each parameter, its
gradient, and the optimizer's state packed with :func:`torsh_kernels.ops.pack` in ``state_format``.
Each ``step()`` works through the parameters in chunks of about ``chunk_mb`` megabytes:

1. the chunk's gradients are flattened (cast to fp32) on the device and copied to the host
   asynchronously on a side stream; the copy of chunk i+1 is issued before chunk i is updated;
2. on the host, the chunk's state is unpacked to fp32, the wrapped optimizer updates the masters, and
   the state is packed again (only one chunk's state exists in fp32 at a time);
3. the updated masters go back on a second side stream and are written into the parameters, cast to
   their dtype, while the host updates the next chunk.

The device stream waits for the last copy before ``step`` returns, so the next forward sees the new
parameters. With ``offload_gradients="backward"`` each gradient instead goes to the host as soon as
backward has produced it (a post-accumulate-grad hook; further micro-batches add to it there) and is
freed on the device, so the device never holds all gradients at once: parameters and activations are
then all that training keeps there (``param.grad`` stays None; ``step`` reads the host copies).
On machines without CUDA, the same steps run on host tensors (no pinning, no streams).

``state_format``: "fp32" keeps the state unpacked (the result equals the wrapped optimizer's bit for
bit); "bf16"/"fp16" round each state tensor to that format after every step (relative error 2^-9 /
2^-11 per step, round to nearest even; fp16 refuses magnitudes past 65504); "int8" quantizes blockwise
(absmax per 256 elements). Second-moment states (``exp_avg_sq``, ``max_exp_avg_sq``, ``square_avg``,
``sum``) are stored as their square root under fp16 and int8: squared gradients of 1e-8 underflow
fp16 (Adam would then divide by ``eps`` alone), and under int8 the root halves the dynamic range a block
must span, so its small entries are not all rounded to zero. Scalar state (``step``) is kept as is.

``state_dict()`` returns the wrapped optimizer's format (state per parameter index, fp32 tensors
unpacked from the stored format, plus each parameter's fp32 ``master`` copy, and the param groups);
``load_state_dict()`` takes it back (a plain optimizer's state dict too: masters are then taken from the
parameters). Nothing is lost beyond the chosen format's precision.

Hyperparameters live in ``param_groups`` as in any optimizer (learning-rate schedulers work); they are
passed to the wrapped optimizer at every step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _trace
from ..collectives.communicator import is_dtensor
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..ops import BucketLayout, Packed, flatten, pack, unflatten, unpack

__all__ = ["STATE_FORMATS", "OffloadedOptimizer"]

STATE_FORMATS = ("fp32", "bf16", "fp16", "int8")
SQRT_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"})


def _cuda_device(params: list[torch.Tensor]) -> torch.device | None:
    devs = {p.device for p in params}
    if len(devs) > 1:
        raise InvalidArgumentError(f"OffloadedOptimizer: parameters on several devices {sorted(map(str, devs))}")
    dev = next(iter(devs))
    return dev if dev.type == "cuda" else None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and gradients: the memory this rank holds and updates),
    detached; any other tensor as it is."""
    return t.to_local().detach() if is_dtensor(t) else t


def _host_state(v: Any) -> Any:
    """A host copy of one state entry: tensors of a parameter's shape in fp32, scalars as they are."""
    if not isinstance(v, torch.Tensor):
        return v
    v = _local(v)
    dtype = torch.float32 if v.is_floating_point() and v.dim() else v.dtype
    return v.detach().to("cpu", dtype, copy=True)


class _Chunk:
    """Parameters of one group updated together: their fp32 masters and gradients as flat host buffers."""

    __slots__ = ("grad_flat", "grad_views", "group", "h2d_done", "host_has", "inner", "layout", "master_flat",
                 "masters", "params")  # fmt: skip

    def __init__(self, group: int, params: list[torch.nn.Parameter], pin: bool) -> None:
        self.group = group
        self.params = params
        local = [_local(p) for p in params]  # a DTensor parameter (FSDP2): its shard, which this rank updates
        n = sum(t.numel() for t in local)
        self.master_flat = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.grad_flat = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.layout = BucketLayout.for_tensors(local, torch.float32)
        self.masters = self.layout.views(self.master_flat)
        self.grad_views = self.layout.views(self.grad_flat)
        self.host_has = [False] * len(params)  # offload_gradients="backward": this step's gradient is on the host
        with torch.no_grad():
            for m, t in zip(self.masters, local):
                m.copy_(t.detach())
        self.inner: torch.optim.Optimizer | None = None
        self.h2d_done: torch.cuda.Event | None = None


class OffloadedOptimizer(torch.optim.Optimizer):
    """See the module docstring.

    Args:
        params: parameters or parameter groups, as for any optimizer; all on one device.
        optimizer: the wrapped optimizer class (default ``torch.optim.AdamW``); it runs on the host.
        state_format: "fp32", "bf16" (default), "fp16" or "int8".
        chunk_mb: megabytes of fp32 parameters per pipeline chunk.
        offload_gradients: "step" (gradients move at ``step()``) or "backward" (as backward produces them).
        **optimizer_kwargs: the wrapped optimizer's arguments (lr, betas, weight_decay, ...).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
        state_format: str = "bf16",
        *,
        chunk_mb: float = 32.0,
        offload_gradients: str = "step",
        **optimizer_kwargs: Any,
    ) -> None:
        what = "OffloadedOptimizer"
        if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
            got = f"an instance of {type(optimizer).__name__}" if isinstance(optimizer, torch.optim.Optimizer) else (
                repr(optimizer))  # fmt: skip
            raise ArgumentTypeError(
                f"{what}: optimizer must be a torch.optim.Optimizer class, got {got}; pass the class "
                "(optimizer=torch.optim.AdamW) and its arguments as keywords (lr=..., betas=...)"
            )
        if state_format not in STATE_FORMATS:
            raise InvalidArgumentError(f"{what}: state_format={state_format!r}; expected one of {STATE_FORMATS}")
        if not isinstance(chunk_mb, (int, float)) or not math.isfinite(chunk_mb) or chunk_mb <= 0:
            raise InvalidArgumentError(f"{what}: chunk_mb={chunk_mb!r} must be a positive number")
        self.optimizer_class = optimizer
        self.state_format = state_format
        self.chunk_mb = float(chunk_mb)
        self.optimizer_kwargs = dict(optimizer_kwargs)
        # the wrapped optimizer's defaults, from a throwaway instance (this also validates the kwargs)
        defaults = dict(optimizer([torch.zeros(1, requires_grad=True)], **optimizer_kwargs).defaults)
        super().__init__(params, defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        for p in all_params:
            if not p.is_floating_point():
                raise ArgumentTypeError(f"{what}: parameters must be floating point, got {p.dtype}")
        self._cuda = _cuda_device(all_params) if all_params else None
        pin = self._cuda is not None
        self._chunks: list[_Chunk] = []
        limit = int(self.chunk_mb * (1 << 20)) // 4
        for gi, g in enumerate(self.param_groups):
            cur: list[torch.nn.Parameter] = []
            size = 0
            for p in g["params"]:
                n = _local(p).numel()
                if cur and size + n > limit:
                    self._chunks.append(_Chunk(gi, cur, pin))
                    cur, size = [], 0
                cur.append(p)
                size += n
            if cur:
                self._chunks.append(_Chunk(gi, cur, pin))
        for c in self._chunks:
            hyper = {k: v for k, v in self.param_groups[c.group].items() if k != "params"}
            c.inner = optimizer([{"params": c.masters, **hyper}])
        self._packed: dict[int, dict[str, Packed]] = {}  # id(master) -> state name -> packed bytes
        if offload_gradients not in ("step", "backward"):
            raise InvalidArgumentError(
                f"{what}: offload_gradients={offload_gradients!r}; expected 'step' or 'backward'"
            )
        self.offload_gradients = offload_gradients
        self._grad_hooks = []
        if offload_gradients == "backward":
            for c in self._chunks:
                for i, p in enumerate(c.params):
                    self._grad_hooks.append(
                        p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, c, i))
                    )
        if self._cuda is not None:
            self._d2h = torch.cuda.Stream(self._cuda)
            self._h2d = torch.cuda.Stream(self._cuda)
        self.stats: dict[str, float] = {"steps": 0, "bytes_to_host": 0, "bytes_to_device": 0, "state_bytes": 0}

    # --------------------------------------------------------------------------------------- state

    def _sqrt(self, name: str) -> bool:
        """Second-moment states are stored as their square root in fp16 (range) and int8 (resolution)."""
        return self.state_format in ("fp16", "int8") and name in SQRT_STATES

    def _unpacked(self, master: torch.Tensor, *, keep: bool) -> dict[str, torch.Tensor]:
        """The packed state of one parameter as fp32 tensors (the stored bytes dropped unless ``keep``)."""
        stored = self._packed.get(id(master), {}) if keep else self._packed.pop(id(master), {})
        out = {}
        for name, pk in stored.items():
            v = unpack(pk, dtype=torch.float32)
            out[name] = v.square_() if self._sqrt(name) else v
        return out

    def _unpack_state(self, master: torch.Tensor, state: dict[str, Any]) -> None:
        state.update(self._unpacked(master, keep=False))

    def _pack_state(self, master: torch.Tensor, state: dict[str, Any]) -> None:
        if self.state_format == "fp32":
            return
        stored = {}
        for name, v in list(state.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == master.shape and v.numel() > 1:
                src = v.sqrt() if (self._sqrt(name)) else v
                stored[name] = pack(src, self.state_format)
                del state[name]  # the fp32 tensor is freed; only the packed bytes remain
        if stored:
            self._packed[id(master)] = stored

    def _state_bytes(self) -> int:
        total = 0
        for c in self._chunks:
            for m in c.masters:
                for v in c.inner.state.get(m, {}).values():
                    if isinstance(v, torch.Tensor):
                        total += v.numel() * v.element_size()
                total += sum(pk.nbytes for pk in self._packed.get(id(m), {}).values())
        return total

    # ---------------------------------------------------------------------------------------- step

    def _gather_grads(self, c: _Chunk) -> tuple[list[bool], torch.cuda.Event | None]:
        """Copy the chunk's gradients into its host grad buffer (async on CUDA); which params had one."""
        with _trace.span("offload grads to host", "offload", {"bytes": c.grad_flat.numel() * 4}, device=self._cuda):
            return self._gather_grads_now(c)

    def _gather_grads_now(self, c: _Chunk) -> tuple[list[bool], torch.cuda.Event | None]:
        has = [p.grad is not None for p in c.params]
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in c.params]
        self.stats["bytes_to_host"] += c.grad_flat.numel() * 4
        if self._cuda is None:
            flatten(grads, out=c.grad_flat)
            return has, None
        self._d2h.wait_stream(torch.cuda.current_stream(self._cuda))  # the gradients are ready
        with torch.cuda.stream(self._d2h):
            dev, _ = flatten(grads, dtype=torch.float32)  # one fused cast + copy on the device
            c.grad_flat.copy_(dev, non_blocking=True)  # one transfer per chunk
            dev.record_stream(self._d2h)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        return has, ev

    def _scatter_params(self, c: _Chunk) -> None:
        """Write the chunk's updated masters into the parameters (async on CUDA)."""
        with _trace.span("offload params to device", "offload", {"bytes": c.master_flat.numel() * 4},
                         device=self._cuda):  # fmt: skip
            self._scatter_params_now(c)

    def _scatter_params_now(self, c: _Chunk) -> None:
        params = [_local(p).detach() for p in c.params]  # (FSDP2: the shard, in FSDP2's own storage)
        self.stats["bytes_to_device"] += c.master_flat.numel() * 4
        if self._cuda is None:
            unflatten(c.master_flat, c.layout, params)
            return
        self._h2d.wait_stream(torch.cuda.current_stream(self._cuda))
        with torch.cuda.stream(self._h2d):
            dev = torch.empty(c.master_flat.numel(), dtype=torch.float32, device=self._cuda)
            dev.copy_(c.master_flat, non_blocking=True)
            unflatten(dev, c.layout, params)  # cast to each parameter's dtype
            dev.record_stream(self._h2d)
            c.h2d_done = torch.cuda.Event()
            c.h2d_done.record(self._h2d)

    def _update(self, c: _Chunk, has: list[bool]) -> None:
        hyper = {k: v for k, v in self.param_groups[c.group].items() if k != "params"}
        c.inner.param_groups[0].update(hyper)
        views = c.layout.views(c.grad_flat)
        if c.h2d_done is not None:  # the previous step's upload still reads these masters
            c.h2d_done.synchronize()
        for m, g, h in zip(c.masters, views, has):
            m.grad = g if h else None
            if h:
                self._unpack_state(m, c.inner.state[m])
        c.inner.step()
        for p, m, h in zip(c.params, c.masters, has):
            m.grad = None
            if h:
                self._pack_state(m, c.inner.state[m])
                # the state lives in the host optimizers; this entry only says it exists (what
                # torch.distributed.checkpoint's get_state_dict looks at before it would run a step of its own)
                self.state[p] = {"offloaded": self.state_format}

    @torch.no_grad()
    def _grad_ready(self, c: _Chunk, i: int, p: torch.Tensor) -> None:
        """offload_gradients="backward": move a gradient to the host as soon as backward produced it (adding
        to the one already there within this step) and free it on the device."""
        view, g = c.grad_views[i], _local(p.grad)
        self.stats["bytes_to_host"] += g.numel() * 4
        if self._cuda is None:
            if c.host_has[i]:
                view.add_(g)
            else:
                view.copy_(g)
        elif not c.host_has[i]:
            self._d2h.wait_stream(torch.cuda.current_stream(self._cuda))
            with torch.cuda.stream(self._d2h):
                view.copy_(g, non_blocking=True)
                g.record_stream(self._d2h)  # the allocator must not reuse it before the copy ran
        else:  # a second micro-batch: add on the host (synchronous)
            self._d2h.synchronize()
            view.add_(g.to("cpu", torch.float32))
        c.host_has[i] = True
        p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for c in self._chunks:
            c.host_has = [False] * len(c.params)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter that has a gradient (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.offload_gradients == "backward":  # the gradients are on the host already
            if self._cuda is not None:
                self._d2h.synchronize()
            for c in self._chunks:
                if any(c.host_has):
                    self._update(c, c.host_has)
                    self._scatter_params(c)
                    c.host_has = [False] * len(c.params)
            return self._finish(loss)
        chunks = [c for c in self._chunks if any(p.grad is not None for p in c.params)]
        if not chunks:
            return loss
        pending = self._gather_grads(chunks[0])
        for i, c in enumerate(chunks):
            has, ev = pending
            if i + 1 < len(chunks):  # double buffering: the next chunk's gradients travel during this update
                pending = self._gather_grads(chunks[i + 1])
            if ev is not None:
                ev.synchronize()
            self._update(c, has)
            self._scatter_params(c)
        return self._finish(loss)

    def _finish(self, loss: Any) -> Any:
        if self._cuda is not None:
            torch.cuda.current_stream(self._cuda).wait_stream(self._h2d)
        self.stats["steps"] += 1
        self.stats["state_bytes"] = self._state_bytes()
        return loss

    # ---------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's format: fp32 state per parameter index (unpacked), plus ``master``."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict[int, dict[str, Any]] = {}
        for c in self._chunks:
            for p, m in zip(c.params, c.masters):
                s = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.inner.state.get(m, {}).items()}
                s.update(self._unpacked(m, keep=True))
                s["master"] = m.detach().clone()
                if is_dtensor(p):  # sharded like the parameter, so distributed checkpoints save every shard
                    s = {k: _like(p, v) for k, v in s.items()}
                state[index[id(p)]] = s
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]  # fmt: skip
        return {"state": state, "param_groups": groups, "offload": {"state_format": self.state_format}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (or from a plain optimizer's state dict)."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise InvalidArgumentError(
                f"OffloadedOptimizer.load_state_dict: {len(groups) if isinstance(groups, list) else groups!r} "
                f"param groups given, this optimizer has {len(self.param_groups)}"
            )
        for g, saved in zip(self.param_groups, groups):
            if len(saved["params"]) != len(g["params"]):
                raise InvalidArgumentError(
                    f"OffloadedOptimizer.load_state_dict: a group has {len(saved['params'])} parameters in the "
                    f"state dict and {len(g['params'])} here"
                )
            g.update({k: v for k, v in saved.items() if k != "params"})
        ids = [i for saved in groups for i in saved["params"]]
        saved_state = state_dict.get("state", {})
        position = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self._packed.clear()
        self.state.clear()
        for c in self._chunks:
            c.inner.state.clear()
            for p, m in zip(c.params, c.masters):
                s = dict(saved_state.get(ids[position[id(p)]], {}))
                with torch.no_grad():
                    master = s.pop("master", None)
                    m.copy_(_local(master) if master is not None else _local(p).detach())
                if s:  # host copies; tensor state in fp32 (a plain optimizer's may be on the device, in bf16)
                    st = {k: _host_state(v) for k, v in s.items()}
                    c.inner.state[m] = st
                    self._pack_state(m, st)
                    self.state[p] = {"offloaded": self.state_format}
        self.stats["state_bytes"] = self._state_bytes()


def _like(p: torch.Tensor, v: Any) -> Any:
    """A state tensor of the shard's shape as a DTensor placed like parameter ``p``; anything else as it is."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return v
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
