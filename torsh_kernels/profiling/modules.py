"""Module spans: a recorder records a model's forward and backward itself (``Recorder(dir, model=net)``).

What is recorded (category ``module``, class compute, args ``{"module": <class name>}``):

- ``forward``: the model's forward, from a forward pre-hook to a forward hook that runs even when forward
  raises (``always_call``), so the span always closes;
- ``forward NAME``: each submodule's forward down to ``depth`` levels (``NAME``: its qualified name);
- ``backward``: the model's backward, from the moment the first gradient with respect to one of its
  outputs is computed (``torch.autograd.graph.register_multi_grad_hook(outputs, mode="any")``, set on the
  outputs of each forward run with gradients enabled) to the end of that backward pass (a callback queued on
  the autograd engine, which runs when the engine has finished the graph, before ``backward()`` returns).
  It covers the gradient computation and whatever runs inside it (DDP's comm hooks, a
  GradientSynchronizer's overlapped buckets, their compression rounds). One span per backward pass, also
  when several forward outputs (micro-batches) meet in one loss.

Submodules' backward is not recorded: a module's backward has no end signal when its inputs need no
gradient, and in graphs that are not chains the backward of two modules interleaves, which spans on one
thread cannot show. The model's outputs are not wrapped (no full backward hooks), so in-place operations on
them behave as without the recorder.

Spans sit on the thread that opens them (forward: the caller; backward: the thread that runs the first
gradient, the caller for CPU tensors) and nest with the spans opened inside them. The hooks exist only
while the recorder is active: ``install()`` at ``start()``, ``remove()`` at ``stop()``, which also closes
any span left open (a stop inside forward).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from .. import recording
from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["ModuleSpans"]


def _grad_tensors(out: object, found: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """The tensors requiring grad in a module's output (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(out, torch.Tensor):
        if out.requires_grad:
            found.append(out)
    elif depth < 4 and isinstance(out, (list, tuple)):
        for x in out:
            _grad_tensors(x, found, depth + 1)
    elif depth < 4 and isinstance(out, dict):
        for x in out.values():
            _grad_tensors(x, found, depth + 1)
    return found


class ModuleSpans:
    """The hooks that record one model's module spans into a recorder (see the module docstring)."""

    def __init__(self, rec, model: nn.Module, *, depth: int = 0) -> None:
        if not isinstance(model, nn.Module):
            raise ArgumentTypeError(f"Recorder.watch: model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise InvalidArgumentError(f"Recorder.watch: depth must be an int >= 0, got {depth!r}")
        self.rec, self.model, self.depth = rec, model, depth
        self._handles: list = []
        self._local = threading.local()  # this thread's open forward spans
        self._open: set = set()  # every open span, to close at remove()
        self._backward: dict[int, object] = {}  # graph task id -> its open backward span
        self._lock = threading.Lock()

    def _modules(self) -> list[tuple[str, nn.Module]]:
        out = [("", self.model)]
        frontier = [("", self.model)]
        for _ in range(self.depth):
            nxt = []
            for prefix, m in frontier:
                for name, child in m.named_children():
                    q = f"{prefix}.{name}" if prefix else name
                    nxt.append((q, child))
            out.extend(nxt)
            frontier = nxt
        return out

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if self._handles:
            return
        for qual, m in self._modules():
            name = f"forward {qual}" if qual else "forward"
            args = {"module": type(m).__name__}
            self._handles.append(m.register_forward_pre_hook(self._pre(name, args)))
            self._handles.append(m.register_forward_hook(self._post(root=not qual), always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._local = threading.local()  # forward spans a post-hook will no longer close
        with self._lock:
            left, self._open = list(self._open), set()
            self._backward.clear()
        for sp in sorted(left, key=lambda sp: -getattr(sp, "t0", 0)):  # innermost first
            sp.__exit__(None, None, None)

    # -- forward -----------------------------------------------------------------------------------------

    def _stack(self) -> list:
        try:
            return self._local.stack
        except AttributeError:
            self._local.stack = []
            return self._local.stack

    def _pre(self, name: str, args: dict):
        def hook(module: nn.Module, inputs: tuple) -> None:
            if recording.recorder is not self.rec:
                self._stack().append(None)  # keep pre/post paired while another recorder (or none) is active
                return
            sp = self.rec.span(name, "module", args)
            sp.__enter__()
            with self._lock:
                self._open.add(sp)
            self._stack().append(sp)

        return hook

    def _post(self, root: bool):
        def hook(module: nn.Module, inputs: tuple, output: object) -> None:
            st = self._stack()
            sp = st.pop() if st else None
            if sp is not None:
                sp.__exit__(None, None, None)
                with self._lock:
                    self._open.discard(sp)
            if root and recording.recorder is self.rec and torch.is_grad_enabled():
                outs = _grad_tensors(output, [])
                if outs:
                    torch.autograd.graph.register_multi_grad_hook(outs, self._backward_starts, mode="any")

        return hook

    # -- backward ----------------------------------------------------------------------------------------

    def _backward_starts(self, grad: object) -> None:
        if recording.recorder is not self.rec:
            return
        task = torch._C._current_graph_task_id()
        with self._lock:
            if task in self._backward:  # one span per backward pass
                return
            sp = self._backward[task] = self.rec.span("backward", "module", {"module": type(self.model).__name__})
            self._open.add(sp)
        sp.__enter__()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_ends(task))

    def _backward_ends(self, task: int) -> None:
        with self._lock:
            sp = self._backward.pop(task, None)
            if sp is None or sp not in self._open:  # closed by remove()
                return
            self._open.discard(sp)
        sp.__exit__(None, None, None)
