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

**All or nothing.** ``step()`` and ``load_state_dict()`` either complete or, on any exception (the
wrapped optimizer raising in some chunk, a gradient that cannot be gathered, a state value fp16 cannot
hold, a parameter whose shape or device changed, an interrupt), leave the parameters, the gradients and
the whole optimizer state (fp32 masters, packed states, step counts, hyperparameters, statistics)
exactly as they were, and re-raise. ``step()`` does this with an undo log: before a chunk's masters are
updated they are copied into a buffer that already exists and is free at that point (with
``offload_gradients="step"``, the chunk's host gradient buffer: gradients are gathered into two
chunk-sized buffers instead, which also double-buffer the transfers; with ``"backward"``, where the host
gradients must survive a failed step, a spare host buffer of the masters' size, made on the first step);
the packed state a chunk had is kept by reference until the step ends (its new state is packed into new
buffers); small tensors (step counts) are cloned. The parameters on the device are written only once
every chunk's update succeeded, from one device staging buffer allocated before the first chunk is
touched (a failure while they are written, which the checks before make a device error, rolls the state
back and writes the parameters already written again from the restored masters: exact, since the
optimizer keeps each parameter equal to its master cast to the parameter's dtype, unless the parameter
was changed outside the optimizer). Costs: host memory, two chunk-sized fp32 buffers (``"step"``; 2 x
the largest chunk: ``chunk_mb`` unless one parameter is larger) or one fp32 copy of the masters
(``"backward"``), plus, while a step runs, the old packed state (as much again as the stored state;
``state_format="fp32"`` instead clones its fp32 state, the state's size); time, one copy of the fp32
masters per step (and of the state under "fp32"); on CUDA the uploads of the new parameters no longer
overlap the host update of the next chunk (they run after the last chunk, on the side stream; the next
forward waits for them on the device, not the host). ``load_state_dict()`` validates the whole state
dict first (types, shapes, dtypes, param groups, each state's keys against what the wrapped optimizer
keeps) and raises a typed error before anything changes, then builds the new state beside the old and
swaps it in.

**All or nothing across ranks.** Where several ranks step together, a step that fails on one rank is rolled
back on every rank: after its local update, before anything is committed, each rank tells the others whether
it succeeded (one all-reduce of one byte per rank; a second, of each failed rank's error line, only where
one failed). Every rank then commits, or every rank rolls back and raises: the rank that failed its own
error (with a note saying the others rolled back), the others ``RankFailedError`` naming each failed rank
and its error (``failures``: global rank -> error line). Without this, FSDP2's ranks, each owning a shard,
would leave a checkpoint mixing two steps. ``group`` says who agrees: "auto" (default) agrees over the
DeviceMesh of DTensor parameters (FSDP2's; one mesh, else pass ``group``) and not at all for plain tensors,
so a single process (or replicated parameters nobody named a group for) issues no collective; DDP's
replicas need ``group=`` (DDP's process group, or ``dist.group.WORLD``); ``group=False`` turns it off (each
rank atomic on its own). A rank that dies ends the exchange at once with ``CollectiveError`` on the others;
one that stalls, after ``timeout`` seconds with ``CollectiveTimeoutError`` (gloo; None: the process
group's timeout, the only one NCCL has); either way they roll back. A rank whose exchange did not complete
cannot know whether a peer completed it and committed (a stalled peer that joins later finds this rank's
contribution and commits), so it then refuses ``step()`` and ``state_dict()`` (``CollectiveError``) until
``load_state_dict()`` restores it: restore every rank from the last checkpoint. Every rank must call
``step()`` at the same point (DCP's ``get_state_dict`` does, on every rank, when it steps an uninitialized
optimizer); a closure runs before the exchange and its errors are not exchanged. A failure after the
exchange, while parameters are written (a device error), rolls back that rank only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import recording
from ..collectives.communicator import is_dtensor
from ..errors import ArgumentTypeError, CollectiveError, InvalidArgumentError
from ..ops import Packed, flatten, pack, unflatten, unpack
from .offload_checks import check_state_dict, step_agreement
from .offload_chunks import Chunk, chunk_parameters, cuda_device, host_state, like, local

__all__ = ["STATE_FORMATS", "OffloadedOptimizer"]

STATE_FORMATS = ("fp32", "bf16", "fp16", "int8")
SQRT_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"})


class OffloadedOptimizer(torch.optim.Optimizer):
    """See the module docstring.

    Args:
        params: parameters or parameter groups, as for any optimizer; all on one device.
        optimizer: the wrapped optimizer class (default ``torch.optim.AdamW``); it runs on the host.
        state_format: "fp32", "bf16" (default), "fp16" or "int8".
        chunk_mb: megabytes of fp32 parameters per pipeline chunk.
        offload_gradients: "step" (gradients move at ``step()``) or "backward" (as backward produces them).
        group: the ranks whose steps are all or nothing together (see the module docstring): "auto" (default:
            DTensor parameters, FSDP2's, agree over their DeviceMesh; plain tensors do not agree), a
            ProcessGroup (``dist.group.WORLD``: the default group; DDP's group for replicated parameters), a
            DeviceMesh, a Communicator, or False (each rank on its own, no collective).
        timeout: seconds this rank waits for the others' outcome of a step before it rolls back and raises
            ``CollectiveTimeoutError`` (gloo; None: the process group's timeout, the only one on NCCL).
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
        group: Any = "auto",
        timeout: float | None = None,
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
        self._agreement = step_agreement(group, all_params, timeout, what)  # None: no other rank to agree with
        self._cuda = cuda_device(all_params) if all_params else None
        pin = self._cuda is not None
        self._chunks = chunk_parameters(self.param_groups, self.chunk_mb, pin)
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
        self._grad_bufs: list[torch.Tensor] = []  # offload_gradients="step": two chunk-sized gradient buffers
        self._state_keys: dict[str, dict[str, bool] | None] = {}  # load_state_dict: the keys the optimizer keeps

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
        else:
            self._packed.pop(id(master), None)

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

    def _gather_grads(self, c: Chunk, buf: torch.Tensor) -> tuple[list[bool], torch.cuda.Event | None]:
        """Copy the chunk's gradients into ``buf`` (async on CUDA); which params had one."""
        with recording.span("offload grads to host", "offload", {"bytes": c.grad_flat.numel() * 4}, device=self._cuda):
            return self._gather_grads_now(c, buf[: c.grad_flat.numel()])

    def _gather_grads_now(self, c: Chunk, buf: torch.Tensor) -> tuple[list[bool], torch.cuda.Event | None]:
        has = [p.grad is not None for p in c.params]
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in c.params]
        self.stats["bytes_to_host"] += buf.numel() * 4
        if self._cuda is None:
            flatten(grads, out=buf)
            return has, None
        self._d2h.wait_stream(torch.cuda.current_stream(self._cuda))  # the gradients are ready
        with torch.cuda.stream(self._d2h):
            dev, _ = flatten(grads, dtype=torch.float32)  # one fused cast + copy on the device
            buf.copy_(dev, non_blocking=True)  # one transfer per chunk
            dev.record_stream(self._d2h)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        return has, ev

    def _scatter_params(self, c: Chunk, stage: torch.Tensor | None) -> None:
        """Write the chunk's updated masters into the parameters (async on CUDA, through ``stage``)."""
        with recording.span("offload params to device", "offload", {"bytes": c.master_flat.numel() * 4},
                         device=self._cuda):  # fmt: skip
            self._scatter_params_now(c, stage)

    def _scatter_params_now(self, c: Chunk, stage: torch.Tensor | None) -> None:
        params = [local(p).detach() for p in c.params]  # (FSDP2: the shard, in FSDP2's own storage)
        self.stats["bytes_to_device"] += c.master_flat.numel() * 4
        if stage is None:
            unflatten(c.master_flat, c.layout, params)
            return
        with torch.cuda.stream(self._h2d):  # one staging buffer, reused in stream order
            dev = stage[: c.master_flat.numel()]
            dev.copy_(c.master_flat, non_blocking=True)
            unflatten(dev, c.layout, params)  # cast to each parameter's dtype
            c.h2d_done = torch.cuda.Event()
            c.h2d_done.record(self._h2d)

    def _update(self, c: Chunk, has: list[bool], grads: torch.Tensor, backup: torch.Tensor, undo: _Undo) -> None:
        """Update one chunk's masters and state on the host, logging in ``undo`` what it replaces."""
        n = c.master_flat.numel()
        inner_group = c.inner.param_groups[0]
        undo.groups.append((inner_group, {k: v for k, v in inner_group.items() if k != "params"}))
        inner_group.update({k: v for k, v in self.param_groups[c.group].items() if k != "params"})
        if c.h2d_done is not None:  # the previous step's upload still reads these masters
            c.h2d_done.synchronize()
        backup[:n].copy_(c.master_flat)  # the masters as they were: what a failure restores
        undo.masters.append((c, backup))
        for m, g, h in zip(c.masters, c.layout.views(grads[:n]), has):
            m.grad = g if h else None
            if h:
                had = m in c.inner.state
                old = c.inner.state[m] if had else None
                undo.states.append((c.inner.state, m, had, old, self._packed.get(id(m))))
                # the working state: small tensors (step counts) cloned, the big ones fresh from the packed bytes
                # (which stay referenced by the undo log); under "fp32" the whole state is cloned
                work = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in (old or {}).items()}
                work.update(self._unpacked(m, keep=True))
                c.inner.state[m] = work
        c.inner.step()
        for p, m, h in zip(c.params, c.masters, has):
            m.grad = None
            if h:
                self._pack_state(m, c.inner.state[m])  # into new buffers
                undo.outer.append((p, p in self.state, self.state.get(p)))
                # the state lives in the host optimizers; this entry only says it exists (what
                # torch.distributed.checkpoint's get_state_dict looks at before it would run a step of its own)
                self.state[p] = {"offloaded": self.state_format}

    @torch.no_grad()
    def _grad_ready(self, c: Chunk, i: int, p: torch.Tensor) -> None:
        """offload_gradients="backward": move a gradient to the host as soon as backward produced it (adding
        to the one already there within this step) and free it on the device."""
        view, g = c.grad_views[i], local(p.grad)
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
        """One optimizer step over every parameter that has a gradient (see the module docstring): all or
        nothing, on every rank of ``group`` together."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        agreement = self._agreement
        if agreement is not None and agreement.unsettled is not None:
            raise CollectiveError(agreement.unsettled)
        undo = _Undo(self.stats)
        error: BaseException | None = None
        work = None
        try:
            work = self._local_step(undo)
        except BaseException as e:
            undo.rollback(self)
            error = e
        if agreement is not None:  # every rank's outcome, before anything is committed
            agreement.settle(error, functools.partial(undo.rollback, self), "OffloadedOptimizer.step")
        if error is not None:
            raise error
        if work is None:  # no gradient at all (offload_gradients="step"): nothing happened
            return loss
        chunks, stage = work
        self._commit(chunks, stage, undo)
        if self.offload_gradients == "backward":
            for c in chunks:
                c.host_has = [False] * len(c.params)
        return self._finish(loss)

    def _local_step(self, undo: _Undo) -> tuple[list[Chunk], torch.Tensor | None] | None:
        """This rank's update of the masters and the state, logged in ``undo``; the parameters are not written.
        Returns the chunks updated and the device staging buffer, or None where no parameter has a gradient
        (offload_gradients="step")."""
        backward = self.offload_gradients == "backward"
        if backward:  # the gradients are on the host already
            if self._cuda is not None:
                self._d2h.synchronize()
            chunks = [c for c in self._chunks if any(c.host_has)]
        else:
            chunks = [c for c in self._chunks if any(p.grad is not None for p in c.params)]
            if not chunks:
                return None
        for c in chunks:
            c.check_params(c.group)
            if not backward:
                self._check_grads(c)
        if not chunks:
            return [], None
        stage = None
        if self._cuda is not None:  # allocated before anything changes: the commit below allocates nothing
            stage = torch.empty(max(c.master_flat.numel() for c in chunks), dtype=torch.float32, device=self._cuda)
        if backward:
            for c in chunks:
                if c.spare is None:
                    c.spare = torch.empty_like(c.master_flat, pin_memory=False)
            for c in chunks:
                self._update(c, list(c.host_has), c.grad_flat, c.spare, undo)
            return chunks, stage
        bufs = self._gradient_buffers()
        pending = self._gather_grads(chunks[0], bufs[0])
        for i, c in enumerate(chunks):
            has, ev = pending
            if i + 1 < len(chunks):  # double buffering: the next chunk's gradients travel during this update
                pending = self._gather_grads(chunks[i + 1], bufs[(i + 1) % 2])
            if ev is not None:
                ev.synchronize()
            # the chunk's own gradient buffer is free in this mode: it holds the masters' undo copy
            self._update(c, has, bufs[i % 2], c.grad_flat, undo)
        return chunks, stage

    @staticmethod
    def _check_grads(c: Chunk) -> None:
        for p in c.params:
            g = p.grad
            if g is not None and (g.layout != torch.strided or g.shape != p.shape or not g.is_floating_point()):
                raise ArgumentTypeError(
                    f"OffloadedOptimizer.step: a parameter of param group {c.group} {tuple(p.shape)} has a "
                    f"{g.layout} {g.dtype} gradient {tuple(g.shape)}; expected a dense floating-point gradient "
                    "of the parameter's shape (sparse gradients, e.g. nn.Embedding(sparse=True), are not "
                    "supported)"
                )

    def _commit(self, chunks: list[Chunk], stage: torch.Tensor | None, undo: _Undo) -> None:
        """Write the updated masters into the parameters. Past the checks this cannot fail on valid input; if
        it still does (a device error), the state is rolled back and the parameters already written are
        written again from the restored masters (on this rank only: the other ranks committed)."""
        if stage is not None:
            self._h2d.wait_stream(torch.cuda.current_stream(self._cuda))
        done: list[Chunk] = []
        try:
            for c in chunks:
                self._scatter_params(c, stage)
                done.append(c)
        except BaseException:
            undo.rollback(self)
            for c in done:
                self._scatter_params(c, stage)
            undo.restore_stats(self)
            raise
        finally:
            if stage is not None:
                stage.record_stream(self._h2d)

    def _gradient_buffers(self) -> list[torch.Tensor]:
        """Two host buffers of the largest chunk's size (pinned where CUDA is), made on the first step."""
        n = max(c.master_flat.numel() for c in self._chunks)
        if not self._grad_bufs or self._grad_bufs[0].numel() < n:
            pin = self._cuda is not None
            self._grad_bufs = [torch.empty(n, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        return self._grad_bufs

    def _finish(self, loss: Any) -> Any:
        if self._cuda is not None:
            torch.cuda.current_stream(self._cuda).wait_stream(self._h2d)
        self.stats["steps"] += 1
        self.stats["state_bytes"] = self._state_bytes()
        return loss

    # ---------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's format: fp32 state per parameter index (unpacked), plus ``master``. Refused
        (``CollectiveError``) after an agreement across ranks that did not complete (see the module docstring)."""
        if self._agreement is not None and self._agreement.unsettled is not None:
            raise CollectiveError(self._agreement.unsettled)
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict[int, dict[str, Any]] = {}
        for c in self._chunks:
            for p, m in zip(c.params, c.masters):
                s = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.inner.state.get(m, {}).items()}
                s.update(self._unpacked(m, keep=True))
                s["master"] = m.detach().clone()
                if is_dtensor(p):  # sharded like the parameter, so distributed checkpoints save every shard
                    s = {k: like(p, v) for k, v in s.items()}
                state[index[id(p)]] = s
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]  # fmt: skip
        return {"state": state, "param_groups": groups, "offload": {"state_format": self.state_format}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (or from a plain optimizer's state dict). The whole dict is
        validated, and the new state built beside the old one, before anything changes: on any error the
        optimizer is as it was."""
        what = "OffloadedOptimizer.load_state_dict"
        groups, saved_state = check_state_dict(
            state_dict, self.param_groups, self.optimizer_class, self._state_keys, what
        )
        ids = [i for saved in groups for i in saved["params"]]
        position = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        # build everything new first (packing may still fail: fp16 refuses magnitudes past 65504)
        masters: list[tuple[torch.Tensor, torch.Tensor]] = []
        inner: list[tuple[Chunk, torch.Tensor, dict[str, Any]]] = []
        packed: dict[int, dict[str, Packed]] = {}
        outer: dict[torch.Tensor, dict[str, str]] = {}
        saved_packed, self._packed = self._packed, packed  # _pack_state writes into the new mapping
        try:
            for c in self._chunks:
                for p, m in zip(c.params, c.masters):
                    s = dict(saved_state.get(ids[position[id(p)]], {}))
                    master = s.pop("master", None)
                    src = local(master) if master is not None else local(p).detach()
                    masters.append((m, src.detach().to("cpu", torch.float32, copy=True)))
                    if s:  # host copies; tensor state in fp32 (a plain optimizer's may be on the device, in bf16)
                        st = {k: host_state(v) for k, v in s.items()}
                        self._pack_state(m, st)
                        inner.append((c, m, st))
                        outer[p] = {"offloaded": self.state_format}
        finally:
            self._packed = saved_packed
        # commit: nothing below can fail on valid input
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        with torch.no_grad():
            for m, v in masters:
                m.copy_(v)
        for c in self._chunks:
            c.inner.state.clear()
        for c, m, st in inner:
            c.inner.state[m] = st
        self._packed = packed
        self.state.clear()
        self.state.update(outer)
        self.stats["state_bytes"] = self._state_bytes()
        if self._agreement is not None:  # restored from a checkpoint: in step with the other ranks again
            self._agreement.unsettled = None


class _Undo:
    """What a step replaced, to put back if it fails (see the module docstring)."""

    __slots__ = ("groups", "masters", "outer", "states", "stats")

    def __init__(self, stats: dict[str, float]) -> None:
        self.stats = dict(stats)
        self.groups: list[tuple[dict, dict]] = []  # (wrapped optimizer's group, its hyperparameters before)
        self.masters: list[tuple[Chunk, torch.Tensor]] = []  # (chunk, buffer holding its masters before)
        self.states: list[tuple[dict, torch.Tensor, bool, Any, Any]] = []  # (state, master, had, old, old packed)
        self.outer: list[tuple[torch.Tensor, bool, Any]] = []  # (parameter, had, old entry of self.state)

    def rollback(self, opt: OffloadedOptimizer) -> None:
        for state, m, had, old, packed in reversed(self.states):
            if had:
                state[m] = old
            else:
                state.pop(m, None)
            if packed is not None:
                opt._packed[id(m)] = packed
            else:
                opt._packed.pop(id(m), None)
        for p, had, old in reversed(self.outer):
            if had:
                opt.state[p] = old
            else:
                opt.state.pop(p, None)
        for c, backup in self.masters:
            c.master_flat.copy_(backup[: c.master_flat.numel()])
        for c, _ in self.masters:
            for m in c.masters:
                m.grad = None
        for g, before in reversed(self.groups):
            for k in [k for k in g if k != "params" and k not in before]:
                del g[k]
            g.update(before)
        self.restore_stats(opt)

    def restore_stats(self, opt: OffloadedOptimizer) -> None:
        opt.stats.clear()
        opt.stats.update(self.stats)
